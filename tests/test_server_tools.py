"""Tool calling on /v1/chat/completions: the prompt, the grammar of "required" and named choices
(random weights: only the grammar makes a call valid), parsing and streaming."""

import json

import pytest
from fastapi.testclient import TestClient

import jaxtier
from conftest import fixture_path
from jaxtier.server import tool_calls as tools
from jaxtier.text.tokenizer import load_tokenizer_dir
from server_support import cold_app

MODEL = "tiny"
# A template that renders tools (compactly: the fixture's tokenizer spends a token per character).
TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
            "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the forecast",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                   "required": ["utc"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def client():
  llm = jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=128, max_num_seqs=4,
                    layer_execution="scan", chat_template=TEMPLATE)
  with cold_app(llm, MODEL) as app:
    yield TestClient(app)


def check_weather(arguments: str) -> None:
  value = json.loads(arguments)
  assert set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome"), arguments
  assert type(value["days"]) is int and 1 <= value["days"] <= 7, arguments


def check_call(call: dict) -> None:
  assert call["type"] == "function" and call["id"].startswith("call_")
  if call["function"]["name"] == "weather":
    check_weather(call["function"]["arguments"])
  else:
    assert call["function"]["name"] == "time"
    assert set(json.loads(call["function"]["arguments"])) == {"utc"}


def post(client, **fields):
  body = {"messages": CHAT, "max_tokens": 60, "temperature": 0.8, "seed": 2, **fields}
  return client.post("/v1/chat/completions", json=body)


def test_named_and_required_tool_choices_give_valid_calls(client):
  response = post(client, tools=[WEATHER, TIME], n=3,
                  tool_choice={"type": "function", "function": {"name": "weather"}})
  assert response.status_code == 200, response.text
  for choice in response.json()["choices"]:
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1
    assert message["tool_calls"][0]["function"]["name"] == "weather"
    check_call(message["tool_calls"][0])
  response = post(client, tools=[WEATHER, TIME], n=3, tool_choice="required",
                  parallel_tool_calls=False)
  assert response.status_code == 200, response.text
  for choice in response.json()["choices"]:
    assert choice["finish_reason"] == "tool_calls", choice
    assert len(choice["message"]["tool_calls"]) == 1
    check_call(choice["message"]["tool_calls"][0])


def test_streamed_tool_calls_come_as_openai_deltas(client):
  body = {"messages": CHAT, "max_tokens": 60, "temperature": 0.8, "seed": 4, "stream": True,
          "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "weather"}}}
  with client.stream("POST", "/v1/chat/completions", json=body) as response:
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.iter_lines()
              if line.startswith("data: ") and line != "data: [DONE]"]
  deltas = [e["choices"][0]["delta"] for e in events]
  assert deltas[0] == {"role": "assistant", "content": ""}
  parts = [c for d in deltas for c in d.get("tool_calls", [])]
  first = parts[0]  # opens the call; the arguments follow in fragments, as OpenAI streams them
  assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
  assert first["function"] == {"name": "weather", "arguments": ""}
  assert len(parts) > 2 and all(set(p) == {"index", "function"} for p in parts[1:])
  check_weather("".join(p["function"]["arguments"] for p in parts))
  assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
  assert not any(d.get("content") for d in deltas[1:])
  # "required" replies are held back and sent whole at the end
  body.update(tool_choice="required", parallel_tool_calls=False, tools=[WEATHER, TIME])
  with client.stream("POST", "/v1/chat/completions", json=body) as response:
    events = [json.loads(line[6:]) for line in response.iter_lines()
              if line.startswith("data: ") and line != "data: [DONE]"]
  calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
  assert len(calls) == 1 and calls[0]["index"] == 0
  check_call(calls[0])
  assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_and_none_leave_the_reply_free(client):
  for choice in ("auto", "none"):
    response = post(client, tools=[WEATHER], tool_choice=choice, max_tokens=8)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(client, fields, param):
  response = post(client, **fields)
  assert response.status_code == 400, response.text
  assert response.json()["error"]["param"].split(".")[0] == param


def test_hermes_calls_are_parsed_from_auto_replies():
  text = ('Let me check. <tool_call>{"name": "weather", "arguments": {"city": "Rome", '
          '"days": 2}}</tool_call>\n<tool_call>{"name": "time", "arguments": {"utc": true}}'
          '</tool_call><tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
  content, calls = tools.parse(text, [WEATHER, TIME], "auto")
  assert content == "Let me check."
  assert [c["function"]["name"] for c in calls] == ["weather", "time"]
  assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 2}
  assert tools.parse("no call here", [WEATHER], "auto") is None
  assert tools.parse('{"city": "Ro', [WEATHER], {"function": {"name": "weather"}}) is None


def test_templates_without_tools_get_them_in_a_system_message():
  tokenizer = load_tokenizer_dir(fixture_path("tiny_llama_chat"))
  assert not tools.renders_tools(tokenizer.chat_template)
  messages, passed = tools.with_tools(CHAT, [WEATHER], tokenizer.chat_template)
  assert passed is None and messages[0]["role"] == "system" and messages[1:] == CHAT
  assert "<tools>" in messages[0]["content"] and '"name": "weather"' in messages[0]["content"]
  messages, _ = tools.with_tools([{"role": "system", "content": "Be brief."}] + CHAT, [WEATHER],
                                 tokenizer.chat_template)
  assert messages[0]["content"].startswith("Be brief.\n\n") and len(messages) == 2
  assert tools.with_tools(CHAT, [WEATHER], TEMPLATE) == (CHAT, [WEATHER])


def test_a_conversation_with_calls_and_results_continues(client):
  call = {"id": "call_1", "type": "function",
          "function": {"name": "weather", "arguments": '{"city": "Rome", "days": 2}'}}
  history = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
  response = post(client, messages=history, tools=[WEATHER], max_tokens=6)
  assert response.status_code == 200, response.text
  for bad, message in (
      ([{"role": "tool", "content": "x"}], "tool_call_id"),
      ([{"role": "user", "content": None}], "content may be null"),
      ([{"role": "user", "content": "x", "tool_calls": [call]}], "only allowed in assistant")):
    response = post(client, messages=bad)
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_history_is_written_in_the_hermes_format_for_templates_without_tools():
  call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": '{"a": 1}'}}
  conversation = [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "content": "sunny", "tool_call_id": "c"}]
  assert tools.history(conversation, TEMPLATE) == conversation
  got = tools.history(conversation, "{{ messages }}")
  assert got[1] == {"role": "assistant", "content":
                    '<tool_call>\n{"name": "weather", "arguments": {"a": 1}}\n</tool_call>'}
  assert got[2] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
