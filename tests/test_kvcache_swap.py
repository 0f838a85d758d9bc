"""Swapping blocks between the device pool and the pinned-host tier, against numpy copies of the
pool and of the host slots.

Shape legend: k kv heads, l layers, p device blocks, c block size, d head dim.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier.common.buckets import pow2_bucket
from jaxtier.kvcache import (HostTier, KVBlocks, PagedCacheConfig, PagedKVCache, swap_in,
                             swap_out)
from jaxtier.kvcache import swap as swap_module
from jaxtier.tools import hlo

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


def random_cache(dtype: str, seed: int = 0, device_blocks: int = DEVICE_BLOCKS,
                 host_blocks: int = HOST_BLOCKS) -> PagedKVCache:
  cache = PagedKVCache.create(cache_config(dtype, device_blocks, host_blocks))
  return cache.replace(device=_random_like(cache.device, seed))


def device_blocks(cache) -> list[np.ndarray]:
  """Each device leaf as numpy, block axis first: [p, k, l, c, ...]."""
  return [np.moveaxis(np.asarray(a), 2, 0).copy() for a in jax.tree.leaves(cache.device)]


def host_slot(host: HostTier, i: int) -> list[np.ndarray]:
  return [np.asarray(a).copy() for a in jax.tree.leaves(host.slots[i])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_swap_round_trip_is_bit_identical(dtype):
  cache = random_cache(dtype)
  before = device_blocks(cache)
  host, out_report = swap_out(cache, HostTier.empty(HOST_BLOCKS), [3, 7, 1], [5, 0, 2])
  for slot, block in ((5, 3), (0, 7), (2, 1)):
    for got, want in zip(host_slot(host, slot), before):
      np.testing.assert_array_equal(got, want[block])
  assert [i for i, s in enumerate(host.slots) if s is not None] == [0, 2, 5] == sorted([5, 0, 2])
  assert host.num_stored == 3
  np.testing.assert_array_equal(device_blocks(cache)[0], before[0])  # swap-out keeps the pool
  cache = cache.replace(device=_random_like(cache.device, seed=1))  # slots get reused
  reused = device_blocks(cache)
  cache, in_report = swap_in(cache, host, [0, 5, 2], [9, 4, 3])
  for got, want, other in zip(device_blocks(cache), before, reused):
    np.testing.assert_array_equal(got[[9, 4, 3]], want[[7, 3, 1]])
    np.testing.assert_array_equal(np.delete(got, [9, 4, 3], 0), np.delete(other, [9, 4, 3], 0))
  block_bytes = host.bytes_stored() // 3  # what one host slot really holds
  assert (out_report.bytes, in_report.bytes) == (3 * block_bytes, 3 * block_bytes)
  assert (out_report.parts, out_report.direction, in_report.direction) == ((1, 1, 1), "out", "in")
  assert out_report.seconds > 0 and in_report.seconds > 0


def test_swaps_equal_numpy_copies_of_the_pool_and_slots():
  """A sequence of swaps whose later ones read slots the earlier ones wrote (and overwrite some),
  against the same block copies done on numpy arrays."""
  cache, host = random_cache("int8", seed=3), HostTier.empty(HOST_BLOCKS)
  device, slots = device_blocks(cache), {}
  swaps = (("out", [11, 0, 4, 6, 2], [7, 1, 3, 0, 6]), ("in", [3, 6], [6, 0]),
           ("out", [6, 9], [4, 3]), ("in", [4, 7, 1, 3], [11, 5, 2, 8]),
           ("in", [7, 7], [1, 10]))  # one host block into two device blocks
  for direction, src, dst in swaps:
    if direction == "out":
      host, _ = swap_out(cache, host, src, dst)
      for s, d in zip(src, dst):
        slots[d] = [a[s].copy() for a in device]
    else:
      cache, _ = swap_in(cache, host, src, dst)
      for s, d in zip(src, dst):
        for a, b in zip(device, slots[s]):
          a[d] = b
  for got, want in zip(device_blocks(cache), device):
    np.testing.assert_array_equal(got, want)
  assert sorted(slots) == [i for i, s in enumerate(host.slots) if s is not None]
  for i, want in slots.items():
    for got, w in zip(host_slot(host, i), want):
      np.testing.assert_array_equal(got, w)


def test_swaps_of_more_blocks_than_one_program_run_in_parts():
  n = swap_module.MAX_SWAP_BLOCKS + 5
  cache, host = random_cache("float32", 5, n + 3, n), HostTier.empty(n)
  before = device_blocks(cache)
  src, dst = np.random.default_rng(1).permutation(n + 3)[:n], np.arange(n)[::-1]
  host, report = swap_out(cache, host, src, dst)
  assert report.parts == (swap_module.MAX_SWAP_BLOCKS, 4, 1)
  cache = cache.replace(device=_random_like(cache.device, seed=6))
  cache, report = swap_in(cache, host, dst, src)
  assert report.parts == (swap_module.MAX_SWAP_BLOCKS, 4, 1)
  for got, want in zip(device_blocks(cache), before):
    np.testing.assert_array_equal(got[src], want[src])


def test_the_device_pool_stays_one_allocation_and_host_blocks_are_pinned():
  cache, host = random_cache("bfloat16", seed=4), HostTier.empty(HOST_BLOCKS)
  def placement(c):
    return [(a.unsafe_buffer_pointer(), a.shape, a.dtype, a.sharding.memory_kind)
            for a in jax.tree.leaves(c)]
  start = placement(cache)
  rng = np.random.default_rng(0)
  parts = set()
  for _ in range(25):
    n = int(rng.integers(1, HOST_BLOCKS + 1))
    host, report = swap_out(cache, host, rng.choice(DEVICE_BLOCKS, n, replace=False),
                            rng.choice(HOST_BLOCKS, n, replace=False))
    stored = np.flatnonzero([s is not None for s in host.slots])
    cache, _ = swap_in(cache, host, rng.choice(stored, n), rng.choice(DEVICE_BLOCKS, n,
                                                                      replace=False))
    parts |= set(report.parts)
  assert placement(cache) == start
  assert [kind for *_, kind in start] == ["device"] * 2
  kinds = {a.sharding.memory_kind for s in host.slots if s is not None for a in jax.tree.leaves(s)}
  assert kinds == {"pinned_host"}
  assert host.num_stored == sum(s is not None for s in host.slots) <= HOST_BLOCKS
  assert parts <= {1, 4}  # `swap_sizes` up to HOST_BLOCKS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_swap_programs_work_in_place(dtype):
  """Neither program copies the device pool: temporaries stay within the swapped blocks."""
  cache = PagedKVCache.create(cache_config(dtype, 256, 256))
  ids, places = np.arange(4, dtype=np.int32), swap_module.host_block_shardings(cache)
  gather = swap_module._GATHER.lower(cache, ids, places=places).compile()
  scatter = swap_module._SCATTER.lower(cache, swap_module.host_block_specs(cache, 4),
                                       ids).compile()
  for compiled in (gather, scatter):
    assert compiled.memory_analysis().temp_size_in_bytes <= 8 * cache.config.bytes_per_block


def test_parts_and_bucket_sizes():
  assert swap_module.swap_sizes() == [1, 4, 16] and swap_module.swap_sizes(8) == [1, 4, 8]
  assert [swap_module.swap_parts(n, 8) for n in (1, 3, 8, 13, 21)] == [
      (1,), (1, 1, 1), (8,), (8, 4, 1), (8, 8, 4, 1)]
  assert swap_module.swap_parts(13) == (4, 4, 4, 1)
  for n in range(1, 200):  # every part is a program's size, largest first, and the parts add up
    parts = swap_module.swap_parts(n)
    assert sum(parts) == n and set(parts) <= {1, 4, 16} and list(parts) == sorted(parts)[::-1]
  assert [pow2_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]
  assert [pow2_bucket(n, 16) for n in (0, 1, 16, 17)] == [16, 16, 16, 32]


def test_swap_validation_names_the_problem():
  cache, host = random_cache("float32"), HostTier.empty(HOST_BLOCKS)
  with pytest.raises(ValueError, match=r"host_ids \[8\] are outside \[0, 8\)"):
    swap_out(cache, host, [0], [8])
  with pytest.raises(ValueError, match=r"device_ids \[-1\] are outside \[0, 12\)"):
    swap_in(cache, host, [0], [-1])
  with pytest.raises(ValueError, match="device_ids has 2 ids but host_ids has 1"):
    swap_out(cache, host, [0, 1], [2])
  with pytest.raises(ValueError, match=r"host_ids \[2, 2\] name a destination block twice"):
    swap_out(cache, host, [0, 1], [2, 2])
  with pytest.raises(ValueError, match="non-empty 1-D list of integers"):
    swap_out(cache, host, [], [])
  with pytest.raises(ValueError, match=r"host blocks \[3\] hold no block"):
    swap_in(cache, host, [3], [0])
  with pytest.raises(ValueError, match="HostTier of the cache's 8 host blocks"):
    swap_out(cache, HostTier.empty(4), [0], [0])


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_exported_swaps_move_whole_blocks_and_compute_nothing_on_the_host(platform):
  """What an accelerator is asked to do: each device<->host transfer carries one whole block
  (K, V or a scale array), and nothing but transfers touches host memory."""
  cache = PagedKVCache.create(cache_config("int8"))
  ids, x = np.arange(4, dtype=np.int32), 4
  programs = {
      "pinned_host": (swap_module._GATHER, (cache, ids),
                      {"places": swap_module.host_block_shardings(cache)}),
      "device": (swap_module._SCATTER, (cache, swap_module.host_block_specs(cache, x), ids), {})}
  block = {(K, L, C, D), (K, L, C)}
  for destination, (jitted, args, static) in programs.items():
    exported = jax.export.export(jitted, platforms=[platform])(*args, **static)
    report = hlo.placement_report(exported.mlir_module())
    assert report.host_compute == ()
    assert {t.destination for t in report.transfers} == {destination}
    assert {t.shape for t in report.transfers} == block
    assert len(report.transfers) == 4 * x  # K, V and their scales, per block
