"""Model loading from a registry name, a Hugging Face directory, a GGUF file or an Orbax directory."""

import dataclasses
import os
import shutil
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


def _registered(manifest: registry.Manifest) -> tuple[str, str, ModelConfig, dict, Tokenizer]:
  """(path, kind, config, params, tokenizer) of a registered model from its Orbax copy in the
  cache; the first load fetches the weights and converts them, holding the entry's lock (a
  process that waited for it finds the copy made)."""
  path = os.path.join(registry.model_dir(manifest), "orbax")
  if not orbax_io.is_orbax_dir(path):
    with registry.entry_lock(manifest):
      if not orbax_io.is_orbax_dir(path):
        weights = registry.fetch(manifest)
        registry.progress(f"converting {weights} to Orbax at {path} ...")
        start = time.perf_counter()
        kind, config, params, tokenizer = _read(weights)
        partial = path + ".partial"
        for stale in (partial, path):  # left by a process that died while converting
          shutil.rmtree(stale, ignore_errors=True)
        orbax_io.save(partial, config, params, tokenizer)
        os.rename(partial, path)
        registry.progress(f"converted ({registry.megabytes(path)}) in "
                          f"{time.perf_counter() - start:.1f} s")
        return path, kind, config, params, tokenizer
  return (path, "orbax") + orbax_io.load(path)


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
    path, kind, config, params, tokenizer = _registered(manifest)
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
