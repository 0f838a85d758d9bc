"""What every layer shares, in the standard library only (no JAX):

- `checks`: the argument validators every layer raises through, and the offload bounds;
- `kv_bytes`: the bytes a token and a block of KV take (the one formula);
- `buckets`: the padded sizes that keep compiled program variants few;
- `cache_dirs`: where jaxtier keeps what it builds or downloads;
- `choices`: the fixed value sets of engine arguments owned by no lower module (model dtypes,
  quantizations).
"""
