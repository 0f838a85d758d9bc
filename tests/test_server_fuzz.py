"""Schema fuzz of /v1/completions and /v1/chat/completions on the tiny Llama: request bodies that
are valid-shaped, subtly wrong (types, ranges, extra fields, odd Unicode, huge numbers) or junk
(any JSON, broken JSON, raw bytes) never get a 5xx, and every 4xx is an OpenAI error object.

Profiles: 40 examples per test; `JAXTIER_HYPOTHESIS_PROFILE=ci` runs 1,000 (~1 min on 2 cores);
`JAXTIER_FUZZ_EXAMPLES=N` runs N (`scripts/bench_serve.py --sections=fuzz` runs a larger count).
"""

import json
import os

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import jaxtier
from conftest import fixture_path
from jaxtier.server import AsyncEngine, create_app

MODEL = "tiny"
VOCAB_SIZE = 300  # the tiny fixtures' vocabulary
_COMMON = dict(deadline=None, suppress_health_check=list(HealthCheck))
# The test suite's profiles replay the same bodies every run (a CI failure reproduces); the
# larger run of `JAXTIER_FUZZ_EXAMPLES` draws new ones each time.
settings.register_profile("jaxtier_server_fuzz_default", max_examples=40, derandomize=True,
                          **_COMMON)
settings.register_profile("jaxtier_server_fuzz_ci", max_examples=1000, derandomize=True,
                          **_COMMON)
settings.register_profile("jaxtier_server_fuzz_env", max_examples=int(
    os.environ.get("JAXTIER_FUZZ_EXAMPLES", "1")), derandomize=False, **_COMMON)
if "JAXTIER_FUZZ_EXAMPLES" in os.environ:
  PROFILE = "jaxtier_server_fuzz_env"
elif os.environ.get("JAXTIER_HYPOTHESIS_PROFILE") == "ci":
  PROFILE = "jaxtier_server_fuzz_ci"
else:
  PROFILE = "jaxtier_server_fuzz_default"


@pytest.fixture(scope="module")
def client():
  llm = jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=64, max_num_seqs=4,
                    layer_execution="scan")
  engine = AsyncEngine(llm)
  yield TestClient(create_app(engine, MODEL, max_request_bytes=1 << 20))
  engine.close()


# Valid values (cheap: at most 3 new tokens, 2 choices) ...
text = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["", " ", "\x00", "\u200b", "\U0001f642", "e\u0301", "\ufeff", "<s>", "</s>", "\\", '"',
     "\n" * 5])
token_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=6)
valid_chat = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                max_size=2)})
VALID_SHARED = {
    "model": st.just(MODEL), "max_tokens": st.integers(1, 3),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2]), "top_p": st.sampled_from([1, 0.9, 0.5]),
    "top_k": st.sampled_from([-1, 1, 5]), "seed": st.integers(0, 2**32 - 1),
    "n": st.integers(1, 2), "stop": st.none() | text | st.lists(text, max_size=2),
    "stop_token_ids": token_ids, "ignore_eos": st.booleans(), "user": text,
}
VALID = {
    "/v1/completions": ("prompt", {
        **VALID_SHARED, "prompt": st.one_of(text.filter(bool), st.lists(text.filter(bool),
                                                                         min_size=1, max_size=2),
                                            token_ids, st.lists(token_ids, min_size=1,
                                                                max_size=2)),
        "echo": st.just(False), "best_of": st.just(1)}),
    "/v1/chat/completions": ("messages", {
        **VALID_SHARED, "messages": st.lists(valid_chat, min_size=1, max_size=3),
        "max_completion_tokens": st.integers(1, 3), "metadata": st.dictionaries(text, text,
                                                                                 max_size=2),
        "store": st.booleans(), "service_tier": st.sampled_from(["auto", "default", "flex"]),
        "modalities": st.just(["text"]), "response_format": st.just({"type": "text"}),
        "safety_identifier": text, "prompt_cache_key": text}),
}

# ... and wrong ones: types, ranges, odd text, huge numbers, fields that are not served.
huge = st.sampled_from([2**31, 2**63, 2**64 + 1, -(2**63) - 1, 10**30, 1e308, -1e308])
lone_surrogate = st.sampled_from(["\ud800", "a\udfffb", "\udc00x"])
scalar = st.none() | st.booleans() | huge | st.integers() | st.floats(allow_nan=True) | text
json_junk = st.recursive(scalar | lone_surrogate, lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(text, inner, max_size=3), max_leaves=6)
WRONG = {
    "max_tokens": st.sampled_from([0, -1, 64, 65, 2**40]), "n": st.sampled_from([0, 129, -1]),
    "temperature": st.sampled_from([-1, -0.0, 1e308]), "top_p": st.sampled_from([0, 1.5, -0.1]),
    "top_k": st.sampled_from([0, -7, 10**6]), "seed": huge,
    "prompt": st.one_of(st.just(""), st.just([]), st.just("word " * 100), lone_surrogate,
                        st.lists(lone_surrogate, min_size=1),
                        st.lists(st.integers(-3, VOCAB_SIZE + 3) | huge, min_size=1)),
    "messages": st.one_of(st.just([]), st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "tool", "robot"]),
         "content": lone_surrogate | st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url"]), "text": text | lone_surrogate}),
             min_size=1)}, optional={"name": text}), min_size=1)),
    "stop": lone_surrogate | st.lists(lone_surrogate, min_size=1),
    "stop_token_ids": st.lists(st.integers(-3, VOCAB_SIZE + 3) | huge, min_size=1),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "include_obfuscation": st.booleans()}),
    "logprobs": st.sampled_from([True, 2]), "echo": st.just(True), "best_of": st.just(2),
    "frequency_penalty": st.just(2.5), "logit_bias": st.just({"x": 5}), "suffix": text,
    "min_p": st.just(1.5), "repetition_penalty": st.just(0), "min_tokens": st.just(-1),
    "allowed_token_ids": st.just([]), "bad_words": st.just([" "]),
    "modalities": st.sampled_from([["audio"], [], ["text", "audio"]]),
    "service_tier": st.just("turbo"), "metadata": st.just({"k": 1}),
    "response_format": st.just({"type": "yaml"}), "tools": st.just([{"type": "function"}]),
    "prediction": json_junk, "audio": json_junk, "functions": json_junk, "zzz": json_junk,
}


@st.composite
def request_objects(draw, path: str) -> dict:
  """A valid request, or one with one to three fields wrong (a wrong value, junk of any type,
  or a field that is missing or not served)."""
  required, fields = VALID[path]
  names = sorted(fields)
  chosen = draw(st.lists(st.sampled_from([n for n in names if n != required]), max_size=6,
                         unique=True))
  obj = {name: draw(fields[name]) for name in [required, *chosen]}
  if draw(st.booleans()):
    for _ in range(draw(st.integers(1, 3))):
      name = draw(st.sampled_from(sorted(set(WRONG) | set(fields))))
      how = draw(st.sampled_from(["wrong", "junk", "drop"]))
      if how == "drop":
        obj.pop(name, None)
      else:
        obj[name] = draw(WRONG[name] if how == "wrong" and name in WRONG else json_junk)
  if draw(st.booleans()):  # streamed requests
    obj["stream"] = True
    if draw(st.booleans()):
      obj["stream_options"] = {"include_usage": draw(st.booleans())}
  return obj


def encoded(path: str) -> st.SearchStrategy[tuple[bytes, str]]:
  """(body bytes, Content-Type): JSON of a request object, cut or corrupted JSON, any JSON,
  raw bytes."""
  as_json = request_objects(path).map(lambda o: json.dumps(o).encode())
  broken = st.builds(lambda b, cut: b[:cut] if cut < len(b) else b + b",", as_json,
                     st.integers(0, 200))
  anything = json_junk.map(lambda v: json.dumps(v).encode())
  content = st.one_of(as_json, as_json, as_json, as_json, broken, anything, st.binary(max_size=40))
  kind = st.sampled_from(["application/json"] * 8 + ["text/plain", ""])
  return st.tuples(content, kind)


def check(client, path: str, content: bytes, content_type: str) -> None:
  headers = {"content-type": content_type} if content_type else {}
  response = client.post(path, content=content, headers=headers)
  event(f"status {response.status_code}")  # shown by --hypothesis-show-statistics
  assert response.status_code < 500, (content, response.text)
  if response.status_code >= 400:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
  elif "text/event-stream" not in response.headers["content-type"]:
    assert response.json()["choices"]


@settings(settings.get_profile(PROFILE))
@given(request=encoded("/v1/completions"))
def test_completions_fuzz(client, request):
  check(client, "/v1/completions", *request)


@settings(settings.get_profile(PROFILE))
@given(request=encoded("/v1/chat/completions"))
def test_chat_completions_fuzz(client, request):
  check(client, "/v1/chat/completions", *request)
