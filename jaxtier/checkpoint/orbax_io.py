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

from jaxtier.checkpoint.params import Path, TensorSource, _flatten, _unflatten
from jaxtier.model.config import ModelConfig, RopeScaling
from jaxtier.text.tokenizer import Tokenizer, load_tokenizer_dir

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


class OrbaxSource(TensorSource):
  """The parameters of a jaxtier Orbax directory, restored one tensor at a time.

  `place` restores a whole tensor straight into its target sharding (Orbax reads each device's
  shard into that device's memory kind). Layer slices of a stacked tensor (an offloaded tail, per
  layer buffers) are read to host memory first: Orbax restores whole arrays only, so `read`
  restores the stacked tensor as numpy and keeps the last one, since the loader asks for the
  layer groups of one tensor in turn.
  """
  kind = "orbax"

  def __init__(self, directory: str):
    super().__init__(directory)
    self._dir = os.path.join(directory, "params")
    if not os.path.isdir(self._dir):
      raise FileNotFoundError(f"{directory} has {MARKER} but no params/ checkpoint")
    self._checkpointer = ocp.PyTreeCheckpointer()
    metadata = self._checkpointer.metadata(self._dir)
    tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
    self._meta = _flatten(tree)
    self._last: tuple[Path, np.ndarray] | None = None

  def shapes(self) -> dict[Path, tuple[int, ...]]:
    return {p: tuple(m.shape) for p, m in self._meta.items()}

  def _restore(self, path: Path, restore_args) -> jax.Array | np.ndarray:
    item = _unflatten({path: np.zeros(0)})
    args = _unflatten({path: restore_args})
    restored = self._checkpointer.restore(
        self._dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))
    return _flatten(restored)[path]

  def read(self, path: Path, layers=None) -> np.ndarray:
    if self._last is None or self._last[0] != path:
      self._last = None  # frees the previous tensor before the next is read
      array = self._restore(path, ocp.RestoreArgs(restore_type=np.ndarray))
      self._last = (path, np.asarray(array, dtype=np.float32))
    array = self._last[1]
    return array if layers is None else array[np.asarray(list(layers), dtype=np.int64)]

  def place(self, path: Path, sharding, dtype) -> jax.Array:
    return self._restore(path, ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype,
                                                    global_shape=tuple(self._meta[path].shape)))

  def close(self) -> None:
    self._last = None
    self._checkpointer.close()


def open_source(directory: str) -> tuple[ModelConfig, Tokenizer, OrbaxSource]:
  """Config, tensor source and tokenizer of a jaxtier Orbax directory (no tensor data read)."""
  directory = os.path.abspath(directory)
  return read_config(directory), load_tokenizer_dir(directory), OrbaxSource(directory)


def load(directory: str) -> tuple[ModelConfig, dict[Path, np.ndarray], Tokenizer]:
  """Config, parameters (float32, host numpy) and tokenizer of a jaxtier Orbax directory."""
  config, tokenizer, source = open_source(directory)
  with source:
    return config, source.read_all(), tokenizer
