"""Log-probabilities in the engine, host side: which rows of a model call ask for them, the arrays
their programs take, and the results as vLLM's per-position dicts. Pure numpy (the programs are
in `runner.py`).

Only requests whose `SamplingParams` set `logprobs` or `prompt_logprobs` have a `RequestLogprobs`;
a call none of whose rows has one runs no log-probability program. Both programs compute the top
MAX_LOGPROBS (entries are trimmed to each request's k), one program per call shape, so
`Engine.warmup` compiles them all; the prompt program computes every row of a call whose rows
record prompt positions (padding and other rows are not read). Prompt log-probabilities come from the
logits at every position of a prefill chunk: position p gives the log-probability of token p + 1.
A long prompt's positions arrive over its chunks, and each prompt position is recorded once: a
request recomputed after preemption prefills its prompt again, but positions it already has (and
its generated tokens) are skipped.

Shape legend: b rows, t tokens per row.
"""

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np

from jaxtier.engine.step_inputs import StepArrays
from jaxtier.sampling.logprobs import MAX_LOGPROBS, LogprobDict, TopLogprobs, entry
from jaxtier.sampling.samplers import SamplingParams
from jaxtier.text.tokenizer import Tokenizer


@dataclasses.dataclass
class RequestLogprobs:
  """What one request has gathered so far (mutable, like `RequestProgress`)."""
  sample_k: int | None  # SamplingParams.logprobs
  prompt_k: int | None  # SamplingParams.prompt_logprobs
  generated: list[LogprobDict] = dataclasses.field(default_factory=list)  # one per generated token
  token_lps: list[float] = dataclasses.field(default_factory=list)  # the raw model's, per token
  processed_lps: list[float] = dataclasses.field(default_factory=list)  # the sampled distribution's
  prompt: list[LogprobDict | None] = dataclasses.field(default_factory=lambda: [None])  # first None
  prompt_sent: bool = False  # the prompt entries went out with an update

  @classmethod
  def of(cls, params: SamplingParams) -> "RequestLogprobs | None":
    """The request's record, or None when it asks for no log-probabilities."""
    if params.logprobs is None and params.prompt_logprobs is None:
      return None
    return cls(params.logprobs, params.prompt_logprobs)

  def update_fields(self, num_new: int) -> tuple[tuple[LogprobDict, ...] | None,
                                                 tuple[LogprobDict | None, ...] | None]:
    """`RequestUpdate.new_logprobs` for the last `num_new` tokens and `prompt_logprobs` (the
    prompt entries on the request's first update only)."""
    new = (tuple(self.generated[len(self.generated) - num_new:])
           if self.sample_k is not None else None)
    prompt = None
    if self.prompt_k is not None and not self.prompt_sent:
      prompt, self.prompt_sent = tuple(self.prompt), True
    return new, prompt

  def completion_fields(self) -> dict:
    """`Completion.logprobs`, `prompt_logprobs`, `token_logprobs` and `processed_logprobs`."""
    sampled = self.sample_k is not None
    return {"logprobs": tuple(self.generated) if sampled else None,
            "prompt_logprobs": tuple(self.prompt) if self.prompt_k is not None else None,
            "token_logprobs": tuple(self.token_lps) if sampled else None,
            "processed_logprobs": tuple(self.processed_lps) if sampled else None}


@dataclasses.dataclass(frozen=True)
class PromptRows:
  """The prompt positions one prefill call records log-probabilities for."""
  targets_bt: np.ndarray  # int32 [b, t] the prompt token after each position (0 where unread)
  rows: tuple[int, ...]  # [recording rows] their row in the call
  request_ids: tuple[Hashable, ...]  # [recording rows]
  first: tuple[int, ...]  # [recording rows] first offset in t that is recorded
  counts: tuple[int, ...]  # [recording rows] how many offsets from `first` are recorded


def sample_k(arrays: StepArrays, wanted: Mapping[Hashable, RequestLogprobs]) -> int | None:
  """The top-k width of the sampled tokens' program for this call, or None if no row that
  samples asks for log-probabilities. Always MAX_LOGPROBS: one program per row count (which
  `Engine.warmup` compiles), and a top-20 of one row of logits costs about what a top-1 does."""
  asks = any(keep and rid in wanted and wanted[rid].sample_k is not None
             for rid, keep in zip(arrays.request_ids, arrays.samples))
  return MAX_LOGPROBS if asks else None


def prompt_rows(arrays: StepArrays, wanted: Mapping[Hashable, RequestLogprobs],
                prompt_ids: Callable[[Hashable], Sequence[int]]) -> PromptRows | None:
  """The rows of this call that compute prompt positions their requests have not recorded yet,
  or None if there are none."""
  picked = []
  for i, rid in enumerate(arrays.request_ids):
    state = wanted.get(rid)
    if state is None or state.prompt_k is None:
      continue
    prompt = prompt_ids(rid)
    start = int(arrays.pos_bt[i, 0])
    end = start + int((arrays.pos_bt[i] >= 0).sum())
    lo, hi = max(start + 1, len(state.prompt)), min(end, len(prompt) - 1)  # target positions
    if lo <= hi:
      picked.append((i, rid, prompt, lo, hi - lo + 1, lo - start - 1, state.prompt_k))
  if not picked:
    return None
  targets = np.zeros(arrays.tokens_bt.shape, np.int32)
  for i, _, prompt, lo, count, first, _ in picked:
    targets[i, first:first + count] = prompt[lo:lo + count]
  return PromptRows(targets, tuple(p[0] for p in picked), tuple(p[1] for p in picked),
                    tuple(p[5] for p in picked), tuple(p[4] for p in picked))


def record_prompt(rows: PromptRows, top: TopLogprobs, wanted: Mapping[Hashable, RequestLogprobs],
                  decode: Callable[[int], str]) -> None:
  """Appends the prompt entries of `top` (numpy, [b, t]) to their requests."""
  for i, rid, first, count in zip(rows.rows, rows.request_ids, rows.first, rows.counts):
    state = wanted[rid]
    for s in range(first, first + count):
      state.prompt.append(entry(top, (i, s), int(rows.targets_bt[i, s]), state.prompt_k, decode))


class TokenText:
  """Each token id decoded on its own (special tokens kept), as vLLM fills `decoded_token`;
  memoized."""

  def __init__(self, tokenizer: Tokenizer):
    self._tokenizer = tokenizer
    self._text: dict[int, str] = {}

  def __call__(self, token_id: int) -> str:
    text = self._text.get(token_id)
    if text is None:
      text = self._text[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
    return text
