"""Where every array lives over a device mesh: logical axis names, one rules table, one mesh.

Each parameter and each KV pool dimension has a logical name (vocab, embed, heads, kv_heads,
head_dim, mlp, layers, blocks), as jax-llm-examples and MaxText name them; `RULES` maps logical
names to mesh axes. Everything else asks this module: the loaders place each checkpoint tensor with
`param_sharding`, the KV pools are allocated with `kv_pool_shardings`, the offloaded tail keeps its
host stack's sharding with memory kind `pinned_host`. The mesh is one axis, `tp` (tensor parallel,
Megatron style): attention is split by heads and the MLP by its hidden width, so each layer needs
two all-reduces (after `o_proj` and after `down_proj`), and the embedding and LM head are
replicated (`vocab` maps to no mesh axis; the logits need no gather before sampling).

Tensor parallelism splits the kv heads too, so `num_kv_heads` must be a multiple of the tensor
parallel size: a larger size is rejected with an error rather than replicating kv heads as vLLM
does (replication would store every kv head tp / num_kv_heads times and complicate the swap, whose
unit is one kv-head shard of a block).

Parameter names are those of `jaxtier.model` (canonical `q_proj/kernel` etc., and the fused
`qkv_kernel`, `gate_up_kernel`, `o_kernel`, `down_kernel` of the CPU unrolled layers, which are only
used unsharded and replicated). A stacked parameter has one more dimension than its per-layer form:
the leading `layers` axis, never sharded.
"""

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtier.model.config import ModelConfig

TP = "tp"
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "blocks")
# logical axis -> mesh axis (None: replicated). The one place that decides every sharding.
RULES: dict[str, str | None] = {
    "vocab": None, "embed": None, "heads": TP, "kv_heads": TP, "head_dim": None, "mlp": TP,
    "layers": None, "blocks": None,
}

# Per-layer parameter name (the last two path elements, or one) -> logical axes of its dims.
# `heads` / `kv_heads` name a flattened (heads x head_dim) dimension: split at head boundaries.
PARAM_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("lm_head",): ("vocab", "embed"),
    ("final_norm", "scale"): ("embed",),
    ("attn_norm", "scale"): ("embed",),
    ("mlp_norm", "scale"): ("embed",),
    ("post_attn_norm", "scale"): ("embed",),
    ("post_mlp_norm", "scale"): ("embed",),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("q_norm", "scale"): ("head_dim",),
    ("k_norm", "scale"): ("head_dim",),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("router",): ("embed", None),
    ("expert_gate",): (None, "embed", "mlp"),
    ("expert_up",): (None, "embed", "mlp"),
    ("expert_down",): (None, "mlp", "embed"),
    ("inv_freq",): (None,),
}
# Compact projections (`jaxtier.model.quant`, `model.QLinear`): the values split as the float
# kernel; a scale or minimum per group of input rows, its rows replicated (a per-channel scale has
# one).
for _proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
  _axes = PARAM_AXES[(_proj, "kernel")]
  PARAM_AXES[(_proj, "values")] = _axes
  PARAM_AXES[(_proj, "scales")] = PARAM_AXES[(_proj, "mins")] = (None, _axes[1])
  PARAM_AXES[(_proj, "perm")] = (None,)  # act-order: the input rows' order, replicated
# A mixture of experts' compact expert stacks (`model.QExperts`, [e, in, out] per part).
for _name in ("expert_gate", "expert_up", "expert_down"):
  _axes = PARAM_AXES[(_name,)]
  PARAM_AXES[(_name, "values")] = _axes
  PARAM_AXES[(_name, "scales")] = PARAM_AXES[(_name, "mins")] = (None, None, _axes[2])
  PARAM_AXES[(_name, "perm")] = (None, None)
# A vocabulary table held compact for the LM head ([hidden, vocab], `model.CompactTable`).
PARAM_AXES[("compact_head", "values")] = ("embed", "vocab")
PARAM_AXES[("compact_head", "scales")] = PARAM_AXES[("compact_head", "mins")] = (None, "vocab")
# Fused (and perhaps packed, `jaxtier.kernels.cpu.matmul`) projections of FusedDecoderLayer:
# replicated whatever their rank (concatenated outputs do not split at head boundaries); the model
# does not fuse when tensor parallel.
REPLICATED = ("qkv_kernel", "qkv_bias", "gate_up_kernel", "o_kernel", "down_kernel",
              "packed_head")
# KV blocks (see jaxtier.kvcache.paged and .swap): the device pool [k, l, p, c, d], and one block
# in the host tier [k, l, c, d].
DEVICE_POOL_AXES = ("kv_heads", "layers", "blocks", None, "head_dim")
HOST_BLOCK_AXES = ("kv_heads", "layers", None, "head_dim")


def make_mesh(tensor_parallel_size: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A one-axis (`tp`) mesh over the first `tensor_parallel_size` of this process's devices."""
  devices = list(jax.local_devices() if devices is None else devices)
  if not 1 <= tensor_parallel_size <= len(devices):
    raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: expected 1 to "
                     f"{len(devices)}, the devices this process has ({devices[0].platform})")
  return Mesh(np.array(devices[:tensor_parallel_size]), (TP,))


def mesh_of(tree) -> Mesh | None:
  """The mesh the array leaves of `tree` are sharded over (None when no leaf has a
  `NamedSharding`: a model its user placed on one device)."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf.sharding, NamedSharding):
      return leaf.sharding.mesh
  return None


def tp_size(mesh: Mesh | None) -> int:
  return 1 if mesh is None else mesh.shape[TP]


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
  """Raises ValueError when the model's heads or MLP width do not split `size` ways."""
  if size == 1:
    return
  dims = {"num_kv_heads": config.num_kv_heads, "num_heads": config.num_heads,
          "intermediate_size": config.intermediate_size}
  bad = {k: v for k, v in dims.items() if v % size}
  if bad:
    raise ValueError(f"tensor_parallel_size={size} does not divide {bad}: tensor parallelism "
                     "splits the kv heads, query heads and MLP width evenly (kv heads are not "
                     f"replicated); expected a divisor of num_kv_heads={config.num_kv_heads}")


def spec(axes: Sequence[str | None], rules: dict[str, str | None] | None = None) -> PartitionSpec:
  """The PartitionSpec of logical `axes` under `rules` (default `RULES`)."""
  rules = RULES if rules is None else rules
  unknown = [a for a in axes if a is not None and a not in rules]
  if unknown:
    raise ValueError(f"logical axes {unknown} have no rule; known: {sorted(rules)}")
  return PartitionSpec(*(None if a is None else rules[a] for a in axes))


def param_axes(path: Sequence[str], ndim: int) -> tuple[str | None, ...]:
  """Logical axes of the parameter at `path` (any arrangement of jaxtier's model: stacked,
  sliced into groups or per layer) with `ndim` dims; a leading extra dim is `layers`."""
  path = tuple(str(p) for p in path)
  if path[-1] in REPLICATED:
    return (None,) * ndim
  axes = PARAM_AXES.get(path[-2:]) or PARAM_AXES.get(path[-1:])
  if axes is None:
    raise ValueError(f"parameter {'/'.join(path)} has no logical axes in jaxtier.model.sharding")
  if ndim == len(axes) + 1:
    return ("layers",) + axes
  if ndim != len(axes):
    raise ValueError(f"parameter {'/'.join(path)} has {ndim} dims; its logical axes are {axes}")
  return axes


def named(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int], memory_kind: str,
          name: str = "array", rules: dict[str, str | None] | None = None) -> NamedSharding:
  """The NamedSharding of an array with logical `axes`, checking each sharded dim divides."""
  pspec = spec(axes, rules)
  for dim, mesh_axis in zip(shape, pspec):
    if mesh_axis is not None and dim % mesh.shape[mesh_axis]:
      raise ValueError(f"{name} {tuple(shape)}: dim {dim} does not split over mesh axis "
                       f"{mesh_axis!r} of size {mesh.shape[mesh_axis]}")
  return NamedSharding(mesh, pspec, memory_kind=memory_kind)


def param_sharding(mesh: Mesh, path: Sequence[str], shape: Sequence[int], memory_kind: str,
                   rules: dict[str, str | None] | None = None) -> NamedSharding:
  """Where the parameter at `path` with `shape` lives: its mesh sharding in `memory_kind`."""
  return named(mesh, param_axes(path, len(shape)), shape, memory_kind, "/".join(map(str, path)),
               rules)


def kv_pool_shardings(mesh: Mesh, device_kind: str = "device", host_kind: str = "pinned_host",
                      rules: dict[str, str | None] | None = None
                      ) -> tuple[NamedSharding, NamedSharding]:
  """Shardings of the device pool and of one block of the host tier (both split over kv heads, so
  a swap moves each device's own kv-head shard of a block between its device and host memory)."""
  return (NamedSharding(mesh, spec(DEVICE_POOL_AXES, rules), memory_kind=device_kind),
          NamedSharding(mesh, spec(HOST_BLOCK_AXES, rules), memory_kind=host_kind))


def scale_sharding(values: NamedSharding) -> NamedSharding:
  """Sharding of int8 scales beside `values` (the same dims without the last, head_dim; `values`
  names every dim, as `kv_pool_shardings` does)."""
  return NamedSharding(values.mesh, PartitionSpec(*tuple(values.spec)[:-1]),
                       memory_kind=values.memory_kind)
