"""The engine's figures: running totals, the `Engine.stats()` dict and the per-step trace.

The scheduler counts what it decides (steps, swaps, preemptions, prefix hits: `scheduler.metrics`);
the engine adds what only it sees (tokens read back, model calls, seconds) in a `Totals`, once per
step (`Totals.add_step`). `figures` joins both into the stats dict `LLM.stats()` returns and
`jaxtier.engine.doctor` reads; `trace_line` is one step's line of the JSONL trace (`Trace`).
Everything here is plain Python over the plan and the metrics; nothing touches the device.
"""

import dataclasses
import json
from collections.abc import Sequence

from jaxtier import scheduler
from jaxtier.engine.link import TIERS, StepLink
from jaxtier.engine.step_inputs import StepArrays
from jaxtier.scheduler.metrics import prefix_figures


@dataclasses.dataclass
class Totals:
  """Running totals the engine adds to the scheduler's counters, and the pools' peak use."""
  prompt_tokens: int = 0
  generated_tokens: int = 0
  computed_tokens: int = 0
  decode_steps: int = 0
  model_calls: int = 0
  decode_seconds: float = 0.0
  run_seconds: float = 0.0
  max_swap_bytes_per_step: int = 0
  prefill_tokens: int = 0  # tokens computed by steps that prefilled, and their seconds
  prefill_seconds: float = 0.0
  planned_ahead: int = 0  # steps dispatched before the previous step's tokens were read
  device_blocks_peak: int = 0  # blocks requests held (cached blocks give way on demand)
  host_blocks_peak: int = 0
  link_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(TIERS, 0))
  link_seconds: float = 0.0  # link seconds of every step (`jaxtier.engine.link.step_link`)
  link_hidden_seconds: float = 0.0  # the part of them within their steps' compute
  link_stall_seconds: float = 0.0  # the rest: link seconds beyond their steps' compute
  link_stalled_steps: int = 0
  link_max_step_bytes: int = 0

  def add_link(self, step: StepLink) -> None:
    """Counts one step's link traffic and its overlap with compute."""
    for tier, nbytes in step.bytes.items():
      self.link_bytes[tier] += nbytes
    self.link_seconds += step.link_s
    self.link_hidden_seconds += step.hidden_s
    self.link_stall_seconds += step.stall_s
    self.link_stalled_steps += step.stall_s > 0
    self.link_max_step_bytes = max(self.link_max_step_bytes, sum(step.bytes.values()))

  def add_step(self, plan: scheduler.Plan, calls: Sequence[StepArrays], seconds: float,
               m: scheduler.Metrics, block_bytes: int) -> None:
    """Counts one finished step: `plan`, its model calls, its wall time, and the metrics after."""
    self.run_seconds += seconds
    self.computed_tokens += sum(a.num_tokens for a in calls)
    self.model_calls += len(calls)
    if len(plan.decode) and not len(plan.prefill) and not plan.swap_out and not plan.swap_in:
      self.decode_steps += 1
      self.decode_seconds += seconds
    if len(plan.prefill):
      self.prefill_tokens += plan.num_tokens
      self.prefill_seconds += seconds
    self.max_swap_bytes_per_step = max(self.max_swap_bytes_per_step,
                                       _swap_blocks(plan) * block_bytes)
    self.device_blocks_peak = max(self.device_blocks_peak,
                                  m.device_blocks_used - m.device_blocks_evictable)
    self.host_blocks_peak = max(self.host_blocks_peak, m.host_blocks_used - m.host_blocks_cached)


def _swap_blocks(plan: scheduler.Plan) -> int:
  return len(plan.swap_out) + len(plan.swap_in) + len(plan.prefetch) + len(plan.writeback)


def figures(m: scheduler.Metrics, totals: Totals, block_bytes: int,
            swap_seconds: dict[str, float], prefix_caching: bool, host_tier: bool) -> dict:
  """The run's counters, as `Engine.stats()` names them (JSON-serializable): the scheduler's
  metrics `m`, the engine's `totals` and the timed swaps' seconds by direction ("out", "in").
  Free block counts include cached blocks no request uses (they are evicted on demand)."""
  steps = max(m.steps, 1)
  return {
      "steps": m.steps, "model_calls": totals.model_calls, "run_seconds": totals.run_seconds,
      "swap_out_count": m.swap_outs, "swap_in_count": m.swap_ins,
      "swap_out_blocks": m.swap_out_blocks, "swap_in_blocks": m.swap_in_blocks,
      "swap_out_bytes": m.swap_out_blocks * block_bytes,
      "swap_in_bytes": m.swap_in_blocks * block_bytes,
      "swap_seconds": swap_seconds["out"] + swap_seconds["in"],
      "swap_out_seconds": swap_seconds["out"], "swap_in_seconds": swap_seconds["in"],
      "kv_swap_bytes_per_step": (m.swap_out_blocks + m.swap_in_blocks) * block_bytes / steps,
      "kv_swap_bytes_max_step": totals.max_swap_bytes_per_step,
      "preemptions": {"swap": 0, "recompute": 0, **dict(m.preemptions)},
      "running": m.num_running, "waiting": m.num_waiting, "swapped": m.num_swapped,
      "device_blocks_total": m.device_blocks_total,
      "device_blocks_free": m.device_blocks_total - m.device_blocks_used
      + m.device_blocks_evictable,
      "device_blocks_peak_used": totals.device_blocks_peak,
      "host_blocks_total": m.host_blocks_total,
      "host_blocks_free": m.host_blocks_total - m.host_blocks_used + m.host_blocks_cached,
      "host_blocks_peak_used": totals.host_blocks_peak,
      **_prefix_cache_figures(m, block_bytes, prefix_caching, host_tier),
      "requests_finished": sum(n for _, n in m.finished),
      "finished_by_reason": dict(m.finished),
      "requests_aborted": dict(m.aborted),
      "prompt_tokens": totals.prompt_tokens, "generated_tokens": totals.generated_tokens,
      "computed_tokens": totals.computed_tokens,
      "decode_step_seconds_mean": (totals.decode_seconds / totals.decode_steps
                                   if totals.decode_steps else None),
      "steps_planned_ahead": totals.planned_ahead,
      **link_figures(totals, m.steps),
  }


def link_figures(totals: Totals, steps: int) -> dict:
  """The host link's traffic and its overlap with compute (`jaxtier.engine.link`): bytes moved by
  tier (swap-in, swap-out, prefix load, prefix write-back, weight prefetch of the offloaded tail)
  in all and per step, the link seconds they took, the share of those the steps' compute hid
  (None before any link time), and the stall: link time beyond each step's compute, summed, in
  milliseconds."""
  per_step = max(steps, 1)
  return {
      "link_bytes": dict(totals.link_bytes),
      "link_bytes_per_step": {tier: n / per_step for tier, n in totals.link_bytes.items()},
      "link_bytes_max_step": totals.link_max_step_bytes,
      "link_seconds": totals.link_seconds,
      "link_hidden_seconds": totals.link_hidden_seconds,
      "link_hidden_fraction": (totals.link_hidden_seconds / totals.link_seconds
                               if totals.link_seconds > 0 else None),
      "link_stall_ms": totals.link_stall_seconds * 1e3,
      "link_stalled_steps": totals.link_stalled_steps,
  }


def _prefix_cache_figures(m: scheduler.Metrics, block_bytes: int, prefix_caching: bool,
                          host_tier: bool) -> dict:
  """The prefix cache's figures (`scheduler.metrics.prefix_figures`) and how the pools' blocks
  split between cache and requests."""
  return {
      "prefix_caching": prefix_caching,
      "host_prefix_caching": host_tier,
      **prefix_figures(m, block_bytes),
      "device_blocks_cached": m.device_blocks_cached,
      "device_blocks_cached_in_use": m.device_blocks_cached - m.device_blocks_evictable,
      "host_blocks_cached": m.host_blocks_cached,
      "host_blocks_swapped": m.host_blocks_used - m.host_blocks_cached,
  }


def trace_line(plan: scheduler.Plan, m: scheduler.Metrics, seconds: float, elapsed: float,
               block_bytes: int) -> dict:
  """One step's trace record: `plan`, the metrics after it, its wall time, and the seconds since
  the engine started. `jaxtier.engine.doctor.read_trace` reads these fields."""
  swapped_in = len(plan.swap_in) + len(plan.prefetch)
  return {
      "step": plan.step, "time": round(elapsed, 6),
      "step_seconds": round(seconds, 6), "running": m.num_running, "waiting": m.num_waiting,
      "swapped": m.num_swapped,
      "device_blocks_used": m.device_blocks_used - m.device_blocks_evictable,
      "host_blocks_used": m.host_blocks_used - m.host_blocks_cached,
      "swap_out_blocks": len(plan.swap_out), "swap_in_blocks": swapped_in,
      "swap_out_bytes": len(plan.swap_out) * block_bytes,
      "swap_in_bytes": swapped_in * block_bytes,
      "prefill_tokens": plan.prefill.num_tokens, "decode_tokens": plan.decode.num_tokens,
      "preempted": len(plan.preempted), "writeback_blocks": len(plan.writeback),
      "cache_load_blocks": plan.cache_loads,
      "device_blocks_cached": m.device_blocks_cached, "host_blocks_cached": m.host_blocks_cached,
      "finished": len(plan.ended)}


class Trace:
  """A JSONL file that gets one `trace_line` per step, flushed at once so a crashed run keeps
  every step it finished."""

  def __init__(self, path: str):
    self._file = open(path, "a")

  def write(self, line: dict) -> None:
    self._file.write(json.dumps(line) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()
