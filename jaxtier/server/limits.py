"""What is checked before a request reaches a route: its API key and the size of its body.

`RequestLimits` is a pure ASGI middleware, so it acts before anything reads or parses the body:
- With an API key, every route except `/health` needs `Authorization: Bearer <key>` (vLLM's
  `--api-key`); a missing, malformed or wrong key is a 401. Keys are compared in constant time.
- With a body cap, a request whose Content-Length is over it is answered 413 at once, its body
  unread. A body without Content-Length (chunked) is read here before the app starts and answered
  413 as soon as it passes the cap; the rest of it is never read into memory. A body that fits is
  handed to the app whole.
Both answers are OpenAI-shaped JSON errors.
"""

import hmac
import json
from typing import Any, Awaitable, Callable

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
OPEN_PATHS = frozenset({"/health"})  # served without an API key (load balancers' probes)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def api_key_problem(key: str | None) -> str | None:
  """Why `key` cannot be an API key (it must travel in an HTTP header), or None if it can."""
  if key is None:
    return None
  if not key:
    return "the API key is empty"
  if not all(33 <= ord(c) <= 126 for c in key):
    return "the API key must be printable ASCII without spaces"
  return None


async def _reply(send: Send, status: int, message: str, code: str,
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
  """Sends an OpenAI-shaped JSON error."""
  body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                               "code": code}}).encode()
  await send({"type": "http.response.start", "status": status,
              "headers": [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode()), *headers]})
  await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
  return next((value for key, value in scope["headers"] if key.lower() == name), None)


def _check(max_request_bytes: int | None, api_key: str | None) -> None:
  if max_request_bytes is not None and (isinstance(max_request_bytes, bool)
                                        or not isinstance(max_request_bytes, int)
                                        or max_request_bytes < 1):
    raise ValueError(f"max_request_bytes={max_request_bytes!r}: expected None or an int >= 1")
  problem = api_key_problem(api_key)
  if problem:
    raise ValueError(problem)


def install(app, max_request_bytes: int | None, api_key: str | None) -> None:
  """Adds `RequestLimits` to a Starlette/FastAPI app, checking its arguments now (Starlette builds
  middleware on the first request)."""
  _check(max_request_bytes, api_key)
  app.add_middleware(RequestLimits, max_request_bytes=max_request_bytes, api_key=api_key)


class RequestLimits:
  """ASGI middleware: the API key check, then the request body cap (None turns either off)."""

  def __init__(self, app: ASGIApp, max_request_bytes: int | None = None,
               api_key: str | None = None):
    _check(max_request_bytes, api_key)
    self.app, self.max_request_bytes = app, max_request_bytes
    self._key = None if api_key is None else api_key.encode("ascii")

  def _auth_problem(self, scope: Scope) -> str | None:
    """Why a request is not let in (no bearer token, or not the key), or None."""
    scheme, _, token = (_header(scope, b"authorization") or b"").strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
      return "Missing bearer token: send the API key in the header 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(token, self._key):
      return "Incorrect API key provided"
    return None

  async def _refuse_too_large(self, send: Send) -> None:
    await _reply(send, 413, f"the request body is larger than the server's limit of "
                 f"{self.max_request_bytes} bytes (--max_request_bytes)", "request_too_large")

  async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
      await self.app(scope, receive, send)
      return
    if self._key is not None and scope["path"] not in OPEN_PATHS:
      problem = self._auth_problem(scope)
      if problem:
        await _reply(send, 401, problem, "invalid_api_key",
                     headers=((b"www-authenticate", b"Bearer"),))
        return
    cap = self.max_request_bytes
    if cap is None:
      await self.app(scope, receive, send)
      return
    length = _header(scope, b"content-length")
    if length is not None and length.isdigit():  # the HTTP server holds the body to its length
      if int(length) > cap:
        await self._refuse_too_large(send)
        return
      await self.app(scope, receive, send)
      return
    # No length (chunked): read the body here, keeping at most the cap, so that the app is not
    # started on a body it would have to drop (and hold until garbage collection).
    chunks, size = [], 0
    while True:
      message = await receive()
      if message["type"] != "http.request":  # the client went away
        return
      size += len(message.get("body", b""))
      if size > cap:
        del chunks
        await self._refuse_too_large(send)
        return
      chunks.append(message.get("body", b""))
      if not message.get("more_body", False):
        break
    whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
    del chunks

    async def replay() -> Message:
      return whole.pop() if whole else await receive()

    await self.app(scope, replay, send)
