"""The engine on the tiny fixtures, against the contiguous-cache reference driver (`generate.py`).

Every engine output is compared with `generate_batch` on the same prompts and seeds: mixed-length
prompts arriving at different steps, device pools too small for the workload (swap and recompute
preemption, int8 KV), aborts, random workloads (Hypothesis), a model class written here, and the
offloaded tail on the paged cache.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxtier
from conftest import fixture_path
from jaxtier import checkpoint
from jaxtier.engine import step_inputs as batch, link
from jaxtier.engine.engine import Engine, EngineConfig
from jaxtier.kvcache.swap import swap_sizes
from jaxtier.engine.padded import generate_batch
from jaxtier.sampling import SamplingParams
from jaxtier.scheduler import Request

MAX_LEN = 64
PROMPT_LENS = (5, 11, 23, 3, 17, 30)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
  loaded = checkpoint.load(fixture_path("tiny_llama"), "float32")
  return loaded.model, loaded.tokenizer


def prompts_of(lengths, vocab: int = 300, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def engine_of(model, tokenizer, tail=link.NO_TAIL, **overrides) -> Engine:
  config = dict(max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                num_device_blocks=64, num_host_blocks=32, kv_cache_dtype="float32",
                preemption_mode="swap", watermark=0.01, victim_policy="longest_waiting",
                enable_prefix_caching=True, host_prefix_caching=True, trace_path=None,
                attention_impl="auto", kernels="auto", async_scheduling=True, kv_disk_path=None,
                kv_disk_gb=1.0)
  config.update(overrides)
  return Engine(model, tokenizer, EngineConfig(**config), tail=tail)


def run(engine: Engine, prompts, params, seeds=None, arrive_every: int = 1, aborts=None):
  """Adds request i at step i * arrive_every, aborts request j at step aborts[j]; returns the
  completions by request index."""
  params = params if isinstance(params, list) else [params] * len(prompts)
  seeds = seeds or [0] * len(prompts)
  aborts = aborts or {}
  done, step = {}, 0
  while len(done) < len(prompts):
    for i in range(len(prompts)):
      if i * arrive_every == step:
        engine.add_request(i, prompts[i], params[i], seeds[i])
    for j, at in aborts.items():
      if at == step:
        update = engine.abort(j)
        if update is not None:
          done[j] = update.completion
    for update in engine.step():
      if update.completion is not None:
        done[update.request_id] = update.completion
    step += 1
    assert step < 2000, "the engine made no progress"
  return done


def reference(model, tokenizer, prompts, params, seeds=None) -> list[tuple[int, ...]]:
  """Token ids from the contiguous-cache driver, all prompts as one padded batch."""
  params = params if isinstance(params, list) else [params] * len(prompts)
  seeds = seeds or [0] * len(prompts)
  graphdef, state = nnx.split(model)
  requests = [Request.of(i, p, q, s) for i, (p, q, s) in enumerate(zip(prompts, params, seeds))]
  return [c.token_ids for c in generate_batch(graphdef, state, tokenizer, requests, MAX_LEN,
                                              np.float32)]


def assert_variants_are_warmed(engine: Engine):
  """Every program the engine ran is one `Engine.warmup` compiles: the shapes `step_shapes`
  lists for its configuration (sampling folded in), and swaps of a listed count within the
  pools."""
  c = engine.config
  shapes = set(batch.step_shapes(c.max_num_seqs, c.max_num_batched_tokens, engine.table_width))
  most = min(c.num_device_blocks, c.num_host_blocks)
  swaps = [x for x in swap_sizes() if x <= most] if c.num_host_blocks else []
  warmed = ({("step",) + shape for shape in shapes}
            | {("swap", d, x) for d in ("out", "in") for x in swaps})
  assert set(engine.runner.variants()) <= warmed


def assert_all_free(engine: Engine):
  stats = engine.stats()
  assert stats["device_blocks_free"] == stats["device_blocks_total"]
  assert stats["host_blocks_free"] == stats["host_blocks_total"]
  assert stats["running"] == stats["waiting"] == stats["swapped"] == 0


def test_staggered_mixed_prompts_equal_the_contiguous_reference(tiny):
  model, tokenizer = tiny
  prompts = prompts_of(PROMPT_LENS)
  engine = engine_of(model, tokenizer)
  out = run(engine, prompts, GREEDY, arrive_every=2)
  assert [out[i].token_ids for i in range(len(prompts))] == reference(model, tokenizer, prompts,
                                                                       GREEDY)
  assert all(out[i].finish_reason == "length" for i in out)
  stats = engine.stats()
  assert stats["requests_finished"] == len(prompts) and stats["compiled_variants"] > 0
  assert stats["generated_tokens"] == len(prompts) * GREEDY.max_tokens
  assert_all_free(engine)


@pytest.mark.parametrize("lengths,call_slots,num_calls", [
    # 8-token rows: the four prompts arriving together are 10 rows, so the step runs 8 rows in
    # one call and two chunk ends in a second that reads what the first wrote.
    ((30, 21, 12, 3), batch.CALL_SLOTS, 2),
    # 15 rows with calls counted free: calls of 8, 4, 2 and 1 rows, a chunk's pieces spread
    # over up to three of them.
    ((30, 21, 12, 3, 40), 0, 4)])
def test_a_prefill_split_into_calls_equals_the_contiguous_reference(tiny, monkeypatch, lengths,
                                                                    call_slots, num_calls):
  model, tokenizer = tiny
  split, original = [], batch.prefill_calls

  def prefill_calls(plan, most_rows):  # 8-token rows: up to 16 of them in a call
    calls = original(plan, 16, row_tokens=8)
    split.append(len(calls))
    return calls

  monkeypatch.setattr(batch, "prefill_calls", prefill_calls)
  monkeypatch.setattr(batch, "CALL_SLOTS", call_slots)
  prompts = prompts_of(lengths)
  engine = engine_of(model, tokenizer, max_num_batched_tokens=64 * (len(lengths) - 2),
                     max_num_seqs=len(lengths))
  out = run(engine, prompts, GREEDY, arrive_every=0)
  assert split[0] == num_calls
  assert [out[i].token_ids for i in range(len(prompts))] == reference(model, tokenizer, prompts,
                                                                       GREEDY)
  assert_all_free(engine)


def test_qwen2_fixture_equals_the_reference():
  loaded = checkpoint.load(fixture_path("tiny_qwen2"), "float32")
  prompts = prompts_of((4, 19, 9), vocab=loaded.model.config.vocab_size)
  out = run(engine_of(loaded.model, loaded.tokenizer), prompts, GREEDY)
  assert [out[i].token_ids for i in range(3)] == reference(loaded.model, loaded.tokenizer,
                                                           prompts, GREEDY)


WIDE = dict(max_num_seqs=8, max_num_batched_tokens=64)  # every request runs at once when it fits


def peak_blocks(model, tokenizer, prompts, params) -> int:
  engine = engine_of(model, tokenizer, **WIDE)
  run(engine, prompts, params, arrive_every=0)
  return engine.stats()["device_blocks_peak_used"]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_quarter_pool_preempts_and_keeps_every_token(tiny, mode):
  model, tokenizer = tiny
  prompts = prompts_of(PROMPT_LENS, seed=1)
  params = [GREEDY if i % 2 else SAMPLED for i in range(len(prompts))]
  seeds = list(range(100, 100 + len(prompts)))
  peak = peak_blocks(model, tokenizer, prompts, params)
  need = max(math.ceil((len(p) + 9) / 4) for p in prompts)  # one request alone must fit
  pool = max(math.ceil(peak / 4), need)
  assert pool <= math.ceil(peak / 4)
  engine = engine_of(model, tokenizer, num_device_blocks=pool, preemption_mode=mode, **WIDE)
  out = run(engine, prompts, params, seeds, arrive_every=0)
  assert [out[i].token_ids for i in range(len(prompts))] == reference(model, tokenizer, prompts,
                                                                       params, seeds)
  stats = engine.stats()
  assert stats["preemptions"][mode] > 0
  if mode == "swap":
    assert stats["swap_out_count"] > 0 and stats["swap_in_count"] == stats["swap_out_count"]
    assert stats["swap_out_bytes"] == stats["swap_out_blocks"] * stats["block_bytes"] > 0
  else:
    assert stats["swap_out_count"] == 0
  assert_all_free(engine)
  assert_variants_are_warmed(engine)


def test_int8_kv_under_pressure_equals_int8_unconstrained(tiny):
  model, tokenizer = tiny
  prompts = prompts_of(PROMPT_LENS, seed=2)
  free = run(engine_of(model, tokenizer, kv_cache_dtype="int8"), prompts, GREEDY)
  engine = engine_of(model, tokenizer, kv_cache_dtype="int8", num_device_blocks=12)
  tight = run(engine, prompts, GREEDY)
  assert [tight[i].token_ids for i in tight] == [free[i].token_ids for i in tight]
  assert engine.stats()["swap_out_count"] > 0
  assert_all_free(engine)


def test_abort_mid_generation_frees_blocks_at_once(tiny):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer)
  engine.add_request("a", prompts_of((20,))[0], GREEDY, 0)
  for _ in range(3):
    engine.step()
  held = engine.stats()
  assert held["device_blocks_free"] < held["device_blocks_total"]
  update = engine.abort("a")
  assert update.completion.finish_reason == "abort" and len(update.completion.token_ids) >= 1
  assert_all_free(engine)
  assert engine.abort("a") is None and not engine.has_unfinished()
  assert engine.stats()["requests_aborted"] == {"client_abort": 1}


def test_planning_ahead_keeps_tokens_stops_and_blocks(tiny):
  """Decode steps planned and dispatched before the previous step's tokens are read: requests
  that stop on a stop token (ended while their next row is in flight), reach max_tokens, are
  aborted with a plan in flight, or reuse a just-stopped request's id all get the tokens the
  engine gives without planning ahead, and every block is free at the end."""
  model, tokenizer = tiny
  prompts = prompts_of((9, 14, 5, 21))
  free = reference(model, tokenizer, prompts, SamplingParams(max_tokens=12, temperature=0,
                                                             ignore_eos=True))
  # each request stops on the token it would generate 3rd, 5th, ... (a stop token id)
  params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[free[i][2 + 2 * i]])
            if i < 3 else SamplingParams(max_tokens=7, temperature=0.8, ignore_eos=True)
            for i in range(len(prompts))]

  def drive(async_scheduling):
    engine = engine_of(model, tokenizer, async_scheduling=async_scheduling)
    for i, prompt in enumerate(prompts):
      engine.add_request(i, prompt, params[i], seed=i)
    done, step, streamed = {}, 0, {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
      for update in engine.step():
        key = update.request_id if update.request_id not in done else "again"
        streamed[key] += update.new_token_ids
        if update.completion is not None:
          done[key] = update.completion
          if key == 0:  # its id reused at once, while its next row may be in flight
            engine.add_request(0, prompts[1], params[3], seed=5)
            streamed["again"] = []
      step += 1
      if step == 4:
        update = engine.abort(3)
        done[3] = update.completion
        streamed[3] += update.new_token_ids
      assert step < 200
    assert_all_free(engine)
    assert all(list(done[i].token_ids) == streamed[i] for i in done)
    return {i: (c.token_ids, c.finish_reason) for i, c in done.items()}, engine.stats()

  ahead, stats = drive(True)
  plain, plain_stats = drive(False)
  assert ahead == plain
  assert stats["steps_planned_ahead"] > 0 and plain_stats["steps_planned_ahead"] == 0
  assert [ahead[i][1] for i in range(3)] == ["stop"] * 3 and ahead[3][1] == "abort"
  # the stopped requests' tokens are the contiguous driver's with the same parameters
  assert [ahead[i][0] for i in range(3)] == reference(model, tokenizer, prompts[:3], params[:3])
  assert max(len(ahead[i][0]) for i in range(3)) > 2  # one stopped after steps planned ahead
  assert stats["requests_finished"] == plain_stats["requests_finished"] == 4
  assert stats["finished_by_reason"] == plain_stats["finished_by_reason"]


def test_reset_prefix_cache_with_a_plan_in_flight_keeps_its_tokens(tiny):
  model, tokenizer = tiny
  prompt = prompts_of((13,))[0]
  engine = engine_of(model, tokenizer)
  engine.add_request("a", prompt, GREEDY, 0)
  tokens = []
  for _ in range(4):
    tokens += [t for u in engine.step() for t in u.new_token_ids]
  assert engine.stats()["steps_planned_ahead"] > 0
  engine.reset_prefix_cache()  # the plan in flight is read first; its token comes next
  while engine.has_unfinished():
    tokens += [t for u in engine.step() for t in u.new_token_ids]
  assert tuple(tokens) == reference(model, tokenizer, [prompt], GREEDY)[0]
  assert_all_free(engine)


def test_a_failing_step_ends_its_requests_and_the_engine_keeps_serving(tiny, monkeypatch):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, num_device_blocks=12)
  prompts = prompts_of(PROMPT_LENS)
  for i, prompt in enumerate(prompts):
    engine.add_request(i, prompt, GREEDY, 0)
  for _ in range(6):
    engine.step()
  real_step = engine.runner.step

  def failing(cache, arrays):
    jax.tree.map(lambda a: a.delete(), cache)  # as if the program had consumed the pools
    raise RuntimeError("injected failure")

  monkeypatch.setattr(engine.runner, "step", failing)
  with pytest.raises(RuntimeError, match="injected failure"):
    engine.step()
  assert not engine.has_unfinished()
  assert_all_free(engine)
  monkeypatch.setattr(engine.runner, "step", real_step)
  out = run(engine, prompts[:2], GREEDY)
  assert [out[i].token_ids for i in range(2)] == reference(model, tokenizer, prompts[:2], GREEDY)


def test_seeded_tokens_do_not_depend_on_the_batch(tiny):
  model, tokenizer = tiny
  prompts = prompts_of((7, 12, 25, 4))
  alone = run(engine_of(model, tokenizer), prompts[:1], SAMPLED, seeds=[42])[0].token_ids
  crowded = run(engine_of(model, tokenizer, num_device_blocks=12), prompts, SAMPLED,
                seeds=[42, 1, 2, 3], arrive_every=0)
  assert crowded[0].token_ids == alone
  other_seed = run(engine_of(model, tokenizer), prompts[:1], SAMPLED, seeds=[43])[0].token_ids
  assert other_seed != alone


def test_bad_requests_are_named(tiny):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer)
  with pytest.raises(ValueError, match="empty prompt"):
    engine.add_request("e", [], GREEDY, 0)
  with pytest.raises(ValueError, match=r"token ids outside \[0, 300\)"):
    engine.add_request("v", [1, 300], GREEDY, 0)
  with pytest.raises(ValueError, match="max_model_len is 64"):
    engine.add_request("l", [1] * 64, GREEDY, 0)
  engine.add_request("d", [1, 2], GREEDY, 0)
  with pytest.raises(ValueError, match="already running"):
    engine.add_request("d", [1, 2], GREEDY, 0)
  engine.abort("d")
  assert_all_free(engine)


def test_trace_has_one_line_per_step(tiny, tmp_path):
  model, tokenizer = tiny
  path = tmp_path / "trace.jsonl"
  engine = engine_of(model, tokenizer, num_device_blocks=12, trace_path=str(path))
  run(engine, prompts_of(PROMPT_LENS), GREEDY)
  engine.close()
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  stats = engine.stats()
  assert len(rows) == stats["steps"]
  assert sum(r["swap_out_blocks"] for r in rows) == stats["swap_out_blocks"]
  assert sum(r["decode_tokens"] + r["prefill_tokens"] for r in rows) == stats["computed_tokens"]
  assert max(r["device_blocks_used"] for r in rows) == stats["device_blocks_peak_used"]


class TinyAttentionModel(nnx.Module):
  """A research model that is not jaxtier's Transformer: embedding, one attention block over the
  engine's cache (no rotary, no MLP), and a separate head."""

  class Config:
    num_layers, num_kv_heads, head_dim, vocab_size, num_heads = 1, 1, 8, 300, 2
    max_position_embeddings = MAX_LEN

  def __init__(self, rngs: nnx.Rngs):
    c = self.config = self.Config()
    self.embed = nnx.Embed(c.vocab_size, 16, rngs=rngs)
    self.q = nnx.Linear(16, c.num_heads * c.head_dim, rngs=rngs)
    self.kv = nnx.Linear(16, 2 * c.head_dim, rngs=rngs)
    self.out = nnx.Linear(c.num_heads * c.head_dim, 16, rngs=rngs)
    self.head = nnx.Linear(16, c.vocab_size, rngs=rngs)

  def hidden_states(self, tokens_bt, pos_bt, cache, meta=None):
    b, t = tokens_bt.shape
    x = self.embed(tokens_bt) + 0.01 * pos_bt[..., None]
    q = self.q(x).reshape(b, t, 2, 8)
    k, v = jnp.split(self.kv(x).reshape(b, t, 2, 8), 2, axis=2)
    cache, attn = cache.update_and_attend(np.int32(0), q, k, v, pos_bt, meta)
    return x + self.out(attn.reshape(b, t, 16)), cache

  def logits(self, h):
    return self.head(h)


def test_distinct_norm_scales_per_layer_equal_the_reference(tiny):
  """Norm scales of every layer made distinct (the fixture's are all ones, so a leaf passed to
  the wrong layer would go unseen): the engine equals the driver."""
  model, tokenizer = tiny
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(1)
  state = jax.tree.map(lambda x: x * jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
                       if x.ndim >= 1 and x.size <= 1024 and x.dtype == jnp.float32 else x, state)
  model = nnx.merge(graphdef, state)
  prompts = prompts_of(PROMPT_LENS[:3])
  engine = engine_of(model, tokenizer)
  done = run(engine, prompts, GREEDY)
  expected = reference(model, tokenizer, prompts, GREEDY)
  assert [done[i].token_ids for i in range(len(prompts))] == expected
  assert expected != reference(tiny[0], tokenizer, prompts, GREEDY)  # the scales matter


def test_a_model_class_of_its_own_runs_on_the_engine(tiny):
  _, tokenizer = tiny
  model = TinyAttentionModel(nnx.Rngs(0))
  prompts = prompts_of((6, 13, 2))
  out = run(engine_of(model, tokenizer), prompts, GREEDY, arrive_every=3)
  assert [out[i].token_ids for i in range(3)] == reference(model, tokenizer, prompts, GREEDY)


def test_offloaded_tail_on_the_paged_cache_equals_resident():
  kwargs = dict(max_model_len=MAX_LEN, block_size=4, num_device_blocks=16, max_num_seqs=4,
                max_num_batched_tokens=32, layer_execution="scan")
  resident = jaxtier.LLM(fixture_path("tiny_llama"), **kwargs)
  offloaded = jaxtier.LLM(fixture_path("tiny_llama"), offload_tail_layers=2, prefetch_depth=1,
                          **kwargs)
  assert offloaded.memory_report()["host_weight_bytes"] > 0
  prompts = prompts_of(PROMPT_LENS[:4], seed=3)
  assert ([o.token_ids for o in offloaded.generate(prompts, GREEDY)]
          == [o.token_ids for o in resident.generate(prompts, GREEDY)])
  stats = offloaded.stats()
  assert stats["swap_out_count"] > 0
  assert f"swap_count={stats['swap_out_count'] + stats['swap_in_count']}" in offloaded.doctor()
  report = offloaded.memory_report()
  assert report["device_kv_blocks"] == 16 and report["host_kv_blocks"] == 16
  assert report["device_kv_bytes"] == 16 * stats["block_bytes"] == report["host_kv_bytes"]


_HYPOTHESIS = settings(
    max_examples=40 if os.environ.get("JAXTIER_HYPOTHESIS_PROFILE") == "ci" else 8,
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                          HealthCheck.too_slow], derandomize=True)


@_HYPOTHESIS
@given(data=st.data())
def test_random_workloads_equal_the_reference_and_free_every_block(tiny, data):
  model, tokenizer = tiny
  n = data.draw(st.integers(1, 6), label="requests")
  lengths = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n), label="prompt lens")
  prompts = prompts_of(lengths, seed=data.draw(st.integers(0, 3), label="prompt seed"))
  params = [data.draw(st.sampled_from([GREEDY, SAMPLED]), label="params") for _ in range(n)]
  seeds = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n), label="seeds")
  aborts = data.draw(st.dictionaries(st.integers(0, n - 1), st.integers(0, 12), max_size=2),
                     label="aborts")
  engine = engine_of(model, tokenizer, num_device_blocks=data.draw(st.sampled_from([14, 64])),
                     num_host_blocks=data.draw(st.sampled_from([0, 32])),
                     preemption_mode=data.draw(st.sampled_from(["swap", "recompute"])))
  out = run(engine, prompts, params, seeds, arrive_every=data.draw(st.integers(0, 3)),
            aborts=aborts)
  expected = reference(model, tokenizer, prompts, params, seeds)
  for i in range(n):
    if out[i].finish_reason == "abort":
      assert expected[i][:len(out[i].token_ids)] == out[i].token_ids
    else:
      assert out[i].token_ids == expected[i]
  assert_all_free(engine)
  assert_variants_are_warmed(engine)


def test_swap_timer_thread_starts_at_the_first_swap_and_ends_with_its_timer():
  """An engine that never swaps starts no thread, and a collected timer's thread ends: a process
  that builds many engines (a test run, a notebook) does not collect one idle thread per engine."""
  import gc, threading  # pylint: disable=import-outside-toplevel,multiple-imports
  from jaxtier.engine.runner import SwapTimer  # pylint: disable=import-outside-toplevel
  timer = SwapTimer()
  assert timer._thread is None  # pylint: disable=protected-access
  timer.submit("out", jnp.zeros(()), 0.0, blocks=3)
  timer.drain()
  assert timer.blocks["out"] == 3 and timer.seconds["out"] > 0
  thread = timer._thread  # pylint: disable=protected-access
  assert thread.is_alive()
  del timer
  gc.collect()
  thread.join(timeout=10)
  assert not thread.is_alive()
  assert threading.active_count() < 100


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux memory mappings")
def test_release_programs_gives_back_the_executables_memory_mappings():
  """`runner.release_programs` frees what the compiled programs hold: the memory mappings an
  engine's executables took come back, and the engine still runs (compiling again)."""
  from jaxtier.engine import runner  # pylint: disable=import-outside-toplevel

  def mappings():
    with open("/proc/self/maps", encoding="ascii") as f:
      return sum(1 for _ in f)
  runner.release_programs()
  before = mappings()
  llm = jaxtier.LLM(fixture_path("tiny_llama"), max_num_seqs=2, max_model_len=48, seed=11)
  first = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
  built = mappings()
  runner.release_programs()
  released = mappings()
  assert built - before > 50 and released - before < (built - before) / 4
  assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == first
