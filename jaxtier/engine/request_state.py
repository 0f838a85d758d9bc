"""What the engine keeps on the host for each live request, from its arrival to its end.

A live request has its `RequestProgress` (generated tokens, stop checks, text) and seed; its
`LogitRules` when it transforms logits (`SamplingParams.transforms_logits`: penalties,
`logit_bias`, masks); a `GrammarMatcher` with structured outputs, once its grammar compiled
(`jaxtier.engine.grammars`; `set_grammar`); a `RequestLogprobs` when it asks for log-probabilities
(`jaxtier.engine.logprob_requests`); and the prefix-cache hits of its first admission, which its
completion reports. `LiveRequests.check` checks an arriving request and builds its rules and
`check` checks an arriving request and builds its rules, `add` makes it live once the scheduler
has it, `accept` appends each sampled token (the matcher consumes it first) and `finish` drops its
state and returns its last update.
"""

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np
from absl import logging

from jaxtier.common.checks import check_prompt_ids
from jaxtier.engine import logprob_requests as lp
from jaxtier.engine.outputs import Completion, RequestUpdate
from jaxtier.engine.step_inputs import SamplingInfo
from jaxtier.sampling.logprobs import TopLogprobs, entry
from jaxtier.sampling.samplers import LogitRules, SamplingParams
from jaxtier.sampling.structured import GrammarMatcher
from jaxtier.text.detokenize import RequestProgress
from jaxtier.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class NewRequest:
  """An arriving request that passed the checks, its rules built (`LiveRequests.add` makes it
  live)."""
  request_id: Hashable
  prompt_ids: tuple[int, ...]
  params: SamplingParams
  seed: int
  max_tokens: int  # params.max_tokens, at most the room the prompt leaves in max_model_len
  rules: LogitRules | None


class LiveRequests:
  """The host state of the engine's live requests, by id (see the module docstring).

  Args:
    tokenizer: EOS ids, encoding of `bad_words` and decoding for stop checks, text and
      log-probability entries.
    vocab_size: the model's vocabulary; token ids outside it are refused.
    max_model_len: the context window a request's prompt and tokens fill.
  """

  def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
    self._tokenizer, self._vocab_size, self._max_model_len = tokenizer, vocab_size, max_model_len
    self._live: dict[Hashable, tuple[RequestProgress, int]] = {}  # id -> (progress, seed)
    self.logprobs: dict[Hashable, lp.RequestLogprobs] = {}  # live requests that ask for them
    self._rules: dict[Hashable, LogitRules] = {}  # live requests with logit transforms
    self.grammars: dict[Hashable, GrammarMatcher] = {}  # live requests whose grammar compiled
    self._hits: dict[Hashable, tuple[int, int]] = {}  # live id -> cached (device, host) tokens
    self._token_text = lp.TokenText(tokenizer)

  def __contains__(self, request_id: Hashable) -> bool:
    return request_id in self._live

  def __len__(self) -> int:
    return len(self._live)

  def prompt_rows(self, row_tokens: int) -> tuple[int, int]:
    """(live requests, rows of `row_tokens` tokens their prompts fill, each prompt's last row
    partial)."""
    return len(self._live), sum(-(-len(progress.prompt_ids) // row_tokens)
                                for progress, _ in self._live.values())

  def ids(self) -> list[Hashable]:
    """The live requests' ids, in arrival order."""
    return list(self._live)

  # Arrival and end.

  def check(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams,
            seed: int) -> NewRequest:
    """Checks an arriving request and builds its logit rules (its grammar is checked and
    compiled by `jaxtier.engine.grammars`).

    Raises ValueError for an id that is live, an empty prompt, ids outside the vocabulary (in
    the prompt, `logit_bias`, `allowed_token_ids` or the tokens of `bad_words`), or a prompt
    that leaves no room to generate within max_model_len.
    """
    if request_id in self._live:
      raise ValueError(f"request_id={request_id!r} is already running: expected a new id")
    prompt_ids = check_prompt_ids(prompt_ids, self._vocab_size, self._max_model_len,
                                  f"request {request_id!r}'s prompt")
    room = self._max_model_len - len(prompt_ids)
    rules = self._logit_rules(params)
    return NewRequest(request_id, prompt_ids, params, seed, min(params.max_tokens, room), rules)

  def _logit_rules(self, params: SamplingParams) -> LogitRules | None:
    """The request's logit transforms with the tokenizer applied, ids checked against the
    vocabulary; None when it has none."""
    if not params.transforms_logits:
      return None
    params.check_vocab(self._vocab_size)
    encode = lambda text: self._tokenizer.encode(text, add_special_tokens=False)
    rules = LogitRules.of(params, encode, self._tokenizer.eos_token_ids, self._vocab_size)
    bad = sorted({t for ids in rules.bad_words_ids for t in ids
                  if not 0 <= t < self._vocab_size})
    if bad:
      raise ValueError(f"bad_words {list(params.bad_words)} encode to token ids outside the "
                       f"vocabulary [0, {self._vocab_size}): {bad[:5]}")
    return rules

  def add(self, new: NewRequest) -> None:
    """Makes a checked request live (the scheduler has it now)."""
    progress = RequestProgress(new.prompt_ids, new.params, self._tokenizer, new.max_tokens)
    self._live[new.request_id] = (progress, new.seed)
    wanted = lp.RequestLogprobs.of(new.params)
    if wanted is not None:
      self.logprobs[new.request_id] = wanted
    if new.rules is not None:
      self._rules[new.request_id] = new.rules

  def set_grammar(self, request_id: Hashable, matcher: GrammarMatcher) -> None:
    """Gives a live request its compiled grammar (before it first samples)."""
    self.grammars[request_id] = matcher

  def finish(self, request_id: Hashable, reason: str, new: tuple[int, ...],
             error: str | None = None) -> RequestUpdate:
    """Ends a live request with `reason`: drops its state and returns its last update (`new`:
    its last tokens) with its completion (`error`: why it ended early, for its client)."""
    progress, _ = self._live.pop(request_id)
    progress.finish_reason = reason
    wanted = self.logprobs.pop(request_id, None)
    self._rules.pop(request_id, None)
    self.grammars.pop(request_id, None)
    device, host = self._hits.pop(request_id, (0, 0))
    cached = dict(num_cached_tokens=device + host, host_cached_tokens=host, error=error)
    if wanted is None:
      return RequestUpdate(request_id, new, Completion(tuple(progress.generated), progress.text(),
                                                       reason, **cached))
    completion = Completion(tuple(progress.generated), progress.text(), reason,
                            **wanted.completion_fields(), **cached)
    return RequestUpdate(request_id, new, completion, *wanted.update_fields(len(new)))

  def record_hits(self, hits: Sequence[tuple[Hashable, int, int]]) -> None:
    """Keeps the (request, device, host) cached tokens of admitted requests (`Plan.hits`); a
    readmitted request keeps its first."""
    for request_id, device, host in hits:
      self._hits.setdefault(request_id, (device, host))

  # What a model call needs.

  def progress(self, request_id: Hashable) -> RequestProgress:
    """The live request's progress (the same object until it ends)."""
    return self._live[request_id][0]

  def is_current(self, request_id: Hashable, progress: RequestProgress) -> bool:
    """Whether `progress` is the live request's: false once it ended, even if its id is live
    again."""
    return self._live.get(request_id, (None,))[0] is progress

  def prompt_ids(self, request_id: Hashable) -> tuple[int, ...]:
    """The live request's prompt."""
    return self._live[request_id][0].prompt_ids

  def token_ids(self, request_id: Hashable) -> tuple[int, ...]:
    """The request's prompt and generated tokens."""
    progress, _ = self._live[request_id]
    return progress.prompt_ids + tuple(progress.generated)

  def sampling(self, request_id: Hashable) -> SamplingInfo:
    """What sampling the live request's next token needs."""
    progress, seed = self._live[request_id]
    return SamplingInfo(progress.params, seed, len(progress.generated),
                        self._rules.get(request_id), self.grammars.get(request_id))

  def needs_last_token(self, request_id: Hashable) -> bool:
    """Whether sampling the request's next token needs its last token on the host: its logit
    transforms and grammar mask depend on it."""
    return request_id in self._rules or request_id in self.grammars

  # Results.

  def record_prompt(self, rows: lp.PromptRows, top: TopLogprobs) -> None:
    """Appends a prefill call's prompt log-probabilities (numpy) to their requests."""
    lp.record_prompt(rows, top, self.logprobs, self._token_text)

  def accept(self, request_id: Hashable, token: int, sampled: TopLogprobs | None,
             row: int, processed: np.ndarray | None = None) -> RequestUpdate:
    """Appends a token sampled for a live request (row `row` of `sampled`, its call's top
    log-probabilities, and of `processed`, the tokens' log-probabilities under the processed
    distribution, when computed) and returns its update, with the completion when the token
    ends the request. Its grammar consumes the token first: complete, it ends the request with
    "stop"; rejecting the token (or allowing none), with "abort" and without the token."""
    progress, _ = self._live[request_id]
    grammar = self.grammars.get(request_id)
    if grammar is not None and not grammar.consume(token):
      error = (f"structured_outputs.{progress.params.structured_outputs.field}: the grammar "
               f"failed after {len(progress.generated)} tokens: "
               f"{grammar.error or 'no token was allowed'}")
      logging.warning("request %r: %s; ending it", request_id, error)
      return self.finish(request_id, "abort", (), error=error)
    progress.append(token)
    if grammar is not None and grammar.stopped and progress.finish_reason is None:
      progress.finish_reason = "stop"  # the grammar is complete
    wanted = self.logprobs.get(request_id)
    if wanted is not None and wanted.sample_k is not None:
      wanted.generated.append(entry(sampled, row, token, wanted.sample_k, self._token_text))
      wanted.token_lps.append(float(sampled.token_lp[row]))
      wanted.processed_lps.append(float(processed[row]))
    if progress.finish_reason is not None:
      return self.finish(request_id, progress.finish_reason, (token,))
    if wanted is None:
      return RequestUpdate(request_id, (token,), None)
    return RequestUpdate(request_id, (token,), None, *wanted.update_fields(1))
