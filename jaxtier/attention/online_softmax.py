"""The online softmax the XLA paths share: kv-head-major queries, tables cut into key chunks, one
softmax step over a chunk, and the loop over a group of rows' chunks.

Everything is kv-head major ([k, b, ...], q rows `q` = t * g per kv head, t major), the order a
gather of the pool yields, so neither dot transposes what it gathered; INT8 scales are folded into
the scores and probabilities instead of dequantizing K and V.

Shape legend: b batch, t query tokens, n query heads, k kv heads, g = n // k, d head dim, f flat
pages, c block size, m blocks per sequence, s key slots of one chunk, x chunks, q query rows per
kv head (t * g, t major).
"""

import functools

import jax
import jax.numpy as jnp

from jaxtier.attention.dense import in_window
from jaxtier.attention.page_format import decode
from jaxtier.model.softcap import softcap


def kv_major_queries(q_btnd, kv: int) -> jax.Array:
  """Queries scaled by 1 / sqrt(d), kv-head major: [k, b, q = t * g, d] (t major)."""
  b, t, n, d = q_btnd.shape
  q_btkgd = q_btnd.reshape(b, t, kv, n // kv, d) * jnp.asarray(d ** -0.5, q_btnd.dtype)
  return jnp.transpose(q_btkgd, (2, 0, 1, 3, 4)).reshape(kv, b, t * (n // kv), d)


def token_major_output(out_kbqd, q_btnd) -> jax.Array:
  """[k, b, t * g, d] -> [b, t, n, d] in the queries' dtype."""
  b, t, n, d = q_btnd.shape
  kv = out_kbqd.shape[0]
  out_btkgd = jnp.transpose(out_kbqd.reshape(kv, b, t, n // kv, d), (1, 2, 0, 3, 4))
  return out_btkgd.reshape(b, t, n, d).astype(q_btnd.dtype)



def chunked_tables(pages_bm: jax.Array, block_size: int, chunk_slots: int
                   ) -> tuple[jax.Array, int]:
  """Tables [chunks, b, blocks per chunk] of about `chunk_slots` slots a chunk, padded with page
  0 (masked by slot position)."""
  b, m = pages_bm.shape
  per_chunk = max(1, min(m, chunk_slots // block_size))
  padded = -(-m // per_chunk) * per_chunk
  pages_bm = jnp.pad(pages_bm, ((0, 0), (0, padded - m)))
  return jnp.moveaxis(pages_bm.reshape(b, padded // per_chunk, per_chunk), 1, 0), per_chunk


def chunk_step(q_kbqd, pos_bt, pages, num_slots: int, window, cap, carry, xs):
  """One online-softmax step over a chunk of s slots of every sequence.

  Everything is kv-head major ([k, b, ...], q rows `q` = t * g per kv head, t major), the order
  the pool's gather yields, so neither dot needs a transposed copy of the gathered keys or
  values. `pages` is (k, v, k_scales, v_scales); carry is (running max, running sum,
  unnormalized output).
  """
  k_kfcd, v_kfcd, k_scales_kfc, v_scales_kfc = pages
  max_kbq, sum_kbq, out_kbqd = carry
  table_bm, first_slot = xs
  b, blocks = table_bm.shape
  kv, s = k_kfcd.shape[0], blocks * k_kfcd.shape[2]
  t = pos_bt.shape[1]

  def gather_kbs(pages_kf):
    return decode(pages_kf[:, table_bm]).reshape((kv, b, s) + pages_kf.shape[3:])

  scores_kbqs = jnp.einsum("kbqd,kbsd->kbqs", q_kbqd, gather_kbs(k_kfcd).astype(q_kbqd.dtype),
                           preferred_element_type=jnp.float32)
  if k_scales_kfc is not None:
    scores_kbqs *= gather_kbs(k_scales_kfc)[:, :, None]
  scores_kbqs = softcap(scores_kbqs, cap)
  slot_s = first_slot + jnp.arange(s)
  visible_bts = in_window(slot_s, pos_bt[:, :, None], window) & (slot_s < num_slots)
  visible_bqs = jnp.repeat(visible_bts, q_kbqd.shape[2] // t, axis=1)  # q = t * g, t major
  scores_kbqs = jnp.where(visible_bqs[None], scores_kbqs, -jnp.inf)
  new_max_kbq = jnp.maximum(max_kbq, scores_kbqs.max(-1))
  shift_kbq = jnp.where(jnp.isfinite(new_max_kbq), new_max_kbq, 0.0)
  probs_kbqs = jnp.exp(scores_kbqs - shift_kbq[..., None])
  rescale_kbq = jnp.exp(max_kbq - shift_kbq)
  weights_kbqs, v_kbsd = probs_kbqs, gather_kbs(v_kfcd)
  if v_scales_kfc is not None:
    weights_kbqs = probs_kbqs * gather_kbs(v_scales_kfc)[:, :, None]
    v_kbsd = v_kbsd.astype(jnp.float32)
  out_kbqd = out_kbqd * rescale_kbq[..., None] + jnp.einsum(
      "kbqs,kbsd->kbqd", weights_kbqs.astype(v_kbsd.dtype), v_kbsd,
      preferred_element_type=jnp.float32)
  return (new_max_kbq, sum_kbq * rescale_kbq + probs_kbqs.sum(-1), out_kbqd), None


def attend_rows(q_kbqd, pos_bt, tables_xbm, pages, num_slots: int, chunk_slots: int,
                window=None, cap=None):
  """The online-softmax loop over chunks for one group of rows; normalized output [k, b, q, d].

  Only the chunks that hold a slot visible to some query of the group run: up to the last
  position's chunk, and under a sliding window from the chunk of the earliest query's first
  visible slot."""
  step = functools.partial(chunk_step, q_kbqd, pos_bt, pages, num_slots, window, cap)
  init = empty_carry(q_kbqd)
  live = jnp.clip((jnp.max(pos_bt) + chunk_slots) // chunk_slots, 0, tables_xbm.shape[0])
  first = 0
  if window is not None:
    earliest = jnp.min(jnp.where(pos_bt >= 0, pos_bt, jnp.iinfo(jnp.int32).max))
    first = jnp.clip((earliest - window + 1) // chunk_slots, 0, live)

  def body(i, carry):
    table_bm = jax.lax.dynamic_index_in_dim(tables_xbm, i, keepdims=False)
    return step(carry, (table_bm, i * chunk_slots))[0]

  _, sum_kbq, out_kbqd = jax.lax.fori_loop(first, live, body, init)
  return normalized(out_kbqd, sum_kbq)


def empty_carry(q_kbqd):
  """The online softmax's carry before any slot: (running max, running sum, output)."""
  kv, b, q, d = q_kbqd.shape
  return jnp.full((kv, b, q), -jnp.inf), jnp.zeros((kv, b, q)), jnp.zeros((kv, b, q, d))


def normalized(out_kbqd, sum_kbq):
  """The output divided by its softmax sum (rows that saw no slot stay 0)."""
  return out_kbqd / jnp.where(sum_kbq > 0, sum_kbq, 1.0)[..., None]
