"""One link, one budget: the scheduler's link budget from a measured rate, the blocked swap-in
rule, the engine feeding its measured rate to its scheduler, and the overlap figures in
`Engine.stats()` and `/metrics`.

Link rates are the hardware presets' (`jaxtier.offload.hardware`): H100 PCIe and GH200.
"""

import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxtier.engine import link
from jaxtier.offload import hardware
from jaxtier.scheduler import (Arrive, Request, SchedulerConfig, Seq, StepFinished, allocator,
                               apply_event, initial_state, schedule, step)
from jaxtier.scheduler import policies
from test_engine import GREEDY, engine_of, prompts_of, run, tiny  # noqa: F401  (tiny: a fixture)

PRESETS = ("h100-pcie", "gh200")
BLOCK_BYTES = 1 << 20  # a 1 MiB KV block: about an 8B model's 16 tokens in bfloat16
_BASE = dict(num_device_blocks=12, num_host_blocks=32, block_size=4, max_num_seqs=4,
             max_num_batched_tokens=16, watermark=0.0, preemption_mode="swap",
             victim_policy="longest_waiting", host_prefix_caching=True, block_bytes=BLOCK_BYTES)


def _config(preset: str, step_s: float, weight_bytes: int = 0, **overrides) -> SchedulerConfig:
  fields = policies.link_fields(hardware.preset(preset).link_bytes_per_s, step_s, weight_bytes)
  return SchedulerConfig(**{**_BASE, "enable_prefix_caching": False, **fields, **overrides})


def _kv_budget(config: SchedulerConfig) -> float:
  return policies.kv_link_budget(config.link_bytes_per_step, config.kv_link_share)


# The budget rule.

@pytest.mark.parametrize("preset", PRESETS)
def test_budget_is_what_a_step_hides_less_the_weights(preset):
  rate = hardware.preset(preset).link_bytes_per_s
  fields = policies.link_fields(rate, 0.010, weight_bytes_per_step=3 << 20)
  assert fields["link_bytes_per_step"] == math.floor(rate * 0.010)
  assert fields["weight_prefetch_bytes_per_step"] == 3 << 20
  config = _config(preset, 0.010, 3 << 20)
  assert _kv_budget(config) == pytest.approx(math.floor(rate * 0.010) - (3 << 20))
  granted = policies.weight_prefetch_bytes(config.link_bytes_per_step, config.kv_link_share, 0,
                                           config.weight_prefetch_bytes_per_step)
  assert granted == 3 << 20, "with no KV traffic the weights get all they need"


def test_no_rate_or_no_step_time_leaves_the_budget_unlimited():
  for rate, step_s in ((None, 0.01), (50e9, None), (0.0, 0.01)):
    fields = policies.link_fields(rate, step_s, 7)
    assert fields["link_bytes_per_step"] is None and fields["kv_link_share"] == 1.0
    assert fields["weight_prefetch_bytes_per_step"] == 7


def test_weights_larger_than_the_step_leave_kv_nothing():
  fields = policies.link_fields(50e9, 1e-3, weight_bytes_per_step=10**9)
  assert fields["kv_link_share"] == 0.0


def test_budget_step_seconds_prefers_the_plan_then_the_measured_median():
  assert link.budget_step_seconds(link.Tail(10, 0.02), [0.5, 0.6]) == 0.02
  assert link.budget_step_seconds(link.NO_TAIL, [0.3, 0.1, 0.2]) == 0.2
  assert link.budget_step_seconds(link.Tail(10, None), []) is None


# The blocked swap-in rule.

def test_only_the_head_of_the_swapped_queue_blocks():
  assert policies.swap_in_blocks(0, num_running=0, waited_steps=0, max_wait_steps=8)
  assert policies.swap_in_blocks(0, num_running=3, waited_steps=8, max_wait_steps=8)
  assert not policies.swap_in_blocks(0, num_running=3, waited_steps=7, max_wait_steps=8)
  assert not policies.swap_in_blocks(1, num_running=0, waited_steps=100, max_wait_steps=8)


def _state(config, running=(), swapped=(), swap_wait_steps=0):
  """A state whose running (decoding) and swapped requests hold the blocks of their tokens."""
  state = initial_state(config)
  pools = {"running": state.device, "swapped": state.host}
  seqs = {"running": [], "swapped": []}
  for place, requests in (("running", running), ("swapped", swapped)):
    for request in requests:
      count = allocator.blocks_for(request.prompt_len, config.block_size)
      pools[place], (blocks,) = allocator.update(pools[place], allocate=[(request.request_id, count)])
      seqs[place].append(Seq(request, request.request_id, request.prompt_len, 1, blocks))
  return dataclasses.replace(
      state, device=pools["running"], host=pools["swapped"], running=tuple(seqs["running"]),
      swapped=tuple(seqs["swapped"]), next_order=len(running) + len(swapped),
      swap_wait_steps=swap_wait_steps)


def _request(request_id, prompt_len):
  return Request(request_id, prompt_len, 8, arrival_time=float(request_id))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_blocked_swap_in_goes_ahead_of_weight_prefetch(preset):
  rate = hardware.preset(preset).link_bytes_per_s
  weights = math.floor(rate * 1e-4) - BLOCK_BYTES  # room for one block of KV per step
  config = _config(preset, 1e-4, weights)
  state, plan = schedule(_state(config, swapped=[_request(0, 12)]))  # 3 blocks, nothing runs
  assert [s.request_id for s in state.running] == [0]
  assert plan.kv_swap_bytes == 3 * BLOCK_BYTES > _kv_budget(config)
  assert plan.weight_prefetch_bytes == config.link_bytes_per_step - 3 * BLOCK_BYTES < weights


@pytest.mark.parametrize("preset", PRESETS)
def test_a_swap_in_that_blocks_nothing_waits_for_room(preset):
  rate = hardware.preset(preset).link_bytes_per_s
  config = _config(preset, 1e-4, math.floor(rate * 1e-4) - BLOCK_BYTES)
  state, plan = schedule(_state(config, running=[_request(0, 4)], swapped=[_request(1, 12)]))
  assert [s.request_id for s in state.swapped] == [1] and not plan.prefetch
  assert plan.weight_prefetch_bytes == config.weight_prefetch_bytes_per_step
  assert state.swap_wait_steps == 1
  # Once the queue has waited swap_in_max_wait_steps, its head blocks and goes.
  waited = _state(config, running=[_request(0, 4)], swapped=[_request(1, 12)],
                  swap_wait_steps=config.swap_in_max_wait_steps)
  state, plan = schedule(waited)
  assert [s.request_id for s in state.running] == [0, 1] and state.swap_wait_steps == 0


def test_a_prefix_load_loads_what_fits_and_recomputes_the_rest():
  config = _config("gh200", 2 * BLOCK_BYTES / 375e9 + 1e-12, enable_prefix_caching=True,
                   num_device_blocks=4)
  ids = list(range(3, 3 + 13))
  state = initial_state(config)
  state, _ = step(state, [Arrive(Request.of(0, ids, GREEDY, 0, max_tokens=1))])
  for _ in range(2):
    state, _ = step(state, [StepFinished(())])
  # Another prompt fills the device, pushing request 0's blocks to the host tier.
  state, _ = step(state, [StepFinished(()), Arrive(Request.of(1, list(range(40, 56)), GREEDY, 0,
                                                              max_tokens=1))])
  for _ in range(3):
    state, _ = step(state, [StepFinished(())])
  assert state.host_cache.by_hash, "request 0's blocks were written back to the host"
  state, plan = step(state, [StepFinished(()), Arrive(Request.of(2, ids, GREEDY, 0,
                                                                  max_tokens=1))])
  assert plan.cache_loads * BLOCK_BYTES <= _kv_budget(config)
  hits = dict((rid, host) for rid, _, host in plan.hits)
  assert hits.get(2, 0) == plan.cache_loads * config.block_size == 2 * config.block_size
  assert state.counters.host_hit_recomputed_tokens == config.block_size, "the third is recomputed"


# Randomized: no step's plan moves more than the rule allows.

_ARRIVALS = st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 12)),
                     min_size=1, max_size=8)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(preset=st.sampled_from(PRESETS), step_s=st.sampled_from([5e-6, 2e-5, 1e-4]),
       weight_share=st.sampled_from([0.0, 0.5, 0.9]), prefix=st.booleans(), arrivals=_ARRIVALS)
def test_plans_never_move_more_than_the_rule_allows(preset, step_s, weight_share, prefix,
                                                    arrivals):
  rate = hardware.preset(preset).link_bytes_per_s
  config = _config(preset, step_s, math.floor(rate * step_s * weight_share),
                   enable_prefix_caching=prefix, swap_in_max_wait_steps=4)
  budget, link_bytes = _kv_budget(config), config.link_bytes_per_step
  state = initial_state(config)
  pending = sorted(enumerate(arrivals), key=lambda item: item[1][2])
  for number in range(400):
    events = [StepFinished(())] if state.in_flight is not None else []
    events += [Arrive(Request.of(i, [3 + (t % 5) for t in range(n)], GREEDY, 0, max_tokens=m))
               for i, (n, m, at) in pending if at == number]
    before = state
    for event in events:
      before = apply_event(before, event)
    state, plan = schedule(before)
    h2d = (len(plan.swap_in) + len(plan.prefetch)) * BLOCK_BYTES
    if h2d > budget:
      came_in = [s.request_id for s in before.swapped
                 if s.request_id in {r.request_id for r in state.running}]
      assert came_in == [before.swapped[0].request_id] and plan.cache_loads == 0, \
          "only the head of the swapped queue may pass the budget"
      assert policies.swap_in_blocks(0, len(before.running), before.swap_wait_steps,
                                     config.swap_in_max_wait_steps)
    assert plan.weight_prefetch_bytes <= max(link_bytes - plan.kv_swap_bytes, 0)
    if plan.kv_swap_bytes + config.weight_prefetch_bytes_per_step <= link_bytes:
      assert plan.weight_prefetch_bytes == config.weight_prefetch_bytes_per_step
    if not (state.waiting or state.running or state.swapped) and number > max(
        at for _, _, at in arrivals):
      break
  else:
    pytest.fail("the requests did not all finish: a swapped request waited for ever")


# The engine: its measured rate reaches its scheduler, and its stats and /metrics count the link.

RATES = link.LinkRates(h2d_bytes_per_s=2e9, d2h_bytes_per_s=1e9)


@pytest.fixture
def measured(monkeypatch):
  monkeypatch.setattr(link, "measured_rates", lambda: RATES)
  monkeypatch.setattr(link, "budget_applies", lambda platform: True)  # as on an accelerator
  return RATES


def test_the_engine_gives_its_scheduler_the_measured_rate(tiny, measured):  # noqa: F811
  model, tokenizer = tiny
  tail = link.Tail(weight_bytes_per_step=5000, compute_step_s=0.004)
  engine = engine_of(model, tokenizer, tail=tail)
  config = engine.scheduler_config
  assert config.link_bytes_per_step == math.floor(2e9 * 0.004)
  assert config.weight_prefetch_bytes_per_step == 5000
  assert _kv_budget(config) == pytest.approx(math.floor(2e9 * 0.004) - 5000)
  stats = engine.stats()
  assert stats["link_h2d_bytes_per_s"] == 2e9 and stats["link_d2h_bytes_per_s"] == 1e9
  assert stats["link_budget_bytes_per_step"] == config.link_bytes_per_step


def _swapping_engine(tiny, **overrides):  # noqa: F811
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, num_device_blocks=12, max_num_seqs=8,
                     max_num_batched_tokens=64, enable_prefix_caching=False, **overrides)
  run(engine, prompts_of((5, 11, 23, 3, 17, 30), seed=1), GREEDY, arrive_every=0)
  return engine


def test_without_a_tail_the_budget_follows_measured_compute_only_steps(tiny, measured):  # noqa: F811
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer)
  assert engine.scheduler_config.link_bytes_per_step is None, "unlimited until measured"
  run(engine, prompts_of((5, 11), seed=1), GREEDY, arrive_every=0)
  step_s = engine.stats()["link_step_seconds"]
  assert step_s is not None and step_s > 0
  budget = engine.scheduler_config.link_bytes_per_step
  assert abs(budget - math.floor(2e9 * step_s)) <= link.RELINK_TOLERANCE * budget + 1
  assert engine.scheduler_config is engine._state.config  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def swapped_stats(tiny):  # noqa: F811
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(link, "measured_rates", lambda: RATES)
    patch.setattr(link, "budget_applies", lambda platform: True)
    engine = _swapping_engine(tiny, tail=link.Tail(weight_bytes_per_step=1000,
                                                     compute_step_s=1e-6))
    return engine.stats()


def test_stats_count_link_bytes_by_tier_and_their_overlap(swapped_stats):
  stats = swapped_stats
  json.dumps(stats)
  moved = stats["link_bytes"]
  assert set(moved) == set(link.TIERS)
  assert stats["swap_out_count"] > 0
  assert moved["swap_out"] == stats["swap_out_bytes"] > 0
  assert moved["swap_in"] == stats["swap_in_bytes"] > 0
  assert moved["prefix_load"] == moved["prefix_writeback"] == 0
  assert moved["weight_prefetch"] == 1000 * stats["steps"]
  assert stats["link_bytes_per_step"]["swap_in"] == pytest.approx(
      moved["swap_in"] / stats["steps"])
  assert 0 < stats["link_hidden_seconds"] < stats["link_seconds"]
  assert stats["link_hidden_fraction"] == pytest.approx(
      stats["link_hidden_seconds"] / stats["link_seconds"])
  assert stats["link_stall_ms"] == pytest.approx(
      1e3 * (stats["link_seconds"] - stats["link_hidden_seconds"]))
  assert 0 < stats["link_stalled_steps"] <= stats["steps"]  # 1 us of compute hides little


class _Figures:
  """What `_EngineCollector` reads of an `AsyncEngine`, holding fixed figures."""

  def __init__(self, figures):
    self.figures = figures
    self.warmup_progress, self.warmup_error = (0, 0), None

  def stats(self):
    return type("Stats", (), {"engine": self.figures, "ready": True})()


def test_metrics_expose_the_link_figures(swapped_stats):
  from jaxtier.server.prometheus import _EngineCollector  # pylint: disable=g-import-not-at-top
  registry = CollectorRegistry()
  registry.register(_EngineCollector(_Figures(swapped_stats), 0))
  values = {s.name + "".join(f"{{{k}={v}}}" for k, v in s.labels.items()): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples}
  for tier in link.TIERS:
    assert values[f"jaxtier_link_bytes_total{{tier={tier}}}"] == swapped_stats["link_bytes"][tier]
  assert values["jaxtier_link_seconds_total"] == pytest.approx(swapped_stats["link_seconds"])
  assert values["jaxtier_link_stall_seconds_total"] == pytest.approx(
      swapped_stats["link_stall_ms"] / 1e3)
  assert values["jaxtier_link_hidden_fraction"] == pytest.approx(
      swapped_stats["link_hidden_fraction"])
  assert values["jaxtier_link_bytes_per_second{direction=h2d}"] == 2e9
  assert values["jaxtier_link_budget_bytes_per_step"] == swapped_stats["link_budget_bytes_per_step"]
  assert values["jaxtier_link_stalled_steps_total"] == swapped_stats["link_stalled_steps"]


def test_on_a_cpu_the_rates_are_measured_but_schedule_nothing(tiny, monkeypatch):  # noqa: F811
  monkeypatch.setattr(link, "measured_rates", lambda: RATES)
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, tail=link.Tail(weight_bytes_per_step=5000,
                                                      compute_step_s=0.004))
  assert engine.scheduler_config.link_bytes_per_step is None
  assert engine.stats()["link_h2d_bytes_per_s"] == 2e9
