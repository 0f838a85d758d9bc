"""The packages export their API and nothing else; the researcher's pieces are documented."""

import importlib
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtier
from jaxtier.kvcache import ContiguousKVCache, PagedKVCache
from conftest import fixture_path

PACKAGES = ("jaxtier", "jaxtier.checkpoint", "jaxtier.kvcache", "jaxtier.offload", "jaxtier.engine",
            "jaxtier.scheduler", "jaxtier.server", "jaxtier.tools", "jaxtier.model",
            "jaxtier.sampling", "jaxtier.attention")


@pytest.mark.parametrize("name", PACKAGES)
def test_packages_export_only_their_api(name):
  package = importlib.import_module(name)
  assert package.__all__ and all(hasattr(package, n) for n in package.__all__)
  for attr in dir(package):
    value = getattr(package, attr)
    if isinstance(value, types.ModuleType):  # only the package's own submodules
      assert value.__name__.startswith(name + "."), f"{name} lists module {attr} ({value.__name__})"
    elif not attr.startswith("_"):
      assert attr in package.__all__, f"{name}.{attr} is not in __all__"


@pytest.mark.parametrize("cls", [ContiguousKVCache, PagedKVCache])
def test_cache_methods_have_docstrings(cls):
  for name, member in inspect.getmembers(cls):
    if not name.startswith("_") and (inspect.isfunction(member) or inspect.ismethod(member)):
      assert inspect.getdoc(member), f"{cls.__name__}.{name} has no docstring"


def test_llm_model_shares_the_engines_arrays_and_runs():
  llm = jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=32, max_num_seqs=2)
  model = llm.model
  assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model)),
                                    jax.tree.leaves(llm.state)))
  ids = llm.tokenizer.encode("The quick brown fox")
  cfg = llm.config
  cache = ContiguousKVCache.create(cfg.num_layers, 1, 32, cfg.num_kv_heads, cfg.head_dim)
  logits, _ = model(jnp.asarray([ids]), jnp.arange(len(ids))[None], cache)
  out = llm.generate([ids], jaxtier.SamplingParams(max_tokens=1, temperature=0))[0]
  assert out.token_ids[0] == int(np.argmax(logits[0, -1]))
