"""KV cache storage dtypes, and INT8 quantization with one float32 scale per token and kv head.

Why per token and head rather than per block: a decode step writes one token into a partly filled
block. A per-block scale is only known once the block is full, so every write that raised the
block's maximum would have to requantize (read, rescale, rewrite) the tokens already there, turning
a scatter of the new tokens into a read-modify-write of whole blocks. A per-token scale makes every
write self-contained, keeps one outlier token from coarsening its neighbours, and is the layout the
Pallas paged attention kernels shipped with JAX take (`k_scales_pages [kv_heads, pages,
page_size]`). It costs 4 bytes per head_dim bytes: 6% at head_dim 64, so an int8 block is 0.53x a
bfloat16 block. The scale is float32 because bfloat16's rounding (0.4%) is as large as half the
int8 step itself (1/254 of the row maximum).

Shape legend: ... any leading dims, d head dim.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier.common.kv_bytes import ELEMENT_BYTES

KV_CACHE_DTYPES = {name: getattr(jnp, name) for name in ELEMENT_BYTES}  # name -> jnp dtype
INT8_MAX = 127
SCALE_DTYPE = jnp.float32


def storage_dtype(kv_cache_dtype: str, platform: str) -> np.dtype:
  """The dtype KV pools are stored in for a `kv_cache_dtype` name on a platform.

  On CPU bfloat16 is stored as its uint16 bit pattern: XLA:CPU runs data movement on bfloat16
  (scatter, dynamic-update-slice) through float32, converting the whole operand, which would copy
  the whole pool on every write and swap. uint16 moves the same bits natively, and only gathered
  blocks are viewed as bfloat16. Other platforms move bfloat16 natively and store it as is (the
  Pallas kernel needs bfloat16 pages, and a whole-pool bitcast would be a copy per layer).
  """
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f"{kv_cache_dtype=} must be one of {sorted(KV_CACHE_DTYPES)}")
  if kv_cache_dtype == "bfloat16" and platform == "cpu":
    return np.dtype(jnp.uint16)
  return np.dtype(KV_CACHE_DTYPES[kv_cache_dtype])


def encode(x: jax.Array, kv_cache_dtype: str, stored_dtype) -> jax.Array:
  """Values in their storage form for float32 or bfloat16 KV (int8 goes through quantize_int8)."""
  assert kv_cache_dtype != "int8", "int8 values need scales: use quantize_int8"
  x = x.astype(KV_CACHE_DTYPES[kv_cache_dtype])
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if stored_dtype == jnp.uint16 else x


def decode(stored: jax.Array) -> jax.Array:
  """Stored values as numbers: uint16 bit patterns become bfloat16; other dtypes are unchanged."""
  if stored.dtype == jnp.uint16:
    return jax.lax.bitcast_convert_type(stored, jnp.bfloat16)
  return stored


def quantize_int8(x_d: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Symmetric INT8 over the last axis: returns (values int8 [..., d], scales float32 [...]).

  `values * scales[..., None]` approximates `x`; an all-zero row gets scale 0 and decodes to zeros.
  """
  x32_d = x_d.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32_d), axis=-1) / INT8_MAX
  safe = jnp.where(scale > 0, scale, 1.0)
  values_d = jnp.clip(jnp.round(x32_d / safe[..., None]), -INT8_MAX, INT8_MAX)
  return values_d.astype(jnp.int8), scale.astype(SCALE_DTYPE)


def dequantize_int8(values_d: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Inverse of `quantize_int8`: values [..., d] times scales [...], in `dtype`."""
  return (values_d.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)
