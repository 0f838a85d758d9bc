"""Sampling parameters (the vLLM names) and a jitted sampler over a batch of logits.

A row's logits go through these transforms, in this order:
1. `logit_bias` (added), then the masks: tokens outside `allowed_token_ids`, the last token of
   a `bad_words` sequence whose other tokens end the output so far, and EOS / `stop_token_ids`
   while fewer than `min_tokens` were generated (set to -inf). Bias and masks commute (a masked
   token stays -inf whatever its bias), so they are one scatter on the device.
2. The penalties: `repetition_penalty` over every token of the prompt and the output (a positive
   logit divided by it, any other multiplied, as Hugging Face's `RepetitionPenaltyLogitsProcessor`
   and vLLM do), then `frequency_penalty` * count and `presence_penalty` * (count > 0) subtracted,
   counting output tokens only (OpenAI's definition, vLLM's order). Hugging Face also applies its
   sequence bias before the repetition penalty, so greedy tokens equal its
   `generate(repetition_penalty=...)`.
3. The grammar mask of a request with `structured_outputs`: tokens its grammar does not allow
   next are set to -inf (a bitmask per row computed on the host by `jaxtier.sampling.structured`).
4. `temperature`, then top-k, top-p and `min_p` (tokens whose probability is below min_p times
   the largest are dropped; the comparison does not change when top-k/top-p renormalize, so
   min-p keeps the tokens both keep, as Hugging Face's warpers in this order do).
Steps 1-3 need each request's token history or grammar state: `LogitsArrays` carries them (ids
padded to a power of two, a prompt/output split, the grammar's bitmask), and the counts and
masks are built on the device by scatters, in a sampling program of its own
(`sample_transformed`) that only batches with such a row run.
The log-probabilities a request asks for are of the raw logits, before all of this.

Shape legend: b batch, v vocab, n history tokens, k biased or masked ids, a allowed ids,
w int32 words of a token bitmask (0 when no row of the batch is constrained).
"""

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier.common.buckets import pow2_bucket
from jaxtier.common.checks import is_int, is_number
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.sampling.logprobs import MAX_LOGPROBS
from jaxtier.sampling.structured import (StructuredOutputsError, StructuredOutputsParams,
                                         mask_words)

BIAS_LIMIT = 100.0  # OpenAI's logit_bias range, [-100, 100]; larger biases are clamped to it
PENALTY_LIMIT = 2.0  # frequency_penalty and presence_penalty are in [-2, 2]


class SamplingParamError(ValueError):
  """A `SamplingParams` value that is out of range; `field` names the parameter."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick tokens for one request. temperature=0 is greedy; top_k <= 0 means no top-k.

  `logprobs` (0 to MAX_LOGPROBS) returns, for every generated token, its log-probability and
  those of the `logprobs` most likely tokens; `prompt_logprobs` does the same for every prompt
  token after the first (given the tokens before it). Both are log_softmax of the raw logits
  (before temperature, top-k, top-p) and never change which tokens are sampled.

  The logit transforms (`repetition_penalty`, `frequency_penalty`, `presence_penalty`, `min_p`,
  `logit_bias`, `allowed_token_ids`, `bad_words`, `min_tokens`) have vLLM's meanings; the module
  docstring gives their order. `logit_bias` keys are token ids, each bias clamped to [-100, 100];
  ids are checked against the vocabulary when a request is added to an engine.

  `structured_outputs` (vLLM's field: a `StructuredOutputsParams` or a mapping of its fields,
  `json`, `regex`, `choice`, `grammar` or `json_object`) constrains the output to a grammar: only
  tokens the grammar allows next are sampled (after the other logit transforms, before
  temperature), and the request stops with "stop" once the grammar is complete.
  """
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  seed: int | None = None
  stop: Sequence[str] = ()
  stop_token_ids: Sequence[int] = ()
  ignore_eos: bool = False
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  repetition_penalty: float = 1.0
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  min_p: float = 0.0
  logit_bias: Mapping[int, float] | None = None
  allowed_token_ids: Sequence[int] | None = None
  bad_words: Sequence[str] = ()
  min_tokens: int = 0
  structured_outputs: StructuredOutputsParams | None = None

  def __post_init__(self):
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    object.__setattr__(self, "stop", tuple(self.stop or ()))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
    if isinstance(self.bad_words, str):
      object.__setattr__(self, "bad_words", (self.bad_words,))
    object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
    _require(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
             "an integer >= 1", self.max_tokens)
    _require(is_number(self.temperature) and 0 <= self.temperature < math.inf, "temperature",
             "a finite number >= 0", self.temperature)
    _require(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
    _require(is_int(self.top_k), "top_k", "an integer (<= 0 disables it)", self.top_k)
    _require(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**32), "seed",
             "an integer in [0, 2**32) or None", self.seed)
    _require(all(isinstance(s, str) and s for s in self.stop), "stop",
             "a list of non-empty strings", self.stop)
    _require(all(_is_id(t) for t in self.stop_token_ids), "stop_token_ids",
             "non-negative integers", self.stop_token_ids)
    for name in ("logprobs", "prompt_logprobs"):
      value = getattr(self, name)
      _require(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
               f"None or an integer in [0, {MAX_LOGPROBS}]", value)
    self._check_transforms()
    if self.structured_outputs is not None:
      try:
        object.__setattr__(self, "structured_outputs",
                           StructuredOutputsParams.of(self.structured_outputs))
      except StructuredOutputsError as e:
        raise SamplingParamError("structured_outputs", str(e)) from None
      except TypeError as e:  # a field that does not exist
        raise SamplingParamError("structured_outputs", f"structured_outputs: {e}") from None

  def _check_transforms(self) -> None:
    _require(is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
             "repetition_penalty", "a finite number > 0 (1 disables it)", self.repetition_penalty)
    for name in ("frequency_penalty", "presence_penalty"):
      value = getattr(self, name)
      _require(is_number(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT, name,
               f"a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]", value)
    _require(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]",
             self.min_p)
    if self.logit_bias is not None:
      object.__setattr__(self, "logit_bias", _clamped_bias(self.logit_bias))
    if self.allowed_token_ids is not None:
      ids = tuple(self.allowed_token_ids)
      _require(ids and all(_is_id(t) for t in ids), "allowed_token_ids",
               "None or a non-empty list of token ids (integers >= 0)", self.allowed_token_ids)
      object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in ids))
    _require(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
             "a list of strings that are not blank", self.bad_words)
    _require(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def transforms_logits(self) -> bool:
    """Whether a transform that needs the request's tokens or its own lists applies (all but
    temperature, top-k, top-p and min-p): its batches run `sample_transformed`."""
    return (self.repetition_penalty != 1 or self.frequency_penalty != 0
            or self.presence_penalty != 0 or bool(self.logit_bias)
            or self.allowed_token_ids is not None or bool(self.bad_words) or self.min_tokens > 0)

  @property
  def constrained(self) -> bool:
    """Whether a grammar constrains the output (`structured_outputs`): its batches run
    `sample_transformed` with the grammar's token mask."""
    return self.structured_outputs is not None

  def check_vocab(self, vocab_size: int) -> None:
    """ValueError naming the field when `logit_bias` or `allowed_token_ids` holds an id outside
    [0, vocab_size)."""
    for name, ids in (("logit_bias", self.logit_bias or ()),
                      ("allowed_token_ids", self.allowed_token_ids or ())):
      bad = sorted({t for t in ids if not 0 <= t < vocab_size})
      if bad:
        raise SamplingParamError(name, f"{name} has token ids outside the vocabulary "
                                 f"[0, {vocab_size}): {bad[:5]}")


def _require(ok, field: str, expected: str, value) -> None:
  """SamplingParamError "<field> must be <expected>, got <value>" unless `ok`."""
  if not ok:
    raise SamplingParamError(field, f"{field} must be {expected}, got {value!r}")


def _is_id(value) -> bool:
  return is_int(value) and value >= 0


def _clamped_bias(logit_bias: Mapping[int, float]) -> dict[int, float]:
  """`logit_bias` as {token id: bias}, each bias clamped to [-BIAS_LIMIT, BIAS_LIMIT]."""
  _require(isinstance(logit_bias, Mapping), "logit_bias", "a mapping of token id to bias",
           logit_bias)
  out = {}
  for token, bias in logit_bias.items():
    _require(_is_id(token), "logit_bias", "keyed by token ids (integers >= 0)", token)
    _require(is_number(bias) and math.isfinite(bias), "logit_bias",
             f"finite numbers (clamped to [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}])", bias)
    out[int(token)] = min(BIAS_LIMIT, max(-BIAS_LIMIT, float(bias)))
  return out


def bad_words_token_ids(bad_words: Sequence[str], encode: Callable[[str], list[int]]
                        ) -> tuple[tuple[int, ...], ...]:
  """The token sequences `bad_words` bans, by vLLM's rule: each word (leading spaces stripped)
  encoded as it is, and also with one leading space when that gives a different first token and
  as many tokens (so a word is banned at the start of a text and after a space).
  `encode` adds no special tokens."""
  out: list[tuple[int, ...]] = []
  for word in bad_words:
    plain = tuple(encode(word.lstrip()))
    if not plain:
      continue
    out.append(plain)
    spaced = tuple(encode(" " + word.lstrip()))
    if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
      out.append(spaced)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class LogitRules:
  """One request's logit transforms with its tokenizer applied (host side; see `LogitsArrays`).

  Attributes:
    params: the request's sampling parameters (`transforms_logits` is true).
    bad_words_ids: `bad_words_token_ids` of its `bad_words`.
    stop_ids: EOS ids (unless `ignore_eos`) and `stop_token_ids`: masked until `min_tokens`.
  """
  params: SamplingParams
  bad_words_ids: tuple[tuple[int, ...], ...] = ()
  stop_ids: tuple[int, ...] = ()

  @classmethod
  def of(cls, params: SamplingParams, encode: Callable[[str], list[int]],
         eos_ids: Sequence[int], vocab_size: int) -> "LogitRules":
    """The rules of `params`; stop ids past the vocabulary (never sampled) are left out."""
    stops = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_ids))
    return cls(params, bad_words_token_ids(params.bad_words, encode),
               tuple(dict.fromkeys(t for t in stops if t < vocab_size)))

  def masked(self, output_ids: Sequence[int]) -> list[int]:
    """Ids masked for the next token after `output_ids`: the last token of each bad word whose
    other tokens end the output (a one-token word always), and the stop ids before min_tokens."""
    out = [ids[-1] for ids in self.bad_words_ids if len(ids) - 1 <= len(output_ids)
           and tuple(output_ids[len(output_ids) - len(ids) + 1:]) == ids[:-1]]
    if len(output_ids) < self.params.min_tokens:
      out += self.stop_ids
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
  """Per-row sampling parameters of a batch, as device arrays."""
  temperature_b: jax.Array  # [b] float32, 0 = greedy
  top_k_b: jax.Array  # [b] int32, <= 0 = all
  top_p_b: jax.Array  # [b] float32
  seed_b: jax.Array  # [b] uint32
  step_b: jax.Array  # [b] int32, tokens generated so far (folded into the key)
  min_p_b: jax.Array  # [b] float32, 0 = off

  @classmethod
  def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
                  steps: Sequence[int]) -> "SamplingArrays":
    return cls(np.array([p.temperature for p in params], np.float32),
               np.array([p.top_k for p in params], np.int32),
               np.array([p.top_p for p in params], np.float32),
               np.array(seeds, np.uint32), np.array(steps, np.int32),
               np.array([p.min_p for p in params], np.float32))


MIN_HISTORY = 64  # history rows pad to at least this many tokens (power-of-two buckets)
MIN_IDS = 8  # biased/masked and allowed id lists pad to at least this many entries


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsArrays:
  """What the logit transforms of a batch need, as device arrays; rows without transforms (and
  padding rows) hold neutral values. Ids of -1 are padding."""
  history_bn: jax.Array  # [b, n] int32 prompt then output token ids
  prompt_len_b: jax.Array  # [b] int32 history positions below it are prompt tokens
  repetition_b: jax.Array  # [b] float32 repetition_penalty, 1 = off
  frequency_b: jax.Array  # [b] float32
  presence_b: jax.Array  # [b] float32
  add_ids_bk: jax.Array  # [b, k] int32 token ids whose logit gets add_values_bk
  add_values_bk: jax.Array  # [b, k] float32 a logit_bias, or -inf for a masked token
  allowed_ids_ba: jax.Array  # [b, a] int32 allowed_token_ids
  restrict_b: jax.Array  # [b] bool only allowed_ids_ba may be sampled
  grammar_bw: jax.Array  # [b, w] int32 token bitmask of a grammar (-1: all allowed); w may be 0

  @property
  def widths(self) -> tuple[int, int, int, int]:
    """(n, k, a, w): with the row count, the compiled variant of `sample_transformed`."""
    return (self.history_bn.shape[1], self.add_ids_bk.shape[1], self.allowed_ids_ba.shape[1],
            self.grammar_bw.shape[1])

  @staticmethod
  def grammar_widths(vocab_size: int) -> tuple[int, int, int, int]:
    """The `widths` of a batch whose rows transform logits by a grammar alone (no penalties,
    bias, allowed ids, bad words or min_tokens), as `from_rows` pads them: the smallest lists
    and one bitmask of `mask_words(vocab_size)` words (`vocab_size`: the grammar's, see
    `structured.grammar_tokenizer`). What the engine's warm-up compiles the transformed
    sampler at."""
    return (MIN_HISTORY, MIN_IDS, MIN_IDS, mask_words(vocab_size))

  @classmethod
  def neutral(cls, b: int, n: int, k: int, a: int, w: int) -> "LogitsArrays":
    """The arrays of `b` rows without transforms at widths (n, k, a, w) (`widths`): what tracing
    and exporting the transformed sampler take."""
    def ids(width):
      return np.full((b, width), -1, np.int32)
    return cls(ids(n), np.zeros(b, np.int32), np.ones(b, np.float32), np.zeros(b, np.float32),
               np.zeros(b, np.float32), ids(k), np.zeros((b, k), np.float32), ids(a),
               np.zeros(b, bool), ids(w))

  @classmethod
  def from_rows(cls, rows: Sequence[tuple | None]) -> "LogitsArrays":
    """The arrays of a batch: per row (rules or None, token ids so far, how many of them are
    output[, its grammar's [w] bitmask or None]), or None for a row without transforms."""
    b = len(rows)
    masks = [row[3] if row is not None and len(row) > 3 else None for row in rows]
    words = max((len(m) for m in masks if m is not None), default=0)
    grammar = np.full((b, words), -1, np.int32)
    for i, m in enumerate(masks):
      if m is not None:
        grammar[i] = m
    adds, allowed, histories = [[] for _ in rows], [[] for _ in rows], [[] for _ in rows]
    prompt_len = np.zeros(b, np.int32)
    penalties = np.zeros((3, b), np.float32)
    penalties[0] = 1
    restrict = np.zeros(b, bool)
    for i, row in enumerate(rows):
      if row is None or row[0] is None:
        continue
      rules, ids, num_output = row[:3]
      p = rules.params
      penalties[:, i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
      if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty:
        histories[i], prompt_len[i] = ids, len(ids) - num_output
      adds[i] = list((p.logit_bias or {}).items()) + [
          (t, -np.inf) for t in rules.masked(ids[len(ids) - num_output:])]
      if p.allowed_token_ids is not None:
        allowed[i], restrict[i] = p.allowed_token_ids, True
    history = _padded(histories, MIN_HISTORY)
    add = _padded([[t for t, _ in row] for row in adds], MIN_IDS)
    values = np.zeros(add.shape, np.float32)
    for i, row in enumerate(adds):
      values[i, :len(row)] = [v for _, v in row]
    return cls(history, prompt_len, *penalties, add, values, _padded(allowed, MIN_IDS), restrict,
               grammar)


def _padded(rows: Sequence[Sequence[int]], minimum: int) -> np.ndarray:
  """[len(rows), pow2_bucket(longest, minimum)] int32 of the rows, padded with -1."""
  out = np.full((len(rows), pow2_bucket(max(map(len, rows), default=0), minimum)), -1, np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def _scatter_bv(shape, ids_bn, values_bn, op: str):
  """A [b, v] array of zeros with values_bn scattered into row i's columns ids_bn[i] by `op`
  ("add" or "set"); ids of -1 are dropped."""
  v = shape[1]
  rows_bn = jnp.broadcast_to(jnp.arange(shape[0])[:, None], ids_bn.shape)
  cols_bn = jnp.where(ids_bn >= 0, ids_bn, v)  # out of range: dropped
  target = jnp.zeros(shape, jnp.asarray(values_bn).dtype).at[rows_bn, cols_bn]
  return getattr(target, op)(values_bn, mode="drop")


def grammar_allowed(grammar_bw: jax.Array, v: int) -> jax.Array:
  """[b, v] bool: bit t % 32 of word t // 32 of each row's bitmask (tokens past 32 w: False)."""
  b, w = grammar_bw.shape
  bits_bw32 = (grammar_bw[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
  bits_bv = bits_bw32.reshape(b, w * 32).astype(bool)
  if w * 32 >= v:
    return bits_bv[:, :v]
  return jnp.pad(bits_bv, ((0, 0), (0, v - w * 32)))


def transform_logits(logits_bv: jax.Array, t: LogitsArrays) -> jax.Array:
  """Steps 1-3 of the module docstring: bias and masks, the penalties, then the grammar mask;
  float32 [b, v]."""
  logits_bv = logits_bv.astype(jnp.float32)
  shape = logits_bv.shape
  logits_bv = logits_bv + _scatter_bv(shape, t.add_ids_bk, t.add_values_bk, "add")
  allowed_bv = _scatter_bv(shape, t.allowed_ids_ba, jnp.ones(t.allowed_ids_ba.shape, bool), "set")
  logits_bv = jnp.where(t.restrict_b[:, None] & ~allowed_bv, -jnp.inf, logits_bv)
  history_bn = t.history_bn
  output_bn = jnp.arange(history_bn.shape[1])[None, :] >= t.prompt_len_b[:, None]
  seen_bv = _scatter_bv(shape, history_bn, jnp.ones(history_bn.shape, bool), "set")
  counts_bv = _scatter_bv(shape, history_bn, output_bn.astype(jnp.float32), "add")
  penalty_b1 = t.repetition_b[:, None]
  penalized_bv = jnp.where(logits_bv > 0, logits_bv / penalty_b1, logits_bv * penalty_b1)
  logits_bv = jnp.where(seen_bv, penalized_bv, logits_bv)
  logits_bv = (logits_bv - t.frequency_b[:, None] * counts_bv
               - t.presence_b[:, None] * (counts_bv > 0).astype(jnp.float32))
  if t.grammar_bw.shape[1]:  # a static shape: batches without a grammar skip this
    logits_bv = jnp.where(grammar_allowed(t.grammar_bw, shape[1]), logits_bv, -jnp.inf)
  return logits_bv


def _kept(logits_v, temperature, top_k, top_p, min_p):
  """The distribution a row's token is drawn from: (its logits over temperature sorted down
  [v], their token ids [v], which of them top-k / top-p / min-p keep [v])."""
  scaled_v = logits_v.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  sorted_v, order_v = jax.lax.top_k(scaled_v, scaled_v.shape[-1])
  rank_v = jnp.arange(scaled_v.shape[-1])
  keep_v = (top_k <= 0) | (rank_v < top_k)
  probs_v = jax.nn.softmax(jnp.where(keep_v, sorted_v, -jnp.inf))
  keep_v &= (jnp.cumsum(probs_v) - probs_v) < top_p  # the smallest prefix whose mass reaches top_p
  keep_v &= (min_p <= 0) | (sorted_v >= sorted_v[0] + jnp.log(min_p))  # p >= min_p * max p
  return sorted_v, order_v, keep_v


def _sample_row(logits_v, temperature, top_k, top_p, min_p, key):
  sorted_v, order_v, keep_v = _kept(logits_v, temperature, top_k, top_p, min_p)
  return order_v[jax.random.categorical(key, jnp.where(keep_v, sorted_v, -jnp.inf))]


def _processed_row(logits_v, token, temperature, top_k, top_p, min_p):
  sorted_v, order_v, keep_v = _kept(logits_v, temperature, top_k, top_p, min_p)
  kept_v = jnp.where(keep_v, sorted_v, -jnp.inf)
  return kept_v[jnp.argmax(order_v == token)] - jax.nn.logsumexp(kept_v)


def argmax_reference(logits_bv: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis (the first index of the maximum), as a max and a min;
  v - 1 for a row of NaNs (with some NaNs, whatever XLA's max makes of them: XLA:CPU's may skip
  them).

  XLA:CPU runs argmax as a variadic (value, index) reduction that does not vectorize; these two
  plain reductions do.
  """
  v = logits_bv.shape[-1]
  top = logits_bv.max(axis=-1, keepdims=True)
  index_v = jnp.arange(v, dtype=jnp.int32)
  first = jnp.min(jnp.where(logits_bv == top, index_v, v), axis=-1)
  return jnp.minimum(first, v - 1)  # a row of NaNs matches nothing


def _kernel_argmax(logits_bv: jax.Array) -> jax.Array:
  lead, v = logits_bv.shape[:-1], logits_bv.shape[-1]
  out = jax.ffi.ffi_call(cpu_kernels.ARGMAX_TARGET,
                         jax.ShapeDtypeStruct((logits_bv.size // v,), jnp.int32))(
                             logits_bv.reshape(-1, v))
  return out.reshape(lead)


def argmax(logits_bv: jax.Array) -> jax.Array:
  """`argmax_reference`, by the CPU kernel (`jaxtier/kernels/cpu/argmax_cpu.cc`) for float32 logits
  lowered for CPU, where XLA's max and masked min are two passes over the logits and the kernel one.
  The kernel gives v - 1 for any row holding a NaN. A process whose backend is not a CPU never
  builds the kernels here."""
  if (logits_bv.dtype != jnp.float32 or not logits_bv.size or logits_bv.ndim < 1
      or jax.default_backend() != "cpu" or not cpu_kernels.available()):
    return argmax_reference(logits_bv)
  return cpu_kernels.cpu_or_reference(logits_bv, cpu=_kernel_argmax, default=argmax_reference)


def sample(logits_bv: jax.Array, s: SamplingArrays, portable: bool = False) -> jax.Array:
  """Next token per row [b] int32: argmax where temperature is 0, else top-k/top-p sampling.
  `portable`: the argmax an accelerator runs (`argmax_reference`), never the CPU kernel."""
  greedy_b = argmax_reference(logits_bv) if portable else argmax(logits_bv)

  def stochastic():
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(
        s.seed_b, s.step_b)
    drawn_b = jax.vmap(_sample_row)(logits_bv, s.temperature_b, s.top_k_b, s.top_p_b, s.min_p_b,
                                    keys)
    return jnp.where(s.temperature_b > 0, drawn_b.astype(jnp.int32), greedy_b)

  return jax.lax.cond(jnp.any(s.temperature_b > 0), stochastic, lambda: greedy_b)


def sample_transformed(logits_bv: jax.Array, s: SamplingArrays, t: LogitsArrays,
                       portable: bool = False) -> jax.Array:
  """`sample` after `transform_logits`: the sampler of batches where a row transforms logits."""
  return sample(transform_logits(logits_bv, t), s, portable)


def processed_logprobs(logits_bv: jax.Array, tokens_b: jax.Array, s: SamplingArrays,
                       t: LogitsArrays | None = None) -> jax.Array:
  """Each row's token's log-probability [b] float32 under the distribution `sample` (or, with
  `t`, `sample_transformed`) draws it from: vLLM's "processed_logprobs", after the logit
  transforms, temperature and the top-k / top-p / min-p cut; 0 for a greedy row, whose
  distribution is its argmax alone."""
  logits_bv = logits_bv if t is None else transform_logits(logits_bv, t)
  lp_b = jax.vmap(_processed_row)(logits_bv, tokens_b, s.temperature_b, s.top_k_b, s.top_p_b,
                                  s.min_p_b)
  return jnp.where(s.temperature_b > 0, lp_b, 0.0)
