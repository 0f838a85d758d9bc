"""Scheduler metrics, derived from the state alone. The engine adds bytes and seconds."""

import dataclasses

from jaxtier.scheduler.state import Counters, SchedulerState


@dataclasses.dataclass(frozen=True, kw_only=True)
class Metrics(Counters):
  """The scheduler's `Counters` (totals since it started) and gauges of the current state.

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
  device_blocks_cached: int  # prefix-cache blocks on the device (used, shared or not)
  device_blocks_evictable: int  # of those, the ones no request references
  host_blocks_cached: int


def metrics(state: SchedulerState) -> Metrics:
  """Returns the metrics of `state`."""
  counters = {field.name: getattr(state.counters, field.name)
              for field in dataclasses.fields(Counters)}
  return Metrics(
      **counters, num_running=len(state.running), num_waiting=len(state.waiting),
      num_swapped=len(state.swapped), device_blocks_used=state.device.num_used,
      device_blocks_total=state.device.num_blocks, host_blocks_used=state.host.num_used,
      host_blocks_total=state.host.num_blocks, device_blocks_cached=state.device_cache.num_cached,
      device_blocks_evictable=state.device_cache.num_evictable,
      host_blocks_cached=state.host_cache.num_cached)


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
