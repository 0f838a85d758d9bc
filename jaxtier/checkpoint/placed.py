"""Placement-first loading: each checkpoint tensor goes straight to where the running model keeps it.

Before any weight is read, the model's arrangement (`Layout`: which layers form which group, which
groups live in pinned host memory, the mesh) fixes a placement for every parameter: a
`NamedSharding` from `jaxtier.sharding` with its memory kind, `device` for the embedding, norms,
LM head and resident layers, `pinned_host` for the offloaded tail. `build` then walks the groups
and, for each parameter, reads its tensor from a `TensorSource` into host memory (one tensor: all
the layers of one group, or one layer of an unrolled group) and puts it into its placement with
`jax.make_array_from_callback`, which hands each device only its own shard (unrolled groups read
each tensor once for the group and place it layer by layer). Nothing is placed
anywhere else first: no step holds the whole model on one device, the tail's bytes never exist in
device memory, and device-kind bytes never exceed the resident share (tested with
`jax.live_arrays()` after every tensor). A source that can restore into a sharding itself (Orbax)
does so for whole tensors. Host memory holds, besides the source's memory maps, one tensor at a
time.

The groups built here are the ones `GroupedTransformer` would cut out of a loaded stacked model
(`LayerStack`, `UnrolledLayers` fused from q/k/v and gate/up on the host, `OffloadedLayers`), which
stays the reference that tests compare against.
"""

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxtier import sharding
from jaxtier.checkpoint.params import (DERIVED, Path, TensorSource, _flatten, _unflatten,
                                       check_shapes)
from jaxtier.config import ModelConfig
from jaxtier.model import (DecoderLayer, FusedDecoderLayer, GroupedTransformer, LayerStack,
                           Transformer, UnrolledLayers, make_layer_stack)
from jaxtier.offload import placement
from jaxtier.offload.prefetch import OffloadedLayers

GROUP_MODES = ("scan", "unrolled", "offload")
Observer = Callable[[str, jax.Array], None]  # called after each tensor is placed


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a loaded model is arranged and placed.

  `groups`: consecutive (num_layers, mode) covering every layer, mode "scan" (a stacked scan on the
  device), "unrolled" (per-layer device buffers) or "offload" (a stack in pinned host memory,
  prefetched `prefetch_depth` layers ahead). `mesh`: the tensor-parallel mesh (None: this
  process's first device).
  """
  groups: tuple[tuple[int, str], ...]
  prefetch_depth: int = 1
  mesh: Mesh | None = None

  def __post_init__(self):
    bad = [m for _, m in self.groups if m not in GROUP_MODES]
    if not self.groups or bad or min(n for n, _ in self.groups) < 1:
      raise ValueError(f"layout groups {self.groups}: expected positive sizes and modes in "
                       f"{GROUP_MODES}")

  @classmethod
  def of(cls, num_layers: int, offload_tail_layers: int = 0, prefetch_depth: int = 1,
         layer_execution: str = "scan", mesh: Mesh | None = None) -> "Layout":
    """The resident head run as `layer_execution` and the last `offload_tail_layers` offloaded."""
    head = num_layers - offload_tail_layers
    groups = ((head, layer_execution),) if head else ()
    if offload_tail_layers:
      groups += ((offload_tail_layers, "offload"),)
    return cls(groups, prefetch_depth, mesh)

  @property
  def num_layers(self) -> int:
    return sum(n for n, _ in self.groups)

  @property
  def fused(self) -> bool:
    """Unrolled layers are fused unless tensor parallel (see `jaxtier.sharding`)."""
    return sharding.tp_size(self.mesh) == 1

  @property
  def plain(self) -> bool:
    """One stacked scan over all layers: the plain `Transformer`."""
    return len(self.groups) == 1 and self.groups[0][1] == "scan"


@dataclasses.dataclass(frozen=True)
class _Read:
  """How one parameter is made from checkpoint tensors: `paths` read at `layers` (None: the whole
  tensor; else those layers stacked), concatenated on the last axis when there are several."""
  paths: tuple[Path, ...]
  layers: Sequence[int] | None = None


class _Placer:
  def __init__(self, source: TensorSource, mesh: Mesh, dtype, observe: Observer | None):
    self.source, self.mesh, self.dtype, self.observe = source, mesh, jnp.dtype(dtype), observe

  def host(self, read: _Read) -> np.ndarray:
    parts = [self.source.read(p, read.layers) for p in read.paths]
    array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    return np.asarray(array, dtype=self.dtype)

  def place(self, name: Path, read: _Read | np.ndarray, spec: jax.ShapeDtypeStruct,
            kind: str) -> jax.Array:
    target = sharding.param_sharding(self.mesh, name, spec.shape, kind)
    array = None
    if isinstance(read, _Read) and read.layers is None and len(read.paths) == 1:
      array = self.source.place(read.paths[0], target, self.dtype)
    if array is None:
      host = read if isinstance(read, np.ndarray) else self.host(read)
      if host.shape != tuple(spec.shape):
        raise ValueError(f"{self.source.where}: {'/'.join(name)} reads as {host.shape}, expected "
                         f"{tuple(spec.shape)}")
      array = jax.make_array_from_callback(host.shape, target, lambda index: host[index])
    if self.observe is not None:
      self.observe("/".join(name), array)
    return array

  def fill(self, module: nnx.Module, recipe: Callable[[Path], _Read | np.ndarray],
           kind: str = placement.DEVICE, prefix: Path = ()) -> nnx.Module:
    """`module` (abstract) with every parameter placed from `recipe(path)`."""
    graphdef, state = nnx.split(module)
    values = {p: self.place(prefix + p, recipe(p), s, kind)
              for p, s in _flatten(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, _unflatten(values))
    return nnx.merge(graphdef, state)


def _whole(config: ModelConfig):
  def recipe(path: Path):
    if path in DERIVED:
      return np.asarray(config.inv_freq())
    return _Read((path,))
  return recipe


def _stacked(layers: range, total: int):
  whole = layers == range(total)
  return lambda sub: _Read((("layers",) + sub,), None if whole else list(layers))


def _unrolled(placer: _Placer, config: ModelConfig, dtype, layers: range,
              fused: bool) -> list[DecoderLayer]:
  """Per-layer modules of an unrolled group, filled tensor by tensor: each parameter (a fused one
  from its parts, concatenated on the host) is read once for the group's layers, then each
  layer's slice is placed. (Layer by layer, a source that reads whole stacked tensors, Orbax,
  would read each one once per layer.)"""
  fuse = FusedDecoderLayer if fused else (lambda layer: layer)
  make = lambda: fuse(DecoderLayer(config, dtype, nnx.Rngs(0)))
  splits = [nnx.split(nnx.eval_shape(make)) for _ in layers]
  specs = _flatten(nnx.to_pure_dict(splits[0][1]))
  values: list[dict] = [{} for _ in layers]
  for sub, spec in specs.items():
    parts = FusedDecoderLayer.PARTS.get(sub[-1]) if len(sub) == 1 else None
    host = placer.host(_Read(tuple(("layers",) + p for p in (parts or (sub,))), list(layers)))
    for j in range(len(layers)):
      values[j][sub] = placer.place(("layers",) + sub, host[j], spec, placement.DEVICE)
    del host
  modules = []
  for (graphdef, state), flat in zip(splits, values):
    nnx.replace_by_pure_dict(state, _unflatten(flat))
    modules.append(nnx.merge(graphdef, state))
  return modules


@dataclasses.dataclass
class _Globals:
  """What GroupedTransformer takes from a model besides the layers."""
  config: ModelConfig
  embed: nnx.Module
  final_norm: nnx.Module
  inv_freq: nnx.Variable
  lm_head: nnx.Param | None = None


def build(config: ModelConfig, source: TensorSource, dtype, layout: Layout,
          observe: Observer | None = None) -> Transformer:
  """The model arranged and placed as `layout` says, each tensor read from `source` once.

  Returns a `Transformer` (layout `plain`) or a `GroupedTransformer` with the same outputs as
  `GroupedTransformer(model_from_params(...), groups)` (see the module docstring). `observe(name,
  array)` is called after every tensor is placed.
  """
  if layout.num_layers != config.num_layers:
    raise ValueError(f"layout groups {layout.groups} cover {layout.num_layers} layers; the model "
                     f"has {config.num_layers}")
  check_shapes(config, source.shapes(), dtype, source.where)
  mesh = layout.mesh if layout.mesh is not None else sharding.make_mesh(1)
  sharding.check_tensor_parallel(config, sharding.tp_size(mesh))
  placer = _Placer(source, mesh, dtype, observe)
  shell = nnx.eval_shape(lambda: Transformer(config, dtype, rngs=nnx.Rngs(0)))
  if layout.plain:
    return placer.fill(shell, _whole(config))
  whole = _whole(config)

  def one(name: str, make):
    value = placer.place((name,), whole((name,)), getattr(shell, name), placement.DEVICE)
    return make(value)

  parts = _Globals(
      config, placer.fill(shell.embed, lambda p: whole(("embed",) + p), prefix=("embed",)),
      placer.fill(shell.final_norm, lambda p: whole(("final_norm",) + p), prefix=("final_norm",)),
      one("inv_freq", nnx.Variable),
      None if config.tie_word_embeddings else one("lm_head", nnx.Param))
  groups, first = [], 0
  for n, mode in layout.groups:
    layers = range(first, first + n)
    if mode == "unrolled":
      group = UnrolledLayers(_unrolled(placer, config, dtype, layers, layout.fused), first,
                             layout.fused)
    else:
      stack_config = dataclasses.replace(config, num_layers=n)
      abstract = nnx.eval_shape(lambda: make_layer_stack(stack_config, dtype, nnx.Rngs(0)))
      kind = placement.PINNED_HOST if mode == "offload" else placement.DEVICE
      stack = placer.fill(abstract, _stacked(layers, config.num_layers), kind, prefix=("layers",))
      group = (OffloadedLayers(stack, first, layout.prefetch_depth) if mode == "offload"
               else LayerStack(stack, first))
    groups.append((n, group))
    first += n
  return GroupedTransformer(parts, groups)
