"""Between checkpoint tensors and the model: one naming scheme, one function that builds the model.

Loaders produce a flat dict from parameter paths (as in `nnx.to_pure_dict` of a Transformer, for
example `("layers", "q_proj", "kernel")`) to numpy arrays, with layer tensors already stacked along a
leading layer axis and linear kernels laid out [in, out].
"""

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtier.config import ModelConfig
from jaxtier.model import Transformer

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
    "post_attention_layernorm.weight": ("layers", "mlp_norm", "scale"),
    "mlp.gate_proj.weight": ("layers", "gate_proj", "kernel"),
    "mlp.up_proj.weight": ("layers", "up_proj", "kernel"),
    "mlp.down_proj.weight": ("layers", "down_proj", "kernel"),
}
HF_GLOBAL_NAMES: dict[str, Path] = {
    "model.embed_tokens.weight": ("embed", "embedding"),
    "model.norm.weight": ("final_norm", "scale"),
    "lm_head.weight": ("lm_head",),
}
DERIVED: frozenset[Path] = frozenset({("inv_freq",)})


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
  graphdef, state = abstract_model(config, dtype)
  expected = {p: s for p, s in _flatten(nnx.to_pure_dict(state)).items() if p not in DERIVED}
  missing = sorted("/".join(p) for p in expected.keys() - params.keys())
  unexpected = sorted("/".join(p) for p in params.keys() - expected.keys())
  if missing or unexpected:
    raise ValueError(f"{source}: parameters do not match a {config.architecture} model with this "
                     f"config; missing {missing}, unexpected {unexpected}")
  values = {}
  for path, spec in expected.items():
    array = params[path]
    if tuple(array.shape) != tuple(spec.shape):
      raise ValueError(f"{source}: parameter {'/'.join(path)} has shape {tuple(array.shape)}, "
                       f"expected {tuple(spec.shape)}")
    values[path] = jnp.asarray(array, dtype=spec.dtype)
  values[("inv_freq",)] = jnp.asarray(config.inv_freq())
  nnx.replace_by_pure_dict(state, _unflatten(values))
  return nnx.merge(graphdef, state)


def params_from_model(model: Transformer) -> dict[Path, jax.Array]:
  """The model's parameters as a flat dict (the inverse of `model_from_params`)."""
  flat = _flatten(nnx.to_pure_dict(nnx.state(model)))
  return {p: v for p, v in flat.items() if p not in DERIVED}


def stack_layers(per_layer: Mapping[Path, list[np.ndarray]], num_layers: int,
                 source: str) -> dict[Path, np.ndarray]:
  """Stacks per-layer tensors along a new leading axis, checking every layer is present."""
  out = {}
  for path, arrays in per_layer.items():
    missing = [i for i, a in enumerate(arrays) if a is None]
    if missing:
      raise ValueError(f"{source}: tensor {'/'.join(path)} is missing for layers {missing} of "
                       f"{num_layers}")
    out[path] = np.stack(arrays)
  return out
