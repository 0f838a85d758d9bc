"""Orbax copies of converted models: parameters as an Orbax checkpoint, config and tokenizer beside it.

Layout of a jaxtier Orbax directory:
  jaxtier_model.json   the ModelConfig and the dtype the parameters were saved in
  params/              Orbax StandardCheckpointer checkpoint of the parameter tree
  tokenizer.json, tokenizer_config.json
"""

import dataclasses
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxtier.checkpoint.params import Path, _flatten, _unflatten
from jaxtier.config import ModelConfig, RopeScaling
from jaxtier.tokenizer import Tokenizer, load_tokenizer_dir

MARKER = "jaxtier_model.json"


def is_orbax_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, MARKER))


def save(directory: str, config: ModelConfig, params: dict[Path, np.ndarray],
         tokenizer: Tokenizer) -> None:
  """Writes a model to `directory` (which must not exist yet, or be empty)."""
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  tree = _unflatten({p: np.asarray(v) for p, v in params.items()})
  dtype = str(next(iter(params.values())).dtype)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(directory, "params"), tree)
    checkpointer.wait_until_finished()
  tokenizer.save(directory)
  with open(os.path.join(directory, MARKER), "w") as f:
    json.dump({"config": dataclasses.asdict(config), "param_dtype": dtype}, f, indent=1)


def read_config(directory: str) -> ModelConfig:
  with open(os.path.join(directory, MARKER)) as f:
    raw = json.load(f)["config"]
  raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
  return ModelConfig(**raw)


def load(directory: str) -> tuple[ModelConfig, dict[Path, jax.Array], Tokenizer]:
  """Config, parameters (in their saved dtype) and tokenizer of a jaxtier Orbax directory."""
  directory = os.path.abspath(directory)
  config = read_config(directory)
  params_dir = os.path.join(directory, "params")
  if not os.path.isdir(params_dir):
    raise FileNotFoundError(f"{directory} has {MARKER} but no params/ checkpoint")
  with ocp.StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(params_dir)
    tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
    target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
    restored = checkpointer.restore(params_dir, target)
  return config, _flatten(restored), load_tokenizer_dir(directory)
