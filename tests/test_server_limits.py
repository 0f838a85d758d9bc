"""The server's request limits (body cap, API key), its messages for malformed bodies, fields it
accepts and ignores, and early refusal of obviously too long prompts: each refused request is
followed by one that works."""

import asyncio
import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import jaxtier
from conftest import fixture_path
from server_support import uvicorn_on_localhost
from jaxtier.server import AsyncEngine, create_app
from jaxtier.server.limits import DEFAULT_MAX_REQUEST_BYTES
from jaxtier.text.tokenizer import Tokenizer

MODEL = "tiny"
KEY = "sk-test-0123456789"
CAP = 64 * 1024
SERVE = os.path.join(os.path.dirname(__file__), "..", "scripts", "serve.py")
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=4, layer_execution="scan")
SMALL = {"model": MODEL, "prompt": "A tiny model", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def engine(llm):
  engine = AsyncEngine(llm)
  yield engine
  engine.close()


@pytest.fixture(scope="module")
def capped(engine):
  """An app whose bodies are capped at CAP bytes."""
  return create_app(engine, MODEL, max_request_bytes=CAP)


@pytest.fixture(scope="module")
def client(capped):
  return TestClient(capped)


@pytest.fixture(scope="module")
def keyed(engine):
  """A TestClient of an app that requires the API key KEY."""
  return TestClient(create_app(engine, MODEL, api_key=KEY))


def assert_error(response, status: int, code: str | None = None) -> str:
  """The message of an OpenAI-shaped error response, after checking its status and shape."""
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert set(error) == {"message", "type", "param", "code"}
  assert error["type"] == "invalid_request_error" and isinstance(error["message"], str)
  if code is not None:
    assert error["code"] == code
  return error["message"]


def assert_works(client, headers: dict | None = None) -> None:
  response = client.post("/v1/completions", json=SMALL, headers=headers)
  assert response.status_code == 200, response.text
  assert response.json()["usage"]["completion_tokens"] == 2


# Body cap.

def test_content_length_over_the_cap_is_413_without_reading_the_body(client):
  pulled = []

  def body():
    pulled.append(1)
    yield b"{}"

  response = client.post("/v1/completions", content=body(),
                         headers={"content-type": "application/json",
                                  "content-length": str(20_000_000)})
  message = assert_error(response, 413, "request_too_large")
  assert f"limit of {CAP} bytes" in message and "--max_request_bytes" in message
  assert not pulled
  assert_works(client)


def test_a_body_at_the_cap_is_served(client):
  body = ('{"model": "tiny", "prompt": "A tiny model", "max_tokens": 2, "user": "'
          + "u" * CAP)
  body = body[:CAP - 2] + '"}'
  assert len(body) == CAP
  response = client.post("/v1/completions", content=body.encode(),
                         headers={"content-type": "application/json"})
  assert response.status_code == 200, response.text


def test_a_chunked_body_is_cut_off_once_past_the_cap(capped, client):
  """At the ASGI level: the body never ends, and no more of it is read than the cap."""
  chunk, pulled, sent = b"x" * 4096, [], []

  async def receive():
    pulled.append(len(chunk))
    return {"type": "http.request", "body": chunk, "more_body": True}

  async def send(message):
    sent.append(message)

  scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
           "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
           "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
           "server": ("127.0.0.1", 80),
           "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]}
  asyncio.run(capped(scope, receive, send))
  assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
  assert sent[0]["status"] == 413
  assert sum(pulled) == CAP + len(chunk)  # the chunk that passed the cap, nothing after it
  assert_works(client)


def test_a_chunked_body_past_the_cap_through_the_test_client(client):
  response = client.post("/v1/completions", content=iter([b"x" * (CAP + 1)]),
                         headers={"content-type": "application/json"})
  assert_error(response, 413, "request_too_large")
  assert_works(client)


# API key.

@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("GET", "/metrics"), ("GET", "/no/such/route")])
@pytest.mark.parametrize("authorization, message", [
    (None, "Missing bearer token"), ("Bearer wrong-key", "Incorrect API key provided"),
    (f"Basic {KEY}", "Missing bearer token"), ("Bearer ", "Missing bearer token"),
    (f"Bearer {KEY}x", "Incorrect API key provided")])
def test_a_missing_or_wrong_key_is_401(keyed, method, path, authorization, message):
  headers = {} if authorization is None else {"authorization": authorization}
  response = keyed.request(method, path, json=SMALL if method == "POST" else None,
                           headers=headers)
  assert message in assert_error(response, 401, "invalid_api_key")
  assert response.headers["www-authenticate"] == "Bearer"
  assert_works(keyed, {"authorization": f"Bearer {KEY}"})


def test_the_right_key_opens_every_route_and_health_needs_none(keyed):
  good = {"authorization": f"Bearer {KEY}"}
  assert_works(keyed, good)
  assert_works(keyed, {"authorization": f"bearer  {KEY} "})  # scheme case and spaces
  assert keyed.get("/v1/models", headers=good).status_code == 200
  assert keyed.get("/metrics", headers=good).status_code == 200
  assert keyed.get("/health").status_code == 200
  assert keyed.get("/no/such/route", headers=good).status_code == 404


@pytest.mark.parametrize("key", ["", "with space", "caf\u00e9"])
def test_unusable_keys_are_refused(engine, key):
  with pytest.raises(ValueError, match="API key"):
    create_app(engine, MODEL, api_key=key)


# What a malformed body is told.

@pytest.mark.parametrize("content, content_type, expected", [
    (b'{"prompt": "a",\n "max_tokens": 2,}', "application/json",
     "the request body is not valid JSON: Expecting property name enclosed in double quotes at "
     "line 2 column 18 (character 33)"),
    (b"", "application/json",
     "the request body is empty: expected a JSON object with at least the field prompt"),
    (b"[]", "application/json", "the request body must be a JSON object, not an array"),
    (b"3", "application/json", "the request body must be a JSON object, not a number"),
    (b"null", "application/json", "the request body must be a JSON object, not null"),
    (b'"prompt"', "application/json", "the request body must be a JSON object, not a string"),
    (b'{"prompt": "a"}', "text/plain", "the request body must be JSON sent with the header "
     "Content-Type: application/json (got Content-Type: text/plain)"),
    (b'{"prompt": "\xff"}', "application/json",
     "the request body is not valid JSON: it is not valid UTF-8 (invalid start byte at byte 12)"),
    (b'{"prompt": "\\ud800"}', "application/json",
     "prompt: contains a lone surrogate (U+D800) at index 0; text must be valid Unicode"),
    (b'{"prompt": ["ok", "x\\udfff"]}', "application/json",
     "prompt: item 1 contains a lone surrogate (U+DFFF) at index 1"),
    (b'{"prompt": "a", "stop": ["\\ud83d"]}', "application/json",
     "stop: item 0 contains a lone surrogate (U+D83D) at index 0"),
])
def test_malformed_bodies_say_what_is_wrong(client, content, content_type, expected):
  response = client.post("/v1/completions", content=content,
                         headers={"content-type": content_type})
  assert expected in assert_error(response, 400)
  if not expected.startswith(("prompt", "stop")):
    assert response.json()["error"]["param"] is None
  assert_works(client)


@pytest.mark.parametrize("content, expected", [
    (b"", "the request body is empty: expected a JSON object with at least the field messages"),
    (b'{"messages": [{"role": "user", "content": "\\udc00 hi"}]}',
     "messages.0.content: contains a lone surrogate (U+DC00) at index 0"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, '
     b'{"type": "text", "text": "a\\ud800"}]}]}',
     "messages.0.content: part 1 contains a lone surrogate (U+D800) at index 1"),
])
def test_malformed_chat_bodies_say_what_is_wrong(client, content, expected):
  response = client.post("/v1/chat/completions", content=content,
                         headers={"content-type": "application/json"})
  assert expected in assert_error(response, 400)
  assert_works(client)


# Fields accepted and ignored, and those that are not.

IGNORED_CHAT_FIELDS = {
    "metadata": {"team": "search", "run": "7"}, "store": True, "service_tier": "auto",
    "user": "u-1", "safety_identifier": "hash-1", "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "modalities": ["text"],
    "stream_options": {"include_usage": True, "include_obfuscation": False}}


def chat_text(client, **fields) -> str:
  body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
          "temperature": 0, "ignore_eos": True, **fields}
  response = client.post("/v1/chat/completions", json=body)
  assert response.status_code == 200, response.text
  if not fields.get("stream"):
    return response.json()["choices"][0]["message"]["content"]
  return "".join(line for line in response.iter_lines() if line)


def test_fields_without_effect_are_accepted_and_ignored(client, llm):
  reference = llm.chat([{"role": "user", "content": "hi"}],
                       jaxtier.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
  fields = {k: v for k, v in IGNORED_CHAT_FIELDS.items() if k != "stream_options"}
  assert chat_text(client, **fields) == reference[0].text
  streamed = chat_text(client, stream=True, stream_options=IGNORED_CHAT_FIELDS["stream_options"])
  assert '"usage"' in streamed and streamed.endswith("data: [DONE]")


@pytest.mark.parametrize("fields, expected", [
    ({"modalities": ["text", "audio"]}, "modalities ['text', 'audio'] are not supported"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio is not a supported field"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction is not a supported field"),
    ({"reasoning_effort": "low"}, "reasoning_effort is not a supported field"),
    ({"verbosity": "low"}, "verbosity is not a supported field"),
    ({"web_search_options": {}}, "web_search_options is not a supported field"),
    ({"service_tier": "fastest"}, "service_tier: Input should be"),
    ({"metadata": {"n": 1}}, "metadata.n: Input should be a valid string"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation: true is not supported"),
])
def test_fields_with_effect_are_400(client, fields, expected):
  body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
          **fields}
  assert expected in assert_error(client.post("/v1/chat/completions", json=body), 400)
  assert_works(client)


def test_completions_take_only_the_legacy_fields(client):
  assert "metadata is not a supported field" in assert_error(
      client.post("/v1/completions", json={**SMALL, "metadata": {"a": "b"}}), 400)
  assert client.post("/v1/completions", json={**SMALL, "user": "u-1"}).status_code == 200


# Obviously too long prompts.

@pytest.fixture
def encoded(monkeypatch):
  """The lengths of the texts `Tokenizer.encode` is called with from here on."""
  lengths = []
  original = Tokenizer.encode

  def encode(self, text, *args, **kwargs):
    lengths.append(len(text))
    return original(self, text, *args, **kwargs)

  monkeypatch.setattr(Tokenizer, "encode", encode)
  return lengths


def test_a_2mb_prompt_is_refused_without_tokenizing_it(engine, llm, encoded):
  client = TestClient(create_app(engine, MODEL, max_request_bytes=DEFAULT_MAX_REQUEST_BYTES))
  prompt = "All work and no play makes Jack a dull boy. " * 46_000
  assert len(prompt) > 2_000_000
  with pytest.raises(ValueError, match="prompt 0 has at least .* tokens; the context window "
                     "max_model_len is 64 and at least one token must be generated"):
    llm.prompt_token_ids(prompt)
  response = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
  assert "the context window max_model_len is 64" in assert_error(response, 400)
  response = client.post("/v1/chat/completions", json={
      "model": MODEL, "messages": [{"role": "user", "content": prompt}]})
  assert "the context window max_model_len is 64" in assert_error(response, 400)
  assert max(encoded, default=0) < 1000
  assert_works(client)


def test_a_prompt_under_the_bound_is_still_counted_exactly(llm, encoded):
  prompt = "\x01" * 200  # single-byte tokens: the bound (50) is under the window, the count not
  assert llm.tokenizer.min_token_count(prompt) < 64 <= len(llm.tokenizer.encode(prompt))
  with pytest.raises(ValueError, match="prompt 0 has 200 tokens; the context window"):
    llm.prompt_token_ids(prompt)
  assert 200 in encoded


# A real socket: uvicorn, the default cap, the API key, and memory that stays flat.

def rss_bytes() -> int:
  with open("/proc/self/status") as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  return kb * 1024


@contextlib.contextmanager
def peak_rss():
  """Yields a list that ends up holding [RSS before, highest RSS seen while inside]."""
  figures, done = [rss_bytes(), 0], threading.Event()

  def sample():
    while not done.is_set():
      figures[1] = max(figures[1], rss_bytes())
      time.sleep(0.002)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  try:
    yield figures
  finally:
    done.set()
    sampler.join()


def read_response(sock: socket.socket) -> tuple[int, bytes]:
  """(status, body) of one HTTP/1.1 response with a Content-Length."""
  data = b""
  while b"\r\n\r\n" not in data:
    chunk = sock.recv(65536)
    assert chunk, f"connection closed after {data!r}"
    data += chunk
  head, body = data.split(b"\r\n\r\n", 1)
  lines = head.decode().split("\r\n")
  length = next(int(l.split(":")[1]) for l in lines if l.lower().startswith("content-length:"))
  while len(body) < length:
    body += sock.recv(65536)
  return int(lines[0].split()[1]), body


def send_huge_body(port: int, total: int, chunked: bool) -> tuple[int, bytes, int]:
  """POSTs `total` bytes (Content-Length, or chunked), reading the response as soon as it comes;
  (status, body, bytes sent before the response arrived)."""
  framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
  piece = b"x" * 65536
  frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
  response, sent_before = None, 0
  with socket.create_connection(("127.0.0.1", port)) as sock:
    sock.settimeout(30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                 f"{KEY}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode())
    if not chunked:  # the answer comes from the headers alone
      response = read_response(sock)
    try:
      for sent in range(0, total, len(piece)):
        if response is None and select.select([sock], [], [], 0)[0]:
          response, sent_before = read_response(sock), sent
        sock.sendall(frame if total - sent >= len(piece) or chunked else piece[:total - sent])
      if chunked:
        sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
      pass  # the server may hang up on the rest of the body
    if response is None:
      response, sent_before = read_response(sock), total
  return response[0], response[1], sent_before


def test_uvicorn_refuses_a_20mb_body_with_flat_memory(engine, llm):
  app = create_app(engine, MODEL, max_request_bytes=DEFAULT_MAX_REQUEST_BYTES, api_key=KEY)
  total = 20_000_000
  with uvicorn_on_localhost(app) as port:
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    text = api.completions.create(model=MODEL, prompt="A tiny model", max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    with pytest.raises(openai.AuthenticationError):
      openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong",
                    max_retries=0).models.list()
    for chunked in (False, True):
      with peak_rss() as rss:
        status, body, sent_before = send_huge_body(port, total, chunked)
      assert status == 413 and b"request_too_large" in body
      if not chunked:
        assert sent_before == 0  # answered from the headers alone
      assert sent_before < total
      grown = rss[1] - rss[0]
      assert grown < (DEFAULT_MAX_REQUEST_BYTES if chunked else 0) + 4_000_000, grown
      again = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                         headers={"authorization": f"Bearer {KEY}"},
                         json={**SMALL, "max_tokens": 4, "ignore_eos": True})
      assert again.status_code == 200 and again.json()["choices"][0]["text"] == text


# Flags.

@pytest.mark.parametrize("args, env, message", [
    (["--max_request_bytes=0"], {}, "max_request_bytes"),
    (["--api_key=has space"], {}, "must be printable ASCII without spaces"),
    ([], {"JAXTIER_API_KEY": "caf\u00e9"}, "must be printable ASCII without spaces"),
])
def test_serve_rejects_bad_limit_flags_before_loading(args, env, message):
  proc = subprocess.run([sys.executable, SERVE, "--model=/nonexistent", *args],
                        capture_output=True, text=True, timeout=60,
                        env={**os.environ, **env})
  assert proc.returncode != 0 and message in proc.stderr
  assert "Traceback" not in proc.stderr
