"""`kernels="portable"`: the programs a GPU or TPU runs (scanned layers, XLA attention, float
weights, XLA's argmax), run on this CPU, so every CI run checks the accelerator path's outputs.

References: Hugging Face's logits and greedy tokens (fixtures), the padded reference driver, and
the same engine with a pool large enough never to swap. The compiled programs are read for the
CPU kernels' custom calls: none under "portable", some under "auto" (which shows the check sees
them)."""

import json
import re

import numpy as np
import pytest

import jaxtier
from jaxtier.engine import runner as runner_module
from jaxtier.engine.args import EngineArgs
from jaxtier.kernels.cpu import library as cpu_kernels
from conftest import DEFAULT_MODEL, fixture_path

TINY = fixture_path("tiny_llama")
GREEDY = jaxtier.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [200, 3], [42] * 20]


def custom_calls(llm: jaxtier.LLM) -> set[str]:
  """The custom-call targets of every program the engine of `llm` compiled."""
  layout = llm.engine.runner._layout_id  # pylint: disable=protected-access
  texts = [program.as_text() for key, program in runner_module._PROGRAMS.items()  # pylint: disable=protected-access
           if key[0] == layout]
  return {t for text in texts for t in re.findall(r'custom_call_target="([^"]+)"', text)}


@pytest.fixture(scope="module")
def portable():
  return jaxtier.LLM(TINY, kernels="portable", max_num_seqs=4)


def test_portable_resolves_to_the_accelerator_path(portable):
  plan = portable.sizing
  # keep_quantized: a GGUF file's blocks would stay blocks (in `jaxtier.model.quant`'s layouts)
  assert (plan.kernels, plan.layer_execution, plan.attention_impl, plan.keep_quantized) == (
      "portable", "scan", "xla", True)
  assert portable.engine_config.kernels == "portable"


def test_portable_logits_match_hugging_face(portable):
  ref = np.load(f"{TINY}/hf_logits.npz")
  for name in ("a", "b"):
    ids = ref[f"ids_{name}"]
    model = portable.model
    from jaxtier.kvcache import ContiguousKVCache  # pylint: disable=import-outside-toplevel
    c = model.config
    cache = ContiguousKVCache.create(c.num_layers, 1, len(ids), c.num_kv_heads, c.head_dim)
    logits, _ = model(ids[None], np.arange(len(ids))[None], cache)
    np.testing.assert_allclose(np.asarray(logits[0]), ref[f"logits_{name}"], atol=1e-4, rtol=0)


def test_portable_engine_equals_the_reference_driver_and_runs_no_cpu_kernel(portable):
  outputs = portable.generate(PROMPTS, GREEDY)
  reference = portable.run_batch([portable.make_request(p, GREEDY) for p in PROMPTS])
  assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
  assert not {t for t in custom_calls(portable) if t.startswith("jaxtier_")}
  if cpu_kernels.available():
    auto = jaxtier.LLM(TINY, max_num_seqs=4)
    auto.generate(PROMPTS, GREEDY)
    assert {t for t in custom_calls(auto) if t.startswith("jaxtier_")}


def test_portable_engine_swapping_and_offloaded_gives_the_same_tokens(portable):
  expected = [o.token_ids for o in portable.generate(PROMPTS, GREEDY)]
  tight = jaxtier.LLM(TINY, kernels="portable", max_num_seqs=4, max_model_len=64,
                      block_size=4, num_device_blocks=17, offload_tail_layers=1,
                      preemption_mode="swap")
  assert [o.token_ids for o in tight.generate(PROMPTS, GREEDY)] == expected
  assert tight.stats()["swap_out_count"] > 0
  assert not {t for t in custom_calls(tight) if t.startswith("jaxtier_")}


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention_impl="cpu"), "attention_impl='cpu' is a CPU kernel"),
    (dict(layer_execution="unrolled"), "layer_execution='unrolled' packs layers"),
])
def test_portable_refuses_cpu_only_choices(kwargs, match):
  with pytest.raises(ValueError, match=match):
    EngineArgs(kernels="portable", **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    dict(max_model_len=2048),
    # 10 offloaded layers and a pool of two sequences for 8 prompts: requests swap out and in
    dict(max_model_len=128, offload_tail_layers=10, num_device_blocks=16, max_num_seqs=8,
         preemption_mode="swap"),
], ids=["resident", "offload-swap"])
def test_portable_default_model_gives_hugging_faces_greedy_tokens(kwargs):
  with open(fixture_path("smollm2_hf.json"), encoding="utf-8") as f:
    ref = json.load(f)
  llm = jaxtier.LLM(DEFAULT_MODEL, kernels="portable", **kwargs)
  params = jaxtier.SamplingParams(max_tokens=len(ref["cases"][0]["greedy"]), temperature=0,
                                  ignore_eos=True)
  outputs = llm.generate([c["ids"] for c in ref["cases"]], params)
  assert [list(o.token_ids) for o in outputs] == [c["greedy"] for c in ref["cases"]]
  if "offload_tail_layers" in kwargs:
    assert llm.stats()["swap_out_count"] > 0
  assert not {t for t in custom_calls(llm) if t.startswith("jaxtier_")}


LOWER_FOR_CUDA = """
import sys
import numpy as np
import jaxtier
from jaxtier.engine.step_inputs import GREEDY, StepArrays
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.sampling.samplers import SamplingArrays
from jaxtier.tools import hlo
llm = jaxtier.LLM(sys.argv[1], kernels="portable", max_num_seqs=2, offload_tail_layers=1)
out = llm.generate([[5, 6, 7]], jaxtier.SamplingParams(max_tokens=4, temperature=0))
engine, runner = llm.engine, llm.engine.runner
tokens, last = np.zeros((2, 1), np.int32), np.zeros(2, np.int32)
sampling = SamplingArrays.from_params([GREEDY] * 2, [0] * 2, [0] * 2)
arrays = StepArrays((), (), tokens, tokens, np.zeros((2, 8), np.int32), last, sampling)
args = runner.step_args(engine.cache, arrays)
text = hlo.exported_text(runner._step, *args, platform="cuda")
print(len(out[0].token_ids), "jaxtier_" in text, cpu_kernels._load.cache_info().currsize)
"""


def test_portable_never_builds_or_loads_the_cpu_kernels(tmp_path):
  """With no compiler on PATH and an empty cache, a portable engine loads, generates and lowers
  its decode step (with its sampler) for CUDA without ever trying to build or load the CPU
  kernels."""
  import os, subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
  env.update(PATH=str(tmp_path), JAXTIER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=root,
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", LOWER_FOR_CUDA, TINY], capture_output=True,
                        text=True, env=env, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["4", "False", "0"]
  assert not (tmp_path / "cache" / "kernels").exists()
