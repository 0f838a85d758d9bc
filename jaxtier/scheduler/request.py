"""Requests as the scheduler sees them: what the client asked for, and how far each one got.

Token accounting. A sequence is the prompt followed by the tokens generated so far. `num_computed`
counts the tokens whose KV sits in the cache. A step computes a range [num_computed, end); when the
range reaches the end of the sequence the model's last logits give a new token (the step "samples").
So a decoding request computes its last generated token and samples the next one, and a request that
lost its KV (recompute preemption) prefills prompt and generated tokens again. The last token sampled
is never fed back, so a request holds the KV of at most prompt_len + max_tokens - 1 tokens.
"""

import dataclasses
import typing
from collections.abc import Hashable, Sequence
from typing import Any

from jaxtier.common.checks import check_int

RequestId = Hashable

FINISHED = "finished"
ABORTED = "aborted"

FINISH_LENGTH = "length"
ABORT_CLIENT = "client_abort"
ABORT_HOST_FULL = "host_pool_full"
ABORT_TOO_LARGE = "exceeds_kv_capacity"


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
  """What a client asked for. It never changes once the request has arrived.

  The scheduler reads only the lengths; the engine and the reference driver also read the prompt's
  token ids, the sampling parameters and the seed (`Request.of` fills them in together).

  Attributes:
    request_id: unique among live requests.
    prompt_len: prompt tokens, >= 1.
    max_tokens: most tokens to generate, >= 1.
    arrival_time: when the request arrived, in the caller's clock (seconds).
    priority: lower runs first; 0 by default.
    predicted_output_len: an estimate of the tokens it will generate (for the
      `shortest_predicted_remaining` victim policy); None means max_tokens.
    prompt_token_ids: the prompt (empty when only its length is known, as in the simulator).
    params: the sampling parameters (a `jaxtier.SamplingParams`; opaque to the scheduler).
    seed: the sampling seed.
    skip_prefix_cache: never reuse cached KV for this prompt (a request that wants the
      log-probabilities of its prompt tokens must compute them all); its blocks are still cached.
  """
  request_id: RequestId
  prompt_len: int
  max_tokens: int
  arrival_time: float = 0.0
  priority: int = 0
  predicted_output_len: int | None = None
  prompt_token_ids: tuple[int, ...] = ()
  params: Any = None
  seed: int = 0
  skip_prefix_cache: bool = False

  @classmethod
  def of(cls, request_id: RequestId, prompt_token_ids: Sequence[int], params: Any, seed: int,
         max_tokens: int | None = None, **kwargs) -> "Request":
    """A request for a prompt; max_tokens defaults to `params.max_tokens`."""
    ids = tuple(int(t) for t in prompt_token_ids)
    return cls(request_id, len(ids), params.max_tokens if max_tokens is None else max_tokens,
               prompt_token_ids=ids, params=params, seed=seed, **kwargs)

  def __post_init__(self):
    if self.request_id is None or not isinstance(self.request_id, Hashable):
      raise ValueError(f"request_id={self.request_id!r}: expected a hashable id, not None")
    check_int("prompt_len", self.prompt_len, 1)
    check_int("max_tokens", self.max_tokens, 1)
    check_int("priority", self.priority)
    if self.predicted_output_len is not None:
      check_int("predicted_output_len", self.predicted_output_len, 0)
    if not isinstance(self.arrival_time, (int, float)) or self.arrival_time != self.arrival_time:
      raise ValueError(f"arrival_time={self.arrival_time!r}: expected a number")
    if self.prompt_token_ids and len(self.prompt_token_ids) != self.prompt_len:
      raise ValueError(f"prompt_len={self.prompt_len} but prompt_token_ids has "
                       f"{len(self.prompt_token_ids)} ids: expected the same length")

  @property
  def max_kv_tokens(self) -> int:
    return self.prompt_len + self.max_tokens - 1

  @property
  def predicted_output(self) -> int:
    if self.predicted_output_len is None:
      return self.max_tokens
    return self.predicted_output_len


class Seq(typing.NamedTuple):
  """A live request and its progress; `blocks` are device blocks while it runs, host blocks while it
  is swapped out, and empty while it waits.

  Immutable like the rest of the state; a named tuple rather than a frozen dataclass because every
  step rebuilds one per running request, and a tuple is built about five times faster.
  """
  request: Request
  order: int  # arrival order, breaks every tie
  num_computed: int
  num_generated: int
  blocks: tuple[int, ...]  # [blocks] in token order: its block table
  hashes: tuple[bytes, ...] = ()  # [full prompt blocks] chained block hashes (prefix caching on)
  num_registered: int = 0  # leading blocks already offered to the device prefix cache

  @property
  def request_id(self) -> RequestId:
    return self.request.request_id

  @property
  def seq_len(self) -> int:
    return self.request.prompt_len + self.num_generated

  @property
  def num_uncomputed(self) -> int:
    return self.request.prompt_len + self.num_generated - self.num_computed

  @property
  def is_decoding(self) -> bool:
    return self.num_generated > 0 and self.num_computed + 1 == self.seq_len


@dataclasses.dataclass(frozen=True)
class Ended:
  """A request that finished or was aborted, reported once in the next plan.

  Attributes:
    status: FINISHED or ABORTED.
    reason: for FINISHED the stop reason the engine gave ("stop", ...) or FINISH_LENGTH; for ABORTED
      one of ABORT_CLIENT, ABORT_HOST_FULL, ABORT_TOO_LARGE.
    detail: a sentence for the client, when the reason alone does not say enough.
  """
  request_id: RequestId
  status: str
  reason: str
  detail: str = ""
