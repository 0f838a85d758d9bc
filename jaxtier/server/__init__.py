"""The OpenAI-compatible HTTP server: `create_app(AsyncEngine(jaxtier.LLM(...)), name)`.

Modules: `protocol` (request bodies), `async_engine` (the queue and batch thread), `detokenize`
(streamed text deltas), `serving` (response shapes), `metrics` (Prometheus), `app` (routes).
"""

from jaxtier.server.app import OpenAIError, create_app
from jaxtier.server.async_engine import AsyncEngine, EngineError, EngineStats

__all__ = ["AsyncEngine", "EngineError", "EngineStats", "OpenAIError", "create_app"]
