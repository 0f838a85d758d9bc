"""An asyncio front over the engine: one thread steps it, HTTP handlers stream each request's tokens.

The engine thread first compiles every program the engine can run (`Engine.warmup`, its progress
logged at each tenth of the programs; `ready` once it has finished), then loops: it takes the
requests and aborts that handlers queued since the last step, applies them to the engine
(arrivals join the running batch at the next step: continuous batching), runs one
`Engine.step()` and hands each update to the event loop of the request it belongs to, with one
wake-up per event loop per step. It sleeps only while the engine has nothing to do.

Closing a request's stream (a client that disconnected) aborts it before the next step; its blocks
are freed at once and nothing more is delivered. A step that fails ends the requests it held with
`EngineError` (the engine aborts them and stays usable). `drain` stops new requests, waits for the
running ones up to a timeout and ends the rest with finish_reason "abort"; `close` stops the thread.

A warm-up that fails leaves the engine serving (programs compile when first needed) but never
`ready`: `warmup_error` says why, and the HTTP layer's /health answers 503 with it.

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
  ready: bool  # warm-up has finished and succeeded: no request will wait for a compile
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
    warmup: compile every program before serving (see `Engine.warmup`); else `ready` at once and
      the first requests of each shape wait for its compile.

  Attributes:
    warmup_progress: (programs compiled, programs in all) of the warm-up so far.
    warmup_report: {"programs", "compile_seconds", "seconds"} once warm-up has succeeded.
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
    self._stats = self._snapshot(ready=False)
    self._ready = threading.Event()
    self._warmed = threading.Event()  # warm-up is over, whether it succeeded or not
    self.warmup_progress = (0, 0)
    self.warmup_report: dict | None = None
    self.warmup_error: str | None = None
    self._warmup = warmup
    self._thread = threading.Thread(target=self._loop, name="jaxtier-engine", daemon=True)
    self._thread.start()

  # The HTTP side.

  @property
  def ready(self) -> bool:
    return self._ready.is_set()

  def wait_ready(self, timeout_s: float | None = None) -> bool:
    """Blocks until warm-up is over (or `timeout_s` passed); returns `ready` (False when warm-up
    failed: see `warmup_error`)."""
    self._warmed.wait(timeout_s)
    return self.ready

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
    failed = self._inbox + list(self._live.values())
    for entry in self._live.values():
      self.engine.abort(entry.request.request_id)
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

  def _warm_up(self) -> bool:
    """Runs `Engine.warmup`, logging its progress; returns whether it succeeded."""
    start = time.perf_counter()

    def progress(done: int, total: int, key: tuple) -> None:
      tenth = 10 * done // total  # logged at the first program and at each tenth of them
      if done == 1 or tenth > 10 * self.warmup_progress[0] // total:
        logging.info("warm-up: %d/%d programs (%d%%) in %.1f s, last %s", done, total,
                     100 * done // total, time.perf_counter() - start, key)
      self.warmup_progress = (done, total)

    try:
      report = self.engine.warmup(progress=progress)
    except Exception as e:  # pylint: disable=broad-except  (serve anyway, compiling on demand)
      self.warmup_error = f"{type(e).__name__}: {e}"
      logging.exception("warm-up failed after %.1f s (/health answers 503 with this reason; "
                        "programs will compile when first needed): %s",
                        time.perf_counter() - start, self.warmup_error)
      return False
    self.warmup_report = {**report, "seconds": time.perf_counter() - start}
    logging.info("warm-up: %d programs ready in %.1f s (%.1f s compiling)",
                 report["programs"], self.warmup_report["seconds"], report["compile_seconds"])
    return True

  def _loop(self) -> None:
    ready = self._warm_up() if self._warmup else True
    with self._cond:
      self._stats = self._snapshot(ready=ready)
    if ready:
      self._ready.set()
    self._warmed.set()
    while True:
      with self._cond:
        while not self._busy() and not self._closed:
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
        self._stats = self._snapshot(ready=ready)
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
