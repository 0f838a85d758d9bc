"""Model loading from a registry name, a Hugging Face directory, a GGUF file or an Orbax directory.

    model, tokenizer = load_model("smollm2-135m-instruct")   # a Flax NNX `Transformer`

`load_model` / `load` build the NNX model, each tensor read once straight into its placement
(`placed`); `open_checkpoint` reads a checkpoint's config and tokenizer without its tensors, and
`open_metadata` what planning reads (a directory holding only a config.json too).
Formats: `hf` (safetensors), `gguf_file`, `orbax_io`; `registry` fetches and caches named models;
`params` holds the one parameter naming scheme every format speaks.
"""

from jaxtier.checkpoint import gguf_file, hf, orbax_io, params, placed, registry
from jaxtier.checkpoint.loading import (DTYPES, Loaded, Opened, load, load_model, load_opened,
                                        open_checkpoint, open_metadata, resolve_dtype, save_orbax)
from jaxtier.checkpoint.params import TensorSource

__all__ = ["DTYPES", "Loaded", "Opened", "TensorSource", "gguf_file", "hf", "load", "load_model",
           "load_opened", "open_checkpoint", "open_metadata", "orbax_io", "params", "placed", "registry",
           "resolve_dtype", "save_orbax"]
