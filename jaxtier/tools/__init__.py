"""Diagnostics beside the inference path: they read what a run or a program produced.

- `doctor`: a run's stats and trace -> symptom and remedy rows, and the trace plot (no JAX).
- `simulator`: a workload replayed through the real scheduler with a cost model (no JAX).
- `hlo`: the memory-kind transfers of an exported program, for placement checks (JAX).
- `export`: every program an engine runs, exported for a GPU or TPU without weights, and what
  each asks of it (custom calls, host compute, bytes moved) (JAX).

The submodules load on first access, so `import jaxtier.tools.doctor` imports no JAX.
"""

from importlib import import_module as _import_module

__all__ = ["doctor", "export", "hlo", "simulator"]


def __getattr__(name: str):
  if name in __all__:
    return _import_module(f"jaxtier.tools.{name}")
  raise AttributeError(f"module 'jaxtier.tools' has no attribute {name!r}")


def __dir__():
  """The submodules, loaded or not (no helpers of this module)."""
  return sorted(__all__)
