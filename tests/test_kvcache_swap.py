"""Swapping blocks between the device pool and the pinned-host pool, against numpy copies of
the pools.

Shape legend: k kv heads, l layers, p device blocks, h host blocks, c block size, d head dim.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier.buckets import pow2_bucket
from jaxtier.kvcache import (KVBlocks, PagedCacheConfig, PagedKVCache, host_pool_bytes, swap_in,
                             swap_out)
from jaxtier.kvcache import swap as swap_module

L, K, C, D = 2, 2, 4, 8
DEVICE_BLOCKS, HOST_BLOCKS = 12, 8


def cache_config(dtype: str, device_blocks: int = DEVICE_BLOCKS, host_blocks: int = HOST_BLOCKS
                 ) -> PagedCacheConfig:
  return PagedCacheConfig(L, K, D, device_blocks, C, host_blocks, dtype, "auto")


def _random_like(pool: KVBlocks, seed: int) -> KVBlocks:
  """Random contents (int8 values spread over the full range). `+ 0` makes XLA own the buffers:
  arrays put straight from numpy alias numpy memory on CPU, and donating them copies."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 60, a.dtype) + 0, pool)


def random_cache(dtype: str, seed: int = 0) -> PagedKVCache:
  cache = PagedKVCache.create(cache_config(dtype))
  return cache.replace(device=_random_like(cache.device, seed))


def device_blocks(cache) -> list[np.ndarray]:
  """Each device leaf as numpy, block axis first: [p, k, l, c, ...]."""
  return [np.moveaxis(np.asarray(a), 2, 0).copy() for a in jax.tree.leaves(cache.device)]


def host_blocks(cache) -> list[np.ndarray]:
  return [np.asarray(a).copy() for a in jax.tree.leaves(cache.host)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_swap_round_trip_is_bit_identical(dtype):
  cache = random_cache(dtype)
  before = device_blocks(cache)
  host_before = host_blocks(cache)
  cache, out_report = swap_out(cache, [3, 7, 1], [5, 0, 2])
  for got, want, old in zip(host_blocks(cache), before, host_before):
    np.testing.assert_array_equal(got[[5, 0, 2]], want[[3, 7, 1]])
    np.testing.assert_array_equal(np.delete(got, [5, 0, 2], 0), np.delete(old, [5, 0, 2], 0))
  cache = cache.replace(device=_random_like(cache.device, seed=1))  # slots get reused
  reused = device_blocks(cache)
  cache, in_report = swap_in(cache, [0, 5, 2], [9, 4, 3])
  for got, want, other in zip(device_blocks(cache), before, reused):
    np.testing.assert_array_equal(got[[9, 4, 3]], want[[7, 3, 1]])
    np.testing.assert_array_equal(np.delete(got, [9, 4, 3], 0), np.delete(other, [9, 4, 3], 0))
  block_bytes = host_pool_bytes(cache) // HOST_BLOCKS  # what one host slot really holds
  assert (out_report.bytes, in_report.bytes) == (3 * block_bytes, 3 * block_bytes)
  assert (out_report.bucket, out_report.direction, in_report.direction) == (4, "out", "in")
  assert out_report.seconds > 0 and in_report.seconds > 0


def test_swaps_equal_numpy_copies_of_the_pools():
  """A sequence of swaps whose later ones read slots the earlier ones wrote, against the same
  block copies done on numpy arrays of both pools."""
  cache = random_cache("int8", seed=3)
  device, host = device_blocks(cache), host_blocks(cache)
  swaps = (("out", [11, 0, 4, 6, 2], [7, 1, 3, 0, 6]), ("in", [3, 6], [6, 0]),
           ("out", [6, 9], [4, 3]), ("in", [4, 7, 1], [11, 5, 2]))
  for direction, src, dst in swaps:
    if direction == "out":
      cache, _ = swap_out(cache, src, dst)
      for d, h in zip(device, host):
        h[dst] = d[src]
    else:
      cache, _ = swap_in(cache, src, dst)
      for d, h in zip(device, host):
        d[dst] = h[src]
  for got, want in zip(device_blocks(cache) + host_blocks(cache), device + host):
    np.testing.assert_array_equal(got, want)


def test_host_pool_is_one_allocation_across_many_swaps():
  cache = random_cache("bfloat16", seed=4)
  def placement(c):
    return [(a.unsafe_buffer_pointer(), a.shape, a.dtype, a.sharding.memory_kind)
            for a in jax.tree.leaves(c)]
  start = placement(cache)
  rng = np.random.default_rng(0)
  buckets = set()
  for _ in range(25):
    n = int(rng.integers(1, HOST_BLOCKS + 1))
    cache, report = swap_out(cache, rng.choice(DEVICE_BLOCKS, n, replace=False),
                             rng.choice(HOST_BLOCKS, n, replace=False))
    cache, _ = swap_in(cache, rng.choice(HOST_BLOCKS, n, replace=False),
                       rng.choice(DEVICE_BLOCKS, n, replace=False))
    buckets.add(report.bucket)
  assert placement(cache) == start
  assert [kind for *_, kind in start] == ["device"] * 2 + ["pinned_host"] * 2
  assert buckets <= {1, 2, 4, 8}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_swap_programs_work_in_place(dtype):
  cache = PagedKVCache.create(cache_config(dtype, 256, 256))
  ids = np.zeros(4, np.int32)
  for fn in (swap_module.swap_out_padded, swap_module.swap_in_padded):
    compiled = jax.jit(fn, donate_argnums=0).lower(cache, ids, ids, np.int32(4)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= 8 * cache.config.bytes_per_block


def test_bucket_sizes():
  assert [pow2_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]
  assert [pow2_bucket(n, 16) for n in (0, 1, 16, 17)] == [16, 16, 16, 32]


def test_swap_validation_names_the_problem():
  cache = random_cache("float32")
  with pytest.raises(ValueError, match=r"host_ids \[8\] are outside \[0, 8\)"):
    swap_out(cache, [0], [8])
  with pytest.raises(ValueError, match=r"device_ids \[-1\] are outside \[0, 12\)"):
    swap_in(cache, [0], [-1])
  with pytest.raises(ValueError, match="device_ids has 2 ids but host_ids has 1"):
    swap_out(cache, [0, 1], [2])
  with pytest.raises(ValueError, match=r"host_ids \[2, 2\] name a destination block twice"):
    swap_out(cache, [0, 1], [2, 2])
  with pytest.raises(ValueError, match="non-empty 1-D list of integers"):
    swap_out(cache, [], [])


def test_cuda_export_moves_only_swapped_blocks():
  """What a GPU is asked to do: every device<->host transfer carries one swapped block."""
  cache = PagedKVCache.create(cache_config("int8"))
  ids = np.zeros(4, np.int32)
  for fn, to in ((swap_module.swap_out_padded, "pinned_host"),
                 (swap_module.swap_in_padded, "device")):
    exported = jax.export.export(jax.jit(fn, donate_argnums=0),
                                 platforms=["cuda"])(cache, ids, ids, np.int32(4))
    moves = re.findall(r"annotate_device_placement\(%[\w#]+\).*?_xla_buffer_placement = \"(\w+)\""
                       r".*?: \(tensor<([\dx]+)x(\w+)>\)", exported.mlir_module())
    block_moves = {(shape, dtype) for placement, shape, dtype in moves
                   if placement == to and dtype != "i32"}
    assert block_moves == {(f"1x{K}x{L}x{C}x{D}", "i8"), (f"1x{K}x{L}x{C}", "f32")}, moves
