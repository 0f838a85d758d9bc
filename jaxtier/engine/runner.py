"""The device side of one engine step: the jitted model call on the paged cache, and block swaps.

The engine reaches the model only through `EngineModel`, so a research model that is not
`jaxtier.model.Transformer` runs on the engine when it offers the same two calls and config fields.
Every program is compiled ahead of time per shape, kept in a process-wide table (engines of the
same model and cache layout share programs) and counted per engine (`compiled_variants`: programs
the engine ran; `compile_seconds`: time it spent compiling). Every program that takes the cache
donates it (pools updated in place).

Swaps are dispatched without waiting: each swap program also returns a small marker array, and a
background thread (`SwapTimer`) waits on the markers and records when each program finished. A
swap's seconds are the time from its dispatch, or from the end of the swap before it, to its
marker becoming ready: measured off the engine thread, so no synchronization enters the step.
The timer also fits those seconds against the blocks of each swap (least squares), which gives the
link's rate and its fixed cost per swap (`SwapTimer.fit`).

Shape legend: b rows, t tokens, h hidden size, v vocab, m table width, x blocks of a swap program.
"""

import collections
import contextlib
import dataclasses
import functools
import gc
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from jaxtier.engine.step_inputs import GREEDY, StepArrays
from jaxtier.kvcache import PagedKVCache, PagedMetadata
from jaxtier.kvcache.paged import KVBlocks
from jaxtier.kvcache import swap
from jaxtier.kvcache.swap import (HostTier, gather_blocks, host_block_shardings,
                                  host_block_specs, part_slices, scatter_blocks)
from jaxtier.sampling.logprobs import MAX_LOGPROBS, TopLogprobs, top_logprobs
from jaxtier.sampling.samplers import (LogitsArrays, SamplingArrays, processed_logprobs, sample,
                                       sample_transformed)


class EngineModel(Protocol):
  """What the engine needs of a model (an `nnx.Module`).

  `config` needs `num_layers`, `num_kv_heads`, `head_dim` and `vocab_size` (and
  `max_position_embeddings` when `jaxtier.LLM` builds the engine). The cache is a
  `jaxtier.kvcache.PagedKVCache` and `meta` a `PagedMetadata`; a model's attention calls
  `cache.update_and_attend(layer, q, k, v, pos_bt, meta)`. Positions below zero are padding: no
  cache write, output ignored.
  """
  config: Any

  def hidden_states(self, tokens_bt: jax.Array, pos_bt: jax.Array, cache: PagedKVCache,
                    meta: PagedMetadata) -> tuple[jax.Array, PagedKVCache]:
    """Final hidden states [b, t, h] and the updated cache."""

  def logits(self, h_bh: jax.Array) -> jax.Array:
    """Vocabulary logits [b, v] of hidden states [b, h]."""


def _forward(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, tokens_bt, pos_bt,
             tables_bm, last_b):
  """Runs the model on one batch; returns the logits [b, v] at each row's position `last_b`, and
  the hidden states [b, t, h] of every position (read only for prompt log-probabilities; the
  model computes them anyway, so one program serves both)."""
  model = nnx.merge(graphdef, state)
  h_bth, cache = model.hidden_states(tokens_bt, pos_bt, cache, PagedMetadata(tables_bm))
  h_bh = jnp.take_along_axis(h_bth, last_b[:, None, None], axis=1)[:, 0]
  return model.logits(h_bh), h_bth, cache


LOGPROB_K = MAX_LOGPROBS  # the top-k width of every call's log-probabilities (one program each)
PROMPT_LOGITS_CHUNK = 256  # positions whose [positions, vocab] logits exist at once


def prompt_chunks(positions: int, most: int = PROMPT_LOGITS_CHUNK) -> tuple[int, int]:
  """(chunks, positions per chunk) for the logits of `positions` positions, at most `most` at a
  time: the fewest chunks, as even as can be, so padding the positions to chunks x size adds
  fewer than `chunks` positions. Positions need not be a multiple of `most` (a call of `t`
  tokens per row, `b` rows: any count), so a fixed chunk of `most` need not divide them."""
  chunks = -(-positions // most)
  return chunks, -(-positions // chunks)


def _prompt_logprobs(graphdef: nnx.GraphDef, state: nnx.State, h_bth, targets_bt, k: int,
                     most: int = PROMPT_LOGITS_CHUNK):
  """Log-probabilities [b, t] of `targets_bt` (and the top k) from the hidden states of every
  position, through `model.logits`, at most `most` positions at a time (see `prompt_chunks`;
  padded positions are zeros, dropped after)."""
  model = nnx.merge(graphdef, state)
  b, t, h = h_bth.shape
  n = b * t
  chunks, c = prompt_chunks(n, most)
  pad = chunks * c - n
  h_nh = jnp.pad(h_bth.reshape(n, h), ((0, pad), (0, 0)))
  targets_n = jnp.pad(targets_bt.reshape(n), (0, pad))
  top = jax.lax.map(lambda x: top_logprobs(model.logits(x[0]), x[1], k),
                    (h_nh.reshape(chunks, c, h), targets_n.reshape(chunks, c)))
  return jax.tree.map(lambda a: a.reshape((chunks * c,) + a.shape[2:])[:n].reshape(
      (b, t) + a.shape[2:]), top)


def _follow(tokens_b, tokens_bt, rows_b):
  """A decode call's input tokens [b, 1] when the call is dispatched before the previous call's
  tokens are read: row i takes the previous call's sampled token of row rows_b[i] (< 0: its own
  token in tokens_bt, as for padding and for a call that follows none)."""
  previous = tokens_b[jnp.clip(rows_b, 0, tokens_b.shape[0] - 1)][:, None]
  return jnp.where(rows_b[:, None] >= 0, previous, tokens_bt)


def _if(predicate, compute: Callable[[], Any]):
  """compute() where `predicate` holds at run time, else zeros of its shapes: both branches are
  in the program, only the taken one runs (`lax.cond`), so a call that asks for nothing extra
  costs nothing extra."""
  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(compute))
  return jax.lax.cond(predicate, compute, zeros)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOut:
  """What one model call leaves on the device; the host reads the parts it needs."""
  tokens_b: jax.Array  # [b] int32, each row's token by the plain sampler
  logits_bv: jax.Array  # [b, v] each row's last logits (for a sampler with logit transforms)
  sampled: TopLogprobs  # [b] of tokens_b, top LOGPROB_K (zeros unless asked for)
  processed_b: jax.Array  # [b] tokens_b's processed log-probabilities (zeros unless asked for)
  prompt: TopLogprobs | None  # [b, t] of the targets, top LOGPROB_K (zeros unless asked for);
  #   None in a decode call


def _step(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, tokens_bt, pos_bt,
          tables_bm, last_b, sampling: SamplingArrays, previous_b, rows_b, want_sampled,
          targets_bt, want_prompt, *, portable: bool) -> tuple[StepOut, PagedKVCache]:
  """One model call and everything a call may need, in one program (see `StepOut`): a decode
  call's input tokens from the previous call's (`_follow`), the model, the plain sampler, and
  where `want_sampled` / `want_prompt` hold at run time the sampled tokens' log-probabilities
  (raw and processed) and a prefill call's prompt log-probabilities of `targets_bt`."""
  if tokens_bt.shape[1] == 1:
    tokens_bt = _follow(previous_b, tokens_bt, rows_b)
  logits_bv, h_bth, cache = _forward(graphdef, state, cache, tokens_bt, pos_bt, tables_bm, last_b)
  tokens_b = sample(logits_bv, sampling, portable)
  sampled, processed_b = _if(want_sampled, lambda: (
      top_logprobs(logits_bv, tokens_b, LOGPROB_K),
      processed_logprobs(logits_bv, tokens_b, sampling)))
  prompt = None
  if tokens_bt.shape[1] > 1:
    prompt = _if(want_prompt, lambda: _prompt_logprobs(graphdef, state, h_bth, targets_bt,
                                                       LOGPROB_K))
  return StepOut(tokens_b, logits_bv, sampled, processed_b, prompt), cache


# Batches where a row has logit transforms (penalties, logit_bias, masks, a grammar) sample from
# the call's logits with this program, one per (rows, history width, id-list widths, grammar
# words). Warm-up compiles it at the widths of rows constrained by a grammar alone
# (`program_keys`); a batch with other transforms compiles its widths on its first need.
_sample_transformed = jax.jit(sample_transformed, static_argnames="portable")
# And so are such a call's log-probabilities, when a request asks for them: of the token drawn
# under the raw model, and under the transformed distribution it was drawn from.
_sample_logprobs = jax.jit(top_logprobs, static_argnames="k")
_processed_logprobs = jax.jit(processed_logprobs)


def _gather_marked(cache, device_ids_x, places):
  """`swap.gather_blocks` and a marker: an output of the same program, ready when it is."""
  return gather_blocks(cache, device_ids_x, places), device_ids_x[0]


def _scatter_marked(cache, blocks, device_ids_x):
  """`swap.scatter_blocks` and a marker."""
  return scatter_blocks(cache, blocks, device_ids_x), device_ids_x[0]


_SWAPS = {"out": jax.jit(_gather_marked, static_argnames="places"),
          "in": jax.jit(_scatter_marked, donate_argnums=0)}


class SwapTimer:
  """Measures swap programs off the engine thread (see the module docstring)."""

  def __init__(self):
    self._queue: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self.seconds = {"out": 0.0, "in": 0.0}
    self.blocks = {"out": 0, "in": 0}  # blocks of the swaps measured so far
    self._sums = [0, 0.0, 0.0, 0.0, 0.0]  # n, sum blocks, sum seconds, sum blocks^2, sum blocks*s
    self._last_ready = 0.0
    self._thread: threading.Thread | None = None

  def submit(self, direction: str, marker: jax.Array, dispatched: float, blocks: int = 0) -> None:
    if self._thread is None:
      # Started by the first swap (most engines never swap), holding only the queue and a weak
      # reference: when the timer is collected, the finalizer's None ends the thread.
      self._thread = threading.Thread(target=_wait_for_swaps,
                                      args=(self._queue, weakref.ref(self)),
                                      name="jaxtier-swap-timer", daemon=True)
      self._thread.start()
      weakref.finalize(self, self._queue.put, None)
    self._queue.put((direction, marker, dispatched, blocks))

  def fit(self) -> tuple[float, float] | None:
    """(seconds per block, seconds per swap) from the swaps measured so far, or None before any.

    A least-squares line through (blocks, seconds) of every swap; with fewer than two distinct
    sizes, all the time is charged to the blocks. Neither figure is negative.
    """
    with self._lock:
      n, x, y, xx, xy = self._sums
    if n == 0 or x == 0:
      return None
    denominator = n * xx - x * x
    if denominator <= 1e-9 * n * xx:
      return y / x, 0.0
    slope = (n * xy - x * y) / denominator
    intercept = (y - slope * x) / n
    if slope <= 0:
      return y / x, 0.0
    if intercept < 0:
      return xy / xx, 0.0
    return slope, intercept

  def drain(self) -> None:
    """Waits until every submitted swap is measured."""
    self._queue.join()

  def _record(self, direction: str, marker: jax.Array, dispatched: float, blocks: int) -> None:
    marker.block_until_ready()
    ready = time.perf_counter()
    with self._lock:
      seconds = ready - max(dispatched, self._last_ready)
      self.seconds[direction] += seconds
      self.blocks[direction] += blocks
      for i, value in enumerate((1, blocks, seconds, blocks * blocks, blocks * seconds)):
        self._sums[i] += value
      self._last_ready = ready


def _wait_for_swaps(swaps: queue.Queue, timer_ref) -> None:
  """The timer's thread: records each submitted swap once its marker is ready; ends at None."""
  while True:
    item = swaps.get()
    try:
      if item is None:
        return
      timer = timer_ref()
      if timer is not None:
        timer._record(*item)  # pylint: disable=protected-access
      del timer
    except Exception:  # pylint: disable=broad-except  (a failed swap fails its step instead)
      logging.exception("could not time a swap")
    finally:
      swaps.task_done()


_PROGRAMS: dict[tuple, Any] = {}  # compiled programs of this process, by layout id and shape
_COMPILING: dict[tuple, threading.Event] = {}  # programs a thread is compiling, set when done
_LOWERED: dict[tuple, Any] = {}  # programs lowered ahead of their compile (`lower_programs`)
_PROGRAMS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=64)
def _NO_FOLLOW(b: int) -> tuple[np.ndarray, np.ndarray]:  # pylint: disable=invalid-name
  """`_follow`'s arguments of a call that follows none: every row keeps its own token."""
  return np.zeros(b, np.int32), np.full(b, -1, np.int32)


@functools.lru_cache(maxsize=64)
def _zeros_bt(b: int, t: int) -> np.ndarray:
  return np.zeros((b, t), np.int32)


_EVENTS = threading.local()


def _count_event(event: str, **_) -> None:
  counts = getattr(_EVENTS, "counts", None)
  if counts is not None:
    counts[event] += 1


jax.monitoring.register_event_listener(_count_event)


@contextlib.contextmanager
def compile_events():
  """Counts the JAX monitoring events this thread records inside the block (such as
  "/jax/compilation_cache/cache_hits"), in the Counter it yields."""
  outer = getattr(_EVENTS, "counts", None)
  _EVENTS.counts = collections.Counter()
  try:
    yield _EVENTS.counts
  finally:
    if outer is not None:
      outer.update(_EVENTS.counts)
    _EVENTS.counts = outer
_LAYOUT_IDS: dict[tuple, int] = {}  # (graphdef, state, cache) -> a small id, hashed once


def release_programs() -> None:
  """Drops every compiled program of this process: the engines' table (kept for the process's
  life, so engines of the same layout share programs), the swaps' and JAX's caches. An engine
  still in use compiles what it runs next again.

  For long processes that build engines of many layouts (a notebook, a test run): each XLA:CPU
  executable holds its code in dozens of memory mappings, a process may hold at most
  vm.max_map_count of them (65,530 by default), and past it the next executable loaded crashes
  the process."""
  _PROGRAMS.clear()
  _LOWERED.clear()
  swap.clear_compiled()
  jax.clear_caches()
  gc.collect()


@functools.lru_cache(maxsize=16)
def _step_fn(graphdef: nnx.GraphDef, state_def, portable: bool):
  """`_step` jitted with the graph and the state's tree structure closed over (hashed once,
  not on every call); it takes the state's leaves, a tuple of arrays, which a call flattens in
  C++ (flattening the `nnx.State` itself runs Python for every variable).

  Every leaf is its own argument, though each argument costs the dispatch a little. Stacking
  the norm scales into fewer arguments makes each scale a slice op that depends on nothing else
  in the program, and XLA:CPU's executor hands ops that are ready beside another to its thread
  pool, whose threads compete with the kernels' for the cores: the dispatch gets faster, the
  step as a whole slower."""
  def step(leaves, cache, *args):
    return _step(graphdef, jax.tree.unflatten(state_def, leaves), cache, *args,
                 portable=portable)
  return jax.jit(step, donate_argnames="cache")


def program_keys(shapes, swap_sizes, grammar_vocab: int | None = None) -> list[tuple]:
  """The programs (`Runner.variants` keys) an engine of these shapes runs, each once, every
  program after those whose outputs it takes: for each (rows, tokens, width) in `shapes` its
  model call (with its sampling and log-probabilities, `_step`); then swaps in both directions
  of every block count in `swap_sizes`.

  With `grammar_vocab` (a grammar's vocabulary), also the transformed sampler for every row
  count at the widths of rows constrained by a grammar alone (`LogitsArrays.grammar_widths`):
  what a batch of requests with `structured_outputs` runs. Other transforms (penalties,
  logit_bias, allowed ids, bad words, min_tokens) give other widths, some growing with the
  request, and a transformed call's log-probabilities are programs of their own: those compile
  on a batch's first need."""
  grammar_widths = None if grammar_vocab is None else LogitsArrays.grammar_widths(grammar_vocab)
  keys = []
  for b, t, m in shapes:
    keys.append(("step", b, t, m))
    if grammar_widths is not None:
      keys.append(("sample_transformed", b) + grammar_widths)
  keys += [("swap", direction, x) for x, direction in itertools.product(swap_sizes, ("out", "in"))]
  return list(dict.fromkeys(keys))


def _layout(tree) -> tuple:
  """What a compiled program depends on in a pytree: structure, shapes, dtypes, placements."""
  return (jax.tree.structure(tree),
          tuple((a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(tree)))


class Runner:
  """Compiled model calls and swaps of one engine, with their compile counts and seconds."""

  def __init__(self, graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache,
               portable: bool = False):
    """`portable`: sample with what an accelerator runs (no CPU kernel; `kernels="portable"`)."""
    self.portable = portable
    self._leaves = tuple(jax.tree.leaves(state))
    self._state_layout = _layout(state)
    self._step = _step_fn(graphdef, jax.tree.structure(state), portable)
    layout = (graphdef, _layout(state), _layout(cache), portable)
    self._layout_id = _LAYOUT_IDS.setdefault(layout, len(_LAYOUT_IDS))
    self._used: set[tuple] = set()
    self.compile_seconds = 0.0  # seconds this engine spent compiling (or loading from disk)
    self.compiled_programs = 0  # programs it built that JAX's persistent cache did not hold
    self.cache_hits = 0  # programs it loaded from that cache
    self.lowered_ahead = 0  # programs it built from a lowering made ahead (`lower_programs`)
    self.timer = SwapTimer()

  def check_state(self, state: nnx.State) -> None:
    """Raises ValueError, naming the first parameter that differs, unless `state` has this
    engine's structure and every leaf its shape, dtype and placement: what lets `replace_state`
    swap it in without compiling anything again."""
    if jax.tree.structure(state) != self._state_layout[0]:
      raise ValueError("the new parameters' structure differs from the engine's")
    for (path, leaf), (shape, dtype, sharding) in zip(
        jax.tree_util.tree_leaves_with_path(state), self._state_layout[1]):
      if (leaf.shape, leaf.dtype, leaf.sharding) != (shape, dtype, sharding):
        raise ValueError(f"parameter {jax.tree_util.keystr(path)}: {leaf.shape} {leaf.dtype} on "
                         f"{leaf.sharding}, expected {shape} {dtype} on {sharding}")

  def replace_state(self, state: nnx.State) -> None:
    """Runs every later program on `state`'s arrays (checked by `check_state`): the compiled
    programs take the parameters as arguments, so none compiles again."""
    self.check_state(state)
    self._leaves = tuple(jax.tree.leaves(state))

  @property
  def compiled_variants(self) -> int:
    return len(self._used)

  def variants(self) -> list[tuple]:
    """The programs this engine ran: ("step", rows, tokens, width) (`_step`), ("swap",
    direction, x), ("sample_transformed", rows, history, biased, allowed, grammar words)
    (`LogitsArrays.widths`), and for a transformed call's log-probabilities ("logprobs", rows,
    k) and ("processed_logprobs", rows, widths...)."""
    return sorted(self._used, key=str)

  def has_program(self, key: tuple) -> bool:
    """Whether this process has the program of `key` compiled (or loaded) already."""
    return (self._layout_id,) + key in _PROGRAMS

  def _program(self, key: tuple, jitted, args, **static):
    self._used.add(key)
    return self._compiled(key, jitted, args, **static)

  def _compiled(self, key: tuple, jitted, args, **static):
    """The program for `key`, compiled now if this process has not compiled it yet. Threads
    may ask at once (a warm-up thread beside the engine's): one compiles, the others wait."""
    full = (self._layout_id,) + key
    while True:
      with _PROGRAMS_LOCK:
        program = _PROGRAMS.get(full)
        if program is not None:
          return program
        pending = _COMPILING.get(full)
        if pending is None:
          pending = _COMPILING[full] = threading.Event()
          break
      pending.wait()
    try:
      start = time.perf_counter()
      with _PROGRAMS_LOCK:
        lowered = _LOWERED.pop(full, None)
      with compile_events() as events:
        ahead = lowered is not None
        if not ahead:
          lowered = jitted.lower(*args, **static)
        program = lowered.compile()
      with _PROGRAMS_LOCK:
        _PROGRAMS[full] = program
        self.compile_seconds += time.perf_counter() - start
        hit = events["/jax/compilation_cache/cache_hits"] > 0
        self.cache_hits += hit
        self.compiled_programs += not hit
        self.lowered_ahead += ahead
    finally:
      with _PROGRAMS_LOCK:
        del _COMPILING[full]
      pending.set()
    return program

  def step_args(self, cache: PagedKVCache, arrays: StepArrays, previous_b=None, rows_b=None,
                want_sampled: bool = False, targets_bt=None) -> tuple:
    """The arguments of the jitted model call (`_step`), in its order (the state goes as its
    leaves)."""
    b, t = arrays.tokens_bt.shape
    if previous_b is None:
      previous_b, rows_b = _NO_FOLLOW(b)
    want_prompt = targets_bt is not None
    if targets_bt is None:
      targets_bt = _zeros_bt(b, t)
    return (self._leaves, cache, arrays.tokens_bt, arrays.pos_bt, arrays.tables_bm, arrays.last_b,
            arrays.sampling, previous_b, rows_b, np.bool_(want_sampled), targets_bt,
            np.bool_(want_prompt))

  def compile_programs(self, cache: PagedKVCache, keys: Sequence[tuple],
                       progress: Callable[[int, int, tuple], None] | None = None) -> None:
    """Compiles each program of `keys` (from `program_keys`) without running it (the cache is
    not consumed); after each, calls progress(programs done, programs in all, its key)."""
    done = itertools.count(1)

    def build(key, jitted, args, static):
      info = self._compiled(key, jitted, args, **static).out_info
      if progress is not None:
        progress(next(done), len(keys), key)
      return info

    self._build_each(cache, keys, build)

  def lower_programs(self, cache: PagedKVCache, keys: Sequence[tuple],
                     progress: Callable[[int, int, tuple], None] | None = None) -> None:
    """Traces and lowers each program of `keys` this process has neither compiled nor lowered,
    for its compile to take (`_compiled`): the Python half of building a program, which a
    thread can do while the engine steps on a CPU whose cores a compile would take from the
    step. With a warm persistent cache, what is left is loading the program. After each,
    calls progress(programs done, programs in all, its key)."""
    done = itertools.count(1)

    def build(key, jitted, args, static):
      full = (self._layout_id,) + key
      with _PROGRAMS_LOCK:
        program, lowered = _PROGRAMS.get(full), _LOWERED.get(full)
        wanted = program is None and lowered is None and full not in _COMPILING
      if wanted:
        lowered = jitted.lower(*args, **static)
        with _PROGRAMS_LOCK:  # unless a step built it meanwhile
          if full not in _PROGRAMS and full not in _COMPILING:
            _LOWERED[full] = lowered
      if progress is not None:
        progress(next(done), len(keys), key)
      if program is None and lowered is None:  # a step is building it: the shapes alone
        return jax.eval_shape(functools.partial(jitted, **static), *args)
      return (program if program is not None else lowered).out_info

    self._build_each(cache, keys, build)

  def trace_programs(self, cache: PagedKVCache, keys: Sequence[tuple]) -> dict[tuple, Any]:
    """Each program of `keys` traced with `jax.eval_shape`, neither compiled nor run: its
    output shapes by key. The programs and arguments are those `compile_programs` compiles, so
    a program that cannot be built for some shape fails here too, in a fraction of the time."""
    traced = {}

    def build(key, jitted, args, static):
      traced[key] = jax.eval_shape(functools.partial(jitted, **static), *args)
      return traced[key]

    self._build_each(cache, keys, build)
    return traced

  def _build_each(self, cache: PagedKVCache, keys: Sequence[tuple], build) -> None:
    """Calls build(key, jitted, args, static) -> the program's output shapes, for each program
    of `keys` in order. Arguments are zeros of the program's shapes, or the output shapes of
    the programs it follows: a call's logits and sampled tokens (by rows)."""
    outs = {}  # the StepOut of a call, by rows
    for key in keys:
      kind, static = key[0], {}
      if kind == "step":
        _, b, t, m = key
        tokens, last = np.zeros((b, t), np.int32), np.zeros(b, np.int32)
        sampling = SamplingArrays.from_params([GREEDY] * b, [0] * b, [0] * b)
        arrays = StepArrays((), (), tokens, tokens, np.zeros((b, m), np.int32), last, sampling)
        jitted, args = self._step, self.step_args(cache, arrays)
      elif kind == "sample_transformed":
        _, b, *widths = key
        sampling = SamplingArrays.from_params([GREEDY] * b, [0] * b, [0] * b)
        jitted, static = _sample_transformed, {"portable": self.portable}
        args = (outs[b].logits_bv, sampling, LogitsArrays.neutral(b, *widths))
      elif kind == "logprobs":
        _, b, k = key
        jitted, args, static = _sample_logprobs, (outs[b].logits_bv, outs[b].tokens_b), {"k": k}
      elif kind == "processed_logprobs":
        _, b, *widths = key
        sampling = SamplingArrays.from_params([GREEDY] * b, [0] * b, [0] * b)
        jitted = _processed_logprobs
        args = (outs[b].logits_bv, outs[b].tokens_b, sampling, LogitsArrays.neutral(b, *widths))
      elif kind == "swap":
        _, direction, x = key
        index, jitted = np.arange(x, dtype=np.int32), _SWAPS[direction]
        if direction == "out":
          args, static = (cache, index), {"places": host_block_shardings(cache)}
        else:
          args = (cache, host_block_specs(cache, x), index)
      else:
        raise ValueError(f"unknown program {key!r}")
      out = build(key, jitted, args, static)
      if kind == "step":
        outs[key[1]] = out[0]

  def call(self, cache: PagedKVCache, arrays: StepArrays, previous_b=None, rows_b=None,
           want_sampled: bool = False, targets_bt=None) -> tuple[StepOut, PagedKVCache]:
    """Dispatches one model call (`_step`); returns what it leaves on the device and the
    cache. `previous_b`, `rows_b`: a decode call's input tokens from the previous call's
    (`step_after`); `want_sampled`: the sampled tokens' log-probabilities; `targets_bt`: a
    prefill call's prompt log-probabilities of these tokens."""
    args = self.step_args(cache, arrays, previous_b, rows_b, want_sampled, targets_bt)
    return self._program(("step",) + arrays.shape, self._step, args)(*args)

  def step(self, cache: PagedKVCache, arrays: StepArrays) -> tuple[jax.Array, PagedKVCache]:
    """Dispatches one model call and its sampling; returns the sampled tokens [b] (not yet read)
    and the cache."""
    out, cache = self.call(cache, arrays)
    return self.sample(out, arrays), cache

  def sample(self, out: StepOut, arrays: StepArrays) -> jax.Array:
    """The sampled tokens of a call: the plain sampler's (in the call), or where a row has logit
    transforms (`arrays.logits`), the transformed sampler's from the call's logits."""
    if arrays.logits is None:
      return out.tokens_b
    args = (out.logits_bv, arrays.sampling, arrays.logits)
    key = ("sample_transformed", arrays.shape[0]) + arrays.logits.widths
    return self._program(key, _sample_transformed, args, portable=self.portable)(*args)

  def step_after(self, cache: PagedKVCache, arrays: StepArrays, previous_b: jax.Array,
                 rows_b: np.ndarray, sample: bool = True) -> tuple[Any, PagedKVCache]:
    """`step` for a decode call dispatched before the previous call's sampled tokens
    `previous_b` are read: its row i's input token is previous_b[rows_b[i]] (see `_follow`),
    taken on the device. The previous call's row count must be this call's. Without `sample`,
    returns the call's `StepOut`, to sample once the host has the rows' transforms (`sample`)."""
    out, cache = self.call(cache, arrays, previous_b, rows_b)
    return (self.sample(out, arrays) if sample else out), cache

  def step_logprobs(self, cache: PagedKVCache, arrays: StepArrays, sample_k: int | None,
                    prompt_targets_bt: np.ndarray | None, prompt_k: int = LOGPROB_K
                    ) -> tuple[jax.Array, PagedKVCache, TopLogprobs | None, TopLogprobs | None,
                               jax.Array]:
    """`step` that also computes log-probabilities, left on the device: of the sampled tokens
    and the top `sample_k` ([b]; None: not computed), of `prompt_targets_bt` at every position
    and the top `prompt_k` ([b, t]; None: not computed), and with `sample_k`, of the sampled
    tokens under the processed distribution they were drawn from ([b]; `processed_logprobs`).
    Both k are `LOGPROB_K`, the width every call computes."""
    for k in (sample_k, prompt_k):
      if k is not None and k != LOGPROB_K:
        raise ValueError(f"log-probabilities are computed at top-{LOGPROB_K}, not {k}")
    plain = arrays.logits is None
    out, cache = self.call(cache, arrays, want_sampled=sample_k is not None and plain,
                           targets_bt=prompt_targets_bt)
    prompt_top = None if prompt_targets_bt is None else out.prompt
    tokens_b = self.sample(out, arrays)
    if sample_k is None:
      return tokens_b, cache, None, prompt_top, None
    if plain:
      return tokens_b, cache, out.sampled, prompt_top, out.processed_b
    lp_args = (out.logits_bv, tokens_b)
    sampled_top = self._program(("logprobs", arrays.shape[0], sample_k), _sample_logprobs,
                                lp_args, k=sample_k)(*lp_args)
    key = ("processed_logprobs", arrays.shape[0]) + arrays.logits.widths
    processed_args = (out.logits_bv, tokens_b, arrays.sampling, arrays.logits)
    processed_b = self._program(key, _processed_logprobs, processed_args)(*processed_args)
    return tokens_b, cache, sampled_top, prompt_top, processed_b

  def swap(self, cache: PagedKVCache, host: HostTier, direction: str, pairs
           ) -> tuple[PagedKVCache, HostTier]:
    """Dispatches copies of (source, destination) block pairs, "out" (device -> host tier) or
    "in", one program per part of `swap.swap_parts`; returns the cache and the host tier."""
    src, dst = (np.asarray(ids, np.int32) for ids in zip(*pairs))
    if direction == "out":  # the tier's slots set once (each `stored` copies its slots)
      return cache, host.stored(dst, self.copy_out(cache, src))
    for part in part_slices(len(pairs)):
      x = part.stop - part.start
      args = (cache, host.blocks(src[part]), dst[part])
      program = self._program(("swap", "in", x), _SWAPS["in"], args)
      dispatched = time.perf_counter()
      cache, marker = program(*args)
      self.timer.submit("in", marker, dispatched, x)
    return cache, host

  def copy_out(self, cache: PagedKVCache, device_ids) -> list[KVBlocks]:
    """Dispatches copies of device blocks `device_ids` to pinned-host buffers of their own (the
    swap-out programs), not waited for: the blocks of a swap-out, or of the disk tier's writes."""
    src, places, blocks = np.asarray(device_ids, np.int32), host_block_shardings(cache), []
    for part in part_slices(len(src)):
      args = (cache, src[part])
      program = self._program(("swap", "out", part.stop - part.start), _SWAPS["out"], args,
                              places=places)
      dispatched = time.perf_counter()
      out, marker = program(*args)
      blocks += out
      self.timer.submit("out", marker, dispatched, part.stop - part.start)
    return blocks
