"""The model: a Flax NNX decoder for the Llama family and its relatives, with the KV cache and
positions as explicit arguments.

- `transformer`: `Transformer` (stacked layers, one `lax.scan`), `GroupedTransformer` (scanned,
  unrolled and offloaded groups), the decoder layers; its names are this package's too.
- `config`: `ModelConfig`, with the per-family options (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3,
  Mixtral, Qwen3-MoE), from a Hugging Face `config.json` or GGUF metadata.
- `rotary`, `softcap`, `moe`: rotary tables, Gemma's soft capping, the grouped expert MLP.
- `quant`: compact weights (int8 / 4-bit values with scales per group of rows) and `qmatmul`.
- `sharding`: every parameter's and KV pool's logical axes, the rules to the `tp` mesh axis.

The transformer's names load on first access, so `jaxtier.model.config` alone imports no model.
"""

from jaxtier.common.lazy import lazy_names as _lazy_names

_TRANSFORMER = ("RMSNorm", "NO_WINDOW", "layer_window", "scale_embeddings", "softcap_logits",
                "layer_rotary", "QLinear", "CompactTable", "DecoderLayer", "FusedDecoderLayer",
                "fuses", "packs_by_default", "make_layer_stack", "scan_layers", "Transformer",
                "LayerStack", "UnrolledLayers", "GroupedTransformer")

__all__ = sorted(_TRANSFORMER)
__getattr__, __dir__ = _lazy_names(
    __name__, dict.fromkeys(_TRANSFORMER, "jaxtier.model.transformer"), globals())
