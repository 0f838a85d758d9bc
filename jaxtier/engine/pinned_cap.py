"""XLA's cap on pinned host memory on a GPU, in the plan.

XLA's GPU client allocates every `pinned_host` buffer (the offloaded tail, the host KV tier) from
one pool, capped by the environment variable `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (64 GiB when it
is unset), which it reads once, when the backend starts. The pool grows on demand up to the cap,
so a higher cap costs nothing until it is used; a plan above it fails at allocation, in the middle
of a run.

- `cap_for(args, platform, host_memory_bytes, started)` is the cap a plan on that platform is
  bounded by (`jaxtier.engine.sizing.size` never plans past it): none off a GPU; the variable's
  value where it is set; else, where the backend has not started yet (or the plan is for another
  machine), what these arguments may pin on that host (`may_pin`) if that is more than XLA's
  default, which the entry point then sets; else XLA's default.
- `raise_before_start(args)` is that entry-point step (`jaxtier.LLM`, the scripts' flags): before
  JAX starts, where the variable is unset and the arguments may pin more than XLA's default, it
  sets the variable to what they may pin and logs it.

Standard library only; whether the backend started is asked of JAX only where it is imported.
"""

import dataclasses
import math
import os
import sys

from absl import logging

from jaxtier.engine.args import GB, HOST_PIN_FRACTION, EngineArgs

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_GIB = 64
GIB = 2**30
# What `raise_before_start` set `ENV` to in this process (it changes the process's own
# environment, once, before JAX starts), so that a plan says who set it: (GiB, setting).
_raised: tuple[int, str] | None = None


@dataclasses.dataclass(frozen=True)
class PinnedCap:
  """The most pinned host memory a plan may take, and the setting behind it (a sentence that
  names `ENV` and its value, and who set it)."""
  bytes: int
  setting: str


def host_memory_bytes() -> int | None:
  """This host's RAM in bytes, or None where the OS does not say."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def host_memory(args: EngineArgs) -> int | None:
  """The host's memory a plan of `args` takes: `host_memory_gb`, else this host's RAM."""
  return int(args.host_memory_gb * GB) if args.host_memory_gb is not None else host_memory_bytes()


def backend_started() -> bool:
  """Whether this process's JAX backend has started (it reads `ENV` then)."""
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return xla_bridge.backends_are_initialized()


def may_pin(args: EngineArgs, host_memory_bytes: int | None) -> int | None:
  """The most pinned memory `args` may plan on a host of `host_memory_bytes`: all of it with an
  explicit host pool (more is an error), else `HOST_PIN_FRACTION` of it (the default pools'
  bound); None where the host's memory is unknown."""
  if host_memory_bytes is None:
    return None
  explicit = args.num_host_blocks is not None or args.swap_space_gb is not None
  return int(host_memory_bytes * (1 if explicit else HOST_PIN_FRACTION))


def _user_gib() -> int | None:
  """`ENV`'s value in GiB, where it is set (ValueError for one XLA cannot read)."""
  value = os.environ.get(ENV)
  if value is None:
    return None
  try:
    gib = int(value)
  except ValueError:
    gib = 0
  if gib < 1:
    raise ValueError(f"{ENV}={value!r}: expected a whole number of GiB >= 1 (XLA reads it as "
                     "the cap of its pinned host memory)")
  return gib


def _wanted_gib(args: EngineArgs, host_memory_bytes: int | None) -> int | None:
  """What `args` may pin, in whole GiB, where that is more than XLA's default; else None."""
  wanted = may_pin(args, host_memory_bytes)
  if wanted is None or wanted <= XLA_DEFAULT_GIB * GIB:
    return None
  return math.ceil(wanted / GIB)


def _setting(gib: int, host_memory_bytes: int) -> str:
  return (f"{ENV}={gib} (set by jaxtier before JAX starts: what these arguments may pin on a "
          f"host of {host_memory_bytes / GB:.0f} GB)")


def cap_for(args: EngineArgs, platform: str, host_memory_bytes: int | None,
            started: bool) -> PinnedCap | None:
  """The pinned-memory cap of a plan of `args` on `platform` (see the module docstring);
  `started`: this process's backend has started, so `ENV` can no longer change."""
  if platform != "gpu":
    return None
  gib = _user_gib()
  if gib is not None and _raised is not None and gib == _raised[0]:
    return PinnedCap(gib * GIB, _raised[1])
  if gib is not None:
    return PinnedCap(gib * GIB, f"{ENV}={gib} (set in the environment)")
  wanted = _wanted_gib(args, host_memory_bytes)
  if wanted is not None and not started:
    return PinnedCap(wanted * GIB, _setting(wanted, host_memory_bytes))
  if wanted is not None:
    return PinnedCap(XLA_DEFAULT_GIB * GIB, f"{ENV} unset: XLA's default of {XLA_DEFAULT_GIB} "
                     "GiB; JAX had started before jaxtier could raise it (set it before JAX "
                     "starts to pin more)")
  return PinnedCap(XLA_DEFAULT_GIB * GIB, f"{ENV} unset: XLA's default of {XLA_DEFAULT_GIB} GiB")


def raise_before_start(args: EngineArgs, host_memory_bytes: int | None) -> int | None:
  """Sets `ENV` to what `args` may pin on this host, in GiB, where that is more than XLA's
  default, the variable is unset and JAX has not started (off a GPU the variable is read by
  nothing); returns the value set, or None. Logs what it set."""
  if ENV in os.environ or backend_started():
    return None
  wanted = _wanted_gib(args, host_memory_bytes)
  if wanted is None:
    return None
  global _raised  # pylint: disable=global-statement
  os.environ[ENV], _raised = str(wanted), (wanted, _setting(wanted, host_memory_bytes))
  logging.info("%s=%d: pinned host memory capped at what these arguments may pin (XLA's default "
               "is %d GiB)", ENV, wanted, XLA_DEFAULT_GIB)
  return wanted
