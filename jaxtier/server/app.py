"""The OpenAI-compatible HTTP app over an `AsyncEngine`.

Handlers validate a request, turn it into engine requests (one per prompt and choice) and turn the
engine's updates back into responses (`serving`). Every error is OpenAI-shaped JSON,
`{"error": {"message", "type", "param", "code"}}`: 400 for bad input, 404 for an unknown model or
route, 429 (with Retry-After) when the request queue is full, 503 while shutting down, 500 only
when a step fails inside the engine (the engine keeps serving). A structured-output constraint is
checked against the engine's limits in a worker thread before it is queued (400 naming the limit
and the field); one whose grammar then fails to compile or run is a 400 too (an `error` event in
a stream). `/health` answers 503 until the
engine's warm-up has compiled every program, then 200; after a failed warm-up it stays 503 with the
reason (`{"status": "warm-up failed", "error": ...}`) while the server still answers requests,
compiling programs when first needed.
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

from jaxtier.server import limits
from jaxtier.server import serving, tool_calls as tools
from jaxtier.sampling.structured import StructuredOutputsError
from jaxtier.server.async_engine import AsyncEngine, EngineError, QueueFull, RequestRejected
from jaxtier.server.prometheus import ServerMetrics
from jaxtier.server.protocol import (ChatCompletionRequest, CompletionRequest, body_problem,
                                     error_messages)

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that went away before the response
RETRY_AFTER_S = 1  # the Retry-After of a 429 when the request queue is full


class OpenAIError(Exception):
  """An error answered as OpenAI's JSON error object with an HTTP status."""

  def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.body = status, serving.error_body(message, type_, param, code)
    self.headers = headers


def _checked(fn: Callable[..., T], *args, param: str | None = None) -> T:
  """fn(*args), with bad input (ValueError, TypeError, a chat template's error) turned into a 400
  naming `param` (or the sampling parameter a `SamplingParamError` names)."""
  try:
    return fn(*args)
  except (ValueError, TypeError, jinja2.TemplateError) as e:
    raise OpenAIError(400, str(e), param=getattr(e, "field", None) or param) from None


_BODY_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def _validation_error(exc: RequestValidationError, request: fastapi.Request) -> OpenAIError:
  """One readable 400: what is wrong with the body as a whole (not JSON, empty, not an object),
  else pydantic's errors as 'field: problem; ...'."""
  problem = body_problem(exc.errors(), exc.body, request.headers.get("content-type"),
                         _BODY_MODELS.get(request.url.path))
  if problem is not None:
    return OpenAIError(400, problem)
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


def create_app(engine: AsyncEngine, served_model_name: str, *,
               max_request_bytes: int | None = None, api_key: str | None = None
               ) -> fastapi.FastAPI:
  """The FastAPI app serving `engine.llm` under the name `served_model_name`.

  Each app owns its Prometheus registry, so several apps can share one process (or one engine).
  `max_request_bytes` caps request bodies (413 beyond it; None: no cap) and `api_key`, when given,
  is required as `Authorization: Bearer <key>` on every route but /health (401 otherwise); both
  act before a body is read (`limits.RequestLimits`).
  """
  llm = engine.llm
  metrics = ServerMetrics(engine)
  created = int(time.time())
  app = fastapi.FastAPI(title="jaxtier", description="OpenAI-compatible server")
  limits.install(app, max_request_bytes, api_key)

  @app.exception_handler(OpenAIError)
  async def _openai_error(request: fastapi.Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

  @app.exception_handler(RequestValidationError)
  async def _invalid(request: fastapi.Request, exc: RequestValidationError) -> JSONResponse:
    error = _validation_error(exc, request)
    return JSONResponse(error.body, status_code=error.status)

  @app.exception_handler(HTTPException)
  async def _http_error(request: fastapi.Request, exc: HTTPException) -> JSONResponse:
    detail = str(exc.detail)
    param = None
    if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
      detail = (f"the request body is not valid JSON: it is not valid UTF-8 "
                f"({exc.__cause__.reason} at byte {exc.__cause__.start})")
    elif isinstance(exc.__cause__, RecursionError):  # nested past what Python's JSON reads
      depth = engine.engine.grammars.limits.grammar_max_depth
      param = "structured_outputs.json"
      detail = ("the request body nests its JSON too deeply to be read; a JSON schema in "
                f"structured_outputs.json or response_format may nest at most "
                f"grammar_max_depth={depth} levels")
    body = serving.error_body(detail, "invalid_request_error", param, code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code)

  def check_model(model: str | None) -> None:
    if model is not None and model != served_model_name:
      raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                        f"`{served_model_name}`", param="model", code="model_not_found")

  async def serve(body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[list[int]],
                  request: fastapi.Request, chat: bool, max_tokens: int | None,
                  tool_calls: Callable[[str], tuple | None] | None = None,
                  named_tool: str | None = None):
    arrival = time.monotonic()
    echo = not chat and body.echo
    scored = echo and max_tokens == 0  # score the prompt: one token is generated and dropped
    if max_tokens is not None:
      longest = max(len(ids) for ids in prompt_ids)
      if longest + max_tokens > llm.max_model_len:
        raise OpenAIError(400, f"This model's maximum context length is {llm.max_model_len} "
                          f"tokens. However, you requested {longest + max_tokens} tokens "
                          f"({longest} in the prompt, {max_tokens} in the completion). Please "
                          "reduce the length of the prompt or of the completion.",
                          param="max_tokens")
    params = _checked(body.sampling_params, llm.max_model_len if max_tokens is None
                      else 1 if scored else max_tokens)
    for p in params:  # token ids in logit_bias / allowed_token_ids, before the engine sees them
      _checked(p.check_vocab, llm.config.vocab_size)
    constraint = params[0].structured_outputs  # one object for all choices
    if constraint is not None:  # the engine's limits, checked off the event loop
      try:
        await asyncio.to_thread(engine.engine.grammars.check, constraint)
      except StructuredOutputsError as e:
        field, message = body.located(e.field, str(e))
        raise OpenAIError(400, message, param=field) from None
    echoes = None
    if echo:
      texts = [p if isinstance(p, str) else llm.tokenizer.decode(ids)
               for p, ids in zip(body.prompts(), prompt_ids)]
      echoes = [serving.Echo(text, tuple(ids)) for text, ids in zip(texts, prompt_ids)
                for _ in params]
    requests = [llm.make_request(ids, p) for ids in prompt_ids for p in params]
    try:
      submitted = engine.submit(requests)
    except QueueFull as e:
      raise OpenAIError(429, str(e), "rate_limit_exceeded", code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineError as e:
      raise OpenAIError(503, str(e), "server_error", code="shutting_down") from None
    streams = [metrics.track(stream, len(r.prompt_token_ids), arrival)
               for r, stream in zip(requests, submitted)]
    choices = serving.Choices(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
        model=served_model_name, chat=chat, streams=streams,
        stops=[p.stop for _ in prompt_ids for p in params],
        prompt_tokens=sum(len(ids) for ids in prompt_ids), logprobs=body.logprob_counts()[0],
        echo=echoes, generated=not scored, per_prompt=len(params), tool_calls=tool_calls,
        named_tool=named_tool)
    if body.stream:
      return StreamingResponse(serving.events(choices, llm.tokenizer, body.include_usage),
                               media_type="text/event-stream")
    try:
      completions = await _unless_disconnected(request, serving.collect(streams))
    except RequestRejected as e:
      raise OpenAIError(400, str(e)) from None
    except EngineError as e:
      raise OpenAIError(500, str(e), "server_error") from None
    if completions is None:
      return fastapi.Response(status_code=CLIENT_CLOSED)
    failed = next((c.error for c in completions if c.error is not None), None)
    if failed is not None:  # a grammar failed to compile or to run: the constraint is at fault
      field, message = serving.error_field(failed)
      if field is not None:
        field, message = body.located(field, message)
      raise OpenAIError(400, message, param=field)
    return serving.response_body(choices, completions, llm.tokenizer)

  @app.get("/health")
  async def health() -> JSONResponse:
    if not engine.ready and engine.warmup_error is not None:
      return JSONResponse({"status": "warm-up failed", "error": engine.warmup_error},
                          status_code=503)
    if not engine.ready:
      return JSONResponse({"status": "warming up"}, status_code=503)
    if not engine.accepting:
      return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok"})

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
    prompt_ids = [_checked(llm.prompt_token_ids, p, i, param="prompt")
                  for i, p in enumerate(body.prompts())]
    return await serve(body, prompt_ids, request, chat=False, max_tokens=body.max_tokens)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
    check_model(body.model)
    choice, tool_calls = body.effective_tool_choice(), None
    conversation = tools.history(body.conversation(), llm.tokenizer.chat_template)
    if choice == "none":
      prompt_ids = [_checked(llm.chat_token_ids, conversation, param="messages")]
    else:
      specs = body.tool_dicts()
      messages, template_tools = tools.with_tools(conversation, specs,
                                                  llm.tokenizer.chat_template)
      prompt_ids = [_checked(llm.chat_token_ids, messages, 0, template_tools, param="messages")]
      tool_calls = lambda text: tools.parse(text, specs, choice)
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    return await serve(body, prompt_ids, request, chat=True, max_tokens=body.token_limit(),
                       tool_calls=tool_calls, named_tool=named)

  return app
