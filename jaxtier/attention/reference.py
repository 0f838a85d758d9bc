"""The reference paged attention: every sequence gathered token by token into a dense array, then
`dense_attention`. Obviously right (a token-granular gather plus a transpose); every other path is
tested against it. `check_paged_inputs` is the argument check every path shares.

Shape legend: see `jaxtier.attention`.
"""

import jax
import jax.numpy as jnp

from jaxtier.attention.dense import dense_attention
from jaxtier.attention.page_format import SCALE_DTYPE, decode, dequantize_int8


def check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                       v_scales_kfc) -> None:
  """Raises ValueError, naming the values, unless the arguments fit together."""
  b, t, n, d = q_btnd.shape
  kv, f, c, dk = k_pages_kfcd.shape
  if v_pages_kfcd.shape != k_pages_kfcd.shape or v_pages_kfcd.dtype != k_pages_kfcd.dtype:
    raise ValueError(f"v pages {v_pages_kfcd.shape} {v_pages_kfcd.dtype} must match k pages "
                     f"{k_pages_kfcd.shape} {k_pages_kfcd.dtype}")
  if dk != d or n % kv:
    raise ValueError(f"q {q_btnd.shape=} needs head_dim {dk} and a multiple of {kv} kv heads")
  if pages_bm.ndim != 2 or pages_bm.shape[0] != b or pages_bm.dtype != jnp.int32:
    raise ValueError(f"{pages_bm.shape=} {pages_bm.dtype=} must be int32 [batch={b}, blocks]")
  if pos_bt.shape != (b, t) or pos_bt.dtype != jnp.int32:
    raise ValueError(f"{pos_bt.shape=} {pos_bt.dtype=} must be int32 [{b}, {t}]")
  quantized = k_pages_kfcd.dtype == jnp.int8
  for name, scales in (("k_scales", k_scales_kfc), ("v_scales", v_scales_kfc)):
    if quantized != (scales is not None):
      given = "given" if scales is not None else "missing"
      raise ValueError(f"{name} must be given exactly when pages are int8 "
                       f"(pages {k_pages_kfcd.dtype}, {name} {given})")
    if scales is not None and (scales.shape != (kv, f, c) or scales.dtype != SCALE_DTYPE):
      raise ValueError(f"{name} {scales.shape} {scales.dtype} must be {SCALE_DTYPE} {(kv, f, c)}")


@jax.jit
def paged_attention_reference(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt,
                              k_scales_kfc=None, v_scales_kfc=None, window=None, cap=None
                              ) -> jax.Array:
  """Paged attention by gathering each slot's token into a dense array; output [b, t, n, d]."""
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  c = k_pages_kfcd.shape[2]
  slot_s = jnp.arange(pages_bm.shape[1] * c)
  page_bs = jnp.clip(pages_bm[:, slot_s // c], 0, k_pages_kfcd.shape[1] - 1)
  offset_bs = jnp.broadcast_to(slot_s % c, page_bs.shape)

  def dense_bskd(pages_kfcd, scales_kfc):
    x_bskd = jnp.moveaxis(decode(pages_kfcd[:, page_bs, offset_bs]), 0, 2)
    if scales_kfc is None:
      return x_bskd.astype(q_btnd.dtype)
    return dequantize_int8(x_bskd, jnp.moveaxis(scales_kfc[:, page_bs, offset_bs], 0, 2),
                           q_btnd.dtype)

  return dense_attention(q_btnd, dense_bskd(k_pages_kfcd, k_scales_kfc),
                         dense_bskd(v_pages_kfcd, v_scales_kfc), pos_bt, window, cap)

