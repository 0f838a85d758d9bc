"""The server's sampling fields: OpenAI's penalties and logit_bias and vLLM's extra fields are
accepted and act (through the `openai` client, against `jaxtier.LLM`), and every 400 about a
field names it in `param`."""

import json

import openai
import pytest
from fastapi.testclient import TestClient

import jaxtier
from conftest import fixture_path
from server_support import uvicorn_on_localhost, warm_engine
from jaxtier.server import create_app

MODEL = "tiny"
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=4, layer_execution="scan")
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def llm():
  """The offline reference (an engine of its own: the server's is stepped by its thread)."""
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def app():
  with warm_engine(jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)) as engine:
    yield create_app(engine, MODEL)


@pytest.fixture(scope="module")
def client(app):
  return TestClient(app)


def greedy(**kwargs) -> jaxtier.SamplingParams:
  return jaxtier.SamplingParams(**{"max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                   **kwargs})


def test_penalties_bias_and_vllm_fields_act_through_the_openai_client(app, llm):
  plain = llm.generate(PROMPT, greedy())[0]
  first = plain.token_ids[0]
  cases = [  # (request fields, extra_body, the SamplingParams the server must apply)
      ({"frequency_penalty": 2.0}, {}, greedy(frequency_penalty=2.0)),
      ({"presence_penalty": 2.0}, {}, greedy(presence_penalty=2.0)),
      ({"logit_bias": {str(first): -100}}, {}, greedy(logit_bias={first: -100})),
      ({}, {"repetition_penalty": 2.0}, greedy(repetition_penalty=2.0)),
      ({"temperature": 1.0, "seed": 7}, {"min_p": 0.9},
       greedy(temperature=1.0, seed=7, min_p=0.9)),
  ]
  with uvicorn_on_localhost(app) as port:
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    for fields, extra, params in cases:
      kwargs = {"temperature": 0, **fields}
      completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                          extra_body={"ignore_eos": True, **extra}, **kwargs)
      reference = llm.generate(PROMPT, params)[0]
      assert completion.choices[0].text == reference.text, (fields, extra)
      unset = llm.generate(PROMPT, greedy(**{k: v for k, v in kwargs.items()
                                            if k in ("temperature", "seed")}))[0]
      assert reference.token_ids != unset.token_ids, (fields, extra)  # the field acts
    chat = api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, frequency_penalty=1.5,
        extra_body={"ignore_eos": True, "min_tokens": 2, "bad_words": ["the"],
                    "allowed_token_ids": list(range(20, 120))})
    reference = llm.chat(CHAT, greedy(max_tokens=8, frequency_penalty=1.5, min_tokens=2,
                                      bad_words=["the"], allowed_token_ids=range(20, 120)))[0]
    assert chat.choices[0].message.content == reference.text
    assert set(reference.token_ids) <= set(range(20, 120))


COMPLETION_CASES = [
    ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("top_k", 2.5),
    ("max_tokens", 0), ("max_tokens", -3), ("n", 0), ("n", 500), ("seed", "x"), ("stop", [""]),
    ("stop", 5), ("stop_token_ids", [-1]), ("ignore_eos", "maybe"), ("logprobs", 21),
    ("frequency_penalty", 2.5), ("frequency_penalty", "x"), ("presence_penalty", -2.5),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("min_p", 1.5), ("min_p", -0.5),
    ("logit_bias", {"a": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"5": "x"}),
    ("logit_bias", [1, 2]), ("min_tokens", -1), ("min_tokens", 17), ("allowed_token_ids", []),
    ("allowed_token_ids", [-4]), ("allowed_token_ids", "1"), ("bad_words", [" "]),
    ("bad_words", "x"), ("suffix", "y"), ("best_of", 3), ("stream_options", {"x": 1}),
    ("stream_options", {"include_usage": True}), ("echo", "x"), ("prompt", []), ("prompt", 5),
    ("user", 3), ("unknown_field", 1), ("structured_outputs", {"json": "{x"}),
    ("structured_outputs", {"grammar": "start: nothing_here"}),
    ("response_format", {"type": "json_schema"}),
]
CHAT_CASES = [
    ("messages", []), ("temperature", -0.5), ("top_logprobs", 3), ("max_completion_tokens", 0),
    ("max_tokens", 0), ("tools", [{"type": "function"}]), ("tool_choice", "auto"),
    ("modalities", ["audio"]), ("response_format", {"type": "yaml"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "nope"}}}),
    ("structured_outputs", {"choice": []}), ("structured_outputs", {"regex": "("}),
    ("repetition_penalty", 0), ("min_p", 2), ("min_tokens", 9), ("bad_words", [""]),
    ("frequency_penalty", 3), ("logit_bias", {"x": 1}), ("service_tier", "turbo"),
]


@pytest.mark.parametrize("path, field, value", [
    *(("/v1/completions", field, value) for field, value in COMPLETION_CASES),
    *(("/v1/chat/completions", field, value) for field, value in CHAT_CASES),
])
def test_every_bad_field_is_a_400_that_names_it(client, path, field, value):
  body = ({"prompt": PROMPT, "max_tokens": 16} if path == "/v1/completions"
          else {"messages": CHAT, "max_tokens": 8})
  body[field] = value
  if field == "max_completion_tokens":
    body.pop("max_tokens")
  if field == "stream_options" and "include_usage" in value:
    body["stream"] = False
  response = client.post(path, content=json.dumps(body),
                         headers={"content-type": "application/json"})
  assert response.status_code == 400, response.text
  error = response.json()["error"]
  assert error["param"] is not None and error["param"].split(".")[0] == field, error
  assert error["type"] == "invalid_request_error" and field.split("_")[0] in error["message"]


def test_out_of_range_values_say_what_is_valid(client):
  cases = {"temperature": (-1, "temperature must be a finite number >= 0, got -1"),
           "frequency_penalty": (2.5, "frequency_penalty must be a number in [-2, 2], got 2.5"),
           "min_p": (1.5, "min_p must be a number in [0, 1], got 1.5"),
           "repetition_penalty": (0, "repetition_penalty must be a finite number > 0"),
           "min_tokens": (17, "min_tokens must be an integer in [0, max_tokens=16], got 17")}
  for field, (value, message) in cases.items():
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16,
                                                    field: value})
    assert response.status_code == 400
    assert message in response.json()["error"]["message"], response.json()


def test_logit_bias_is_clamped_and_null_vllm_fields_are_defaults(client, llm):
  body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
  plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
  nulls = client.post("/v1/completions", json={**body, "top_k": None, "min_p": None,
                                               "repetition_penalty": None,
                                               "frequency_penalty": None}).json()
  assert nulls["choices"][0]["text"] == plain
  first = llm.generate(PROMPT, greedy(max_tokens=1))[0].token_ids[0]
  huge = client.post("/v1/completions", json={**body, "logit_bias": {str(first): -1e9}}).json()
  clamped = llm.generate(PROMPT, greedy(max_tokens=6, logit_bias={first: -100}))[0].text
  assert huge["choices"][0]["text"] == clamped != plain


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"allowed_token_ids": [3, 100000]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [5, 100000]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [7] * 100]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 400}]}, "messages"),
])
def test_vocabulary_and_prompt_errors_are_400s_that_name_the_field(client, path, fields, param):
  body = ({"prompt": PROMPT, "max_tokens": 4} if path == "/v1/completions"
          else {"messages": CHAT, "max_tokens": 4})
  response = client.post(path, json={**body, **fields})
  assert response.status_code == 400, response.text
  assert response.json()["error"]["param"] == param, response.json()


# Structured outputs (random weights: only the constraint makes the replies valid).

REPLY_SCHEMA = {"type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]},
                               "age": {"type": "integer", "minimum": 0, "maximum": 20},
                               "ok": {"type": "boolean"}},
                "required": ["kind", "age", "ok"]}


def check_reply(text: str) -> None:
  value = json.loads(text)
  assert set(value) == {"kind", "age", "ok"}, text  # strict: no other keys
  assert value["kind"] in ("cat", "dog") and 0 <= value["age"] <= 20, text
  assert type(value["age"]) is int and type(value["ok"]) is bool, text


def test_response_format_json_schema_and_structured_outputs_constrain_replies(client):
  body = {"messages": CHAT, "max_tokens": 40, "temperature": 0.8, "seed": 3, "n": 3,
          "response_format": {"type": "json_schema", "json_schema": {
              "name": "pet", "schema": REPLY_SCHEMA, "strict": True}}}
  response = client.post("/v1/chat/completions", json=body)
  assert response.status_code == 200, response.text
  for choice in response.json()["choices"]:
    assert choice["finish_reason"] == "stop"
    check_reply(choice["message"]["content"])
  response = client.post("/v1/completions", json={  # response_format on completions too
      "prompt": PROMPT, "max_tokens": 40, "temperature": 0.8, "seed": 2,
      "response_format": {"type": "json_schema", "json_schema": {
          "name": "pet", "schema": REPLY_SCHEMA, "strict": True}}})
  assert response.status_code == 200, response.text
  check_reply(response.json()["choices"][0]["text"])
  cases = [({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
           ({"regex": "[0-9]{2}-[a-c]{3}"}, lambda t: len(t) == 6 and t[2] == "-")]
  for constraint, valid in cases:
    response = client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 20, "temperature": 0.8, "seed": 1, "n": 2,
        "structured_outputs": constraint})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
      assert choice["finish_reason"] == "stop" and valid(choice["text"]), choice


def test_streamed_json_schema_reply_concatenates_to_valid_json(client):
  body = {"messages": CHAT, "max_tokens": 40, "temperature": 0.8, "seed": 5, "stream": True,
          "response_format": {"type": "json_schema", "json_schema": {
              "name": "pet", "schema": REPLY_SCHEMA, "strict": True}}}
  with client.stream("POST", "/v1/chat/completions", json=body) as response:
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.iter_lines()
              if line.startswith("data: ") and line != "data: [DONE]"]
  text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
  check_reply(text)
  assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_structured_outputs_and_response_format_together_are_refused(client):
  response = client.post("/v1/chat/completions", json={
      "messages": CHAT, "response_format": {"type": "json_object"},
      "structured_outputs": {"choice": ["a"]}})
  assert response.status_code == 400
  assert response.json()["error"]["param"] == "structured_outputs"
