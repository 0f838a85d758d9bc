"""The model against Hugging Face on tiny random checkpoints, and cached decoding against a full pass."""

import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

from jaxtier import checkpoint
from jaxtier.kvcache import ContiguousKVCache
from conftest import fixture_path

TINY = ["tiny_llama", "tiny_qwen2"]


def _cache(model, batch, length, dtype=jnp.float32):
  c = model.config
  return ContiguousKVCache.create(c.num_layers, batch, length, c.num_kv_heads, c.head_dim, dtype)


@nnx.jit
def forward(model, cache, tokens_bt, pos_bt):
  return model(tokens_bt, pos_bt, cache)


def full_logits(model, tokens_bt):
  b, t = tokens_bt.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return np.asarray(forward(model, _cache(model, b, t), tokens_bt, pos)[0])


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
  directory = fixture_path(request.param)
  model, tokenizer = checkpoint.load_model(directory)
  return model, tokenizer, dict(np.load(fixture_path(request.param, "hf_logits.npz")))


def test_logits_match_hugging_face(tiny):
  model, _, ref = tiny
  for name in ("a", "b"):
    ids = ref[f"ids_{name}"]
    got = full_logits(model, jnp.asarray(ids)[None])[0]
    np.testing.assert_allclose(got, ref[f"logits_{name}"], atol=1e-4, rtol=0)


def test_cached_decoding_equals_full_forward(tiny):
  model, _, ref = tiny
  ids = jnp.asarray(ref["ids_b"])[None]
  full = full_logits(model, ids)[0]
  cache = _cache(model, 1, 32)
  prefix = 5
  logits, cache = forward(model, cache, ids[:, :prefix], jnp.arange(prefix)[None])
  got = [np.asarray(logits[0])]
  for i in range(prefix, ids.shape[1]):
    logits, cache = forward(model, cache, ids[:, i:i + 1], jnp.array([[i]]))
    got.append(np.asarray(logits[0]))
  np.testing.assert_allclose(np.concatenate(got), full, atol=1e-5, rtol=0)


def test_ragged_batch_with_padding_equals_single_rows(tiny):
  model, _, ref = tiny
  a, b = ref["ids_a"], ref["ids_b"]
  tokens = np.zeros((2, len(b)), np.int32)
  pos = np.full((2, len(b)), -1, np.int32)
  for row, ids in enumerate((a, b)):
    tokens[row, :len(ids)], pos[row, :len(ids)] = ids, np.arange(len(ids))
  logits, _ = forward(model, _cache(model, 2, 16), tokens, pos)
  np.testing.assert_allclose(np.asarray(logits[0, :len(a)]), ref["logits_a"], atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(logits[1]), ref["logits_b"], atol=1e-4, rtol=0)


def test_bfloat16_params_stay_close(tiny):
  _, _, ref = tiny
  model16, _ = checkpoint.load_model(fixture_path("tiny_llama"), dtype="bfloat16")
  assert model16.embed.embedding[...].dtype == jnp.bfloat16
  ref32 = dict(np.load(fixture_path("tiny_llama", "hf_logits.npz")))
  got = full_logits(model16, jnp.asarray(ref32["ids_b"])[None])[0].astype(np.float32)
  assert np.abs(got - ref32["logits_b"]).max() < 0.05 * np.abs(ref32["logits_b"]).max()
  assert (got.argmax(-1) == ref32["logits_b"].argmax(-1)).mean() >= 0.75


def test_orbax_round_trip_is_exact(tiny, tmp_path):
  model, tokenizer, ref = tiny
  checkpoint.save_orbax(str(tmp_path / "copy"), model, tokenizer)
  loaded = checkpoint.load(str(tmp_path / "copy"))
  assert loaded.kind == "orbax"
  assert loaded.model.config == model.config
  ids = jnp.asarray(ref["ids_a"])[None]
  np.testing.assert_array_equal(full_logits(loaded.model, ids), full_logits(model, ids))
  assert loaded.tokenizer.encode("Hello, world!") == tokenizer.encode("Hello, world!")
  assert loaded.tokenizer.chat_template == tokenizer.chat_template


@pytest.mark.parametrize("name, groups", [
    ("tiny_llama", [(1, "unrolled"), (2, "scan")]), ("tiny_llama", [(3, "unrolled")]),
    ("tiny_llama", [(2, "scan"), (1, "scan")]), ("tiny_qwen2", [(1, "scan"), (1, "unrolled")])])
def test_grouped_layers_equal_the_stacked_scan(name, groups):
  from jaxtier.model import GroupedTransformer
  model, _ = checkpoint.load_model(fixture_path(name))
  ref = dict(np.load(fixture_path(name, "hf_logits.npz")))
  ids = jnp.asarray(ref["ids_b"])[None]
  np.testing.assert_allclose(full_logits(GroupedTransformer(model, groups), ids),
                             full_logits(model, ids), atol=1e-6, rtol=0)


def test_grouped_layers_reject_bad_groups():
  from jaxtier.model import GroupedTransformer
  model, _ = checkpoint.load_model(fixture_path("tiny_llama"))
  with pytest.raises(ValueError, match="must have positive sizes adding up to num_layers=3"):
    GroupedTransformer(model, [(2, "scan")])
  with pytest.raises(ValueError, match="mode 'python'"):
    GroupedTransformer(model, [(3, "python")])
