"""JAX's Pallas TPU decode kernel (`jax.experimental.pallas.ops.tpu.paged_attention`), which reads
`k_pages` in this pool's own layout: decode steps of float pools only, where `tpu_kernel_fits` (its
scales must be head_dim-wide, a copy 4x the int8 pool per call, so int8 pools take the gathered
path), with `cap` but no window. `interpret=True` runs it on CPU in Pallas' TPU interpret mode.

JAX's `ragged_paged_attention` is not used: it takes one page-major pool with K and V interleaved
per head ([pages, block_size, 2 * kv_heads, head_dim]) and one scale per tensor, which this pool
([kv_heads, pages, ...], K and V apart, a scale per token) becomes only by a copy of the whole pool
per step.

Shape legend: see `jaxtier.attention`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import paged_attention as tpu_paged

from jaxtier.attention.page_format import decode
from jaxtier.attention.reference import check_paged_inputs

TPU_LANES = 128  # head_dim must be a multiple of the TPU's vector lanes
TPU_SUBLANES = 16  # block_size must be a multiple of a bfloat16 tile's rows
TPU_COMPUTE_SLOTS = 512  # most key slots per step of the TPU kernel (pages per compute block)


def tpu_kernel_fits(t: int, head_dim: int, block_size: int, quantized: bool) -> bool:
  """Whether `paged_attention_tpu` serves a call: decode steps (t == 1) of a float pool whose
  head_dim is a multiple of TPU_LANES and block size of TPU_SUBLANES (Mosaic's (16, 128)
  bfloat16 tiles of its page buffers; a bound kept conservative, untried on other shapes)."""
  return (t == 1 and not quantized and head_dim % TPU_LANES == 0
          and block_size % TPU_SUBLANES == 0)


def _largest_divisor_at_most(value: int, limit: int) -> int:
  return max(i for i in range(1, min(value, limit) + 1) if value % i == 0)


@functools.partial(jax.jit, static_argnames=("cap", "interpret"))
def paged_attention_tpu(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc=None,
                        v_scales_kfc=None, cap: float | None = None, *, interpret: bool = False
                        ) -> jax.Array:
  """Decode-step paged attention (t == 1) with JAX's Pallas TPU kernel; output [b, 1, n, d].

  The kernel reads the pool in place (its `k_pages` layout is the pool's) in compute blocks of
  up to TPU_COMPUTE_SLOTS slots (a divisor of the table width), upcasting K and V to bfloat16
  (float32 pools lose precision there; the cache stores bfloat16 on TPU); `cap` soft-caps the
  scores. Raises ValueError for a call `tpu_kernel_fits` rejects, but with interpret=True (Pallas'
  TPU interpret mode on CPU) only for t != 1 and int8 pages.
  """
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  b, t, n, d = q_btnd.shape
  kv, f, c, _ = k_pages_kfcd.shape
  quantized = k_scales_kfc is not None
  if t != 1 or quantized or not (interpret or tpu_kernel_fits(t, d, c, quantized)):
    raise ValueError(f"the TPU kernel serves decode steps of float pools with head_dim a "
                     f"multiple of {TPU_LANES} and block_size of {TPU_SUBLANES}; got {t=} "
                     f"tokens, {d=}, {c=}, pages {k_pages_kfcd.dtype}")
  m = pages_bm.shape[1]
  q_bnd = q_btnd[:, 0] * jnp.asarray(d ** -0.5, q_btnd.dtype)  # the kernel does not scale
  call = functools.partial(
      tpu_paged.paged_attention, q_bnd, decode(k_pages_kfcd), decode(v_pages_kfcd),
      jnp.maximum(pos_bt[:, 0] + 1, 0), jnp.clip(pages_bm, 0, f - 1),
      attn_logits_soft_cap=cap,
      pages_per_compute_block=_largest_divisor_at_most(m, max(1, TPU_COMPUTE_SLOTS // c)))
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      out_bnd = call()
  else:
    out_bnd = call()
  # rows of length 0 (padding) are skipped by the kernel: their output is never written
  return jnp.where(pos_bt[:, 0, None, None] >= 0, out_bnd, 0).astype(q_btnd.dtype)[:, None]
