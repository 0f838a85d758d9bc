"""Unit tests of the scheduler: each policy's choice on hand-made states, events, validation."""

import ast
import dataclasses
import pathlib
import subprocess
import sys

import pytest

from jaxtier.scheduler import (Abort, Arrive, Request, SchedulerConfig, Seq, StepFinished, Stop,
                               allocator, apply_event, initial_state, metrics, schedule, step)
from jaxtier.scheduler import policies
from jaxtier.scheduler.request import (ABORT_CLIENT, ABORT_HOST_FULL, ABORT_TOO_LARGE, ABORTED,
                                       FINISH_LENGTH, FINISHED)

_BASE = dict(num_device_blocks=8, num_host_blocks=16, block_size=4, max_num_seqs=4,
             max_num_batched_tokens=16, watermark=0.0, preemption_mode="swap",
             victim_policy="longest_waiting", enable_prefix_caching=False, host_prefix_caching=True)


def _config(**overrides):
  return SchedulerConfig(**{**_BASE, **overrides})


def _request(request_id, prompt_len, max_tokens=8, **kwargs):
  return Request(request_id, prompt_len, max_tokens, arrival_time=float(request_id), **kwargs)


def _state(config, running=(), swapped=(), waiting=()):
  """A state whose running and swapped requests hold just the blocks for their computed tokens.

  Each entry is (request, num_computed, num_generated); integer request ids give the arrival order.
  """
  state = initial_state(config)
  pools = {"running": state.device, "swapped": state.host}
  seqs = {"running": [], "swapped": []}
  for place, specs in (("running", running), ("swapped", swapped)):
    for request, computed, generated in specs:
      count = allocator.blocks_for(computed, config.block_size)
      pools[place], (blocks,) = allocator.update(pools[place], allocate=[(request.request_id, count)])
      seqs[place].append(Seq(request, request.request_id, computed, generated, blocks))
  queue = tuple(Seq(r, r.request_id, 0, 0, ()) for r in waiting)
  ids = [r.request_id for r, *_ in list(running) + list(swapped)] + [r.request_id for r in waiting]
  return dataclasses.replace(
      state, device=pools["running"], host=pools["swapped"], running=tuple(seqs["running"]),
      swapped=tuple(seqs["swapped"]), waiting=queue, next_order=1 + max(ids, default=-1))


def _decoding(request, generated=1):
  """A running spec for `request` that has computed its prompt and `generated - 1` tokens."""
  return (request, request.prompt_len + generated - 1, generated)


def _ids(seqs):
  return [seq.request_id for seq in seqs]


# Victim policies on hand-made sequences.

def _seq(order, arrival, generated, max_tokens, predicted=None, priority=0):
  request = Request(order, 4, max_tokens, arrival, priority, predicted)
  return Seq(request, order, 4, generated, ())


def test_longest_waiting_picks_the_earliest_arrival():
  running = [_seq(0, 5.0, 1, 10), _seq(1, 2.0, 1, 10), _seq(2, 9.0, 1, 10)]
  assert policies.choose_victim(running, policies.longest_waiting) == 1


def test_closest_to_finish_picks_fewest_tokens_left():
  running = [_seq(0, 0.0, 2, 10), _seq(1, 1.0, 8, 10), _seq(2, 2.0, 1, 4)]
  assert policies.choose_victim(running, policies.closest_to_finish) == 1


def test_closest_to_finish_breaks_ties_by_newest():
  running = [_seq(0, 0.0, 2, 10), _seq(1, 1.0, 2, 10)]
  assert policies.choose_victim(running, policies.closest_to_finish) == 1


def test_shortest_predicted_remaining_uses_predictions():
  running = [_seq(0, 0.0, 2, 100, predicted=50), _seq(1, 1.0, 2, 100, predicted=5),
             _seq(2, 2.0, 2, 100)]
  assert policies.choose_victim(running, policies.shortest_predicted_remaining) == 1


def test_victims_come_from_the_least_urgent_priority_first():
  running = [_seq(0, 0.0, 1, 10, priority=0), _seq(1, 5.0, 1, 10, priority=2)]
  assert policies.choose_victim(running, policies.longest_waiting) == 1


@pytest.mark.parametrize("policy, victim", [
    ("longest_waiting", 0), ("closest_to_finish", 1), ("shortest_predicted_remaining", 0)])
def test_watermark_swaps_out_the_policys_victim(policy, victim):
  # Both decode into a new block: 1 free block cannot hold 2 more and keep 1 free.
  config = _config(watermark=1 / 8, victim_policy=policy)
  r0 = _request(0, 12, max_tokens=8, predicted_output_len=2)
  r1 = _request(1, 16, max_tokens=2, predicted_output_len=8)
  state = _state(config, running=[_decoding(r0), _decoding(r1)])
  assert state.device.num_free == 1
  state, plan = schedule(state)
  (victim_seq,) = state.swapped
  assert victim_seq.request_id == victim and plan.preempted == ((victim, "swap"),)
  before = _state(config, running=[_decoding(r0), _decoding(r1)])
  old_blocks = next(s.blocks for s in before.running if s.request_id == victim)
  assert plan.swap_out == tuple(zip(old_blocks, victim_seq.blocks))
  (survivor,) = state.running
  assert plan.decode.request_ids == (survivor.request_id,)
  assert plan.decode.block_tables == (survivor.blocks,)
  assert state.device.num_free >= 1


def test_a_request_running_alone_is_never_preempted():
  config = _config(watermark=3 / 8)
  request = _request(0, 28, max_tokens=4)
  state, plan = schedule(_state(config, running=[_decoding(request)]))
  assert plan.decode.request_ids == (0,) and not plan.swap_out
  assert state.device.num_free == 0


# Admission.

def test_admission_needs_the_first_chunk_above_the_watermark():
  config = _config(watermark=2 / 8)
  running = _decoding(_request(0, 15))  # 4 blocks, the next token fits in the last one
  fits, too_big = _request(1, 8), _request(2, 12)
  state, plan = schedule(_state(config, running=[running], waiting=[fits, too_big]))
  assert _ids(state.running) == [0, 1] and _ids(state.waiting) == [2]
  assert plan.prefill.request_ids == (1,) and plan.prefill.ends == (8,)


def test_admission_keeps_queue_order():
  config = _config(watermark=2 / 8)
  running = _decoding(_request(0, 15))
  too_big, small = _request(1, 12), _request(2, 4)
  state, _ = schedule(_state(config, running=[running], waiting=[too_big, small]))
  assert _ids(state.waiting) == [1, 2], "a smaller request must not overtake a waiting one"


def test_nothing_running_admits_a_request_below_the_watermark():
  config = _config(watermark=4 / 8, max_num_batched_tokens=32)
  state, plan = schedule(_state(config, waiting=[_request(0, 24)]))
  assert plan.prefill.ends == (24,) and state.device.num_free == 2


def test_request_that_could_never_fit_is_rejected_at_arrival():
  config = _config()
  state = apply_event(initial_state(config), Arrive(_request(0, 30, max_tokens=4)))
  assert not state.waiting
  (ended,) = state.ended
  assert (ended.status, ended.reason) == (ABORTED, ABORT_TOO_LARGE)
  assert "needs 9 KV blocks" in ended.detail and "at most 8" in ended.detail
  assert metrics(state).aborted == ((ABORT_TOO_LARGE, 1),)


def test_per_request_cap_rejects_below_the_pool_size():
  config = _config(max_blocks_per_request=2)
  state = apply_event(initial_state(config), Arrive(_request(0, 8, max_tokens=2)))
  assert state.ended[0].reason == ABORT_TOO_LARGE
  state = apply_event(state, Arrive(_request(1, 8, max_tokens=1)))
  assert _ids(state.waiting) == [1]


def test_kv_grows_block_by_block():
  config = _config(max_num_batched_tokens=16)
  state, _ = step(initial_state(config), [Arrive(_request(0, 5, max_tokens=20))])
  assert len(state.running[0].blocks) == 2, "blocks for the prompt only, not for max_tokens"


def test_chunked_prefill_under_the_token_budget():
  config = _config(max_num_seqs=2, max_num_batched_tokens=8)
  state, plan = step(initial_state(config), [Arrive(_request(0, 20, max_tokens=2))])
  chunks = [(plan.prefill.starts, plan.prefill.ends, plan.prefill.samples)]
  for _ in range(2):
    state, plan = step(state, [StepFinished()])
    chunks.append((plan.prefill.starts, plan.prefill.ends, plan.prefill.samples))
  assert chunks == [((0,), (8,), (False,)), ((8,), (16,), (False,)), ((16,), (20,), (True,))]
  state, plan = step(state, [StepFinished()])
  assert plan.decode.request_ids == (0,) and plan.decode.starts == (20,)


# Swap-in.

@pytest.mark.parametrize("prefetch", [True, False])
def test_swap_in_prefetches_one_step_early(prefetch):
  config = _config(prefetch_swap_in=prefetch)
  request = _request(0, 8)
  state = _state(config, swapped=[_decoding(request)])
  host_blocks = state.swapped[0].blocks
  state, plan = schedule(state)
  (seq,) = state.running
  copies = plan.prefetch if prefetch else plan.swap_in
  assert copies == tuple(zip(host_blocks, seq.blocks)) and not (plan.prefetch and plan.swap_in)
  assert plan.decode.request_ids == (() if prefetch else (0,))
  assert state.host.num_free == config.num_host_blocks
  if prefetch:
    state, plan = step(state, [StepFinished()])
    assert plan.decode.request_ids == (0,)


def test_swap_in_is_oldest_first_unless_priority_says_otherwise():
  config = _config(watermark=1 / 4, num_device_blocks=4)
  old, urgent = _request(0, 8, priority=1), _request(1, 8, priority=0)
  state = _state(config, swapped=[_decoding(urgent), _decoding(old)])
  state, _ = schedule(state)
  assert _ids(state.running) == [1] and _ids(state.swapped) == [0]


def test_no_admission_while_requests_are_swapped_out():
  config = _config(num_device_blocks=4)
  state = _state(config, swapped=[_decoding(_request(0, 16))], waiting=[_request(1, 4)])
  state, plan = schedule(state)
  assert _ids(state.waiting) == [1] and not plan.prefill.request_ids


# Host pool cap.

def _tight_host(**overrides):
  # Both running requests decode into a new block: one must go, and its 3 blocks do not fit in the
  # 2 free host blocks.
  config = _config(watermark=1 / 8, num_host_blocks=3, **overrides)
  r0, r1 = _request(0, 12), _request(1, 16)
  old = _request(2, 4)
  old = dataclasses.replace(old, arrival_time=-1.0)
  return config, _state(config, running=[_decoding(r0), _decoding(r1)], swapped=[_decoding(old)])


def test_host_full_falls_back_to_recompute():
  config, state = _tight_host(host_full="recompute")
  state, plan = schedule(state)
  assert plan.preempted == ((0, "recompute"),) and not plan.swap_out
  (dropped,) = [seq for seq in state.waiting if seq.request_id == 0]
  assert dropped.num_computed == 0 and dropped.num_generated == 1 and not dropped.blocks
  assert _ids(state.swapped) == [2]


def test_host_full_aborts_the_oldest_swapped_request():
  config, state = _tight_host(host_full="abort_oldest")
  freed_host = state.swapped[0].blocks
  state, plan = schedule(state)
  assert [(e.request_id, e.reason) for e in plan.ended] == [(2, ABORT_HOST_FULL)]
  assert plan.preempted == ((0, "swap"),) and _ids(state.swapped) == [0]
  assert set(freed_host) <= set(plan.free_host)
  assert {h for _, h in plan.swap_out} & set(freed_host), "the freed host blocks are reused"


def test_host_full_aborts_the_victim_when_it_is_the_oldest():
  config = _config(watermark=1 / 8, num_host_blocks=2, host_full="abort_oldest")
  state = _state(config, running=[_decoding(_request(0, 12)), _decoding(_request(1, 16))])
  state, plan = schedule(state)
  assert [(e.request_id, e.reason) for e in plan.ended] == [(0, ABORT_HOST_FULL)]
  assert not plan.swap_out and _ids(state.running) == [1]
  assert metrics(state).aborted == ((ABORT_HOST_FULL, 1),)


def test_recompute_mode_never_swaps():
  config = _config(watermark=1 / 8, preemption_mode="recompute")
  state = _state(config, running=[_decoding(_request(0, 12)), _decoding(_request(1, 16))])
  state, plan = schedule(state)
  assert plan.preempted == ((0, "recompute"),) and not plan.swap_out
  assert state.host.num_free == config.num_host_blocks
  assert metrics(state).preemptions == (("recompute", 1),)


def test_recomputed_request_prefills_prompt_and_generated_tokens():
  config = _config(max_num_batched_tokens=16)
  request = _request(0, 6)
  state = dataclasses.replace(_state(config), waiting=(Seq(request, 0, 0, 3, ()),), next_order=1)
  state, plan = schedule(state)
  assert (plan.prefill.starts, plan.prefill.ends, plan.prefill.samples) == ((0,), (9,), (True,))


# The link budget.

def test_kv_swaps_and_weight_prefetch_share_the_link_budget():
  config = _config(block_bytes=10, link_bytes_per_step=100, kv_link_share=0.5,
                   weight_prefetch_bytes_per_step=80)
  state = _state(config, swapped=[_decoding(_request(0, 12)), _decoding(_request(1, 12))])
  state, plan = schedule(state)
  assert _ids(state.running) == [0], "the second swap-in would pass the 50-byte KV share"
  assert plan.kv_swap_bytes == 30 and plan.weight_prefetch_bytes == 50


def test_weight_prefetch_gets_what_swap_outs_leave():
  assert policies.weight_prefetch_bytes(100, 0.5, kv_bytes_spent=70, weight_bytes_wanted=80) == 30
  assert policies.weight_prefetch_bytes(None, 0.5, kv_bytes_spent=70, weight_bytes_wanted=80) == 80


def test_first_swap_in_goes_even_above_the_kv_share():
  config = _config(block_bytes=10, link_bytes_per_step=20, kv_link_share=0.5)
  state, plan = schedule(_state(config, swapped=[_decoding(_request(0, 12))]))
  assert _ids(state.running) == [0] and plan.kv_swap_bytes == 30


# Events.

def test_finished_and_length_requests_free_their_blocks():
  config = _config()
  state, plan = step(initial_state(config), [Arrive(_request(0, 4, max_tokens=1)),
                                              Arrive(_request(1, 4, max_tokens=5))])
  state, plan = step(state, [StepFinished(finished=((1, "stop"),))])
  assert {(e.request_id, e.status, e.reason) for e in plan.ended} == {
      (0, FINISHED, FINISH_LENGTH), (1, FINISHED, "stop")}
  assert state.device.num_free == config.num_device_blocks and not state.running
  assert metrics(state).finished == (("length", 1), ("stop", 1))


def test_abort_of_a_swapped_request_frees_its_host_blocks_at_once():
  config = _config()
  state = _state(config, swapped=[_decoding(_request(0, 8))])
  state = apply_event(state, Abort(0))
  assert state.host.num_free == config.num_host_blocks and not state.swapped
  assert state.ended[0].reason == ABORT_CLIENT and len(state.freed_host) == 2


def test_abort_of_an_unknown_or_ended_request_does_nothing():
  state = initial_state(_config())
  assert apply_event(state, Abort("nobody")) == state


def test_stop_for_an_aborted_in_flight_request_is_ignored():
  state, _ = step(initial_state(_config()), [Arrive(_request(0, 4))])
  state, plan = step(state, [Abort(0), StepFinished(finished=((0, "stop"),))])
  assert [(e.request_id, e.reason) for e in plan.ended] == [(0, ABORT_CLIENT)]


def test_stop_with_the_next_plan_in_flight_ends_the_request_as_finished():
  """An engine planning ahead reports a step as StepFinished() and a stop found afterwards with
  Stop: the request ends FINISHED with that reason, its blocks free at once, while the next plan
  (which still holds its row) is in flight; its StepFinished then ignores the request."""
  config = _config()
  state, _ = step(initial_state(config), [Arrive(_request(0, 4)), Arrive(_request(1, 4))])
  state, plan = step(state, [StepFinished()])  # both decode in this plan
  assert sorted(plan.decode.request_ids) == [0, 1]
  state = apply_event(state, Stop(0, "stop"))
  assert _ids(state.running) == [1] and state.in_flight is plan
  assert apply_event(state, Stop(0, "stop")) == state  # already ended: nothing
  held = allocator.blocks_for(5, config.block_size)
  assert state.device.num_free == config.num_device_blocks - held
  state, plan = step(state, [StepFinished()])
  assert [(e.request_id, e.status, e.reason) for e in plan.ended] == [(0, FINISHED, "stop")]
  assert plan.decode.request_ids == (1,)
  assert metrics(state).finished == (("stop", 1),) and not metrics(state).aborted
  with pytest.raises(ValueError, match="reason"):
    Stop(1, "")


def test_protocol_errors_are_reported():
  state = initial_state(_config())
  with pytest.raises(ValueError, match="no plan in flight"):
    apply_event(state, StepFinished())
  state, _ = step(state, [Arrive(_request(0, 20, max_tokens=4))])  # a 16-token chunk: no sample
  with pytest.raises(ValueError, match="in flight"):
    schedule(state)
  with pytest.raises(ValueError, match="sampled no token"):
    apply_event(state, StepFinished(finished=((0, "stop"),)))
  with pytest.raises(ValueError, match="request_id=0"):
    apply_event(state, Arrive(_request(0, 4)))
  with pytest.raises(ValueError, match="expected an Arrive"):
    apply_event(state, "go")
  with pytest.raises(ValueError, match="expected a Request"):
    Arrive("go")
  with pytest.raises(ValueError, match="expected \\(request_id, non-empty reason\\)"):
    StepFinished(finished=((0, ""),))


def test_same_events_give_the_same_plans():
  def run():
    state, plans = initial_state(_config(watermark=1 / 8)), []
    events = [Arrive(_request(i, 5 + 3 * i, max_tokens=6)) for i in range(4)]
    for _ in range(12):
      state, plan = step(state, events)
      plans.append(plan)
      events = [StepFinished()]
    return state, plans
  assert run() == run()


# Validation and sizing.

@pytest.mark.parametrize("overrides, message", [
    (dict(num_device_blocks=0), "num_device_blocks=0"),
    (dict(max_num_batched_tokens=2), "max_num_batched_tokens=2: expected an int >= 4"),
    (dict(watermark=0.9), "watermark=0.9 keeps 8 blocks free"),
    (dict(watermark=1.0), r"watermark=1.0: expected a number in \[0, 1\)"),
    (dict(preemption_mode="drop"), "preemption_mode='drop'"),
    (dict(victim_policy="random"), "victim_policy='random'"),
    (dict(host_full="wait"), "host_full='wait'"),
    (dict(link_bytes_per_step=100), "block_bytes=0"),
])
def test_config_validation_names_the_parameter(overrides, message):
  with pytest.raises(ValueError, match=message):
    _config(**overrides)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_len=0), "prompt_len=0"), (dict(max_tokens=-1), "max_tokens=-1"),
    (dict(request_id=None), "request_id=None"), (dict(predicted_output_len=-2),
                                                  "predicted_output_len=-2")])
def test_request_validation_names_the_parameter(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Request(**{**dict(request_id="a", prompt_len=4, max_tokens=4), **kwargs})


def test_allocator_is_fifo_and_checks_its_input():
  pool, (a, b) = allocator.update(allocator.new_pool(600), allocate=[("a", 300), ("b", 2)])
  assert a == tuple(range(300)) and b == (300, 301)
  pool, (c,) = allocator.update(pool, release=a[:2], allocate=[("c", 299)])
  assert c == tuple(range(302, 600)) + (0,), "released blocks are handed out last"
  assert pool.owner(0) == "c" and pool.owner(1) is None and pool.free_blocks() == (1,)
  with pytest.raises(ValueError, match="owned by someone"):
    allocator.update(pool, release=[1])
  with pytest.raises(ValueError, match="only 1 are free"):
    allocator.update(pool, allocate=[("d", 2)])


def test_scheduler_modules_import_no_jax():
  package = pathlib.Path(__file__).parent.parent / "jaxtier" / "scheduler"
  for path in package.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
      for name in names:
        assert name.split(".")[0] not in ("jax", "jaxlib", "flax", "numpy"), f"{path.name}: {name}"
        # jaxtier.common.checks: the shared argument validators, a leaf of the standard library
        # only.
        assert not name.startswith("jaxtier.") or name.startswith(
            ("jaxtier.scheduler", "jaxtier.common.checks")), path.name


def test_importing_the_scheduler_loads_no_jax():
  code = "import sys, jaxtier.scheduler; sys.exit('jax' in sys.modules or 'numpy' in sys.modules)"
  assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
