"""Tool calls cut short by max_tokens: the calls completed before the cut come back in
`message.tool_calls`, the unfinished rest is dropped and finish_reason stays "length"."""

import json

import pytest
from fastapi.testclient import TestClient

import jaxtier
from conftest import fixture_path
from jaxtier.server import tool_calls as tools
from server_support import cold_app

MODEL = "tiny"
# A template that renders tools (compactly: the fixture's tokenizer spends a token per character).
TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
            "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "user", "content": "x"}]


def flag_tool(name: str, flag: str) -> dict:
  """A function of one boolean: short calls, so that several fit in the tiny model's context."""
  return {"type": "function", "function": {"name": name, "parameters": {
      "type": "object", "properties": {flag: {"type": "boolean"}}, "required": [flag],
      "additionalProperties": False}}}


A, B = flag_tool("a", "x"), flag_tool("b", "y")
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
TOOLS = [A, B, SEARCH]
NAMED_A = {"type": "function", "function": {"name": "a"}}

FIRST = '{"name": "a", "parameters": {"x": true}}'
SECOND = '{"name": "search", "parameters": {"q": "[x] {y} \\"z\\" ]}"}}'
THIRD = '{"name": "b", "parameters": {"y": false}}'
WHOLE = f"[{FIRST}, {SECOND},\n {THIRD}]"


def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
  return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def required(text: str) -> list[tuple[str, dict]] | None:
  parsed = tools.parse(text, TOOLS, "required")
  if parsed is None:
    return None
  content, calls = parsed
  assert content is None
  return names_and_arguments(calls)


FIRST_TWO = [("a", {"x": True}), ("search", {"q": '[x] {y} "z" ]}'})]


def test_a_whole_required_array_gives_all_its_calls():
  assert required(WHOLE) == FIRST_TWO + [("b", {"y": False})]
  assert required(f"  [ {FIRST} ]  ") == [("a", {"x": True})]


def test_a_required_array_cut_inside_its_third_call_keeps_the_first_two():
  for cut in range(len(WHOLE) - len(THIRD) - 1, len(WHOLE) - 1):  # every cut inside the third
    assert required(WHOLE[:cut]) == FIRST_TWO, WHOLE[:cut]


def test_a_required_array_cut_between_calls_keeps_the_calls_before_the_cut():
  before_comma = f"[{FIRST}, {SECOND}"
  assert required(before_comma) == FIRST_TWO
  assert required(before_comma + ",") == FIRST_TWO
  assert required(before_comma + ",\n ") == FIRST_TWO
  assert required(f"[{FIRST}") == [("a", {"x": True})]


def test_a_required_array_cut_inside_its_first_call_has_no_call():
  for cut in range(len(FIRST) + 1):
    assert required(WHOLE[:cut]) is None, WHOLE[:cut]


def test_a_cut_inside_a_string_with_brackets_braces_and_escaped_quotes_drops_that_call():
  start = WHOLE.index(SECOND)
  inside = WHOLE.index('"[x]') + 1
  for cut in range(inside, start + len(SECOND)):  # cut anywhere in or after the tricky string
    assert required(WHOLE[:cut]) == [("a", {"x": True})], WHOLE[:cut]
  assert tools.array_prefix('[{"q": "]"}, {"q": "\\"]}') == [{"q": "]"}]


def test_elements_that_are_not_calls_of_known_tools_are_skipped():
  text = ('[{"name": "nope", "parameters": {}}, {"name": "a", "parameters": [1]}, 7, '
          f'{FIRST}, {{"name": "b"')
  assert required(text) == [("a", {"x": True})]
  assert required('{"name": "a", "parameters": {"x": true}}') is None  # not an array
  assert required("") is None and required("[") is None and required("[]") is None
  assert tools.array_prefix("not json") is None


def test_hermes_blocks_cut_in_a_later_block_keep_the_closed_ones():
  whole = ('Let me see. <tool_call>\n{"name": "a", "arguments": {"x": true}}\n</tool_call>\n'
           '<tool_call>\n{"name": "search", "arguments": {"q": "</tool"}}\n</tool_call>')
  second = whole.index("<tool_call>", 20)
  for cut in range(second, len(whole)):
    content, calls = tools.parse(whole[:cut], TOOLS, "auto")
    assert content == "Let me see." and names_and_arguments(calls) == [("a", {"x": True})]
  content, calls = tools.parse(whole, TOOLS, "auto")
  assert len(calls) == 2
  cut_first = whole[:whole.index("</tool_call>")]
  assert tools.parse(cut_first, TOOLS, "auto") is None  # no closed block: all of it is content


def test_a_cut_named_call_is_not_a_call():
  for text in ('{"x": tr', "", "{", '{"x": true'):
    assert tools.parse(text, TOOLS, {"type": "function", "function": {"name": "a"}}) is None
  assert tools.parse('{"x": true}', TOOLS, NAMED_A) is not None


def test_the_finish_reason_of_a_reply_with_calls():
  assert tools.finish_reason("stop") == "tool_calls"
  assert tools.finish_reason("length") == "length"


# End to end: the HTTP app on the tiny random-weight model (only the grammar makes a call valid).

@pytest.fixture(scope="module")
def client():
  llm = jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=256, max_num_seqs=4,
                    layer_execution="scan", chat_template=TEMPLATE)
  with cold_app(llm, MODEL) as app:
    yield TestClient(app)


def chat(client, **fields) -> dict:
  body = {"model": MODEL, "messages": CHAT, "temperature": 1.0, "tools": [A, B], **fields}
  response = client.post("/v1/chat/completions", json=body)
  assert response.status_code == 200, response.text
  return response.json()["choices"][0]


def streamed(client, **fields) -> tuple[str, list[dict], str]:
  """A streamed reply's content, tool calls and finish_reason."""
  body = {"model": MODEL, "messages": CHAT, "temperature": 1.0, "tools": [A, B], "stream": True,
          **fields}
  with client.stream("POST", "/v1/chat/completions", json=body) as response:
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.iter_lines()
              if line.startswith("data: ") and line != "data: [DONE]"]
  deltas = [e["choices"][0]["delta"] for e in events]
  calls = [c for d in deltas for c in d.get("tool_calls", [])]
  return ("".join(d.get("content") or "" for d in deltas), calls,
          events[-1]["choices"][0]["finish_reason"])


def token_ends(choice: dict) -> tuple[str, list[int]]:
  """A reply's raw text, from its logprobs' tokens, and where each token ends in it."""
  ends, text = [], ""
  for entry in choice["logprobs"]["content"]:
    text += entry["token"]
    ends.append(len(text))
  return text, ends


def call_ends(text: str) -> list[int]:
  """Where each top-level object of a JSON array of calls without strings ends."""
  depth, ends = 0, []
  for i, char in enumerate(text):
    depth += {"{": 1, "}": -1}.get(char, 0)
    if char == "}" and depth == 0:
      ends.append(i + 1)
  return ends


def test_a_required_reply_cut_by_max_tokens_keeps_its_complete_calls(client):
  for seed in range(40):  # a reply of three calls or more, found deterministically
    choice = chat(client, tool_choice="required", max_tokens=200, seed=seed, logprobs=True)
    if choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) >= 3:
      break
  else:
    pytest.fail("no seed gave a reply of three calls")
  text, ends = token_ends(choice)
  whole = names_and_arguments(choice["message"]["tool_calls"])
  assert [(c["name"], c["parameters"]) for c in json.loads(text)] == whole
  second, third = call_ends(text)[1:3]
  # cut just after the second call's closing brace, and inside the third call
  for cut_at in (second, (second + third) // 2):
    max_tokens = next(i for i, end in enumerate(ends) if end >= cut_at) + 1
    cut = chat(client, tool_choice="required", max_tokens=max_tokens, seed=seed)
    assert cut["finish_reason"] == "length", (cut, text[:ends[max_tokens - 1]])
    assert cut["message"]["content"] is None
    assert names_and_arguments(cut["message"]["tool_calls"]) == whole[:2]
    assert all(c["id"].startswith("call_") for c in cut["message"]["tool_calls"])
    content, calls, reason = streamed(client, tool_choice="required", max_tokens=max_tokens,
                                      seed=seed)
    assert (content, reason) == ("", "length")
    assert [c["index"] for c in calls] == [0, 1] and names_and_arguments(calls) == whole[:2]
  # cut inside the first call: no call; the raw text is the content, as before
  cut = chat(client, tool_choice="required", max_tokens=5, seed=seed)
  assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
  assert cut["message"]["content"] == text[:ends[4]]


def test_hermes_blocks_cut_by_max_tokens_keep_the_closed_ones(client):
  """tool_choice "auto" leaves the reply free, so a regex makes the random model write blocks."""
  regex = ('Hi<tool_call>\\{"name": "a", "arguments": \\{"x": (true|false)\\}\\}</tool_call>'
           '<tool_call>\\{"name": "b", "arguments": \\{"y": (true|false)\\}\\}</tool_call>')
  fields = {"tool_choice": "auto", "seed": 1, "structured_outputs": {"regex": regex}}
  whole = chat(client, max_tokens=200, logprobs=True, **fields)
  assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Hi"
  calls = names_and_arguments(whole["message"]["tool_calls"])
  assert [name for name, _ in calls] == ["a", "b"]
  text, ends = token_ends(whole)
  cut_at = text.rindex('"y"')  # inside the second block
  max_tokens = next(i for i, end in enumerate(ends) if end >= cut_at) + 1
  cut = chat(client, max_tokens=max_tokens, **fields)
  assert cut["finish_reason"] == "length"
  assert cut["message"]["content"] == "Hi"  # the unfinished block is not content
  assert names_and_arguments(cut["message"]["tool_calls"]) == calls[:1]
  assert streamed(client, max_tokens=max_tokens, **fields)[::2] == ("Hi", "length")


def test_a_named_call_cut_by_max_tokens_is_left_as_content(client):
  cut = chat(client, tool_choice=NAMED_A, max_tokens=3, seed=0)
  assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
  assert isinstance(cut["message"]["content"], str) and cut["message"]["content"]
