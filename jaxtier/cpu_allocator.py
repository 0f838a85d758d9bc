"""Keeps freed memory in the process, so XLA:CPU temporaries above 32 MB stop page-faulting.

XLA:CPU allocates each execution's temporaries as one block with `malloc`. glibc serves any block
above its mmap threshold (at most 32 MB on 64-bit) with a fresh `mmap` and unmaps it on `free`, so
every step of a program with more than 32 MB of temporaries touches new pages: one minor page fault
per 4 KiB page, about 10,000 per step for 42 MB. An offloaded tail with prefetch depth d holds d + 1
layer copies among its temporaries (14 MB per SmolLM2 layer in float32), so from d = 2 on each step
paid for those faults (measured: 10,374 faults and +30 ms per step at d = 2, none at d = 1).

`retain_freed_memory()` turns that off for the whole process: glibc stops using `mmap` for
allocations, serves every thread from its main heap (a per-thread arena cannot hold a block of
64 MB or more without `mmap`) and stops returning the top of the heap to the system, so a block
freed by one step is reused by the next. The costs: the process keeps its peak heap, and threads
share one allocator lock. It is a process-wide setting, so entry points (scripts) call it, not the
library, and before the first JAX computation starts XLA's threads (arenas that exist stay).
"""

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
  name = ctypes.util.find_library("c")
  if name is None:
    return None
  try:
    libc = ctypes.CDLL(name)
    libc.gnu_get_libc_version  # only glibc has it
  except (OSError, AttributeError):
    return None
  return libc


def retain_freed_memory() -> bool:
  """Makes glibc keep freed blocks for reuse (one arena, no mmap, no trim). True if applied; False
  when the C library is not glibc (the setting does not exist there)."""
  libc = _glibc()
  if libc is None:
    return False
  settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _INT_MAX))
  return all([bool(libc.mallopt(param, value)) for param, value in settings])
