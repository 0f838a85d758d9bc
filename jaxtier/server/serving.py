"""OpenAI response shapes built from engine updates: whole JSON bodies and server-sent events."""

import asyncio
import dataclasses
import json
from typing import Any, AsyncIterator

from jaxtier.generate import Completion, StepUpdate
from jaxtier.server.async_engine import EngineError
from jaxtier.server.detokenize import IncrementalDetokenizer
from jaxtier.tokenizer import Tokenizer

DONE = "data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True)
class Choices:
  """The engine streams of one HTTP request, one per choice, and what its response needs."""
  id: str
  created: int
  model: str
  chat: bool  # chat.completion(.chunk) rather than text_completion
  streams: list[AsyncIterator[StepUpdate]]
  stops: list[tuple[str, ...]]  # per choice
  prompt_tokens: int  # each prompt counted once, as OpenAI counts usage


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None
               ) -> dict[str, Any]:
  return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(payload: dict[str, Any]) -> str:
  return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def merge(streams: list[AsyncIterator[StepUpdate]]
                ) -> AsyncIterator[tuple[int, StepUpdate]]:
  """(choice index, update) pairs from all streams as they arrive; closing it closes them all."""
  queue: asyncio.Queue = asyncio.Queue()

  async def pump(index: int, stream: AsyncIterator[StepUpdate]) -> None:
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


async def collect(streams: list[AsyncIterator[StepUpdate]]) -> list[Completion]:
  """Each stream's final `Completion`, in order. Raises EngineError if a batch failed."""
  done: dict[int, Completion] = {}
  async for index, update in merge(streams):
    if update.completion is not None:
      done[index] = update.completion
  return [done[i] for i in range(len(streams))]


def _usage(choices: Choices, completions: list[Completion]) -> dict[str, int]:
  generated = sum(len(c.token_ids) for c in completions)
  return {"prompt_tokens": choices.prompt_tokens, "completion_tokens": generated,
          "total_tokens": choices.prompt_tokens + generated}


def response_body(choices: Choices, completions: list[Completion]) -> dict[str, Any]:
  """The non-streamed `text_completion` or `chat.completion` object."""
  if choices.chat:
    items = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
              "finish_reason": c.finish_reason} for i, c in enumerate(completions)]
  else:
    items = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
             for i, c in enumerate(completions)]
  return {"id": choices.id, "object": "chat.completion" if choices.chat else "text_completion",
          "created": choices.created, "model": choices.model, "choices": items,
          "usage": _usage(choices, completions)}


def _chunk(choices: Choices, index: int, text: str, finish_reason: str | None,
           role: bool = False) -> dict[str, Any]:
  if choices.chat:
    delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
    item = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
  else:
    item = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
  return {"id": choices.id, "created": choices.created, "model": choices.model,
          "object": "chat.completion.chunk" if choices.chat else "text_completion",
          "choices": [item]}


async def events(choices: Choices, tokenizer: Tokenizer, include_usage: bool
                 ) -> AsyncIterator[str]:
  """The server-sent events of a streamed response, ending with `data: [DONE]`.

  Chat streams open each choice with a chunk carrying `delta.role`; every choice ends with a chunk
  carrying its finish_reason; with `include_usage` a last chunk (no choices) carries the usage.
  A failed batch is reported as an `error` event before `[DONE]`.
  """
  detokenizers = [IncrementalDetokenizer(tokenizer, stops) for stops in choices.stops]
  if choices.chat:
    for i in range(len(choices.streams)):
      yield sse(_chunk(choices, i, "", None, role=True))
  finished: list[Completion] = []
  try:
    async for index, update in merge(choices.streams):
      if update.completion is None:
        text = detokenizers[index].push(update.new_token_ids)
        if text:
          yield sse(_chunk(choices, index, text, None))
      else:
        finished.append(update.completion)
        yield sse(_chunk(choices, index, detokenizers[index].finish(update.completion.text),
                         update.completion.finish_reason))
  except EngineError as e:
    yield sse(error_body(str(e), "server_error"))
  else:
    if include_usage:
      yield sse({"id": choices.id, "created": choices.created, "model": choices.model,
                 "object": "chat.completion.chunk" if choices.chat else "text_completion",
                 "choices": [], "usage": _usage(choices, finished)})
  yield DONE
