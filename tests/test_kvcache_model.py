"""The default model (SmolLM2-135M-Instruct) running on the paged cache.

Paged float32 KV decodes the same greedy tokens as the contiguous cache; INT8 KV is measured against
float32 KV by greedy agreement and by perplexity on a held-out text (tests/data/heldout.txt).

Shape legend: b batch, t tokens, v vocab, m blocks per sequence.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier.checkpoint import load_model
from jaxtier.kvcache import ContiguousKVCache, PagedCacheConfig, PagedKVCache, PagedMetadata

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
DECODE_STEPS = 16
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The waves",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. In plants, it",
    "Once upon a time",
    "The three primary colors are",
]
HELDOUT = os.path.join(os.path.dirname(__file__), "data", "heldout.txt")


@pytest.fixture(scope="module")
def smollm():
  model, tokenizer = load_model("smollm2-135m-instruct", dtype="float32")
  graphdef, state = nnx.split(model)
  return graphdef, state, tokenizer, model.config


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def forward(graphdef, state, tokens_bt, pos_bt, cache, meta):
  return nnx.merge(graphdef, state)(tokens_bt, pos_bt, cache, meta)


def paged(config, kv_cache_dtype: str, tokens_per_seq: list[int], seed: int = 0):
  """A paged cache and metadata giving each sequence shuffled blocks for its tokens."""
  used = [-(-n // BLOCK_SIZE) for n in tokens_per_seq]
  num_blocks = sum(used) + 3
  ids = np.random.default_rng(seed).permutation(num_blocks)
  table = np.full((len(used), max(used)), -1, np.int32)
  for i, u in enumerate(used):
    table[i, :u] = ids[sum(used[:i]):sum(used[:i]) + u]
  cache_config = PagedCacheConfig(config.num_layers, config.num_kv_heads, config.head_dim,
                                  num_blocks, block_size=BLOCK_SIZE, num_host_blocks=0,
                                  kv_cache_dtype=kv_cache_dtype, attention_impl="auto")
  return PagedKVCache.create(cache_config), PagedMetadata.create(table, num_blocks)


def greedy(smollm, prompts_ids, cache, meta):
  """Right-padded batched prefill, then DECODE_STEPS greedy steps: tokens [b, DECODE_STEPS]."""
  graphdef, state, _, _ = smollm
  lens = np.array([len(p) for p in prompts_ids])
  tokens = np.zeros((len(lens), lens.max()), np.int32)
  pos = np.full(tokens.shape, -1, np.int32)
  for i, ids in enumerate(prompts_ids):
    tokens[i, :len(ids)], pos[i, :len(ids)] = ids, np.arange(len(ids))
  logits_btv, cache = forward(graphdef, state, tokens, pos, cache, meta)
  next_b = np.asarray(jnp.argmax(logits_btv[np.arange(len(lens)), lens - 1], -1))
  out = [next_b]
  for step in range(DECODE_STEPS - 1):
    pos_b1 = (lens + step)[:, None].astype(np.int32)
    logits_btv, cache = forward(graphdef, state, next_b[:, None].astype(np.int32), pos_b1, cache,
                                meta)
    next_b = np.asarray(jnp.argmax(logits_btv[:, 0], -1))
    out.append(next_b)
  return np.stack(out, 1)


def prompt_ids(smollm):
  return [smollm[2].encode(p) for p in PROMPTS]


def test_paged_decoding_equals_contiguous(smollm):
  _, _, _, config = smollm
  ids = prompt_ids(smollm)
  total = [len(p) + DECODE_STEPS for p in ids]
  contiguous = ContiguousKVCache.create(config.num_layers, len(ids), max(total),
                                        config.num_kv_heads, config.head_dim)
  want = greedy(smollm, ids, contiguous, None)
  got = greedy(smollm, ids, *paged(config, "float32", total))
  np.testing.assert_array_equal(got, want)


def test_int8_kv_greedy_agreement(smollm, record_property):
  _, _, _, config = smollm
  ids = prompt_ids(smollm)
  total = [len(p) + DECODE_STEPS for p in ids]
  reference = greedy(smollm, ids, *paged(config, "float32", total))
  quantized = greedy(smollm, ids, *paged(config, "int8", total))
  agreement = float((reference == quantized).mean())
  diverged = ~np.cumprod(reference == quantized, axis=1).astype(bool)
  prefix = float((~diverged).sum(1).mean())
  record_property("int8_greedy_agreement", agreement)
  record_property("int8_mean_agreeing_prefix", prefix)
  print(f"int8 KV greedy agreement {agreement:.3f}, mean agreeing prefix {prefix:.1f}/"
        f"{DECODE_STEPS}")
  assert agreement >= 0.9 and prefix >= 12


def perplexity(smollm, ids, kv_cache_dtype: str, chunk: int = 128) -> float:
  """exp(mean next-token NLL) with the text fed in chunks through a paged cache."""
  graphdef, state, _, config = smollm
  n = len(ids)
  cache, meta = paged(config, kv_cache_dtype, [n])
  tokens = np.zeros(-(-n // chunk) * chunk, np.int32)
  tokens[:n] = ids
  nll = []
  for start in range(0, n, chunk):
    pos = np.arange(start, start + chunk)
    pos_1t = np.where(pos < n, pos, -1)[None].astype(np.int32)
    logits_btv, cache = forward(graphdef, state, tokens[None, start:start + chunk], pos_1t, cache,
                                meta)
    logp_tv = jax.nn.log_softmax(logits_btv[0].astype(jnp.float32), -1)
    target = pos + 1 < n
    nll.append(-np.asarray(logp_tv)[target, tokens[pos[target] + 1]])
  return float(np.exp(np.concatenate(nll).mean()))


def test_int8_kv_perplexity_on_heldout_text(smollm, record_property):
  with open(HELDOUT) as f:
    ids = smollm[2].encode(f.read())
  ppl = {dtype: perplexity(smollm, ids, dtype) for dtype in ("float32", "bfloat16", "int8")}
  increase = ppl["int8"] / ppl["float32"] - 1
  for dtype, value in ppl.items():
    record_property(f"perplexity_{dtype}", value)
  record_property("int8_perplexity_increase", increase)
  print(f"held-out perplexity over {len(ids)} tokens: {ppl}; int8 increase {increase:.4%}")
  assert 1 < ppl["float32"] < 100
  assert increase <= 0.01
