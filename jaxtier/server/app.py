"""The OpenAI-compatible HTTP app over an `AsyncEngine`.

Handlers validate a request, turn it into engine requests (one per prompt and choice) and turn the
engine's updates back into responses (`serving`). Every error is OpenAI-shaped JSON,
`{"error": {"message", "type", "param", "code"}}`: 400 for bad input, 404 for an unknown model or
route, 500 only when a batch fails inside the engine (the engine keeps serving).
"""

import asyncio
import time
import uuid
from typing import Any, Awaitable, Callable, TypeVar

import fastapi
import jinja2
import prometheus_client
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from jaxtier.server import serving
from jaxtier.server.async_engine import AsyncEngine, EngineError
from jaxtier.server.metrics import ServerMetrics
from jaxtier.server.protocol import ChatCompletionRequest, CompletionRequest, error_messages

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that went away before the response


class OpenAIError(Exception):
  """An error answered as OpenAI's JSON error object with an HTTP status."""

  def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.body = status, serving.error_body(message, type_, param, code)


def _checked(fn: Callable[..., T], *args) -> T:
  """fn(*args), with bad input (ValueError, TypeError, a chat template's error) turned into 400."""
  try:
    return fn(*args)
  except (ValueError, TypeError, jinja2.TemplateError) as e:
    raise OpenAIError(400, str(e)) from None


def _validation_error(exc: RequestValidationError) -> OpenAIError:
  """One readable 400 from pydantic's errors: 'field: problem; ...'."""
  found = error_messages(exc.errors(), skip=("body",))
  return OpenAIError(400, "; ".join(m for m, _ in found), param=found[0][1] if found else None)


async def _disconnected(request: fastapi.Request) -> None:
  """Returns once the client has disconnected (the body has already been read)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


async def _unless_disconnected(request: fastapi.Request, work: Awaitable[T]) -> T | None:
  """The result of `work`, or None after cancelling it if the client disconnects first."""
  task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
  try:
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    watch.cancel()
    if not task.done():
      task.cancel()
      await asyncio.gather(task, return_exceptions=True)
  return None if task.cancelled() else task.result()


def create_app(engine: AsyncEngine, served_model_name: str) -> fastapi.FastAPI:
  """The FastAPI app serving `engine.llm` under the name `served_model_name`.

  Each app owns its Prometheus registry, so several apps can share one process (or one engine).
  """
  llm = engine.llm
  metrics = ServerMetrics(engine)
  created = int(time.time())
  app = fastapi.FastAPI(title="jaxtier", description="OpenAI-compatible server")

  @app.exception_handler(OpenAIError)
  async def _openai_error(request: fastapi.Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)

  @app.exception_handler(RequestValidationError)
  async def _invalid(request: fastapi.Request, exc: RequestValidationError) -> JSONResponse:
    error = _validation_error(exc)
    return JSONResponse(error.body, status_code=error.status)

  @app.exception_handler(HTTPException)
  async def _http_error(request: fastapi.Request, exc: HTTPException) -> JSONResponse:
    body = serving.error_body(str(exc.detail), "invalid_request_error", code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code)

  def check_model(model: str | None) -> None:
    if model is not None and model != served_model_name:
      raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                        f"`{served_model_name}`", param="model", code="model_not_found")

  async def serve(body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[list[int]],
                  request: fastapi.Request, chat: bool, max_tokens: int | None):
    arrival = time.monotonic()
    if max_tokens is not None:
      longest = max(len(ids) for ids in prompt_ids)
      if longest + max_tokens > llm.max_model_len:
        raise OpenAIError(400, f"This model's maximum context length is {llm.max_model_len} "
                          f"tokens. However, you requested {longest + max_tokens} tokens "
                          f"({longest} in the prompt, {max_tokens} in the completion). Please "
                          "reduce the length of the prompt or of the completion.",
                          param="max_tokens")
    params = _checked(body.sampling_params,
                      llm.max_model_len if max_tokens is None else max_tokens)
    streams = [metrics.track(engine.generate(llm.make_request(ids, p)), len(ids), arrival)
               for ids in prompt_ids for p in params]
    choices = serving.Choices(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
        model=served_model_name, chat=chat, streams=streams,
        stops=[p.stop for _ in prompt_ids for p in params],
        prompt_tokens=sum(len(ids) for ids in prompt_ids))
    if body.stream:
      return StreamingResponse(serving.events(choices, llm.tokenizer, body.include_usage),
                               media_type="text/event-stream")
    try:
      completions = await _unless_disconnected(request, serving.collect(streams))
    except EngineError as e:
      raise OpenAIError(500, str(e), "server_error") from None
    if completions is None:
      return fastapi.Response(status_code=CLIENT_CLOSED)
    return serving.response_body(choices, completions)

  @app.get("/health")
  async def health() -> dict[str, str]:
    return {"status": "ok"}

  @app.get("/v1/models")
  async def models() -> dict[str, Any]:
    return {"object": "list", "data": [{"id": served_model_name, "object": "model",
                                        "created": created, "owned_by": "jaxtier",
                                        "max_model_len": llm.max_model_len}]}

  @app.get("/metrics")
  async def prometheus() -> fastapi.Response:
    return fastapi.Response(metrics.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: fastapi.Request):
    check_model(body.model)
    prompt_ids = [_checked(llm.prompt_token_ids, p, i) for i, p in enumerate(body.prompts())]
    return await serve(body, prompt_ids, request, chat=False, max_tokens=body.max_tokens)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
    check_model(body.model)
    prompt_ids = [_checked(llm.chat_token_ids, body.conversation())]
    return await serve(body, prompt_ids, request, chat=True, max_tokens=body.token_limit())

  return app
