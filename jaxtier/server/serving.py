"""OpenAI response shapes built from engine updates: whole JSON bodies and server-sent events."""

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, AsyncIterator

from jaxtier.engine.engine import RequestUpdate
from jaxtier.engine.padded import Completion
from jaxtier.sampling.logprobs import LogprobDict
from jaxtier.server.async_engine import EngineError, RequestRejected
from jaxtier.server.openai_logprobs import (TokenLogprobs, TokenTracker, chat_logprobs,
                                            completion_logprobs, tokens_of)
from jaxtier.server.stream_text import IncrementalDetokenizer
from jaxtier.server.tool_calls import finish_reason as tool_finish_reason
from jaxtier.text.tokenizer import Tokenizer

DONE = "data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True)
class Choices:
  """The engine streams of one HTTP request, one per choice, and what its response needs."""
  id: str
  created: int
  model: str
  chat: bool  # chat.completion(.chunk) rather than text_completion
  streams: list[AsyncIterator[RequestUpdate]]
  stops: list[tuple[str, ...]]  # per choice
  prompt_tokens: int  # each prompt counted once, as OpenAI counts usage
  logprobs: int | None = None  # top tokens per log-probability entry; None: no logprobs
  echo: list["Echo"] | None = None  # per choice, the prompt its text starts with
  generated: bool = True  # False: the prompt is only scored (max_tokens=0), its token dropped
  per_prompt: int = 1  # choices of each prompt (n); the streams are prompt-major
  # chat with tools: a reply's text -> (content, tool calls), or None when it holds no call
  tool_calls: Callable[[str], tuple[str | None, list[dict]] | None] | None = None
  named_tool: str | None = None  # the function a named tool_choice calls: streamed as it comes


@dataclasses.dataclass(frozen=True)
class Echo:
  """A prompt echoed at the start of a completion choice's text."""
  text: str
  token_ids: tuple[int, ...]


def _encodable(text: str | None) -> str | None:
  """`text` with lone surrogates (JSON carries them, UTF-8 cannot) written as `\\udxxx`."""
  return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None
               ) -> dict[str, Any]:
  """OpenAI's error object. The message and param may quote the request (a model name, a field
  name), so lone surrogates in them are escaped."""
  return {"error": {"message": _encodable(message), "type": type_, "param": _encodable(param),
                    "code": code}}


def sse(payload: dict[str, Any]) -> str:
  return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_field(error: str) -> tuple[str | None, str]:
  """(the request field a completion's `error` names, or None; the error)."""
  first = error.split(" ", 1)[0].rstrip(":")
  return (first if first.startswith("structured_outputs") else None), error


async def merge(streams: list[AsyncIterator[RequestUpdate]]
                ) -> AsyncIterator[tuple[int, RequestUpdate]]:
  """(choice index, update) pairs from all streams as they arrive; closing it closes them all."""
  queue: asyncio.Queue = asyncio.Queue()

  async def pump(index: int, stream: AsyncIterator[RequestUpdate]) -> None:
    try:
      async for update in stream:
        await queue.put((index, update))
      await queue.put((index, None))
    except Exception as e:  # handed to the reader, which raises it
      await queue.put((index, e))

  tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
  try:
    remaining = len(tasks)
    while remaining:
      index, item = await queue.get()
      if item is None:
        remaining -= 1
      elif isinstance(item, Exception):
        raise item
      else:
        yield index, item
  finally:
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def collect(streams: list[AsyncIterator[RequestUpdate]]) -> list[Completion]:
  """Each stream's final `Completion`, in order. Raises EngineError if a batch failed."""
  done: dict[int, Completion] = {}
  async for index, update in merge(streams):
    if update.completion is not None:
      done[index] = update.completion
  return [done[i] for i in range(len(streams))]


def _usage(choices: Choices, completions: list[Completion]) -> dict:
  """OpenAI's usage; `prompt_tokens_details.cached_tokens` counts each prompt's tokens served by
  the prefix cache once, like `prompt_tokens` (the most any of its choices found)."""
  generated = sum(len(c.token_ids) for c in completions) if choices.generated else 0
  n = choices.per_prompt
  cached = sum(max(c.num_cached_tokens for c in completions[i:i + n])
               for i in range(0, len(completions), n))
  return {"prompt_tokens": choices.prompt_tokens, "completion_tokens": generated,
          "total_tokens": choices.prompt_tokens + generated,
          "prompt_tokens_details": {"cached_tokens": cached}}


def _logprobs(choices: Choices, tokens: list[TokenLogprobs] | None) -> dict[str, list] | None:
  if tokens is None:
    return None
  return chat_logprobs(tokens, choices.logprobs) if choices.chat else completion_logprobs(tokens)


def _prompt_tokens(echo: Echo, entries: Sequence[LogprobDict | None], tokenizer: Tokenizer
                   ) -> list[TokenLogprobs]:
  return tokens_of(tokenizer, echo.token_ids, entries, len(echo.text))


def _whole_choice(choices: Choices, index: int, c: Completion, tokenizer: Tokenizer
                  ) -> tuple[str, list[TokenLogprobs] | None]:
  """A finished choice's text and, when logprobs are asked for, its tokens: the echoed prompt's,
  then the generated ones (none when the prompt is only scored)."""
  echo = choices.echo[index] if choices.echo else None
  prompt = echo.text if echo else ""
  text = prompt + c.text if choices.generated else prompt
  if choices.logprobs is None:
    return text, None
  tokens = _prompt_tokens(echo, c.prompt_logprobs, tokenizer) if echo else []
  if choices.generated:
    tokens += tokens_of(tokenizer, c.token_ids, c.logprobs, len(c.text), len(prompt))
  return text, tokens


def response_body(choices: Choices, completions: list[Completion], tokenizer: Tokenizer
                  ) -> dict[str, Any]:
  """The non-streamed `text_completion` or `chat.completion` object."""
  items = []
  for i, c in enumerate(completions):
    text, tokens = _whole_choice(choices, i, c, tokenizer)
    finish_reason = c.finish_reason if choices.generated else "length"
    if choices.chat:
      message = {"role": "assistant", "content": text}
      calls = None if choices.tool_calls is None else choices.tool_calls(text)
      if calls is not None:
        message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
        finish_reason = tool_finish_reason(finish_reason)
      items.append({"index": i, "message": message,
                    "logprobs": _logprobs(choices, tokens), "finish_reason": finish_reason})
    else:
      items.append({"index": i, "text": text, "logprobs": _logprobs(choices, tokens),
                    "finish_reason": finish_reason})
  return {"id": choices.id, "object": "chat.completion" if choices.chat else "text_completion",
          "created": choices.created, "model": choices.model, "choices": items,
          "usage": _usage(choices, completions)}


def _chunk(choices: Choices, index: int, text: str, finish_reason: str | None,
           tokens: list[TokenLogprobs] | None = None, role: bool = False,
           tool_calls: list[dict] | None = None) -> dict[str, Any]:
  logprobs = _logprobs(choices, tokens)
  if choices.chat:
    delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
    if tool_calls is not None:
      delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(tool_calls)]
    item = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
  else:
    item = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
  return {"id": choices.id, "created": choices.created, "model": choices.model,
          "object": "chat.completion.chunk" if choices.chat else "text_completion",
          "choices": [item]}


class _StreamedChoice:
  """One choice of a streamed response: its text deltas and the tokens that go with them
  (`logprobs.TokenTracker`; None when no logprobs are asked for)."""

  def __init__(self, choices: Choices, index: int, tokenizer: Tokenizer):
    self._echo = choices.echo[index] if choices.echo else None
    self._generated, self._tokenizer = choices.generated, tokenizer
    self._detokenizer = IncrementalDetokenizer(tokenizer, choices.stops[index])
    self._tracker = (None if choices.logprobs is None else
                     TokenTracker(tokenizer, len(self._echo.text) if self._echo else 0))
    self._sent = 0  # generated characters sent

  def echo(self, update: RequestUpdate) -> tuple[str, list[TokenLogprobs] | None] | None:
    """The echoed prompt's text and tokens, on the choice's first update only; else None."""
    echo, self._echo = self._echo, None
    if echo is None:
      return None
    tokens = (None if self._tracker is None
              else _prompt_tokens(echo, update.prompt_logprobs, self._tokenizer))
    return echo.text, tokens

  def push(self, update: RequestUpdate) -> tuple[str, list[TokenLogprobs] | None]:
    """The text (maybe empty) and tokens that became safe to send with an update."""
    if not self._generated:
      return "", None
    text = self._detokenizer.push(update.new_token_ids)
    self._sent += len(text)
    if self._tracker is None:
      return text, None
    self._tracker.push(update.new_token_ids, update.new_logprobs)
    return text, self._tracker.take(self._sent)

  def finish(self, update: RequestUpdate) -> tuple[str, list[TokenLogprobs] | None]:
    """The rest of the text and of the tokens, with the choice's last update."""
    if not self._generated:
      return "", None if self._tracker is None else []
    text = self._detokenizer.finish(update.completion.text)
    if self._tracker is None:
      return text, None
    self._tracker.push(update.new_token_ids, update.new_logprobs)
    return text, self._tracker.rest(len(update.completion.text))


async def events(choices: Choices, tokenizer: Tokenizer, include_usage: bool
                 ) -> AsyncIterator[str]:
  """The server-sent events of a streamed response, ending with `data: [DONE]`.

  Chat streams open each choice with a chunk carrying `delta.role`; an echoing completion opens
  each choice with a chunk carrying the prompt (and its tokens' logprobs) once the choice's first
  update arrives; a chunk's logprobs are those of its tokens (`logprobs.TokenTracker`); every
  choice ends with a chunk carrying its finish_reason; with `include_usage` a last chunk (no
  choices) carries the usage. A failed batch is reported as an `error` event before `[DONE]`.
  With a named tool choice (`Choices.named_tool`) the reply is the call's arguments: the first
  chunk of a choice opens the call (`index` 0, id, type, name, empty arguments) and each text
  delta is sent as an arguments fragment, as OpenAI streams calls; finish_reason "tool_calls"
  (or "length" when cut short). With other tools (`Choices.tool_calls`) a choice's text is held
  back until it ends, then sent in one chunk: its tool calls (each whole, with its `index`, id,
  name and arguments) and the content before them, finish_reason "tool_calls" ("length" when cut
  short: the calls completed before the cut); or, with no call, the text as content.
  """
  streamed = [_StreamedChoice(choices, i, tokenizer) for i in range(len(choices.streams))]
  if choices.chat:
    for i in range(len(choices.streams)):
      yield sse(_chunk(choices, i, "", None, role=True))
  finished: dict[int, Completion] = {}
  held: dict[int, tuple[list[str], list]] = {}  # with tools: each choice's text and tokens so far
  opened: set[int] = set()  # choices whose named call was opened
  try:
    async for index, update in merge(choices.streams):
      echo = streamed[index].echo(update)
      if echo is not None:
        yield sse(_chunk(choices, index, echo[0], None, echo[1]))
      if choices.named_tool is not None:
        if index not in opened:
          opened.add(index)
          call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": choices.named_tool, "arguments": ""}}
          yield sse(_chunk(choices, index, "", None, tool_calls=[call]))
        if update.completion is None:
          text, tokens = streamed[index].push(update)
          reason = None
        else:
          finished[index] = update.completion
          text, tokens = streamed[index].finish(update)
          reason = update.completion.finish_reason
          reason = "tool_calls" if reason == "stop" else reason
        if text or reason is not None:
          fragment = [{"function": {"arguments": text}}] if text else None
          yield sse(_chunk(choices, index, "", reason, tokens, tool_calls=fragment))
        continue
      if update.completion is None:
        text, tokens = streamed[index].push(update)
        if choices.tool_calls is not None:
          texts, all_tokens = held.setdefault(index, ([], []))
          texts.append(text)
          all_tokens += tokens or []
        elif text:
          yield sse(_chunk(choices, index, text, None, tokens))
      else:
        finished[index] = update.completion
        if update.completion.error is not None:  # its grammar failed: say why, then end it
          param, error = error_field(update.completion.error)
          yield sse(error_body(error, "invalid_request_error", param))
        text, tokens = streamed[index].finish(update)
        reason = update.completion.finish_reason if choices.generated else "length"
        calls = None
        if choices.tool_calls is not None:
          texts, all_tokens = held.pop(index, ([], []))
          text = "".join(texts) + text
          tokens = None if tokens is None else all_tokens + tokens
          calls = choices.tool_calls(text)
        if calls is not None:
          yield sse(_chunk(choices, index, calls[0] or "", tool_finish_reason(reason), tokens,
                           tool_calls=calls[1]))
        else:
          yield sse(_chunk(choices, index, text, reason, tokens))
  except RequestRejected as e:
    yield sse(error_body(str(e), "invalid_request_error"))
  except EngineError as e:
    yield sse(error_body(str(e), "server_error"))
  else:
    if include_usage:
      yield sse({"id": choices.id, "created": choices.created, "model": choices.model,
                 "object": "chat.completion.chunk" if choices.chat else "text_completion",
                 "choices": [], "usage": _usage(choices, [finished[i] for i in sorted(finished)])})
  yield DONE
