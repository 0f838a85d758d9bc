"""Replays a workload through the real scheduler with a cost model instead of a model.

The simulated engine runs each plan in the order `state` prescribes and charges:
  compute   step_base_s + per_token_s x tokens, for a step that computes anything;
  link      swap-outs and blocking swap-ins before compute; prefetches and weight prefetch overlap
            compute, so a step takes  out + in + max(compute, prefetch).
A request stops when it has generated its `output_len` tokens (or reaches max_tokens).
Workloads are synthetic (seeded) or read from a JSONL trace; randomness lives here, never in the
scheduler.
"""

import collections
import dataclasses
import json
import math
import random
from collections.abc import Iterable

from jaxtier.scheduler.config import SchedulerConfig
from jaxtier.scheduler.metrics import metrics
from jaxtier.scheduler.request import FINISHED, Request
from jaxtier.scheduler.state import Arrive, Plan, StepFinished, initial_state
from jaxtier.scheduler.transitions import step

LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "exponential")


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds per step. `block_bytes` is the size of one KV block (jaxtier.kv_bytes.kv_block_bytes)."""
  step_base_s: float
  per_token_s: float
  link_bytes_per_s: float
  block_bytes: int

  def __post_init__(self):
    for name in ("step_base_s", "per_token_s"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name}={getattr(self, name)!r}: expected a number >= 0")
    if not self.link_bytes_per_s > 0:
      raise ValueError(f"link_bytes_per_s={self.link_bytes_per_s!r}: expected a number > 0")

  def step_seconds(self, plan: Plan) -> tuple[float, float]:
    """Returns (step seconds, link seconds spent on KV copies) for one plan."""
    tokens = plan.num_tokens
    compute = self.step_base_s + self.per_token_s * tokens if tokens else 0.0
    per_block = self.block_bytes / self.link_bytes_per_s
    blocking = (len(plan.swap_out) + len(plan.swap_in)) * per_block
    prefetch = len(plan.prefetch) * per_block
    overlapped = prefetch + plan.weight_prefetch_bytes / self.link_bytes_per_s
    return blocking + max(compute, overlapped), blocking + prefetch


@dataclasses.dataclass(frozen=True)
class WorkItem:
  request: Request
  output_len: int  # tokens generated before the model stops on its own


def synthetic_workload(num_requests: int, arrival_rate: float, prompt_len: float, output_len: float,
                       distribution: str, max_tokens: int, seed: int) -> tuple[WorkItem, ...]:
  """Poisson arrivals (`arrival_rate` per second; 0: all at time 0) with lengths of the given means.

  `distribution` is "fixed", "uniform" (over [mean / 2, 3 mean / 2]) or "exponential". `max_tokens`
  0 gives each request max_tokens = its output length.
  """
  if distribution not in LENGTH_DISTRIBUTIONS:
    raise ValueError(f"distribution={distribution!r}: expected one of {LENGTH_DISTRIBUTIONS}")
  if num_requests < 1 or arrival_rate < 0 or prompt_len < 1 or output_len < 1 or max_tokens < 0:
    raise ValueError(f"num_requests={num_requests}, arrival_rate={arrival_rate}, prompt_len="
                     f"{prompt_len}, output_len={output_len}, max_tokens={max_tokens}: expected "
                     "num_requests >= 1, lengths >= 1, rate and max_tokens >= 0")
  rng = random.Random(seed)
  clock, items = 0.0, []
  for i in range(num_requests):
    if arrival_rate:
      clock += rng.expovariate(arrival_rate)
    prompt = _draw_length(rng, distribution, prompt_len)
    output = _draw_length(rng, distribution, output_len)
    limit = max_tokens or output
    items.append(WorkItem(Request(i, prompt, limit, arrival_time=clock), min(output, limit)))
  return tuple(items)


def _draw_length(rng: random.Random, distribution: str, mean: float) -> int:
  if distribution == "fixed":
    return max(round(mean), 1)
  if distribution == "uniform":
    return max(round(rng.uniform(mean / 2, 3 * mean / 2)), 1)
  return max(round(rng.expovariate(1 / mean)), 1)


def read_trace(lines: Iterable[str]) -> tuple[WorkItem, ...]:
  """Reads JSONL lines {"arrival_time", "prompt_len", "output_len"[, "max_tokens", "priority",
  "predicted_output_len", "request_id"]}; max_tokens defaults to output_len."""
  items = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    record = json.loads(line)
    missing = {"arrival_time", "prompt_len", "output_len"} - set(record)
    if missing:
      raise ValueError(f"trace line {number}: missing {sorted(missing)}; expected arrival_time, "
                       "prompt_len and output_len")
    output = int(record["output_len"])
    request = Request(record.get("request_id", number), int(record["prompt_len"]),
                      int(record.get("max_tokens", output)), float(record["arrival_time"]),
                      int(record.get("priority", 0)), record.get("predicted_output_len"))
    items.append(WorkItem(request, min(output, request.max_tokens)))
  return tuple(items)


@dataclasses.dataclass
class _Tally:
  """What the simulated engine observes; local to one `simulate` call."""
  first_token: dict = dataclasses.field(default_factory=dict)
  last_token: dict = dataclasses.field(default_factory=dict)
  generated: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  furthest: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  ended: dict = dataclasses.field(default_factory=dict)
  computed_tokens: int = 0
  link_seconds: float = 0.0
  peak_device_blocks: int = 0
  peak_host_blocks: int = 0


def simulate(config: SchedulerConfig, cost: CostModel, workload: tuple[WorkItem, ...],
             max_steps: int = 10_000_000) -> dict:
  """Runs `workload` to the end and returns the report (see `_report`)."""
  if not workload:
    raise ValueError("workload is empty: expected at least one request")
  items = sorted(workload, key=lambda item: item.request.arrival_time)
  output_len = {item.request.request_id: item.output_len for item in items}
  state, tally = initial_state(config), _Tally()
  now, arrived, stopped, steps = 0.0, 0, (), 0
  while len(tally.ended) < len(items):
    if steps == max_steps:
      raise RuntimeError(f"simulation did not finish in max_steps={max_steps}")
    if not (state.waiting or state.running or state.swapped) and arrived < len(items):
      now = max(now, items[arrived].request.arrival_time)
    events = [StepFinished(stopped)] if state.in_flight else []
    while arrived < len(items) and items[arrived].request.arrival_time <= now:
      events.append(Arrive(items[arrived].request))
      arrived += 1
    state, plan = step(state, events)
    steps += 1
    tally.ended.update((e.request_id, e) for e in plan.ended)
    seconds, link_seconds = cost.step_seconds(plan)
    now += seconds
    tally.link_seconds += link_seconds
    stopped = _observe(plan, now, output_len, tally)
    usage = metrics(state)
    tally.peak_device_blocks = max(tally.peak_device_blocks, usage.device_blocks_used)
    tally.peak_host_blocks = max(tally.peak_host_blocks, usage.host_blocks_used)
  return _report(config, cost, items, state, tally, steps)


def _observe(plan: Plan, now: float, output_len: dict, tally: _Tally) -> tuple:
  """Records the tokens a plan produced; returns the requests that stop on them."""
  stopped = []
  for batch in (plan.prefill, plan.decode):
    tally.computed_tokens += batch.num_tokens
    for request_id, end, sampled in zip(batch.request_ids, batch.ends, batch.samples):
      tally.furthest[request_id] = max(tally.furthest[request_id], end)
      if not sampled:
        continue
      tally.generated[request_id] += 1
      tally.first_token.setdefault(request_id, now)
      tally.last_token[request_id] = now
      if tally.generated[request_id] == output_len[request_id]:
        stopped.append((request_id, "stop"))
  return tuple(stopped)


def _report(config: SchedulerConfig, cost: CostModel, items: list[WorkItem], state, tally: _Tally,
            steps: int) -> dict:
  usage = metrics(state)
  finished = [i.request for i in items if tally.ended[i.request.request_id].status == FINISHED]
  start = min(i.request.arrival_time for i in items)
  makespan = max(tally.last_token.values(), default=start) - start
  ttft = [tally.first_token[r.request_id] - r.arrival_time for r in finished]
  tpot = [(tally.last_token[r.request_id] - tally.first_token[r.request_id])
          / (tally.generated[r.request_id] - 1) for r in finished if tally.generated[r.request_id] > 1]
  output_tokens = sum(tally.generated[r.request_id] for r in finished)
  swap_blocks = usage.swap_out_blocks + usage.swap_in_blocks
  return {
      "requests": len(items), "finished": len(finished), "aborted": dict(usage.aborted),
      "steps": steps, "makespan_s": makespan,
      "throughput_tokens_per_s": output_tokens / makespan if makespan else 0.0,
      "throughput_requests_per_s": len(finished) / makespan if makespan else 0.0,
      "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot),
      "swap_outs": usage.swap_outs, "swap_ins": usage.swap_ins, "swap_count": usage.swap_outs
      + usage.swap_ins, "swap_blocks": swap_blocks, "swap_bytes": swap_blocks * cost.block_bytes,
      "swap_seconds": tally.link_seconds, "preemptions": dict(usage.preemptions),
      "computed_tokens": tally.computed_tokens,
      "recomputed_tokens": tally.computed_tokens - sum(tally.furthest.values()),
      "peak_device_blocks": tally.peak_device_blocks, "peak_host_blocks": tally.peak_host_blocks,
      "device_blocks": config.num_device_blocks, "host_blocks": config.num_host_blocks,
      "block_bytes": cost.block_bytes,
  }


def _percentiles(values: list[float]) -> dict:
  if not values:
    return {}
  ordered = sorted(values)
  return {f"p{q}": _percentile(ordered, q) for q in (50, 90, 99)} | {"mean": sum(values) / len(values)}


def _percentile(ordered: list[float], q: float) -> float:
  """Linear interpolation between the closest ranks."""
  position = (len(ordered) - 1) * q / 100
  low, high = math.floor(position), math.ceil(position)
  return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
