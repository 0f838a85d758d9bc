"""Mixture-of-experts layers with their routed experts in pinned host memory
(`offload_expert_layers`), streamed to the device or computed on the host: against the resident
model, Hugging Face's log-probabilities, the padded driver under swaps and prefix hits, and the
programs exported for CUDA."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier import offload
import jaxtier
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.llm import dry_run
from jaxtier.model import GroupedTransformer, Transformer
from jaxtier.model.config import ModelConfig, config_from_hf
from jaxtier.offload.experts import ExpertOffloadedLayers, expert_group, is_expert_param
from jaxtier.tools.export import export_programs
from conftest import fixture_path
from test_dry_run import write_header_only
from test_model_families import (ATOL, ENGINE, GREEDY, greedy_against_reference, hf_reference,
                                 log_softmax, prompt_logprobs, prompts_of)

MOE = ["tiny_mixtral", "tiny_qwen3_moe"]


def tiny_moe(num_layers: int = 4) -> Transformer:
  config = ModelConfig(architecture="mixtral", vocab_size=97, hidden_size=32,
                       intermediate_size=64, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                       head_dim=8, max_position_embeddings=64, num_experts=6,
                       num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)
  return Transformer(config, rngs=nnx.Rngs(0))


@nnx.jit
def forward(model, cache, tokens_bt, pos_bt):
  return model(tokens_bt, pos_bt, cache)


@pytest.mark.parametrize("length", [1, 2, 11])  # host: gathered (n * k <= e), then masked
@pytest.mark.parametrize("stream_from", [None, 1])  # always on the host, always streamed
def test_offloaded_experts_equal_the_resident_model(length, stream_from):
  model = tiny_moe()
  c = model.config
  rng = np.random.default_rng(length)
  tokens = jnp.asarray(rng.integers(0, c.vocab_size, (1, length)), jnp.int32)
  pos = jnp.arange(length, dtype=jnp.int32)[None]
  cache = lambda: ContiguousKVCache.create(c.num_layers, 1, 16, c.num_kv_heads, c.head_dim)
  want = forward(model, cache(), tokens, pos)[0]
  placed = GroupedTransformer(model, [(1, "scan"), (3, expert_group(2, stream_from))])
  group = placed.groups[1]
  assert isinstance(group, ExpertOffloadedLayers)
  assert group.mode(length) == ("host" if stream_from is None else "stream")
  got = forward(placed, cache(), tokens, pos)[0]
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
  # only the routed experts live on the host
  flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(group))
  for path, leaf in flat:
    assert leaf.sharding.memory_kind == (offload.PINNED_HOST if is_expert_param(path)
                                         else offload.DEVICE)
  expert_bytes = 3 * 3 * 6 * 32 * 24 * 4  # layers x (gate, up, down) x e x h x f x float32
  assert offload.bytes_by_memory_kind(nnx.state(placed))[offload.PINNED_HOST] == expert_bytes


def test_expert_offload_refuses_dense_layers():
  from test_offload import tiny_model  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="needs mixture-of-experts layers"):
    GroupedTransformer(tiny_model(2), [(2, expert_group(1, None))])


@pytest.fixture(scope="module", params=[(n, m) for n in MOE for m in ("stream", "host")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def offloaded(request):
  name, mode = request.param
  llm = jaxtier.LLM(fixture_path(name), offload_expert_layers=-1, expert_offload_mode=mode,
                    **ENGINE)
  return name, mode, llm


def test_log_probabilities_match_hugging_face_with_every_expert_on_the_host(offloaded):
  name, mode, llm = offloaded
  ref = hf_reference(name)
  report = llm.memory_report()
  c = llm.config
  expert_bytes = c.num_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size * 4
  assert report["offload_expert_layers"] == c.num_layers
  assert report["host_weight_bytes"] == report["host_expert_bytes"] == expert_bytes
  assert llm.stats()["expert_stream_from_tokens"] == (1 if mode == "stream" else None)
  for key in ("a", "b"):
    ids = ref[f"ids_{key}"]
    want = log_softmax(ref[f"logits_{key}"].astype(np.float64))[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(prompt_logprobs(llm, ids), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["stream", "host"])
@pytest.mark.parametrize("name", MOE)
def test_every_layer_counted_explicitly_gives_the_resident_values(name, mode):
  """offload_expert_layers=num_layers is -1; both modes give the resident model's values."""
  ids = hf_reference(name)["ids_a"]
  resident = jaxtier.LLM(fixture_path(name), **ENGINE)
  explicit = jaxtier.LLM(fixture_path(name), offload_expert_layers=resident.config.num_layers,
                         expert_offload_mode=mode, **ENGINE)
  assert explicit.memory_report()["offload_expert_layers"] == resident.config.num_layers
  np.testing.assert_allclose(prompt_logprobs(explicit, ids), prompt_logprobs(resident, ids),
                             atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, mode, path", [("tiny_mixtral", "auto", "cpu"),
                                              ("tiny_qwen3_moe", "host", "portable"),
                                              ("tiny_mixtral", "stream", "portable")])
def test_under_swaps_chunked_prefill_and_prefix_hits(name, mode, path):
  """A small pool preempts by swapping, prompts prefill in chunks and hit cached prefixes on the
  second run: the padded driver's tokens every time (auto on CPU: decode on the host, prefill
  chunks streamed), every block back."""
  kernels = "portable" if path == "portable" else "auto"
  llm = jaxtier.LLM(fixture_path(name), max_model_len=64, max_num_seqs=4, block_size=4,
                    num_device_blocks=24, preemption_mode="swap", max_num_batched_tokens=16,
                    enable_prefix_caching=True, offload_expert_layers=1,
                    expert_offload_mode=mode, kernels=kernels)
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
  assert stats["offload_expert_layers"] == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(model="tiny_qwen3", offload_expert_layers=1), "has no mixture-of-experts layers"),
    (dict(model="tiny_mixtral", offload_expert_layers=3), r"expected -1 \(all\) or at most 2"),
    (dict(model="tiny_mixtral", offload_expert_layers=-2), "offload_expert_layers=-2"),
    (dict(model="tiny_mixtral", offload_expert_layers=1, expert_offload_mode="cpu"),
     "expert_offload_mode='cpu'"),
])
def test_bad_expert_offload_arguments(kwargs, match):
  model = fixture_path(kwargs.pop("model"))
  with pytest.raises(ValueError, match=match):
    jaxtier.LLM(model, **ENGINE, **kwargs)


def test_host_compute_needs_one_device():
  with pytest.raises(ValueError, match="expert_offload_mode='host' computes experts on one"):
    dry_run(fixture_path("tiny_mixtral"), offload_expert_layers=-1,
                    expert_offload_mode="host", tensor_parallel_size=2, **ENGINE)


def test_dry_run_reports_the_choice_per_batch_and_layer():
  plan = dry_run(fixture_path("tiny_mixtral"), platform="cuda", offload_expert_layers=1, **ENGINE)
  report = plan["expert_offload"]
  assert plan["offload_expert_layers"] == 1 and report["forced"] == "auto"
  assert set(report["layers"]) == {"1"}  # the last of two layers
  switch = report["stream_from_tokens"]
  for batch, row in report["by_batch"].items():
    assert row["mode"] == ("stream" if switch is not None and int(batch) >= switch else "host")
  assert plan["host_weight_bytes"] == plan["host_expert_bytes"] > 0
  assert plan["device_weight_bytes"] + plan["host_weight_bytes"] == dry_run(
      fixture_path("tiny_mixtral"), platform="cuda", **ENGINE)["device_weight_bytes"]


def test_tail_layers_move_whole_and_the_experts_group_is_the_rest():
  """offload_expert_layers counts from the end independently of offload_tail_layers: of the last
  two layers, the tail's one moves whole and the other keeps only its experts on the host."""
  resident = dry_run(fixture_path("tiny_mixtral"), **ENGINE)
  plan = dry_run(fixture_path("tiny_mixtral"), offload_expert_layers=2, offload_tail_layers=1,
                 prefetch_depth=1, **ENGINE)
  with open(fixture_path("tiny_mixtral", "config.json")) as f:
    c = config_from_hf(json.load(f))
  layer, experts = c.layer_param_count * 4, c.num_experts * 3 * 64 * 32 * 4
  assert (plan["offload_tail_layers"], plan["offload_expert_layers"]) == (1, 1)
  assert plan["host_expert_bytes"] == experts
  assert plan["host_weight_bytes"] == layer + experts
  assert plan["device_weight_bytes"] == resident["device_weight_bytes"] - layer - experts
  assert plan["prefetch_buffer_bytes"] == 2 * layer


def _header_only_mixtral(directory: str, layers=32, hidden=4096, heads=32, kv_heads=8,
                         head_dim=128, width=14336, experts=8, vocab=32000) -> str:
  """Mixtral-8x7B's shapes as transformers saves them: a real safetensors header over zero
  (sparse) data, all a dry run reads."""
  with open(fixture_path("tiny_mixtral", "config.json")) as f:
    config = json.load(f)
  config.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, intermediate_size=width, num_hidden_layers=layers,
                num_local_experts=experts, vocab_size=vocab, max_position_embeddings=32768,
                dtype="bfloat16")
  os.makedirs(directory)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    if os.path.exists(fixture_path("tiny_mixtral", name)):
      shutil.copy(fixture_path("tiny_mixtral", name), directory)
  shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden],
            "lm_head.weight": [vocab, hidden]}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes |= {p + "self_attn.q_proj.weight": [heads * head_dim, hidden],
               p + "self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
               p + "self_attn.v_proj.weight": [kv_heads * head_dim, hidden],
               p + "self_attn.o_proj.weight": [hidden, heads * head_dim],
               p + "block_sparse_moe.gate.weight": [experts, hidden],
               p + "input_layernorm.weight": [hidden],
               p + "post_attention_layernorm.weight": [hidden]}
    for j in range(experts):
      q = f"{p}block_sparse_moe.experts.{j}."
      shapes |= {q + "w1.weight": [width, hidden], q + "w2.weight": [hidden, width],
                 q + "w3.weight": [width, hidden]}
  return write_header_only(directory, shapes)


def test_mixtral_8x7b_plans_onto_one_80gb_gpu_with_its_experts_on_the_host(tmp_path):
  """Mixtral-8x7B in bfloat16 (93 GB) does not fit an 80 GB GPU; with every layer's experts in
  pinned host memory, 3 GB stay on the device, and the cost model computes a decode step's few
  routed experts on the host and streams them for large batches."""
  model = _header_only_mixtral(str(tmp_path / "mixtral"))
  machine = dict(platform="cuda", device_memory_gb=80, host_memory_gb=256, max_model_len=4096)
  with pytest.raises(ValueError, match="device KV pool holds 0 blocks"):
    dry_run(model, **machine)
  plan = dry_run(model, offload_expert_layers=-1, **machine)
  experts = 32 * 8 * 3 * 4096 * 14336 * 2
  assert plan["host_weight_bytes"] == plan["host_expert_bytes"] == experts
  attention = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 4096 + 2 * 4096) * 2
  assert plan["device_weight_bytes"] == attention + (2 * 32000 * 4096 + 4096) * 2 + 128 // 2 * 4
  assert plan["device_kv_blocks"] > 0 and plan["host_kv_bytes"] + experts <= 0.5 * 256e9
  report = plan["expert_offload"]
  assert report["by_batch"]["1"]["mode"] == "host"
  assert report["by_batch"]["256"]["mode"] == "stream"
  assert set(report["layers"]) == {str(i) for i in range(32)}


@pytest.mark.parametrize("mode", ["stream", "host"])
def test_cuda_decode_moves_the_streamed_experts_or_computes_on_the_host(mode):
  facts = export_programs(fixture_path("tiny_mixtral"), "cuda", offload_expert_layers=-1,
                          expert_offload_mode=mode, **ENGINE)
  experts = facts["plan"]["host_expert_bytes"]
  assert experts == facts["host_weight_bytes"] > 0
  for name in ("decode", "prefill"):
    program = facts["programs"][name]
    assert program["ok"], program["error"]
    assert program["host_compute_ops"] == 0 and program["cpu_custom_calls"] == 0
    if mode == "stream":
      assert program["h2d_bytes"] == experts and program["host_offload_compute_ops"] == 0
    else:
      # not the experts: each layer's [n, h] result (bfloat16) comes back
      _, rows, tokens, _ = program["key"]
      assert program["host_offload_compute_ops"] > 0
      assert program["h2d_bytes"] == 2 * rows * tokens * 64 * 2
