"""KV caches for jaxtier's model: usable on their own, without the engine or the server.

The names load on first access (`jaxtier.common.lazy`), so that a light submodule (the disk
tier's file store, `jaxtier.kvcache.disk`) imports without JAX.
"""

from jaxtier.common.lazy import lazy_names as _lazy_names

_EXPORTS = {
    "paged_attention_cpu": "jaxtier.attention.cpu_kernel",
    "dense_attention": "jaxtier.attention.dense",
    "KV_CACHE_DTYPES": "jaxtier.attention.page_format",
    "dequantize_int8": "jaxtier.attention.page_format",
    "quantize_int8": "jaxtier.attention.page_format",
    "paged_attention_tpu": "jaxtier.attention.pallas_tpu",
    "paged_attention_reference": "jaxtier.attention.reference",
    "paged_attention": "jaxtier.attention.xla_chunked",
    "paged_attention_gathered": "jaxtier.attention.xla_gathered",
    "ContiguousKVCache": "jaxtier.kvcache.contiguous",
    **{name: "jaxtier.kvcache.paged" for name in (
        "KVBlocks", "PagedCacheConfig", "PagedKVCache", "PagedMetadata", "attend",
        "device_pool_bytes", "host_pool_bytes", "write_chunk")},
    **{name: "jaxtier.kvcache.swap" for name in ("HostTier", "SwapReport", "swap_in", "swap_out")},
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_names(__name__, _EXPORTS, globals())
