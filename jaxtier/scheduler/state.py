"""Scheduler state, the events that change it and the plans it hands to the engine: all plain data.

Executing a plan. The engine applies the fields of a `Plan` in this order:
  0. `disk_writes`: copy each device block out for the disk tier's writer (device -> host), and
     `disk_fills`: put each block read from disk in its host block (no device work).
  1. `swap_out` and `writeback`: copy each device block to its host block (device -> host).
  2. `swap_in`: copy each host block to its device block (host -> device).
  3. compute `prefill` and `decode`: each sequence computes tokens [start, end) into its block table.
  4. `prefetch`: copy host -> device, overlapping step 3; it must finish before the next plan's step 1.
`writeback` copies prefix-cache blocks evicted from the device to the host tier; host-tier hits are
copies like any swap-in (in `prefetch`, or `swap_in` without prefetching), `cache_loads` of them.
Device blocks freed by this plan's swap-outs and write-backs may be the destinations of step 2 or 4 or be written in
step 3, which is why step 1 goes first. `free_device` / `free_host` list the blocks that became free
since the previous plan (finished, aborted, swapped out or dropped requests); they need no copy.
Then the engine reports the step with a `StepFinished` event before asking for the next plan. An
engine that plans ahead (its next decode step planned and running before it has read this step's
tokens) reports this step as `StepFinished()` at once and each request that stopped on this step's
token afterwards with a `Stop` event.
"""

import dataclasses

from rpds import HashTrieSet

from jaxtier.scheduler import allocator
from jaxtier.scheduler import prefix
from jaxtier.scheduler.request import FINISHED, Ended, Request, RequestId, Seq
from jaxtier.scheduler.scheduler_config import SchedulerConfig


def _is_reason(reason) -> bool:
  """Whether `reason` can be a stop reason: a non-empty string."""
  return isinstance(reason, str) and bool(reason)


@dataclasses.dataclass(frozen=True)
class Arrive:
  """A client submitted `request`. `held`: it takes its place in the queue but is not admitted
  until a `Release` (the engine is still compiling its grammar); the requests behind it are."""
  request: Request
  held: bool = False

  def __post_init__(self):
    if not isinstance(self.request, Request):
      raise ValueError(f"request={self.request!r}: expected a Request")


@dataclasses.dataclass(frozen=True)
class StepFinished:
  """The engine ran the plan in flight.

  Every sequence of that plan computed its range and each one whose range reached the end of its
  sequence (`samples`) appended one token. `finished` names those that stopped on that token (EOS, a
  stop string) with the reason; the scheduler itself ends requests that reach max_tokens ("length").
  """
  finished: tuple[tuple[RequestId, str], ...] = ()

  def __post_init__(self):
    for entry in self.finished:
      if not (isinstance(entry, tuple) and len(entry) == 2 and _is_reason(entry[1])):
        raise ValueError(f"finished entry {entry!r}: expected (request_id, non-empty reason)")


@dataclasses.dataclass(frozen=True)
class Release:
  """A request that arrived held may be admitted now; releasing one that is not held, or no
  longer live, does nothing."""
  request_id: RequestId


@dataclasses.dataclass(frozen=True)
class Abort:
  """The client gave up on `request_id`; aborting a request that already ended does nothing."""
  request_id: RequestId


@dataclasses.dataclass(frozen=True)
class Stop:
  """The engine found that `request_id` stopped (`reason`: EOS, a stop string) on a token of a
  step it had already reported, its next step being planned and in flight: the request ends now,
  as FINISHED, and its blocks are freed at once (the plan in flight may still write its row, which
  nothing reads; every later plan runs after it). Stopping a request that already ended does
  nothing."""
  request_id: RequestId
  reason: str

  def __post_init__(self):
    if not _is_reason(self.reason):
      raise ValueError(f"reason={self.reason!r}: expected a non-empty string")


@dataclasses.dataclass(frozen=True)
class Rates:
  """What the engine measured, for choosing between loading a host-tier prefix hit and recomputing
  it: loading h blocks costs `swap_latency_s + h * block_bytes / link_bytes_per_s`, recomputing
  them `h * block_size / prefill_tokens_per_s`."""
  link_bytes_per_s: float
  prefill_tokens_per_s: float
  swap_latency_s: float = 0.0
  disk_bytes_per_s: float | None = None  # the disk tier's measured read rate (None: unknown)

  def __post_init__(self):
    for name in ("link_bytes_per_s", "prefill_tokens_per_s"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name}={value!r}: expected a number > 0")
    if not (isinstance(self.swap_latency_s, (int, float)) and self.swap_latency_s >= 0):
      raise ValueError(f"swap_latency_s={self.swap_latency_s!r}: expected a number >= 0")
    if self.disk_bytes_per_s is not None and not (
        isinstance(self.disk_bytes_per_s, (int, float)) and self.disk_bytes_per_s > 0):
      raise ValueError(f"disk_bytes_per_s={self.disk_bytes_per_s!r}: expected None or a number > 0")


@dataclasses.dataclass(frozen=True)
class DiskIndexed:
  """The disk tier's index changed: `added` hashes were written (by this process or another),
  `removed` ones evicted or found corrupt; `reset`: forget the index first (a new namespace)."""
  added: tuple[bytes, ...] = ()
  removed: tuple[bytes, ...] = ()
  reset: bool = False


@dataclasses.dataclass(frozen=True)
class DiskLoaded:
  """The engine read `hashes` (the blocks `disk.disk_lookup` named for `request_id`, those that
  passed their checks, in order) from disk into pinned host memory: the scheduler books host
  blocks for them in the host index, and the next plan's `disk_fills` puts them there."""
  request_id: RequestId
  hashes: tuple[bytes, ...]


Event = Arrive | Release | StepFinished | Abort | Stop | Rates | DiskIndexed | DiskLoaded


@dataclasses.dataclass(frozen=True)
class ComputeBatch:
  """Sequences to compute in one step, as columns the engine turns into device arrays."""
  request_ids: tuple[RequestId, ...]  # [seqs]
  starts: tuple[int, ...]  # [seqs] first position computed
  ends: tuple[int, ...]  # [seqs] one past the last position computed
  block_tables: tuple[tuple[int, ...], ...]  # [seqs][blocks] device blocks in token order
  samples: tuple[bool, ...]  # [seqs] the range reaches the end of the sequence: sample a token

  @property
  def num_tokens(self) -> int:
    return sum(self.ends) - sum(self.starts)

  def __len__(self) -> int:
    return len(self.request_ids)


EMPTY_BATCH = ComputeBatch((), (), (), (), ())


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the engine does in one step; see the module docstring for the order."""
  step: int
  prefill: ComputeBatch
  decode: ComputeBatch
  swap_out: tuple[tuple[int, int], ...]  # [pairs] (device block, host block)
  swap_in: tuple[tuple[int, int], ...]  # [pairs] (host block, device block)
  prefetch: tuple[tuple[int, int], ...]  # [pairs] (host block, device block)
  free_device: tuple[int, ...]
  free_host: tuple[int, ...]
  preempted: tuple[tuple[RequestId, str], ...]  # (request, "swap" or "recompute")
  ended: tuple[Ended, ...]  # requests that ended since the previous plan
  kv_swap_bytes: int  # high-priority link bytes: all swap, write-back and prefetch copies
  weight_prefetch_bytes: int  # low-priority link bytes granted to weight prefetch
  writeback: tuple[tuple[int, int], ...] = ()  # [pairs] (device block, host block): cache evictions
  cache_loads: int = 0  # pairs of swap_in + prefetch that load host-tier prefix hits
  hits: tuple[tuple[RequestId, int, int], ...] = ()  # admitted now: (request, device, host tokens)
  disk_writes: tuple[tuple[int, bytes], ...] = ()  # [blocks] (device block, hash): to write to disk
  disk_fills: tuple[tuple[bytes, int], ...] = ()  # [blocks] (hash, host block): read from disk

  @property
  def num_tokens(self) -> int:
    return self.prefill.num_tokens + self.decode.num_tokens


@dataclasses.dataclass(frozen=True)
class Counters:
  """Running totals since the scheduler started; the pairs are (name, count) sorted by name."""
  steps: int = 0
  swap_outs: int = 0
  swap_out_blocks: int = 0
  swap_ins: int = 0
  swap_in_blocks: int = 0
  preemptions: tuple[tuple[str, int], ...] = ()
  finished: tuple[tuple[str, int], ...] = ()
  aborted: tuple[tuple[str, int], ...] = ()
  prefix_query_tokens: int = 0  # prompt tokens of admissions that looked the prefix cache up
  device_hit_tokens: int = 0
  host_hit_tokens: int = 0
  host_hit_recomputed_tokens: int = 0  # host-tier hits recomputed because that was cheaper
  writeback_blocks: int = 0
  cache_load_blocks: int = 0
  device_cache_evictions: int = 0
  host_cache_evictions: int = 0
  disk_loaded_blocks: int = 0  # blocks read from the disk tier into host blocks (`DiskLoaded`)


@dataclasses.dataclass(frozen=True)
class SchedulerState:
  """Everything the scheduler knows. Each live request is in exactly one of the three queues.

  Attributes:
    waiting: requests without KV, by (priority, arrival); new and recompute-preempted ones.
    held: the waiting requests that may not be admitted yet (`Arrive.held`), by id.
    running: requests whose KV is on the device, in the order they started running.
    swapped: requests whose KV is on the host, by (priority, arrival).
    ended, freed_device, freed_host: what happened since the last plan, reported in the next one.
    in_flight: the plan the engine is running, until its StepFinished arrives.
    next_order: arrival order of the next request.
    device_cache, host_cache: the prefix-cache index of each pool (empty with caching off).
    rates: the engine's latest measured rates, or None.
    swap_wait_steps: steps in a row that ended with requests swapped and none swapped in
      (`policies.swap_in_blocks`).
    disk_index: the block hashes the disk tier holds, as the engine last reported them
      (`DiskIndexed`); empty without the disk tier.
    disk_writes: (device block, hash) of blocks registered since the last plan that the disk
      tier lacks, for the next plan to write through.
    disk_fills: (hash, host block) of blocks read from disk (`DiskLoaded`), booked in the host
      index, for the next plan to put in their host blocks.
  """
  config: SchedulerConfig
  device: allocator.BlockPool
  host: allocator.BlockPool
  waiting: tuple[Seq, ...] = ()
  held: frozenset = frozenset()
  running: tuple[Seq, ...] = ()
  swapped: tuple[Seq, ...] = ()
  ended: tuple[Ended, ...] = ()
  freed_device: tuple[int, ...] = ()
  freed_host: tuple[int, ...] = ()
  in_flight: Plan | None = None
  next_order: int = 0
  counters: Counters = Counters()
  device_cache: prefix.TierIndex = prefix.EMPTY_INDEX
  host_cache: prefix.TierIndex = prefix.EMPTY_INDEX
  rates: Rates | None = None
  swap_wait_steps: int = 0
  disk_index: HashTrieSet = HashTrieSet()
  disk_writes: tuple[tuple[int, bytes], ...] = ()
  disk_fills: tuple[tuple[bytes, int], ...] = ()


def initial_state(config: SchedulerConfig) -> SchedulerState:
  """Returns the state of a scheduler with empty pools and no requests."""
  if not isinstance(config, SchedulerConfig):
    raise ValueError(f"config={config!r}: expected a SchedulerConfig")
  return SchedulerState(config, allocator.new_pool(config.num_device_blocks),
                        allocator.new_pool(config.num_host_blocks))


def find(state: SchedulerState, request_id: RequestId) -> tuple[str, Seq] | None:
  """Returns ("waiting" | "running" | "swapped", seq) for a live request, or None."""
  for place in ("waiting", "running", "swapped"):
    for seq in getattr(state, place):
      if seq.request_id == request_id:
        return place, seq
  return None


def add_count(pairs: tuple[tuple[str, int], ...], name: str, count: int = 1
              ) -> tuple[tuple[str, int], ...]:
  """Returns `pairs` with `count` added to the entry for `name`."""
  totals = dict(pairs)
  totals[name] = totals.get(name, 0) + count
  return tuple(sorted(totals.items()))


def with_ended(state: SchedulerState, ended: tuple[Ended, ...]) -> SchedulerState:
  """Returns `state` with `ended` queued for the next plan and counted."""
  counters = state.counters
  for item in ended:
    field = "finished" if item.status == FINISHED else "aborted"
    counters = dataclasses.replace(
        counters, **{field: add_count(getattr(counters, field), item.reason)})
  return dataclasses.replace(state, ended=state.ended + ended, counters=counters)
