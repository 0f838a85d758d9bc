"""Streamed text deltas that are safe to send.

A delta is sent only when it cannot change or be taken back later: text that ends in an incomplete
UTF-8 character waits for the next token (`jaxtier.text.detokenize.IncrementalDecoder`), and so does
a tail that could be the start of a stop string, since stop strings are never sent. When the request
finishes, the rest of its final text (already cut at the stop string) is sent.
"""

from typing import Sequence

from jaxtier.text.detokenize import IncrementalDecoder
from jaxtier.text.tokenizer import Tokenizer


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
  """Length of the longest tail of `text` that is a proper prefix of one of `stops`."""
  best = 0
  for stop in stops:
    for k in range(min(len(stop) - 1, len(text)), best, -1):
      if text.endswith(stop[:k]):
        best = k
        break
  return best


class IncrementalDetokenizer:
  """Turns one request's generated token ids into streamable text deltas.

  Each push decodes only the newest tokens (and the few before them); `finish` sends what is left
  of the final text, so the deltas concatenate to exactly the non-streamed text.
  """

  def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]):
    self._decoder, self._stops = IncrementalDecoder(tokenizer), tuple(stops)
    self._longest_stop = max(map(len, self._stops), default=0)
    self._sent = 0  # characters of the decoded text already returned

  def push(self, token_ids: Sequence[int]) -> str:
    """Adds newly generated ids; returns the text that became safe to send (maybe empty)."""
    if not self._decoder.push(token_ids):
      return ""
    text = self._decoder.text
    end = len(text) - stop_prefix_len(text[max(0, len(text) - self._longest_stop):], self._stops)
    if end <= self._sent:
      return ""
    delta, self._sent = text[self._sent:end], end
    return delta

  def finish(self, final_text: str) -> str:
    """The rest of the request's final text (`Completion.text`), once it has finished."""
    assert final_text.startswith(self._decoder.text[:self._sent]), "streamed text was taken back"
    return final_text[self._sent:]
