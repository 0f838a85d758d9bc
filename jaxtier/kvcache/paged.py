"""A paged KV cache: device block pools for all layers (its host tier lives in `swap.HostTier`).

The cache is one pytree. Its device pool holds K and V for every layer, in the flat-page layout the
attention kernels read (see `paged_attention`). Blocks swapped to the host are held apart, outside
the cache, by `jaxtier.kvcache.swap.HostTier` (one pinned buffer per block): the model's programs
never take them, and the config's `num_host_blocks` is the tier's capacity.
Which block belongs to which sequence is not part of the cache: it travels per step in
`PagedMetadata`, built by whoever allocates blocks. bfloat16 KV is stored as uint16 bit patterns on
CPU (see `quant.storage_dtype`).

`cache.update_and_attend(layer, q, k, v, pos, meta)` is the contract with the model (see
`contiguous.py`): the new tokens are scattered into their slots (in place when the cache is
donated), then the layer attends. Every jit that takes and returns the cache must donate it, or XLA
copies the pool on every call.

Shape legend: l layers, k kv heads, p device blocks, h host blocks, c block size, d head dim,
b batch, t new tokens, n query heads, m blocks per sequence (table width), f flat pages (l * p).
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxtier.attention import dispatch
from jaxtier.attention.dispatch import attention_path, resolve_attention_impl
from jaxtier.attention.names import ATTENTION_IMPLS
from jaxtier.attention.page_format import (KV_CACHE_DTYPES, SCALE_DTYPE, encode, quantize_int8,
                                           storage_dtype)
from jaxtier.common.checks import check_block_size, check_choice, check_int
from jaxtier.common.kv_bytes import check_kv_cache_dtype, kv_block_bytes
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.model import sharding


@dataclasses.dataclass(frozen=True)
class PagedCacheConfig:
  """Shape, pool sizes, storage dtype and attention path of a paged cache.

  No field has a default: the pool sizes, block size, dtype and attention path are engine
  arguments (`jaxtier.engine.args.EngineArgs` holds their defaults; the engine sizes both pools
  in blocks before it builds the cache), and the shape is the model's. `attention_impl` picks the
  attention path (see `paged_attention`'s module docstring): "cpu" is the CPU kernels
  (`jaxtier.kernels.cpu.library`; decode and prefill rows), "pallas" the GPU kernel (decode and
  prefill rows), "pallas_tpu" the TPU kernel (decode steps it fits; others take the gathered XLA
  path), "xla" the XLA path of the platform (the chunked loop on CPU, "xla_gathered" on
  accelerators), "xla_gathered" the gathered XLA path anywhere, "reference" the test path, and
  "pallas_interpret" / "pallas_tpu_interpret" the kernels run on CPU by Pallas' interpreters; "auto"
  becomes "cpu" for a pool on one CPU device when the kernels build, "pallas" / "pallas_tpu" for a
  pool on one GPU / TPU, else the platform's XLA path (see `resolve_attention_impl`;
  `attention_path` says which path each call takes).

  Attributes:
    num_layers, num_kv_heads, head_dim: the model's KV shape.
    num_device_blocks: blocks in the device pool.
    block_size: tokens per block.
    num_host_blocks: blocks the pinned-host tier holds at most (0: none; `swap.HostTier`).
    kv_cache_dtype: one of `quant.KV_CACHE_DTYPES`.
    attention_impl: one of ATTENTION_IMPLS.
  """
  num_layers: int
  num_kv_heads: int
  head_dim: int
  num_device_blocks: int
  block_size: int
  num_host_blocks: int
  kv_cache_dtype: str
  attention_impl: str

  def __post_init__(self):
    for name in ("num_layers", "num_kv_heads", "head_dim", "num_device_blocks"):
      check_int(name, getattr(self, name), 1)
    check_block_size(self.block_size)
    check_int("num_host_blocks", self.num_host_blocks, 0)
    check_kv_cache_dtype(self.kv_cache_dtype)
    check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)

  @property
  def quantized(self) -> bool:
    """Whether values are stored as int8 with a float32 scale per token (kv_cache_dtype "int8")."""
    return self.kv_cache_dtype == "int8"

  @property
  def bytes_per_block(self) -> int:
    """Bytes of K plus V (plus INT8 scales) of one block over all layers: what a swap moves."""
    return kv_block_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_cache_dtype,
                          self.block_size)


@flax.struct.dataclass(frozen=True)
class KVBlocks:
  """K and V blocks, with float32 scales when the values are int8 (None otherwise).

  The device pool is [k, l, p, c, d] (scales [k, l, p, c]); one block of the host tier is
  [k, l, c, d] (scales [k, l, c]).
  """
  k: jax.Array
  v: jax.Array
  k_scales: jax.Array | None = None
  v_scales: jax.Array | None = None


@flax.struct.dataclass(frozen=True)
class PagedMetadata:
  """Per-step attention metadata: each sequence's device block ids, in order.

  Entry [b, i] holds the block of token positions i * block_size ... (i + 1) * block_size - 1 of
  sequence b; -1 marks an unused entry. Positions beyond the table are neither written nor read.
  """
  block_tables_bm: jax.Array  # [batch, max_blocks_per_seq] int32

  @classmethod
  def create(cls, block_tables_bm, num_blocks: int) -> "PagedMetadata":
    """Validates concrete block tables (int32 [batch, width], ids in [-1, num_blocks))."""
    tables = np.asarray(block_tables_bm)
    if tables.ndim != 2 or not np.issubdtype(tables.dtype, np.integer):
      raise ValueError(f"block tables {tables.shape} {tables.dtype} must be integer [batch, width]")
    bad = tables[(tables < -1) | (tables >= num_blocks)]
    if bad.size:
      raise ValueError(f"block ids {sorted(set(bad.tolist()))[:8]} are outside [-1, {num_blocks})")
    return cls(jnp.asarray(tables, jnp.int32))


def _zeros(shape, dtype, target) -> jax.Array:
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=target)()


def _scale_sharding(values):
  if isinstance(values, jax.sharding.NamedSharding):
    return sharding.scale_sharding(values)
  return values


def _abstract(shape, dtype, target) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=target)


def _allocate(leading: tuple[int, ...], config: PagedCacheConfig, target, platform: str,
              make=_zeros) -> KVBlocks:
  """K and V (and int8 scales) of one pool, each `make(shape, dtype, sharding)`, stored in the
  dtype `platform` stores them in."""
  shape = leading + (config.block_size,)
  value_dtype = storage_dtype(config.kv_cache_dtype, platform)
  values = [make(shape + (config.head_dim,), value_dtype, target) for _ in range(2)]
  scales = [make(shape, SCALE_DTYPE, _scale_sharding(target)) if config.quantized else None
            for _ in range(2)]
  return KVBlocks(*values, *scales)


@flax.struct.dataclass(frozen=True)
class PagedKVCache:
  """The device block pool of a paged KV cache (see the module docstring).

  Create it with `PagedKVCache.create(PagedCacheConfig(...))`; each model call takes a
  `PagedMetadata` of block tables. `jaxtier.kvcache.swap_out` / `swap_in` move whole blocks
  between the pool and a `swap.HostTier`.
  """
  device: KVBlocks  # [kv_heads, layers, blocks, block_size, head_dim] in `device` memory
  config: PagedCacheConfig = flax.struct.field(pytree_node=False)

  @classmethod
  def create(cls, config: PagedCacheConfig, device: jax.Device | None = None,
             mesh: jax.sharding.Mesh | None = None) -> "PagedKVCache":
    """Allocates the device pool (zeros) over `mesh` (split by kv heads, see
    `jaxtier.model.sharding`), or on `device` (default: this process's first device).

    The pool holds `config.num_device_blocks` blocks (the host tier, `swap.HostTier.empty`,
    takes memory only as blocks are swapped out); "auto" attention is resolved for the mesh
    (`resolve_attention_impl`) and kept in the returned cache's config. Raises ValueError when
    the kv heads do not split over the mesh.
    """
    return cls._build(config, device, mesh, None, _zeros)

  @classmethod
  def abstract(cls, config: PagedCacheConfig, mesh: jax.sharding.Mesh | None = None,
               platform: str | None = None) -> "PagedKVCache":
    """The cache `create` would allocate, its pool `jax.ShapeDtypeStruct`s with the same
    shardings and memory kinds (nothing is allocated): the argument of a program traced or
    exported (`jax.export`) without running it. `platform` ("cpu", "gpu", "tpu"; default: the
    mesh's): the platform whose storage dtype and "auto" attention the cache takes, for a
    program exported for another platform than this process's."""
    return cls._build(config, None, mesh, platform, _abstract)

  @classmethod
  def _build(cls, config: PagedCacheConfig, device, mesh, platform, make) -> "PagedKVCache":
    if mesh is None:
      mesh = sharding.make_mesh(1, [device or jax.local_devices()[0]])
    platform = platform or mesh.devices.flat[0].platform
    config = dataclasses.replace(
        config, attention_impl=resolve_attention_impl(config.attention_impl, mesh, platform))
    k, l = config.num_kv_heads, config.num_layers
    if k % sharding.tp_size(mesh):
      raise ValueError(f"num_kv_heads={k} does not split over {sharding.tp_size(mesh)} devices")
    dev, _ = sharding.kv_pool_shardings(mesh)
    return cls(_allocate((k, l, config.num_device_blocks), config, dev, platform, make), config)

  def update_and_attend(self, layer: jax.Array, q_btnd: jax.Array, k_btkd: jax.Array,
                        v_btkd: jax.Array, pos_bt: jax.Array, meta: PagedMetadata,
                        window: jax.Array | int | None = None, cap: float | None = None
                        ) -> tuple["PagedKVCache", jax.Array]:
    """Writes the new tokens of `layer`, then attends over the sequence's cached tokens.

    The model calls this from each decoder layer (the cache contract of `jaxtier.kvcache`).

    Args:
      layer: index of the layer (may be traced, as inside the model's `lax.scan`).
      q_btnd: queries [b, t, n, d] of the new tokens (rotary embedding applied).
      k_btkd, v_btkd: their keys and values [b, t, k, d].
      pos_bt: each new token's position [b, t]; below zero marks padding, not written.
      meta: the block table of each row's sequence; position i lives in block
        `meta.block_tables_bm[b, i // block_size]`.
      window: the layer's sliding window (a query at p sees p - window + 1..p; may be traced),
        or None: every earlier position. Every block stays in the cache either way.
      cap: the scores' soft cap (cap * tanh(score / cap)), or None.

    Returns:
      (the cache with the new tokens written, attention output [b, t, n, d]). A decode step on
      a float pool with the "cpu" impl writes and attends in one kernel call; otherwise
      `write_chunk` then `attend`.
    """
    if (self.config.attention_impl == "cpu" and q_btnd.shape[1] == 1
        and not self.config.quantized and window is None and cap is None):
      return write_and_attend_cpu(self, layer, q_btnd, k_btkd, v_btkd, pos_bt, meta)
    cache = write_chunk(self, layer, k_btkd, v_btkd, pos_bt, meta)
    return cache, attend(cache, layer, q_btnd, pos_bt, meta, window, cap)


def _check(cache: PagedKVCache, x_btkd, pos_bt, meta, name: str) -> None:
  cfg = cache.config
  if not isinstance(meta, PagedMetadata):
    raise ValueError(f"meta must be a PagedMetadata, got {type(meta).__name__}")
  b, t = pos_bt.shape
  heads = x_btkd.shape[2] if x_btkd.ndim == 4 else 0
  fits_heads = heads % cfg.num_kv_heads == 0 if name == "q" else heads == cfg.num_kv_heads
  if x_btkd.shape[:2] != (b, t) or x_btkd.shape[-1] != cfg.head_dim or not heads or not fits_heads:
    raise ValueError(f"{name} {x_btkd.shape} does not fit {pos_bt.shape=}, {cfg.num_kv_heads=} "
                     f"and {cfg.head_dim=}")
  tables = meta.block_tables_bm
  if tables.ndim != 2 or tables.shape[0] != b or tables.dtype != jnp.int32:
    raise ValueError(f"block tables {tables.shape} {tables.dtype} must be int32 [batch={b}, width]")
  if pos_bt.dtype != jnp.int32:
    raise ValueError(f"{pos_bt.dtype=} must be int32")


def _flat(pool_klp) -> jax.Array:
  """[k, l, p, ...] -> [k, l * p, ...], a free reshape."""
  if pool_klp is None:
    return None
  return pool_klp.reshape((pool_klp.shape[0], -1) + pool_klp.shape[3:])


def _pages_bm(cache: PagedKVCache, layer, meta: PagedMetadata) -> jax.Array:
  tables_bm = meta.block_tables_bm
  return jnp.where(tables_bm >= 0, tables_bm + layer * cache.config.num_device_blocks, -1)


def write_chunk(cache: PagedKVCache, layer: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array,
                pos_bt: jax.Array, meta: PagedMetadata) -> PagedKVCache:
  """Scatters a chunk of new tokens (prefill or decode) of one layer into their slots.

  Tokens with a negative position, an unused (-1) table entry or a position beyond the table are
  dropped. Only the new tokens are written: in place when the cache is donated.
  """
  if k_btkd.shape != v_btkd.shape:
    raise ValueError(f"{k_btkd.shape=} must equal {v_btkd.shape=}")
  _check(cache, k_btkd, pos_bt, meta, "k")
  cfg, dev = cache.config, cache.device
  c, m = cfg.block_size, meta.block_tables_bm.shape[1]
  pages_bm = _pages_bm(cache, layer, meta)
  page_bt = jnp.take_along_axis(pages_bm, jnp.clip(pos_bt // c, 0, m - 1), axis=1)
  keep_bt = (pos_bt >= 0) & (pos_bt < m * c) & (page_bt >= 0)
  dropped = cfg.num_layers * cfg.num_device_blocks  # a page out of range: the write is dropped
  page_bt = jnp.where(keep_bt, page_bt, dropped)
  offset_bt = pos_bt % c
  # XLA rewrites a scatter of a single update into a bounds-checked dynamic-update-slice inside a
  # conditional, and copies the whole pool around the conditional (every layer, every step of a
  # batch-1 decode). A second, dropped update keeps it a scatter, which updates in place.
  single = page_bt.size == 1
  if single:
    page_bt = jnp.pad(page_bt, ((0, 0), (0, 1)), constant_values=dropped)
    offset_bt = jnp.pad(offset_bt, ((0, 0), (0, 1)))

  def scatter(pool_klp, new_bt):
    assert new_bt.dtype == pool_klp.dtype, (new_bt.dtype, pool_klp.dtype)
    if single:
      new_bt = jnp.pad(new_bt, ((0, 0), (0, 1)) + ((0, 0),) * (new_bt.ndim - 2))
    flat = _flat(pool_klp).at[:, page_bt, offset_bt].set(jnp.moveaxis(new_bt, 2, 0), mode="drop")
    return flat.reshape(pool_klp.shape)

  if cfg.quantized:
    (k_q, k_s), (v_q, v_s) = quantize_int8(k_btkd), quantize_int8(v_btkd)
    new = KVBlocks(scatter(dev.k, k_q), scatter(dev.v, v_q), scatter(dev.k_scales, k_s),
                   scatter(dev.v_scales, v_s))
  else:
    new = KVBlocks(scatter(dev.k, encode(k_btkd, cfg.kv_cache_dtype, dev.k.dtype)),
                   scatter(dev.v, encode(v_btkd, cfg.kv_cache_dtype, dev.v.dtype)))
  return cache.replace(device=new)


def attend(cache: PagedKVCache, layer: jax.Array, q_btnd: jax.Array, pos_bt: jax.Array,
           meta: PagedMetadata, window: jax.Array | int | None = None,
           cap: float | None = None) -> jax.Array:
  """Attention of queries at `pos_bt` over the cached tokens of `layer` (within a sliding
  `window`, scores soft-capped at `cap`, where given); output [b, t, n, d]. The implementation
  is `attention_path`'s for the cache's attention_impl: a layer with a window or a cap runs an
  XLA path where the kernel has neither."""
  _check(cache, q_btnd, pos_bt, meta, "q")
  cfg, dev = cache.config, cache.device
  args = (q_btnd, _flat(dev.k), _flat(dev.v), _pages_bm(cache, layer, meta), pos_bt,
          _flat(dev.k_scales), _flat(dev.v_scales))
  path = attention_path(cfg.attention_impl, q_btnd.shape[1], cfg.head_dim, cfg.block_size,
                        cfg.quantized, window is not None, cap is not None)
  return dispatch.attend(path, *args, window, cap)


def write_and_attend_cpu(cache: PagedKVCache, layer: jax.Array, q_b1nd: jax.Array,
                         k_b1kd: jax.Array, v_b1kd: jax.Array, pos_b1: jax.Array,
                         meta: PagedMetadata) -> tuple[PagedKVCache, jax.Array]:
  """A decode step's `write_chunk` then `attend` for a float32 or bfloat16 pool, as one CPU
  kernel call that writes each row's new key and value in place and attends (XLA ran seven small
  ops per layer around the attention kernel for the slot indices, scatters and clamped table).
  Same rules and results as the two calls it replaces; output [b, 1, n, d]."""
  _check(cache, k_b1kd, pos_b1, meta, "k")
  _check(cache, q_b1nd, pos_b1, meta, "q")
  if k_b1kd.shape != v_b1kd.shape:
    raise ValueError(f"{k_b1kd.shape=} must equal {v_b1kd.shape=}")
  cfg, dev = cache.config, cache.device
  b, _, n, d = q_b1nd.shape
  k_pages, v_pages = dev.k, dev.v  # [k, l, p, c, d]: the kernel addresses page l * p + i
  new = [encode(x[:, 0], cfg.kv_cache_dtype, dev.k.dtype) for x in (k_b1kd, v_b1kd)]
  offset = jnp.asarray(layer, jnp.int32) * jnp.int32(cfg.num_device_blocks)
  out_bnd, k_pages, v_pages = jax.ffi.ffi_call(
      cpu_kernels.WRITE_ATTENTION_TARGET,
      (jax.ShapeDtypeStruct((b, n, d), jnp.float32),
       jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
       jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
      input_output_aliases={3: 1, 4: 2}, vmap_method="sequential")(
          q_b1nd[:, 0].astype(jnp.float32), *new, k_pages, v_pages, meta.block_tables_bm,
          pos_b1[:, 0], offset, scale=np.float32(d ** -0.5))
  cache = cache.replace(device=dev.replace(k=k_pages, v=v_pages))
  return cache, out_bnd[:, None].astype(q_b1nd.dtype)


def device_pool_bytes(cache: PagedKVCache) -> int:
  """Bytes held by the device pool (values and scales)."""
  return sum(x.nbytes for x in jax.tree.leaves(cache.device))


def host_pool_bytes(cache: PagedKVCache) -> int:
  """Bytes of the pinned-host tier when full (`num_host_blocks` blocks, values and scales, as
  stored): the most pinned memory it takes."""
  return device_pool_bytes(cache) // cache.config.num_device_blocks * cache.config.num_host_blocks
