"""The engine: an impure shell around `scheduler.step` that applies each plan to the device.

    engine = Engine(model, tokenizer, EngineConfig(...))
    engine.add_request("a", prompt_ids, SamplingParams(...), seed=0)
    while engine.has_unfinished():
      for update in engine.step():   # RequestUpdate: new tokens, and the completion when it ends
        ...

One `step()`: ask the scheduler for a plan, then apply it in the order the plan documents
(`jaxtier.scheduler.state`): swap-outs, swap-ins, then the prefetch swap-ins (dispatched before the
compute, with no host synchronization between them; they fill blocks this step does not touch),
then the prefill chunks (cut into rows: one model call, or two when that pads less,
`batch.prefill_calls`) and the decode batch, each jitted model call sampling one token per
sequence. Only then are the sampled tokens read (the step's one host synchronization), appended
to their requests and checked for stops; the scheduler learns which requests stopped at once, so
requests join and leave between steps (continuous batching).

Planning ahead (`async_scheduling`, vLLM's async scheduling): a step that is one decode call
plans its successor before it reads its tokens, as if no request stopped (the scheduler still ends
requests at max_tokens), and when the successor is again a pure decode call of the same rows, the
engine dispatches it at once, each row's input token taken on the device from this step's sampled
tokens (`Runner.step_after`). The device runs the two calls back to back while the host reads this
step's tokens, runs the stop checks and returns; the next `step()` call starts with the successor
in flight. A request that stopped on this step's token is ended with a `scheduler.Stop` event (its
blocks freed at once) and its row of the successor is dropped. The tokens are the same as without
it; only steps that are all decode (no prefill, swap, preemption, log-probabilities) plan ahead.
Where a row has logit transforms (penalties, `logit_bias`, masks:
`SamplingParams.transforms_logits`) or a grammar, which need the token not yet read, only the
successor's model call is dispatched ahead: the host reads this step's tokens, the matchers
consume them, and the next `step()` computes the rows' transforms and grammar masks while the
device runs that model call, then dispatches its sampling (`step_inputs.late_transforms`): the
masks are computed beside the device step instead of between steps.

Structured outputs (`SamplingParams.structured_outputs`): a constrained request's constraint is
checked against the engine's `GrammarLimits` when it arrives (a ValueError naming the limit and
the field), and its grammar compiles in a worker thread (`jaxtier.engine.grammars`) while it
waits in the queue, held: it keeps its place, the requests behind it are admitted, and the others
keep stepping. A grammar that fails to compile, or takes longer than
`grammar_compile_timeout_s`, ends its request with "abort" and the reason in
`Completion.error`. Once compiled, the request has a `GrammarMatcher` on the host. Building a call
that samples for it computes the grammar's token bitmask (it enters the sampling program as an
array, `LogitsArrays.grammar_bw`); reading the token, the matcher consumes it. The request stops
with "stop" when the grammar is complete, and with "abort" (the reason in `Completion.error`) if
the grammar rejects the token (it never should: the mask allowed it) or allows none. Only
sampled tokens reach the matcher, once each: a recomputed request's prefill of its generated
tokens and prefix-cache hits do not touch it.

Arrivals and aborts are applied to the scheduler state when they happen: an aborted request's
blocks are free before `abort` returns. A request's sampling key is its seed folded with the number
of tokens it has generated, so its tokens do not depend on what else shares the batch, or on
whether it was preempted (a recomputed request prefills its prompt and generated tokens again and
samples its next token with the same key).

The host link (`jaxtier.engine.link`): the engine measures it once at start-up and gives the
scheduler a link budget per step (the host -> device bytes a step's compute hides, less the
offloaded tail's weights), updated as compute-only steps are measured (`link.LinkBudget`); each
step's link traffic and its overlap with compute are counted in `stats()`.

The engine's figures (`stats()`) and per-step trace are `jaxtier.engine.stats`; the updates and
completions it returns are `jaxtier.engine.outputs`; what it keeps on the host for each live
request (progress, logit rules, grammar matcher, log-probabilities, prefix-cache hits) is
`jaxtier.engine.request_state`.
"""

import dataclasses
import itertools
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from jaxtier import scheduler
from jaxtier.common.buckets import pow2_bucket, row_bucket
from jaxtier.common.kv_bytes import kv_block_bytes
from jaxtier.common.grammar_limits import GrammarLimits
from jaxtier.engine import disk_tier
from jaxtier.engine import link
from jaxtier.engine import logprob_requests as lp
from jaxtier.engine import step_inputs as batching
from jaxtier.engine.grammars import GrammarCompiles
from jaxtier.engine.outputs import RequestUpdate
from jaxtier.engine.request_state import LiveRequests
from jaxtier.engine.runner import Runner, program_keys
from jaxtier.engine.startup import Warmup, stop_warmups
from jaxtier.engine.stats import Totals, Trace, figures, trace_line
from jaxtier.kvcache import (HostTier, PagedCacheConfig, PagedKVCache, device_pool_bytes,
                             host_pool_bytes)
from jaxtier.kvcache.swap import MAX_SWAP_BLOCKS, swap_sizes
from jaxtier.model import sharding
from jaxtier.sampling.logprobs import MAX_LOGPROBS
from jaxtier.sampling.samplers import SamplingParams
from jaxtier.sampling.structured import GrammarMatcher
from jaxtier.scheduler import disk_index
from jaxtier.scheduler.allocator import blocks_for
from jaxtier.scheduler.request import ABORT_CLIENT, ABORTED, FINISHED
from jaxtier.text.detokenize import RequestProgress
from jaxtier.text.tokenizer import Tokenizer


GRAMMAR_WAIT_S = 0.05  # a step with only grammars compiling waits this long for one, at most


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """The sizes and policies of one engine (`jaxtier.LLM` fills it from `EngineArgs`).

  Every field is the engine argument of the same name, resolved (the pool sizes and token budget
  filled in, an "auto" KV dtype replaced by the model's), so none has a default here:
  `jaxtier.engine.args.EngineArgs` holds the defaults and ranges.

  Attributes:
    max_model_len: context window; a request stops with "length" when it fills it.
    max_num_seqs: most requests running at once.
    max_num_batched_tokens: token budget of one step (decodes plus prefill chunks).
    block_size, num_device_blocks, num_host_blocks: the KV pools, in blocks of block_size tokens.
    kv_cache_dtype: "float32", "bfloat16" or "int8".
    preemption_mode, watermark, victim_policy: the scheduler's policies (see SchedulerConfig).
    enable_prefix_caching: full prompt blocks are cached and shared by later requests with the same
      prefix (`jaxtier.scheduler.prefix`); host_prefix_caching: blocks evicted from the device
      are kept in the host pool and loaded back on a hit.
    trace_path: a JSONL file that gets one line per step, or None.
    kv_disk_path, kv_disk_gb: the disk tier's directory (None: no disk tier) and its budget in GB
      (`jaxtier.engine.disk_tier`).
    attention_impl: the attention implementation (see `jaxtier.kvcache.PagedCacheConfig`).
    kernels: "auto", or "portable": sample with what an accelerator runs, never a CPU kernel (the
      model and the attention are chosen before: `jaxtier.engine.sizing`).
    async_scheduling: a pure decode step whose successor is a pure decode step of the same rows
      plans and dispatches that successor before reading its own tokens (see `Engine.step`).
  """
  max_model_len: int
  max_num_seqs: int
  max_num_batched_tokens: int
  block_size: int
  num_device_blocks: int
  num_host_blocks: int
  kv_cache_dtype: str
  preemption_mode: str
  watermark: float
  victim_policy: str
  enable_prefix_caching: bool
  host_prefix_caching: bool
  trace_path: str | None
  attention_impl: str
  kernels: str
  async_scheduling: bool
  kv_disk_path: str | None
  kv_disk_gb: float


def warmup_programs(config: EngineConfig, vocab_size: int) -> list[tuple]:
  """The programs (`Runner.variants` keys) `Engine.warmup` compiles for `config`, in order: every
  one such an engine runs with plain sampling or a grammar. One program per call shape
  (`step_inputs.step_shapes`: decode row buckets and prefill token buckets), each with its
  sampling and log-probabilities folded in; the transformed sampler at every row count at the
  widths of rows constrained by a grammar alone, for a grammar over `vocab_size` tokens (the
  larger of the model's logits and the tokenizer, as `structured.grammar_tokenizer` sizes it);
  and the swap programs (`swap.swap_sizes`, up to the smaller pool). Pure, so the list of a
  configuration can be checked without building its engine (`Runner.trace_programs`).

  The first programs are those an ordinary request runs (`ready_programs`): warm-up compiles
  them first and a server is ready once it has them. A call with logit transforms other than
  a grammar, or a transformed call's log-probabilities, compiles its programs on first need."""
  c = config
  shapes = _step_shapes(c)
  most_swapped = min(c.num_device_blocks, c.num_host_blocks, MAX_SWAP_BLOCKS)
  sizes = [x for x in swap_sizes() if x <= most_swapped]
  keys = program_keys(sorted(shapes), sizes, vocab_size)
  ready = [key for key in keys if _ready(key)]
  return ready + [key for key in keys if not _ready(key)]


def _step_shapes(c: EngineConfig) -> list[tuple[int, int, int]]:
  """Every (rows, tokens, width) of the model calls of an engine of `c`."""
  return batching.step_shapes(c.max_num_seqs, c.max_num_batched_tokens,
                              batching.table_width(c.max_model_len, c.block_size),
                              c.max_model_len)


READY_ROWS = 2  # an ordinary request: decode calls of up to this many rows, prefill calls of
#   up to this many rows (2 x PREFILL_ROW_TOKENS tokens of prompt, a chat turn's), plain sampling


def _ready(key: tuple) -> bool:
  return key[0] == "step" and key[1] <= READY_ROWS


def ready_programs(config: EngineConfig, vocab_size: int) -> list[tuple]:
  """The leading programs of `warmup_programs` an ordinary request runs: the model calls of up
  to `READY_ROWS` rows, decode and prefill, with plain sampling. A server answers /health once
  it has them."""
  return [key for key in warmup_programs(config, vocab_size) if _ready(key)]


def ahead_programs(config: EngineConfig, requests: int, prompt_rows: int) -> list[tuple]:
  """The model calls (`Runner` step keys) that `requests` queued requests, whose prompts fill
  `prompt_rows` prefill rows (`PREFILL_ROW_TOKENS` tokens each, a prompt's last row partial), can
  run: decode calls up to the rows the requests fill, prefill calls up to the rows their prompts
  fill, both within `warmup_programs`. In the order a batch first meets them: the largest prefill
  call with the smallest decode call, then the next of each (a batch prefills in its largest
  calls first and decodes in more rows as its requests start)."""
  keys = [("step",) + shape for shape in _step_shapes(config)]
  decode_rows = row_bucket(min(max(requests, 1), config.max_num_seqs))
  prefill_rows = pow2_bucket(max(prompt_rows, 1))
  decode = sorted(key for key in keys if key[2] == 1 and key[1] <= decode_rows)
  prefill = sorted((key for key in keys if key[2] > 1 and key[1] <= prefill_rows), reverse=True)
  return [key for pair in itertools.zip_longest(prefill, decode) for key in pair
          if key is not None]


def cache_config(model_config, config: EngineConfig) -> PagedCacheConfig:
  """The paged cache of an engine of `config` for a model of `model_config` (its KV shape)."""
  c = model_config
  return PagedCacheConfig(
      num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
      num_device_blocks=config.num_device_blocks, block_size=config.block_size,
      num_host_blocks=config.num_host_blocks, kv_cache_dtype=config.kv_cache_dtype,
      attention_impl=config.attention_impl)


class Engine:
  """Continuous batching on a paged KV cache; see the module docstring.

  Args:
    model: an `nnx.Module` with the `EngineModel` calls (its parameters stay where they are, so an
      offloaded tail stays in pinned host memory).
    tokenizer: EOS ids and decoding for stop checks and text.
    config: pool sizes and policies.
    tail: the offloaded tail's weight bytes per step and planned compute seconds, for the link
      budget (`jaxtier.engine.link`); none by default.
    grammar_limits: what a structured-output constraint may cost (`GrammarLimits`).
    disk_identity: with `kv_disk_path`, what names the disk tier's namespace besides the KV
      layout (`disk_tier.namespace_parts`): "weights" (a checksum of the checkpoint files) and
      the settings that change the KV's numbers (`jaxtier.LLM` passes them); default: a digest
      of the model's arrays and the engine's kernels.
  """

  def __init__(self, model: nnx.Module, tokenizer: Tokenizer, config: EngineConfig,
               tail: link.Tail = link.NO_TAIL, grammar_limits: GrammarLimits = GrammarLimits(),
               disk_identity: Mapping | None = None):
    c = model.config
    self.config, self.tokenizer = config, tokenizer
    self.cache_config = cache_config(c, config)
    self.block_bytes = kv_block_bytes(c.num_layers, c.num_kv_heads, c.head_dim,
                                      config.kv_cache_dtype, config.block_size)
    graphdef, state = nnx.split(model)
    self.mesh = sharding.mesh_of(state)  # None: parameters on one device, no mesh
    platform = (self.mesh.devices.flat[0] if self.mesh is not None
                else jax.local_devices()[0]).platform
    self.platform = platform
    self.warmups: list[Warmup] = []  # started by `start_warmup`
    self._aheads: list[Warmup] = []  # started by `compile_ahead`
    self._asked_ahead: set[tuple] = set()  # programs a `compile_ahead` warm-up was given
    self.startup: dict = {}  # start-up figures (`jaxtier.engine.startup`), set by whoever builds it
    self.link_budget = link.LinkBudget.measured(platform, tail)
    scheduler_config = scheduler.SchedulerConfig(
        num_device_blocks=config.num_device_blocks, num_host_blocks=config.num_host_blocks,
        block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, watermark=config.watermark,
        max_blocks_per_request=blocks_for(config.max_model_len, config.block_size),
        preemption_mode=config.preemption_mode, victim_policy=config.victim_policy,
        block_bytes=self.block_bytes, enable_prefix_caching=config.enable_prefix_caching,
        host_prefix_caching=config.host_prefix_caching,
        disk_tier=config.kv_disk_path is not None, **self.link_budget.fields())
    self.vocab_size = c.vocab_size
    self.table_width = batching.table_width(config.max_model_len, config.block_size)
    self.prefill_rows = batching.prefill_rows_most(config.max_num_seqs,
                                                   config.max_num_batched_tokens)
    self.cache = PagedKVCache.create(self.cache_config, mesh=self.mesh)
    self.host = HostTier.empty(config.num_host_blocks)  # takes pinned memory as blocks arrive
    self.runner = Runner(graphdef, state, self.cache, portable=config.kernels == "portable")
    self._state = scheduler.initial_state(scheduler_config)
    self.disk: disk_tier.DiskTier | None = None  # the disk tier (`kv_disk_path`)
    if config.kv_disk_path is not None:
      identity = disk_identity or {
          "weights": disk_tier.arrays_digest(state),
          "engine": {"kernels": config.kernels, "attention_impl": config.attention_impl}}
      weights = identity["weights"]
      self.disk = disk_tier.DiskTier(
          config.kv_disk_path, config.kv_disk_gb, self.cache,
          disk_tier.namespace_parts(weights, c, {k: v for k, v in identity.items()
                                                 if k != "weights"}, self.cache),
          {"model": identity.get("model", getattr(c, "architecture", "model"))})
      self._disk_changes()
    self._requests = LiveRequests(tokenizer, c.vocab_size, config.max_model_len)
    self.grammars = GrammarCompiles(tokenizer, c.vocab_size, grammar_limits)
    self._totals = Totals()
    self._started = time.perf_counter()
    self._trace = Trace(config.trace_path) if config.trace_path else None
    # A plan dispatched before its predecessor's tokens were read: (plan, calls, dispatched,
    # its model call's logits when its sampling waits for its rows' transforms, else None).
    self._ahead: tuple | None = None
    self._held: list[RequestUpdate] = []  # updates of a plan finished outside `step()`
    self.weights_version = 0  # how many times `update_weights` replaced the parameters

  # Requests.

  def add_request(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams,
                  seed: int, priority: int = 0) -> None:
    """Queues a request; it starts running when the scheduler admits it.

    Raises ValueError for a request `LiveRequests.check` refuses (an id that is live, a prompt
    that is empty or leaves no room to generate, token ids outside the vocabulary) or a
    constraint past the engine's `GrammarLimits` or one llguidance refuses. A constrained request
    waits, held in the queue, until its grammar has compiled (see the module docstring).
    """
    new = self._requests.check(request_id, prompt_ids, params, seed)
    if params.constrained:
      self.grammars.check(params.structured_outputs)
    request = scheduler.Request.of(request_id, new.prompt_ids, params, seed,
                                   max_tokens=new.max_tokens,
                                   arrival_time=time.perf_counter() - self._started,
                                   priority=priority,
                                   skip_prefix_cache=params.prompt_logprobs is not None)
    reads = ()
    if self.disk is not None:
      # files another process (a server beside a batch job) wrote since this one's scan
      if self.disk.store.discover(disk_index.after_hits(self._state, request)):
        self._disk_changes()
      reads = scheduler.disk_lookup(self._state, request)
    self._state = scheduler.apply_event(
        self._state, scheduler.Arrive(request, held=params.constrained or bool(reads)))
    self._requests.add(new)
    if params.constrained:
      self.grammars.submit(request_id, params.structured_outputs)
    if reads:
      self.disk.read(request_id, reads)
    self._totals.prompt_tokens += len(new.prompt_ids)

  def abort(self, request_id: Hashable) -> RequestUpdate | None:
    """Ends a live request with finish_reason "abort" and frees its blocks at once.

    Returns its final update, or None if the request is not live (already ended, or unknown).
    """
    if request_id not in self._requests:
      return None
    self.grammars.cancel(request_id)
    if self.disk is not None:
      self.disk.cancel(request_id)
    self._state = scheduler.apply_event(self._state, scheduler.Abort(request_id))
    return self._requests.finish(request_id, "abort", ())

  def update_weights(self, state: nnx.State, abort_running: bool = False) -> int:
    """Runs on the parameters `state` from now on, and returns the new weights version.

    `state` must have the model's structure, shapes, dtypes and placements (`Runner.check_state`:
    a ValueError, and nothing changed, otherwise), so no program compiles again. Live requests
    first finish on the old weights (their updates are held for the next `step()`), or with
    `abort_running` end at once with "abort". Then every cached prefix is forgotten, on both
    tiers: its KV came from the old weights.
    """
    self.runner.check_state(state)
    if abort_running:
      self._held += [self.abort(request_id) for request_id in self._requests.ids()]
    while self._requests:
      self._held = self.step()
    self._settle()
    self.runner.replace_state(state)
    self._state = scheduler.reset_prefix_cache(self._state)
    if self.disk is not None:  # the new weights' KV lives in their own namespace
      self._state = scheduler.apply_event(
          self._state, self.disk.renamed(disk_tier.arrays_digest(state)))
    self.weights_version += 1
    return self.weights_version

  def reset_prefix_cache(self) -> None:
    """Forgets every cached prefix block no running request uses (both tiers)."""
    self._settle()
    self._state = scheduler.reset_prefix_cache(self._state)
    if self.disk is not None:
      self.disk.staged.clear()

  def has_unfinished(self) -> bool:
    return bool(self._requests) or bool(self._held)

  @property
  def num_unfinished(self) -> int:
    return len(self._requests)

  @property
  def scheduler_config(self) -> scheduler.SchedulerConfig:
    """The scheduler's configuration now (its link fields follow the link budget)."""
    return self._state.config

  @property
  def _grammars(self) -> Mapping[Hashable, GrammarMatcher]:
    """The grammar matchers of the live requests with structured outputs, by id."""
    return self._requests.grammars

  def warmup(self, progress: Callable[[int, int, tuple], None] | None = None) -> dict:
    """Compiles every program this engine's configuration can run (`warmup_programs`), now, so
    no later step compiles; after each, calls progress(programs done, programs in all, its key).

    Returns {"programs": count, "compile_seconds": time spent compiling now, "compiled":
    programs compiled, "cache_hits": programs loaded from JAX's persistent compilation cache};
    programs already compiled in this process cost nothing.
    """
    runner = self.runner
    keys = warmup_programs(self.config, self.grammar_vocab)
    before = runner.compile_seconds, runner.compiled_programs, runner.cache_hits
    self.compile_programs(keys, progress)
    return {"programs": len(keys), "compile_seconds": runner.compile_seconds - before[0],
            "compiled": runner.compiled_programs - before[1],
            "cache_hits": runner.cache_hits - before[2]}

  def start_warmup(self, busy: Callable[[], bool] | None = None,
                   progress: Callable[[int, int, tuple], None] | None = None,
                   start: bool = True) -> Warmup:
    """Starts compiling every program of `warmup_programs` on a thread while this engine keeps
    stepping (`startup.Warmup`): its `ready` event is set once an ordinary request's programs
    exist (`ready_programs`). `busy`: whether the engine is serving; on a CPU, the programs
    past the ready ones wait while it is (a compile there takes the step's cores). Without
    `start`, the caller starts it (`Warmup.start`), once it holds it."""
    keys = warmup_programs(self.config, self.grammar_vocab)
    ready = set(ready_programs(self.config, self.grammar_vocab))
    count = max((i + 1 for i, key in enumerate(keys) if key in ready), default=0)
    on_cpu = self.platform == "cpu"
    warmup = Warmup(self, keys, count, busy if on_cpu else None, progress)
    self.warmups.append(warmup)
    return warmup.start() if start else warmup

  def compile_ahead(self) -> Warmup | None:
    """Starts building, on a thread, the model calls the live requests can run
    (`ahead_programs`) that this process does not have and no earlier call asked for, while
    this engine steps: a step that needs one sooner builds it itself, or waits for the one the
    thread is building (`Runner._compiled`), and never waits for one it does not use. The
    offline API calls it after queuing requests, so a batch's first pass loads or compiles its
    programs beside its steps, not between them. Returns the warm-up started, else None."""
    requests, rows = self._requests.prompt_rows(batching.PREFILL_ROW_TOKENS)
    keys = [key for key in ahead_programs(self.config, requests, rows)
            if key not in self._asked_ahead and not self.runner.has_program(key)]
    if not keys:
      return None
    self._asked_ahead.update(keys)
    self._aheads = [w for w in self._aheads if not w.done.is_set()]
    # On a CPU a compile beside the steps takes their cores: lower only (the Python half).
    warmup = Warmup(self, keys, 0, lower_only=self.platform == "cpu")
    self._aheads.append(warmup)
    return warmup.start()

  def lower_programs(self, keys: Sequence[tuple],
                     progress: Callable[[int, int, tuple], None] | None = None) -> None:
    """`compile_programs`' tracing and lowering alone (`Runner.lower_programs`): a step that
    needs one of them compiles (or loads) it without tracing it."""
    self.runner.lower_programs(self._abstract_cache(), keys, progress)

  def _abstract_cache(self):
    """The cache's shapes, dtypes and placements: what a program is built from, so a thread
    can build one while `step` runs."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        self.cache)

  def compile_programs(self, keys: Sequence[tuple],
                       progress: Callable[[int, int, tuple], None] | None = None) -> None:
    """Compiles `keys` (`Runner` program keys) without running them; after each, calls
    progress(programs done, programs in all, its key). Safe on another thread while `step`
    runs: the programs are built from the cache's shapes, not its arrays."""
    self.runner.compile_programs(self._abstract_cache(), keys, progress)

  @property
  def grammar_vocab(self) -> int:
    """The vocabulary a grammar of this engine spans (`structured.grammar_tokenizer`)."""
    return max(self.vocab_size, self.tokenizer.vocab_size)

  # Stepping.

  def step(self) -> list[RequestUpdate]:
    """Plans and runs one step; returns an update for every request that produced a token or
    ended.

    If running the plan fails, every live request is aborted (its blocks freed, the pools
    recreated if the failed program had consumed them) before the error propagates: the engine
    itself stays usable.
    """
    start = time.perf_counter()
    held, self._held = self._held, []
    self._disk_changes()
    held += self._compiled()
    if self._ahead is None and self._requests and self._all_held():
      # Every live request waits for its grammar or its disk blocks: wait instead of planning
      # nothing.
      if self.disk is not None and self.disk.pending():
        self.disk.wait(GRAMMAR_WAIT_S)
      else:
        self.grammars.wait(GRAMMAR_WAIT_S)
      return held + self._compiled()
    try:
      plan, updates, calls, dispatched = self._schedule_and_dispatch()
      ahead = self._plan_ahead(plan, dispatched)
      finished, new_updates = self._collect(dispatched)
      self._report_stops(finished, ahead)
    except Exception:
      self._abandon()
      raise
    seconds = time.perf_counter() - start
    self._account(plan, calls, seconds)
    self.link_budget = self.link_budget.observed(plan, seconds)
    self._update_rates()
    self._state = link.relink(self._state, self.link_budget.fields())
    return held + updates + new_updates

  def _all_held(self) -> bool:
    """Whether every live request waits in the queue for its grammar or its disk blocks."""
    if self.disk is None or not len(self.disk):  # the common case, without building sets
      return len(self.grammars) == len(self._requests)
    return len(self.grammars.pending() | self.disk.pending()) == len(self._requests)

  def _compiled(self) -> list[RequestUpdate]:
    """Releases the requests whose grammar compiled, or whose disk blocks were read, into the
    queue once neither is pending; ends, with the reason in their completion, those whose
    grammar failed. Returns the updates of those ended."""
    updates = []
    for request_id, matcher, error in self.grammars.finished():
      if request_id not in self._requests:
        continue
      if matcher is None:
        if self.disk is not None:
          self.disk.cancel(request_id)
        self._state = scheduler.apply_event(self._state, scheduler.Abort(request_id))
        updates.append(self._requests.finish(request_id, "abort", (), error=error))
        continue
      self._requests.set_grammar(request_id, matcher)
      if self.disk is None or request_id not in self.disk:
        self._state = scheduler.apply_event(self._state, scheduler.Release(request_id))
    if self.disk is not None:
      for request_id, hashes in self.disk.finished():
        # booked even for a request that ended meanwhile: they are as good a cache entry as any
        self._state = scheduler.apply_event(self._state,
                                            scheduler.DiskLoaded(request_id, hashes))
        self.disk.unstage(set(hashes) - {h for h, _ in self._state.disk_fills})
        if request_id in self._requests and request_id not in self.grammars:
          self._state = scheduler.apply_event(self._state, scheduler.Release(request_id))
    return updates

  def _disk_changes(self) -> None:
    """Tells the scheduler which blocks the disk tier gained or lost (this process's writes,
    evictions and corrupt files)."""
    if self.disk is not None:
      event = self.disk.changes()
      if event is not None:
        self._state = scheduler.apply_event(self._state, event)

  def _schedule_and_dispatch(self):
    """The step's plan, dispatched: the one the previous step dispatched ahead, if any, else a
    new one from the scheduler. Returns (plan, updates of requests it ended, calls, dispatched)."""
    if self._ahead is None:
      self._state, plan = scheduler.schedule(self._state)
      updates, calls, dispatched = self._dispatch(plan)
      return plan, updates, calls, dispatched
    (plan, calls, dispatched, late_out), self._ahead = self._ahead, None
    return plan, [], calls, self._sample_late(dispatched, late_out)

  def _sample_late(self, dispatched, out):
    """`dispatched` with its sampling dispatched, where it waited for its rows' transforms (see
    the module docstring): computed now, the rows' last tokens read and consumed. `out`: the
    call's `StepOut`, or None where it sampled."""
    if out is None:
      return dispatched
    ((arrays, _, extra, progresses),) = dispatched
    live = [keep and self._requests.is_current(request_id, progresses[i])
            for i, (request_id, keep) in enumerate(zip(arrays.request_ids, arrays.samples))]
    arrays = dataclasses.replace(arrays, logits=batching.late_transforms(
        arrays, live, self._requests.token_ids, self._requests.sampling))
    return [(arrays, self.runner.sample(out, arrays), extra, progresses)]

  def _report_stops(self, finished: list[tuple[Hashable, str]], ahead) -> None:
    """Tells the scheduler the step ended and which requests stopped; with a plan dispatched
    ahead (`_plan_ahead`), the stops end their requests and that plan is kept in flight."""
    if ahead is None:
      self._state = scheduler.apply_event(self._state, scheduler.StepFinished(tuple(finished)))
      return
    for request_id, reason in finished:
      self._state = scheduler.apply_event(self._state, scheduler.Stop(request_id, reason))
    self._ahead = ahead
    self._totals.planned_ahead += 1

  def _update_rates(self) -> None:
    """Passes the rates measured so far (`_rates`) to the scheduler when they changed."""
    rates = self._rates()
    if rates is not None and rates != self._state.rates:
      self._state = scheduler.apply_event(self._state, rates)

  def _rates(self) -> scheduler.Rates | None:
    """The link and prefill rates measured so far, for the scheduler's load-or-recompute choice
    on host-tier prefix hits; None until both have been measured."""
    fit = self.runner.timer.fit()
    totals = self._totals
    if fit is None or not totals.prefill_seconds or not fit[0]:
      return None
    per_block, per_swap = fit
    return scheduler.Rates(self.block_bytes / per_block,
                           totals.prefill_tokens / totals.prefill_seconds, per_swap,
                           self.disk.read_rate() if self.disk is not None else None)

  def _dispatch(self, plan: scheduler.Plan):
    """Dispatches `plan` (see the module docstring): its swaps, then its model calls. Returns
    the updates of requests the plan ended, the calls' arrays and what `_collect` reads."""
    # The scheduler ends requests on its own only when it aborts them (host pool full, over the
    # KV cap); the engine ended the others itself, and their ids may be live again by now.
    requests = self._requests
    updates = []
    for e in plan.ended:
      if e.status == ABORTED and e.reason != ABORT_CLIENT and e.request_id in requests:
        self.grammars.cancel(e.request_id)
        updates.append(requests.finish(e.request_id, "abort", ()))
    self._requests.record_hits(plan.hits)
    if plan.disk_fills:
      self.host = self.disk.fill(self.host, plan.disk_fills)
    if plan.disk_writes:  # copied out before anything this plan runs can overwrite them
      self.disk.write(plan.disk_writes,
                      self.runner.copy_out(self.cache, [b for b, _ in plan.disk_writes]))
    for direction, pairs in (("out", plan.swap_out + plan.writeback), ("in", plan.swap_in),
                             ("in", plan.prefetch)):
      if pairs:
        self.cache, self.host = self.runner.swap(self.cache, self.host, direction, pairs)
    calls = []
    if len(plan.prefill):
      calls += [batching.build(rows, self._requests.token_ids, self._requests.sampling,
                               decode=False, width=self.table_width)
                for rows in batching.prefill_calls(plan.prefill, self.prefill_rows)]
    if len(plan.decode):
      calls.append(batching.build(plan.decode, self._requests.token_ids, self._requests.sampling,
                                  decode=True, width=self.table_width))
    dispatched = []
    for arrays in calls:
      if self._requests.logprobs:
        dispatched.append(self._step_logprobs(arrays) + (self._progress_of(arrays),))
        continue
      tokens_b, self.cache = self.runner.step(self.cache, arrays)
      dispatched.append((arrays, tokens_b, None, self._progress_of(arrays)))
    return updates, calls, dispatched

  def _progress_of(self, arrays: batching.StepArrays) -> tuple[RequestProgress, ...]:
    """The progress of each request a call computes for, as it is when the call is dispatched."""
    return tuple(self._requests.progress(request_id) for request_id in arrays.request_ids)

  def _plan_ahead(self, plan: scheduler.Plan, dispatched):
    """With `plan` (one decode call) dispatched and its tokens not yet read: plans the next step
    as if no request stopped and, if that is a pure decode call of the same rows (their bucket
    too), dispatches it with its input tokens taken from this call's on the device (its model
    call only, where a row's transforms need this call's tokens). Returns (next plan, its calls,
    its dispatched calls, its logits when its sampling waits, else None), the scheduler state
    then holding the next plan in flight; else None, nothing changed."""
    if (not self.config.async_scheduling or self._requests.logprobs or len(dispatched) != 1
        or len(plan.prefill) or not len(plan.decode)):
      return None
    arrays, tokens_b, _, _ = dispatched[0]
    # Their transforms and masks need the token this call samples: sampled in the next step().
    late = any(self._requests.needs_last_token(request_id) for request_id in arrays.request_ids)
    state, following = scheduler.schedule(
        scheduler.apply_event(self._state, scheduler.StepFinished(())))
    rows = {request_id: i for i, request_id in enumerate(arrays.request_ids)}
    decode = following.decode
    if (len(following.prefill) or not len(decode) or following.swap_out or following.swap_in
        or following.prefetch or following.writeback or following.preempted
        or following.disk_writes or following.disk_fills
        or any(e.status != FINISHED for e in following.ended)
        or any(request_id not in rows for request_id in decode.request_ids)
        or row_bucket(len(decode)) != arrays.tokens_bt.shape[0]):
      return None
    def sampling(request_id):  # one more token generated by then: the one this call samples
      info = self._requests.sampling(request_id)  # (its transforms: when it samples)
      return dataclasses.replace(info, num_generated=info.num_generated + 1, rules=None,
                                 grammar=None)

    # Each row's last token is the one this call samples for it: a placeholder on the host.
    next_arrays = batching.build(decode,
                                 lambda request_id: self._requests.token_ids(request_id) + (0,),
                                 sampling, decode=True, width=self.table_width)
    source = np.full(next_arrays.tokens_bt.shape[0], -1, np.int32)
    source[:len(decode)] = [rows[request_id] for request_id in decode.request_ids]
    out, self.cache = self.runner.step_after(self.cache, next_arrays, tokens_b, source,
                                             sample=not late)
    self._state = state
    return following, [next_arrays], [(next_arrays, None if late else out, None,
                                       self._progress_of(next_arrays))], out if late else None

  def _settle(self) -> None:
    """Reads the plan dispatched ahead, if any, and reports it (its updates are returned by
    the next `step()`), leaving no plan in flight."""
    if self._ahead is None:
      return
    start = time.perf_counter()
    (plan, calls, dispatched, late_out), self._ahead = self._ahead, None
    try:
      finished, updates = self._collect(self._sample_late(dispatched, late_out))
      self._state = scheduler.apply_event(self._state, scheduler.StepFinished(tuple(finished)))
    except Exception:
      self._abandon()
      raise
    self._account(plan, calls, time.perf_counter() - start)
    self._held += updates

  def _abandon(self) -> None:
    """After a failed step: ends the plan in flight and every live request, and replaces pools
    that a failed program consumed (donated) with fresh ones."""
    self._ahead = None
    if self._state.in_flight is not None:
      self._state = scheduler.apply_event(self._state, scheduler.StepFinished(()))
    for request_id in self._requests.ids():
      self.grammars.cancel(request_id)
      if self.disk is not None:
        self.disk.cancel(request_id)
      self._state = scheduler.apply_event(self._state, scheduler.Abort(request_id))
      self._requests.finish(request_id, "abort", ())
    # The failed plan's blocks were never written, and the pools may be lost: forget the cache.
    self._state = scheduler.reset_prefix_cache(self._state)
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
      self.cache = PagedKVCache.create(self.cache_config, mesh=self.mesh)
    self.host = HostTier.empty(self.config.num_host_blocks)
    if self.disk is not None:
      self.disk.staged.clear()

  def _step_logprobs(self, arrays: batching.StepArrays):
    """Dispatches one call whose rows may ask for log-probabilities (the plain step if none
    does); returns (arrays, tokens, (prompt rows, their results, sampled results) or None)."""
    wanted = self._requests.logprobs
    sample_k = lp.sample_k(arrays, wanted)
    prompt = (None if arrays.tokens_bt.shape[1] == 1 else
              lp.prompt_rows(arrays, wanted, self._requests.prompt_ids))
    if sample_k is None and prompt is None:
      tokens_b, self.cache = self.runner.step(self.cache, arrays)
      return arrays, tokens_b, None
    tokens_b, self.cache, sampled, prompt_top, processed = self.runner.step_logprobs(
        self.cache, arrays, sample_k, None if prompt is None else prompt.targets_bt, MAX_LOGPROBS)
    return arrays, tokens_b, (prompt, prompt_top, sampled, processed)

  def _collect(self, dispatched) -> tuple[list[tuple[Hashable, str]], list[RequestUpdate]]:
    """Reads each call's sampled tokens and appends them; returns stops and updates. Rows of
    requests that ended since their call was dispatched (aborted, or stopped on the token of the
    step before a plan dispatched ahead) are dropped."""
    finished, updates = [], []
    for arrays, tokens_b, extra, progresses in dispatched:
      tokens = np.asarray(tokens_b)
      sampled = processed = None
      if extra is not None:  # log-probabilities: read only for calls that computed them
        prompt, (prompt_top, sampled, processed) = extra[0], jax.device_get(extra[1:])
        if prompt is not None:
          self._requests.record_prompt(prompt, prompt_top)
      for i, (request_id, keep) in enumerate(zip(arrays.request_ids, arrays.samples)):
        if not keep or not self._requests.is_current(request_id, progresses[i]):
          continue
        update = self._requests.accept(request_id, int(tokens[i]), sampled, i, processed)
        self._totals.generated_tokens += len(update.new_token_ids)
        if update.completion is not None:
          finished.append((request_id, update.completion.finish_reason))
        updates.append(update)
    return finished, updates

  # Observability.

  def _account(self, plan: scheduler.Plan, calls, seconds: float) -> None:
    """Counts a finished step and writes its trace line."""
    m = scheduler.metrics(self._state)
    self._totals.add_step(plan, calls, seconds, m, self.block_bytes)
    timer = self.runner.timer
    self._totals.add_link(self.link_budget.overlap(plan, seconds, self.block_bytes, timer.seconds,
                                                   timer.blocks))
    if self._trace is not None:
      self._trace.write(trace_line(plan, m, seconds, time.perf_counter() - self._started,
                                   self.block_bytes))

  def stats(self, wait_for_swaps: bool = True) -> dict:
    """The run's figures (JSON-serializable; `jaxtier.engine.stats.figures` and this engine's
    settings). Waits for outstanding swap timings first unless `wait_for_swaps` is False (then
    the swaps of the last step may not be timed yet)."""
    if wait_for_swaps:
      self.runner.timer.drain()
    return {
        **figures(scheduler.metrics(self._state), self._totals, self.block_bytes,
                  self.runner.timer.seconds, self.config.enable_prefix_caching,
                  self.scheduler_config.host_tier),
        "compiled_variants": self.runner.compiled_variants,
        "compile_seconds": self.runner.compile_seconds,
        "compiled_programs": self.runner.compiled_programs,
        "compile_cache_hits": self.runner.cache_hits,
        "compile_lowered_ahead": self.runner.lowered_ahead,
        "startup": self.startup_figures(),
        "block_size": self.config.block_size, "block_bytes": self.block_bytes,
        "kv_cache_dtype": self.config.kv_cache_dtype,
        "preemption_mode": self.config.preemption_mode,
        "watermark_blocks": self.scheduler_config.watermark_block_count,
        "device_kv_bytes": device_pool_bytes(self.cache),
        "host_kv_bytes": host_pool_bytes(self.cache),
        "host_kv_bytes_stored": self.host.num_stored * self.block_bytes,
        **self.grammars.figures(),
        **self.link_budget.settings(self._state.config),
        **(self.disk.figures(self.config.block_size, self._state.counters.disk_loaded_blocks)
           if self.disk is not None else {"kv_disk_path": None}),
    }

  def startup_figures(self) -> dict:
    """The start-up's phases (`startup.startup_line`): what built the engine recorded in
    `self.startup` (load, size and engine seconds), and the last warm-up's compile figures and
    when it was ready (seconds since the process started)."""
    out = dict(self.startup)
    if self.warmups:
      report = self.warmups[-1].report
      out["compile"] = report
      out["ready_seconds"] = report["ready_seconds"]
    else:  # compiled on demand, as the steps needed them
      runner = self.runner
      out["compile"] = {"done": runner.compiled_variants, "compiled": runner.compiled_programs,
                        "cache_hits": runner.cache_hits,
                        "compile_seconds": runner.compile_seconds}
    return out

  def flush_disk(self, timeout: float | None = 60.0) -> None:
    """Waits until the disk tier (if any) has written every queued block, at most `timeout`."""
    if self.disk is not None:
      self.disk.store.flush(timeout)

  def close(self) -> None:
    stop_warmups(self.warmups + self._aheads)
    self.grammars.close()
    if self.disk is not None:
      self.disk.close()
    if self._trace is not None:
      self._trace.close()
      self._trace = None
