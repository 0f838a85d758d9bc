"""KV cache sizes: the one place that says how many bytes a token and a block of KV take.

Every consumer (the paged cache's pools and swaps, the scheduler's byte budgets, the offload
planner's KV reservation, the engine's pool sizing and `memory_report()`) asks here, so int8 scales
are counted everywhere or nowhere. No JAX import: the scheduler uses it too.
"""

from jaxtier.common.checks import check_choice
from jaxtier.common.choices import DTYPE_BYTES

# Bytes of one stored element per `kv_cache_dtype` name (the model dtypes and int8), and of the
# per-token, per-kv-head scale that int8 values carry (float32, see
# `jaxtier.attention.page_format`).
ELEMENT_BYTES = {**DTYPE_BYTES, "int8": 1}
SCALE_BYTES = {name: 4 if name == "int8" else 0 for name in ELEMENT_BYTES}


def check_kv_cache_dtype(kv_cache_dtype) -> None:
  """Raises ValueError unless `kv_cache_dtype` is a name of ELEMENT_BYTES ("auto" is resolved
  before: `jaxtier.engine.sizing`)."""
  check_choice("kv_cache_dtype", kv_cache_dtype, tuple(ELEMENT_BYTES))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       kv_cache_dtype: str) -> int:
  """Bytes of K and V of one token over all layers, int8 scales included:
  2 x layers x kv_heads x (head_dim x element bytes + scale bytes)."""
  for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r}: expected an int >= 1")
  check_kv_cache_dtype(kv_cache_dtype)
  per_head = head_dim * ELEMENT_BYTES[kv_cache_dtype] + SCALE_BYTES[kv_cache_dtype]
  return 2 * num_layers * num_kv_heads * per_head


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                   block_size: int) -> int:
  """Bytes of one block of `block_size` tokens over all layers: what one swapped block moves."""
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"block_size={block_size!r}: expected an int >= 1")
  return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_cache_dtype) * block_size
