"""Event transitions `state, event -> state`, and `step`, the one call an engine makes per step.

Engine loop:

    state = scheduler.initial_state(config)
    events = [scheduler.Arrive(request), ...]
    while serving:
      state, plan = scheduler.step(state, events)
      finished = engine.execute(plan)          # swaps, compute, sampling
      events = [scheduler.StepFinished(finished)] + new_arrivals_and_aborts

Nothing here reads a clock or draws a random number: times arrive inside events.
"""

import bisect
import dataclasses
from collections.abc import Iterable

from jaxtier.scheduler import allocator
from jaxtier.scheduler import disk_index as disk
from jaxtier.scheduler import policies
from jaxtier.scheduler import prefix
from jaxtier.scheduler.planning import schedule
from jaxtier.scheduler.request import (ABORT_CLIENT, ABORT_TOO_LARGE, ABORTED, FINISH_LENGTH,
                                       FINISHED, Ended, Request, Seq)
from jaxtier.scheduler.state import (Abort, Arrive, DiskIndexed, DiskLoaded, Event, Plan, Rates,
                                     Release, SchedulerState, StepFinished, Stop, find, with_ended)


def step(state: SchedulerState, events: Iterable[Event] = ()) -> tuple[SchedulerState, Plan]:
  """Applies `events` in order, then plans the next step."""
  for event in events:
    state = apply_event(state, event)
  return schedule(state)


def apply_event(state: SchedulerState, event: Event) -> SchedulerState:
  """Returns the state after one event; its effects are reported in the next plan."""
  if isinstance(event, Arrive):
    state = _arrive(state, event.request)
    if event.held and find(state, event.request.request_id) is not None:
      state = dataclasses.replace(state, held=state.held | {event.request.request_id})
    return state
  if isinstance(event, Release):
    return dataclasses.replace(state, held=state.held - {event.request_id})
  if isinstance(event, StepFinished):
    return _step_finished(state, event)
  if isinstance(event, Abort):
    return _end(state, event.request_id, Ended(event.request_id, ABORTED, ABORT_CLIENT))
  if isinstance(event, Stop):
    return _end(state, event.request_id, Ended(event.request_id, FINISHED, event.reason))
  if isinstance(event, Rates):
    return dataclasses.replace(state, rates=event)
  if isinstance(event, DiskIndexed):
    return disk.indexed(state, event)
  if isinstance(event, DiskLoaded):
    return disk.loaded(state, event)
  raise ValueError(f"event={event!r}: expected an Arrive, Release, StepFinished, Abort, Stop, "
                   "Rates, DiskIndexed or DiskLoaded")


def _arrive(state: SchedulerState, request: Request) -> SchedulerState:
  config = state.config
  if find(state, request.request_id) is not None:
    raise ValueError(f"request_id={request.request_id!r}: expected an id not used by a live request")
  need = allocator.blocks_for(request.max_kv_tokens, config.block_size)
  order = state.next_order
  state = dataclasses.replace(state, next_order=order + 1)
  if need > config.request_block_cap:
    detail = (f"prompt_len={request.prompt_len} + max_tokens={request.max_tokens} needs {need} KV "
              f"blocks of {config.block_size} tokens; a request may hold at most "
              f"{config.request_block_cap}")
    return with_ended(state, (Ended(request.request_id, ABORTED, ABORT_TOO_LARGE, detail),))
  hashes = ()
  if config.enable_prefix_caching and request.prompt_token_ids:
    hashes = prefix.block_hashes(request.prompt_token_ids, config.block_size)
  seq = Seq(request, order, 0, 0, (), hashes)
  at = bisect.bisect(state.waiting, policies.queue_key(seq), key=policies.queue_key)
  return dataclasses.replace(state, waiting=state.waiting[:at] + (seq,) + state.waiting[at:])


def _step_finished(state: SchedulerState, event: StepFinished) -> SchedulerState:
  plan = state.in_flight
  if plan is None:
    raise ValueError("StepFinished with no plan in flight: expected one StepFinished per plan")
  scheduled = dict(zip(plan.decode.request_ids, plan.decode.ends))
  scheduled.update(zip(plan.prefill.request_ids, plan.prefill.ends))
  sampling = set(plan.decode.request_ids)
  sampling.update(i for i, s in zip(plan.prefill.request_ids, plan.prefill.samples) if s)
  stopped = _check_finished(state, event, sampling)
  block_size = state.config.block_size
  device, cache = state.device, state.device_cache
  running, ended, releasing, registered = [], [], [], []
  for seq in state.running:
    request = seq.request
    end = scheduled.get(request.request_id)
    if end is not None:
      sampled = end == request.prompt_len + seq.num_generated
      seq = Seq(request, seq.order, end, seq.num_generated + sampled, seq.blocks, seq.hashes,
                seq.num_registered)
    # The step wrote these blocks' KV (or, for a prefetched swap-in, copied it): share them now.
    if seq.num_registered < len(seq.hashes) and seq.num_computed >= (seq.num_registered + 1) * block_size:
      full = min(seq.num_computed // block_size, len(seq.hashes))
      for i in range(seq.num_registered, full):
        cache, added = prefix.register(cache, seq.blocks[i], seq.hashes[i], referenced=True)
        if added:
          registered.append((seq.blocks[i], seq.hashes[i]))
      seq = seq._replace(num_registered=full)
    if end is not None:
      reason = stopped.get(request.request_id)
      if reason is None and seq.num_generated >= request.max_tokens:
        reason = FINISH_LENGTH
      if reason is not None:
        ended.append(Ended(request.request_id, FINISHED, reason))
        releasing.append(seq.blocks)
        continue
    running.append(seq)
  if registered:
    device = allocator.reassign(device, [block for block, _ in registered], prefix.CACHED)
  released = []
  for blocks in releasing:
    cache, private = prefix.release(cache, blocks)
    released.extend(private)
  if released:
    device, _ = allocator.update(device, release=released)
  state = dataclasses.replace(state, running=tuple(running), device=device, device_cache=cache,
                              in_flight=None, freed_device=state.freed_device + tuple(released))
  state = disk.written_through(state, registered)
  return with_ended(state, tuple(ended)) if ended else state


def _check_finished(state: SchedulerState, event: StepFinished, sampling: set) -> dict:
  """Returns the stop reasons by request id of the live requests in `event.finished`."""
  stopped = {}
  for request_id, reason in event.finished:
    if request_id in stopped:
      raise ValueError(f"finished names request {request_id!r} twice: expected it once")
    if find(state, request_id) is None:
      continue  # the client aborted it while the step ran
    if request_id not in sampling:
      raise ValueError(f"finished names request {request_id!r}, which sampled no token in step "
                       f"{state.in_flight.step}: expected only requests whose range had samples=True")
    stopped[request_id] = reason
  return stopped


def _end(state: SchedulerState, request_id, ended: Ended) -> SchedulerState:
  """Ends a live request at once (`Abort`, `Stop`), wherever it is, and frees its blocks."""
  found = find(state, request_id)
  if found is None:
    return state
  place, seq = found
  remaining = tuple(s for s in getattr(state, place) if s.request_id != request_id)
  state = dataclasses.replace(state, **{place: remaining}, held=state.held - {request_id})
  if place == "running":
    cache, private = prefix.release(state.device_cache, seq.blocks)
    device, _ = allocator.update(state.device, release=private)
    state = dataclasses.replace(state, device=device, device_cache=cache,
                                freed_device=state.freed_device + private)
  elif place == "swapped":
    host, _ = allocator.update(state.host, release=seq.blocks)
    state = dataclasses.replace(state, host=host, freed_host=state.freed_host + seq.blocks)
  return with_ended(state, (ended,))


def reset_prefix_cache(state: SchedulerState) -> SchedulerState:
  """Forgets every cached block that no request references, in both tiers, and frees them (and
  the disk tier's pending writes and fills; the disk keeps its files).

  Blocks shared by running requests stay cached until those requests let go of them. Called after
  the pools' contents are lost (a failed step) or by a user who wants a cold cache.
  """
  if state.in_flight is not None:
    raise ValueError(f"plan {state.in_flight.step} is in flight: expected its StepFinished before "
                     "resetting the prefix cache")
  device_cache, device_blocks = prefix.drop_unreferenced(state.device_cache)
  host_cache, host_blocks = prefix.drop_unreferenced(state.host_cache)
  device, host = state.device, state.host
  if device_blocks:
    device, _ = allocator.update(device, release=device_blocks)
  if host_blocks:
    host, _ = allocator.update(host, release=host_blocks)
  return dataclasses.replace(state, device=device, host=host, device_cache=device_cache,
                             host_cache=host_cache, disk_writes=(), disk_fills=(),
                             freed_device=state.freed_device + device_blocks,
                             freed_host=state.freed_host + host_blocks)
