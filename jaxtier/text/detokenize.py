"""Incremental decoding of generated token ids: each step decodes a few tokens, not all of them.

`IncrementalDecoder` follows the offsets scheme of vLLM's incremental detokenizer: it decodes a
window that starts at the tokens of the previous emission twice, without and with the new tokens,
and emits the difference. Starting the window a chunk back keeps decoders exact that drop the
leading space of a window's first token or join bytes across tokens. Text that ends in an
incomplete UTF-8 character (decoded as U+FFFD) waits for the next token.
"""

from typing import Sequence

from jaxtier.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
  """The text of a growing list of token ids, `text`, extended by `push`."""

  def __init__(self, tokenizer: Tokenizer):
    self._tokenizer = tokenizer
    self.ids: list[int] = []
    self.text = ""  # the text of ids[:self._read]
    self._prefix = 0  # first id of the decode window
    self._read = 0  # ids up to here are in `text`

  def push(self, token_ids: Sequence[int]) -> str:
    """Adds ids; returns the text they completed (empty while a character is incomplete)."""
    self.ids.extend(token_ids)
    decode = self._tokenizer.decode
    before = decode(self.ids[self._prefix:self._read])
    after = decode(self.ids[self._prefix:])
    if len(after) <= len(before) or after.endswith(REPLACEMENT):
      return ""
    delta = after[len(before):]
    self.text += delta
    self._prefix, self._read = self._read, len(self.ids)
    return delta


def find_stop(text: str, stops: Sequence[str], new_chars: int) -> int | None:
  """Where the earliest stop string starts in `text`, looking only where one of its last
  `new_chars` characters could complete it (earlier text was searched before); None if none."""
  hits = []
  for stop in stops:
    at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
    if at >= 0:
      hits.append(at)
  return min(hits) if hits else None


class RequestProgress:
  """Host-side progress of one request: its generated ids, stop checks and final text.

  Stops on an EOS id (unless `ignore_eos`), a `stop_token_ids` id, a `stop` string (checked on the
  incrementally decoded text, only where the newest characters could complete one), or `limit`
  tokens (max_tokens, or what is left of the context window). The final text is decoded once from
  all ids and cut before the earliest stop string.
  """

  def __init__(self, prompt_ids: Sequence[int], params, tokenizer: Tokenizer, limit: int):
    self.prompt_ids, self.params, self.tokenizer = tuple(prompt_ids), params, tokenizer
    self.generated: list[int] = []
    self.decoder = IncrementalDecoder(tokenizer) if params.stop else None
    self.finish_reason: str | None = None
    self.limit = limit

  def append(self, token: int) -> None:
    """Adds a sampled token and sets `finish_reason` when it ends the request."""
    p = self.params
    self.generated.append(token)
    new_text = self.decoder.push([token]) if self.decoder is not None else ""
    if (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
      self.finish_reason = "stop"
    elif new_text and find_stop(self.decoder.text, p.stop, len(new_text)) is not None:
      self.finish_reason = "stop"
    elif len(self.generated) >= self.limit:
      self.finish_reason = "length"

  def text(self) -> str:
    """The generated text, cut before the earliest stop string."""
    text = self.tokenizer.decode(self.generated)
    cut = find_stop(text, self.params.stop, len(text))
    return text if cut is None else text[:cut]
