"""An asyncio front over the engine: one thread steps it, HTTP handlers stream each request's tokens.

A warm-up thread compiles every program the engine can run (`Engine.start_warmup`, its progress
logged at each tenth of the programs), those of an ordinary request first: `ready` once it has
them, the rest reported in /metrics. The engine thread serves from the start meanwhile: a request
that arrives during the warm-up runs with the programs it needs, compiled on the spot ahead of the
warm-up's queue (see `jaxtier.engine.startup`). It loops: it takes the
requests and aborts that handlers queued since the last step, applies them to the engine
(arrivals join the running batch at the next step: continuous batching), runs one
`Engine.step()` and hands each update to the event loop of the request it belongs to, with one
wake-up per event loop per step. It sleeps only while the engine has nothing to do.

Closing a request's stream (a client that disconnected) aborts it before the next step; its blocks
are freed at once and nothing more is delivered. A step that fails ends the requests it held with
`EngineError` (the engine aborts them and stays usable). `drain` stops new requests, waits for the
running ones up to a timeout and ends the rest with finish_reason "abort"; `close` stops the thread.

A warm-up that fails leaves the engine serving (programs compile when first needed); one that
fails before `ready` leaves it never `ready`: `warmup_error` says why, and the HTTP layer's
/health answers 503 with it.

The server holds `llm.engine`: do not call the offline methods of the same `LLM` (`generate`,
`chat`) while it serves, since the engine is stepped by this class's thread only.
"""

import asyncio
import dataclasses
import threading
import time
from collections.abc import Hashable

from absl import logging

from jaxtier.engine.engine import RequestUpdate
from jaxtier.scheduler import Request


class EngineError(RuntimeError):
  """The step a request ran in failed, or the engine is shutting down."""


class RequestRejected(EngineError):
  """The engine refused the request (`Engine.add_request` raised ValueError): bad input."""


class QueueFull(EngineError):
  """More requests are queued than `max_queued_requests`: retry later."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
  """The engine as the HTTP layer sees it, refreshed after every step."""
  running: int  # requests holding device KV blocks
  waiting: int  # requests queued, not yet admitted (handed to the engine or not)
  swapped: int  # preempted requests whose KV sits in the host pool
  steps: int  # engine steps run since start
  model_calls: int  # model programs run (a step: its prefill in a call or a few, its decode in one)
  ready: bool  # an ordinary request's programs are compiled (the rest may still be compiling)
  engine: dict  # `Engine.stats()` as of the last step (swap timings may lag a step)


class _Entry:
  """One request's link between the engine thread and the event loop that waits for it."""

  def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
    self.request, self.loop = request, loop
    self.updates: asyncio.Queue = asyncio.Queue()
    self.aborted = False  # set by the event loop: the client went away
    self.done = False  # set by the engine thread: the last update was handed over


class RequestStream:
  """One request's updates as an async iterator; the last update carries its `Completion`.

  Raises EngineError if the request's step fails or the server ends it. `aclose()` before the
  last update aborts the request (its blocks are freed before the engine's next step).
  """

  def __init__(self, engine: "AsyncEngine", entry: _Entry):
    self._engine, self._entry, self._finished = engine, entry, False

  def __aiter__(self) -> "RequestStream":
    return self

  async def __anext__(self) -> RequestUpdate:
    if self._finished:
      raise StopAsyncIteration
    item = await self._entry.updates.get()
    if isinstance(item, EngineError):
      self._finished = True
      raise item
    self._finished = item.completion is not None
    return item

  async def aclose(self) -> None:
    self._finished = True
    self._engine._client_gone(self._entry)  # pylint: disable=protected-access


def _deliver(items: list[tuple[_Entry, RequestUpdate | EngineError]]) -> None:
  """Hands each entry its item on the entry's event loop, with one call per event loop."""
  by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Entry, RequestUpdate | EngineError]]] = {}
  for entry, item in items:
    by_loop.setdefault(entry.loop, []).append((entry, item))
  for loop, mine in by_loop.items():
    def put_all(mine=mine) -> None:
      for entry, item in mine:
        entry.updates.put_nowait(item)

    try:
      loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the waiting event loop is closed: nobody will read these requests
      for entry, _ in mine:
        entry.aborted = True


class AsyncEngine:
  """Steps `llm.engine` on a background thread; see the module docstring.

  Args:
    llm: a `jaxtier.LLM`; its engine (and KV pools) is created here.
    max_queued_requests: most requests waiting for admission; more raise `QueueFull`. None: no
      cap.
    warmup: compile every program on a warm-up thread while serving (see
      `Engine.start_warmup`); else `ready` at once and the first requests of each shape wait
      for its compile.

  Attributes:
    warmup: the `startup.Warmup` running or run, or None without one.
    warmup_error: why warm-up failed ("TypeError: ..."), else None.
  """

  def __init__(self, llm, max_queued_requests: int | None = None, warmup: bool = True):
    if max_queued_requests is not None and max_queued_requests < 1:
      raise ValueError(f"max_queued_requests={max_queued_requests!r}: expected an int >= 1 or "
                       "None")
    self.llm, self.max_queued_requests = llm, max_queued_requests
    self.engine = llm.engine
    self._cond = threading.Condition()
    self._inbox: list[_Entry] = []  # new requests, for the engine thread
    self._aborts: list[tuple[Hashable, bool]] = []  # (request id, deliver its final update)
    self._live: dict[Hashable, _Entry] = {}  # requests in the engine (engine thread only)
    self._num_live = 0  # len(self._live) as of the end of the engine thread's last iteration
    self._working = False  # the engine thread is between taking the inbox and publishing
    self._taken = 0  # arrivals the engine thread took that the published stats do not count yet
    self._accepting, self._closed, self._ending = True, False, False
    self._drained = 0  # requests the engine thread ended because `drain` timed out
    self.warmup = None
    self._stats = self._snapshot(ready=False)
    self._logged = 0  # programs done when warm-up progress was last logged
    if warmup:
      self.warmup = self.engine.start_warmup(busy=self._serving, progress=self._log_progress,
                                             start=False)
      self.warmup.start()
    self._thread = threading.Thread(target=self._loop, name="jaxtier-engine", daemon=True)
    self._thread.start()

  # The HTTP side.

  @property
  def ready(self) -> bool:
    """Whether the programs of an ordinary request are compiled (see `Engine.start_warmup`)."""
    w = self.warmup
    return w is None or w.ready.is_set()

  @property
  def warmup_error(self) -> str | None:
    return None if self.warmup is None else self.warmup.error

  @property
  def warmup_progress(self) -> tuple[int, int]:
    """(programs compiled, programs in all) of the warm-up so far."""
    return (0, 0) if self.warmup is None else self.warmup.counts

  @property
  def warmup_report(self) -> dict | None:
    """`Warmup.report` once the warm-up has compiled every program, else None."""
    w = self.warmup
    return w.report if w is not None and w.done.is_set() and w.error is None else None

  def wait_ready(self, timeout_s: float | None = None) -> bool:
    """Blocks until `ready` (or warm-up failed, or `timeout_s` passed); returns `ready`."""
    w = self.warmup
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while w is not None and not w.ready.is_set() and not w.done.is_set():
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left <= 0:
        break
      w.ready.wait(0.1 if left is None else min(left, 0.1))
    return self.ready

  def wait_warm(self, timeout_s: float | None = None) -> bool:
    """Blocks until the warm-up has compiled every program (or failed, or `timeout_s` passed);
    returns whether it compiled them all."""
    if self.warmup is None:
      return True
    self.warmup.done.wait(timeout_s)
    return self.warmup_report is not None

  @property
  def accepting(self) -> bool:
    """False once `drain` or `close` has begun."""
    return self._accepting

  def stats(self) -> EngineStats:
    with self._cond:
      return self._stats

  def submit(self, requests: list[Request]) -> list["RequestStream"]:
    """Queues requests (the choices of one HTTP request, all or none) for the engine's next step;
    returns a stream of updates per request.

    Raises QueueFull when they would pass `max_queued_requests`, EngineError when the engine is
    shutting down.
    """
    loop = asyncio.get_running_loop()
    entries = [_Entry(request, loop) for request in requests]
    with self._cond:
      if not self._accepting:
        raise EngineError("the server is shutting down")
      queued = len(self._inbox) + self._taken + self._stats.waiting
      if self.max_queued_requests is not None and queued + len(entries) > self.max_queued_requests:
        raise QueueFull(f"{self.max_queued_requests} requests are queued already "
                        "(max_queued_requests); retry later")
      self._inbox += entries
      self._cond.notify()
    return [RequestStream(self, entry) for entry in entries]

  def generate(self, request: Request) -> "RequestStream":
    """`submit` of one request."""
    return self.submit([request])[0]

  def _client_gone(self, entry: _Entry) -> None:
    if not entry.done and not entry.aborted:
      entry.aborted = True
      with self._cond:
        self._aborts.append((entry.request.request_id, False))
        self._cond.notify()

  def drain(self, timeout_s: float) -> int:
    """Stops accepting requests, lets the live ones finish for up to `timeout_s` seconds, then
    ends the rest with finish_reason "abort" (delivered to their clients). Returns how many were
    ended that way."""
    deadline = time.monotonic() + timeout_s
    with self._cond:
      self._accepting = False
      while self._busy() and time.monotonic() < deadline:
        self._cond.wait(deadline - time.monotonic())
      # The engine thread counts what it ends: mid-iteration, the requests it took from the inbox
      # are in neither the inbox nor the live count published at the end of its last iteration.
      self._ending = True
      self._cond.notify_all()
      while self._busy():
        self._cond.wait()
      return self._drained

  def close(self) -> None:
    """Stops the thread after its current step; requests still queued or running fail with
    EngineError."""
    with self._cond:
      self._accepting, self._closed = False, True
      self._cond.notify_all()
    self._thread.join()
    if self.warmup is not None:  # the program it is compiling finishes first
      self.warmup.stop()
      self.warmup.join(60.0)
    failed = self._inbox + list(self._live.values())
    for entry in self._live.values():
      self.engine.abort(entry.request.request_id)
    self.engine.flush_disk()  # the disk tier's queued blocks, written before the process ends
    self._inbox, self._live = [], {}
    _deliver([(entry, EngineError("the engine shut down before this request finished"))
              for entry in failed])

  # The engine thread.

  def _busy(self) -> bool:
    """Whether any request is queued, live or being aborted (call with the lock held)."""
    return bool(self._inbox or self._aborts or self._working or self._num_live)

  def _snapshot(self, ready: bool) -> EngineStats:
    figures = self.engine.stats(wait_for_swaps=False)
    return EngineStats(running=figures["running"], waiting=figures["waiting"],
                       swapped=figures["swapped"], steps=figures["steps"],
                       model_calls=figures["model_calls"], ready=ready, engine=figures)

  def _serving(self) -> bool:
    """Whether requests are queued or live (read without the lock: a hint for the warm-up)."""
    return bool(self._inbox or self._num_live or self._working)

  def _log_progress(self, done: int, total: int, key: tuple) -> None:
    """The warm-up's progress in the log: at the first program, at each tenth, at ready."""
    w = self.warmup
    if total and (done == 1 or 10 * done // total > 10 * self._logged // total):
      logging.info("warm-up: %d/%d programs (%d%%) in %.1f s, last %s", done, total,
                   100 * done // total, w.report["seconds"], key)
      self._logged = done
    if w is not None and done == w.ready_count:
      logging.info("warm-up: ready (%d programs of an ordinary request) in %.1f s; %d more "
                   "compile while serving", done, w.report["seconds"], total - done)
    if done == total:
      report = w.report
      logging.info("warm-up: %d programs ready in %.1f s (%.1f s compiling; %d compiled, %d from "
                   "the persistent cache)", total, report["seconds"], report["compile_seconds"],
                   report["compiled"], report["cache_hits"])
    with self._cond:
      self._stats = dataclasses.replace(self._stats, ready=self.ready)

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._busy() and not self._closed:
          if self.warmup is not None:
            self.warmup.wake()
          self._cond.wait()
        if self._closed:
          return
        arrivals, self._inbox = self._inbox, []
        aborts, self._aborts = self._aborts, []
        ending, self._working, self._taken = self._ending, True, len(arrivals)
      items = self._admit(arrivals)
      if ending:  # `drain` timed out: end every request, telling its client
        aborts += [(request_id, True) for request_id in self._live]
        drained = len(self._live)
      items += self._abort(aborts)
      if self.engine.has_unfinished():
        items += self._step()
      _deliver(items)  # one wake-up of each event loop per step
      with self._cond:
        self._stats = self._snapshot(ready=self.ready)
        self._num_live, self._working, self._taken = len(self._live), False, 0
        if ending:
          self._drained += drained
        self._cond.notify_all()  # for `drain`

  def _admit(self, arrivals: list[_Entry]) -> list[tuple[_Entry, EngineError]]:
    failed = []
    for entry in arrivals:
      r = entry.request
      if entry.aborted:  # the client left before the request started
        continue
      try:
        self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, r.seed)
      except ValueError as e:  # the HTTP layer checks requests first; this is a backstop
        failed.append((entry, RequestRejected(f"request rejected: {e}")))
        continue
      self._live[r.request_id] = entry
    return failed

  def _abort(self, aborts: list[tuple[Hashable, bool]]) -> list[tuple[_Entry, RequestUpdate]]:
    ended = []
    for request_id, deliver in aborts:
      entry = self._live.pop(request_id, None)
      update = self.engine.abort(request_id)
      if entry is not None and deliver and update is not None:
        entry.done = True
        ended.append((entry, update))
    return ended

  def _step(self) -> list[tuple[_Entry, RequestUpdate | EngineError]]:
    try:
      updates = self.engine.step()
    except Exception as e:  # the engine aborted every live request; it keeps serving
      logging.exception("an engine step failed")
      failed, self._live = list(self._live.values()), {}
      for entry in failed:
        entry.done = True
      return [(entry, EngineError(f"generation failed: {type(e).__name__}: {e}"))
              for entry in failed]
    items = []
    for update in updates:
      entry = self._live.get(update.request_id)
      if entry is None:
        continue
      if update.completion is not None:
        del self._live[update.request_id]
        entry.done = True
      if not entry.aborted:
        items.append((entry, update))
    return items
