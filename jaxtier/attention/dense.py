"""Dense causal attention with grouped-query heads: the reference every cache layout is checked against.

Shape legend: b batch, t query tokens, s key slots, n query heads, k kv heads, g = n // k query heads
per kv head, d head dim.
"""

import jax
import jax.numpy as jnp

from jaxtier.model.softcap import softcap


def dense_attention(q_btnd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                    q_pos_bt: jax.Array, window: jax.Array | int | None = None,
                    cap: float | None = None) -> jax.Array:
  """Causal GQA attention where key slot s holds the token at position s.

  A query at position p sees key slots 0..p, or with a sliding `window` W (a positive int, may be
  traced; None: no window) the last W of them, p - W + 1..p. Scores (q.k / sqrt(d)) are
  soft-capped to cap * tanh(score / cap) where `cap` is given. Queries with a negative position
  are padding; their output is zero. Softmax runs in float32 whatever the input dtype.
  """
  b, t, n, d = q_btnd.shape
  kv_heads = k_bskd.shape[2]
  assert n % kv_heads == 0, f"{n=} query heads must be a multiple of {kv_heads=}"
  q_btkgd = q_btnd.reshape(b, t, kv_heads, n // kv_heads, d)
  scores_bkgts = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd,
                            preferred_element_type=jnp.float32) * (d ** -0.5)
  scores_bkgts = softcap(scores_bkgts, cap)
  s = k_bskd.shape[1]
  visible_bts = in_window(jnp.arange(s)[None, None, :], q_pos_bt[:, :, None], window)
  scores_bkgts = jnp.where(visible_bts[:, None, None], scores_bkgts, -jnp.inf)
  probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1)
  probs_bkgts = jnp.where(visible_bts[:, None, None], probs_bkgts, 0.0)
  out_btkgd = jnp.einsum("bkgts,bskd->btkgd", probs_bkgts.astype(v_bskd.dtype), v_bskd,
                         preferred_element_type=jnp.float32)
  return out_btkgd.reshape(b, t, n, d).astype(q_btnd.dtype)


def in_window(slot, pos, window):
  """Whether key slot `slot` is visible to a query at `pos` (broadcast): slot <= pos, and
  slot > pos - window under a sliding `window` (None: every earlier slot)."""
  visible = slot <= pos
  if window is None:
    return visible
  return visible & (slot > pos - window)
