"""Prefix caching on the engine (tiny fixture), against the contiguous-cache reference driver.

Outputs must not change whether blocks are recomputed, shared on the device, or loaded back from
the host tier, including under device-pool pressure with swapping; the host tier must really load
(not recompute) an evicted prefix, and recompute it instead when the measured rates say so.
"""

import numpy as np
import pytest

from jaxtier import scheduler
from jaxtier.sampling import SamplingParams
from test_engine import GREEDY, SAMPLED, assert_all_free, engine_of, prompts_of, reference, run
from test_engine import tiny  # noqa: F401  (the module fixture)

SYSTEM = prompts_of((14,), seed=7)[0]  # 3 full blocks of 4 tokens, and 2 tokens
MODES = {"off": dict(enable_prefix_caching=False), "device": dict(host_prefix_caching=False),
         "device+host": {}}


def chat_prompts(count: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [SYSTEM + rng.integers(3, 300, size=int(rng.integers(1, 12))).tolist()
          for _ in range(count)]


@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "pressure"])
@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_equal_the_reference_with_prefix_caching_off_device_and_host(tiny, mode,
                                                                            pressure):
  model, tokenizer = tiny
  prompts = chat_prompts(8, seed=1)
  params = [GREEDY, SAMPLED] * 4
  seeds = list(range(8))
  pools = dict(num_device_blocks=14, num_host_blocks=40) if pressure else {}
  engine = engine_of(model, tokenizer, **MODES[mode], **pools)
  out = run(engine, prompts, params, seeds, arrive_every=3)
  assert [out[i].token_ids for i in range(8)] == reference(model, tokenizer, prompts, params,
                                                           seeds)
  stats = engine.stats()
  if mode == "off":
    assert stats["prefix_device_hit_tokens"] == stats["device_blocks_cached"] == 0
  else:
    assert stats["prefix_device_hit_tokens"] > 0
    assert stats["computed_tokens"] < stats["prompt_tokens"] + stats["generated_tokens"]
  if pressure:
    assert stats["preemptions"]["swap"] > 0 and stats["swap_in_count"] > 0
  assert_all_free(engine)
  engine.reset_prefix_cache()
  assert engine.stats()["device_blocks_cached"] == engine.stats()["host_blocks_cached"] == 0


def evict_then_reuse(engine, tokenizer, model):
  """Runs a prompt, then others that push its blocks off the device, then the prompt extended;
  returns the extended prompt's completion and the stats before and after it."""
  prefix = prompts_of((21,), seed=3)[0]  # 5 full blocks
  run(engine, [prefix], GREEDY)
  fillers = prompts_of((30, 30, 30), seed=4)
  for filler in fillers:  # one at a time: each fills most of the device pool
    run(engine, [filler], GREEDY)
  before = engine.stats()
  reused = prefix + [7, 8, 9]
  out = run(engine, [reused], GREEDY)[0]
  assert out.token_ids == reference(model, tokenizer, [reused], GREEDY)[0]
  return out, before, engine.stats()


def test_a_prefix_evicted_to_the_host_is_loaded_back_not_recomputed(tiny):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, num_device_blocks=12, num_host_blocks=24)
  _, before, after = evict_then_reuse(engine, tokenizer, model)
  assert before["prefix_writeback_blocks"] >= 5 and before["prefix_device_evictions"] >= 5
  assert after["prefix_host_hit_tokens"] - before["prefix_host_hit_tokens"] == 20
  assert after["prefix_load_blocks"] - before["prefix_load_blocks"] == 5
  assert after["prefix_load_bytes"] == after["prefix_load_blocks"] * after["block_bytes"]
  # 24 prompt tokens, 20 loaded: 4 computed, then 9 decodes (the last token is never fed back).
  assert after["computed_tokens"] - before["computed_tokens"] == 4 + GREEDY.max_tokens - 1
  assert after["host_blocks_cached"] >= 5 and after["host_blocks_swapped"] == 0
  assert_all_free(engine)


def test_without_the_host_tier_the_evicted_prefix_is_recomputed(tiny):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, num_device_blocks=12, num_host_blocks=24,
                     host_prefix_caching=False)
  _, before, after = evict_then_reuse(engine, tokenizer, model)
  assert after["prefix_writeback_blocks"] == after["prefix_host_hit_tokens"] == 0
  assert after["computed_tokens"] - before["computed_tokens"] == 24 + GREEDY.max_tokens - 1


def test_a_slow_link_makes_the_scheduler_recompute_a_host_hit(tiny, monkeypatch):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, num_device_blocks=12, num_host_blocks=24)
  slow = scheduler.Rates(link_bytes_per_s=1.0, prefill_tokens_per_s=1e6, swap_latency_s=0.0)
  monkeypatch.setattr(engine, "_rates", lambda: slow)
  _, before, after = evict_then_reuse(engine, tokenizer, model)
  assert after["prefix_host_hit_tokens"] == before["prefix_host_hit_tokens"]
  assert after["prefix_host_hit_recomputed_tokens"] - before["prefix_host_hit_recomputed_tokens"] \
      == 20
  assert after["computed_tokens"] - before["computed_tokens"] == 24 + GREEDY.max_tokens - 1


def test_prompt_logprobs_requests_compute_their_whole_prompt(tiny):
  model, tokenizer = tiny
  params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
  prompt = SYSTEM + [5, 6, 7]
  cold = run(engine_of(model, tokenizer, enable_prefix_caching=False), [prompt], params)[0]
  engine = engine_of(model, tokenizer)
  run(engine, [prompt], GREEDY)  # caches the prompt's blocks
  warm = run(engine, [prompt], params)[0]
  assert engine.stats()["prefix_device_hit_tokens"] == 0
  assert warm.token_ids == cold.token_ids
  for got, want in zip(warm.prompt_logprobs[1:], cold.prompt_logprobs[1:]):
    assert got.keys() == want.keys()
    for token in got:
      assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-5)
