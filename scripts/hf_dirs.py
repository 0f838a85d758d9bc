"""Hugging Face directories written from jaxtier's checkpoints, without torch or transformers.

`build_hf_dir` writes the float32 Hugging Face directory of a Llama GGUF file: config.json
(LlamaForCausalLM), model.safetensors (float32, [out, in] linear weights), tokenizer.json and
tokenizer_config.json (special tokens, EOS ids, chat template), all from jaxtier's GGUF reader,
checked on the way (the config and the tokenizer read back equal) and moved into place only when
complete. `scripts/bench_quant.py` measures the other weight formats against it.

Beside `make_hf_fixtures.py`, which writes the test fixtures through torch and transformers: this
module imports neither, so a benchmark can use it where they are not installed.
"""

import dataclasses
import json
import os
import shutil

import numpy as np


def hf_tensors(source, config) -> dict[str, np.ndarray]:
  """Every tensor of `source` (a `TensorSource`) under its Hugging Face name, float32, linear
  weights [out, in]: the inverse of `jaxtier.checkpoint.hf.HFSource`."""
  from jaxtier.checkpoint import params
  layer_names = {path: name for name, path in params.hf_layer_names(config).items()}
  global_names = {path: name for name, path in params.HF_GLOBAL_NAMES.items()}
  out = {}
  for path in source.shapes():
    if path in global_names:
      out[global_names[path]] = np.ascontiguousarray(source.read(path), np.float32)
    elif path in layer_names:
      name = layer_names[path]
      for i, layer in enumerate(source.read(path)):
        layer = layer.T if name.endswith("proj.weight") else layer
        out[f"model.layers.{i}.{name}"] = np.ascontiguousarray(layer, np.float32)
    else:
      raise ValueError(f"{source.where}: no Hugging Face name for {'/'.join(path)}")
  return out


def hf_config(config, tokenizer) -> dict:
  """config.json of a Llama `config` (a `jaxtier.model.config.ModelConfig`)."""
  if config.architecture != "llama" or config.norm_offset or config.num_experts:
    raise ValueError(f"a {config.architecture} model: only Llama checkpoints are converted")
  scaling = config.rope_scaling
  rope = None if scaling.rope_type == "default" else dataclasses.asdict(scaling)
  bos = tokenizer.backend.token_to_id(tokenizer.bos_token) if tokenizer.bos_token else None
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "intermediate_size": config.intermediate_size,
          "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
          "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
          "rope_theta": config.rope_theta, "rope_scaling": rope,
          "rms_norm_eps": config.rms_norm_eps,
          "tie_word_embeddings": config.tie_word_embeddings,
          "attention_bias": config.attention_bias, "mlp_bias": False,
          "max_position_embeddings": config.max_position_embeddings,
          "hidden_act": config.hidden_act, "torch_dtype": "float32", "bos_token_id": bos,
          "eos_token_id": list(tokenizer.eos_token_ids)}


def write_tokenizer(tokenizer, directory: str) -> None:
  """tokenizer.json and tokenizer_config.json (`Tokenizer.save`), with the tokenizer class
  transformers needs to open them."""
  tokenizer.save(directory)
  path = os.path.join(directory, "tokenizer_config.json")
  with open(path) as f:
    config = json.load(f)
  config["tokenizer_class"] = "PreTrainedTokenizerFast"
  with open(path, "w") as f:
    json.dump(config, f, indent=1)


def check_written(directory: str, config, tokenizer, text: str) -> None:
  """Raises ValueError unless `directory`'s config and tokenizer read back as written."""
  from jaxtier.checkpoint import hf
  from jaxtier.text.tokenizer import load_tokenizer_dir
  read = hf.read_config(directory)
  if read != config:
    raise ValueError(f"{directory}: config.json reads back as {read}, not {config}")
  back = load_tokenizer_dir(directory)
  for name in ("eos_token_ids", "bos_token", "eos_token", "chat_template"):
    if getattr(back, name) != getattr(tokenizer, name):
      raise ValueError(f"{directory}: the tokenizer's {name} reads back as "
                       f"{getattr(back, name)!r:.80}, not {getattr(tokenizer, name)!r:.80}")
  if back.encode(text) != tokenizer.encode(text):
    raise ValueError(f"{directory}: the tokenizer reads back encoding text differently")


def build_hf_dir(gguf_path: str, directory: str, text: str) -> None:
  """Writes the float32 Hugging Face directory of a GGUF file (in a .partial directory moved
  into place once complete and checked, the tokenizer on `text`)."""
  import safetensors.numpy
  from jaxtier import checkpoint
  opened = checkpoint.open_checkpoint(gguf_path)
  config_json = hf_config(opened.config, opened.tokenizer)
  with opened.source:
    tensors = hf_tensors(opened.source, opened.config)
  partial = directory + ".partial"
  shutil.rmtree(partial, ignore_errors=True)
  os.makedirs(partial)
  safetensors.numpy.save_file(tensors, os.path.join(partial, "model.safetensors"),
                              metadata={"format": "pt"})
  del tensors
  with open(os.path.join(partial, "config.json"), "w") as f:
    json.dump(config_json, f, indent=1)
  write_tokenizer(opened.tokenizer, partial)
  check_written(partial, opened.config, opened.tokenizer, text)
  shutil.rmtree(directory, ignore_errors=True)
  os.rename(partial, directory)
