"""The engine's grammar compiles: a constrained request's matcher is built in a worker thread while
the engine keeps stepping the other requests.

A constrained request is checked when it arrives (`check`: its limits and llguidance's validation,
`jaxtier.sampling.structured.checked_grammar`), so a constraint past a limit is a ValueError before
it is queued. Its matcher, whose lexer can take seconds to build for tens of thousands of strings,
is built by `submit` in a worker; the request waits in the scheduler's queue meanwhile, held
(`scheduler.Arrive(held=True)`): it keeps its place, and the requests behind it are admitted.
Each step, `finished` hands back the compiles that ended: a matcher, or the error that ends the
request (llguidance refused the grammar, or it took longer than `grammar_compile_timeout_s`).
llguidance releases the GIL while it builds, so the engine's thread runs on beside the worker.

A compile past its time budget cannot be interrupted (llguidance runs it to its fuel limits, which
bound it); its request ends at once and the worker's result is dropped when it comes.
"""

import concurrent.futures
import threading
import time
from collections.abc import Hashable

import llguidance

from jaxtier.common.grammar_limits import GrammarLimits
from jaxtier.sampling.structured import (GrammarMatcher, StructuredOutputsParams, checked_grammar,
                                         grammar_tokenizer)
from jaxtier.text.tokenizer import Tokenizer

WORKERS = 2  # compiles at once: llguidance builds on one core each


class GrammarCompiles:
  """The grammar compiles of one engine (see the module docstring).

  Args:
    tokenizer, vocab_size: llguidance's tokenizer is built from them once, by the first compile.
    limits: the constraints' limits and compile budget.
    clock: seconds, for the budget (monotonic).
  """

  def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GrammarLimits,
               clock=time.monotonic):
    self.limits, self._clock = limits, clock
    self._tokenizer, self._vocab_size = tokenizer, vocab_size
    self._ll_tokenizer: llguidance.LLTokenizer | None = None
    self._lock = threading.Lock()  # the tokenizer is built once, by the first worker
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._pending: dict[Hashable, tuple[concurrent.futures.Future, float, str]] = {}
    self.compiled = self.failed = 0
    self.compile_seconds = 0.0  # the workers' time building matchers
    self.wait_seconds = 0.0  # the engine's time waiting for a compile with nothing else to do

  def check(self, constraint: StructuredOutputsParams) -> None:
    """Raises StructuredOutputsError (a ValueError naming the field, and the limit where one is
    passed) for a constraint this engine refuses."""
    checked_grammar(constraint, self.limits)

  def submit(self, request_id: Hashable, constraint: StructuredOutputsParams) -> None:
    """Starts building the matcher of a checked constraint (an earlier compile under the same
    id, whose request ended, is forgotten: its result is never handed back)."""
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, "jaxtier-grammar")
    future = self._pool.submit(self._build, constraint)
    self._pending[request_id] = (future, self._clock(), constraint.field)

  def _build(self, constraint: StructuredOutputsParams) -> tuple[GrammarMatcher, float]:
    with self._lock:
      if self._ll_tokenizer is None:
        self._ll_tokenizer = grammar_tokenizer(self._tokenizer, self._vocab_size)
    start = time.perf_counter()
    matcher = GrammarMatcher(self._ll_tokenizer, constraint, self.limits)
    return matcher, time.perf_counter() - start

  def __contains__(self, request_id: Hashable) -> bool:
    return request_id in self._pending

  def pending(self) -> set:
    """The ids of the requests whose grammar is compiling."""
    return set(self._pending)

  def __len__(self) -> int:
    return len(self._pending)

  def cancel(self, request_id: Hashable) -> None:
    """Forgets a compile (its request ended); a running one finishes unread."""
    entry = self._pending.pop(request_id, None)
    if entry is not None:
      entry[0].cancel()

  def finished(self) -> list[tuple[Hashable, GrammarMatcher | None, str | None]]:
    """The compiles that ended since the last call, as (request id, matcher, None) or
    (request id, None, why it failed), in submission order."""
    now, out = self._clock(), []
    for request_id, (future, start, field) in list(self._pending.items()):
      if future.done():
        try:
          matcher, seconds = future.result()
        except Exception as e:  # pylint: disable=broad-except  (the grammar's own error)
          out.append((request_id, None, f"structured_outputs.{field} could not be compiled: {e}"))
        else:
          self.compile_seconds += seconds
          out.append((request_id, matcher, None))
      elif now - start > self.limits.grammar_compile_timeout_s:
        future.cancel()
        out.append((request_id, None, f"structured_outputs.{field} took longer than "
                    f"grammar_compile_timeout_s={self.limits.grammar_compile_timeout_s:g} s to "
                    "compile"))
      else:
        continue
      del self._pending[request_id]
      if out[-1][1] is None:
        self.failed += 1
      else:
        self.compiled += 1
    return out

  def wait(self, timeout_s: float) -> None:
    """Blocks until a compile ends, its budget runs out, or `timeout_s` passed."""
    if not self._pending:
      return
    now = self._clock()
    budget = self.limits.grammar_compile_timeout_s
    deadline = min(began + budget for _, began, _ in self._pending.values()) - now
    start = time.perf_counter()
    concurrent.futures.wait([future for future, _, _ in self._pending.values()],
                            timeout=max(0.0, min(timeout_s, deadline)),
                            return_when=concurrent.futures.FIRST_COMPLETED)
    self.wait_seconds += time.perf_counter() - start

  def figures(self) -> dict:
    """The compiles' counts and seconds, for the engine's stats."""
    return {"grammar_compiles": self.compiled, "grammar_compile_failures": self.failed,
            "grammar_compiling": len(self._pending),
            "grammar_compile_seconds": self.compile_seconds,
            "grammar_wait_seconds": self.wait_seconds}

  def close(self) -> None:
    """Stops the workers after the compiles they are running; forgets the others."""
    for request_id in list(self._pending):
      self.cancel(request_id)
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
      self._pool = None
