"""The OpenAI-compatible HTTP server: `create_app(AsyncEngine(jaxtier.LLM(...)), name)`.

Modules: `protocol` (request bodies), `async_engine` (the engine thread and request streams), `detokenize`
(streamed text deltas), `serving` (response shapes), `metrics` (Prometheus), `app` (routes).

The names below load lazily, so `jaxtier.server.records` (the batch job's record checks, pydantic
only) imports without the `[server]` extra (fastapi, uvicorn, prometheus-client).
"""

from importlib import import_module as _import_module

_EXPORTS = {"OpenAIError": "jaxtier.server.app", "create_app": "jaxtier.server.app",
            "AsyncEngine": "jaxtier.server.async_engine",
            "EngineError": "jaxtier.server.async_engine",
            "EngineStats": "jaxtier.server.async_engine", "QueueFull": "jaxtier.server.async_engine"}

__all__ = ["AsyncEngine", "EngineError", "EngineStats", "OpenAIError", "QueueFull", "create_app"]


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(_import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'jaxtier.server' has no attribute {name!r}")
