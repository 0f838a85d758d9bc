"""Diagnostics beside the inference path: they read what a run or a program produced.

- `simulator`: a workload replayed through the real scheduler with a cost model (no JAX).
- `hlo`: the memory-kind transfers of an exported program, for placement checks (JAX).
- `export`: every program an engine runs, exported for a GPU or TPU without weights, and what
  each asks of it (custom calls, host compute, bytes moved) (JAX).

The submodules load on first access, so `import jaxtier.tools.simulator` imports no JAX; the
doctor (symptom -> remedy rows) sits beside the engine's statistics, in `jaxtier.engine.doctor`.
"""

from importlib import import_module as _import_module

__all__ = ["export", "hlo", "simulator"]


def __getattr__(name: str):
  if name in __all__ or name == "doctor":  # doctor: its old path, `jaxtier.engine.doctor` now
    return _import_module(f"jaxtier.tools.{name}")
  raise AttributeError(f"module 'jaxtier.tools' has no attribute {name!r}")


def __dir__():
  """The submodules, loaded or not (no helpers of this module)."""
  return sorted(__all__)
