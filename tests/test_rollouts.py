"""Rollouts in a training loop: an engine around in-memory weights (`jaxtier.LLM(transformer,
tokenizer=...)`), `update_weights` without recompiling, and the sampled tokens' log-probabilities
as arrays (`rollout_arrays`), each against a fresh engine or a teacher-forced recomputation."""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtier
from jaxtier import checkpoint
from jaxtier.engine import runner
from conftest import fixture_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = fixture_path("tiny_llama")
GREEDY = jaxtier.SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


@functools.lru_cache(maxsize=2)
def _trainer(path: str):
  """A model and tokenizer as a trainer holds them, and a second set of weights for it."""
  model, tokenizer = checkpoint.load_model(path)
  params = nnx.state(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(params))))
  new = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), params)
  return model, tokenizer, params, new


@pytest.fixture(scope="module")
def trainer():
  return _trainer(TINY)


def _with(model, params):
  """A copy of `model` holding `params`."""
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
  nnx.update(copy, params)
  return copy


def _outputs(llm, prompts=PROMPTS, params=GREEDY):
  out = llm.generate(prompts, params)
  prompt_lps = [[None if e is None else [lp.logprob for lp in e.values()][0]
                 for e in o.prompt_logprobs] for o in out]
  return [o.token_ids for o in out], prompt_lps, [o.weights_version for o in out]


def _assert_prompt_logprobs_close(got, want):
  for g, w in zip(got, want):
    assert g[0] is None and w[0] is None
    np.testing.assert_allclose(g[1:], w[1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, engine_args", [
    ("tiny_llama", dict()), ("tiny_llama", dict(offload_tail_layers=1, prefetch_depth=1)),
    ("tiny_mistral", dict(quantization="int8")),  # the CPU kernels' int8 blocks (widths of 32s)
    ("tiny_llama", dict(quantization="int8", kernels="portable")),  # per output channel
    ("tiny_llama", dict(kernels="portable"))],
    ids=["resident", "offloaded", "int8", "int8-portable", "portable"])
def test_updated_weights_give_what_a_fresh_engine_of_them_gives(name, engine_args):
  model, tokenizer, params, new = _trainer(fixture_path(name))
  kwargs = dict(max_model_len=64, max_num_seqs=4) | engine_args
  llm = jaxtier.LLM(model, tokenizer=tokenizer, **kwargs)
  before, _, versions = _outputs(llm)
  assert versions == [0, 0]
  # the same weights, from their files
  assert before == _outputs(jaxtier.LLM(fixture_path(name), **kwargs))[0]
  programs, seconds = len(runner._PROGRAMS), llm.engine.runner.compile_seconds
  assert llm.update_weights(new) == 1
  tokens, prompt_lps, versions = _outputs(llm)
  assert (len(runner._PROGRAMS), llm.engine.runner.compile_seconds) == (programs, seconds)
  fresh_tokens, fresh_lps, _ = _outputs(jaxtier.LLM(_with(model, new), tokenizer=tokenizer,
                                                    **kwargs))
  assert versions == [1, 1] and tokens == fresh_tokens and tokens != before
  _assert_prompt_logprobs_close(prompt_lps, fresh_lps)


def _bytes_by_kind() -> dict[str, int]:
  out: dict[str, int] = {}
  for a in jax.live_arrays():
    kind = a.sharding.memory_kind
    out[kind] = out.get(kind, 0) + a.nbytes
  return out


def test_ten_updates_compile_nothing_and_twenty_hold_no_more_memory(trainer):
  model, tokenizer, params, new = trainer
  llm = jaxtier.LLM(model, tokenizer=tokenizer, max_model_len=64, max_num_seqs=4,
                    offload_tail_layers=1, prefetch_depth=1)
  _outputs(llm)
  seconds, variants = llm.engine.runner.compile_seconds, llm.engine.runner.compiled_variants
  first = None
  for i in range(20):
    llm.update_weights(new if i % 2 == 0 else params)
    _outputs(llm)
    if i == 9:
      assert (llm.engine.runner.compile_seconds, llm.engine.runner.compiled_variants) == (
          seconds, variants)
    if i == 0:
      first = _bytes_by_kind()
  assert llm.weights_version == 20
  after = _bytes_by_kind()
  for kind, size in after.items():  # device and pinned host memory
    assert size <= first.get(kind, 0), (kind, size, first)


def test_a_prefix_cached_before_an_update_is_not_served_after_it(trainer):
  """The prefix's first blocks are on the device, its others pushed to the host tier by a long
  request: without an update both tiers serve it, after one neither does."""
  model, tokenizer, _, new = trainer
  kwargs = dict(max_model_len=160, max_num_seqs=2, num_device_blocks=10, num_host_blocks=12)
  prompt = [[7 + i % 50 for i in range(40)]]  # two full blocks of 16 tokens
  long = [[299 - i for i in range(140)]]
  params = jaxtier.SamplingParams(max_tokens=4, temperature=0)
  for update in (False, True):
    llm = jaxtier.LLM(model, tokenizer=tokenizer, **kwargs)
    llm.generate(prompt, params)
    llm.generate(long, params)
    assert llm.stats()["host_blocks_cached"] > 0
    if update:
      llm.update_weights(new)
      assert llm.stats()["host_blocks_cached"] == llm.stats()["device_blocks_cached"] == 0
    out = llm.generate(prompt, params)[0]
    assert out.num_cached_tokens == (0 if update else 32)
  fresh = jaxtier.LLM(_with(model, new), tokenizer=tokenizer, **kwargs)
  assert out.token_ids == fresh.generate(prompt, params)[0].token_ids


def test_sampled_logprobs_equal_a_teacher_forced_recomputation(trainer):
  model, tokenizer, _, _ = trainer
  llm = jaxtier.LLM(model, tokenizer=tokenizer, max_model_len=64, max_num_seqs=4)
  params = [jaxtier.SamplingParams(max_tokens=12, temperature=0.7, top_p=0.8, seed=s,
                                   logprobs=0) for s in range(4)]
  outs = llm.generate([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, params)
  batch = jaxtier.rollout_arrays(outs)
  assert batch["group"].tolist() == [0, 0, 1, 1]
  logits = np.asarray(model(jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                            _cache(model, batch))[0], np.float64)
  targets = batch["tokens"][:, 1:]
  mask = batch["completion_mask"][:, 1:] > 0
  raw = _log_softmax(logits[:, :-1])
  want_raw = np.take_along_axis(raw, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(batch["token_logprobs"][:, 1:][mask], want_raw[mask], atol=1e-4)
  processed = _log_softmax(_top_p(logits[:, :-1] / 0.7, 0.8))
  want = np.take_along_axis(processed, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(batch["processed_logprobs"][:, 1:][mask], want[mask], atol=1e-4)
  assert np.all(batch["processed_logprobs"][:, 1:][mask] >= want_raw[mask] - 1e-4)


def _cache(model, batch):
  from jaxtier.kvcache import ContiguousKVCache  # pylint: disable=import-outside-toplevel
  c = model.config
  return ContiguousKVCache.create(c.num_layers, batch["tokens"].shape[0],
                                  batch["tokens"].shape[1], c.num_kv_heads, c.head_dim)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  m = np.max(x, -1, keepdims=True)
  return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


def _top_p(x: np.ndarray, p: float) -> np.ndarray:
  """`x` with the tokens outside each position's smallest prefix of mass >= p at -inf."""
  order = np.argsort(-x, -1)
  probs = np.exp(_log_softmax(np.take_along_axis(x, order, -1)))
  keep_sorted = (np.cumsum(probs, -1) - probs) < p
  keep = np.zeros_like(keep_sorted)
  np.put_along_axis(keep, order, keep_sorted, -1)
  return np.where(keep, x, -np.inf)


def test_an_update_waits_for_running_requests_or_aborts_them(trainer):
  model, tokenizer, _, new = trainer
  params = jaxtier.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
  items = [(i, [5 + i, 6, 7], params) for i in range(4)]
  old = {o.request_id: o.token_ids
         for o in jaxtier.LLM(model, tokenizer=tokenizer, max_model_len=64,
                              max_num_seqs=2).generate([p for _, p, _ in items], params)}
  for abort in (False, True):
    llm = jaxtier.LLM(model, tokenizer=tokenizer, max_model_len=64, max_num_seqs=2)
    stream = llm.generate_stream(items)
    first_key, first = next(stream)
    llm.update_weights(new, abort_running=abort)
    rest = dict(stream)
    assert set(rest) == {0, 1, 2, 3} - {first_key} and first.token_ids == old[str(first_key)]
    # every request was live when the update came: all report the old weights, and those that
    # finished give the old weights' tokens (waiting, all of them; aborting, the others end)
    assert {o.weights_version for o in rest.values()} == {0}
    finished = [k for k, o in rest.items() if o.finish_reason == "length"]
    assert all(rest[k].token_ids == old[str(k)] for k in finished)
    assert len(finished) == (3 if not abort else len(finished)) and (not abort or any(
        o.finish_reason == "abort" for o in rest.values()))
    assert llm.generate([[5, 6, 7]], params)[0].weights_version == 1


@pytest.mark.parametrize("change, match", [
    (lambda p: {k: v for k, v in p.items() if k != ("final_norm", "scale")}, "missing.*final_norm"),
    (lambda p: p | {("extra",): np.zeros(3, np.float32)}, "unexpected.*extra"),
    (lambda p: p | {("final_norm", "scale"): np.zeros(5, np.float32)}, "final_norm/scale has shape"),
    (lambda p: p | {("final_norm", "scale"): np.zeros(p[("final_norm", "scale")].shape,
                                                      np.float16)}, "final_norm/scale is float16"),
], ids=["missing", "unknown", "shape", "dtype"])
def test_bad_parameters_are_refused_and_change_nothing(trainer, change, match):
  model, tokenizer, params, _ = trainer
  llm = jaxtier.LLM(model, tokenizer=tokenizer, max_model_len=64, max_num_seqs=4)
  before = _outputs(llm)
  flat = checkpoint.params.flat_params(params)
  with pytest.raises(ValueError, match=match):
    llm.update_weights(change(flat))
  assert _outputs(llm) == before and llm.weights_version == 0


def test_an_in_memory_model_needs_its_tokenizer(trainer):
  model, _, _, _ = trainer
  with pytest.raises(ValueError, match="tokenizer: an in-memory model needs"):
    jaxtier.LLM(model, max_model_len=64)


def test_the_grpo_example_raises_its_reward():
  """examples/grpo_tiny.py: 30 GRPO steps at fixed seeds, the engine generating and `update_weights`
  taking each optax step's weights: the last 5 steps' mean reward well above the first 5's."""
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "grpo_tiny.py"),
                         "--steps=30"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-2000:]
  rewards = [float(r) for r in re.findall(r"mean reward (\S+)", proc.stdout)]
  assert len(rewards) == 30
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.3, rewards


TENSOR_PARALLEL = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from flax import nnx
import jaxtier
from jaxtier import checkpoint
model, tokenizer = checkpoint.load_model(sys.argv[1])
params = nnx.state(model, nnx.Param)
keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(params))))
new = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), params)
greedy = jaxtier.SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1)
first = lambda outs: [[None if e is None else next(iter(e.values())).logprob
                       for e in o.prompt_logprobs] for o in outs]
prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
llm = jaxtier.LLM(model, tokenizer=tokenizer, max_model_len=64, max_num_seqs=4,
                  tensor_parallel_size=2)
before = [o.token_ids for o in llm.generate(prompts, greedy)]
seconds = llm.engine.runner.compile_seconds
llm.update_weights(new)  # arrays on one device: resharded over the two
outs = llm.generate(prompts, greedy)
after, after_lps = [o.token_ids for o in outs], first(outs)
graphdef, state = nnx.split(model)
fresh_model = nnx.merge(graphdef, state)
nnx.update(fresh_model, new)
fresh = jaxtier.LLM(fresh_model, tokenizer=tokenizer, max_model_len=64, max_num_seqs=4,
                    tensor_parallel_size=2)
fresh_outs = fresh.generate(prompts, greedy)
print(json.dumps({"before": before, "after": after, "after_lps": after_lps,
                  "fresh": [o.token_ids for o in fresh_outs], "fresh_lps": first(fresh_outs),
                  "compiled_nothing": llm.engine.runner.compile_seconds == seconds,
                  "devices": len(llm.state["embed"]["embedding"].value.sharding.device_set)}))
"""


def test_an_update_under_tensor_parallelism_equals_a_fresh_engine():
  proc = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL, TINY], capture_output=True,
                        text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["after"] == out["fresh"] and out["after"] != out["before"]
  _assert_prompt_logprobs_close(out["after_lps"], out["fresh_lps"])
  assert out["compiled_nothing"] and out["devices"] == 2
