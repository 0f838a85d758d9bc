"""Incremental decoding of generated token ids: each step decodes a few tokens, not all of them.

`IncrementalDecoder` follows the offsets scheme of vLLM's incremental detokenizer: it decodes a
window that starts at the tokens of the previous emission twice, without and with the new tokens,
and emits the difference. Starting the window a chunk back keeps decoders exact that drop the
leading space of a window's first token or join bytes across tokens. Text that ends in an
incomplete UTF-8 character (decoded as U+FFFD) waits for the next token.
"""

from typing import Sequence

from jaxtier.tokenizer import Tokenizer

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
