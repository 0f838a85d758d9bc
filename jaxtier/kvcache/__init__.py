"""KV caches for jaxtier's model: usable on their own, without the engine or the server."""

from jaxtier.attention.cpu_kernel import paged_attention_cpu
from jaxtier.attention.dense import dense_attention
from jaxtier.attention.page_format import KV_CACHE_DTYPES, dequantize_int8, quantize_int8
from jaxtier.attention.pallas_tpu import paged_attention_tpu
from jaxtier.attention.reference import paged_attention_reference
from jaxtier.attention.xla_chunked import paged_attention
from jaxtier.attention.xla_gathered import paged_attention_gathered
from jaxtier.kvcache.contiguous import ContiguousKVCache
from jaxtier.kvcache.paged import (KVBlocks, PagedCacheConfig, PagedKVCache, PagedMetadata, attend,
                                   device_pool_bytes, host_pool_bytes, write_chunk)
from jaxtier.kvcache.swap import HostTier, SwapReport, swap_in, swap_out

__all__ = [
    "ContiguousKVCache", "HostTier", "KVBlocks", "KV_CACHE_DTYPES", "PagedCacheConfig", "PagedKVCache",
    "PagedMetadata", "SwapReport", "attend", "dense_attention", "dequantize_int8",
    "device_pool_bytes", "host_pool_bytes", "paged_attention", "paged_attention_cpu",
    "paged_attention_gathered", "paged_attention_reference", "paged_attention_tpu",
    "quantize_int8", "swap_in", "swap_out",
    "write_chunk",
]
