"""The XLA path on accelerators (`attention_impl="xla"` on a GPU or TPU, or "xla_gathered"
anywhere): one batched gather of every row's table pages (whole blocks, kv-head major, the pool's
order) and one masked float32 softmax, INT8 scales folded in. A few large ops instead of a loop:
the portable reference there, and the path of the layers and shapes the kernels do not serve.

Shape legend: see `jaxtier.attention`.
"""

import functools

import jax
import jax.numpy as jnp

from jaxtier.attention.online_softmax import (attend_rows, chunk_step, chunked_tables,
                                              empty_carry, kv_major_queries, normalized,
                                              token_major_output)
from jaxtier.attention.reference import check_paged_inputs

GATHER_SLOTS = 4096  # widest table the gathered path attends in one step; wider ones in chunks


@functools.partial(jax.jit, static_argnames=("gather_slots",))
def paged_attention_gathered(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt,
                             k_scales_kfc=None, v_scales_kfc=None, window=None, cap=None,
                             gather_slots: int = GATHER_SLOTS) -> jax.Array:
  """Paged attention, the XLA path on accelerators: one gather and one masked softmax.

  Each row's table pages are gathered at once, whole blocks in the pool's kv-head-major order
  ([k, b, m * c, d]), and every query row attends to all of its row's slots under a mask (slots
  after its position, or before its sliding `window`, are hidden); scores and probabilities are
  float32, soft-capped at `cap` where given, with INT8 scales folded into them instead of
  dequantizing K and V. A handful of large ops whatever the context, where `paged_attention`
  loops over chunks and row groups. Output [b, t, n, d].

  Tables wider than `gather_slots` slots run in key chunks of that many instead (the same
  online softmax as the CPU loop's steps, for all rows at once, up to the last chunk a query
  sees): a few large steps, so the gathered keys and the scores stay bounded at long contexts.
  """
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  kv, f, c, _ = k_pages_kfcd.shape
  s = pages_bm.shape[1] * c
  q_kbqd = kv_major_queries(q_btnd, kv)
  pages_bm = jnp.clip(pages_bm, 0, f - 1)
  pages = (k_pages_kfcd, v_pages_kfcd, k_scales_kfc, v_scales_kfc)
  if s > gather_slots:
    tables_xbm, per_chunk = chunked_tables(pages_bm, c, gather_slots)
    return token_major_output(attend_rows(q_kbqd, pos_bt, tables_xbm, pages, s,
                                          per_chunk * c, window, cap), q_btnd)

  # the whole table as one chunk: one online-softmax step from the empty carry is the softmax
  (_, sum_kbq, out_kbqd), _ = chunk_step(q_kbqd, pos_bt, pages, s, window, cap,
                                         empty_carry(q_kbqd), (pages_bm, 0))
  return token_major_output(normalized(out_kbqd, sum_kbq), q_btnd)
