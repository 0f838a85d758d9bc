"""Structured outputs and tool calls as a user sees them: the `openai` client against
`scripts/serve.py` (the tiny random-weight model: only the constraint makes a reply valid)."""

import json
import os
import re
import subprocess
import sys

import openai
import pytest

from conftest import fixture_path
from server_support import free_port, wait_until_healthy

SERVE = os.path.join(os.path.dirname(__file__), "..", "scripts", "serve.py")
# A template that renders tools (compactly: the fixture's tokenizer spends a token per character).
TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
            "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 20},
                                        "ok": {"type": "boolean"}},
       "required": ["kind", "age", "ok"]}
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
  port = free_port()
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get(
      "JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("xla")))}
  proc = subprocess.Popen(
      [sys.executable, SERVE, f"--model={fixture_path('tiny_llama')}", f"--port={port}",
       "--max_model_len=128", "--max_num_seqs=4", "--layer_execution=scan",
       f"--chat_template={TEMPLATE}", "--served_model_name=tiny"],
      env=env, stderr=subprocess.DEVNULL, text=True)
  url = f"http://127.0.0.1:{port}"
  try:
    wait_until_healthy(proc, url)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()


def test_json_schema_replies_parse_and_match_the_schema_every_time(api):
  reply = api.chat.completions.create(
      model="tiny", messages=CHAT, max_tokens=40, temperature=0.8, seed=3, n=4,
      response_format={"type": "json_schema",
                       "json_schema": {"name": "pet", "schema": PET, "strict": True}})
  for choice in reply.choices:
    value = json.loads(choice.message.content)
    assert set(value) == {"kind", "age", "ok"}  # strict: no other keys
    assert value["kind"] in ("cat", "dog") and type(value["age"]) is int
    assert 0 <= value["age"] <= 20 and type(value["ok"]) is bool


def test_required_tool_choice_returns_a_call_whose_arguments_match(api):
  reply = api.chat.completions.create(
      model="tiny", messages=CHAT, max_tokens=60, temperature=0.8, seed=2, n=3,
      tools=[WEATHER], tool_choice="required")
  for choice in reply.choices:
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome")
    assert type(arguments["days"]) is int and 1 <= arguments["days"] <= 7


def test_choice_and_regex_constraints_hold(api):
  colors = ("red", "green", "blue")
  reply = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                 temperature=0.8, seed=1, n=4,
                                 extra_body={"structured_outputs": {"choice": list(colors)}})
  assert all(c.text in colors for c in reply.choices)
  reply = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20,
                                 temperature=0.8, seed=1, n=4,
                                 extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-c]{3}"}})
  assert all(re.fullmatch("[0-9]{2}-[a-c]{3}", c.text) for c in reply.choices)
