"""Hugging Face checkpoint directories: config.json, *.safetensors shards (with an index), tokenizer."""

import json
import os
import re

import numpy as np
import safetensors

from jaxtier.checkpoint.params import (HF_FUSED_LAYER_NAMES, HF_GLOBAL_NAMES, hf_layer_names,
                                       Path, TensorSource, check_layers_present,
                                       fused_row_splits, is_layer_path)
from jaxtier.model.config import ModelConfig, config_from_hf

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# A Gemma 3 image-and-text checkpoint: its text tower under a prefix, the vision tower skipped.
_TOWER_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


# Mixture-of-experts tensors of a layer (Mixtral's `block_sparse_moe`, Qwen3-MoE's `mlp`): the
# router, and each expert's projections, stacked by expert into the model's [e, in, out].
_ROUTER_NAMES = ("block_sparse_moe.gate.weight", "mlp.gate.weight")
_EXPERT_RE = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                        r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PATHS = {"w1": ("layers", "expert_gate"), "gate_proj": ("layers", "expert_gate"),
                 "w3": ("layers", "expert_up"), "up_proj": ("layers", "expert_up"),
                 "w2": ("layers", "expert_down"), "down_proj": ("layers", "expert_down")}


def _text_tower_name(name: str) -> str | None:
  """The Llama-style name of a text tower tensor; None for another tower's."""
  if name.startswith(_OTHER_TOWERS):
    return None
  for prefix, replacement in _TOWER_PREFIXES:
    if name.startswith(prefix):
      return replacement + name[len(prefix):]
  return name


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


def has_weights(directory: str) -> bool:
  """Whether `directory` holds safetensors weights (shards or an index)."""
  return any(name.endswith((".safetensors", ".safetensors.index.json"))
             for name in os.listdir(directory))


def _layer_tensor(name: str, array: np.ndarray) -> np.ndarray:
  return array.T if name.endswith("proj.weight") else array


class HFSource(TensorSource):
  """The tensors of a Hugging Face directory's safetensors shards, read one at a time (memory
  mapped); linear weights are transposed to [in, out]. A fused projection (Phi-3's `qkv_proj`,
  `gate_up_proj`) is read as the model's parameters it splits into, each its rows of the tensor."""
  kind = "hf"

  def __init__(self, directory: str, config: ModelConfig):
    super().__init__(directory)
    self._handles, self._names, self._shapes = [], {}, {}
    self._norm_offset = config.norm_offset
    layer_names = hf_layer_names(config)
    per_layer: dict[Path, list] = {}
    for shard in safetensors_files(directory):
      try:
        handle = safetensors.safe_open(shard, framework="numpy")
      except Exception as e:  # safetensors raises its own error types for a corrupt header
        self.close()
        raise ValueError(f"{shard} is not a readable safetensors file: {e}") from None
      self._handles.append(handle)
      for stored in handle.keys():
        name = _text_tower_name(stored)
        if name is None:
          continue
        shape = tuple(handle.get_slice(stored).get_shape())
        match = _LAYER_RE.match(name)
        expert = match and config.num_experts and _EXPERT_RE.match(match.group(2))
        if expert or (match and config.num_experts and match.group(2) in _ROUTER_NAMES):
          layer = int(match.group(1))
          if layer >= config.num_layers or (expert and int(expert.group(1)) >= config.num_experts):
            self.close()
            raise ValueError(f"{shard}: tensor {name} is outside the config's "
                             f"{config.num_layers} layers of {config.num_experts} experts")
          if expert:  # one expert's projection: its slot of the layer's [e, in, out] stack
            path = _EXPERT_PATHS[expert.group(2)]
            slots = per_layer.setdefault(path, [None] * config.num_layers)
            if slots[layer] is None:
              slots[layer] = [None] * config.num_experts
            slots[layer][int(expert.group(1))] = (handle, stored, None, name)
            self._shapes[path] = (config.num_layers, config.num_experts) + shape[::-1]
          else:
            path = ("layers", "router")
            per_layer.setdefault(path, [None] * config.num_layers)[layer] = (handle, stored,
                                                                             None, name)
            self._shapes[path] = (config.num_layers,) + shape[::-1]
        elif match and (match.group(2) in layer_names or match.group(2) in HF_FUSED_LAYER_NAMES):
          layer, sub = int(match.group(1)), match.group(2)
          if layer >= config.num_layers:
            self.close()
            raise ValueError(f"{shard}: tensor {name} is for layer {layer}, but the config has "
                             f"{config.num_layers} layers")
          if sub in HF_FUSED_LAYER_NAMES:
            rows = fused_row_splits(sub, config)
            if shape[0] != rows[-1][1]:
              self.close()
              raise ValueError(f"{shard}: tensor {name} has {shape[0]} rows; the config's "
                               f"parts need {rows[-1][1]}")
            parts = [(path, rows_of) for path, rows_of in zip(HF_FUSED_LAYER_NAMES[sub], rows)]
          else:
            parts = [(layer_names[sub], None)]
          for path, rows_of in parts:
            part_shape = shape if rows_of is None else (rows_of[1] - rows_of[0],) + shape[1:]
            per_layer.setdefault(path, [None] * config.num_layers)[layer] = (handle, stored,
                                                                             rows_of, name)
            self._shapes[path] = (config.num_layers,) + (
                part_shape[::-1] if sub.endswith("proj.weight") else part_shape)
        elif name in HF_GLOBAL_NAMES:
          if config.tie_word_embeddings and HF_GLOBAL_NAMES[name] == ("lm_head",):
            continue
          self._names[HF_GLOBAL_NAMES[name]] = (handle, stored, None, name)
          self._shapes[HF_GLOBAL_NAMES[name]] = shape
        elif not (name.endswith("rotary_emb.inv_freq") or self._claim(shard, stored, name)):
          self.close()
          raise ValueError(f"{shard}: unexpected tensor {name!r} for a {config.architecture} model")
    try:
      self._claimed(per_layer)
      check_layers_present(per_layer, config.num_layers, directory)
    except ValueError:
      self.close()
      raise
    self._layers = per_layer

  def _claim(self, shard: str, stored: str, name: str) -> bool:
    """Whether a subclass takes the tensor `stored` of `shard` (Llama-style name `name`) that is
    none of the model's parameters: a quantized checkpoint's packed parts. Default: none."""
    del shard, stored, name
    return False

  def _claimed(self, per_layer: dict[Path, list]) -> None:
    """Adds the layer tensors a subclass assembles from claimed parts to `per_layer` (path ->
    one slot per layer) and `self._shapes`, before the check that every layer has each."""
    del per_layer

  def shapes(self) -> dict[Path, tuple[int, ...]]:
    return dict(self._shapes)

  def _get(self, handle, stored: str, rows: tuple[int, int] | None, name: str) -> np.ndarray:
    """The tensor `stored` in the file (rows `rows` of it), whose Llama-style name is `name`."""
    array = (handle.get_tensor(stored) if rows is None
             else handle.get_slice(stored)[rows[0]:rows[1]])
    array = np.asarray(array, dtype=np.float32)
    if self._norm_offset and name.endswith("norm.weight"):
      array = array + np.float32(self._norm_offset)  # the family's scale: offset + w
    if _LAYER_RE.match(name) and (_EXPERT_RE.match(name.split(".", 3)[3])
                                   or name.endswith(_ROUTER_NAMES)):
      return array.T  # [out, in] -> [in, out], as every projection
    return _layer_tensor(name, array) if _LAYER_RE.match(name) else array

  def _slot(self, slot) -> np.ndarray:
    """A layer's tensor: one file tensor, or an expert stack read expert by expert."""
    if isinstance(slot, list):
      missing = [j for j, part in enumerate(slot) if part is None]
      if missing:
        raise ValueError(f"{self.where}: experts {missing[:8]} of a layer have no tensor")
      return np.stack([self._get(*part) for part in slot])
    return self._get(*slot)

  def read(self, path: Path, layers=None) -> np.ndarray:
    if is_layer_path(path):
      slots = self._layers[path]
      layers = range(len(slots)) if layers is None else layers
      return np.stack([self._slot(slots[i]) for i in layers])
    return self._get(*self._names[path])

  def close(self) -> None:
    # The shards' memory maps close when their handles are collected.
    self._handles, self._names, self._layers = [], {}, {}


def read_params(directory: str, config: ModelConfig) -> dict[Path, np.ndarray]:
  """Reads all shards into model parameter paths; linear weights are transposed to [in, out]."""
  with HFSource(directory, config) as source:
    return source.read_all()
