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
  device_blocks_cached: int = 0  # prefix-cache blocks on the device (used, shared or not)
  device_blocks_evictable: int = 0  # of those, the ones no request references
  host_blocks_cached: int = 0
  prefix_query_tokens: int = 0
  device_hit_tokens: int = 0
  host_hit_tokens: int = 0
  host_hit_recomputed_tokens: int = 0
  writeback_blocks: int = 0
  cache_load_blocks: int = 0
  device_cache_evictions: int = 0
  host_cache_evictions: int = 0


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
      finished=counters.finished, aborted=counters.aborted,
      device_blocks_cached=state.device_cache.num_cached,
      device_blocks_evictable=state.device_cache.num_evictable,
      host_blocks_cached=state.host_cache.num_cached,
      prefix_query_tokens=counters.prefix_query_tokens,
      device_hit_tokens=counters.device_hit_tokens, host_hit_tokens=counters.host_hit_tokens,
      host_hit_recomputed_tokens=counters.host_hit_recomputed_tokens,
      writeback_blocks=counters.writeback_blocks, cache_load_blocks=counters.cache_load_blocks,
      device_cache_evictions=counters.device_cache_evictions,
      host_cache_evictions=counters.host_cache_evictions)


def prefix_figures(m: Metrics, block_bytes: int) -> dict:
  """The prefix cache's figures, as the engine's stats and the simulator's report name them: hit
  tokens and rates per tier (over the prompt tokens looked up), host hits recomputed, write-back
  and load blocks and bytes, evictions per tier."""
  query = m.prefix_query_tokens
  return {
      "prefix_query_tokens": query,
      "prefix_device_hit_tokens": m.device_hit_tokens,
      "prefix_host_hit_tokens": m.host_hit_tokens,
      "prefix_device_hit_rate": m.device_hit_tokens / query if query else 0.0,
      "prefix_host_hit_rate": m.host_hit_tokens / query if query else 0.0,
      "prefix_host_hit_recomputed_tokens": m.host_hit_recomputed_tokens,
      "prefix_writeback_blocks": m.writeback_blocks,
      "prefix_writeback_bytes": m.writeback_blocks * block_bytes,
      "prefix_load_blocks": m.cache_load_blocks,
      "prefix_load_bytes": m.cache_load_blocks * block_bytes,
      "prefix_device_evictions": m.device_cache_evictions,
      "prefix_host_evictions": m.host_cache_evictions,
  }
