"""OpenAI's log-probability shapes, built from the engine's entries (dicts token id -> `Logprob`).

Completions (the legacy shape), one list item per token: `{"tokens": [text], "token_logprobs":
[float], "top_logprobs": [{text: float}], "text_offset": [int]}`. A token's text is the token
decoded on its own; its top_logprobs hold it and the requested top tokens (texts shared by several
tokens keep the highest value); an echoed prompt's first token has null token_logprobs and
top_logprobs (nothing precedes it). Chat: `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}`, with exactly the requested top tokens by rank
and `bytes` the UTF-8 of the token's text (a token holding part of a character decodes to U+FFFD,
as in vLLM). Log-probabilities below -9999 are sent as -9999 (JSON has no infinity), as vLLM does.

`text_offset`: token i starts where the text decoded from the tokens before it ends (the tokens of
a character split over several all start where it starts), cut to the choice's text (tokens past a
stop string start at its end); an echoed prompt's text comes first.

Streaming (`TokenTracker`): a token goes with the chunk whose text holds the last character it
completes; a token that completes none before the request ends (EOS, a token past a stop string,
one still held back as a possible stop string's start) goes with the last chunk. The chunks' tokens
thus concatenate to the non-streamed list.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxtier.sampling.logprobs import LogprobDict
from jaxtier.text.detokenize import IncrementalDecoder
from jaxtier.text.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """One token of a choice: its id, text, entry (None for a prompt's first token) and offset."""
  token_id: int
  text: str
  entry: LogprobDict | None
  offset: int  # where its text starts in the choice's text


class TokenTracker:
  """A choice's tokens with their entries and text offsets, handed out as their text is sent.

  Args:
    tokenizer: the model's tokenizer.
    base: characters of the choice's text before these tokens' text (an echoed prompt).
  """

  def __init__(self, tokenizer: Tokenizer, base: int = 0):
    self._tokenizer, self._base = tokenizer, base
    self._decoder = IncrementalDecoder(tokenizer)
    self._open: list[TokenLogprobs] = []  # pushed, no character completed since
    self._closed: list[tuple[TokenLogprobs, int]] = []  # (token, end of the text it completed)

  def push(self, token_ids: Sequence[int], entries: Sequence[LogprobDict | None]) -> None:
    """Adds tokens and their entries (one each, in order). Tokens past the last entry are left
    out: a request aborted before its whole prompt was scored has fewer prompt entries."""
    for token, entry in zip(token_ids, entries):
      text = (self._tokenizer.decode([token], skip_special_tokens=False) if entry is None
              else entry[token].decoded_token)
      self._open.append(TokenLogprobs(token, text, entry, self._base + len(self._decoder.text)))
      if self._decoder.push([token]):
        end = len(self._decoder.text)
        self._closed += [(t, end) for t in self._open]
        self._open = []

  def take(self, sent: int) -> list[TokenLogprobs]:
    """The tokens not taken yet whose text ends within the first `sent` characters."""
    n = 0
    while n < len(self._closed) and self._closed[n][1] <= sent:
      n += 1
    taken, self._closed = [t for t, _ in self._closed[:n]], self._closed[n:]
    return taken

  def rest(self, text_len: int) -> list[TokenLogprobs]:
    """Every token not taken yet, offsets cut to `text_len` characters of text."""
    rest = [t for t, _ in self._closed] + self._open
    self._closed, self._open = [], []
    end = self._base + text_len
    return [dataclasses.replace(t, offset=min(t.offset, end)) for t in rest]


def tokens_of(tokenizer: Tokenizer, token_ids: Sequence[int],
              entries: Sequence[LogprobDict | None], text_len: int, base: int = 0
              ) -> list[TokenLogprobs]:
  """All tokens of a finished text of `text_len` characters, starting `base` characters in."""
  tracker = TokenTracker(tokenizer, base)
  tracker.push(token_ids, entries)
  return tracker.rest(text_len)


def _value(logprob: float) -> float:
  return max(logprob, MIN_LOGPROB)


def _text_values(entry: LogprobDict) -> dict[str, float]:
  out: dict[str, float] = {}
  for value in entry.values():
    out[value.decoded_token] = max(out.get(value.decoded_token, MIN_LOGPROB), _value(value.logprob))
  return out


def completion_logprobs(tokens: Sequence[TokenLogprobs]) -> dict[str, list]:
  """The legacy completions `logprobs` object of `tokens`."""
  return {"tokens": [t.text for t in tokens],
          "token_logprobs": [None if t.entry is None else _value(t.entry[t.token_id].logprob)
                             for t in tokens],
          "top_logprobs": [None if t.entry is None else _text_values(t.entry) for t in tokens],
          "text_offset": [t.offset for t in tokens]}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
  return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: Sequence[TokenLogprobs], top: int) -> dict[str, list]:
  """The chat `logprobs` object of `tokens`, each with its `top` most likely tokens.

  An entry holds the chosen token first, then the top tokens by rank
  (`jaxtier.sampling.logprobs.entry`); it has `top` entries when the chosen token is one of them.
  """
  content = []
  for t in tokens:
    items = list(t.entry.values())
    best = items[1:] if len(items) > top else sorted(items, key=lambda v: v.rank)
    content.append({**_chat_token(t.text, t.entry[t.token_id].logprob),
                    "top_logprobs": [_chat_token(v.decoded_token, v.logprob) for v in best]})
  return {"content": content}
