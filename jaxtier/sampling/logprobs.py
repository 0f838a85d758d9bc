"""Log-probabilities of tokens (vLLM's `Logprob` and its dictionaries), and the device function
that computes them from raw model logits.

Values are `log_softmax` of the model's logits in float32, before temperature, top-k or top-p (what
vLLM returns by default). A position's entry is a dict token id -> `Logprob`: the token that was
sampled (or, for a prompt position, the prompt token) and the `k` most likely tokens.

Shape legend: n positions, v vocab, k top tokens.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20  # the most top tokens a request may ask for (OpenAI's top_logprobs limit)

# One position's entry: token id -> its log-probability, rank and text.
LogprobDict = dict[int, "Logprob"]


@dataclasses.dataclass(frozen=True)
class Logprob:
  """One token's log-probability at one position.

  Attributes:
    logprob: log_softmax of the raw logits at the token.
    rank: 1-based rank of the token in the whole distribution (1 = most likely). A top token's
      rank is its place in the top list; the sampled (or prompt) token's is the number of tokens
      whose logit is at least its own, as vLLM counts it.
    decoded_token: the token decoded on its own (special tokens kept), or None.
  """
  logprob: float
  rank: int | None = None
  decoded_token: str | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TopLogprobs:
  """Log-probabilities at some positions (leading axes `...`, on device or read to numpy)."""
  token_lp: jax.Array  # [...] float32, the given token's log-probability
  token_rank: jax.Array  # [...] int32, its 1-based rank
  top_lp_k: jax.Array  # [..., k] float32, the k largest log-probabilities, descending
  top_ids_k: jax.Array  # [..., k] int32, their token ids


def top_logprobs(logits_nv: jax.Array, tokens_n: jax.Array, k: int) -> TopLogprobs:
  """log_softmax of `logits_nv` at `tokens_n` (with its rank) and at the `k` best tokens."""
  logits_nv = logits_nv.astype(jnp.float32)
  lse_n = jax.nn.logsumexp(logits_nv, axis=-1)
  token_logit_n = jnp.take_along_axis(logits_nv, tokens_n[:, None], axis=-1)[:, 0]
  rank_n = jnp.sum(logits_nv >= token_logit_n[:, None], axis=-1, dtype=jnp.int32)
  top_nk, ids_nk = jax.lax.top_k(logits_nv, k)
  return TopLogprobs(token_logit_n - lse_n, rank_n, top_nk - lse_n[:, None],
                     ids_nk.astype(jnp.int32))


def entry(top: TopLogprobs, index, token: int, k: int, decode: Callable[[int], str]) -> LogprobDict:
  """The dict of one position of `top` (numpy arrays) at `index`: `token` first, then the `k`
  best tokens (a top token's rank wins when `token` is among them, as in vLLM)."""
  out = {token: Logprob(float(top.token_lp[index]), int(top.token_rank[index]), decode(token))}
  lps, ids = np.asarray(top.top_lp_k[index])[:k], np.asarray(top.top_ids_k[index])[:k]
  for rank, (lp, token_id) in enumerate(zip(lps.tolist(), ids.tolist()), 1):
    out[token_id] = Logprob(lp, rank, decode(token_id))
  return out
