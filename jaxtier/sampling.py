"""Sampling parameters (the vLLM names) and a jitted sampler over a batch of logits.

Shape legend: b batch, v vocab.
"""

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier import cpu_kernels
from jaxtier.logprobs import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick tokens for one request. temperature=0 is greedy; top_k <= 0 means no top-k.

  `logprobs` (0 to MAX_LOGPROBS) returns, for every generated token, its log-probability and
  those of the `logprobs` most likely tokens; `prompt_logprobs` does the same for every prompt
  token after the first (given the tokens before it). Both are log_softmax of the raw logits
  (before temperature, top-k, top-p) and never change which tokens are sampled.
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

  def __post_init__(self):
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    object.__setattr__(self, "stop", tuple(self.stop or ()))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
    if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
    if not np.isfinite(self.temperature) or self.temperature < 0:
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.top_k, (int, np.integer)):
      raise ValueError(f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
    if self.seed is not None and not (isinstance(self.seed, (int, np.integer)) and 0 <= self.seed < 2**32):
      raise ValueError(f"seed must be an integer in [0, 2**32) or None, got {self.seed!r}")
    if any(not isinstance(s, str) or not s for s in self.stop):
      raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
    if any(not isinstance(t, (int, np.integer)) or t < 0 for t in self.stop_token_ids):
      raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
    for name in ("logprobs", "prompt_logprobs"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got "
                         f"{value!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
  """Per-row sampling parameters of a batch, as device arrays."""
  temperature_b: jax.Array  # [b] float32, 0 = greedy
  top_k_b: jax.Array  # [b] int32, <= 0 = all
  top_p_b: jax.Array  # [b] float32
  seed_b: jax.Array  # [b] uint32
  step_b: jax.Array  # [b] int32, tokens generated so far (folded into the key)

  @classmethod
  def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
                  steps: Sequence[int]) -> "SamplingArrays":
    return cls(np.array([p.temperature for p in params], np.float32),
               np.array([p.top_k for p in params], np.int32),
               np.array([p.top_p for p in params], np.float32),
               np.array(seeds, np.uint32), np.array(steps, np.int32))


def _sample_row(logits_v, temperature, top_k, top_p, key):
  scaled_v = logits_v.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  sorted_v, order_v = jax.lax.top_k(scaled_v, scaled_v.shape[-1])
  rank_v = jnp.arange(scaled_v.shape[-1])
  keep_v = (top_k <= 0) | (rank_v < top_k)
  probs_v = jax.nn.softmax(jnp.where(keep_v, sorted_v, -jnp.inf))
  keep_v &= (jnp.cumsum(probs_v) - probs_v) < top_p  # the smallest prefix whose mass reaches top_p
  choice = jax.random.categorical(key, jnp.where(keep_v, sorted_v, -jnp.inf))
  return order_v[choice]


def argmax_reference(logits_bv: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis (the first index of the maximum), as a max and a min;
  v - 1 for a row of NaNs (with some NaNs, whatever XLA's max makes of them: XLA:CPU's may skip
  them).

  XLA:CPU runs argmax as a variadic (value, index) reduction that does not vectorize: 1.9 ms for
  16 rows of a 49k vocabulary, against 0.5 ms for these two plain reductions.
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
  """`argmax_reference`, by the CPU kernel (`jaxtier/argmax_cpu.cc`) for float32 logits lowered
  for CPU: XLA:CPU's max and masked min took 2.5-3.3 ms for 32 rows of a 49k vocabulary. The
  kernel gives v - 1 for any row holding a NaN."""
  if (logits_bv.dtype != jnp.float32 or not logits_bv.size or logits_bv.ndim < 1
      or not cpu_kernels.available()):
    return argmax_reference(logits_bv)
  return jax.lax.platform_dependent(logits_bv, cpu=_kernel_argmax, default=argmax_reference)


def sample(logits_bv: jax.Array, s: SamplingArrays) -> jax.Array:
  """Next token per row [b] int32: argmax where temperature is 0, else top-k/top-p sampling."""
  greedy_b = argmax(logits_bv)

  def stochastic():
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(
        s.seed_b, s.step_b)
    drawn_b = jax.vmap(_sample_row)(logits_bv, s.temperature_b, s.top_k_b, s.top_p_b, keys)
    return jnp.where(s.temperature_b > 0, drawn_b.astype(jnp.int32), greedy_b)

  return jax.lax.cond(jnp.any(s.temperature_b > 0), stochastic, lambda: greedy_b)
