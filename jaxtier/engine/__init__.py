"""The engine: continuous batching over the paged KV cache, the pure scheduler, swaps and the
offloaded tail. `Engine.step()` runs one scheduler plan on the device; `jaxtier.LLM` drives it.

Names load lazily; the engine's arguments (`EngineArgs`) live in `jaxtier.engine.args`, which
imports no JAX, so that scripts check them when flags are parsed.
"""

from importlib import import_module as _import_module

_EXPORTS = {"Engine": "jaxtier.engine.engine", "EngineArgs": "jaxtier.engine.args",
            "RequestUpdate": "jaxtier.engine.outputs", "EngineModel": "jaxtier.engine.runner"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(_import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'jaxtier.engine' has no attribute {name!r}")


def __dir__():
  """The public names and the submodules imported so far (no helpers of this module)."""
  return sorted({n for n in globals() if not n.startswith("_")} | set(_EXPORTS))
