"""Qwen3, Mistral, Phi-3, Gemma 2 and 3, Mixtral and Qwen3-MoE against Hugging Face on tiny random
checkpoints (tests/fixtures, written by scripts/make_hf_fixtures.py --only_families), on the
stacked scan, through the engine on the CPU path (unrolled fused layers, the CPU kernels where
built) and on the scan path with XLA attention; greedy generation through the engine against the
padded reference driver; the configs' family options and refusals."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier import checkpoint
import jaxtier
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.model import FusedDecoderLayer, Transformer, UnrolledLayers
from jaxtier.model import sharding
from jaxtier.model.config import ModelConfig, config_from_hf
from conftest import fixture_path

FAMILIES = ["tiny_qwen3", "tiny_mistral", "tiny_phi3", "tiny_gemma2", "tiny_gemma3", "tiny_mixtral",
            "tiny_qwen3_moe"]
ATOL = 5e-3  # float32 against Hugging Face's float32
PATHS = {
    "cpu": dict(layer_execution="unrolled"),  # attention_impl auto: the CPU kernels when built
    # what a GPU or TPU runs: scanned layers, XLA attention, XLA's argmax, nothing packed
    "portable": dict(kernels="portable"),
}
ENGINE = dict(max_model_len=64, max_num_seqs=4, block_size=8)
GREEDY = jaxtier.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def hf_reference(name: str) -> dict:
  return dict(np.load(fixture_path(name, "hf_logits.npz")))


def log_softmax(logits: np.ndarray) -> np.ndarray:
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@nnx.jit
def forward(model, cache, tokens_bt, pos_bt):
  return model(tokens_bt, pos_bt, cache)[0]


@pytest.mark.parametrize("name", FAMILIES)
def test_loaded_model_matches_hugging_face(name):
  model, _ = checkpoint.load_model(fixture_path(name))
  ref = hf_reference(name)
  c = model.config
  for key in ("a", "b"):
    ids = jnp.asarray(ref[f"ids_{key}"])[None]
    t = ids.shape[1]
    cache = ContiguousKVCache.create(c.num_layers, 1, t, c.num_kv_heads, c.head_dim, jnp.float32)
    got = np.asarray(forward(model, cache, ids, jnp.arange(t, dtype=jnp.int32)[None]))[0]
    np.testing.assert_allclose(got, ref[f"logits_{key}"], atol=ATOL, rtol=0)


@pytest.fixture(scope="module", params=[(n, p) for n in FAMILIES for p in PATHS],
                ids=lambda np_: f"{np_[0]}-{np_[1]}")
def family_llm(request):
  name, path = request.param
  return name, path, jaxtier.LLM(fixture_path(name), **ENGINE, **PATHS[path])


def prompt_logprobs(llm, ids) -> np.ndarray:
  params = jaxtier.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
  out = llm.generate([list(map(int, ids))], params)[0]
  return np.array([entry[int(token)].logprob
                   for entry, token in zip(out.prompt_logprobs[1:], ids[1:])])


def test_engine_log_probabilities_match_hugging_face(family_llm):
  name, path, llm = family_llm
  if path == "cpu" and cpu_kernels.available():  # the kernels' path runs: packed fused layers
    groups = llm.loaded.model.groups
    assert isinstance(groups[0], UnrolledLayers)
    dense = not llm.config.num_experts  # a mixture of experts stays unfused, its attention too
    assert all(isinstance(layer, FusedDecoderLayer) == dense and getattr(layer, "packed", True)
               for layer in groups[0].layers)
  ref = hf_reference(name)
  for key in ("a", "b"):
    ids = ref[f"ids_{key}"]
    want = log_softmax(ref[f"logits_{key}"].astype(np.float64))[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(prompt_logprobs(llm, ids), want, atol=ATOL, rtol=0)


def prompts_of(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(2, vocab, n).tolist() for n in lengths]


def greedy_against_reference(llm, prompts) -> list[tuple[int, ...]]:
  got = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
  reference = llm.run_batch([llm.make_request(p, GREEDY) for p in prompts])
  assert got == [tuple(r.token_ids) for r in reference]
  return got


def test_engine_greedy_equals_the_padded_driver(family_llm):
  _, _, llm = family_llm
  greedy_against_reference(llm, prompts_of((5, 23, 12, 40), llm.config.vocab_size))
  stats = llm.stats()
  assert stats["device_blocks_free"] == stats["device_blocks_total"]


def test_qwen3_under_swapping_equals_the_padded_driver():
  llm = jaxtier.LLM(fixture_path("tiny_qwen3"), max_model_len=64, max_num_seqs=4, block_size=4,
                    num_device_blocks=16, preemption_mode="swap")
  greedy_against_reference(llm, prompts_of((30, 25, 33, 28), llm.config.vocab_size, seed=1))
  stats = llm.stats()
  assert stats["preemptions"]["swap"] > 0 and stats["swap_in_count"] == stats["swap_out_count"]


def test_qwen3_prefix_cache_hits_give_the_same_tokens():
  llm = jaxtier.LLM(fixture_path("tiny_qwen3"), enable_prefix_caching=True, **ENGINE)
  shared = prompts_of((24,), llm.config.vocab_size, seed=2)[0]
  prompts = [shared + tail for tail in prompts_of((3, 7), llm.config.vocab_size, seed=3)]
  first = greedy_against_reference(llm, prompts)
  again = llm.generate(prompts, GREEDY)
  assert [out.outputs[0].token_ids for out in again] == first
  assert all(out.num_cached_tokens >= 16 for out in again)


def test_qwen3_offloaded_tail_equals_the_padded_driver():
  llm = jaxtier.LLM(fixture_path("tiny_qwen3"), offload_tail_layers=1, prefetch_depth=1, **ENGINE)
  greedy_against_reference(llm, prompts_of((9, 17), llm.config.vocab_size, seed=4))


def test_gemma3_offloaded_tail_equals_the_padded_driver():
  """The offloaded stack holds part of the layers and keeps the model's per-layer windows and
  rotary tables (looked up by each layer's index in the whole model)."""
  llm = jaxtier.LLM(fixture_path("tiny_gemma3"), offload_tail_layers=1, prefetch_depth=1,
                    kernels="portable", **ENGINE)
  prompts = prompts_of((9, 30), llm.config.vocab_size, seed=7)
  resident = jaxtier.LLM(fixture_path("tiny_gemma3"), kernels="portable", **ENGINE)
  assert greedy_against_reference(llm, prompts) == [
      out.outputs[0].token_ids for out in resident.generate(prompts, GREEDY)]


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_phi3"])
def test_orbax_round_trip_is_exact(name, tmp_path):
  model, tokenizer = checkpoint.load_model(fixture_path(name))
  checkpoint.save_orbax(str(tmp_path / "copy"), model, tokenizer)
  loaded = checkpoint.load(str(tmp_path / "copy"))
  assert loaded.model.config == model.config
  ids = jnp.asarray(hf_reference(name)["ids_a"][:16])[None]
  c = model.config
  pos = jnp.arange(16, dtype=jnp.int32)[None]
  cache = lambda: ContiguousKVCache.create(c.num_layers, 1, 16, c.num_kv_heads, c.head_dim,
                                           jnp.float32)
  np.testing.assert_array_equal(np.asarray(forward(loaded.model, cache(), ids, pos)),
                                np.asarray(forward(model, cache(), ids, pos)))


def write_family_gguf(path: str, name: str, types: dict | None = None) -> None:
  """A tiny fixture as llama.cpp's converter names it: q/k rows as in HF (Qwen3 and Phi-3 run
  NeoX-style rotary), Phi-3's q/k/v fused in attn_qkv and gate/up in ffn_up; each tensor float32
  unless `types` gives a GGML type for its name (e.g. {"attn_qkv": Q8_0})."""
  import gguf  # pylint: disable=import-outside-toplevel
  from jaxtier.checkpoint import hf  # pylint: disable=import-outside-toplevel
  directory = fixture_path(name)
  config = hf.read_config(directory)
  params = hf.read_params(directory, config)
  with open(fixture_path(name, "tokenizer.json")) as f:
    tok = json.load(f)
  from test_checkpoint import llama_gguf_writer  # pylint: disable=import-outside-toplevel
  writer = llama_gguf_writer(path, config, config.architecture, head_dims=True)
  vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
  writer.add_token_list([t for t, _ in vocab])
  writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                           for m in tok["model"]["merges"]])
  writer.add_token_types([gguf.TokenType.CONTROL if t in ("<s>", "</s>")
                          else gguf.TokenType.NORMAL for t, _ in vocab])
  writer.add_eos_token_id(tok["model"]["vocab"]["</s>"])
  if config.architecture == "phi3":
    names = {"attn_qkv": ("q_proj", "k_proj", "v_proj"), "attn_output": ("o_proj",),
             "ffn_up": ("gate_proj", "up_proj"), "ffn_down": ("down_proj",)}
  else:
    names = {"attn_q": ("q_proj",), "attn_k": ("k_proj",), "attn_v": ("v_proj",),
             "attn_output": ("o_proj",), "ffn_gate": ("gate_proj",), "ffn_up": ("up_proj",),
             "ffn_down": ("down_proj",)}
  norms = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm"}
  if config.qk_norm:
    norms.update(attn_q_norm="q_norm", attn_k_norm="k_norm")
  for i in range(config.num_layers):
    for g, ours in names.items():
      w = np.concatenate([params[("layers", p, "kernel")][i].T for p in ours])  # [out, in]
      qtype = (types or {}).get(g)
      if qtype is None:
        writer.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(w))
      else:
        writer.add_tensor(f"blk.{i}.{g}.weight", gguf.quants.quantize(w, qtype),
                          raw_dtype=qtype)
    for g, ours in norms.items():
      writer.add_tensor(f"blk.{i}.{g}.weight", params[("layers", ours, "scale")][i])
  writer.add_tensor("token_embd.weight", params[("embed", "embedding")])
  writer.add_tensor("output_norm.weight", params[("final_norm", "scale")])
  if not config.tie_word_embeddings:
    writer.add_tensor("output.weight", params[("lm_head",)])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_phi3"])
def test_gguf_matches_hugging_face(name, tmp_path):
  path = str(tmp_path / f"{name}.gguf")
  write_family_gguf(path, name)
  loaded = checkpoint.load(path)
  assert loaded.kind == "gguf"
  c = loaded.model.config
  want = config_from_hf(hf_config(name))
  assert c.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # stored as float32
  assert c == dataclasses.replace(want, rms_norm_eps=c.rms_norm_eps)
  ref = hf_reference(name)
  ids = jnp.asarray(ref["ids_a"])[None]
  cache = ContiguousKVCache.create(c.num_layers, 1, 48, c.num_kv_heads, c.head_dim, jnp.float32)
  got = np.asarray(forward(loaded.model, cache, ids, jnp.arange(48, dtype=jnp.int32)[None]))[0]
  np.testing.assert_allclose(got, ref["logits_a"], atol=ATOL, rtol=0)
  llm = jaxtier.LLM(path, **ENGINE)  # placed from the file: unrolled fused layers on CPU
  greedy_against_reference(llm, prompts_of((6, 14), c.vocab_size, seed=5))


def test_phi3_gguf_fused_blocks_kept_equal_the_dequantized_model(tmp_path):
  """Phi-3's fused Q8_0 tensors, split by rows, kept in blocks by the CPU layers: the same
  products as the dequantized weights."""
  import gguf  # pylint: disable=import-outside-toplevel
  path = str(tmp_path / "tiny_phi3_q8.gguf")
  q8 = gguf.GGMLQuantizationType.Q8_0
  write_family_gguf(path, "tiny_phi3", {"attn_qkv": q8, "ffn_up": q8})
  llm = jaxtier.LLM(path, block_activations="float32", layer_execution="unrolled", **ENGINE)
  if cpu_kernels.available():
    for layer in llm.loaded.model.groups[0].layers:  # blocks, not float32 panels
      assert layer.qkv_kernel[...].dtype != jnp.float32
      assert layer.gate_up_kernel[...].dtype != jnp.float32
      assert layer.o_kernel[...].dtype == jnp.float32
  model, _ = checkpoint.load_model(path)  # dequantized, stacked
  ids = hf_reference("tiny_phi3")["ids_b"]
  c = model.config
  cache = ContiguousKVCache.create(c.num_layers, 1, 48, c.num_kv_heads, c.head_dim, jnp.float32)
  logits = np.asarray(forward(model, cache, jnp.asarray(ids)[None],
                              jnp.arange(48, dtype=jnp.int32)[None]))[0]
  want = log_softmax(logits.astype(np.float64))[np.arange(47), ids[1:]]
  np.testing.assert_allclose(prompt_logprobs(llm, ids), want, atol=1e-4, rtol=0)


# The configs: what each family's options come from, and what is refused.


def hf_config(name: str) -> dict:
  with open(fixture_path(name, "config.json")) as f:
    return json.load(f)


def test_family_options_from_the_configs():
  qwen3 = config_from_hf(hf_config("tiny_qwen3"))
  assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim, qwen3.sliding_window) == (
      True, False, 32, None)
  assert qwen3.rope_theta == 1e6  # from transformers 5's rope_parameters
  mistral = config_from_hf(hf_config("tiny_mistral"))
  assert (mistral.qk_norm, mistral.sliding_window) == (False, 16)
  gemma2 = config_from_hf(hf_config("tiny_gemma2"))
  assert (gemma2.layer_windows(), gemma2.hidden_act, gemma2.sandwich_norms, gemma2.norm_offset,
          gemma2.embed_scale, gemma2.query_scale, gemma2.attn_softcap, gemma2.final_softcap) == (
              (16, None), "gelu_pytorch_tanh", True, 1.0, 8.0, 24 ** -0.5, 2.0, 3.0)
  older = dict(hf_config("tiny_gemma2"), num_hidden_layers=3)  # transformers 4: no layer_types
  del older["layer_types"]
  assert config_from_hf(older).layer_windows() == (16, None, 16)
  gemma3 = config_from_hf(hf_config("tiny_gemma3"))
  assert (gemma3.qk_norm, gemma3.layer_windows(), gemma3.layer_ropes(), gemma3.rope_theta,
          gemma3.sliding_rope_theta, gemma3.rope_scaling.rope_type, gemma3.rope_scaling.factor,
          gemma3.attn_softcap) == (True, (16, None), (1, 0), 1e6, 1e4, "linear", 8.0, None)
  assert gemma3.inv_freq().shape == (2, 8)
  older = dict(hf_config("tiny_gemma3"), num_hidden_layers=7, rope_theta=1e6,
               rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
  for key in ("layer_types", "rope_parameters"):  # transformers 4 wrote neither
    del older[key]
  older = config_from_hf(older)
  assert older.layer_ropes() == (1, 1, 1, 1, 1, 0, 1)  # a full layer every sixth
  assert (older.sliding_rope_theta, older.rope_scaling.factor) == (1e4, 8.0)
  phi3 = config_from_hf(hf_config("tiny_phi3"))
  assert (phi3.qk_norm, phi3.attention_bias, phi3.sliding_window) == (False, False, None)
  older = dict(hf_config("tiny_phi3"), rope_theta=5000.0, rope_scaling=None)  # transformers 4
  del older["rope_parameters"]
  assert config_from_hf(older).rope_theta == 5000.0


@pytest.mark.parametrize("name", FAMILIES)
def test_layer_param_count_counts_every_layer_parameter(name):
  model, _ = checkpoint.load_model(fixture_path(name))
  c = model.config
  layers = sum(x.size for x in jax.tree.leaves(nnx.state(model.layers, nnx.Param)))
  assert layers == c.num_layers * c.layer_param_count


def test_q_k_norms_have_logical_axes():
  assert sharding.param_axes(("layers", "q_norm", "scale"), 2) == ("layers", "head_dim")
  assert sharding.param_axes(("k_norm", "scale"), 1) == ("head_dim",)


def test_the_sliding_window_is_what_matches_hugging_face():
  """Mistral's 16-token window over 48-token sequences: without it the logits past the window
  leave Hugging Face's (so the match above is the window's)."""
  model, _ = checkpoint.load_model(fixture_path("tiny_mistral"))
  ref = hf_reference("tiny_mistral")
  full = dataclasses.replace(model.config, sliding_window=None)
  unwindowed = Transformer(full, rngs=nnx.Rngs(0))
  nnx.update(unwindowed, nnx.state(model))
  ids = jnp.asarray(ref["ids_a"])[None]
  t, c = ids.shape[1], full
  cache = ContiguousKVCache.create(c.num_layers, 1, t, c.num_kv_heads, c.head_dim, jnp.float32)
  got = np.asarray(forward(unwindowed, cache, ids, jnp.arange(t, dtype=jnp.int32)[None]))[0]
  error = np.abs(got - ref["logits_a"]).max(-1)
  assert error[:16].max() < ATOL < error[16:].max()


@pytest.mark.parametrize("name, path", [("tiny_mistral", "cpu"), ("tiny_mistral", "portable"),
                                        ("tiny_gemma2", "cpu"), ("tiny_gemma2", "portable"),
                                        ("tiny_gemma3", "portable"), ("tiny_mixtral", "cpu"),
                                        ("tiny_qwen3_moe", "portable")])
def test_under_swaps_chunked_prefill_and_prefix_hits(name, path):
  """Prompts longer than the window (Mistral's on every layer, Gemma's on every other; the
  mixtures of experts have none), prefilled in chunks, preempted by swapping under a small pool,
  then run again on cached prefixes: the padded driver's tokens every time, every block back."""
  llm = jaxtier.LLM(fixture_path(name), max_model_len=64, max_num_seqs=4, block_size=4,
                    num_device_blocks=24, preemption_mode="swap", max_num_batched_tokens=16,
                    enable_prefix_caching=True, **PATHS[path])
  shared = prompts_of((20,), llm.config.vocab_size, seed=5)[0]
  prompts = [shared + tail for tail in prompts_of((11, 3, 14, 9), llm.config.vocab_size, seed=6)]
  first = greedy_against_reference(llm, prompts)
  stats = llm.stats()
  assert stats["preemptions"]["swap"] > 0 and stats["swap_in_count"] == stats["swap_out_count"]
  again = llm.generate(prompts, GREEDY)
  assert [out.outputs[0].token_ids for out in again] == first
  assert any(out.num_cached_tokens >= 16 for out in again)
  stats = llm.stats()
  assert stats["device_blocks_free"] == stats["device_blocks_total"]


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_qwen3"])
def test_qwen_window_applies_only_with_use_sliding_window(name):
  raw = dict(hf_config(name), sliding_window=16)
  assert config_from_hf(raw).sliding_window is None
  raw.update(use_sliding_window=True, layer_types=["sliding_attention"] * 2)
  assert config_from_hf(raw).sliding_window == 16


@pytest.mark.parametrize("key, rope", [  # as transformers 5 and 4 write them
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                         "long_factor": [2.0] * 8}),
    ("rope_scaling", {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})])
def test_phi3_long_rope_is_a_clear_error(tmp_path, key, rope):
  shutil.copytree(fixture_path("tiny_phi3"), tmp_path / "m")
  raw = hf_config("tiny_phi3")
  raw[key] = rope
  (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
  with pytest.raises(ValueError, match="rope scaling '(longrope|su)' is not supported"):
    checkpoint.load(str(tmp_path / "m"))


def test_partial_rotary_factor_is_refused():
  raw = hf_config("tiny_phi3")
  raw["rope_parameters"]["partial_rotary_factor"] = 0.5
  with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
    config_from_hf(raw)


def test_gemma3_image_and_text_checkpoint_loads_its_text_tower(tmp_path):
  """A `gemma3` checkpoint as transformers saves Gemma3ForConditionalGeneration: the text
  config nested, the text tower's tensors under `language_model.`, a vision tower beside."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  source = fixture_path("tiny_gemma3")
  text = hf_config("tiny_gemma3")
  config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
            "tie_word_embeddings": True}
  (tmp_path / "config.json").write_text(json.dumps(config))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(fixture_path("tiny_gemma3", name), tmp_path / name)
  tensors = safetensors.numpy.load_file(fixture_path("tiny_gemma3", "model.safetensors"))
  renamed = {"language_model." + name: value for name, value in tensors.items()}
  renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((4, 3, 2, 2),
                                                                                     np.float32)
  renamed["multi_modal_projector.mm_soft_emb_norm.weight"] = np.zeros(4, np.float32)
  safetensors.numpy.save_file(renamed, str(tmp_path / "model.safetensors"))
  model, _ = checkpoint.load_model(str(tmp_path))
  want, _ = checkpoint.load_model(source)
  assert model.config == want.config
  ref = hf_reference("tiny_gemma3")
  ids = jnp.asarray(ref["ids_a"])[None]
  t, c = ids.shape[1], model.config
  cache = lambda: ContiguousKVCache.create(c.num_layers, 1, t, c.num_kv_heads, c.head_dim,
                                           jnp.float32)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  np.testing.assert_allclose(np.asarray(forward(model, cache(), ids, pos))[0], ref["logits_a"],
                             atol=ATOL, rtol=0)
