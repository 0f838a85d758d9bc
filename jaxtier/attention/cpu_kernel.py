"""Paged attention on CPU with C++ kernels called through the XLA FFI
(`jaxtier.kernels.cpu.library`; one for decode steps, one for prefill rows) that read each table's
pages in place: XLA:CPU's gathers copy every chunk first, and at long contexts those copies were
most of a decode step.

Shape legend: see `jaxtier.attention`.
"""

import jax
import jax.numpy as jnp

from jaxtier.attention.page_format import SCALE_DTYPE
from jaxtier.attention.reference import check_paged_inputs
from jaxtier.kernels.cpu import library as cpu_kernels


def paged_attention_cpu(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc=None,
                        v_scales_kfc=None) -> jax.Array:
  """Paged attention with the CPU kernels; output [b, t, n, d].

  The kernels (`jaxtier.kernels.cpu.library`) read each sequence's keys and values in place from the
  pool, so no gathered copy is made: the decode kernel for one query token per row, the prefill
  kernel for more (each row's queries in register tiles against its keys, transposed once per
  row and kv head). Raises RuntimeError where they cannot be built.
  """
  if not cpu_kernels.available():
    raise RuntimeError(f"the CPU attention kernel is unavailable: "
                       f"{cpu_kernels.unavailable_reason()}")
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  b, t, n, d = q_btnd.shape
  f = k_pages_kfcd.shape[1]
  if k_pages_kfcd.dtype == jnp.bfloat16:  # the kernels read bfloat16 as its uint16 bit patterns
    k_pages_kfcd, v_pages_kfcd = (jax.lax.bitcast_convert_type(x, jnp.uint16)
                                  for x in (k_pages_kfcd, v_pages_kfcd))
  q_btnd_scaled = q_btnd.astype(jnp.float32) * jnp.float32(d ** -0.5)
  no_scales = jnp.zeros((1,), SCALE_DTYPE)
  pages = (k_pages_kfcd, v_pages_kfcd, jnp.clip(pages_bm, 0, f - 1))
  scales = (no_scales if k_scales_kfc is None else k_scales_kfc,
            no_scales if v_scales_kfc is None else v_scales_kfc)
  if t == 1:
    out_bnd = jax.ffi.ffi_call(cpu_kernels.ATTENTION_TARGET,
                               jax.ShapeDtypeStruct((b, n, d), jnp.float32),
                               vmap_method="sequential")(
        q_btnd_scaled[:, 0], *pages, pos_bt[:, 0], *scales)
    return out_bnd[:, None].astype(q_btnd.dtype)
  out_btnd = jax.ffi.ffi_call(cpu_kernels.PREFILL_ATTENTION_TARGET,
                              jax.ShapeDtypeStruct((b, t, n, d), jnp.float32),
                              vmap_method="sequential")(q_btnd_scaled, *pages, pos_bt, *scales)
  return out_btnd.astype(q_btnd.dtype)
