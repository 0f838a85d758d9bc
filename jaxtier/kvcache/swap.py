"""Moving whole blocks between the device pool and the pinned-host pool of a `PagedKVCache`.

`swap_out(cache, device_ids, host_ids)` copies device blocks into host slots; `swap_in(cache,
host_ids, device_ids)` copies host blocks into device slots. Both validate the ids, pad the lists to
a power-of-two bucket (so at most log2(pool size) + 1 programs are compiled per direction), run one
jitted program that donates the cache (pools are updated in place and stay in their memory kinds),
wait for it, and return the new cache with a `SwapReport` of bytes and wall time.

A swapped block is read from the device layout ([k, l, block, c, d]: k * l strided runs), moved as
one contiguous [1, k, l, c, d] unit and stored block-major on the host; swap-in is the mirror image.
The program loops over the real blocks only: per block one dynamic-slice, one transfer and one
dynamic-update-slice, the pattern XLA's host offloading handles for activations inside scans
(a scatter with dynamic indices into a pinned_host array has crashed XLA's GPU compiler).

Shape legend: x swapped blocks (the padded bucket), k kv heads, l layers, c block size, d head dim.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier.buckets import pow2_bucket
from jaxtier.kvcache.paged import PagedKVCache


@dataclasses.dataclass(frozen=True)
class SwapReport:
  """What one swap moved and how long it took (compilation reported apart, 0 when cached)."""
  direction: str  # "out" (device -> host) or "in" (host -> device)
  num_blocks: int
  bucket: int  # the padded block count the program was compiled for
  bytes: int  # bytes of the real blocks (K, V and scales, all layers)
  seconds: float
  compile_seconds: float

  @property
  def gbps(self) -> float:
    return self.bytes / self.seconds / 1e9


def _blocks_to_host_major(pool_klx) -> jax.Array:
  """[k, l, x, ...] -> [x, k, l, ...]: a free reshape when x == 1."""
  return jnp.moveaxis(pool_klx, 2, 0)


def swap_out_padded(cache: PagedKVCache, device_ids_x, host_ids_x, count) -> PagedKVCache:
  """The jittable core of `swap_out`: ids padded to x past `count` (the padding is not read)."""
  def body(i, host):
    block = jax.tree.map(
        lambda a: _blocks_to_host_major(jax.lax.dynamic_slice_in_dim(a, device_ids_x[i], 1, 2)),
        cache.device)
    block = jax.device_put(block, jax.memory.Space.Host)
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, host_ids_x[i], 0),
                        host, block)
  return cache.replace(host=jax.lax.fori_loop(0, count, body, cache.host))


def swap_in_padded(cache: PagedKVCache, host_ids_x, device_ids_x, count) -> PagedKVCache:
  """The jittable core of `swap_in`: ids padded to x past `count` (the padding is not read)."""
  def body(i, device):
    block = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, host_ids_x[i], 1, 0),
                         cache.host)
    block = jax.device_put(block, jax.memory.Space.Device)
    return jax.tree.map(
        lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, jnp.moveaxis(b, 0, 2),
                                                         device_ids_x[i], 2),
        device, block)
  return cache.replace(device=jax.lax.fori_loop(0, count, body, cache.device))


_JITTED = {
    "out": jax.jit(swap_out_padded, donate_argnums=0),
    "in": jax.jit(swap_in_padded, donate_argnums=0),
}
_COMPILED = {}


def clear_compiled() -> None:
  """Drops the compiled swap programs of this process (`jaxtier.engine.runner.release_programs`
  drops them with the rest)."""
  _COMPILED.clear()


def _ids(name: str, ids, pool_size: int) -> np.ndarray:
  ids = np.asarray(ids)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{name} must be a non-empty 1-D list of integers, got {ids.shape} "
                     f"{ids.dtype}")
  bad = ids[(ids < 0) | (ids >= pool_size)]
  if bad.size:
    raise ValueError(f"{name} {sorted(set(bad.tolist()))[:8]} are outside [0, {pool_size})")
  return ids.astype(np.int32)


def _compiled(direction: str, args) -> tuple[jax.stages.Compiled, float]:
  """The compiled program for these argument shapes and placements, and its compile time (0 if
  it was compiled before)."""
  cache, ids_x = args[0], args[1]
  key = (direction, ids_x.size, jax.tree.structure(cache),
         tuple((a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(cache)))
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  _COMPILED[key] = _JITTED[direction].lower(*args).compile()
  return _COMPILED[key], time.perf_counter() - start


def _run(direction: str, cache: PagedKVCache, src, dst, src_size: int, dst_size: int,
         names: tuple[str, str]) -> tuple[PagedKVCache, SwapReport]:
  if not isinstance(cache, PagedKVCache):
    raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  src, dst = _ids(names[0], src, src_size), _ids(names[1], dst, dst_size)
  if src.size != dst.size:
    raise ValueError(f"{names[0]} has {src.size} ids but {names[1]} has {dst.size}")
  if np.unique(dst).size != dst.size:
    raise ValueError(f"{names[1]} {dst.tolist()} name a destination block twice")
  n, x = src.size, pow2_bucket(src.size)
  args = (cache, np.pad(src, (0, x - n), constant_values=src_size),
          np.pad(dst, (0, x - n), constant_values=dst_size), np.int32(n))
  compiled, compile_seconds = _compiled(direction, args)
  start = time.perf_counter()
  cache = jax.block_until_ready(compiled(*args))
  seconds = time.perf_counter() - start
  return cache, SwapReport(direction, n, x, n * cache.config.bytes_per_block, seconds,
                           compile_seconds)


def swap_out(cache: PagedKVCache, device_ids, host_ids) -> tuple[PagedKVCache, SwapReport]:
  """Copies device blocks `device_ids[i]` into host slots `host_ids[i]`; donates `cache`.

  Device blocks keep their contents (the caller frees them). Returns the new cache and a report.
  """
  c = cache.config
  return _run("out", cache, device_ids, host_ids, c.num_device_blocks, c.num_host_blocks,
              ("device_ids", "host_ids"))


def swap_in(cache: PagedKVCache, host_ids, device_ids) -> tuple[PagedKVCache, SwapReport]:
  """Copies host blocks `host_ids[i]` into device slots `device_ids[i]`; donates `cache`.

  Returns the new cache and a report.
  """
  c = cache.config
  return _run("in", cache, host_ids, device_ids, c.num_host_blocks, c.num_device_blocks,
              ("host_ids", "device_ids"))
