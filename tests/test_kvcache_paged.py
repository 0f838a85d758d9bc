"""The paged cache through the model's contract: equal to the contiguous cache, writes in place.

Shape legend: l layers, b batch, t new tokens, n query heads, k kv heads, d head dim, m table width.
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier.attention.page_format import decode, encode
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.kvcache import (ContiguousKVCache, PagedCacheConfig, PagedKVCache, PagedMetadata,
                             attend, device_pool_bytes, quantize_int8, write_chunk)
from jaxtier.kvcache.paged import attention_path, resolve_attention_impl
from jaxtier.model import sharding

L, K, G, D, C = 3, 2, 3, 8, 4
NUM_BLOCKS = 24
needs_kernels = pytest.mark.skipif(cpu_kernels._compiler() is None,
                                   reason="no C++ compiler to build the CPU kernels")


def cache_config(num_device_blocks: int = NUM_BLOCKS, *, num_host_blocks: int = 0,
                 kv_cache_dtype: str = "float32", attention_impl: str = "auto"
                 ) -> PagedCacheConfig:
  """A cache of this file's shape (L layers, K heads, D, blocks of C tokens)."""
  return PagedCacheConfig(L, K, D, num_device_blocks, C, num_host_blocks, kv_cache_dtype,
                          attention_impl)


@functools.partial(jax.jit, donate_argnums=0)
def run_layers(cache, q_lbtnd, k_lbtkd, v_lbtkd, pos_bt, meta):
  """What the model does: a scan over layers calling `update_and_attend` with a traced layer."""
  def body(cache, xs):
    layer, q, k, v = xs
    return cache.update_and_attend(layer, q, k, v, pos_bt, meta)
  layers = jnp.arange(q_lbtnd.shape[0], dtype=jnp.int32)
  return jax.lax.scan(body, cache, (layers, q_lbtnd, k_lbtkd, v_lbtkd))


def block_tables(rng, lengths):
  """Shuffled distinct device blocks for each sequence, -1 past its last block."""
  used = [-(-n // C) for n in lengths]
  m = max(used) + 1
  ids = rng.permutation(NUM_BLOCKS)
  table = np.full((len(lengths), m), -1, np.int32)
  for i, u in enumerate(used):
    table[i, :u] = ids[i * m:i * m + u]
  return table


def random_step(rng, positions):
  """Random q/k/v for every layer at the given [b, t] positions (negative = padding)."""
  b, t = positions.shape
  q = rng.normal(size=(L, b, t, K * G, D)).astype(np.float32)
  k = rng.normal(size=(L, b, t, K, D)).astype(np.float32)
  v = rng.normal(size=(L, b, t, K, D)).astype(np.float32)
  return q, k, v, positions.astype(np.int32)


def schedule(lengths):
  """Ragged padded prefill of the first 7 tokens, a second chunk, then two decode steps."""
  pos = np.arange(7)[None].repeat(len(lengths), 0)
  first = np.where(pos < np.minimum(np.array(lengths)[:, None] - 3, 7), pos, -1)
  second = first.max(1, keepdims=True) + 1 + np.arange(4)[None]
  second = np.where(second < np.array(lengths)[:, None] - 2, second, -1)
  done = np.maximum(first.max(1), second.max(1))
  return [first, second, done[:, None] + 1, done[:, None] + 2]


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=needs_kernels), "xla", "xla_gathered",
                                  "reference", "pallas_interpret"])
def test_equals_contiguous_cache_over_prefill_chunks_and_decode(impl):
  rng = np.random.default_rng(0)
  lengths = [9, 14, 6]
  config = cache_config(attention_impl=impl)
  paged = PagedKVCache.create(config)
  contiguous = ContiguousKVCache.create(L, len(lengths), 16, K, D)
  meta = PagedMetadata.create(block_tables(rng, lengths), NUM_BLOCKS)
  for positions in schedule(lengths):
    step = random_step(rng, positions)
    paged, out_paged = run_layers(paged, *step, meta)
    contiguous, out_contiguous = run_layers(contiguous, *step, None)
    real = (positions >= 0)[None, :, :, None, None]
    np.testing.assert_allclose(np.where(real, out_paged, 0), np.where(real, out_contiguous, 0),
                               atol=1e-5, rtol=1e-5)


def test_pure_functions_compose_like_update_and_attend():
  rng = np.random.default_rng(5)
  config = cache_config(kv_cache_dtype="bfloat16")
  meta = PagedMetadata.create(block_tables(rng, [7, 3]), NUM_BLOCKS)
  layer = jnp.int32(2)
  q, k, v, pos = random_step(rng, np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]]))
  q1, k1, v1, pos1 = random_step(rng, np.array([[6], [3]]))
  cache = jax.jit(write_chunk)(PagedKVCache.create(config), layer, k[2], v[2], pos, meta)
  cache = jax.jit(write_chunk)(cache, layer, k1[2], v1[2], pos1, meta)  # one decode token
  got = jax.jit(attend)(cache, layer, q1[2], pos1, meta)
  update_and_attend = jax.jit(PagedKVCache.update_and_attend)
  want_cache, _ = update_and_attend(PagedKVCache.create(config), layer, q[2], k[2], v[2], pos, meta)
  _, want = update_and_attend(want_cache, layer, q1[2], k1[2], v1[2], pos1, meta)
  np.testing.assert_array_equal(got, want)


def gather_tokens(cache, layer, table, n):
  """Values, scales of the first n slots of each sequence, read from the pool by hand."""
  def read(pool):
    if pool is None:
      return None
    pool = np.asarray(decode(pool).astype(jnp.float32) if pool.dtype == jnp.uint16 else pool)
    return np.stack([np.stack([pool[:, layer, row[s // C], s % C] for s in range(n)])
                     for row in table])
  dev = cache.device
  return read(dev.k), read(dev.k_scales)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_writes_store_exactly_the_new_tokens(dtype):
  rng = np.random.default_rng(1)
  config = cache_config(kv_cache_dtype=dtype)
  cache = PagedKVCache.create(config)
  table = block_tables(rng, [11, 5])
  meta = PagedMetadata.create(table, NUM_BLOCKS)
  positions = np.array([np.arange(11), np.where(np.arange(11) < 5, np.arange(11), -1)])
  q, k, v, pos = random_step(rng, positions)
  cache, _ = run_layers(cache, q, k, v, pos, meta)
  got, got_scales = gather_tokens(cache, 1, table, 5)
  want = k[1, :, :5]
  if dtype == "int8":
    want_q, want_s = quantize_int8(jnp.asarray(want))
    np.testing.assert_array_equal(got, want_q)
    np.testing.assert_array_equal(got_scales, want_s)
  else:
    np.testing.assert_array_equal(got, np.asarray(jnp.asarray(want).astype(dtype), np.float32))
  written = np.zeros(NUM_BLOCKS, bool)
  written[table[0, :3]] = written[table[1, :2]] = True
  untouched = np.asarray(cache.device.k)[:, :, ~written]
  assert not untouched.any(), "padding tokens or unused blocks were written"


@pytest.mark.parametrize("dtype, positions", [
    ("float32", [[5], [9]]), ("bfloat16", [[5], [9]]), ("int8", [[5], [9]]),
    ("float32", [[5]]),  # a single new token: XLA's single-update rewrite would copy the pool
])
def test_step_writes_in_place_without_pool_copies(dtype, positions):
  rng = np.random.default_rng(2)
  config = cache_config(512, num_host_blocks=8, kv_cache_dtype=dtype)
  cache = PagedKVCache.create(config)
  rows = len(positions)
  meta = PagedMetadata.create(np.arange(4 * rows, dtype=np.int32).reshape(rows, 4), 512)
  step = random_step(rng, np.array(positions))
  compiled = run_layers.lower(cache, *step, meta).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < device_pool_bytes(cache) // 20
  pointers = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(cache)]
  cache, _ = run_layers(cache, *step, meta)
  assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(cache)] == pointers
  assert {a.sharding.memory_kind for a in jax.tree.leaves(cache)} == {"device"}


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("traced_layer", [False, True])
def test_cpu_decode_write_and_attend_equals_write_chunk_then_attend(dtype, traced_layer):
  """The CPU kernel that writes a decode step's keys and values and attends in one call, against
  `write_chunk` (XLA's scatter) then `attend`: the same pool, bit for bit, and the same output,
  over a pool of random values, with the rows the write rules skip: padding (a negative
  position), a -1 table entry and a position past the table."""
  rng = np.random.default_rng(7)
  config = cache_config(kv_cache_dtype=dtype, attention_impl="cpu")
  cache = PagedKVCache.create(config)
  stored = cache.device.k.dtype
  fill = lambda x: encode(jnp.asarray(rng.normal(size=x.shape), jnp.float32), dtype, stored)
  cache = cache.replace(device=cache.device.replace(k=fill(cache.device.k),
                                                    v=fill(cache.device.v)))
  table = np.array([[3, 7, 11], [5, -1, -1], [2, 9, -1], [0, 4, 6], [13, 1, 8]], np.int32)
  positions = np.array([[5], [-1], [9], [3 * C], [10]], np.int32)  # rows 1-3 write nothing
  meta = PagedMetadata.create(table, NUM_BLOCKS)
  q, k, v, pos = random_step(rng, positions)
  q, k, v = (jnp.asarray(x) for x in (q, k, v))
  layer = 1

  def fused(cache, layer):
    return cache.update_and_attend(layer, q[layer], k[layer], v[layer], pos, meta)

  def unfused(cache, layer):
    cache = write_chunk(cache, layer, k[layer], v[layer], pos, meta)
    return cache, attend(cache, layer, q[layer], pos, meta)

  if traced_layer:
    got_cache, got = jax.jit(lambda c, i: fused(c, i))(cache, jnp.int32(layer))
  else:
    got_cache, got = jax.jit(fused, static_argnums=1)(cache, layer)
  want_cache, want = jax.jit(unfused, static_argnums=1)(cache, layer)
  hlo = jax.jit(fused, static_argnums=1).lower(cache, layer).as_text()
  assert cpu_kernels.WRITE_ATTENTION_TARGET in hlo
  assert cpu_kernels.WRITE_ATTENTION_TARGET not in jax.jit(unfused, static_argnums=1).lower(
      cache, layer).as_text()
  np.testing.assert_array_equal(got_cache.device.k, want_cache.device.k)
  np.testing.assert_array_equal(got_cache.device.v, want_cache.device.v)
  assert not np.array_equal(got_cache.device.k, cache.device.k)  # rows 0 and 4 wrote
  np.testing.assert_array_equal(got, want)


def test_cuda_export_of_a_step_moves_nothing_between_memory_kinds():
  """On a GPU the model's step takes the device pool alone (the host tier stays outside the
  cache): no transfer, no host argument, the pool aliased to the output."""
  rng = np.random.default_rng(3)
  cache = PagedKVCache.abstract(cache_config(num_host_blocks=8), platform="gpu")
  assert cache.config.attention_impl == "pallas"
  meta = PagedMetadata.create(block_tables(rng, [5, 9]), NUM_BLOCKS)
  step = random_step(rng, np.array([[4], [8]]))
  module = jax.export.export(run_layers, platforms=["cuda"], disabled_checks=TRITON)(
      cache, *step, meta).mlir_module()
  assert "annotate_device_placement" not in module
  signature = module[module.index("func.func public @main"):].split("->")[0]
  assert "pinned_host" not in signature
  pool_args = [arg for arg in signature.split("%arg") if "tf.aliasing_output" in arg]
  assert len(pool_args) == 2  # K and V


TRITON = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def exported_attention(impl: str, platform: str, t: int, window=None, cap=None, head_dim=D,
                       block_size=C, kv_cache_dtype="bfloat16") -> str:
  """StableHLO of one layer's `attend` over a cache built for `platform` (nothing allocated)."""
  config = PagedCacheConfig(L, K, head_dim, NUM_BLOCKS, block_size, 0, kv_cache_dtype, impl)
  cache = PagedKVCache.abstract(config, platform=platform.replace("cuda", "gpu"))
  q = jax.ShapeDtypeStruct((2, t, K * G, head_dim), jnp.bfloat16)
  pos = jax.ShapeDtypeStruct((2, t), jnp.int32)
  meta = PagedMetadata(jax.ShapeDtypeStruct((2, 6), jnp.int32))
  fn = jax.jit(lambda cache, q, pos, meta: attend(cache, jnp.int32(1), q, pos, meta, window, cap))
  return jax.export.export(fn, platforms=[platform], disabled_checks=TRITON)(
      cache, q, pos, meta).mlir_module()


@pytest.mark.parametrize("t", [1, 5])
def test_gpu_programs_run_the_kernel_or_the_gathered_path_never_the_loop(t):
  """"auto" on a GPU: the Triton kernel for decode and prefill, the gathered XLA path for a
  sliding-window or soft-capped layer; the chunked loop (CPU's XLA path) in neither."""
  kernel = exported_attention("auto", "cuda", t)
  assert "__gpu$xla.gpu.triton" in kernel and "@paged_attention(" not in kernel
  for window, cap in ((8, None), (None, 30.0)):
    xla = exported_attention("auto", "cuda", t, window, cap)
    assert "__gpu$xla.gpu.triton" not in xla and "@paged_attention(" not in xla
    assert "@paged_attention_gathered(" in xla and "stablehlo.while" not in xla
  explicit = exported_attention("xla", "cuda", t)
  assert "@paged_attention_gathered(" in explicit and "stablehlo.while" not in explicit


def test_tpu_programs_run_the_kernel_for_decode_steps_it_fits():
  decode = exported_attention("auto", "tpu", 1, cap=30.0, head_dim=128, block_size=16)
  assert "tpu_custom_call" in decode and "@paged_attention_gathered(" not in decode
  for t, window, head_dim, dtype in ((5, None, 128, "bfloat16"), (1, 8, 128, "bfloat16"),
                                     (1, None, D, "bfloat16"), (1, None, 128, "int8")):
    other = exported_attention("auto", "tpu", t, window, head_dim=head_dim, block_size=16,
                               kv_cache_dtype=dtype)
    assert "tpu_custom_call" not in other and "stablehlo.while" not in other, (t, window)
    assert "@paged_attention_gathered(" in other


def test_auto_resolves_per_platform():
  one = sharding.make_mesh(1, [jax.devices("cpu")[0]])
  assert resolve_attention_impl("auto", one, "gpu") == "pallas"
  assert resolve_attention_impl("auto", one, "cuda") == "pallas"
  assert resolve_attention_impl("auto", one, "tpu") == "pallas_tpu"
  for platform in ("gpu", "tpu"):
    assert resolve_attention_impl("xla", one, platform) == "xla_gathered"
  assert resolve_attention_impl("xla", one, "cpu") == "xla"
  assert resolve_attention_impl("xla_gathered", one, "cpu") == "xla_gathered"
  split = types.SimpleNamespace(devices=np.array(jax.devices("cpu") * 2))  # two devices
  assert resolve_attention_impl("auto", split, "gpu") == "xla_gathered"  # kernels: one device
  with pytest.raises(ValueError, match="needs a TPU"):
    resolve_attention_impl("pallas_tpu", one, "gpu")
  with pytest.raises(ValueError, match="needs a GPU"):
    resolve_attention_impl("pallas", one, "tpu")


def test_attention_path_sends_what_a_kernel_cannot_serve_to_an_xla_path():
  decode = dict(t=1, head_dim=128, block_size=16, quantized=False, window=False, cap=False)
  for impl in ("pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret", "cpu", "xla",
               "xla_gathered", "reference"):
    assert attention_path(impl, **decode) == impl
  assert attention_path("pallas", **{**decode, "t": 7, "quantized": True}) == "pallas"
  assert attention_path("pallas", **{**decode, "cap": True}) == "xla_gathered"
  assert attention_path("pallas_interpret", **{**decode, "window": True}) == "xla_gathered"
  assert attention_path("pallas", **{**decode, "block_size": 12}) == "xla_gathered"
  assert attention_path("pallas_tpu", **{**decode, "cap": True}) == "pallas_tpu"
  for change in ({"t": 7}, {"window": True}, {"quantized": True}, {"head_dim": 64},
                 {"block_size": 8}):
    assert attention_path("pallas_tpu", **{**decode, **change}) == "xla_gathered", change
  assert attention_path("cpu", **{**decode, "window": True}) == "xla"
  assert attention_path("reference", **{**decode, "window": True}) == "reference"


def test_tpu_kernel_through_the_cache_in_interpret_mode():
  """A decode step of a bfloat16 cache of the kernel's shapes with "pallas_tpu_interpret": the
  TPU kernel (its cap included) equals the reference; the prefill before it took the gathered
  path."""
  rng = np.random.default_rng(9)
  d, c = 128, 16
  config = PagedCacheConfig(1, K, d, 8, c, 0, "bfloat16", "pallas_tpu_interpret")
  ref_config = dataclasses.replace(config, attention_impl="reference")
  table = np.array([[3, 5, -1], [1, -1, -1], [6, 0, 2]], np.int32)
  meta = PagedMetadata.create(table, 8)
  prefill = np.where(np.arange(20)[None] < np.array([[20], [9], [17]]), np.arange(20)[None], -1)
  steps = []
  for positions in (prefill, np.array([[20], [9], [-1]])):
    b, t = positions.shape
    steps.append([jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for h in (K * G, K, K)]
                 + [jnp.asarray(positions, jnp.int32)])
  step = jax.jit(PagedKVCache.update_and_attend, static_argnames="cap")
  outs = []
  for cfg in (config, ref_config):
    cache = PagedKVCache.create(cfg)
    for q, k, v, pos in steps:
      cache, out = step(cache, jnp.int32(0), q, k, v, pos, meta, cap=20.0)
      outs.append(np.asarray(out))
  # prefill: the gathered path's probabilities meet bfloat16 values in bfloat16; decode: the
  # kernel computes in float32
  for got, want, tol in zip(outs[:2], outs[2:], (2e-2, 1e-4)):
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
  assert np.all(outs[1][2] == 0)


def test_config_and_metadata_validation():
  with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
    cache_config(8, kv_cache_dtype="fp8")
  with pytest.raises(ValueError, match="block_size=0"):
    PagedCacheConfig(L, K, D, 8, 0, 0, "float32", "auto")
  with pytest.raises(ValueError, match=r"block ids \[8, 9\] are outside \[-1, 8\)"):
    PagedMetadata.create(np.array([[0, 8], [9, -1]]), 8)
  cache = PagedKVCache.create(cache_config(8, num_host_blocks=4))
  q = jnp.zeros((2, 1, K * G, D))
  kv = jnp.zeros((2, 1, K, D))
  pos = jnp.zeros((2, 1), jnp.int32)
  with pytest.raises(ValueError, match="meta must be a PagedMetadata"):
    cache.update_and_attend(jnp.int32(0), q, kv, kv, pos, None)
  with pytest.raises(ValueError, match="must be int32"):
    cache.update_and_attend(jnp.int32(0), q, kv, kv, pos, PagedMetadata(jnp.zeros((2, 3))))
  meta = PagedMetadata(jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="head_dim"):
    cache.update_and_attend(jnp.int32(0), q, kv[..., :4], kv[..., :4], pos, meta)
  with pytest.raises(ValueError, match="num_kv_heads"):
    cache.update_and_attend(jnp.int32(0), q, kv[:, :, :1], kv[:, :, :1], pos, meta)


def test_bytes_per_block_int8_is_about_half_of_bfloat16():
  sizes = {dtype: PagedCacheConfig(30, 3, 64, 8, 16, 0, dtype, "auto").bytes_per_block
           for dtype in ("float32", "bfloat16", "int8")}
  assert sizes["float32"] == 2 * 30 * 3 * 16 * 64 * 4 == 2 * sizes["bfloat16"]
  assert sizes["int8"] == 2 * 30 * 3 * 16 * (64 + 4)
  assert sizes["int8"] / sizes["bfloat16"] < 0.55
