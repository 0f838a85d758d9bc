"""Placement-first loading: each checkpoint tensor goes straight to where the running model keeps it.

Before any weight is read, the model's arrangement (`Layout`: which layers form which group, which
groups live in pinned host memory, the mesh) fixes a placement for every parameter: a
`NamedSharding` from `jaxtier.model.sharding` with its memory kind, `device` for the embedding,
norms, LM head and resident layers, `pinned_host` for the offloaded tail. `build` then reads each
tensor from a `TensorSource` into host memory and puts it into its placement with
`jax.make_array_from_callback`, which hands each device only its own shard. Layer tensors go
checkpoint tensor by checkpoint tensor, each layer group's share in turn (an unrolled group places
its share layer by layer; a fused q/k/v or gate/up parameter is concatenated on the host once its
parts are read), so each tensor is read once. Nothing is placed anywhere else first: no step holds
the whole model on one device, the tail's bytes never exist in device memory, and device-kind bytes
never exceed the resident share (tested with `jax.live_arrays()` after every tensor). A source that
can restore into a sharding itself (Orbax) does so for whole tensors. Host memory holds, besides the
source's memory maps, one group's share of a tensor at a time (of the three parts of a fused one).

The groups built here are the ones `GroupedTransformer` would cut out of a loaded stacked model
(`LayerStack`, `UnrolledLayers` fused from q/k/v and gate/up on the host, `OffloadedLayers`), which
stays the reference that tests compare against.
"""

import collections
import copy
import dataclasses
import functools
from typing import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxtier.checkpoint.params import (DERIVED, Path, TensorSource, _flatten, _unflatten,
                                       check_shapes)
from jaxtier.checkpoint.quantized import layout_of
from jaxtier.common.checks import MAX_PREFETCH_DEPTH, check_int
from jaxtier.kernels.cpu import matmul
from jaxtier.model import quant, sharding
from jaxtier.model.config import ModelConfig
from jaxtier.model.transformer import (CompactTable, DecoderLayer, FusedDecoderLayer,
                                       GroupedTransformer, LayerStack, Transformer, UnrolledLayers,
                                       make_layer_stack, packs_by_default)
from jaxtier.offload import placement
from jaxtier.offload.experts import EXPERT_PARAMS, ExpertOffloadedLayers, is_expert_param
from jaxtier.offload.prefetch import OffloadedLayers, UnrolledOffloadedLayers

GROUP_MODES = ("scan", "unrolled", "offload", "experts")
Observer = Callable[[str, jax.Array], None]  # called after each tensor is placed


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a loaded model is arranged and placed.

  `groups`: consecutive (num_layers, mode) covering every layer, mode "scan" (a stacked scan on the
  device), "unrolled" (per-layer device buffers), "offload" (a stack in pinned host memory,
  prefetched `prefetch_depth` layers ahead) or "experts" (a stack of mixture-of-experts layers
  whose routed experts are in pinned host memory and the rest on the device, streamed from
  `expert_stream_from_tokens` tokens a call, else computed on the host:
  `jaxtier.offload.experts`). `mesh`: the tensor-parallel mesh (None: this
  process's first device). `keep_quantized`: packed unrolled layers keep a fused kernel (q/k/v,
  gate/up, o, down) of a layer in blocks where the source stores all its parts in blocks
  (`TensorSource.quantization`, `block_kernels`): Q4_1 where that format holds every part
  (GGUF's Q4_1, Q4_0, Q4_K), Q8_0 likewise (Q8_0, Q5_0), else Q8_16 (every type that fits 8 bits;
  `FusedDecoderLayer(formats=...)`); the layer's other kernels are float32 panels, and a packed
  LM head keeps the table's blocks the same way, instead of dequantizing them on load
  (`jaxtier.kernels.cpu.matmul`: the same products, fewer bytes).
  `block_activations`: how kept blocks multiply, "float32" (bit for bit the dequantized
  weights' products) or "int16" (x quantized per block; `matmul.pack_q4_1`). `portable`: the
  layers and head as an accelerator holds them (nothing fused or packed for the CPU kernels), so
  a CPU runs the accelerator's program (`kernels="portable"`).
  With `keep_quantized`, stacked groups (scan, offload, experts) hold each projection whose every
  layer in the group the source stores in blocks in the `jaxtier.model.quant` layout that holds them
  exactly (`quant.BLOCK_LAYOUTS`; a `checkpoint.quantized.QuantizedSource` presents a float
  checkpoint so), multiplied by `quant.qmatmul`: a tail offloaded so is held and moved compact.
  `table_dtype`: the embedding and LM head tables' dtype where it differs from the model's (a
  quantized float32 model keeps them in bfloat16); None: the model's.
  """
  groups: tuple[tuple[int, str], ...]
  prefetch_depth: int | None = None  # layers fetched ahead: given where a group streams
  mesh: Mesh | None = None
  keep_quantized: bool = False
  block_activations: str = "float32"
  portable: bool = False  # only what an accelerator runs: no layer or head packed for CPU kernels
  expert_stream_from_tokens: int | None = None  # "experts" groups: None computes on the host
  table_dtype: str | None = None
  platform: str | None = None  # compact layouts as this platform holds them (None: jax's default)
  unrolled_offload: bool = False  # an offloaded tail held per layer (`UnrolledOffloadedLayers`)

  def __post_init__(self):
    bad = [m for _, m in self.groups if m not in GROUP_MODES]
    if not self.groups or bad or min(n for n, _ in self.groups) < 1:
      raise ValueError(f"layout groups {self.groups}: expected positive sizes and modes in "
                       f"{GROUP_MODES}")
    if any(m in ("offload", "experts") for _, m in self.groups):
      check_int("prefetch_depth", self.prefetch_depth, 1, MAX_PREFETCH_DEPTH)

  @classmethod
  def of(cls, num_layers: int, offload_tail_layers: int = 0, prefetch_depth: int | None = None,
         layer_execution: str = "scan", mesh: Mesh | None = None, keep_quantized: bool = False,
         block_activations: str = "float32", portable: bool = False,
         expert_layers: int = 0, expert_stream_from_tokens: int | None = None,
         table_dtype: str | None = None, platform: str | None = None) -> "Layout":
    """The resident head run as `layer_execution`, then `expert_layers` layers whose experts are
    in pinned host memory, then the last `offload_tail_layers` offloaded (held per layer, as the
    head, where the head is unrolled for the CPU kernels)."""
    head = num_layers - offload_tail_layers - expert_layers
    groups = ((head, layer_execution),) if head else ()
    if expert_layers:
      groups += ((expert_layers, "experts"),)
    if offload_tail_layers:
      groups += ((offload_tail_layers, "offload"),)
    return cls(groups, prefetch_depth, mesh, keep_quantized, block_activations, portable,
               expert_stream_from_tokens, table_dtype, platform,
               layer_execution == "unrolled" and not portable)

  @property
  def num_layers(self) -> int:
    return sum(n for n, _ in self.groups)

  @property
  def fused(self) -> bool:
    """Unrolled layers are fused unless tensor parallel (see `jaxtier.model.sharding`) or
    portable."""
    return sharding.tp_size(self.mesh) == 1 and not self.portable

  @property
  def offload_per_layer(self) -> bool:
    """Whether an offloaded tail is held per layer, fused and packed as the unrolled head's
    layers are (`UnrolledOffloadedLayers`: the CPU kernels multiply it in the head's formats)."""
    return self.unrolled_offload and self.fused

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
      array = self.source.place(read.paths[0], target, spec.dtype)
    if array is None:
      host = read if isinstance(read, np.ndarray) else self.host(read)
      if host.dtype != spec.dtype:
        host = host.astype(spec.dtype)
      if host.shape != tuple(spec.shape):
        raise ValueError(f"{self.source.where}: {'/'.join(name)} reads as {host.shape}, expected "
                         f"{tuple(spec.shape)}")
      array = jax.make_array_from_callback(host.shape, target, lambda index: host[index])
    if self.observe is not None:
      self.observe("/".join(name), array)
    return array

  def place_groups(self, groups: list["_Group"], num_layers: int) -> None:
    _place_groups(self, groups, num_layers)

  def fill(self, module: nnx.Module, recipe: Callable[[Path], _Read | np.ndarray],
           kind: str = placement.DEVICE, prefix: Path = ()) -> nnx.Module:
    """`module` (abstract) with every parameter placed from `recipe(path)`."""
    graphdef, state = nnx.split(module)
    values = {p: self.place(prefix + p, recipe(p), s, kind)
              for p, s in _flatten(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, _unflatten(values))
    return nnx.merge(graphdef, state)


class _AbstractPlacer(_Placer):
  """Places nothing: each parameter becomes the `jax.ShapeDtypeStruct` of the array `_Placer`
  would place, with its sharding and memory kind. Reads no tensor."""

  def place(self, name: Path, read, spec, kind: str) -> jax.ShapeDtypeStruct:
    target = sharding.param_sharding(self.mesh, name, spec.shape, kind)
    return jax.ShapeDtypeStruct(tuple(spec.shape), spec.dtype, sharding=target)

  def place_groups(self, groups: list["_Group"], num_layers: int) -> None:
    for group in groups:
      for j, values in enumerate(group.values):
        for sub, spec in group.specs_of(j).items():
          values[sub] = self.place(("layers",) + sub, None, spec, group.kind_of(sub))


def _whole(config: ModelConfig):
  def recipe(path: Path):
    if path in DERIVED:
      return np.asarray(config.inv_freq())
    return _Read((path,))
  return recipe


@dataclasses.dataclass
class _Group:
  """One layer group's abstract modules (one stack, or one per unrolled layer) and the parameter
  values placed so far; `parts` holds host slices of fused parameters' parts until all arrive."""
  mode: str
  layers: range
  kind: str
  splits: list
  values: list[dict]
  packed: bool = False  # fused layers whose kernels are packed (`jaxtier.kernels.cpu.matmul`)
  blocks: tuple[dict, ...] = ()  # per layer: {kernel: block format} kept in the source's blocks
  activations: str = "float32"  # ... multiplied so (`Layout.block_activations`)
  parts: dict = dataclasses.field(default_factory=dict)
  compact: dict = dataclasses.field(default_factory=dict)  # stacked: {projection: WeightFormat}
  per_layer: bool = False  # one module per layer (unrolled; an offloaded tail held so)

  def kind_of(self, sub: Path) -> str:
    """The memory kind of parameter `sub`: the group's, except that an "experts" group keeps
    only its routed experts in pinned host memory."""
    if self.mode == "experts":
      return placement.PINNED_HOST if is_expert_param(sub) else placement.DEVICE
    return self.kind

  @property
  def specs(self) -> dict[Path, jax.ShapeDtypeStruct]:
    return self.specs_of(0)

  def specs_of(self, index: int) -> dict[Path, jax.ShapeDtypeStruct]:
    """The parameters of module `index` (unrolled layers may hold kernels in other formats)."""
    return _flatten(nnx.to_pure_dict(self.splits[index][1]))

  def module(self, index: int) -> nnx.Module:
    graphdef, state = self.splits[index]
    nnx.replace_by_pure_dict(state, _unflatten(self.values[index]))
    return nnx.merge(graphdef, state)


def kernel_path(name: str) -> Path:
  """The checkpoint path of projection `name`'s kernel (an expert stack's: the stack)."""
  return ("layers", name) if name in EXPERT_PARAMS else ("layers", name, "kernel")


def stack_formats(source: TensorSource | None, layers: range, platform: str | None = None
                  ) -> dict[str, quant.WeightFormat]:
  """{projection: layout} for a stack of `layers`: each projection whose every layer `source`
  stores in blocks (`TensorSource.quantization`), in the `jaxtier.model.quant` layout that holds
  them (one block format for all the layers, else "q8_16", which holds every 8-bit type); the others
  are absent (float). A mixture of experts' stacks where the source gives their layout
  (`TensorSource.layout`: a pre-quantized checkpoint's; a GGUF file's experts are read as
  floats). Each as `platform` (default: jax's backend) holds it (`WeightFormat.on`)."""
  out = {}
  if source is None:
    return out
  for name in quant.PROJECTIONS + EXPERT_PARAMS:
    path = kernel_path(name)
    if path not in source.shapes():
      continue
    if name in EXPERT_PARAMS:  # compact where the source has their layout (pre-quantized ones)
      fmt = source.layout(path)
      if fmt is not None:
        out[name] = fmt.on(platform or jax.default_backend())
      continue
    kinds = {source.quantization(path, layer) for layer in layers}
    if None in kinds:
      continue
    mixed = len(kinds) > 1
    kind = "q8_16" if mixed else kinds.pop()
    fmt = (None if mixed else source.layout(path)) or layout_of(
        kind, getattr(source, "group_size", 32))
    out[name] = fmt.on(platform or jax.default_backend())
  return out


def group_formats(source: TensorSource | None, layout: "Layout", mode: str, layers: range,
                  per_layer: bool = False) -> dict[str, quant.WeightFormat]:
  """{projection: layout} a group of `layers` holds compact: a stack's, every projection the
  source stores in blocks (`stack_formats`). Per-layer layers (unrolled, or an offloaded tail
  held so) the same where some projection has no CPU block format (FP8, act-order), held unfused
  and multiplied by `qmatmul` (the kernels' XLA reference) rather than dequantized; else none
  (the kernels' blocks, `block_kernels`, or floats)."""
  if source is None or not layout.keep_quantized:
    return {}
  formats = stack_formats(source, layers, layout.platform)
  if mode != "unrolled" and not (per_layer and mode == "offload"):
    return formats
  # a mixture of experts is never fused, so never packed: its layers take every compact format
  unblocked = any(name in EXPERT_PARAMS or source.quantization(kernel_path(name), layer)
                  not in matmul.BLOCK_FORMATS for name in formats for layer in layers)
  return formats if unblocked else {}


# Abstract modules traced so far in this process, by what they are (a layer's trace takes tens of
# milliseconds, a whole model's a tenth of a second): `build` runs again for every
# `update_weights` of a training loop, and places into a copy.
_TRACED: collections.OrderedDict[Hashable, nnx.Module] = collections.OrderedDict()
_MOST_TRACED = 64


def _traced(key: Hashable, make: Callable[[], nnx.Module]) -> nnx.Module:
  """A copy of the abstract module `make()` returns (`nnx.eval_shape`), traced once per `key`."""
  if key in _TRACED:
    _TRACED.move_to_end(key)
  else:
    _TRACED[key] = nnx.eval_shape(make)
    if len(_TRACED) > _MOST_TRACED:
      _TRACED.popitem(last=False)
  return copy.deepcopy(_TRACED[key])


def _abstract_modules(base: tuple, keys: Sequence[Hashable],
                      make: Callable[[Hashable], nnx.Module]) -> list[nnx.Module]:
  """One abstract module per key, `make(key)` traced once per distinct key of `base`."""
  return [_traced(base + (key,), functools.partial(make, key)) for key in keys]


def _abstract_group(config: ModelConfig, dtype, mode: str, layers: range, fused: bool,
                    blocks: Sequence[frozenset] | None = None, activations: str = "float32",
                    compact: dict[str, quant.WeightFormat] | None = None,
                    per_layer: bool = False) -> _Group:
  """blocks: per model layer, {fused kernel: block format} to keep in the source's blocks where
  the layers pack, multiplied with `activations`; compact: the group's {projection: layout}
  (`group_formats`: a stack's, or per-layer layers' held unfused as `QLinear`s); per_layer: an
  "offload" group held per layer as "unrolled" is."""
  kept: tuple[dict, ...] = ()
  per_layer = mode == "unrolled" or (per_layer and mode == "offload")
  if per_layer and compact:  # compact projections (`QLinear`): the layers unfused
    modules = _abstract_modules(
        ("qlayer", config, jnp.dtype(dtype).name, tuple(sorted(compact.items()))),
        [()] * len(layers), lambda key: DecoderLayer(config, dtype, nnx.Rngs(0), compact))
    splits = [nnx.split(module) for module in modules]
    packed = False
  elif per_layer:
    fused = fused and not config.num_experts  # a mixture of experts is never fused
    fuse = FusedDecoderLayer if fused else (lambda layer: layer)
    make = lambda: fuse(DecoderLayer(config, dtype, nnx.Rngs(0)))
    base = ("layer", config, jnp.dtype(dtype).name, fused)
    packed = fused and getattr(_traced(base + ((),), make), "packed", False)
    if packed and blocks is not None:
      kept = tuple(dict(blocks[i]) for i in layers)
    if any(kept):
      modules = _abstract_modules(
          ("blocks", config, jnp.dtype(dtype).name, activations),
          [tuple(sorted(names.items())) for names in kept],
          lambda key: FusedDecoderLayer(DecoderLayer(config, dtype, nnx.Rngs(0)),
                                        formats=dict(key), activations=activations))
    else:
      modules = _abstract_modules(base, [()] * len(layers), lambda key: make())
    splits = [nnx.split(module) for module in modules]
  else:
    key = ("stack", config, jnp.dtype(dtype).name, len(layers),
           tuple(sorted((compact or {}).items())))
    splits = [nnx.split(_traced(key, lambda: make_layer_stack(config, dtype, nnx.Rngs(0),
                                                                len(layers), compact)))]
    packed = False
  kind = placement.PINNED_HOST if mode == "offload" else placement.DEVICE
  return _Group(mode, layers, kind, splits, [{} for _ in splits], packed, kept, activations,
                compact=dict(compact or {}), per_layer=per_layer)


def _place_groups(placer: _Placer, groups: list[_Group], num_layers: int) -> None:
  """Places every layer parameter of `groups`, checkpoint tensor by checkpoint tensor: each
  group's share of one tensor in turn (a fused parameter once its last part is read), so a source
  that restores whole stacked tensors (Orbax) reads each once, and host memory holds one group's
  share of a tensor (or of a fused parameter's parts) at a time."""
  uses: dict[Path, list] = {}  # checkpoint path -> (group, parameter, its parts)
  for group in groups:
    for sub, spec in group.specs.items():
      if sub[0] in group.compact and sub[-1] in quant.PARTS:
        if sub[-1] == "values":  # one use per compact kernel: its parts are placed together
          uses.setdefault(kernel_path(sub[0]), []).append((group, sub, spec, None))
        continue
      parts = FusedDecoderLayer.PARTS.get(sub[-1]) if len(sub) == 1 else None
      for part in parts or (sub,):
        uses.setdefault(("layers",) + part, []).append((group, sub, spec, parts or (sub,)))
  fused_first = [("layers",) + p for parts in FusedDecoderLayer.PARTS.values() for p in parts]
  order = sorted(uses, key=lambda path: (fused_first.index(path) if path in fused_first
                                         else len(fused_first), path))
  for path in order:
    for group, sub, spec, parts in uses[path]:
      whole = not group.per_layer and group.layers == range(num_layers)
      if parts is None and group.per_layer:  # a compact kernel of per-layer layers: each's
        fmt = group.compact[sub[0]]
        for j, layer in enumerate(group.layers):
          stored = placer.source.read_blocks(path, [layer], _block_name(fmt))
          for name, array in quant.cast_parts(stored, fmt).items():
            part = (sub[0], name)
            group.values[j][part] = placer.place(("layers",) + part, array[0],
                                                 group.specs_of(j)[part], group.kind_of(part))
        continue
      if parts is None:  # a compact kernel of a stacked group: its blocks, in its layout
        fmt = group.compact[sub[0]]
        stored = placer.source.read_blocks(path, list(group.layers), _block_name(fmt))
        for name, array in quant.cast_parts(stored, fmt).items():
          part = (sub[0], name)
          group.values[0][part] = placer.place(("layers",) + part, array, group.specs[part],
                                               group.kind_of(part))
        del stored
        continue
      if not group.per_layer:
        read = _Read((path,), None if whole else list(group.layers))
        group.values[0][sub] = placer.place(("layers",) + sub, read, spec, group.kind_of(sub))
        continue
      got = group.parts.setdefault(sub, {})
      kernel = group.packed and sub[-1] in FusedDecoderLayer.KERNELS
      ids = list(group.layers)
      # the group's layers (indices) holding this kernel in blocks, by format, and the others
      formats = ([names.get(sub[-1]) for names in group.blocks] if kernel and group.blocks
                 else [None] * len(ids))
      kept = {fmt: [j for j, f in enumerate(formats) if f == fmt]
              for fmt in sorted(set(formats) - {None})}
      rest = [j for j, f in enumerate(formats) if f is None]
      got[path[1:]] = (  # {format: (q, d, m) as stored}, and floats
          {fmt: placer.source.read_blocks(path, [ids[j] for j in js], fmt)
           for fmt, js in kept.items()},
          placer.host(_Read((path,), [ids[j] for j in rest])) if rest else None)
      if len(got) < len(parts):
        continue
      pieces = [got.pop(p) for p in parts]
      host = {}
      for fmt, js in kept.items():
        blocks = zip(*(b[fmt] for b, _ in pieces))  # (q, d, m), each part's
        host.update(zip(js, matmul.pack_blocks(fmt, [np.concatenate(a, axis=-1) for a in blocks],
                                               group.activations)))
      if rest:
        floats = [f for _, f in pieces]
        floats = floats[0] if len(floats) == 1 else np.concatenate(floats, axis=-1)
        host.update(zip(rest, matmul.pack(floats) if kernel else floats))
      del group.parts[sub], pieces
      for j, values in enumerate(group.values):
        values[sub] = placer.place(("layers",) + sub, host.pop(j), group.specs_of(j)[sub],
                                   group.kind)


def _block_name(fmt: quant.WeightFormat) -> str | None:
  """The `read_blocks` format name of a layout: a GGUF block format where it is one, else the
  quantization (the source's own name for it)."""
  plain = dataclasses.replace(fmt, values="uint4") if fmt.values == "u4x2" else fmt
  for name, layout in quant.BLOCK_LAYOUTS.items():
    if layout == plain:
      return name
  return {"int8": "int8", "float8_e4m3fn": "fp8"}.get(fmt.values, "int4")


@dataclasses.dataclass
class _Globals:
  """What GroupedTransformer takes from a model besides the layers."""
  config: ModelConfig
  embed: nnx.Module
  final_norm: nnx.Module
  inv_freq: nnx.Variable
  lm_head: nnx.Param | None = None
  packed_head: jax.Array | None = None  # the table's blocks, packed (`GroupedTransformer`)
  compact_head: nnx.Module | None = None  # ... or held compact (`CompactTable`)


def block_kernels(source: TensorSource, num_layers: int) -> list[dict[str, str]]:
  """Per layer, {fused kernel: block format} for the kernels whose every part `source` stores in
  blocks (`TensorSource.quantization`): "q4_1" or "q8_0" where all parts are held by that format,
  else "q8_16", which holds them all."""
  out = []
  for layer in range(num_layers):
    kept = {}
    for name in FusedDecoderLayer.KERNELS:
      kinds = {source.quantization(("layers",) + part, layer)
               for part in FusedDecoderLayer.PARTS[name]}
      if kinds <= set(matmul.BLOCK_FORMATS):  # the kernels' blocks hold every part
        kept[name] = kinds.pop() if len(kinds) == 1 else "q8_16"
    out.append(kept)
  return out


def _head_path(config: ModelConfig) -> Path:
  return ("embed", "embedding") if config.tie_word_embeddings else ("lm_head",)


def _head_blocks(config: ModelConfig, source: TensorSource, dtype, layout: Layout) -> str | None:
  """The block format the LM head keeps the table in (`TensorSource.quantization`'s), where
  `layout` keeps blocks and `GroupedTransformer` would pack the head; else None."""
  kind = source.quantization(_head_path(config))
  if not (layout.keep_quantized and layout.fused and kind in matmul.BLOCK_FORMATS
          and packs_by_default(dtype) and matmul.packs_exactly(config.vocab_size)):
    return None
  return kind


def _packed_head_blocks(placer: _Placer, config: ModelConfig, dtype, layout: Layout
                        ) -> jax.Array | None:
  """The LM head packed from the table's blocks and placed (`_head_blocks`), or None."""
  path = _head_path(config)
  kind = None if placer.source is None else _head_blocks(config, placer.source, dtype, layout)
  if kind is None:
    return None
  if isinstance(placer, _AbstractPlacer):
    raise NotImplementedError("an abstract model whose LM head keeps a GGUF file's blocks: its "
                              "packed shape is known only once the blocks are packed")
  blocks = placer.source.read_blocks(path)
  host = matmul.pack_blocks(kind, blocks, layout.block_activations)
  del blocks
  return placer.place(("packed_head",), host, jax.ShapeDtypeStruct(host.shape, host.dtype),
                      placement.DEVICE)


def _tail_per_layer(layout: Layout, blocks: Sequence[dict] | None) -> bool:
  """Whether an offloaded tail is held per layer (`Layout.offload_per_layer`): where every layer
  keeps the same formats, so one offloaded layer's bytes are every layer's (the planner's
  `ModelBytes.layer_bytes`); layers of mixed formats offload as a compact stack instead."""
  return layout.offload_per_layer and (not blocks or all(b == blocks[0] for b in blocks))


def _compact_head_format(config: ModelConfig, source: TensorSource | None, layout: Layout
                         ) -> quant.WeightFormat | None:
  """The layout (`jaxtier.model.quant`) the LM head keeps the table's blocks in on the portable
  path, where `layout` keeps blocks and the source stores the table in them; else None (the CPU
  kernels pack it instead: `_head_blocks`)."""
  if source is None or not (layout.keep_quantized and layout.portable):
    return None
  kind = source.quantization(_head_path(config))
  if kind not in quant.BLOCK_LAYOUTS or config.hidden_size % quant.BLOCK_LAYOUTS[kind].group:
    return None
  return quant.BLOCK_LAYOUTS[kind].on(layout.platform or jax.default_backend())


def _compact_head(placer: _Placer, config: ModelConfig, dtype, layout: Layout
                  ) -> CompactTable | None:
  """The LM head as a `CompactTable` of the table's blocks, placed (`_compact_head_format`)."""
  fmt = _compact_head_format(config, placer.source, layout)
  if fmt is None:
    return None
  specs = fmt.shapes(config.hidden_size, config.vocab_size)
  if isinstance(placer, _AbstractPlacer):
    parts = [None] * len(specs)
  else:
    parts = list(quant.cast_parts(placer.source.read_blocks(_head_path(config), None,
                                                            _block_name(fmt)), fmt).values())
  arrays = [placer.place(("compact_head", name), part, specs[name], placement.DEVICE)
            for name, part in zip(quant.PARTS, parts)]
  return CompactTable(*arrays, dtype=dtype)


def resident_bytes(config: ModelConfig, source: TensorSource, dtype, layout: Layout,
                   tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], int, int]:
  """(bytes of each layer, bytes of everything else, bytes of one offloaded layer) as `build`
  would hold them with every layer resident on the device in `layout`'s first group mode, and
  as an offloaded stack would hold one layer (both keep the blocks of `keep_quantized`: packed
  in unrolled layers, `jaxtier.model.quant` layouts in stacks): what the offload planner needs where
  kept blocks make layers and the LM head smaller than their float parameters. Taken from the
  abstract modules `build` places; nothing is read. `tensor_parallel_size`: one device's share
  of the layers (each parameter's dims that `jaxtier.model.sharding` splits, divided; the tables
  are replicated)."""
  c = config
  tp = tensor_parallel_size
  size = jnp.dtype(layout.table_dtype or dtype).itemsize
  blocks = block_kernels(source, c.num_layers) if layout.keep_quantized else None
  every = range(c.num_layers)
  compact = stack_formats(source, every, layout.platform) if layout.keep_quantized else {}
  mode = layout.groups[0][1]
  group = _abstract_group(c, dtype, mode, every, layout.fused, blocks, layout.block_activations,
                          group_formats(source, layout, mode, every))
  nbytes = lambda state: _device_bytes(state, tp)
  per_split = [nbytes(state) for _, state in group.splits]
  layers = (tuple(per_split) if len(per_split) == c.num_layers
            else (per_split[0] // c.num_layers,) * c.num_layers)  # one stack of all layers
  if _tail_per_layer(layout, blocks) and mode == "unrolled":  # held as the head's layers
    offloaded = layers[-1]
  else:
    stack = _abstract_group(c, dtype, "offload", every, layout.fused, compact=compact)
    offloaded = nbytes(stack.splits[0][1]) // c.num_layers
  table = c.vocab_size * c.hidden_size
  other = (table * size * (1 if c.tie_word_embeddings else 2)
           + c.hidden_size * jnp.dtype(dtype).itemsize + c.head_dim // 2 * 4)
  head = _compact_head_format(c, source, layout)
  if head is not None:  # the head's table held compact instead
    other += head.nbytes(c.hidden_size, c.vocab_size) - table * size
  kind = _head_blocks(c, source, dtype, layout)
  if kind is not None:  # the head's table held in its blocks instead (int16 layouts: same bytes)
    other += table // matmul.QUANT_BLOCK * matmul.BYTES_PER_COLUMN[kind] - table * size
  return layers, other, offloaded


def expert_layer_bytes(config: ModelConfig, source: TensorSource, dtype, layout: Layout,
                       tensor_parallel_size: int = 1) -> int:
  """Bytes of one layer's routed experts as a stack holds them (compact where the source keeps
  their layout, `stack_formats`), one device's share: what an experts group keeps in host
  memory per layer."""
  if not config.num_experts:
    return 0
  every = range(config.num_layers)
  group = _abstract_group(config, dtype, "offload", every, layout.fused,
                          compact=group_formats(source, layout, "offload", every))
  return _device_bytes(group.splits[0][1], tensor_parallel_size,
                       is_expert_param) // config.num_layers


def _device_bytes(state, tp: int, keep=None) -> int:
  """Bytes of one device's share of the parameters in `state` (abstract), split `tp` ways as
  `sharding.param_axes` says; `keep(path)`: only the parameters it accepts."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if keep is not None and not keep(path):
      continue
    shape = list(leaf.shape)
    if tp > 1:
      names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
      for dim, axis in enumerate(sharding.spec(sharding.param_axes(names, len(shape)))):
        if axis is not None:
          shape[dim] //= tp
    total += quant.array_bytes(jax.ShapeDtypeStruct(tuple(shape), leaf.dtype))
  return total


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
  return _arrange(config, dtype, layout, _Placer(source, mesh, dtype, observe))


def abstract(config: ModelConfig, dtype, layout: Layout, source: TensorSource | None = None
             ) -> Transformer:
  """The model `build` would return, arranged the same way, each parameter the
  `jax.ShapeDtypeStruct` of the array `build` would place (shape, dtype, sharding and memory
  kind: pinned host for an offloaded tail), and no tensor read: the argument of programs traced
  or exported without weights (`nnx.split` it for the state). `source` is asked only which
  kernels keep a GGUF file's blocks (`Layout.keep_quantized`; an LM head kept in blocks is not
  supported here); None: none do."""
  if layout.num_layers != config.num_layers:
    raise ValueError(f"layout groups {layout.groups} cover {layout.num_layers} layers; the model "
                     f"has {config.num_layers}")
  mesh = layout.mesh if layout.mesh is not None else sharding.make_mesh(1)
  if source is None:
    layout = dataclasses.replace(layout, keep_quantized=False)
  return _arrange(config, dtype, layout, _AbstractPlacer(source, mesh, dtype, None))


def _arrange(config: ModelConfig, dtype, layout: Layout, placer: _Placer) -> Transformer:
  """`build`'s model, each parameter from `placer`."""
  source = placer.source
  sharding.check_tensor_parallel(config, sharding.tp_size(placer.mesh))
  shell = _traced(("model", config, jnp.dtype(dtype).name, layout.table_dtype),
                  lambda: Transformer(config, dtype, rngs=nnx.Rngs(0),
                                      table_dtype=layout.table_dtype))
  if layout.plain and not group_formats(source, layout, "scan", range(config.num_layers)):
    return placer.fill(shell, _whole(config))
  whole = _whole(config)

  def one(name: str, make):
    value = placer.place((name,), whole((name,)), getattr(shell, name), placement.DEVICE)
    return make(value)

  packed_head = _packed_head_blocks(placer, config, dtype, layout)
  compact_head = _compact_head(placer, config, dtype, layout)
  if (packed_head is None and isinstance(placer, _AbstractPlacer) and layout.fused
      and packs_by_default(dtype) and matmul.packs_exactly(config.vocab_size)):
    # the head `GroupedTransformer` packs from the float table, which an abstract table cannot be
    table = shell.embed.embedding if config.tie_word_embeddings else shell.lm_head
    packed = jax.eval_shape(lambda t: matmul.pack(t.T), jax.ShapeDtypeStruct(table.shape, dtype))
    packed_head = placer.place(("packed_head",), None, packed, placement.DEVICE)
  held = packed_head is not None or compact_head is not None  # the head's table, in blocks
  embed = (None if held and config.tie_word_embeddings  # held packed (or compact) only
           else placer.fill(shell.embed, lambda p: whole(("embed",) + p), prefix=("embed",)))
  parts = _Globals(
      config, embed,
      placer.fill(shell.final_norm, lambda p: whole(("final_norm",) + p), prefix=("final_norm",)),
      one("inv_freq", nnx.Variable),
      # an untied table kept packed is not read as floats too (`GroupedTransformer` holds only
      # the packed head then)
      None if config.tie_word_embeddings or held else one("lm_head", nnx.Param),
      packed_head, compact_head)
  pending, first = [], 0
  blocks = block_kernels(source, config.num_layers) if layout.keep_quantized else None
  for n, mode in layout.groups:
    layers = range(first, first + n)
    per_layer = _tail_per_layer(layout, blocks)
    pending.append(_abstract_group(config, dtype, mode, layers, layout.fused, blocks,
                                   layout.block_activations,
                                   group_formats(source, layout, mode, layers, per_layer),
                                   per_layer))
    first += n
  placer.place_groups(pending, config.num_layers)
  groups = []
  for group in pending:
    first = group.layers.start
    if group.mode == "unrolled":
      built = UnrolledLayers([group.module(j) for j in range(len(group.layers))], first,
                             layout.fused)
    elif group.mode == "offload" and group.per_layer:
      built = UnrolledOffloadedLayers([group.module(j) for j in range(len(group.layers))], first)
    elif group.mode == "offload":
      built = OffloadedLayers(group.module(0), first, layout.prefetch_depth)
    elif group.mode == "experts":
      built = ExpertOffloadedLayers(group.module(0), first,
                                    min(layout.prefetch_depth, len(group.layers)),
                                    layout.expert_stream_from_tokens)
    else:
      built = LayerStack(group.module(0), first)
    groups.append((len(group.layers), built))
  return GroupedTransformer(parts, groups, layout.fused)
