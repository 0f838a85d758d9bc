"""Replays a workload through the real scheduler with a cost model instead of a model.

The simulated engine runs each plan in the order `state` prescribes and charges:
  compute   step_base_s + per_token_s x tokens, for a step that computes anything (prefix-cache
            hits are never computed, so they shrink this term);
  link      swap-outs, prefix-cache write-backs and blocking swap-ins before compute; prefetches
            (swap-ins and host-tier prefix hits alike) and weight prefetch overlap compute, so a
            step takes  out + writeback + in + max(compute, prefetch).
A request stops when it has generated its `output_len` tokens (or reaches max_tokens).
Workloads are synthetic (seeded), multi-turn chats (seeded, with prompt token ids so that prefix
caching has something to match, and each turn arriving after the previous one ended), or read from
a JSONL trace; randomness lives here, never in the scheduler.
"""

import collections
import dataclasses
import heapq
import json
import math
import random
from collections.abc import Iterable

from jaxtier.scheduler.metrics import metrics, prefix_figures
from jaxtier.scheduler.request import FINISHED, Request, RequestId
from jaxtier.scheduler.scheduler_config import SchedulerConfig
from jaxtier.scheduler.state import Arrive, Plan, Rates, StepFinished, initial_state
from jaxtier.scheduler.transitions import step

LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "exponential")


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds per step. `block_bytes` is the size of one KV block
  (jaxtier.common.kv_bytes.kv_block_bytes)."""
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
    blocking = (len(plan.swap_out) + len(plan.writeback) + len(plan.swap_in)) * per_block
    prefetch = len(plan.prefetch) * per_block
    overlapped = prefetch + plan.weight_prefetch_bytes / self.link_bytes_per_s
    return blocking + max(compute, overlapped), blocking + prefetch

  def rates(self) -> Rates | None:
    """The rates a real engine would measure on this hardware, so that the scheduler weighs loading
    host-tier prefix hits against recomputing them as it would in service; None when prefill costs
    nothing per token (the scheduler then always loads)."""
    if not self.per_token_s > 0:
      return None
    return Rates(link_bytes_per_s=self.link_bytes_per_s, prefill_tokens_per_s=1 / self.per_token_s)


@dataclasses.dataclass(frozen=True)
class WorkItem:
  """One request of a workload and how it behaves.

  Attributes:
    request: what the client sends.
    output_len: tokens generated before the model stops on its own.
    after: a request id of an earlier item, or None. When given, this item arrives `think_time_s`
      after that request ended (finished or aborted), as a chat's next turn follows the reply to the
      previous one; its request's arrival_time is replaced by that moment. Otherwise it arrives at
      its request's arrival_time.
    think_time_s: seconds between the end of `after` and this arrival.
  """
  request: Request
  output_len: int
  after: RequestId | None = None
  think_time_s: float = 0.0

  def __post_init__(self):
    think = self.think_time_s
    if not (isinstance(think, (int, float)) and 0 <= think < math.inf):
      raise ValueError(f"think_time_s={think!r}: expected a finite number >= 0")
    if think and self.after is None:
      raise ValueError(f"think_time_s={think!r} with after=None: a think time needs the request "
                       "it follows; expected after to name one, or think_time_s=0")


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


def chat_workload(num_conversations: int, min_turns: int, max_turns: int, system_len: int,
                  user_len: int, output_len: int, num_system_prompts: int = 1, vocab: int = 32000,
                  arrival_rate: float = 0.0, think_time_s: float = 0.0, seed: int = 0
                  ) -> tuple[WorkItem, ...]:
  """Multi-turn conversations whose prompts grow by the previous turns, for prefix caching.

  Each conversation opens with one of `num_system_prompts` shared system prompts of `system_len`
  tokens and has a number of turns drawn uniformly from [min_turns, max_turns]. Turn k's prompt is
  the system prompt, then every earlier turn's user message and reply, then its own user message:
  so it starts with the whole prompt of turn k - 1, which a prefix cache can reuse. User messages
  are exactly `user_len` tokens and replies exactly `output_len` (every turn has max_tokens =
  output_len and stops there), so the work without caching follows from the lengths alone. Replies
  are synthetic ids standing for what the model said: the scheduler only counts generated tokens,
  and the ids matter only where the next turn's prompt repeats them.

  First turns arrive by a Poisson process of `arrival_rate` per second (0: all at time 0); each
  later turn arrives `think_time_s` after the previous turn of its conversation ended
  (`WorkItem.after`). Request ids read "c<conversation>t<turn>", both counted from 0. Token ids are
  drawn from [0, vocab) by `random.Random(seed)`.
  """
  _check_chat(num_conversations, min_turns, max_turns, system_len, user_len, output_len,
              num_system_prompts, vocab, arrival_rate, think_time_s)
  rng = random.Random(seed)
  systems = [_draw_tokens(rng, system_len, vocab) for _ in range(num_system_prompts)]
  clock, items = 0.0, []
  for c in range(num_conversations):
    if arrival_rate:
      clock += rng.expovariate(arrival_rate)
    context = systems[rng.randrange(num_system_prompts)]
    previous = None
    for t in range(rng.randint(min_turns, max_turns)):
      prompt = context + _draw_tokens(rng, user_len, vocab)
      request = Request(f"c{c}t{t}", len(prompt), output_len, arrival_time=clock,
                        prompt_token_ids=prompt)
      think = think_time_s if previous is not None else 0.0
      items.append(WorkItem(request, output_len, previous, think))
      context = prompt + _draw_tokens(rng, output_len, vocab)
      previous = request.request_id
  return tuple(items)


def _check_chat(num_conversations, min_turns, max_turns, system_len, user_len, output_len,
                num_system_prompts, vocab, arrival_rate, think_time_s):
  for name, value, minimum in (("num_conversations", num_conversations, 1),
                               ("min_turns", min_turns, 1), ("max_turns", max_turns, min_turns),
                               ("system_len", system_len, 0), ("user_len", user_len, 1),
                               ("output_len", output_len, 1),
                               ("num_system_prompts", num_system_prompts, 1), ("vocab", vocab, 1)):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
  for name, value in (("arrival_rate", arrival_rate), ("think_time_s", think_time_s)):
    if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
      raise ValueError(f"{name}={value!r}: expected a finite number >= 0")


def _draw_tokens(rng: random.Random, length: int, vocab: int) -> tuple[int, ...]:
  return tuple(rng.randrange(vocab) for _ in range(length))


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
  """What the simulated engine observes; local to one `replay` call."""
  first_token: dict = dataclasses.field(default_factory=dict)
  last_token: dict = dataclasses.field(default_factory=dict)
  generated: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  furthest: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first_start: dict = dataclasses.field(default_factory=dict)  # first position it computed
  started: dict = dataclasses.field(default_factory=dict)  # start of its first computing step
  ended: dict = dataclasses.field(default_factory=dict)
  ended_at: dict = dataclasses.field(default_factory=dict)
  computed_tokens: int = 0
  link_seconds: float = 0.0
  peak_device_blocks: int = 0
  peak_host_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class RequestTimes:
  """When one request went through the simulated engine, in the workload's clock (seconds).

  Attributes:
    arrival: when it arrived: its arrival_time, or for a dependent item the end of the request it
      follows plus its think time.
    started: the start of the first step that computed any of its tokens (None: none did).
    first_token, last_token: when its first and last tokens were generated (None: none were).
    ended: when the scheduler reported it finished or aborted.
  """
  arrival: float
  started: float | None
  first_token: float | None
  last_token: float | None
  ended: float


@dataclasses.dataclass(frozen=True)
class Replay:
  """A workload run to the end: the report (see `_report`) and each request's times by id."""
  report: dict
  times: dict


def simulate(config: SchedulerConfig, cost: CostModel, workload: tuple[WorkItem, ...],
             max_steps: int = 10_000_000) -> dict:
  """Runs `workload` to the end and returns the report (see `_report`)."""
  return replay(config, cost, workload, max_steps).report


def replay(config: SchedulerConfig, cost: CostModel, workload: tuple[WorkItem, ...],
           max_steps: int = 10_000_000) -> Replay:
  """Runs `workload` to the end; returns the report and every request's times.

  Requests reach the scheduler at the first step boundary at or after their arrival moment (in
  order of that moment, then of their place in the workload); when nothing is live, the clock jumps
  to the next arrival. A dependent item's moment is known only once the request it follows ended,
  so it waits on a heap until then. The first step also hands the scheduler the cost model's rates,
  as a real engine measures them, for its choice between loading and recomputing host-tier hits.
  """
  if not workload:
    raise ValueError("workload is empty: expected at least one request")
  followers = _followers(workload)
  items = sorted((item.request.arrival_time, position, item.request)
                 for position, item in enumerate(workload) if item.after is None)
  output_len = {item.request.request_id: item.output_len for item in workload}
  state, tally = initial_state(config), _Tally()
  rates = cost.rates()
  now, arrived, stopped, steps = 0.0, 0, (), 0
  pending: list[tuple[float, int, Request]] = []  # followers whose `after` ended, by moment
  delivered: dict[RequestId, Request] = {}  # as they arrived, in that order
  while len(tally.ended) < len(workload):
    if steps == max_steps:
      raise RuntimeError(f"simulation did not finish in max_steps={max_steps}")
    if not (state.waiting or state.running or state.swapped):
      now = max(now, _next_arrival(items, arrived, pending, now))
    events = [StepFinished(stopped)] if state.in_flight else []
    if steps == 0 and rates is not None:
      events.append(rates)
    requests, arrived = _due(items, arrived, pending, now)
    events.extend(Arrive(request) for request in requests)
    delivered.update((request.request_id, request) for request in requests)
    state, plan = step(state, events)
    steps += 1
    for ended in plan.ended:
      tally.ended[ended.request_id] = ended
      tally.ended_at[ended.request_id] = now
      for position, item in followers.get(ended.request_id, ()):
        moment = now + item.think_time_s
        heapq.heappush(pending, (moment, position,
                                 dataclasses.replace(item.request, arrival_time=moment)))
    seconds, link_seconds = cost.step_seconds(plan)
    _note_started(plan, now, tally)
    now += seconds
    tally.link_seconds += link_seconds
    stopped = _observe(plan, now, output_len, tally)
    usage = metrics(state)
    tally.peak_device_blocks = max(tally.peak_device_blocks, usage.device_blocks_used)
    tally.peak_host_blocks = max(tally.peak_host_blocks, usage.host_blocks_used)
  requests = list(delivered.values())  # in arrival order
  return Replay(_report(config, cost, requests, state, tally, steps), _times(requests, tally))


def _followers(workload: tuple[WorkItem, ...]) -> dict[RequestId, tuple[tuple[int, WorkItem], ...]]:
  """Returns (position, item) of the dependent items by the request id they follow.

  Raises:
    ValueError: an `after` that names no earlier item, or a request id used twice.
  """
  seen, followers = set(), collections.defaultdict(list)
  for position, item in enumerate(workload):
    if item.after is not None:
      if item.after not in seen:
        raise ValueError(f"workload item {position} ({item.request.request_id!r}): after="
                         f"{item.after!r} names no earlier item; expected the request id of an "
                         f"item among the first {position}")
      followers[item.after].append((position, item))
    if item.request.request_id in seen:
      raise ValueError(f"workload item {position}: request_id={item.request.request_id!r} is used "
                       "by an earlier item; expected unique request ids")
    seen.add(item.request.request_id)
  return {key: tuple(value) for key, value in followers.items()}


def _next_arrival(items: list, arrived: int, pending: list, now: float) -> float:
  """The earliest arrival moment still to come (`now` when none is known yet)."""
  moments = [items[arrived][0]] if arrived < len(items) else []
  if pending:
    moments.append(pending[0][0])
  return min(moments, default=now)


def _due(items: list, arrived: int, pending: list, now: float) -> tuple[list[Request], int]:
  """Returns the requests whose moment has come, in (moment, workload position) order, and how many
  independent items have arrived; pops the dependent ones off `pending`."""
  fresh = []
  while arrived < len(items) and items[arrived][0] <= now:
    fresh.append(items[arrived])
    arrived += 1
  followers = []
  while pending and pending[0][0] <= now:
    followers.append(heapq.heappop(pending))
  return [request for _, _, request in heapq.merge(fresh, followers)], arrived


def _note_started(plan: Plan, now: float, tally: _Tally):
  for batch in (plan.prefill, plan.decode):
    for request_id, start in zip(batch.request_ids, batch.starts):
      tally.started.setdefault(request_id, now)
      tally.first_start.setdefault(request_id, start)


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


def _times(requests: list[Request], tally: _Tally) -> dict:
  return {r.request_id: RequestTimes(r.arrival_time, tally.started.get(r.request_id),
                                     tally.first_token.get(r.request_id),
                                     tally.last_token.get(r.request_id),
                                     tally.ended_at[r.request_id]) for r in requests}


def _report(config: SchedulerConfig, cost: CostModel, requests: list[Request], state,
            tally: _Tally, steps: int) -> dict:
  """The figures of one run. TTFT counts from each request's arrival_time as it arrived.

  `recomputed_tokens` are the tokens computed more than once: beyond one pass over each request's
  positions from where its first computing step started, so recompute preemptions count and prefix
  hits do not. `prefix_*` are the prefix cache's totals, with hit rates over the prompt tokens it
  looked up; `swap_seconds` is the link time of every KV copy (swaps, write-backs, hit loads).
  """
  usage = metrics(state)
  finished = [r for r in requests if tally.ended[r.request_id].status == FINISHED]
  start = min(r.arrival_time for r in requests)
  makespan = max(tally.last_token.values(), default=start) - start
  ttft = [tally.first_token[r.request_id] - r.arrival_time for r in finished]
  tpot = [(tally.last_token[r.request_id] - tally.first_token[r.request_id])
          / (tally.generated[r.request_id] - 1) for r in finished if tally.generated[r.request_id] > 1]
  output_tokens = sum(tally.generated[r.request_id] for r in finished)
  swap_blocks = usage.swap_out_blocks + usage.swap_in_blocks
  first_pass = sum(end - tally.first_start[rid] for rid, end in tally.furthest.items())
  return {
      "requests": len(requests), "finished": len(finished), "aborted": dict(usage.aborted),
      "steps": steps, "makespan_s": makespan,
      "throughput_tokens_per_s": output_tokens / makespan if makespan else 0.0,
      "throughput_requests_per_s": len(finished) / makespan if makespan else 0.0,
      "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot),
      "swap_outs": usage.swap_outs, "swap_ins": usage.swap_ins, "swap_count": usage.swap_outs
      + usage.swap_ins, "swap_blocks": swap_blocks, "swap_bytes": swap_blocks * cost.block_bytes,
      "swap_seconds": tally.link_seconds, "preemptions": dict(usage.preemptions),
      "computed_tokens": tally.computed_tokens,
      "recomputed_tokens": tally.computed_tokens - first_pass,
      "peak_device_blocks": tally.peak_device_blocks, "peak_host_blocks": tally.peak_host_blocks,
      "device_blocks": config.num_device_blocks, "host_blocks": config.num_host_blocks,
      "block_bytes": cost.block_bytes,
  } | _prefix_report(config, cost, usage)


def _prefix_report(config: SchedulerConfig, cost: CostModel, usage) -> dict:
  return {"enable_prefix_caching": config.enable_prefix_caching,
          "host_prefix_caching": config.host_prefix_caching,
          **prefix_figures(usage, cost.block_bytes)}


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
