"""Paged KV cache benchmark: attention time, swap bandwidth, bytes per block, as one JSON object.

- attention: decode (and one prefill chunk) over a paged pool, the paged XLA path and the paged
  reference against `dense_attention` on the same tokens stored contiguously; medians after warm-up.
- swap: swap-out and swap-in of 1, 8 and 64 blocks as bandwidth, and as a ratio to a plain numpy
  memcpy of the same bytes measured in the same run.
- bytes_per_block for each kv_cache_dtype.
Shapes default to SmolLM2-135M (30 layers, 9 query heads, 3 kv heads, head_dim 64, blocks of 16).

  python scripts/bench_kvcache.py --repeats=20
"""

import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxtier.kvcache import (HostTier, PagedCacheConfig, PagedKVCache, dense_attention,
                             paged_attention, paged_attention_reference, swap_in, swap_out)

import benchlib

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_layers", 30, "layers in the cache")
flags.DEFINE_integer("num_heads", 9, "query heads")
flags.DEFINE_integer("num_kv_heads", 3, "kv heads")
flags.DEFINE_integer("head_dim", 64, "head dim")
flags.DEFINE_integer("block_size", 16, "tokens per block")
flags.DEFINE_integer("repeats", 15, "timed repeats per point (median reported)")
flags.DEFINE_list("attention_points", ["1x512", "8x512", "8x2048", "32x1024"],
                  "batch x context length points for decode attention")
flags.DEFINE_list("swap_blocks", ["1", "8", "64"], "block counts per swap")


def median_seconds(fn, repeats: int) -> float:
  """Median wall time of `fn()` (which must block) after one warm-up call."""
  return statistics.median(benchlib.timed_calls(fn, repeats))


def attention_point(rng, batch: int, length: int, new_tokens: int) -> dict:
  n, kv, d, c = FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim, FLAGS.block_size
  m = -(-length // c)
  pages = batch * m
  k_kfcd = jnp.asarray(rng.normal(size=(kv, pages, c, d)), jnp.float32)
  v_kfcd = jnp.asarray(rng.normal(size=(kv, pages, c, d)), jnp.float32)
  table_bm = jnp.asarray(rng.permutation(pages).reshape(batch, m), jnp.int32)
  q_btnd = jnp.asarray(rng.normal(size=(batch, new_tokens, n, d)), jnp.float32)
  pos_bt = jnp.asarray(np.arange(length - new_tokens, length)[None].repeat(batch, 0), jnp.int32)
  k_bskd = jnp.moveaxis(k_kfcd[:, table_bm].reshape(kv, batch, m * c, d), 0, 2)
  v_bskd = jnp.moveaxis(v_kfcd[:, table_bm].reshape(kv, batch, m * c, d), 0, 2)
  dense = jax.jit(dense_attention)
  fns = {
      "dense": lambda: dense(q_btnd, k_bskd, v_bskd, pos_bt).block_until_ready(),
      "paged": lambda: paged_attention(
          q_btnd, k_kfcd, v_kfcd, table_bm, pos_bt).block_until_ready(),
      "paged_reference": lambda: paged_attention_reference(
          q_btnd, k_kfcd, v_kfcd, table_bm, pos_bt).block_until_ready(),
  }
  ms = {name: median_seconds(fn, FLAGS.repeats) * 1e3 for name, fn in fns.items()}
  return {"batch": batch, "context": length, "new_tokens": new_tokens,
          **{f"{name}_ms": round(t, 4) for name, t in ms.items()},
          "paged_over_dense": round(ms["paged"] / ms["dense"], 3),
          "reference_over_paged": round(ms["paged_reference"] / ms["paged"], 3)}


def memcpy_gbps(num_bytes: int) -> float:
  src = np.ones(num_bytes, np.uint8)
  dst = np.empty_like(src)
  return num_bytes / median_seconds(lambda: np.copyto(dst, src), max(FLAGS.repeats, 50)) / 1e9


def cache_config(dtype: str, num_device_blocks: int, num_host_blocks: int) -> PagedCacheConfig:
  """A cache of the flags' shape; the attention path is not used here."""
  return PagedCacheConfig(FLAGS.num_layers, FLAGS.num_kv_heads, FLAGS.head_dim, num_device_blocks,
                          FLAGS.block_size, num_host_blocks, dtype, "xla")


def swap_points(dtype: str) -> list[dict]:
  blocks = [int(b) for b in FLAGS.swap_blocks]
  pool = 2 * max(blocks)
  config = cache_config(dtype, pool, pool)
  cache, host = PagedKVCache.create(config), HostTier.empty(pool)
  rng = np.random.default_rng(0)
  rows = []
  for n in blocks:
    memcpy = memcpy_gbps(n * config.bytes_per_block)
    reports = {"out": [], "in": []}
    for _ in range(FLAGS.repeats + 1):
      written = rng.choice(pool, n, replace=False)
      host, out = swap_out(cache, host, rng.choice(pool, n, replace=False), written)
      cache, back = swap_in(cache, host, rng.permutation(written),
                            rng.choice(pool, n, replace=False))
      reports["out"].append(out)
      reports["in"].append(back)
    for direction, rs in reports.items():
      seconds = statistics.median(r.seconds for r in rs[1:])
      gbps = rs[0].bytes / seconds / 1e9
      rows.append({"dtype": dtype, "direction": direction, "blocks": n,
                   "bytes": rs[0].bytes, "median_ms": round(seconds * 1e3, 4),
                   "gbps": round(gbps, 3), "memcpy_gbps": round(memcpy, 3),
                   "ratio_to_memcpy": round(gbps / memcpy, 3),
                   "compile_s": round(rs[0].compile_seconds, 3)})
  return rows


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  points = [tuple(int(x) for x in p.split("x")) for p in FLAGS.attention_points]
  attention = [attention_point(rng, b, length, 1) for b, length in points]
  attention.append(attention_point(rng, 1, 1024, 128))
  dtypes = ("float32", "bfloat16", "int8")
  bytes_per_block = {dtype: cache_config(dtype, 1, 0).bytes_per_block for dtype in dtypes}
  result = {
      "backend": jax.default_backend(), "jax": jax.__version__,
      "shape": {"layers": FLAGS.num_layers, "heads": FLAGS.num_heads,
                "kv_heads": FLAGS.num_kv_heads, "head_dim": FLAGS.head_dim,
                "block_size": FLAGS.block_size},
      "bytes_per_block": bytes_per_block,
      "int8_over_bfloat16_bytes": round(bytes_per_block["int8"] / bytes_per_block["bfloat16"], 4),
      "attention": attention,
      "swap": [row for dtype in dtypes for row in swap_points(dtype)],
  }
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)
