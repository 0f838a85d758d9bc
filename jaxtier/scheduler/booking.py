"""Booking: turn a step's decision (block counts) into block ids, the next state and the plan.

Each pool gets one allocator update: the blocks it releases first, then the blocks it hands out. The
plan's order (swap-outs before anything writes to the device, see `state`) makes it safe for a block
released by a swap-out to be handed out again in the same step.
"""

import dataclasses

from jaxtier.scheduler import allocator
from jaxtier.scheduler import policies
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
  blocks: tuple[int, ...]  # [seqs] device blocks booked


@dataclasses.dataclass(frozen=True)
class Decision:
  """What one step does, in block counts."""
  preemption: Preemption
  swap_in: Choice
  admit: Choice


def book(state: SchedulerState, decision: Decision) -> tuple[SchedulerState, Plan]:
  """Books the decision's blocks in both pools; returns the next state and the plan."""
  p, swap_in, admit = decision.preemption, decision.swap_in, decision.admit
  device_release = _blocks_of(p.swap_out + p.recompute + p.victim_aborted)
  growing = [(seq.request_id, g) for seq, g in zip(p.kept, p.kept_growth) if g]
  device, granted = allocator.update(
      state.device, device_release, growing + _wants(swap_in) + _wants(admit))
  # Swap-ins happen only in steps without swap-outs, so no host block is freed and refilled at once.
  host_release = _blocks_of(p.host_aborted + swap_in.seqs)
  host, host_granted = allocator.update(
      state.host, host_release, [(seq.request_id, len(seq.blocks)) for seq in p.swap_out])
  kept = p.kept
  if growing:
    grown = iter(granted[:len(growing)])
    kept = tuple([_with_blocks(seq, seq.blocks + next(grown)) if g else seq
                  for seq, g in zip(p.kept, p.kept_growth)])
  rest = granted[len(growing):]
  swapped_in = tuple(map(_with_blocks, swap_in.seqs, rest[:len(swap_in.seqs)]))
  admitted = tuple(map(_with_blocks, admit.seqs, rest[len(swap_in.seqs):]))
  swapped_out = tuple(map(_with_blocks, p.swap_out, host_granted))
  dropped = tuple(Seq(s.request, s.order, 0, s.num_generated, ()) for s in p.recompute)
  running = kept + swapped_in + admitted
  copies_out, copies_in = _copies(p.swap_out, swapped_out), _copies(swap_in.seqs, swapped_in)
  host_full = _host_full_ended(state, p)
  plan = _plan(state, running, p.kept_tokens + swap_in.tokens + admit.tokens, copies_out, copies_in,
               device_release, host_release, host_full, p)
  counters = _count(state.counters, p, len(swap_in.seqs), len(copies_out), len(copies_in),
                    host_full)
  next_state = SchedulerState(
      state.config, device, host, waiting=_merge(state.waiting[len(admit.seqs):], dropped),
      running=running, swapped=_merge(p.swapped[len(swap_in.seqs):], swapped_out), in_flight=plan,
      next_order=state.next_order, counters=counters)
  return next_state, plan


def _blocks_of(seqs: tuple[Seq, ...]) -> tuple[int, ...]:
  return tuple(block for seq in seqs for block in seq.blocks)


def _wants(choice: Choice) -> list[tuple]:
  return [(seq.request_id, count) for seq, count in zip(choice.seqs, choice.blocks)]


def _with_blocks(seq: Seq, blocks: tuple[int, ...]) -> Seq:
  return Seq(seq.request, seq.order, seq.num_computed, seq.num_generated, blocks)


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
          copies_out: tuple, copies_in: tuple, device_release: tuple[int, ...],
          host_release: tuple[int, ...], host_full: tuple[Ended, ...], p: Preemption) -> Plan:
  config = state.config
  prefill, decode = _batches(running, tokens)
  kv_bytes = (len(copies_out) + len(copies_in)) * config.block_bytes
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
          config.weight_prefetch_bytes_per_step))


def _count(counters: Counters, p: Preemption, num_swap_ins: int, out_blocks: int, in_blocks: int,
           host_full: tuple[Ended, ...]) -> Counters:
  preemptions, aborted = counters.preemptions, counters.aborted
  if p.swap_out:
    preemptions = add_count(preemptions, "swap", len(p.swap_out))
  if p.recompute:
    preemptions = add_count(preemptions, "recompute", len(p.recompute))
  if host_full:
    aborted = add_count(aborted, ABORT_HOST_FULL, len(host_full))
  return Counters(
      steps=counters.steps + 1, swap_outs=counters.swap_outs + len(p.swap_out),
      swap_out_blocks=counters.swap_out_blocks + out_blocks,
      swap_ins=counters.swap_ins + num_swap_ins, swap_in_blocks=counters.swap_in_blocks + in_blocks,
      preemptions=preemptions, finished=counters.finished, aborted=aborted)
