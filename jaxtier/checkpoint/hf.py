"""Hugging Face checkpoint directories: config.json, *.safetensors shards (with an index), tokenizer."""

import json
import os
import re

import numpy as np
import safetensors

from jaxtier.checkpoint.params import HF_GLOBAL_NAMES, HF_LAYER_NAMES, Path, stack_layers
from jaxtier.config import ModelConfig, config_from_hf

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def read_config(directory: str) -> ModelConfig:
  """Reads and validates `config.json` of a Hugging Face model directory."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory} has no config.json: expected a Hugging Face model "
                            "directory (config.json, *.safetensors, tokenizer.json)")
  try:
    with open(path) as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from None
  return config_from_hf(raw, source=path)


def safetensors_files(directory: str) -> list[str]:
  """The weight shards, from `model.safetensors.index.json` when present, else every *.safetensors."""
  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      names = sorted(set(json.load(f)["weight_map"].values()))
    missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
    if missing:
      raise FileNotFoundError(f"{index} names shards that are not in {directory}: {missing}")
  else:
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
  if not names:
    raise FileNotFoundError(f"{directory} has no *.safetensors weights")
  return [os.path.join(directory, n) for n in names]


def _layer_tensor(name: str, array: np.ndarray) -> np.ndarray:
  return array.T if name.endswith("proj.weight") else array


def read_params(directory: str, config: ModelConfig) -> dict[Path, np.ndarray]:
  """Reads all shards into model parameter paths; linear weights are transposed to [in, out]."""
  per_layer: dict[Path, list] = {}
  params: dict[Path, np.ndarray] = {}
  for shard in safetensors_files(directory):
    try:
      handle = safetensors.safe_open(shard, framework="numpy")
    except Exception as e:  # safetensors raises its own error types for a corrupt header
      raise ValueError(f"{shard} is not a readable safetensors file: {e}") from None
    with handle as f:
      for name in f.keys():
        array = np.asarray(f.get_tensor(name), dtype=np.float32)
        match = _LAYER_RE.match(name)
        if match and match.group(2) in HF_LAYER_NAMES:
          layer, sub = int(match.group(1)), match.group(2)
          if layer >= config.num_layers:
            raise ValueError(f"{shard}: tensor {name} is for layer {layer}, but the config has "
                             f"{config.num_layers} layers")
          slots = per_layer.setdefault(HF_LAYER_NAMES[sub], [None] * config.num_layers)
          slots[layer] = _layer_tensor(sub, array)
        elif name in HF_GLOBAL_NAMES:
          params[HF_GLOBAL_NAMES[name]] = array
        elif name.endswith("rotary_emb.inv_freq"):
          continue
        else:
          raise ValueError(f"{shard}: unexpected tensor {name!r} for a {config.architecture} model")
  if config.tie_word_embeddings:
    params.pop(("lm_head",), None)
  params.update(stack_layers(per_layer, config.num_layers, directory))
  return params
