"""Start-up: the warm-up that compiles in the background, the persistent compilation cache, and
the figures and log line of a start.

Warm-up (`Warmup`): a thread compiles an engine's programs (`engine.warmup_programs`) in order,
those of an ordinary request first (`engine.ready_programs`: decode and prefill calls of a row or
two), then the rest. The engine keeps serving meanwhile: a step compiles the program it needs on
the spot, ahead of the queue (or waits for it, where the warm-up thread is compiling that very
one: `Runner._compiled`), and never waits for a program it does not use. `ready` is set once the
ready programs exist: what a server's /health waits for. On a CPU the thread compiles the rest
only while the engine is idle (`busy`), since a compile there takes the cores a step runs on; an
accelerator's steps run beside it.

The persistent compilation cache (`enable_compilation_cache`): JAX keeps every compiled program
on disk, keyed by the program, the compile options, jaxlib and the device. A second start of the
same configuration loads its programs from there instead of compiling them. The cache folder
holds a note of the jax, jaxlib and device that wrote it (`CACHE_NOTE`); where this process
differs, programs compile again, and the log says why (`cache_mismatch`).

Shape legend: none (no arrays here).
"""

import atexit
import json
import os
import threading
import time
import weakref
from collections.abc import Callable

import jax
from absl import logging

CACHE_NOTE = "jaxtier-cache.json"  # in the cache folder: what wrote its programs
_IMPORTED = time.time()


def process_seconds() -> float:
  """Seconds since this process started (from /proc where there is one, else since jaxtier's
  engine was imported)."""
  try:
    with open("/proc/self/stat", encoding="ascii") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime", encoding="ascii") as f:
      uptime = float(f.read().split()[0])
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
  except (OSError, ValueError, IndexError):
    return time.time() - _IMPORTED


def cache_identity() -> dict:
  """What JAX's persistent cache keys its programs by, beside the program: the jax and jaxlib
  versions and the devices of this process."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  device = jax.local_devices()[0]
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": device.platform,
          "device_kind": device.device_kind, "devices": jax.local_device_count()}


def cache_mismatch(directory: str) -> str | None:
  """Why the programs in the cache at `directory` cannot serve this process ("written by jaxlib
  0.6.1, this is 0.7.0"), or None where they can (or it holds none yet). Records this process's
  identity there for the next start."""
  path = os.path.join(directory, CACHE_NOTE)
  mine = cache_identity()
  try:
    with open(path, encoding="utf-8") as f:
      written = json.load(f)
  except (OSError, ValueError):
    written = None
  differences = [f"{name} {written.get(name)!r}, this process {value!r}"
                 for name, value in mine.items()
                 if isinstance(written, dict) and written.get(name) != value]
  if written != mine:
    try:
      os.makedirs(directory, exist_ok=True)
      with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(mine, f)
      os.replace(path + ".tmp", path)
    except OSError as e:
      logging.warning("compilation cache at %s: cannot write %s (%s)", directory, CACHE_NOTE, e)
  if not differences:
    return None
  return (f"the compilation cache at {directory} was written by another setup ("
          + "; ".join(differences) + "): its programs do not apply and compile again")


def enable_compilation_cache(directory: str | None) -> str | None:
  """Keeps compiled programs in `directory` (JAX's persistent compilation cache; every program,
  however fast it compiled), or turns the cache off where `directory` is None or "". Returns
  the folder in use. Touches no device (a multi-process job initializes JAX's distributed
  runtime after this): `default_compilation_cache` reads the folder's note later."""
  if not directory:
    jax.config.update("jax_enable_compilation_cache", False)
    _reset_cache()
    return None
  directory = os.path.expanduser(directory)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  _reset_cache()  # JAX settles on a cache at its first compile: a later folder needs a reset
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  _ENABLED.append(directory)
  return directory


_ENABLED: list[str] = []  # the folders `enable_compilation_cache` set, the last in use
_NOTED: set[str] = set()  # the folders whose note this process has read


def default_compilation_cache() -> str | None:
  """What `jaxtier.LLM` does first: the persistent compilation cache on, keeping every program
  (`enable_compilation_cache`), in the folder this process chose (JAX_COMPILATION_CACHE_DIR,
  `jax_compilation_cache_dir`), else in jaxtier's per-user folder (xla/ in
  `cache_dirs.cache_dir()`); off where this process turned it off
  (`jax_enable_compilation_cache`). Returns the folder in use, None when off. Logs, once per
  folder, why the programs there cannot serve this process, where they cannot
  (`cache_mismatch`)."""
  if not jax.config.jax_enable_compilation_cache:
    return None
  chosen = jax.config.jax_compilation_cache_dir
  if not (chosen and _ENABLED[-1:] == [chosen]):
    from jaxtier.common import cache_dirs  # pylint: disable=g-import-not-at-top
    chosen = enable_compilation_cache(chosen or os.path.join(cache_dirs.cache_dir(), "xla"))
  if chosen not in _NOTED:
    _NOTED.add(chosen)
    why = cache_mismatch(chosen)
    if why is not None:
      logging.warning("%s", why)
  return chosen


def _reset_cache() -> None:
  try:
    from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
    compilation_cache.reset_cache()
  except (ImportError, AttributeError):  # another JAX: the folder applies from the next process
    pass


_RUNNING: "weakref.WeakSet[Warmup]" = weakref.WeakSet()  # started, not done


def stop_warmups(warmups, timeout_s: float = 60.0) -> None:
  """Stops each of `warmups`, then waits for each to finish the program it is building."""
  for warmup in warmups:
    warmup.stop()
  for warmup in warmups:
    warmup.join(timeout_s)


@atexit.register
def _stop_running() -> None:
  """At exit, lets each warm-up finish the program it is compiling and end: a thread still
  inside XLA's compiler while the interpreter shuts down aborts the process."""
  stop_warmups(list(_RUNNING))


class Warmup:
  """Compiles `keys` of `engine` on a thread (see the module docstring).

  Args:
    engine: a `jaxtier.engine.Engine`.
    keys: the programs, in order (`warmup_programs`); the first `ready_count` make it `ready`.
    busy: whether the engine is serving now; where given, the programs past the ready ones wait
      while it is (on a CPU).
    progress: called after each program with (programs done, programs in all, its key).
    lower_only: trace and lower the programs, for the steps to compile (`Engine.lower_programs`).

  Attributes:
    ready, done: threading.Events, set once the ready programs exist, once all do (or it failed).
    error: why a program failed to compile ("TypeError: ..."), else None.
    report: {"programs", "compiled", "cache_hits", "compile_seconds", "seconds"} so far.
  """

  def __init__(self, engine, keys: list[tuple], ready_count: int,
               busy: Callable[[], bool] | None = None,
               progress: Callable[[int, int, tuple], None] | None = None,
               lower_only: bool = False):
    self.engine, self.keys, self.ready_count = engine, keys, ready_count
    self._lower_only = lower_only
    self._busy, self._progress = busy, progress
    self.ready, self.done = threading.Event(), threading.Event()
    self.error: str | None = None
    self.counts = (0, len(keys))
    self._idle = threading.Condition()
    self._stop = False
    runner = engine.runner
    self._before = (runner.compiled_programs, runner.cache_hits, runner.compile_seconds)
    self._start = time.perf_counter()
    self.ready_seconds: float | None = None
    self._thread = threading.Thread(target=self._run, name="jaxtier-warmup", daemon=True)

  def start(self) -> "Warmup":
    _RUNNING.add(self)
    self._thread.start()
    return self

  @property
  def report(self) -> dict:
    runner = self.engine.runner
    return {"programs": len(self.keys), "done": self.counts[0],
            "compiled": runner.compiled_programs - self._before[0],
            "cache_hits": runner.cache_hits - self._before[1],
            "compile_seconds": runner.compile_seconds - self._before[2],
            "seconds": time.perf_counter() - self._start,
            "ready_seconds": self.ready_seconds}  # since the process started

  def wake(self) -> None:
    """Tells a paused warm-up that the engine may have gone idle."""
    with self._idle:
      self._idle.notify_all()

  def stop(self) -> None:
    """Ends the thread after the program it is compiling (`join` waits for that)."""
    with self._idle:
      self._stop = True
      self._idle.notify_all()

  def join(self, timeout_s: float | None = None) -> bool:
    return self.done.wait(timeout_s)

  def _progressed(self, done: int, total: int, key: tuple) -> None:
    self.counts = (done, total)
    if done >= self.ready_count and not self.ready.is_set():
      self.ready_seconds = process_seconds()
      self.ready.set()
    if self._progress is not None:
      self._progress(done, total, key)

  def _wait_idle(self, done: int, total: int, key: tuple) -> None:
    self._progressed(done, total, key)
    with self._idle:
      while (not self._stop and done >= self.ready_count and self._busy is not None
             and self._busy()):
        self._idle.wait(1.0)
      if self._stop:
        raise _Stopped

  def _run(self) -> None:
    try:
      if self.ready_count == 0:
        self._progressed(0, len(self.keys), ())
      build = self.engine.lower_programs if self._lower_only else self.engine.compile_programs
      build(self.keys, self._wait_idle)
    except _Stopped:
      pass
    except Exception as e:  # pylint: disable=broad-except  (reported; steps compile on demand)
      self.error = f"{type(e).__name__}: {e}"
      logging.exception("warm-up failed after %.1f s (programs will compile when first "
                        "needed): %s", time.perf_counter() - self._start, self.error)
    finally:
      self.done.set()
      _RUNNING.discard(self)


class _Stopped(Exception):
  """Ends a warm-up thread early (`Warmup.stop`)."""


def startup_line(figures: dict) -> str:
  """The one log line of a start, from `figures` ({"load_seconds", "size_seconds",
  "engine_seconds", "compile": `Warmup.report`, "ready_seconds"}): its phases in order."""
  c = figures.get("compile") or {}
  parts = [f"{name} {figures[key]:.1f} s" for name, key in
           (("size", "size_seconds"), ("load", "load_seconds"), ("engine", "engine_seconds"))
           if figures.get(key) is not None]
  if c:
    count = (f"{c.get('done', 0)}/{c['programs']}" if c.get("programs") is not None
             else f"{c.get('done', 0)}")
    parts.append(f"compile {count} programs in {c.get('compile_seconds', 0.0):.1f} s "
                 f"({c.get('compiled', 0)} compiled, {c.get('cache_hits', 0)} from the cache)")
  if figures.get("ready_seconds") is not None:
    parts.append(f"ready at {figures['ready_seconds']:.1f} s after the process started")
  return "start-up: " + ", ".join(parts)
