"""Measured inputs of the planner: host -> device link bandwidth and one layer's compute time.

Both are medians over repeats after a warm-up. On CPU the "link" is a memcpy between two views of
one memory and the layer runs on the CPU: the numbers are real but say nothing about a GPU.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtier.kvcache import ContiguousKVCache
from jaxtier.model import Transformer, rotary_tables
from jaxtier.offload import placement


def _median_seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def link_bytes_per_s(nbytes: int = 64 * 2**20, repeats: int = 5,
                     device: jax.Device | None = None) -> float:
  """Bandwidth of `jax.device_put` from pinned host memory to device memory, bytes per second."""
  device = device or jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(device, memory_kind=placement.PINNED_HOST)
  source = jax.device_put(np.ones(nbytes // 4, np.float32), host)
  target = host.with_memory_kind(placement.DEVICE)
  return source.nbytes / _median_seconds(lambda: jax.device_put(source, target), repeats)


def layer_compute_s(model: Transformer, batch: int, tokens: int, context: int,
                    repeats: int = 5) -> float:
  """Seconds one decoder layer of `model` takes for `batch` x `tokens` new tokens after `context`
  cached ones (its first layer, resident, jitted alone)."""
  c = model.config
  graphdef, stacked = nnx.split(model.layers)
  layer_state = jax.tree.map(lambda a: a[0], stacked)
  dtype = jax.tree.leaves(stacked)[0].dtype
  cache = ContiguousKVCache.create(1, batch, context + tokens, c.num_kv_heads, c.head_dim, dtype)
  pos_bt = jnp.broadcast_to(jnp.arange(context, context + tokens, dtype=jnp.int32), (batch, tokens))
  cos_btd, sin_btd = rotary_tables(model.inv_freq[...], pos_bt)
  x_bth = jnp.ones((batch, tokens, c.hidden_size), dtype)

  @jax.jit
  def run(layer_state, x_bth, cache):
    layer = nnx.merge(graphdef, layer_state)
    return layer(x_bth, cos_btd, sin_btd, cache, jnp.int32(0), pos_bt, None)

  return _median_seconds(lambda: run(layer_state, x_bth, cache), repeats)
