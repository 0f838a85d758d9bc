"""Prefix caching in the pure scheduler, against a symbolic KV cache.

The test plays the engine: it executes every plan on a cache whose slots hold, instead of KV, the
token prefix that produced them (the KV of position p depends on tokens [0, p]). Every sequence that
computes must read exactly its own prefix in the blocks before its range, copies must move the
right contents, and every block the index calls cached must hold the tokens its hash names. The
contents come from the tokens alone, not from the scheduler's hashes, so a wrong hash, a block read
before it is written, or a block overwritten while still shared all show up as a wrong read.
"""

import dataclasses

import hypothesis
from hypothesis import strategies as st

from jaxtier import scheduler
from jaxtier.scheduler import prefix
from jaxtier.scheduler.request import Request


def _token(request_id, n, vocab):
  return (hash((request_id, n)) % vocab) + 1


class SymbolicEngine:
  """Executes plans on symbolic pools; `tokens` maps request ids to their prompt + generated ids."""

  def __init__(self, config):
    self.config = config
    self.device = {}  # block -> list of slot contents (token prefixes), None = never written
    self.host = {}
    self.tokens = {}
    self.content = {}  # block hash -> slot contents it must hold, from the prompts seen

  def arrive(self, request):
    self.tokens[request.request_id] = list(request.prompt_token_ids)
    bs = self.config.block_size
    ids = request.prompt_token_ids
    for i, block_hash in enumerate(prefix.block_hashes(ids, bs)):
      expected = [tuple(ids[:i * bs + j + 1]) for j in range(bs)]
      assert self.content.setdefault(block_hash, expected) == expected, "hash collision"

  def execute(self, plan, vocab):
    bs = self.config.block_size
    computing = set()
    for batch in (plan.prefill, plan.decode):
      for table in batch.block_tables:
        computing.update(table)
    out_targets = {h for _, h in plan.swap_out + plan.writeback}
    for d, h in plan.swap_out + plan.writeback:
      self.host[h] = list(self.device[d])
    for h, d in plan.swap_in:
      self.device[d] = list(self.host[h])
    for h, d in plan.prefetch:  # overlaps compute: it must not touch what compute uses
      assert d not in computing, f"prefetch into block {d}, which this step computes with"
      assert h not in out_targets, f"prefetch from host block {h}, which this step overwrites"
    for batch in (plan.prefill, plan.decode):
      for rid, start, end, table, sample in zip(batch.request_ids, batch.starts, batch.ends,
                                                batch.block_tables, batch.samples):
        tokens = self.tokens[rid]
        for p in range(start):
          got = self.device.get(table[p // bs], [None] * bs)[p % bs]
          assert got == tuple(tokens[:p + 1]), (
              f"step {plan.step}: request {rid!r} reads position {p} from block {table[p // bs]} "
              f"and finds {got}")
        for p in range(start, end):
          block = self.device.setdefault(table[p // bs], [None] * bs)
          block[p % bs] = tuple(tokens[:p + 1])
        if sample:
          tokens.append(_token(rid, len(tokens), vocab))
    for h, d in plan.prefetch:
      self.device[d] = list(self.host[h])

  def check_cached(self, state):
    for index, pool in ((state.device_cache, self.device), (state.host_cache, self.host)):
      for block, block_hash in index.hashes.items():
        assert pool.get(block) == self.content[block_hash], (
            f"cached block {block} does not hold the tokens of its hash")


def check_accounting(state):
  """Every block is free, privately owned by one request, or cached with the right references."""
  device, host = state.device, state.host
  dc, hc = state.device_cache, state.host_cache
  holders = {}
  for seq in state.running:
    for block in seq.blocks:
      holders.setdefault(block, []).append(seq.request_id)
  for block in range(device.num_blocks):
    owner = device.owner(block)
    users = holders.get(block, [])
    if block in dc.hashes:
      assert owner == prefix.CACHED, f"cached device block {block} owned by {owner!r}"
      assert dc.refcount(block) == len(users) >= 0
      assert (block in dc.ticks) == (not users), f"block {block}: in LRU iff unreferenced"
      assert dc.by_hash[dc.hashes[block]] == block
    elif owner is None:
      assert not users, f"free device block {block} is in the tables of {users}"
    else:
      assert users == [owner], f"private device block {block} of {owner!r} held by {users}"
  assert all(count > 0 for count in dc.refs.values()), "a reference count is not positive"
  assert len(dc.ticks) == len(dc.lru)
  swapped = {}
  for seq in state.swapped:
    for block in seq.blocks:
      swapped.setdefault(block, []).append(seq.request_id)
  for block in range(host.num_blocks):
    owner = host.owner(block)
    users = swapped.get(block, [])
    if block in hc.hashes:
      assert owner == prefix.CACHED and not users and block in hc.ticks
    elif owner is None:
      assert not users
    else:
      assert users == [owner]
  for seq in state.waiting:
    assert not seq.blocks


@st.composite
def configs(draw):
  block_size = draw(st.integers(1, 4))
  device = draw(st.integers(4, 14))
  return scheduler.SchedulerConfig(
      num_device_blocks=device, num_host_blocks=draw(st.integers(0, 12)), block_size=block_size,
      max_num_seqs=draw(st.integers(1, 4)), max_num_batched_tokens=draw(st.integers(4, 24)),
      watermark=draw(st.integers(0, 1)) / device, max_blocks_per_request=device,
      preemption_mode=draw(st.sampled_from(["swap", "recompute"])),
      victim_policy="longest_waiting",
      prefetch_swap_in=draw(st.booleans()), enable_prefix_caching=True,
      host_prefix_caching=draw(st.booleans()))


@hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
@hypothesis.given(configs(), st.data())
def test_random_shared_prefix_workloads_keep_every_block_accounted_for(config, data):
  vocab = data.draw(st.integers(2, 4), label="vocab")
  families = data.draw(st.lists(st.lists(st.integers(1, vocab), min_size=1, max_size=10),
                                min_size=1, max_size=3), label="prefixes")
  engine = SymbolicEngine(config)
  state = scheduler.initial_state(config)
  live, next_id = set(), 0
  steps = data.draw(st.integers(5, 40), label="steps")
  for step in range(steps + 400):
    draining = step >= steps  # no more arrivals or aborts: everything must finish
    if draining and not live and state.in_flight is None:
      break
    events = []
    for _ in range(0 if draining else data.draw(st.integers(0, 2))):
      tail = data.draw(st.lists(st.integers(1, vocab), max_size=6))
      ids = tuple(data.draw(st.sampled_from(families)) + tail)
      request = Request(next_id, len(ids), data.draw(st.integers(1, 5)), prompt_token_ids=ids)
      next_id += 1
      engine.arrive(request)
      events.append(scheduler.Arrive(request))
      live.add(request.request_id)
    if live and not draining and data.draw(st.booleans()):
      events.append(scheduler.Abort(data.draw(st.sampled_from(sorted(live)))))
    for event in events:
      state = scheduler.apply_event(state, event)
    check_accounting(state)
    state, plan = scheduler.schedule(state)
    check_accounting(state)
    engine.execute(plan, vocab)
    for ended in plan.ended:
      live.discard(ended.request_id)
    sampled = [rid for batch in (plan.prefill, plan.decode)
               for rid, s in zip(batch.request_ids, batch.samples) if s]
    stop = tuple((rid, "stop") for rid in sampled
                 if not draining and data.draw(st.integers(0, 4)) == 0)
    state = scheduler.apply_event(state, scheduler.StepFinished(stop))
    live.difference_update(rid for rid, _ in stop)
    check_accounting(state)
    engine.check_cached(state)
  state, plan = scheduler.schedule(state)  # reports the last endings
  live.difference_update(e.request_id for e in plan.ended)
  assert not live, f"requests {sorted(live)} never finished"
  state = scheduler.apply_event(state, scheduler.StepFinished(()))
  check_accounting(state)
  assert state.device.num_free + state.device_cache.num_evictable == config.num_device_blocks
  assert state.host.num_free + state.host_cache.num_cached == config.num_host_blocks
  state = scheduler.reset_prefix_cache(state)
  assert state.device.num_free == config.num_device_blocks
  assert state.host.num_free == config.num_host_blocks
  assert state.device_cache.num_cached == state.host_cache.num_cached == 0
