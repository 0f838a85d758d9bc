"""What the benchmark scripts (`bench_*.py`, `validate_gpu.py`) share: timing repeated calls,
releasing an engine between measurements, printing the report.

Standard library only: a script imports it before its engine flags are applied and JAX starts (the
allocator setting must come first), and `validate_gpu.sh` runs on machines that have JAX and
little else.
"""

import gc
import json
import time
from typing import Any, Callable


def timed_calls(fn: Callable[[], Any], repeats: int, warmup: bool = True) -> list[float]:
  """Seconds of each of `repeats` calls of `fn()` (which blocks until its work is done), after one
  untimed call (compiles, warms caches) unless `warmup` is False (the caller has made such a call
  already); each script takes the central figure it reports."""
  if warmup:
    fn()
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    samples.append(time.perf_counter() - start)
  return samples


def release(llm) -> None:
  """Closes a `jaxtier.LLM`'s engine and collects garbage before the next engine is measured. The
  compiled programs stay: engines of the same layout built later share them."""
  llm.engine.close()
  del llm
  gc.collect()


def print_report(report: dict, out: str | None, indent: int) -> None:
  """Prints `report` as one JSON object, and writes the same text to `out` (the script's --out)
  when given."""
  text = json.dumps(report, indent=indent)
  print(text)
  if out:
    with open(out, "w") as f:
      f.write(text + "\n")
