"""Measured machine figures: host -> device link bandwidth and one layer's compute time (the
planner's inputs), device -> host bandwidth (swap-outs), and the read bandwidth, matmul rate and
weight-matmul time that benchmarks bound a step with.

All are medians over repeats after a warm-up. On CPU the "link" is a memcpy between two views of
one memory and the layer runs on the CPU: the numbers are real but say nothing about a GPU.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtier.kernels.cpu import matmul
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.model.config import ModelConfig
from jaxtier.model.rotary import rotary_tables
from jaxtier.model.transformer import make_layer_stack
from jaxtier.offload import placement


def _median_seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def read_bytes_per_s(nbytes: int = 512 << 20, repeats: int = 7) -> float:
  """Bytes/s of a jitted sum over a large array (every core XLA uses): the access pattern of a
  decode step's weight and KV reads."""
  src = jnp.ones(nbytes // 4, jnp.float32)
  total = jax.jit(jnp.sum)
  return nbytes / _median_seconds(lambda: total(src), repeats)


def matmul_flops_per_s(repeats: int = 5) -> tuple[float, int]:
  """(FLOP/s, n) of a jitted float32 n x n matmul, n = 2048 on CPU and 8192 elsewhere."""
  n = 2048 if jax.default_backend() == "cpu" else 8192
  a = jnp.ones((n, n), jnp.float32) / n
  b = jnp.ones((n, n), jnp.float32)
  product = jax.jit(jnp.matmul)
  return 2 * n**3 / _median_seconds(lambda: product(a, b), repeats), n


def _pack(w, fmt: str):
  activations = "int16" if fmt.endswith("_i16") else "float32"
  blocks = fmt.removesuffix("_i16")
  if blocks in matmul.BLOCK_FORMATS:
    return matmul.pack_blocks(blocks, matmul.quantize_blocks(blocks, w), activations)
  return matmul.pack(w)


def weight_matmuls_s(config: ModelConfig, rows: int, dtype=jnp.float32, repeats: int = 5,
                     packed: bool = False, layer_format="float32",
                     head_format: str = "float32") -> float:
  """Seconds of one decode step's weight matmuls alone at `rows` rows: every layer's q/k/v,
  output, gate/up and down projections and the LM head, on random weights of the model's
  shapes (one array per layer, as the engine's unrolled layers hold them), in one jitted
  program with nothing else in it. What the matmul kernels take for a step's weights at this
  batch: a floor for the step that the bandwidth/matmul-rate bound does not see (skinny matmuls
  run far below a square matmul's rate). `packed`: the projections and LM head packed and
  multiplied as the packed model does (`jaxtier.kernels.cpu.matmul`); else XLA's matmuls on [in,
  out] weights. `layer_format` / `head_format` (`jaxtier.kernels.cpu.matmul.FORMATS`): where they
  pack, the projections / LM head packed in those blocks (`matmul.pack_blocks`), as the loader keeps
  a GGUF file's; `layer_format` is one format for every projection, or per layer the formats of its
  q/k/v, o, gate/up and down kernels (a file that mixes types)."""
  c = config
  shapes = [(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim),
            (c.num_heads * c.head_dim, c.hidden_size), (c.hidden_size, 2 * c.intermediate_size),
            (c.intermediate_size, c.hidden_size)]
  keys = iter(jax.random.split(jax.random.key(0), c.num_layers * len(shapes) + 1))
  layers = [[jax.random.normal(next(keys), s, dtype) * 0.02 for s in shapes]
            for _ in range(c.num_layers)]
  widths = [n for _, n in shapes]
  product = lambda x, w, n: x @ w
  if packed and matmul.packs_exactly(*widths):  # as FusedDecoderLayer packs
    formats = ([[layer_format] * len(shapes)] * c.num_layers if isinstance(layer_format, str)
               else layer_format)
    layers = [[_pack(w, fmt) for w, fmt in zip(layer, fmts)]
              for layer, fmts in zip(layers, formats, strict=True)]
    product = matmul.packed_matmul
  head = jax.random.normal(next(keys), (c.vocab_size, c.hidden_size), dtype) * 0.02
  logits = lambda h, head: h @ head.T
  if packed and matmul.packs_exactly(c.vocab_size):  # as GroupedTransformer packs the LM head
    head = _pack(head.T, head_format)
    logits = lambda h, head: matmul.packed_matmul(h, head, c.vocab_size)
  x = jnp.ones((rows, c.hidden_size), dtype)

  @jax.jit
  def run(x, layers, head):
    h = x
    for qkv, o, gate_up, down in layers:  # each product feeds the next: nothing runs ahead
      a = product(h, qkv, widths[0])[:, :c.num_heads * c.head_dim]
      h = h + product(a, o, widths[1])
      g = product(h, gate_up, widths[2])
      h = h + product(g[:, :c.intermediate_size] * g[:, c.intermediate_size:], down, widths[3])
    return logits(h, head)

  return _median_seconds(lambda: run(x, layers, head), repeats)


def _copy_bytes_per_s(nbytes: int, repeats: int, device: jax.Device | None, source_kind: str,
                      target_kind: str) -> float:
  """Bandwidth of `jax.device_put` of `nbytes` from `source_kind` to `target_kind` memory of
  `device` (default: the first local one), bytes per second."""
  device = device or jax.local_devices()[0]
  place = jax.sharding.SingleDeviceSharding(device, memory_kind=source_kind)
  source = jax.device_put(np.ones(nbytes // 4, np.float32), place)
  target = place.with_memory_kind(target_kind)
  return source.nbytes / _median_seconds(lambda: jax.device_put(source, target), repeats)


def link_bytes_per_s(nbytes: int = 64 * 2**20, repeats: int = 5,
                     device: jax.Device | None = None) -> float:
  """Bandwidth of `jax.device_put` from pinned host memory to device memory, bytes per second."""
  return _copy_bytes_per_s(nbytes, repeats, device, placement.PINNED_HOST, placement.DEVICE)


def d2h_bytes_per_s(nbytes: int = 64 * 2**20, repeats: int = 5,
                    device: jax.Device | None = None) -> float:
  """Bandwidth of `jax.device_put` from device memory to pinned host memory, bytes per second
  (the direction of swap-outs and prefix-cache write-backs)."""
  return _copy_bytes_per_s(nbytes, repeats, device, placement.DEVICE, placement.PINNED_HOST)


def layer_compute_s(config: ModelConfig, dtype, batch: int, tokens: int, context: int,
                    repeats: int = 5) -> float:
  """Seconds one decoder layer of a `config` model in `dtype` takes for `batch` x `tokens` new
  tokens after `context` cached ones: a layer of random weights (the time does not depend on
  their values, and no checkpoint needs to be loaded), resident and jitted alone."""
  c = config
  graphdef, stacked = nnx.split(make_layer_stack(config, jnp.dtype(dtype), nnx.Rngs(0), 1))
  layer_state = jax.tree.map(lambda a: a[0], stacked)
  dtype = jax.tree.leaves(stacked)[0].dtype
  cache = ContiguousKVCache.create(1, batch, context + tokens, c.num_kv_heads, c.head_dim, dtype)
  pos_bt = jnp.broadcast_to(jnp.arange(context, context + tokens, dtype=jnp.int32), (batch, tokens))
  cos_btd, sin_btd = rotary_tables(jnp.asarray(c.inv_freq()), pos_bt)
  x_bth = jnp.ones((batch, tokens, c.hidden_size), dtype)

  @jax.jit
  def run(layer_state, x_bth, cache):
    layer = nnx.merge(graphdef, layer_state)
    return layer(x_bth, cos_btd, sin_btd, cache, jnp.int32(0), pos_bt, None)

  return _median_seconds(lambda: run(layer_state, x_bth, cache), repeats)
