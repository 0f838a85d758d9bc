"""Stateful property test of the scheduler: random arrivals, aborts, stops, pools, policies.

Profiles: `JAXTIER_HYPOTHESIS_PROFILE=ci` runs 10,000 examples (CI); anything else runs a few hundred.
The profile applies to this machine only, never to other test modules.
"""

import collections
import os
import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxtier.scheduler import (Abort, Arrive, Request, SchedulerConfig, StepFinished, apply_event,
                               blocks_for, initial_state, schedule)
from jaxtier.scheduler.policies import VICTIM_POLICIES
from jaxtier.scheduler.request import (ABORT_CLIENT, ABORT_HOST_FULL, ABORT_TOO_LARGE, ABORTED,
                                       FINISH_LENGTH, FINISHED)

_COMMON = dict(deadline=None, stateful_step_count=12,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("jaxtier_scheduler_default", max_examples=300, **_COMMON)
settings.register_profile("jaxtier_scheduler_ci", max_examples=10_000, **_COMMON)
_PROFILE = ("jaxtier_scheduler_ci" if os.environ.get("JAXTIER_HYPOTHESIS_PROFILE") == "ci"
            else "jaxtier_scheduler_default")


@st.composite
def configs(draw):
  num_device_blocks = draw(st.integers(1, 24))
  watermark = draw(st.one_of(  # a few blocks, or a share of the pool
      st.integers(0, min(3, num_device_blocks - 1)).map(lambda k: k / num_device_blocks),
      st.sampled_from([0.0, 0.1, 0.25])))
  if watermark * num_device_blocks > num_device_blocks - 1:
    watermark = 0.0
  max_num_seqs = draw(st.integers(1, 6))
  block_bytes = draw(st.sampled_from([0, 10]))
  return SchedulerConfig(
      num_device_blocks=num_device_blocks, num_host_blocks=draw(st.integers(0, 24)),
      block_size=draw(st.integers(1, 8)), max_num_seqs=max_num_seqs,
      max_num_batched_tokens=max_num_seqs + draw(st.integers(0, 24)), watermark=watermark,
      max_blocks_per_request=draw(st.one_of(st.none(), st.integers(1, num_device_blocks))),
      preemption_mode=draw(st.sampled_from(["swap", "recompute"])),
      victim_policy=draw(st.sampled_from(sorted(VICTIM_POLICIES))),
      host_full=draw(st.sampled_from(["recompute", "abort_oldest"])),
      prefetch_swap_in=draw(st.booleans()), block_bytes=block_bytes,
      link_bytes_per_step=draw(st.sampled_from([None, 10, 35, 200])) if block_bytes else None,
      kv_link_share=draw(st.sampled_from([0.5, 1.0])),
      weight_prefetch_bytes_per_step=draw(st.sampled_from([0, 50])), enable_prefix_caching=False,
      host_prefix_caching=True)


_REQUEST = st.tuples(st.integers(1, 200), st.integers(1, 16), st.integers(0, 2),
                     st.one_of(st.none(), st.integers(0, 16)))


class SchedulerMachine(RuleBasedStateMachine):
  """Drives the scheduler the way an engine does and checks every state and plan it produces."""

  @initialize(config=configs(), burst=st.lists(_REQUEST, max_size=10))
  def start(self, config, burst):
    self.config = config
    self.state = initial_state(config)
    self.requests = {}
    self.ended = {}
    self.client_aborted = set()
    self.generated = collections.Counter()
    self.clock = 0.0
    self._arrive(burst)

  @rule(burst=st.lists(_REQUEST, min_size=1, max_size=4), delay=st.sampled_from([0.0, 0.5]))
  def arrive(self, burst, delay):
    self.clock += delay
    self._arrive(burst)

  def _arrive(self, burst):
    """Sizes prompts to the KV cap, so that most requests fit it and a few do not."""
    cap_tokens = self.config.request_block_cap * self.config.block_size
    for prompt, max_tokens, priority, predicted in burst:
      request = Request(len(self.requests), prompt_len=1 + (prompt - 1) % (cap_tokens + 2),
                        max_tokens=max_tokens, arrival_time=self.clock, priority=priority,
                        predicted_output_len=predicted)
      self.requests[request.request_id] = request
      self.state = apply_event(self.state, Arrive(request))

  @rule(data=st.data(), roll=st.integers(0, 3))
  def abort(self, data, roll):
    if not self.requests or roll:
      return
    request_id = data.draw(st.sampled_from(sorted(self.requests)))
    if request_id not in self.ended and not self._pending_end(request_id):
      self.client_aborted.add(request_id)
    self.state = apply_event(self.state, Abort(request_id))

  @rule(seed=st.integers(0, 2**16), steps=st.integers(1, 6))
  def run_steps(self, seed, steps):
    rng = random.Random(seed)  # which sampled requests stop; one draw keeps examples small
    for _ in range(steps):
      self._run_step(rng, check_determinism=True)

  def _run_step(self, rng, check_determinism=False):
    self._finish_step(rng)
    before = self.state
    self.state, plan = schedule(before)
    if check_determinism:
      assert schedule(before) == (self.state, plan), "same state must give the same plan"
    self._check_plan(before, plan)
    self._record(plan)
    for name, happened in (("swap out", plan.swap_out), ("swap in", plan.swap_in),
                           ("prefetch", plan.prefetch), ("recompute", any(
                               kind == "recompute" for _, kind in plan.preempted)),
                           ("host full", any(e.reason == ABORT_HOST_FULL for e in plan.ended))):
      if happened:
        event(name)

  def _finish_step(self, rng):
    plan = self.state.in_flight
    if plan is None:
      return
    sampled = [i for batch in (plan.prefill, plan.decode)
               for i, s in zip(batch.request_ids, batch.samples) if s]
    for request_id in sampled:
      self.generated[request_id] += 1
    stopped = tuple((i, "stop") for i in sampled if rng.random() < 0.15)
    self.state = apply_event(self.state, StepFinished(stopped))

  def _pending_end(self, request_id):
    return any(e.request_id == request_id for e in self.state.ended)

  def _record(self, plan):
    for item in plan.ended:
      assert item.request_id in self.requests, item
      assert item.request_id not in self.ended, f"{item.request_id} ended twice"
      self.ended[item.request_id] = item

  def _check_plan(self, before, plan):
    config, after = self.config, self.state
    running = {seq.request_id: seq for seq in after.running}
    assert plan.num_tokens <= config.max_num_batched_tokens
    for batch in (plan.prefill, plan.decode):
      for rid, start, end, table, sample in zip(batch.request_ids, batch.starts, batch.ends,
                                                batch.block_tables, batch.samples):
        seq = running[rid]
        assert seq.blocks == table and seq.num_computed == start < end <= seq.seq_len
        assert blocks_for(end, config.block_size) <= len(table), "must own blocks for its tokens"
        assert sample == (end == seq.seq_len)
    _check_copies(before, after, plan.swap_out, before.device, before.host, plan.free_host,
                  "running", "swapped")
    _check_copies(before, after, plan.swap_in + plan.prefetch, before.host, before.device,
                  plan.free_device, "swapped", "running")
    assert not (plan.swap_in and plan.prefetch)
    if len(after.running) >= 2:
      assert after.device.num_free >= config.watermark_block_count, \
          "two or more running stay above watermark"
    self._check_link(before, plan)

  def _check_link(self, before, plan):
    """KV copies go first within their share; weight prefetch gets at most what is left."""
    config = self.config
    copied_in = len(plan.swap_in) + len(plan.prefetch)
    assert plan.kv_swap_bytes == config.block_bytes * (len(plan.swap_out) + copied_in)
    assert plan.weight_prefetch_bytes <= config.weight_prefetch_bytes_per_step
    if config.link_bytes_per_step is None:
      assert plan.weight_prefetch_bytes == config.weight_prefetch_bytes_per_step
      return
    kv_share = config.link_bytes_per_step * config.kv_link_share
    swapped_in = {s.request_id for s in before.swapped} & {s.request_id for s in self.state.running}
    if len(swapped_in) > 1:
      assert copied_in * config.block_bytes <= kv_share, "only the first swap-in may pass the share"
    assert plan.weight_prefetch_bytes <= config.link_bytes_per_step - kv_share + 1
    assert plan.weight_prefetch_bytes <= max(config.link_bytes_per_step - plan.kv_swap_bytes, 0)

  @invariant()
  def places_are_exclusive(self):
    state = self.state
    live = [seq.request_id for seq in state.waiting + state.running + state.swapped]
    pending = [e.request_id for e in state.ended]
    everyone = live + pending + list(self.ended)
    assert len(everyone) == len(set(everyone)), "each request is in exactly one place"
    assert set(everyone) == set(self.requests)
    assert len(state.running) <= self.config.max_num_seqs

  @invariant()
  def pools_are_consistent(self):
    state = self.state
    _check_pool(state.device, state.running)
    _check_pool(state.host, state.swapped)
    plan = state.in_flight
    in_flight = {}
    if plan is not None:
      for batch in (plan.prefill, plan.decode):
        in_flight.update(zip(batch.request_ids, batch.ends))
    block_size = self.config.block_size
    for seq in state.running:
      end = in_flight.get(seq.request_id, seq.num_computed)
      assert len(seq.blocks) == blocks_for(end, block_size), "KV grows block by block"
      assert len(seq.blocks) <= self.config.request_block_cap
    for seq in state.swapped:
      assert len(seq.blocks) == blocks_for(seq.num_computed, block_size)
    for seq in state.waiting:
      assert not seq.blocks and seq.num_computed == 0

  def teardown(self):
    if not hasattr(self, "state"):
      return
    self._drain()
    self._check_ends()

  def _drain(self):
    work = sum(r.prompt_len + r.max_tokens for r in self.requests.values())
    rng = random.Random(work)
    for _ in range(30 * work + 20):
      state = self.state
      if not (state.waiting or state.running or state.swapped or state.ended):
        return
      self._run_step(rng)
      self.places_are_exclusive()
      self.pools_are_consistent()
    raise AssertionError(f"requests did not all end within {30 * work + 20} steps: livelock")

  def _check_ends(self):
    config = self.config
    swaps_may_abort = config.preemption_mode == "swap" and config.host_full == "abort_oldest"
    for request_id, request in self.requests.items():
      item = self.ended[request_id]
      too_large = blocks_for(request.max_kv_tokens, config.block_size) > config.request_block_cap
      assert (item.reason == ABORT_TOO_LARGE) == too_large, item
      if item.status == ABORTED:
        assert item.reason in (ABORT_CLIENT, ABORT_HOST_FULL, ABORT_TOO_LARGE), item
        assert (item.reason == ABORT_CLIENT) == (request_id in self.client_aborted), item
        assert item.reason != ABORT_HOST_FULL or swaps_may_abort, item
      else:
        assert item.status == FINISHED and request_id not in self.client_aborted, item
        assert self.generated[request_id] <= request.max_tokens
        if item.reason == FINISH_LENGTH:
          assert self.generated[request_id] == request.max_tokens, item


def _check_pool(pool, seqs):
  owned = [b for seq in seqs for b in seq.blocks]
  free = pool.free_blocks()
  assert len(owned) == len(set(owned)), "a block has at most one owner"
  assert len(free) == len(set(free)) == pool.num_free
  assert not set(owned) & set(free)
  assert len(owned) + len(free) == pool.num_blocks, "free + owned = total"
  for seq in seqs:
    for block in seq.blocks:
      assert pool.owner(block) == seq.request_id
  assert all(pool.owner(block) is None for block in free)


def _check_copies(before, after, pairs, source_pool, dest_pool, freed_dest, source_place,
                  dest_place):
  """Each copy moves a block its source request owned to a slot that was free."""
  sources = [s for s, _ in pairs]
  dests = [d for _, d in pairs]
  assert len(set(sources)) == len(sources) and len(set(dests)) == len(dests)
  free_before = set(dest_pool.free_blocks()) | set(freed_dest)
  owners_before = {b: s.request_id for s in getattr(before, source_place) for b in s.blocks}
  owners_after = {b: s.request_id for s in getattr(after, dest_place) for b in s.blocks}
  for source, dest in pairs:
    assert source_pool.owner(source) is not None and source in owners_before
    assert dest in free_before, f"copy {source}->{dest}: destination was not free"
    assert owners_after[dest] == owners_before[source], "the copy follows its request"


SchedulerMachine.TestCase.settings = settings.get_profile(_PROFILE)
TestSchedulerMachine = SchedulerMachine.TestCase
