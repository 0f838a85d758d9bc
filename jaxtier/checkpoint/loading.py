"""Model loading from a registry name, a Hugging Face directory, a GGUF file or an Orbax directory
(re-exported by `jaxtier.checkpoint`)."""

import dataclasses
import os
import shutil
import time

import jax.numpy as jnp
import numpy as np

from jaxtier.checkpoint import gguf_file, hf, orbax_io, placed, prequantized, registry
from jaxtier.checkpoint.params import ConfigSource, TensorSource, params_from_model
from jaxtier.common.choices import DTYPE_BYTES
from jaxtier.model.config import ModelConfig
from jaxtier.model.transformer import Transformer
from jaxtier.text.tokenizer import Tokenizer, load_tokenizer_dir

DTYPES = {name: getattr(jnp, name) for name in DTYPE_BYTES}  # the model dtypes' jnp types


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


@dataclasses.dataclass
class Opened:
  """A checkpoint opened for reading: its config and tokenizer, its tensors not read yet."""
  kind: str  # "gguf", "hf", "orbax", or "config" (`open_metadata`)
  path: str
  config: ModelConfig
  tokenizer: Tokenizer | None  # None: a directory holding only a config (`open_metadata`)
  source: TensorSource

  def close(self) -> None:
    self.source.close()

  def __enter__(self) -> "Opened":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _open_path(path: str) -> Opened:
  if os.path.isdir(path):
    if orbax_io.is_orbax_dir(path):
      return Opened("orbax", path, *orbax_io.open_source(path))
    config = hf.read_config(path)
    if not hf.has_weights(path):
      raise FileNotFoundError(f"{path} holds a config.json but no weights (*.safetensors): it "
                              "can be planned (--dry_run, jaxtier.llm.dry_run), not loaded")
    scheme = prequantized.read_scheme(path)
    source = (hf.HFSource(path, config) if scheme is None
              else prequantized.PrequantizedSource(path, config, scheme))
    return Opened("hf", path, config, load_tokenizer_dir(path), source)
  if os.path.isfile(path):
    with open(path, "rb") as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF'); "
                       "expected a registry name, a Hugging Face directory, a .gguf file or a "
                       "jaxtier Orbax directory")
    return Opened("gguf", path, *gguf_file.open_source(path))
  raise FileNotFoundError(f"{path!r} is neither a registered model ({registry.known_models()}) "
                          "nor an existing file or directory")


def _registered(manifest: registry.Manifest, keep_quantized: bool = False,
                convert: bool = True) -> Opened:
  """A registered model's Orbax copy in the cache; the first open fetches the weights and converts
  them (in host memory, never on a device), holding the entry's lock (a process that waited for it
  finds the copy made). With `keep_quantized`, a GGUF file with layer kernels the loader keeps in
  blocks (`placed.block_kernels`) is opened itself, so the loader can keep them so (the Orbax copy
  holds float32)."""
  if keep_quantized and manifest.format == "gguf":
    opened = _open_path(registry.fetch(manifest))
    if any(placed.block_kernels(opened.source, opened.config.num_layers)):
      return opened
    opened.close()
  path = os.path.join(registry.model_dir(manifest), "orbax")
  converted_from = None
  if not convert and not orbax_io.is_orbax_dir(path):
    return _open_path(registry.fetch(manifest))
  if not orbax_io.is_orbax_dir(path):
    with registry.entry_lock(manifest):
      if not orbax_io.is_orbax_dir(path):
        weights = registry.fetch(manifest)
        registry.progress(f"converting {weights} to Orbax at {path} ...")
        start = time.perf_counter()
        opened = _open_path(weights)
        with opened.source:
          params = opened.source.read_all()
        partial = path + ".partial"
        for stale in (partial, path):  # left by a process that died while converting
          shutil.rmtree(stale, ignore_errors=True)
        orbax_io.save(partial, opened.config, params, opened.tokenizer)
        del params
        os.rename(partial, path)
        registry.progress(f"converted ({registry.megabytes(path)}) in "
                          f"{time.perf_counter() - start:.1f} s")
        converted_from = opened.kind
  opened = _open_path(path)
  opened.kind = converted_from or opened.kind  # the first load reports the format it converted
  return opened


def open_checkpoint(source: str, keep_quantized: bool = False, convert: bool = True) -> Opened:
  """Opens a registry name (its weights are fetched and checksummed once, converted to an Orbax
  copy once, and later opens read that copy; with `keep_quantized`, a GGUF file with layer
  weights the loader keeps in blocks is read itself), a Hugging Face directory, a .gguf file, or a
  directory written by `orbax_io.save`. Reads metadata only; close it (or `load` from it).
  `convert=False`: a registry model without its Orbax copy opens its fetched file instead of
  converting it (for callers that read the config and shapes, not the tensors)."""
  manifest = registry.find_manifest(source)
  return (_open_path(source) if manifest is None
          else _registered(manifest, keep_quantized, convert))


def open_metadata(source: str, keep_quantized: bool = False) -> Opened:
  """What planning reads: `open_checkpoint(source, keep_quantized, convert=False)` (a registry
  model is never converted for it), and also a directory holding a Hugging Face config.json but
  no weights, so a deployment can be sized from its config alone: its tensors' shapes come from
  the config (`params.ConfigSource`), none can be read, and it has no tokenizer."""
  if (registry.find_manifest(source) is None and os.path.isdir(source)
      and not orbax_io.is_orbax_dir(source) and not hf.has_weights(source)):
    config = hf.read_config(source)
    return Opened("config", source, config, None, ConfigSource(source, config))
  return open_checkpoint(source, keep_quantized, convert=False)


def load(source: str, dtype="float32", layout: placed.Layout | None = None,
         observe: placed.Observer | None = None) -> Loaded:
  """Loads a model and its tokenizer, each tensor straight into its placement.

  `source`: see `open_checkpoint`. `layout` (default: one stacked scan on this process's first
  device) arranges and places the model (`jaxtier.checkpoint.placed`); `observe(name, array)` is
  called after each tensor is placed.
  """
  dtype = resolve_dtype(dtype)
  start = time.perf_counter()
  opened = open_checkpoint(source)
  return load_opened(opened, dtype, layout, observe, start)


def load_opened(opened: Opened, dtype, layout: placed.Layout | None = None,
                observe: placed.Observer | None = None, start: float | None = None) -> Loaded:
  """`load` from an opened checkpoint (which it closes)."""
  dtype = resolve_dtype(dtype)
  start = time.perf_counter() if start is None else start
  layout = layout or placed.Layout(((opened.config.num_layers, "scan"),))
  with opened.source:
    model = placed.build(opened.config, opened.source, dtype, layout, observe)
  return Loaded(model, opened.tokenizer, opened.kind, opened.path, time.perf_counter() - start)


def load_model(source: str, dtype="float32") -> tuple[Transformer, Tokenizer]:
  """`(model, tokenizer)` for a registry name or path; see `load`."""
  loaded = load(source, dtype)
  return loaded.model, loaded.tokenizer


def save_orbax(directory: str, model: Transformer, tokenizer: Tokenizer) -> None:
  """Saves a loaded model as a jaxtier Orbax directory."""
  params = {p: np.asarray(v) for p, v in params_from_model(model).items()}
  orbax_io.save(directory, model.config, params, tokenizer)

