"""KV byte counts (`jaxtier.common.kv_bytes`) against the pools a `PagedKVCache` really
allocates."""

import pytest

from jaxtier import offload
from jaxtier.common import kv_bytes
from jaxtier.common.kv_bytes import kv_block_bytes, kv_bytes_per_token
from jaxtier.kvcache import (KV_CACHE_DTYPES, HostTier, PagedCacheConfig, PagedKVCache,
                             device_pool_bytes, host_pool_bytes, swap_out)
from jaxtier.model.config import ModelConfig

DTYPES = ("float32", "bfloat16", "int8")
L, K, D, C = 3, 2, 8, 4
DEVICE_BLOCKS, HOST_BLOCKS = 5, 3


def _cache(dtype: str) -> PagedKVCache:
  return PagedKVCache.create(PagedCacheConfig(L, K, D, DEVICE_BLOCKS, block_size=C,
                                              num_host_blocks=HOST_BLOCKS, kv_cache_dtype=dtype,
                                              attention_impl="auto"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_bytes_match_the_allocated_pools(dtype):
  cache = _cache(dtype)
  block = kv_block_bytes(L, K, D, dtype, C)
  assert device_pool_bytes(cache) == DEVICE_BLOCKS * block
  host, _ = swap_out(cache, HostTier.empty(HOST_BLOCKS), range(HOST_BLOCKS), range(HOST_BLOCKS))
  assert host_pool_bytes(cache) == host.bytes_stored() == HOST_BLOCKS * block
  assert cache.config.bytes_per_block == block


def test_int8_counts_its_scales_everywhere():
  cache = _cache("int8")
  allocated_per_token = device_pool_bytes(cache) // (DEVICE_BLOCKS * C)
  assert allocated_per_token == kv_bytes_per_token(L, K, D, "int8") == 2 * L * K * (D + 4)
  config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=K * D, intermediate_size=32,
                       num_layers=L, num_heads=K, num_kv_heads=K, head_dim=D,
                       tie_word_embeddings=True, max_position_embeddings=64)
  planned = offload.ModelBytes.from_config(config, "bfloat16", kv_cache_dtype="int8")
  assert planned.kv_bytes_per_token == allocated_per_token
  assert planned.kv_bytes_per_token * C == cache.config.bytes_per_block


def test_design_example_and_validation():
  # A 7B model's 4096 tokens: 28 layers x 2 x 32 x 128 x 2 B x 4096 tokens = 1.88 GB.
  assert kv_block_bytes(28, 32, 128, "bfloat16", 4096) == 1_879_048_192
  assert set(kv_bytes.ELEMENT_BYTES) == set(KV_CACHE_DTYPES) == set(DTYPES)
  with pytest.raises(ValueError, match="kv_cache_dtype='float16'"):
    kv_bytes_per_token(2, 2, 8, "float16")
  with pytest.raises(ValueError, match="num_kv_heads=0"):
    kv_bytes_per_token(2, 0, 8, "int8")
  with pytest.raises(ValueError, match="block_size=True"):
    kv_block_bytes(2, 2, 8, "int8", True)
