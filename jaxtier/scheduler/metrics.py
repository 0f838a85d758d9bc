"""Scheduler metrics, derived from the state alone. The engine adds bytes and seconds."""

import dataclasses

from jaxtier.scheduler.state import SchedulerState


@dataclasses.dataclass(frozen=True)
class Metrics:
  """Gauges of the current state and totals since the scheduler started.

  The (name, count) pairs are sorted by name: preemptions by kind ("swap", "recompute"), finished
  requests by stop reason, aborted requests by reason.
  """
  num_running: int
  num_waiting: int
  num_swapped: int
  device_blocks_used: int
  device_blocks_total: int
  host_blocks_used: int
  host_blocks_total: int
  steps: int
  swap_outs: int
  swap_out_blocks: int
  swap_ins: int
  swap_in_blocks: int
  preemptions: tuple[tuple[str, int], ...]
  finished: tuple[tuple[str, int], ...]
  aborted: tuple[tuple[str, int], ...]


def metrics(state: SchedulerState) -> Metrics:
  """Returns the metrics of `state`."""
  counters = state.counters
  return Metrics(
      num_running=len(state.running), num_waiting=len(state.waiting),
      num_swapped=len(state.swapped), device_blocks_used=state.device.num_used,
      device_blocks_total=state.device.num_blocks, host_blocks_used=state.host.num_used,
      host_blocks_total=state.host.num_blocks, steps=counters.steps, swap_outs=counters.swap_outs,
      swap_out_blocks=counters.swap_out_blocks, swap_ins=counters.swap_ins,
      swap_in_blocks=counters.swap_in_blocks, preemptions=counters.preemptions,
      finished=counters.finished, aborted=counters.aborted)
