"""The OpenAI-compatible HTTP server: `create_app(AsyncEngine(jaxtier.LLM(...)), name)`.

Modules: `protocol` (request bodies), `async_engine` (the engine thread and request streams), `detokenize`
(streamed text deltas), `serving` (response shapes), `metrics` (Prometheus), `app` (routes).
"""

from jaxtier.server.app import OpenAIError, create_app
from jaxtier.server.async_engine import AsyncEngine, EngineError, EngineStats, QueueFull

__all__ = ["AsyncEngine", "EngineError", "EngineStats", "OpenAIError", "QueueFull", "create_app"]
