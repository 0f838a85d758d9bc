"""The engine: continuous batching over the paged KV cache, the pure scheduler, swaps and the
offloaded tail. `Engine.step()` runs one scheduler plan on the device; `jaxtier.LLM` drives it.

Names load lazily; the engine's arguments (`EngineArgs`) live in `jaxtier.engine.args`, which
imports no JAX, so that scripts check them when flags are parsed.
"""

from jaxtier.common.lazy import lazy_names as _lazy_names

_EXPORTS = {"Engine": "jaxtier.engine.engine", "EngineArgs": "jaxtier.engine.args",
            "RequestUpdate": "jaxtier.engine.outputs", "EngineModel": "jaxtier.engine.runner"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_names(__name__, _EXPORTS, globals())
