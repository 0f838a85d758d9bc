"""What generation hands back: a request's `Completion`, and the engine's per-step `RequestUpdate`.

A leaf module (it depends only on `jaxtier.sampling.logprobs`), so that both the reference driver
(`jaxtier.engine.padded`) and the engine, which sits above it, import these types from one place;
`jaxtier.engine.padded.Completion` and `jaxtier.engine.engine.RequestUpdate` re-export them.
"""

import dataclasses
from collections.abc import Hashable

from jaxtier.sampling.logprobs import LogprobDict


@dataclasses.dataclass(frozen=True)
class Completion:
  """A request's result. The log-probabilities are the engine's (the reference driver leaves them
  None): `logprobs` one dict per generated token when `SamplingParams.logprobs` is set,
  `prompt_logprobs` one entry per prompt token (the first None) when `prompt_logprobs` is set.
  `num_cached_tokens`: prompt tokens whose KV came from the engine's prefix cache instead of being
  computed (`host_cached_tokens` of them loaded from its host tier), when the request first ran.
  With `logprobs` set, `token_logprobs` holds each generated token's log-probability under the raw
  model (vLLM's "raw_logprobs") and `processed_logprobs` under the distribution it was drawn from
  (after logit transforms, temperature and the top-k / top-p / min-p cut; 0 for a greedy row):
  what a policy-gradient step needs, without the dicts."""
  token_ids: tuple[int, ...]
  text: str
  finish_reason: str  # "stop", "length" or "abort" (`error` says why, where the engine knows)
  logprobs: tuple[LogprobDict, ...] | None = None
  prompt_logprobs: tuple[LogprobDict | None, ...] | None = None
  num_cached_tokens: int = 0
  host_cached_tokens: int = 0
  token_logprobs: tuple[float, ...] | None = None
  processed_logprobs: tuple[float, ...] | None = None
  error: str | None = None  # why a request ended early ("abort"), e.g. its grammar failed


@dataclasses.dataclass(frozen=True)
class RequestUpdate:
  """What one engine step added to one request; `completion` is set on the step the request ends.

  Log-probabilities (None unless the request's `SamplingParams` ask for them): `new_logprobs`
  holds one dict per token of `new_token_ids` (`logprobs`); `prompt_logprobs` holds one entry per
  prompt token, the first None (`prompt_logprobs`), on the request's first update only (the one
  with its first token, or its final one if it ends before any) and None on later updates. The
  completion carries both lists whole.
  """
  request_id: Hashable
  new_token_ids: tuple[int, ...]
  completion: Completion | None
  new_logprobs: tuple[LogprobDict, ...] | None = None
  prompt_logprobs: tuple[LogprobDict | None, ...] | None = None
