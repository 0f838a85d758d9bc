"""cpu_allocator: with freed memory retained, XLA:CPU's large buffers come from the heap, not from
a fresh mmap (which page-faults every page on every step).

Runs in subprocesses because the setting applies to the whole process. glibc's own accounting
(`mallinfo2().hblkhd`, bytes held in mmapped blocks) is checked while a result is alive: 40 MB
(above glibc's largest mmap threshold, 32 MB, and below the 64 MB of a thread's own heap) and
64 MB (which only the main heap holds: `single_arena`). Page faults per step are reported by
scripts/bench_offload.py instead, since a kernel that reclaims idle pages (DAMON, swap) can fault
retained pages too.
"""

import functools
import json
import subprocess
import sys

import pytest

from jaxtier.kernels.cpu import heap as cpu_allocator

PROGRAM = """
import ctypes, json, sys
from jaxtier.kernels.cpu import heap as cpu_allocator
mode, mb = sys.argv[1], int(sys.argv[2])
applied = (cpu_allocator.retain_freed_memory(single_arena=mode == "single_arena")
           if mode != "default" else None)
import jax, jax.numpy as jnp

class Mallinfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
              "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
step = jax.jit(lambda x: x * 2 + 1)
x = jnp.ones(mb * 2**18, jnp.float32)
for _ in range(3):
  y = step(x).block_until_ready()
info = libc.mallinfo2()
print(json.dumps({"applied": applied, "mmapped": info.hblkhd, "heap": info.arena}))
"""


@functools.cache  # the default process serves several cases
def allocator_bytes(mode: str, mb: int) -> dict:
  proc = subprocess.run([sys.executable, "-c", PROGRAM, mode, str(mb)], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu_allocator._glibc() is None, reason="the setting exists only in glibc")
@pytest.mark.parametrize("mode,mb", [("per_thread", 40), ("single_arena", 40),
                                     ("single_arena", 64)])
def test_retained_memory_serves_large_buffers_from_the_heap(mode, mb):
  default, retained = allocator_bytes("default", mb), allocator_bytes(mode, mb)
  buffer = mb * 2**20
  assert default["mmapped"] >= buffer  # the live result (and the input) are mmapped blocks
  assert retained["applied"] is True
  assert retained["mmapped"] < buffer and retained["heap"] >= 2 * buffer
