"""Keeps freed memory in the process, so XLA:CPU temporaries above 32 MB stop page-faulting.

XLA:CPU allocates each execution's temporaries as one block with `malloc`. glibc serves any block
above its mmap threshold (at most 32 MB on 64-bit) with a fresh `mmap` and unmaps it on `free`, so
every step of a program with more than 32 MB of temporaries touches new pages: one minor page fault
per 4 KiB page, about 10,000 per step for 42 MB. An offloaded tail with prefetch depth d holds d + 1
layer copies among its temporaries (14 MB per SmolLM2 layer in float32), so from d = 2 on each step
paid for those faults.

`retain_freed_memory()` turns that off for the whole process: glibc stops using `mmap` where it has
a choice and stops returning the top of a heap to the system, so a block freed by one step is
reused by the next. Each thread keeps its own arena, which holds blocks below 64 MB; a block of
64 MB or more that a thread other than the main one allocates is still mapped afresh (glibc's
per-thread heaps are 64 MB at most and it falls back to `mmap` there).
`retain_freed_memory(single_arena=True)` also serves every thread from the main heap, which holds
blocks of any size, for steps whose temporaries are whole layers of a large model (an offloaded
tail); the batch and serving scripts ask for it when they offload. Its cost is one allocator lock
for all threads: the host thread's dispatch and XLA's threads then contend for it every step, which
made the default model's decode steps mostly slower than with per-thread arenas, so it is not the
default.

The costs of either: the process keeps its peak heap. It is a process-wide setting, so entry
points (scripts) call it, not the library, and before the first JAX computation starts XLA's
threads (arenas that exist stay).
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


def retain_freed_memory(single_arena: bool = False) -> bool:
  """Makes glibc keep freed blocks for reuse (no mmap, no trim; with `single_arena`, one arena for
  every thread). True if applied; False when the C library is not glibc (the settings do not
  exist there)."""
  libc = _glibc()
  if libc is None:
    return False
  settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _INT_MAX)) + (
      ((M_ARENA_MAX, 1),) if single_arena else ())
  return all([bool(libc.mallopt(param, value)) for param, value in settings])
