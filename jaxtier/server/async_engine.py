"""An asyncio front over the batch driver: requests queue up and a background thread runs them.

The thread takes up to `max_num_seqs` waiting requests and runs them as one padded batch
(`LLM.run_batch`) until every row of it has finished; requests that arrive meanwhile wait for the
next batch. A batch that is not full starts once no request has arrived for `batch_wait_s` (at
most 20 such waits after its first request), so clients that send together share one batch
instead of the first running alone. Per-step updates travel back to each request's event loop, so
HTTP handlers stream tokens as they are generated. Closing a request's stream (a client that disconnected) aborts its
row between two steps, or drops it from the queue if it has not started.

The HTTP layer needs only `generate` (an async stream of `StepUpdate`s that aborts when closed),
`stats` and the `llm` that tokenizes prompts; a continuous-batching engine that admits requests
between steps can take the place of this class behind the same methods.
"""

import asyncio
import collections
import dataclasses
import threading
import time
from typing import AsyncIterator, Callable, Protocol, Sequence

from absl import logging

from jaxtier.generate import Completion, StepUpdate
from jaxtier.scheduler import Request


class BatchDriver(Protocol):
  """What the engine needs from `jaxtier.LLM` to run a batch."""
  max_num_seqs: int

  def run_batch(self, requests: Sequence[Request],
                on_step: Callable[[list[StepUpdate]], None] | None = None,
                aborted: Callable[[int], bool] | None = None) -> list[Completion]:
    ...


MAX_WAITS = 20  # a batch waits at most this many batch_wait_s for arrivals


class EngineError(RuntimeError):
  """The batch a request ran in failed; the engine itself keeps serving."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
  running: int  # rows of the current batch still generating
  waiting: int  # requests queued for the next batch
  steps: int  # model steps run since start (prefills included)


class _Entry:
  """One request's link between the engine thread and the event loop that waits for it."""

  def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
    self.request, self.loop = request, loop
    self.updates: asyncio.Queue = asyncio.Queue()
    self.aborted = False  # set by the event loop, read by the engine thread
    self.done = False  # set by the engine thread


def _deliver(items: list[tuple[_Entry, StepUpdate | EngineError]]) -> None:
  """Hands each entry its item on the entry's event loop, with one call per event loop."""
  by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Entry, StepUpdate | EngineError]]] = {}
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
  """Runs queued requests in batches on a background thread; see the module docstring.

  Args:
    llm: the batch driver, normally a `jaxtier.LLM`.
    batch_wait_s: the quiet time after the last arrival that starts a batch that is not full.
  """

  def __init__(self, llm: BatchDriver, batch_wait_s: float = 0.005):
    if not batch_wait_s >= 0:
      raise ValueError(f"batch_wait_s={batch_wait_s!r}: expected a number >= 0")
    self.llm, self.batch_wait_s = llm, batch_wait_s
    self._cond = threading.Condition()
    self._waiting: collections.deque[_Entry] = collections.deque()
    self._running: list[_Entry] = []
    self._steps = 0
    self._closed = False
    self._thread = threading.Thread(target=self._loop, name="jaxtier-engine", daemon=True)
    self._thread.start()

  def stats(self) -> EngineStats:
    with self._cond:
      return EngineStats(running=sum(not (e.done or e.aborted) for e in self._running),
                         waiting=sum(not e.aborted for e in self._waiting), steps=self._steps)

  async def generate(self, request: Request) -> AsyncIterator[StepUpdate]:
    """Streams the request's updates; the last one carries its `Completion`.

    Waits while the current batch runs. Closing the stream early aborts the request. Raises
    EngineError if the batch fails.
    """
    entry = _Entry(request, asyncio.get_running_loop())
    with self._cond:
      if self._closed:
        raise EngineError("the engine is shut down")
      self._waiting.append(entry)
      self._cond.notify()
    try:
      while True:
        item = await entry.updates.get()
        if isinstance(item, EngineError):
          raise item
        yield item
        if item.completion is not None:
          return
    finally:
      entry.aborted = not entry.done

  def close(self) -> None:
    """Stops the thread after the batch it is running; queued requests fail with EngineError."""
    with self._cond:
      self._closed = True
      waiting, self._waiting = list(self._waiting), collections.deque()
      self._cond.notify()
    _deliver([(entry, EngineError("the engine shut down before this request started"))
              for entry in waiting])
    self._thread.join()

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._waiting and not self._closed:
          self._cond.wait()
        now = time.monotonic()
        quiet_until, latest = now + self.batch_wait_s, now + MAX_WAITS * self.batch_wait_s
        seen = len(self._waiting)
        while seen < self.llm.max_num_seqs and not self._closed:
          left = min(quiet_until, latest) - time.monotonic()
          if left <= 0:
            break
          self._cond.wait(left)
          if len(self._waiting) != seen:  # another arrival: wait for the next one again
            seen, quiet_until = len(self._waiting), time.monotonic() + self.batch_wait_s
        if self._closed:
          return
        batch: list[_Entry] = []
        while self._waiting and len(batch) < self.llm.max_num_seqs:
          entry = self._waiting.popleft()
          if not entry.aborted:
            batch.append(entry)
        self._running = batch
      if batch:
        self._run(batch)
      with self._cond:
        self._running = []

  def _run(self, batch: list[_Entry]) -> None:
    def on_step(updates: list[StepUpdate]) -> None:
      with self._cond:
        self._steps += 1
      items = []
      for update in updates:
        entry = batch[update.index]
        entry.done = update.completion is not None
        if not entry.aborted:
          items.append((entry, update))
      _deliver(items)  # one wake-up of each event loop per step

    try:
      self.llm.run_batch([e.request for e in batch], on_step=on_step,
                         aborted=lambda i: batch[i].aborted)
    except Exception as e:  # one failing batch must not stop the engine
      logging.exception("batch of %d requests failed", len(batch))
      failed = [entry for entry in batch if not entry.done]
      for entry in failed:
        entry.done = True
      _deliver([(entry, EngineError(f"generation failed: {type(e).__name__}: {e}"))
                for entry in failed])
