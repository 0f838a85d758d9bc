"""KV caches for jaxtier's model: usable on their own, without the engine or the server."""

from jaxtier.kvcache.attention import dense_attention
from jaxtier.kvcache.contiguous import ContiguousKVCache

__all__ = ["ContiguousKVCache", "dense_attention"]
