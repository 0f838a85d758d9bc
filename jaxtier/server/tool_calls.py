"""Tool calling for chat completions: tools in the prompt, the grammar that enforces a call, and
calls parsed out of the reply.

- Prompt: a chat template that renders tools (it names `tools`) gets them as the `tools`
  variable, as `transformers` passes them; any other template gets them in a system message in
  the Hermes format (function signatures in `<tools></tools>`, calls asked for as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), prepended to the first system
  message or added before the conversation.
- History: `history` writes earlier calls and tool results in the Hermes format for templates
  that do not render tools.
- `tool_choice`: "none" (no tools in the prompt, nothing parsed), "auto" (the reply is free; Hermes
  `<tool_call>` blocks in it become calls), "required" (the reply is constrained to a JSON array
  of one or more `{"name", "parameters"}` calls of the given tools, vLLM's format), or a named
  function (the reply is constrained to that function's parameters schema: its arguments).
- A reply with calls has `message.tool_calls` (ids `call_<hex>`), `content` the text before the
  first call (None when empty) and finish_reason "tool_calls".
- A reply cut short (max_tokens) keeps the calls it completed: the whole elements of a cut
  "required" array, the closed `<tool_call>` blocks of an "auto" reply; the unfinished rest is
  dropped and finish_reason stays "length", as OpenAI and vLLM report a truncated reply. A cut
  named call has no complete call: its text is left as content.
"""

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def parameters(tool: dict) -> dict:
  return tool["function"].get("parameters") or EMPTY_PARAMETERS


def system_prompt(tools: Sequence[dict]) -> str:
  """The Hermes instructions and signatures, for templates that do not render tools."""
  signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
  return ("You may call one or more functions to assist with the user query. You are provided "
          "with function signatures within <tools></tools> XML tags:\n<tools>\n"
          f"{signatures}\n</tools>\n\nFor each function call, return a json object with function "
          "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
          '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def renders_tools(chat_template: str | None) -> bool:
  return chat_template is not None and re.search(r"\btools\b", chat_template) is not None


def with_tools(conversation: list[dict], tools: Sequence[dict], chat_template: str | None
               ) -> tuple[list[dict], list[dict] | None]:
  """(messages, the template's `tools` variable): the tools passed to a template that renders
  them, else added to the messages as a system message."""
  if renders_tools(chat_template):
    return conversation, list(tools)
  prompt = system_prompt(tools)
  if conversation and conversation[0]["role"] in ("system", "developer"):
    first = dict(conversation[0], content=conversation[0]["content"] + "\n\n" + prompt)
    return [first] + conversation[1:], None
  return [{"role": "system", "content": prompt}] + conversation, None


def history(conversation: list[dict], chat_template: str | None) -> list[dict]:
  """The conversation for a template that does not render tools: an assistant's earlier calls
  written into its text as Hermes `<tool_call>` blocks, and each tool result as a user message
  in `<tool_response>` tags (Hermes' format). Unchanged for templates that render tools."""
  if renders_tools(chat_template):
    return conversation
  out = []
  for m in conversation:
    if m.get("tool_calls"):
      calls = "\n".join(
          "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                        "arguments": _arguments(c["function"]["arguments"])},
                                       ensure_ascii=False) + "\n</tool_call>"
          for c in m["tool_calls"])
      out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "")
                  + calls})
    elif m["role"] == "tool":
      out.append({"role": "user",
                  "content": "<tool_response>\n" + m["content"] + "\n</tool_response>"})
    else:
      out.append(m)
  return out


def _arguments(text: str):
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def constraint(tools: Sequence[dict], choice: str | dict, parallel: bool = True) -> dict | None:
  """`SamplingParams.structured_outputs` enforcing `choice`; None for "auto" and "none".
  Without `parallel` (`parallel_tool_calls=false`) "required" allows exactly one call."""
  if isinstance(choice, dict):
    name = choice["function"]["name"]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return {"json": parameters(tool)}
  if choice != "required":
    return None
  calls = [{"type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters(t)},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
  array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
  return {"json": array if parallel else dict(array, maxItems=1)}


def _call(name: str, arguments: Any) -> dict:
  text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
  return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
          "function": {"name": name, "arguments": text}}


def array_prefix(text: str) -> list | None:
  """The elements of the JSON array `text` opens, up to the first that does not decode: all of
  them for a whole array, the complete ones for an array cut short (max_tokens), so that calls
  finished before the cut are kept. None when `text` does not open an array.

  Each element is decoded on its own (`raw_decode`), so brackets, braces and escaped quotes inside
  strings never confuse where an element ends; the whitespace and commas between elements are
  skipped."""
  text = text.strip()
  if not text.startswith("["):
    return None
  decoder, items, at = json.JSONDecoder(), [], 1
  while True:
    while at < len(text) and text[at] in " \t\n\r,":
      at += 1
    if at >= len(text) or text[at] == "]":
      return items
    try:
      item, at = decoder.raw_decode(text, at)
    except json.JSONDecodeError:
      return items
    items.append(item)


def _known_call(item: Any, names: set[str]) -> bool:
  """Whether an element of a "required" reply is a call: an object naming one of the tools, with
  an object of parameters (missing: none)."""
  return (isinstance(item, dict) and item.get("name") in names
          and isinstance(item.get("parameters", {}), dict))


def finish_reason(reason: str) -> str:
  """The finish_reason of a reply that holds calls, from the engine's: "tool_calls" when the
  reply ended by itself ("stop"), else the engine's ("length" when max_tokens cut it), as OpenAI
  and vLLM report a truncated reply."""
  return "tool_calls" if reason == "stop" else reason


def parse(text: str, tools: Sequence[dict], choice: str | dict
          ) -> tuple[str | None, list[dict]] | None:
  """(content, tool calls) of a reply, or None when it holds no call (then it is plain content).
  Calls of functions not in `tools` are not calls."""
  names = {t["function"]["name"] for t in tools}
  if isinstance(choice, dict):
    try:
      json.loads(text)
    except json.JSONDecodeError:
      return None  # cut short (max_tokens): left as content
    return None, [_call(choice["function"]["name"], text)]
  if choice == "required":
    items = array_prefix(text)
    calls = [_call(item["name"], item.get("parameters", {})) for item in items or ()
             if _known_call(item, names)]
    return (None, calls) if calls else None
  if choice != "auto":
    return None
  calls = []
  for match in TOOL_CALL.finditer(text):
    try:
      item = json.loads(match.group(1))
    except json.JSONDecodeError:
      continue
    if isinstance(item, dict) and item.get("name") in names:
      calls.append(_call(item["name"], item.get("arguments", item.get("parameters", {}))))
  if not calls:
    return None
  content = text[:text.find("<tool_call>")].strip()
  return content or None, calls
