"""The pinned-host tier of a paged KV cache, and the swaps that move whole blocks to and from it.

`HostTier` holds `num_host_blocks` slots; a slot is empty or holds one block (K and V of every
layer and kv head, and the int8 scales) as its own pinned-host buffers, [k, l, c, d] each. Host
ids are slot numbers: the scheduler books them as it books device blocks.
`swap_out(cache, host, device_ids, host_ids)` copies device blocks into host slots and returns the
new tier; `swap_in(cache, host, host_ids, device_ids)` copies host slots into device blocks and
returns the new cache (donating the old one). Both validate the ids, run jitted programs, wait
for them and return a `SwapReport` of bytes and wall time.

Why one buffer per block rather than one host pool updated in place: a program that updates,
scatters or computes on a `pinned_host` array is what XLA's GPU compiler has failed on (a scatter
into pinned host memory, and the memory-space verifier on a dynamic-update-slice into it), and
what a host offloading pass may turn into host computation. Here every index computation stays
on the device: swap-out slices each block from the device pool on the device and moves it to
the host as one whole contiguous buffer (a program's outputs); swap-in takes the blocks as whole
host buffers (a program's arguments), moves each to the device and writes it into the device
pool there (block by block, unrolled: a gather and a scatter of the same blocks ran 2-4x slower
on XLA:CPU). The exported programs show no operation on host memory but the transfers
(`jaxtier.tools.export`). A block of a real model is 0.2-2 MB per K or V (a whole block over all
layers is contiguous in this layout), the transfer size that keeps a link busy; per-layer block
copies would be 10-100x smaller.

The tier takes pinned memory as blocks arrive: a slot's buffers live until the slot is written
again or the tier is dropped, so it never holds more than `num_host_blocks` blocks (the budget
the sizing step checks against host RAM), and a tier that was never used holds nothing.

A swap of n blocks runs one program per part of `swap_parts(n)` (powers of four, at most
`MAX_SWAP_BLOCKS` each): no padded block is copied, and an engine compiles at most
log4(MAX_SWAP_BLOCKS) + 1 programs per direction (`swap_sizes`): 1, 4 and 16 blocks.

Shape legend: x blocks of one program, k kv heads, l layers, c block size, d head dim.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier.kvcache.paged import KVBlocks, PagedKVCache
from jaxtier.model import sharding

MAX_SWAP_BLOCKS = 16  # blocks per swap program (its arguments or outputs grow with the count)


@dataclasses.dataclass(frozen=True)
class SwapReport:
  """What one swap moved and how long it took (compilation reported apart, 0 when cached)."""
  direction: str  # "out" (device -> host) or "in" (host -> device)
  num_blocks: int
  parts: tuple[int, ...]  # the block count of each program run (`swap_parts`)
  bytes: int  # bytes of the blocks (K, V and scales, all layers)
  seconds: float
  compile_seconds: float

  @property
  def gbps(self) -> float:
    return self.bytes / self.seconds / 1e9


@dataclasses.dataclass(frozen=True)
class HostTier:
  """The host tier's slots: `slots[i]` is the block stored in host block i, or None.

  Each stored block is a `KVBlocks` of pinned-host arrays, [k, l, c, d] (scales [k, l, c]), split
  over kv heads as the device pool is. Functional: `stored` returns a new tier.
  """
  slots: tuple[KVBlocks | None, ...]
  num_stored: int = 0  # slots that hold a block

  @classmethod
  def empty(cls, num_blocks: int) -> "HostTier":
    """A tier of `num_blocks` empty slots (no memory taken)."""
    return cls((None,) * num_blocks)

  @property
  def num_blocks(self) -> int:
    return len(self.slots)

  def bytes_stored(self) -> int:
    """Pinned bytes the stored blocks hold."""
    return sum(a.nbytes for block in self.slots if block is not None
               for a in jax.tree.leaves(block))

  def blocks(self, ids) -> tuple[KVBlocks, ...]:
    """The blocks in slots `ids`; a ValueError names the slots that hold none."""
    empty = [int(i) for i in ids if self.slots[i] is None]
    if empty:
      raise ValueError(f"host blocks {empty[:8]} hold no block: nothing was swapped out to them")
    return tuple(self.slots[i] for i in ids)

  def stored(self, ids, blocks) -> "HostTier":
    """The tier with `blocks[i]` in slot `ids[i]` (a slot's previous block is let go)."""
    slots, added = list(self.slots), 0
    for i, block in zip(ids, blocks, strict=True):
      added += slots[int(i)] is None
      slots[int(i)] = block
    return HostTier(tuple(slots), self.num_stored + added)


def host_block_shardings(cache: PagedKVCache) -> KVBlocks:
  """Where one host block's arrays live: pinned host memory, split over the device pool's mesh
  by kv heads (`sharding.kv_pool_shardings`); scales None unless the cache is int8."""
  pool = cache.device.k.sharding
  mesh = (pool.mesh if isinstance(pool, jax.sharding.NamedSharding)
          else sharding.make_mesh(1, sorted(pool.device_set, key=lambda d: d.id)))
  values = sharding.kv_pool_shardings(mesh)[1]
  scales = sharding.scale_sharding(values) if cache.config.quantized else None
  return KVBlocks(values, values, scales, scales)


def host_block_specs(cache: PagedKVCache, x: int) -> tuple[KVBlocks, ...]:
  """`x` host blocks as `jax.ShapeDtypeStruct`s (the arguments of a swap-in program compiled or
  exported without blocks at hand); `cache` may be abstract (`PagedKVCache.abstract`)."""
  places = host_block_shardings(cache)
  def spec(pool, place):
    shape = pool.shape[:2] + pool.shape[3:]
    return jax.ShapeDtypeStruct(shape, pool.dtype, sharding=place)
  return (jax.tree.map(spec, cache.device, places),) * x


def gather_blocks(cache: PagedKVCache, device_ids_x, places: KVBlocks) -> tuple[KVBlocks, ...]:
  """The jittable core of a swap-out: each device block of `device_ids_x` sliced from the pool on
  the device and put in host memory at `places` (`host_block_shardings`) as a buffer of its
  own."""
  def block(pool, i, place):
    return jax.device_put(jax.lax.dynamic_index_in_dim(pool, device_ids_x[i], 2, False), place)
  return tuple(jax.tree.map(lambda pool, place: block(pool, i, place), cache.device, places)
               for i in range(device_ids_x.shape[0]))


def scatter_blocks(cache: PagedKVCache, blocks: tuple[KVBlocks, ...], device_ids_x
                   ) -> PagedKVCache:
  """The jittable core of a swap-in: each host block moved to the device whole and written there
  into device block `device_ids_x[i]` (in place when the cache is donated; later blocks win
  where ids repeat)."""
  def write(pool, i, block):
    new = jax.device_put(block, jax.memory.Space.Device)[:, :, None]
    return jax.lax.dynamic_update_slice_in_dim(pool, new, device_ids_x[i], 2)
  device = cache.device
  for i, block in enumerate(blocks):
    device = jax.tree.map(lambda pool, b, i=i: write(pool, i, b), device, block)
  return cache.replace(device=device)


_GATHER = jax.jit(gather_blocks, static_argnames="places")
_SCATTER = jax.jit(scatter_blocks, donate_argnums=0)
_COMPILED = {}


def clear_compiled() -> None:
  """Drops the compiled swap programs of this process (`jaxtier.engine.runner.release_programs`
  drops them with the rest)."""
  _COMPILED.clear()


def swap_sizes(most: int = MAX_SWAP_BLOCKS) -> list[int]:
  """The block counts of the swap programs, ascending: powers of four up to `most` (and `most`
  itself): few programs, at most three parts of each size below the largest in one swap."""
  sizes = [1]
  while sizes[-1] * 4 <= most:
    sizes.append(sizes[-1] * 4)
  return sizes + ([most] if sizes[-1] != most else [])


def swap_parts(n: int, most: int = MAX_SWAP_BLOCKS) -> tuple[int, ...]:
  """Block counts of the programs a swap of `n` blocks runs: the largest of `swap_sizes(most)`
  that fits while blocks remain (21 -> 16, 4, 1)."""
  parts = []
  for size in reversed(swap_sizes(most)):
    parts += [size] * (n // size)
    n %= size
  return tuple(parts)


def part_slices(n: int) -> list[slice]:
  """The slices of a swap's n block pairs that its programs take, in order (`swap_parts`)."""
  bounds = np.cumsum((0,) + swap_parts(n))
  return [slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _ids(name: str, ids, pool_size: int) -> np.ndarray:
  ids = np.asarray(ids)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{name} must be a non-empty 1-D list of integers, got {ids.shape} "
                     f"{ids.dtype}")
  bad = ids[(ids < 0) | (ids >= pool_size)]
  if bad.size:
    raise ValueError(f"{name} {sorted(set(bad.tolist()))[:8]} are outside [0, {pool_size})")
  return ids.astype(np.int32)


def _checked(cache, host, src, dst, sizes, names) -> tuple[np.ndarray, np.ndarray]:
  if not isinstance(cache, PagedKVCache):
    raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  if not isinstance(host, HostTier) or host.num_blocks != cache.config.num_host_blocks:
    got = (f"one of {host.num_blocks}" if isinstance(host, HostTier)
           else type(host).__name__)
    raise ValueError(f"host must be the HostTier of the cache's {cache.config.num_host_blocks} "
                     f"host blocks, got {got}")
  src, dst = _ids(names[0], src, sizes[0]), _ids(names[1], dst, sizes[1])
  if src.size != dst.size:
    raise ValueError(f"{names[0]} has {src.size} ids but {names[1]} has {dst.size}")
  if np.unique(dst).size != dst.size:
    raise ValueError(f"{names[1]} {dst.tolist()} name a destination block twice")
  return src, dst


def _compiled(jitted, key: tuple, args, static) -> tuple[jax.stages.Compiled, float]:
  """The program compiled for `key` (compiled now if needed) and its compile seconds (0 if it
  was compiled before)."""
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  _COMPILED[key] = jitted.lower(*args, **static).compile()
  return _COMPILED[key], time.perf_counter() - start


def _layout(cache: PagedKVCache) -> tuple:
  return (jax.tree.structure(cache),
          tuple((a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(cache)))


def swap_out(cache: PagedKVCache, host: HostTier, device_ids, host_ids
             ) -> tuple[HostTier, SwapReport]:
  """Copies device blocks `device_ids[i]` into host slots `host_ids[i]`.

  The cache is not consumed (device blocks keep their contents; the caller frees them). Returns
  the new host tier and a report.
  """
  c = cache.config
  src, dst = _checked(cache, host, device_ids, host_ids,
                      (c.num_device_blocks, c.num_host_blocks), ("device_ids", "host_ids"))
  places, parts = host_block_shardings(cache), swap_parts(src.size)
  programs = [_compiled(_GATHER, ("out", x, _layout(cache)), (cache, src[:x]), {"places": places})
              for x in parts]
  start = time.perf_counter()
  blocks = [block for (program, _), part in zip(programs, part_slices(src.size))
            for block in program(cache, src[part])]
  host = host.stored(dst, blocks)  # once: each call copies the slot tuple
  jax.block_until_ready(blocks)
  seconds = time.perf_counter() - start
  return host, SwapReport("out", src.size, parts, src.size * c.bytes_per_block, seconds,
                          sum(s for _, s in programs))


def swap_in(cache: PagedKVCache, host: HostTier, host_ids, device_ids
            ) -> tuple[PagedKVCache, SwapReport]:
  """Copies the blocks in host slots `host_ids[i]` into device blocks `device_ids[i]`; donates
  `cache`. Returns the new cache and a report."""
  c = cache.config
  src, dst = _checked(cache, host, host_ids, device_ids,
                      (c.num_host_blocks, c.num_device_blocks), ("host_ids", "device_ids"))
  blocks, parts = host.blocks(src), swap_parts(src.size)
  programs = [_compiled(_SCATTER, ("in", x, _layout(cache)), (cache, blocks[:x], dst[:x]), {})
              for x in parts]
  start = time.perf_counter()
  for (program, _), part in zip(programs, part_slices(src.size)):
    cache = program(cache, blocks[part], dst[part])
  cache = jax.block_until_ready(cache)
  seconds = time.perf_counter() - start
  return cache, SwapReport("in", src.size, parts, src.size * c.bytes_per_block, seconds,
                           sum(s for _, s in programs))
