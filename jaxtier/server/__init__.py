"""The OpenAI-compatible HTTP server: `create_app(AsyncEngine(jaxtier.LLM(...)), name)`.

Modules: `protocol` (request bodies), `async_engine` (the engine thread and request streams),
`stream_text` (streamed text deltas), `serving` (response shapes), `openai_logprobs`,
`tool_calls`, `limits`, `prometheus` (`/metrics`), `records` (batch records), `app` (routes).

The names below load lazily, so `jaxtier.server.records` (the batch job's record checks, pydantic
only) imports without the `[server]` extra (fastapi, uvicorn, prometheus-client).
"""

from jaxtier.common.lazy import lazy_names as _lazy_names

_EXPORTS = {"OpenAIError": "jaxtier.server.app", "create_app": "jaxtier.server.app",
            "AsyncEngine": "jaxtier.server.async_engine",
            "EngineError": "jaxtier.server.async_engine",
            "EngineStats": "jaxtier.server.async_engine",
            "QueueFull": "jaxtier.server.async_engine"}

__all__ = ["AsyncEngine", "EngineError", "EngineStats", "OpenAIError", "QueueFull", "create_app"]

__getattr__, __dir__ = _lazy_names(__name__, _EXPORTS, globals())
