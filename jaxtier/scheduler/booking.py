"""Booking: turn a step's decision (block counts) into block ids, the next state and the plan.

The device pool gets one allocator update: the blocks it releases first, then the blocks it hands
out. The plan's order (swap-outs and write-backs before anything writes to the device, see `state`)
makes it safe for a block released by a swap-out or evicted from the prefix cache to be handed out
again in the same step. With prefix caching, the blocks the pool lacks are evicted from the device
index (least recently used first) and, with the host tier, written back to host blocks that are free
or evicted from the host index in turn; swap-outs of running requests take host blocks first.

The host pool gets two updates: first what this step writes (swap-outs, write-backs) takes its
blocks, then the blocks this step reads and lets go (swap-ins) are freed, so no host block is read
and overwritten in one step. Host blocks that this step's hits load are never evicted by it.
"""

import dataclasses

from jaxtier.scheduler import allocator
from jaxtier.scheduler import policies
from jaxtier.scheduler import prefix
from jaxtier.scheduler.request import ABORT_HOST_FULL, ABORTED, Ended, Seq
from jaxtier.scheduler.state import (EMPTY_BATCH, ComputeBatch, Counters, Plan, SchedulerState,
                                     add_count)


@dataclasses.dataclass(frozen=True)
class Preemption:
  """The running requests a step keeps, and what happens to the others."""
  kept: tuple[Seq, ...]
  kept_tokens: tuple[int, ...]  # [kept] tokens computed this step
  kept_growth: tuple[int, ...]  # [kept] new device blocks
  swap_out: tuple[Seq, ...]
  recompute: tuple[Seq, ...]
  victim_aborted: tuple[Seq, ...]  # victims aborted for lack of host blocks (device KV dropped)
  host_aborted: tuple[Seq, ...]  # swapped requests aborted to make room in the host pool
  swapped: tuple[Seq, ...]  # swapped requests still on the host
  free: int  # device blocks free once the kept requests grew


@dataclasses.dataclass(frozen=True)
class Choice:
  """Requests that start running this step (swapped in, or admitted)."""
  seqs: tuple[Seq, ...]
  tokens: tuple[int, ...]  # [seqs] tokens computed this step
  blocks: tuple[int, ...]  # [seqs] new device blocks booked (host hits' destinations first)
  device_hits: tuple[int, ...] = ()  # [seqs] leading blocks shared from the device index
  host_hits: tuple[int, ...] = ()  # [seqs] blocks after those loaded from the host index
  host_passed: tuple[int, ...] = ()  # [seqs] host hits recomputed instead (cheaper)


@dataclasses.dataclass(frozen=True)
class Decision:
  """What one step does, in block counts."""
  preemption: Preemption
  swap_in: Choice
  admit: Choice


def book(state: SchedulerState, decision: Decision) -> tuple[SchedulerState, Plan]:
  """Books the decision's blocks in both pools; returns the next state and the plan."""
  config = state.config
  p, swap_in, admit = decision.preemption, decision.swap_in, decision.admit
  device_cache, host_cache = state.device_cache, state.host_cache
  victims = p.swap_out + p.recompute + p.victim_aborted
  device_release = []
  for seq in victims:
    device_cache, private = prefix.release(device_cache, seq.blocks)
    device_release.extend(private)
  # Admitted requests share their device hits before anything is evicted.
  device_hits = [prefix.hit_blocks(device_cache, seq.hashes[:n]) if n else ()
                 for seq, n in zip(admit.seqs, admit.device_hits)]
  host_hits = [prefix.hit_blocks(host_cache, seq.hashes[d:d + n]) if n else ()
               for seq, d, n in zip(admit.seqs, admit.device_hits, admit.host_hits)]
  if any(device_hits):
    device_cache = prefix.acquire(device_cache, (b for table in device_hits for b in table))
  if any(host_hits):
    host_cache = prefix.touch(host_cache, (b for table in host_hits for b in table))
  growing = [(seq.request_id, g) for seq, g in zip(p.kept, p.kept_growth) if g]
  wants = growing + _wants(swap_in) + _wants(admit)
  short = sum(n for _, n in wants) - state.device.num_free - len(device_release)
  device_cache, evicted = prefix.evict(device_cache, short)
  device, granted = allocator.update(
      state.device, tuple(device_release) + tuple(b for b, _ in evicted), wants)
  host, host_cache, host_granted, writeback, host_evictions = _book_host(
      state, host_cache, p, evicted, frozenset(b for table in host_hits for b in table))
  host_release = _blocks_of(swap_in.seqs)
  if host_release:
    host, _ = allocator.update(host, release=host_release)
  kept = p.kept
  if growing:
    grown = iter(granted[:len(growing)])
    kept = tuple([_with_blocks(seq, seq.blocks + next(grown)) if g else seq
                  for seq, g in zip(p.kept, p.kept_growth)])
  rest = granted[len(growing):]
  swapped_in = tuple(_with_blocks(seq, blocks, 0)
                     for seq, blocks in zip(swap_in.seqs, rest[:len(swap_in.seqs)]))
  admitted, loads = _admitted(config, admit, device_hits, host_hits, rest[len(swap_in.seqs):])
  swapped_out = tuple(_with_blocks(seq, blocks, 0) for seq, blocks in zip(p.swap_out, host_granted))
  dropped = tuple(Seq(s.request, s.order, 0, s.num_generated, (), s.hashes) for s in p.recompute)
  running = kept + swapped_in + admitted
  copies_out, copies_in = _copies(p.swap_out, swapped_out), _copies(swap_in.seqs, swapped_in)
  host_full = _host_full_ended(state, p)
  plan = _plan(state, running, p.kept_tokens + swap_in.tokens + admit.tokens, copies_out,
               copies_in + loads, len(loads), writeback, tuple(device_release),
               _blocks_of(p.host_aborted) + host_release, host_full, p)
  if any(admit.device_hits) or any(admit.host_hits):
    size = config.block_size
    plan = dataclasses.replace(plan, hits=tuple(
        (seq.request_id, d * size, h * size)
        for seq, d, h in zip(admit.seqs, admit.device_hits, admit.host_hits) if d or h))
  looked_up = sum(seq.request.prompt_len for seq in admit.seqs
                  if not seq.request.skip_prefix_cache) if config.enable_prefix_caching else 0
  counters = _count(state.counters, config.block_size, p, admit, len(swap_in.seqs),
                    len(copies_out), len(copies_in), host_full,
                    (looked_up, len(writeback), len(evicted), host_evictions))
  swapped = _merge(p.swapped[len(swap_in.seqs):], swapped_out)
  started = {seq.request_id for seq in admit.seqs}  # not a prefix of the queue: held ones stay
  next_state = SchedulerState(
      config, device, host,
      waiting=_merge(tuple(s for s in state.waiting if s.request_id not in started), dropped),
      held=state.held, running=running, swapped=swapped, in_flight=plan,
      next_order=state.next_order, counters=counters, device_cache=device_cache,
      host_cache=host_cache, rates=state.rates, disk_index=state.disk_index,
      swap_wait_steps=state.swap_wait_steps + 1 if swapped and not swap_in.seqs else 0)
  return next_state, plan


def _book_host(state: SchedulerState, host_cache: prefix.TierIndex, p: Preemption,
               evicted: tuple[tuple[int, bytes], ...], keep: frozenset[int]):
  """Gives host blocks to the swap-outs, then to the write-backs of `evicted` device blocks.

  Returns the host pool, the host index, the swap-outs' host blocks, the write-back pairs and the
  number of host-index blocks evicted.
  """
  config = state.config
  aborted = _blocks_of(p.host_aborted)
  need = sum(len(seq.blocks) for seq in p.swap_out)
  free = state.host.num_free + len(aborted)
  if config.host_tier:
    # Newest evictions first: when the host has no room for all, the most recently used stay.
    evicted = tuple(e for e in evicted if e[1] not in host_cache.by_hash)
    room = free - need + host_cache.num_evictable - sum(1 for b in keep if b in host_cache.ticks)
    evicted = evicted[len(evicted) - max(min(room, len(evicted)), 0):]
  else:
    evicted = ()
  host_cache, dropped = prefix.evict(host_cache, need + len(evicted) - free, keep)
  host, granted = allocator.update(
      state.host, aborted + tuple(b for b, _ in dropped),
      [(seq.request_id, len(seq.blocks)) for seq in p.swap_out]
      + ([(prefix.CACHED, len(evicted))] if evicted else []))
  writeback = ()
  if evicted:
    targets = granted[-1]
    granted = granted[:-1]
    for (_, block_hash), target in zip(evicted, targets):
      host_cache, _ = prefix.register(host_cache, target, block_hash, referenced=False)
    writeback = tuple((block, target) for (block, _), target in zip(evicted, targets))
  return host, host_cache, granted, writeback, len(dropped)


def _admitted(config, admit: Choice, device_hits: list, host_hits: list, granted
              ) -> tuple[tuple[Seq, ...], tuple[tuple[int, int], ...]]:
  """The admitted requests with their tables, and the host-hit copies (host block, device block)."""
  seqs, loads = [], []
  for seq, shared, sources, blocks in zip(admit.seqs, device_hits, host_hits, granted):
    loads.extend(zip(sources, blocks))
    computed = (len(shared) + len(sources)) * config.block_size
    seqs.append(Seq(seq.request, seq.order, computed, seq.num_generated, shared + blocks,
                    seq.hashes, len(shared)))
  return tuple(seqs), tuple(loads)


def _blocks_of(seqs: tuple[Seq, ...]) -> tuple[int, ...]:
  return tuple(block for seq in seqs for block in seq.blocks)


def _wants(choice: Choice) -> list[tuple]:
  return [(seq.request_id, count) for seq, count in zip(choice.seqs, choice.blocks)]


def _with_blocks(seq: Seq, blocks: tuple[int, ...], num_registered: int | None = None) -> Seq:
  return Seq(seq.request, seq.order, seq.num_computed, seq.num_generated, blocks, seq.hashes,
             seq.num_registered if num_registered is None else num_registered)


def _copies(sources: tuple[Seq, ...], destinations: tuple[Seq, ...]) -> tuple[tuple[int, int], ...]:
  """Pairs each source block of a request with the block it moves to."""
  return tuple(pair for old, new in zip(sources, destinations)
               for pair in zip(old.blocks, new.blocks))


def _merge(queue: tuple[Seq, ...], extra: tuple[Seq, ...]) -> tuple[Seq, ...]:
  if not extra:
    return queue
  return tuple(sorted(queue + extra, key=policies.queue_key))


def _host_full_ended(state: SchedulerState, p: Preemption) -> tuple[Ended, ...]:
  detail = (f"the host KV pool ({state.config.num_host_blocks} blocks) was full and "
            "host_full='abort_oldest' aborts the oldest swapped request")
  return tuple(Ended(seq.request_id, ABORTED, ABORT_HOST_FULL, detail)
               for seq in p.host_aborted + p.victim_aborted)


def _batches(running: tuple[Seq, ...], tokens: tuple[int, ...]
             ) -> tuple[ComputeBatch, ComputeBatch]:
  """Splits the requests that compute this step into a prefill and a decode batch."""
  computing = [(seq, n) for seq, n in zip(running, tokens) if n]
  decode = [seq for seq, n in computing if seq.num_generated
            and seq.num_computed + 1 == seq.request.prompt_len + seq.num_generated]
  prefill = []
  if len(decode) < len(computing):
    prefill = [(seq, n) for seq, n in computing if not seq.is_decoding]
  decode_batch = prefill_batch = EMPTY_BATCH
  if decode:
    starts = tuple([seq.num_computed for seq in decode])
    decode_batch = ComputeBatch(
        tuple([seq.request.request_id for seq in decode]), starts,
        tuple([start + 1 for start in starts]), tuple([seq.blocks for seq in decode]),
        (True,) * len(decode))
  if prefill:
    ends = tuple([seq.num_computed + n for seq, n in prefill])
    prefill_batch = ComputeBatch(
        tuple([seq.request_id for seq, _ in prefill]),
        tuple([seq.num_computed for seq, _ in prefill]), ends,
        tuple([seq.blocks for seq, _ in prefill]),
        tuple([end == seq.seq_len for (seq, _), end in zip(prefill, ends)]))
  return prefill_batch, decode_batch


def _plan(state: SchedulerState, running: tuple[Seq, ...], tokens: tuple[int, ...],
          copies_out: tuple, copies_in: tuple, cache_loads: int, writeback: tuple,
          device_release: tuple[int, ...], host_release: tuple[int, ...],
          host_full: tuple[Ended, ...], p: Preemption) -> Plan:
  config = state.config
  prefill, decode = _batches(running, tokens)
  kv_bytes = (len(copies_out) + len(copies_in) + len(writeback)) * config.block_bytes
  return Plan(
      step=state.counters.steps, prefill=prefill, decode=decode, swap_out=copies_out,
      swap_in=() if config.prefetch_swap_in else copies_in,
      prefetch=copies_in if config.prefetch_swap_in else (),
      free_device=state.freed_device + device_release, free_host=state.freed_host + host_release,
      preempted=(tuple((seq.request_id, "swap") for seq in p.swap_out)
                 + tuple((seq.request_id, "recompute") for seq in p.recompute)),
      ended=state.ended + host_full, kv_swap_bytes=kv_bytes,
      weight_prefetch_bytes=policies.weight_prefetch_bytes(
          config.link_bytes_per_step, config.kv_link_share, kv_bytes,
          config.weight_prefetch_bytes_per_step),
      writeback=writeback, cache_loads=cache_loads, disk_writes=state.disk_writes,
      disk_fills=state.disk_fills)


def _count(counters: Counters, size: int, p: Preemption, admit: Choice, num_swap_ins: int,
           out_blocks: int, in_blocks: int, host_full: tuple[Ended, ...],
           cache: tuple[int, int, int]) -> Counters:
  """Adds one step to `counters`; `cache` is (prompt tokens looked up, write-backs, device
  evictions, host evictions)."""
  preemptions, aborted = counters.preemptions, counters.aborted
  if p.swap_out:
    preemptions = add_count(preemptions, "swap", len(p.swap_out))
  if p.recompute:
    preemptions = add_count(preemptions, "recompute", len(p.recompute))
  if host_full:
    aborted = add_count(aborted, ABORT_HOST_FULL, len(host_full))
  counters = dataclasses.replace(
      counters, steps=counters.steps + 1, swap_outs=counters.swap_outs + len(p.swap_out),
      swap_out_blocks=counters.swap_out_blocks + out_blocks,
      swap_ins=counters.swap_ins + num_swap_ins, swap_in_blocks=counters.swap_in_blocks + in_blocks,
      preemptions=preemptions, aborted=aborted)
  if not any(cache):
    return counters
  looked_up, writeback_blocks, device_evictions, host_evictions = cache
  return dataclasses.replace(
      counters, prefix_query_tokens=counters.prefix_query_tokens + looked_up,
      device_hit_tokens=counters.device_hit_tokens + sum(admit.device_hits) * size,
      host_hit_tokens=counters.host_hit_tokens + sum(admit.host_hits) * size,
      host_hit_recomputed_tokens=counters.host_hit_recomputed_tokens
      + sum(admit.host_passed) * size,
      writeback_blocks=counters.writeback_blocks + writeback_blocks,
      cache_load_blocks=counters.cache_load_blocks + sum(admit.host_hits),
      device_cache_evictions=counters.device_cache_evictions + device_evictions,
      host_cache_evictions=counters.host_cache_evictions + host_evictions)
