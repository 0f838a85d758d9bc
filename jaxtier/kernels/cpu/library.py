"""The CPU kernels, built on first use into one library and called through the XLA FFI (the
sources sit beside this module).

- `paged_attention_cpu.cc`: decode and prefill attention over the paged pool.
  XLA:CPU has no way to read a paged pool in place: the fast XLA path gathers every chunk of
  blocks into a copy before its dots, and on CPU those gathers, not the arithmetic, are most of a
  long-context decode step. The kernels read keys and values straight from the pool; the prefill
  one also keeps tiles of queries' scores in registers.
- `matmul_cpu.cc`: x @ w with w packed in column panels (`jaxtier.kernels.cpu.matmul`; 64 columns
  with AVX-512, 16 with AVX2: `panel_width()`). XLA:CPU's matmuls with 2-32 rows (batched decode)
  run at a fraction of the memory bandwidth; the kernel streams each panel once.
- `argmax_cpu.cc`: greedy decoding's argmax over each row of logits, in one pass (XLA:CPU's
  takes two, well short of the memory's rate).
- `cpu_crew.h`: the helper threads the kernels share (why not XLA's intra-op pool: there);
  `cpu_vec.h`: their vector types.

Building: the sources are compiled once per (sources, compiler, jaxlib, CPU) with the system C++
compiler (`$CXX`, else `c++`/`g++`/`clang++`) against the FFI headers jaxlib ships
(`jax.ffi.include_dir()`) into `<cache dir>/kernels/` (`$JAXTIER_CACHE_DIR`, else
`~/.cache/jaxtier`); `-march=native` because the library only ever runs where it was built. With
no compiler, or a build that fails, `available()` is False, `unavailable_reason()` says why, and
callers keep the XLA path.
"""

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib
from absl import logging

from jaxtier.common import cache_dirs

_HERE = Path(__file__).parent
SOURCES = (_HERE / "paged_attention_cpu.cc", _HERE / "matmul_cpu.cc", _HERE / "argmax_cpu.cc")
HEADERS = (_HERE / "cpu_crew.h", _HERE / "cpu_vec.h")  # included by the sources: in the cache key
ATTENTION_TARGET = "jaxtier_paged_decode_attention"
PREFILL_ATTENTION_TARGET = "jaxtier_paged_prefill_attention"
WRITE_ATTENTION_TARGET = "jaxtier_paged_decode_write_attention"
MATMUL_TARGET = "jaxtier_packed_matmul"
NORM_MATMUL_TARGET = "jaxtier_norm_packed_matmul"
GLU_MATMUL_TARGET = "jaxtier_glu_packed_matmul"
NORM_ROPE_MATMUL_TARGET = "jaxtier_norm_rope_packed_matmul"
ARGMAX_TARGET = "jaxtier_argmax"
_SYMBOLS = {ATTENTION_TARGET: "JaxtierPagedDecodeAttention",
            PREFILL_ATTENTION_TARGET: "JaxtierPagedPrefillAttention",
            WRITE_ATTENTION_TARGET: "JaxtierPagedDecodeWriteAttention",
            MATMUL_TARGET: "JaxtierPackedMatmul",
            NORM_MATMUL_TARGET: "JaxtierNormPackedMatmul",
            NORM_ROPE_MATMUL_TARGET: "JaxtierNormRopePackedMatmul",
            GLU_MATMUL_TARGET: "JaxtierGluPackedMatmul", ARGMAX_TARGET: "JaxtierArgmax"}
TARGETS = tuple(_SYMBOLS)  # every custom-call target the kernels register
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def _compiler() -> str | None:
  """The first C++ compiler found: $CXX, c++, g++, clang++."""
  found = (shutil.which(name) for name in (os.environ.get("CXX"), "c++", "g++", "clang++") if name)
  return next((path for path in found if path), None)


def _cpu_signature() -> str:
  """The CPU's model and feature flags: a library built with -march=native runs only there."""
  try:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return platform.processor()
  keep = [l for l in lines if l.startswith(("model name", "flags"))][:2]
  return "\n".join(keep) or platform.processor()


def _library_path(compiler: str) -> Path:
  key = hashlib.sha256()
  sources = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
  for part in (*sources, compiler.encode(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(),
               platform.machine().encode(), _cpu_signature().encode()):
    key.update(part)
    key.update(b"\0")
  return Path(cache_dirs.cache_dir()) / "kernels" / f"jaxtier_cpu-{key.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
  """Compiles the sources into `path` (atomically: concurrent builds each rename a whole file)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
  os.close(fd)
  try:
    cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
  """Builds (if needed), loads and registers the kernels: (the library, None), or (None, why they
  are unavailable)."""
  compiler = _compiler()
  if compiler is None:
    return None, "no C++ compiler found (set CXX, or install g++ or clang++)"
  try:
    path = _library_path(compiler)
    if not path.exists():
      _build(compiler, path)
    library = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in _SYMBOLS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform="cpu")
  except (OSError, RuntimeError, AttributeError) as e:
    return None, f"building or loading the CPU kernels failed: {e}"
  return library, None


def available() -> bool:
  """Whether the kernels are built and registered (builds them on the first call)."""
  reason = _load()[1]
  if reason is not None:
    _warn_once(reason)
  return reason is None


def unavailable_reason() -> str | None:
  """Why `available()` is False, or None."""
  return _load()[1]


@functools.cache
def panel_width() -> int | None:
  """Columns per panel of the packed matmul kernel as built for this CPU: the width of its
  register tile (64 with AVX-512, 16 with AVX2); None when the kernels are unavailable."""
  library = _load()[0]
  return None if library is None else int(library.JaxtierPanelWidth())


@functools.cache
def lanes() -> int | None:
  """Columns per panel of the int16-activation block formats as built for this CPU: the lanes of
  a vector register (16 with AVX-512, 8 with AVX2); None when the kernels are unavailable."""
  library = _load()[0]
  return None if library is None else int(library.JaxtierLanes())


@functools.cache
def integer_dots() -> bool:
  """Whether the int16-activation block formats multiply in vector instructions as built for
  this CPU (AVX512-VNNI, AVX512BW or AVX2; elsewhere their pair products are a scalar loop);
  False when the kernels are unavailable."""
  library = _load()[0]
  return library is not None and bool(library.JaxtierIntegerDots())


_EVERY_PLATFORM = [0]  # traced_for_every_platform contexts open, in any thread
_EVERY_PLATFORM_LOCK = threading.Lock()


def cpu_or_reference(*args, cpu, default):
  """`cpu(*args)` where the program is lowered for the CPU, else `default(*args)`.

  In a process whose backend is the CPU this traces the kernel branch alone: the programs it
  compiles run here, and `lax.platform_dependent` would trace the reference beside it for
  nothing (lowering keeps one branch), most of a program's tracing time with 30 unrolled layers.
  Elsewhere, and inside `traced_for_every_platform`, both are traced and lowering picks."""
  if jax.default_backend() == "cpu" and not _EVERY_PLATFORM[0]:
    return cpu(*args)
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


@contextlib.contextmanager
def traced_for_every_platform():
  """Within, programs trace every platform's branch of `cpu_or_reference`, in every thread, so
  they can be lowered for another platform than this CPU (`jax.export` for "cuda" of a program
  built here). Entering clears JAX's trace caches (`jax.clear_caches`): a trace made for this
  CPU alone is not reused. Traces made within stay correct for the CPU (lowering picks its
  branch), only slower to make."""
  with _EVERY_PLATFORM_LOCK:
    _EVERY_PLATFORM[0] += 1
  try:
    jax.clear_caches()
    yield
  finally:
    with _EVERY_PLATFORM_LOCK:
      _EVERY_PLATFORM[0] -= 1


@functools.cache
def _warn_once(reason: str) -> None:
  logging.warning("CPU kernels unavailable, using the XLA paths: %s", reason)
