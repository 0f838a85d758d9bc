"""KV cache sizes: the one place that says how many bytes a token and a block of KV take.

Every consumer (the paged cache's pools and swaps, the scheduler's byte budgets, the offload
planner's KV reservation, the engine's pool sizing and `memory_report()`) asks here, so int8 scales
are counted everywhere or nowhere. No JAX import: the scheduler uses it too.
"""

# Bytes of one stored element per `kv_cache_dtype` name, and of the per-token, per-kv-head scale
# that int8 values carry (float32, see `jaxtier.attention.page_format`).
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}
SCALE_BYTES = {"float32": 0, "bfloat16": 0, "int8": 4}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       kv_cache_dtype: str) -> int:
  """Bytes of K and V of one token over all layers, int8 scales included:
  2 x layers x kv_heads x (head_dim x element bytes + scale bytes)."""
  for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r}: expected an int >= 1")
  if kv_cache_dtype not in ELEMENT_BYTES:
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {sorted(ELEMENT_BYTES)}")
  per_head = head_dim * ELEMENT_BYTES[kv_cache_dtype] + SCALE_BYTES[kv_cache_dtype]
  return 2 * num_layers * num_kv_heads * per_head


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                   block_size: int) -> int:
  """Bytes of one block of `block_size` tokens over all layers: what one swapped block moves."""
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"block_size={block_size!r}: expected an int >= 1")
  return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_cache_dtype) * block_size
