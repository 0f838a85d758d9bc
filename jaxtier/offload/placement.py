"""Which memory kind each array lives in, moving pytrees between kinds, and counting their bytes.

JAX memory kinds: "device" (HBM on an accelerator), "pinned_host" (page-locked host memory the
device can DMA from), "unpinned_host". On CPU they are one physical memory; placement and numerics
are still real, transfer speed is not (a transfer between kinds compiles to nothing there).
"""

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jaxtier.model.quant import array_bytes

DEVICE = "device"
PINNED_HOST = "pinned_host"
HOST_KINDS = ("pinned_host", "unpinned_host")


def check_memory_kind(kind: str, name: str = "memory_kind") -> str:
  """Returns `kind` if the default device offers it; raises ValueError naming `name` otherwise."""
  kinds = tuple(m.kind for m in jax.local_devices()[0].addressable_memories())
  if kind not in kinds:
    raise ValueError(f"{name}={kind!r} is not a memory kind of {jax.local_devices()[0]}; "
                     f"expected one of {kinds}")
  return kind


def to_memory_kind(tree: Any, kind: str) -> Any:
  """Copies every array leaf of `tree` into memory kind `kind`, keeping its sharding otherwise;
  an abstract leaf (`jax.ShapeDtypeStruct`) gets that sharding."""
  def move(a):
    target = a.sharding.with_memory_kind(kind)
    if isinstance(a, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target)
    return jax.device_put(a, target)
  return jax.tree.map(move, tree)


def memory_kinds(tree: Any) -> set[str]:
  """The set of memory kinds the array leaves of `tree` live in."""
  return {a.sharding.memory_kind for a in jax.tree.leaves(tree)}


def tree_bytes(tree: Any) -> int:
  """Bytes of all array leaves of `tree` (global shapes; 4-bit values at half a byte,
  `jaxtier.model.quant.array_bytes`)."""
  return sum(array_bytes(a) for a in jax.tree.leaves(tree))


def bytes_by_memory_kind(tree: Any) -> dict[str, int]:
  """{memory kind: bytes} over the array leaves of `tree`."""
  out: dict[str, int] = {}
  for a in jax.tree.leaves(tree):
    kind = a.sharding.memory_kind
    out[kind] = out.get(kind, 0) + array_bytes(a)
  return out


def bytes_per_device(tree: Any) -> dict[str, int]:
  """{memory kind: bytes} that one device holds of the array leaves of `tree` (its shards; under
  tensor parallelism the per-device share, replicated leaves counted whole)."""
  out: dict[str, int] = {}
  for a in jax.tree.leaves(tree):
    kind = a.sharding.memory_kind
    shard = a.sharding.shard_shape(a.shape)
    out[kind] = out.get(kind, 0) + array_bytes(jax.ShapeDtypeStruct(shard, a.dtype))
  return out


def layer_sharding(stacked: Sharding, kind: str) -> Sharding:
  """The sharding, in memory kind `kind`, of one layer sliced out of a stacked [layers, ...] array.

  A single-device sharding is kept as is; a named sharding drops its leading (layer) axis, which
  must be unsharded for a layer slice to live on every device that holds the stack.
  """
  if isinstance(stacked, SingleDeviceSharding):
    return stacked.with_memory_kind(kind)
  if isinstance(stacked, NamedSharding):
    spec = tuple(stacked.spec)
    if spec and spec[0] is not None:
      raise ValueError(f"stacked layer sharding {stacked} shards the layer axis ({spec[0]!r}); "
                       "expected the leading axis unsharded")
    return NamedSharding(stacked.mesh, PartitionSpec(*spec[1:]), memory_kind=kind)
  raise TypeError(f"sharding {stacked!r} is not supported; expected a SingleDeviceSharding or a "
                  "NamedSharding")
