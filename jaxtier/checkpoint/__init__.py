"""Model loading from a registry name, a Hugging Face directory, a GGUF file or an Orbax directory."""

import dataclasses
import os
import time

import jax.numpy as jnp
import numpy as np

from jaxtier.checkpoint import gguf_file, hf, orbax_io, registry
from jaxtier.checkpoint.params import model_from_params, params_from_model
from jaxtier.config import ModelConfig
from jaxtier.model import Transformer
from jaxtier.tokenizer import Tokenizer, load_tokenizer_dir

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Loaded:
  model: Transformer
  tokenizer: Tokenizer
  kind: str  # "gguf", "hf", "orbax"
  path: str
  seconds: float


def resolve_dtype(dtype) -> jnp.dtype:
  """jnp dtype for "float32"/"bfloat16" (or the dtypes themselves); anything else is an error."""
  name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if name not in DTYPES:
    raise ValueError(f"dtype={dtype!r} is not supported; expected one of {sorted(DTYPES)}")
  return DTYPES[name]


def _read(path: str) -> tuple[str, ModelConfig, dict, Tokenizer]:
  if os.path.isdir(path):
    if orbax_io.is_orbax_dir(path):
      return ("orbax",) + orbax_io.load(path)
    config = hf.read_config(path)
    return "hf", config, hf.read_params(path, config), load_tokenizer_dir(path)
  if os.path.isfile(path):
    with open(path, "rb") as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF'); "
                       "expected a registry name, a Hugging Face directory, a .gguf file or a "
                       "jaxtier Orbax directory")
    return ("gguf",) + gguf_file.load(path)
  raise FileNotFoundError(f"{path!r} is neither a registered model ({registry.known_models()}) "
                          "nor an existing file or directory")


def load(source: str, dtype="float32") -> Loaded:
  """Loads a model and its tokenizer.

  `source` is a registry name (its weights are fetched and checksummed once, converted to an Orbax
  copy once, and later loads come from that copy), a Hugging Face directory, a .gguf file, or a
  directory written by `orbax_io.save`.
  """
  dtype = resolve_dtype(dtype)
  start = time.perf_counter()
  manifest = registry.find_manifest(source)
  if manifest is None:
    kind, config, params, tokenizer = _read(source)
    path = source
  else:
    path = os.path.join(registry.model_dir(manifest), "orbax")
    if orbax_io.is_orbax_dir(path):
      kind, config, params, tokenizer = ("orbax",) + orbax_io.load(path)
    else:
      weights = registry.fetch(manifest)
      kind, config, params, tokenizer = _read(weights)
      orbax_io.save(path + ".partial", config, params, tokenizer)
      os.replace(path + ".partial", path)
  model = model_from_params(config, params, dtype, source=path)
  return Loaded(model, tokenizer, kind, path, time.perf_counter() - start)


def load_model(source: str, dtype="float32") -> tuple[Transformer, Tokenizer]:
  """`(model, tokenizer)` for a registry name or path; see `load`."""
  loaded = load(source, dtype)
  return loaded.model, loaded.tokenizer


def save_orbax(directory: str, model: Transformer, tokenizer: Tokenizer) -> None:
  """Saves a loaded model as a jaxtier Orbax directory."""
  params = {p: np.asarray(v) for p, v in params_from_model(model).items()}
  orbax_io.save(directory, model.config, params, tokenizer)


__all__ = ["Loaded", "load", "load_model", "save_orbax", "resolve_dtype"]
