"""Between checkpoint tensors and the model: one naming scheme, tensor sources, a reference builder.

Parameter paths are those of `nnx.to_pure_dict` of a Transformer, for example
`("layers", "q_proj", "kernel")`; layer tensors are stacked along a leading layer axis and linear
kernels laid out [in, out]. Each checkpoint format is a `TensorSource`: it lists every tensor's path
and shape from the file's metadata and reads one tensor (or some layers of one) at a time, so the
placement-first loader (`jaxtier.checkpoint.placed`) never holds the whole model anywhere.
`model_from_params` builds a model from a whole dict on the default device: the reference the
placed loader is tested against.
"""

import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtier.model.config import ModelConfig
from jaxtier.model.transformer import Transformer

Path = tuple[str, ...]

# Per-layer tensors in Hugging Face naming (`model.layers.{i}.<name>`) and their paths in the model.
HF_LAYER_NAMES: dict[str, Path] = {
    "input_layernorm.weight": ("layers", "attn_norm", "scale"),
    "self_attn.q_proj.weight": ("layers", "q_proj", "kernel"),
    "self_attn.k_proj.weight": ("layers", "k_proj", "kernel"),
    "self_attn.v_proj.weight": ("layers", "v_proj", "kernel"),
    "self_attn.o_proj.weight": ("layers", "o_proj", "kernel"),
    "self_attn.q_proj.bias": ("layers", "q_proj", "bias"),
    "self_attn.k_proj.bias": ("layers", "k_proj", "bias"),
    "self_attn.v_proj.bias": ("layers", "v_proj", "bias"),
    "self_attn.q_norm.weight": ("layers", "q_norm", "scale"),
    "self_attn.k_norm.weight": ("layers", "k_norm", "scale"),
    "post_attention_layernorm.weight": ("layers", "mlp_norm", "scale"),
    "mlp.gate_proj.weight": ("layers", "gate_proj", "kernel"),
    "mlp.up_proj.weight": ("layers", "up_proj", "kernel"),
    "mlp.down_proj.weight": ("layers", "down_proj", "kernel"),
}
# Gemma 2 norms both blocks' inputs and outputs: its names where they differ from Llama's.
HF_SANDWICH_NORM_NAMES: dict[str, Path] = {
    "post_attention_layernorm.weight": ("layers", "post_attn_norm", "scale"),
    "pre_feedforward_layernorm.weight": ("layers", "mlp_norm", "scale"),
    "post_feedforward_layernorm.weight": ("layers", "post_mlp_norm", "scale"),
}


def hf_layer_names(config: ModelConfig) -> dict[str, Path]:
  """The per-layer tensor names of `config`'s family and their model paths."""
  if config.sandwich_norms:
    return {**HF_LAYER_NAMES, **HF_SANDWICH_NORM_NAMES}
  return HF_LAYER_NAMES


# Fused per-layer tensors (Phi-3) and the model parameters their output rows split into, in order:
# q/k/v by heads (`config.num_heads`, `num_kv_heads`, `num_kv_heads` times `head_dim` rows), gate
# and up in halves.
HF_FUSED_LAYER_NAMES: dict[str, tuple[Path, ...]] = {
    "self_attn.qkv_proj.weight": (("layers", "q_proj", "kernel"), ("layers", "k_proj", "kernel"),
                                  ("layers", "v_proj", "kernel")),
    "mlp.gate_up_proj.weight": (("layers", "gate_proj", "kernel"), ("layers", "up_proj", "kernel")),
}
HF_GLOBAL_NAMES: dict[str, Path] = {
    "model.embed_tokens.weight": ("embed", "embedding"),
    "model.norm.weight": ("final_norm", "scale"),
    "lm_head.weight": ("lm_head",),
}
DERIVED: frozenset[Path] = frozenset({("inv_freq",)})


class TensorSource:
  """Tensors of one checkpoint, by parameter path, read on demand as float32 numpy arrays.

  `shapes()` gives every path's full shape (layer tensors stacked: [num_layers, ...]) without
  reading data. `read(path, layers)` reads a global tensor, or the listed layers of a layer tensor
  stacked in that order (`layers=None`: all). `place(path, sharding, dtype)` may put a whole tensor
  straight into its placement (a format that can, like Orbax, reads each shard into its device
  memory); it returns None when the format cannot, and the loader reads and places it itself.
  """
  kind = "checkpoint"

  def __init__(self, where: str):
    self.where = where

  def shapes(self) -> dict[Path, tuple[int, ...]]:
    raise NotImplementedError

  def read(self, path: Path, layers: Sequence[int] | None = None) -> np.ndarray:
    raise NotImplementedError

  def place(self, path: Path, sharding, dtype) -> jax.Array | None:
    del path, sharding, dtype
    return None

  def quantization(self, path: Path, layer: int | None = None) -> str | None:
    """The block format (`jaxtier.kernels.cpu.matmul`) that holds exactly the tensor at `path`
    (every layer's, for a layer tensor, or only `layer`'s) as the source stores it, in blocks along
    its input axis: "q4_1" (GGUF's Q4_1, Q4_0 or Q4_K), "q8_0" (Q8_0 or Q5_0) or "q8_16" (the other
    types that fit 8 bits, or layers of different such types); None where it is not stored in such
    blocks. `read_blocks` then reads it as stored."""
    del path, layer
    return None

  def layout(self, path: Path):
    """The `jaxtier.model.quant.WeightFormat` that stacked layers hold the tensor at `path` in,
    where the source stores it in a layout of its own (a checkpoint quantized before download:
    its group size, zero points or act-order); None: the layout of `quantization`'s block
    format. `read_blocks(path, layers, fmt)` with a `fmt` that is not a block format then
    gives its parts in that layout."""
    del path
    return None

  def read_blocks(self, path: Path, layers: Sequence[int] | None = None, fmt: str | None = None
                  ) -> tuple[np.ndarray, ...]:
    """A weight as its blocks in format `fmt` (default: `quantization`'s; "q8_16" holds every
    stored block type), the blocked (input) axis K first: a layer weight as (q [L, K, N],
    d [L, K / 32, N], ...) in `read`'s [in, out] layout, the embedding or LM head table as the
    transpose of `read`'s [vocab, hidden] (q [K = hidden, N = vocab], ...). Q4_1: (q uint8 0-15,
    d, m) with the weight d q + m; Q8_0: (q int8, d) with the weight d q (d and m float32,
    repeated over each block's 32 rows); Q8_16: (q int8, d, m) with d and m per 16 rows
    [L, K / 16, N]."""
    del layers, fmt
    raise NotImplementedError(f"{self.where}: {'/'.join(path)} is not stored in blocks")

  def read_all(self) -> dict[Path, np.ndarray]:
    """Every tensor (the whole model in host memory: for converting formats)."""
    return {path: self.read(path) for path in self.shapes()}

  def close(self) -> None:
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class ConfigSource(TensorSource):
  """A model's tensors as its config gives their shapes, none of them readable: what planning
  needs from a directory that holds a config and no weights."""
  kind = "config"

  def __init__(self, where: str, config: ModelConfig):
    super().__init__(where)
    self._shapes = expected_shapes(config, jnp.float32)

  def shapes(self) -> dict[Path, tuple[int, ...]]:
    return self._shapes

  def read(self, path: Path, layers: Sequence[int] | None = None) -> np.ndarray:
    del layers
    raise ValueError(f"{self.where} holds a config but no weights ({'/'.join(path)} cannot be "
                     "read): it can be planned (a dry run), not loaded")


class ArraySource(TensorSource):
  """Parameters already in memory (a trainer's JAX arrays, or numpy) by path: what an engine
  built around in-memory weights, or given new ones, places. A whole tensor that is a JAX array
  of the target dtype is used as it is where it already has the target sharding and memory kind
  (no copy), else moved there on the devices (resharded, or to pinned host memory); a part of a
  tensor (a group of its layers), or another dtype, is read to the host and placed from there."""
  kind = "arrays"

  def __init__(self, params: Mapping[Path, object], where: str = "params"):
    super().__init__(where)
    self.params = dict(params)

  def shapes(self) -> dict[Path, tuple[int, ...]]:
    return {p: tuple(a.shape) for p, a in self.params.items()}

  def read(self, path: Path, layers: Sequence[int] | None = None) -> np.ndarray:
    a = self.params[path]
    if layers is not None and is_layer_path(path):
      a = a[np.asarray(layers)]
    return np.asarray(a)

  def place(self, path: Path, sharding, dtype) -> jax.Array | None:
    a = self.params[path]
    if not isinstance(a, jax.Array) or a.dtype != jnp.dtype(dtype):
      return None
    same = (a.sharding.is_equivalent_to(sharding, a.ndim)
            and a.sharding.memory_kind == sharding.memory_kind)
    return a if same else jax.device_put(a, sharding)


def flat_params(params) -> dict[Path, object]:
  """A model's parameters as this module's flat {path: array}: from an NNX state (`nnx.state(
  model, nnx.Param)` of a `Transformer`), a nested dict of its pure form, or a flat dict whose
  keys are paths (tuples) or "/"-joined names. Derived parameters (the rotary frequencies) are
  left out. ValueError for anything else."""
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  if not isinstance(params, Mapping):
    raise ValueError(f"params: expected an nnx.State or a dict of arrays, got "
                     f"{type(params).__name__}")
  if all(isinstance(k, tuple) for k in params):
    flat = dict(params)
  elif all(isinstance(k, str) and "/" in k for k in params):
    flat = {tuple(k.split("/")): v for k, v in params.items()}
  else:
    flat = _flatten(params)
  return {p: v for p, v in flat.items() if p not in DERIVED}


def fused_row_splits(name: str, config: ModelConfig) -> list[tuple[int, int]]:
  """The [start, stop) output rows of each part of the fused HF tensor `name`
  (`HF_FUSED_LAYER_NAMES`)."""
  if name == "self_attn.qkv_proj.weight":
    n, k, d = config.num_heads, config.num_kv_heads, config.head_dim
    return [(0, n * d), (n * d, (n + k) * d), ((n + k) * d, (n + 2 * k) * d)]
  f = config.intermediate_size
  return [(0, f), (f, 2 * f)]


def is_layer_path(path: Path) -> bool:
  return path[0] == "layers"


def check_layers_present(found: Mapping[Path, Sequence[object]], num_layers: int,
                         source: str) -> None:
  """Raises ValueError naming the layers a layer tensor lacks (`found[path][i]` None)."""
  for path, slots in found.items():
    missing = [i for i, s in enumerate(slots) if s is None]
    if missing:
      raise ValueError(f"{source}: tensor {'/'.join(path)} is missing for layers {missing} of "
                       f"{num_layers}")


def check_shapes(config: ModelConfig, shapes: Mapping[Path, Sequence[int]], dtype,
                 source: str) -> None:
  """Raises ValueError when a source's tensors are not exactly those of the model `config` gives."""
  expected = expected_shapes(config, dtype)
  missing = sorted("/".join(p) for p in expected.keys() - shapes.keys())
  unexpected = sorted("/".join(p) for p in shapes.keys() - expected.keys())
  if missing or unexpected:
    raise ValueError(f"{source}: parameters do not match a {config.architecture} model with this "
                     f"config; missing {missing}, unexpected {unexpected}")
  for path, shape in expected.items():
    if tuple(shapes[path]) != tuple(shape):
      raise ValueError(f"{source}: parameter {'/'.join(path)} has shape {tuple(shapes[path])}, "
                       f"expected {tuple(shape)}")


def check_params(config: ModelConfig, params: Mapping[Path, object], dtype, source: str) -> None:
  """`check_shapes`, and every parameter in `dtype`: ValueError naming the first that is not."""
  check_shapes(config, {p: tuple(a.shape) for p, a in params.items()}, dtype, source)
  for path, a in params.items():
    if jnp.dtype(a.dtype) != jnp.dtype(dtype):
      raise ValueError(f"{source}: parameter {'/'.join(path)} is {jnp.dtype(a.dtype).name}, "
                       f"expected {jnp.dtype(dtype).name} (the engine's dtype)")


def expected_shapes(config: ModelConfig, dtype) -> dict[Path, tuple[int, ...]]:
  """Every checkpoint parameter's path and shape for `config` (derived ones excluded)."""
  return dict(_expected_shapes(config, jnp.dtype(dtype)))


@functools.lru_cache(maxsize=8)
def _expected_shapes(config: ModelConfig, dtype) -> tuple[tuple[Path, tuple[int, ...]], ...]:
  # traced once per config (a whole model's trace is a tenth of a second, and a training loop's
  # `update_weights` checks every step's parameters against it)
  _, state = abstract_model(config, dtype)
  return tuple((p, tuple(s.shape)) for p, s in _flatten(nnx.to_pure_dict(state)).items()
               if p not in DERIVED)


def abstract_model(config: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
  """The model's graph and its state of ShapeDtypeStructs, without allocating parameters."""
  abstract = nnx.eval_shape(lambda: Transformer(config, dtype, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)


def _flatten(tree, prefix: Path = ()) -> dict[Path, object]:
  if isinstance(tree, Mapping):
    out = {}
    for key, value in tree.items():
      out.update(_flatten(value, prefix + (str(key),)))
    return out
  return {prefix: tree}


def _unflatten(flat: Mapping[Path, object]) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def model_from_params(config: ModelConfig, params: Mapping[Path, np.ndarray], dtype,
                      source: str = "checkpoint") -> Transformer:
  """Builds a Transformer from loaded tensors, checking that names and shapes are exactly right."""
  check_shapes(config, {p: a.shape for p, a in params.items()}, dtype, source)
  graphdef, state = abstract_model(config, dtype)
  values = {}
  for path, spec in _flatten(nnx.to_pure_dict(state)).items():
    if path not in DERIVED:
      values[path] = jnp.asarray(params[path], dtype=spec.dtype)
  values[("inv_freq",)] = jnp.asarray(config.inv_freq())
  nnx.replace_by_pure_dict(state, _unflatten(values))
  return nnx.merge(graphdef, state)


def params_from_model(model: Transformer) -> dict[Path, jax.Array]:
  """The model's parameters as a flat dict (the inverse of `model_from_params`)."""
  flat = _flatten(nnx.to_pure_dict(nnx.state(model)))
  return {p: v for p, v in flat.items() if p not in DERIVED}
