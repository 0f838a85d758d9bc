"""The XLA path on CPU (`attention_impl="xla"` there), flash-decoding style: a loop over chunks of
the block tables with an online softmax, up to the last chunk a query can see.

Each step gathers whole blocks (contiguous block_size x head_dim runs per kv head) of ~CHUNK_SLOTS
slots, so no dense copy of the context is materialized. Rows are sorted by length and run in small
groups, each to its own longest context. On CPU it runs 2-4x faster than one big gather (and than
`dense_attention`) at long contexts; on an accelerator its hundreds of small sequential steps run
launch-bound, so accelerators take `xla_gathered` instead.

Shape legend: see `jaxtier.attention`.
"""

import jax
import jax.numpy as jnp

from jaxtier.attention.online_softmax import (attend_rows, chunked_tables, kv_major_queries,
                                              token_major_output)
from jaxtier.attention.reference import check_paged_inputs

CHUNK_SLOTS = 128  # key slots per step of the chunked path's scan
ROW_GROUP = 16  # most rows of one group of the chunked path's loop
GROUP_QUERIES = 256  # most query tokens of one group: a chunk step's scores stay in cache


def _row_group(t: int) -> int:
  """Rows per group of the chunked path for t query tokens per row."""
  return max(1, min(ROW_GROUP, GROUP_QUERIES // t))


@jax.jit
def paged_attention(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc=None,
                    v_scales_kfc=None, window=None, cap=None) -> jax.Array:
  """Paged attention, the XLA path on CPU: an online-softmax loop over chunks of each table.

  Rows run in groups of `_row_group(t)` (ROW_GROUP rows for decode, fewer for longer rows, so
  one step's scores stay in cache). Each step gathers ~CHUNK_SLOTS slots of a group's sequences
  in the pool's own layout, kv-head major, so no dense copy of the context is materialized and
  neither dot transposes what it gathered; INT8 scales are folded into the scores and
  probabilities. Batches of more than one group are sorted by their last position first, and
  each group's loop stops after the last chunk one of its queries can see: cost follows each
  group's longest sequence, not the batch's, and a table padded to a wider bucket costs nothing
  extra. With a sliding `window`, slots before a query's window are masked and the chunks before
  a group's earliest window are skipped; with `cap`, scores are soft-capped. Output [b, t, n, d].
  """
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  b, t, n, d = q_btnd.shape
  kv, f, c, _ = k_pages_kfcd.shape
  g = n // kv
  q_kbqd = kv_major_queries(q_btnd, kv)
  pages = (k_pages_kfcd, v_pages_kfcd, k_scales_kfc, v_scales_kfc)
  num_slots = pages_bm.shape[1] * c
  pages_bm = jnp.clip(pages_bm, 0, f - 1)
  group = _row_group(t)
  if b <= group:
    tables_xbm, per_chunk = chunked_tables(pages_bm, c, CHUNK_SLOTS)
    out_kbqd = attend_rows(q_kbqd, pos_bt, tables_xbm, pages, num_slots, per_chunk * c, window,
                           cap)
  else:
    groups = -(-b // group)
    rows = groups * group  # padding rows: position -1, sorted last
    pad = lambda x, axis, value=0: jnp.pad(
        x, [(0, rows - b) if i == axis else (0, 0) for i in range(x.ndim)], constant_values=value)
    pos_bt = pad(pos_bt, 0, -1)
    order = jnp.argsort(-jnp.max(pos_bt, axis=1))
    q_gkbqd = jnp.moveaxis(pad(q_kbqd, 1)[:, order].reshape(kv, groups, group, t * g, d), 1, 0)
    pos_gbt = pos_bt[order].reshape(groups, group, t)
    tables_xbm, per_chunk = chunked_tables(pad(pages_bm, 0)[order], c, CHUNK_SLOTS)
    tables_gxbm = jnp.moveaxis(
        tables_xbm.reshape(tables_xbm.shape[0], groups, group, per_chunk), 1, 0)
    out_gkbqd = jax.lax.map(
        lambda xs: attend_rows(*xs, pages, num_slots, per_chunk * c, window, cap),
        (q_gkbqd, pos_gbt, tables_gxbm))
    out_kbqd = jnp.zeros((kv, rows, t * g, d), out_gkbqd.dtype).at[:, order].set(
        jnp.moveaxis(out_gkbqd, 0, 1).reshape(kv, rows, t * g, d))[:, :b]
  return token_major_output(out_kbqd, q_btnd)
