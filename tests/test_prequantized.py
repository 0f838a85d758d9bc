"""Checkpoints quantized before download (`jaxtier.checkpoint.prequantized`): every weight the
loader reconstructs against the formats' own dequantization (tests/quant_reference.py, ports of
the libraries' unpacking; compressed-tensors' library itself where installed), the model's
log-probabilities against the float model built from those weights on the CPU kernels and the
portable path with an offloaded tail, the engine's reports and plans, the CUDA export of an
offloaded compact tail, and the refusals.

Fixtures: tests/fixtures/quantized, written by scripts/make_quant_fixtures.py."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtier
from jaxtier.checkpoint import hf, loading, placed
from jaxtier.checkpoint.params import (ArraySource, HF_LAYER_NAMES, is_layer_path,
                                       params_from_model)
from jaxtier.checkpoint.quantized import QuantizedSource
from jaxtier.kernels.cpu import matmul
from jaxtier.model import Transformer, quant
from jaxtier.sampling import SamplingParams
from jaxtier.tools import export, hlo
from conftest import fixture_path
from test_dry_run import run_script, write_header_only
from test_matmul_blocks import logits_of, q4_config
from test_quant import DictSource
from test_tensor_parallel import run_worker
import quant_reference

ROOT = fixture_path("quantized")
MOE = "gptq_moe"  # a mixture of experts: its own test
FIXTURES = sorted(set(os.listdir(ROOT)) - {MOE})
PROJECTIONS = {path[1]: name[:-len(".weight")] for name, path in HF_LAYER_NAMES.items()
               if path[1] in quant.PROJECTIONS and name.endswith("proj.weight")}
EXPERTS = {"gate_proj": "expert_gate", "up_proj": "expert_up", "down_proj": "expert_down"}


def reference_weights(directory: str) -> dict[tuple[str, int], np.ndarray]:
  """{(projection, layer): the float32 weight [in, out]} by the formats' own dequantization (a
  mixture of experts': its attention projections, and each expert stack [experts, in, out])."""
  tensors = quant_reference.read_safetensors(os.path.join(directory, "model.safetensors"))
  with open(os.path.join(directory, "config.json")) as f:
    raw = json.load(f)
  qc = raw["quantization_config"]
  out = {}
  experts = raw.get("num_experts") or raw.get("num_local_experts", 0)
  modules = {proj: [name] for proj, name in PROJECTIONS.items()
             if not (experts and name.startswith("mlp."))}
  for name, path in EXPERTS.items():
    if experts:
      modules[path] = [f"mlp.experts.{e}.{name}" for e in range(experts)]
  fused = {}  # Phi-3's fused projections: name -> (part, its output width) in order
  if "Phi3ForCausalLM" in raw["architectures"]:
    heads, kv, d = (raw["num_attention_heads"], raw["num_key_value_heads"],
                    raw["hidden_size"] // raw["num_attention_heads"])
    fused = {"self_attn.qkv_proj": (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)),
             "mlp.gate_up_proj": (("gate_proj", raw["intermediate_size"]),
                                  ("up_proj", raw["intermediate_size"]))}
    modules = {proj: names for proj, names in modules.items()
               if proj not in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
  for layer in range(raw["num_hidden_layers"]):
    for proj, names in modules.items():
      stack = [weight(tensors, qc, f"model.layers.{layer}.{name}") for name in names]
      out[proj, layer] = stack[0] if proj in PROJECTIONS else np.stack(stack)
    for name, parts in fused.items():
      w, start = weight(tensors, qc, f"model.layers.{layer}.{name}"), 0
      for proj, width in parts:
        out[proj, layer], start = w[:, start:start + width], start + width
  return out


def weight(tensors: dict, qc: dict, p: str) -> np.ndarray:
  """One module's weight [in, out] by its format's dequantization."""
  if qc["quant_method"] == "gptq":
    w = quant_reference.gptq_dequantize(tensors[p + ".qweight"], tensors[p + ".qzeros"],
                                        tensors[p + ".scales"], tensors[p + ".g_idx"],
                                        qc["bits"], qc.get("checkpoint_format") == "gptq_v2")
  elif qc["quant_method"] == "awq":
    w = quant_reference.awq_dequantize(tensors[p + ".qweight"], tensors[p + ".qzeros"],
                                       tensors[p + ".scales"], qc["group_size"])
  else:
    w = quant_reference.ct_dequantize(tensors, p)
  return w.T


@pytest.fixture(scope="module")
def references():
  return {name: reference_weights(os.path.join(ROOT, name)) for name in FIXTURES + [MOE]}


def open_source(name: str):
  return loading._open_path(os.path.join(ROOT, name))  # pylint: disable=protected-access


@pytest.mark.parametrize("name", FIXTURES)
def test_every_weight_equals_the_formats_dequantization(name, references):
  """Dequantized (`read`), in the stacked layers' layout (rows back in order where act-order
  permuted them), and in the CPU kernels' blocks where they hold it: bit for bit the format's
  weight."""
  with open_source(name) as opened:
    source = opened.source
    for (proj, layer), want in references[name].items():
      path = ("layers", proj, "kernel")
      np.testing.assert_array_equal(source.read(path, [layer])[0], want)
      fmt = source.layout(path).on("cpu")
      parts = quant.cast_parts(source.read_blocks(path, [layer], "stored"), fmt)
      w = np.asarray(quant.dequantize(parts["values"], parts["scales"], parts.get("mins")))[0]
      if fmt.perm:
        w = w[np.argsort(parts["perm"][0])]
      np.testing.assert_array_equal(w, want)
      kind = source.quantization(path, layer)
      if kind in matmul.BLOCK_FORMATS:
        packed = matmul.pack_blocks(kind, [b[0] for b in source.read_blocks(path, [layer], kind)])
        got = np.swapaxes(np.asarray(matmul.dequantize_packed(packed)), 0, 1)
        np.testing.assert_array_equal(got.reshape(want.shape[0], -1)[:, :want.shape[1]], want)


def test_the_formats_hold_what_they_say():
  """4-bit values in Q4_1 blocks, 8-bit in Q8_0 or (zero points) Q8_16, FP8 and act-order in
  the stacked layouts alone (the CPU kernels have no blocks for them)."""
  expected = {"ct_w4a16": "q4_1", "ct_w4a16_asym": "q4_1", "ct_w8a16": "q8_0", "ct_w8a8": "q8_0",
              "ct_fp8_dynamic": "stored", "ct_fp8_tensor": "stored", "gptq_4bit": "q4_1",
              "gptq_act_order": "stored", "gptq_8bit": "q8_16", "awq_4bit": "q4_1",
              "gptq_phi3": "q4_1", "gptq_v2": "q4_1", "ct_w8a16_asym": "q8_16"}
  assert set(expected) == set(FIXTURES)
  for name, kind in expected.items():
    with open_source(name) as opened:
      path = ("layers", "down_proj", "kernel")
      assert opened.source.quantization(path) == kind, name
      fmt = opened.source.layout(path)
      assert fmt.values == {"q4_1": "uint4", "q8_0": "int8", "q8_16": "int8"}.get(
          kind, "float8_e4m3fn" if "fp8" in name else "uint4"), name
      assert fmt.perm == (name == "gptq_act_order")


def test_compressed_tensors_decompresses_to_the_same_weights(references):
  """The library's own decompression, where it is installed (the fixture script checks this
  too): jaxtier's exact weights rounded once to the checkpoint's bfloat16 are the library's."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("compressed_tensors")
  from compressed_tensors.compressors import BaseCompressor  # pylint: disable=import-outside-toplevel
  from compressed_tensors.quantization import QuantizationConfig  # pylint: disable=import-outside-toplevel
  from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel
  for name in (n for n in FIXTURES if n.startswith("ct_")):
    directory = os.path.join(ROOT, name)
    with open(os.path.join(directory, "config.json")) as f:
      config = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.load_from_registry(config.format)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    for (proj, layer), want in references[name].items():
      prefix = f"model.layers.{layer}.{PROJECTIONS[proj]}."
      state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
      got = compressor.decompress(state, scheme)["weight"]
      assert torch.equal(torch.tensor(want.T).to(got.dtype), got), (name, proj, layer)


def float_model(name: str, references):
  """The float model of the dequantized weights (and the checkpoint's other tensors)."""
  with open_source(name) as opened:
    params = {p: opened.source.read(p) for p in opened.source.shapes()
              if not (is_layer_path(p) and (p[1] in quant.PROJECTIONS and p[2] == "kernel"
                                            or p[1] in EXPERTS.values()))}
    config = opened.config
  for proj in {p for p, _ in references[name]}:
    path = ("layers", proj) if proj in EXPERTS.values() else ("layers", proj, "kernel")
    params[path] = np.stack([references[name][proj, i] for i in range(config.num_layers)])
  return config, placed.build(config, ArraySource(params), jnp.float32,
                              placed.Layout(((config.num_layers, "scan"),)))


def log_probs(logits) -> list[np.ndarray]:
  return [np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1)) for x in logits]


LAYOUTS = {
    # the CPU kernels: a resident layer in blocks, an offloaded one held per layer likewise
    "cpu": dict(layer_execution="unrolled", block_activations="float32"),
    # the portable path: a scanned layer and an offloaded stack in the compact layouts
    "portable": dict(layer_execution="scan", portable=True, platform="cpu"),
}


@pytest.mark.parametrize("path", sorted(LAYOUTS))
@pytest.mark.parametrize("name", FIXTURES)
def test_log_probs_equal_the_dequantized_float_model(name, path, references):
  config, floats = float_model(name, references)
  with open_source(name) as opened:
    layout = placed.Layout.of(config.num_layers, offload_tail_layers=1, prefetch_depth=1,
                              keep_quantized=True, **LAYOUTS[path])
    model = placed.build(config, opened.source, jnp.float32, layout)
  leaves = jax.tree.leaves(nnx.state(model))
  host = {str(a.dtype) for a in leaves if a.sharding.memory_kind == "pinned_host"}
  compact = {"uint8", "int8", "float8_e4m3fn", "uint32"}  # u4x2 or Q4_1, int8, FP8, Q8_16
  assert host & compact, host  # the offloaded layer too (FP8, act-order: `qmatmul` on CPU)
  for got, want in zip(log_probs(logits_of(model, config)), log_probs(logits_of(floats, config))):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("path", sorted(LAYOUTS))
def test_a_mixture_of_experts_keeps_its_experts_compact(path, references):
  """A GPTQ Qwen3-MoE: its attention projections and its expert stacks compact (the experts'
  4-bit values in pinned host memory for the second layer, as the expert offload keeps them), the
  log-probabilities those of the float model of the format's weights, streamed and computed on
  the host alike."""
  config, floats = float_model(MOE, references)
  want = log_probs(logits_of(floats, config))
  with open_source(MOE) as opened:
    fmt = opened.source.layout(("layers", "expert_gate"))
    assert (fmt.values, fmt.group, fmt.mins) == ("uint4", 32, True)
    for stream in (None, 1):  # the host computes them; the device streams them
      layout = placed.Layout.of(config.num_layers, expert_layers=1, prefetch_depth=1,
                                keep_quantized=True, expert_stream_from_tokens=stream,
                                **LAYOUTS[path])
      model = placed.build(config, opened.source, jnp.float32, layout)
      state = {"/".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model))}
      experts = {p: a for p, a in state.items() if "expert_" in p}
      assert experts and all(p.rsplit("/", 1)[-1] in quant.PARTS for p in experts), experts
      host = [p for p, a in state.items() if a.sharding.memory_kind == "pinned_host"]
      assert host and all("expert_" in p for p in host)
      assert any(a.dtype == jnp.uint8 for p, a in experts.items() if p in host)  # 4-bit pairs
      for got, exact in zip(log_probs(logits_of(model, config)), want):
        np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4)


def test_the_engine_loads_reports_and_plans_them_compact():
  """`LLM(dir)` of a GPTQ act-order, an AWQ and a GPTQ mixture-of-experts checkpoint (a layer's
  experts offloaded): greedy tokens of the dequantized model's float run, the weights' formats
  and scheme in `memory_report()`, and the dry run's bytes those of the loaded model."""
  prompts = ["hello world", "the quick brown fox"]
  params = SamplingParams(max_tokens=6, temperature=0)
  for name, kw, held in (("gptq_act_order", dict(kernels="portable", offload_tail_layers=1),
                          {"u4x2", "int32"}),
                         ("awq_4bit", dict(block_activations="float32"), {"q4_1"}),
                         ("gptq_moe", dict(offload_expert_layers=1, block_activations="float32"),
                          {"u4x2"})):
    directory = os.path.join(ROOT, name)
    floats = jaxtier.LLM(directory, weight_format="float", **kw)
    want = [o.outputs[0].token_ids for o in floats.generate(prompts, params)]
    float_bytes = floats.memory_report()
    del floats
    llm = jaxtier.LLM(directory, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    report = llm.memory_report()
    assert held <= set(report["weight_bytes_by_format"]), report["weight_bytes_by_format"]
    assert report["checkpoint_quantization"] == name.split("_")[0]
    weights = report["device_weight_bytes"] + report["host_weight_bytes"]
    assert weights < 0.5 * (float_bytes["device_weight_bytes"] + float_bytes["host_weight_bytes"])
    plan = jaxtier.llm.dry_run(directory, **kw)
    for key in ("device_weight_bytes", "host_weight_bytes", "host_expert_bytes",
                "checkpoint_quantization"):
      assert plan[key] == report[key], key
    del llm


def test_an_offloaded_w4a16_tail_moves_its_compact_bytes_on_cuda():
  """The CUDA export of a W4A16 checkpoint's offloaded tail: the bytes moved per decode step are
  the tail's host bytes, under 0.3x its bfloat16 form, with no CPU custom call and no host
  compute; FP8 weights stay float8 in device and host memory."""
  directory = os.path.join(ROOT, "ct_w4a16")
  kw = dict(offload_tail_layers=1, max_num_seqs=4)
  engine = export.abstract_engine(directory, "cuda", **kw)
  decode = export.export_engine_programs(engine, "cuda", {})["decode"]
  assert decode["ok"], decode["error"]
  assert decode["h2d_bytes"] == engine.host_weight_bytes
  assert decode["cpu_custom_calls"] == 0 and decode["host_compute_ops"] == 0
  floats = export.abstract_engine(directory, "cuda", weight_format="float", **kw)
  assert engine.host_weight_bytes <= 0.3 * floats.host_weight_bytes
  fp8 = export.abstract_engine(os.path.join(ROOT, "ct_fp8_dynamic"), "cuda", **kw)
  leaves = fp8.runner._leaves  # pylint: disable=protected-access
  assert sum(a.dtype == jnp.float8_e4m3fn for a in leaves) == 7 * 2  # every projection
  texts = {}
  decode = export.export_engine_programs(fp8, "cuda", texts)["decode"]
  assert decode["ok"] and decode["h2d_bytes"] == fp8.host_weight_bytes
  # each FP8 weight converts inside the dot's operand or its scale's multiply, never whole
  users = hlo.narrow_convert_users(texts["decode"], ("f8E4M3FN",))
  assert users and set(users) <= {"stablehlo.multiply", "stablehlo.dot_general"}, users


def test_fp8_quantization_of_a_float_checkpoint():
  """`quantization="fp8"` on the portable path: float8 values with a scale per output channel
  (resident and offloaded), logits near the float model's; the CPU kernels refuse it (they have
  no FP8 blocks)."""
  config = q4_config()
  model = Transformer(config, rngs=nnx.Rngs(0))
  source = QuantizedSource(DictSource(params_from_model(model)), "fp8", head=False)
  compact = placed.build(config, source, jnp.float32, placed.Layout(
      ((1, "scan"), (1, "offload")), 1, keep_quantized=True, portable=True))
  kinds = {(str(a.dtype), a.sharding.memory_kind) for a in jax.tree.leaves(nnx.state(compact))}
  assert {("float8_e4m3fn", "device"), ("float8_e4m3fn", "pinned_host")} <= kinds
  for got, want in zip(logits_of(compact, config), logits_of(model, config)):
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
  tiny = fixture_path("tiny_qwen3")
  llm = jaxtier.LLM(tiny, kernels="portable", quantization="fp8")
  assert "float8_e4m3fn" in llm.memory_report()["weight_bytes_by_format"]
  del llm
  with pytest.raises(ValueError, match="kernels='portable'"):
    jaxtier.LLM(tiny, quantization="fp8", kernels="auto")


def rewrite_config(tmp_path, name: str, change) -> str:
  directory = str(tmp_path / name)
  shutil.copytree(os.path.join(ROOT, name), directory)
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    raw = json.load(f)
  change(raw["quantization_config"])
  with open(path, "w") as f:
    json.dump(raw, f)
  return directory


REFUSED = {
    "bitsandbytes": ("gptq_4bit", lambda qc: qc.update(quant_method="bitsandbytes"),
                     "quant_method 'bitsandbytes'"),
    "gptq 3-bit": ("gptq_4bit", lambda qc: qc.update(bits=3), "GPTQ with 3-bit values"),
    "awq gemv": ("awq_4bit", lambda qc: qc.update(version="gemv"), "AWQ version 'gemv'"),
    "2:4 sparsity": ("ct_w4a16", lambda qc: qc.update(sparsity_config={
        "format": "sparse-24-bitmask", "sparsity_structure": "2:4"}), "sparsity"),
    "fp8 blocks": ("ct_fp8_dynamic", lambda qc: qc["config_groups"]["group_0"]["weights"].update(
        strategy="block", block_structure=[128, 128]), "strategy 'block'"),
    "nvfp4": ("ct_w4a16", lambda qc: qc.update(format="nvfp4-pack-quantized"),
              "format 'nvfp4-pack-quantized'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_schemes_are_refused_by_name(tmp_path, case):
  name, change, what = REFUSED[case]
  directory = rewrite_config(tmp_path, name, change)
  with pytest.raises(ValueError, match="not supported; supported: compressed-tensors") as e:
    jaxtier.llm.dry_run(directory)
  assert what in str(e.value)
  assert "GPTQ" in str(e.value) and "AWQ" in str(e.value)


def write_header_only_awq(directory: str, layers=80, hidden=8192, heads=64, kv_heads=8,
                          head_dim=128, mlp=28672, vocab=128256, group=128) -> str:
  """Llama-3-70B's shape as an AWQ (GEMM, 4-bit, groups of 128) checkpoint: config.json and a
  safetensors header over zero (sparse) data."""
  os.makedirs(directory)
  shapes = {"model.embed_tokens.weight": ("F16", [vocab, hidden]),
            "lm_head.weight": ("F16", [vocab, hidden]), "model.norm.weight": ("F16", [hidden])}
  dims = {"self_attn.q_proj": (hidden, heads * head_dim),
          "self_attn.k_proj": (hidden, kv_heads * head_dim),
          "self_attn.v_proj": (hidden, kv_heads * head_dim),
          "self_attn.o_proj": (heads * head_dim, hidden), "mlp.gate_proj": (hidden, mlp),
          "mlp.up_proj": (hidden, mlp), "mlp.down_proj": (mlp, hidden)}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes[p + "input_layernorm.weight"] = ("F16", [hidden])
    shapes[p + "post_attention_layernorm.weight"] = ("F16", [hidden])
    for name, (k, n) in dims.items():
      shapes[p + name + ".qweight"] = ("I32", [k, n // 8])
      shapes[p + name + ".qzeros"] = ("I32", [k // group, n // 8])
      shapes[p + name + ".scales"] = ("F16", [k // group, n])
  write_header_only(directory, shapes)
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192, "rope_theta": 500000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float16",
            "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": group,
                                    "zero_point": True, "version": "gemm"}}
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(fixture_path("tiny_llama"), name), directory)
  return directory


def test_dry_run_of_a_70b_awq_checkpoint_on_one_gpu(tmp_path):
  """Llama-3-70B in AWQ on one 80 GB GPU: every layer resident at its compact 0.56 bytes a
  weight (the plan reads no weight); on a 24 GB one, the tail offloaded, and what crosses the
  link each step is the offloaded layers' compact bytes."""
  model = write_header_only_awq(str(tmp_path / "llama70b_awq"))
  layer_params = 8192 * (8192 + 2 * 1024 + 8192) + 3 * 8192 * 28672
  layer_bytes = layer_params // 2 + layer_params // 128 * 8 + 2 * 8192 * 2  # values, f32 scales
  plans = {}
  for gb in (80, 24):
    proc = run_script("serve.py", "--dry_run", "--platform=cuda", f"--model={model}",
                      f"--device_memory_gb={gb}", "--host_memory_gb=256", "--max_model_len=4096",
                      "--offload_tail_layers=auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plans[gb] = json.loads(proc.stdout.strip().splitlines()[-1])
  whole = plans[80]
  assert whole["offload_tail_layers"] == 0 and whole["checkpoint_quantization"] == "awq"
  assert whole["host_weight_bytes"] == 0
  tables = 2 * 128256 * 8192 * 2  # the embedding and LM head in bfloat16
  norm_and_rotary = 8192 * 2 + 64 * 4
  assert whole["device_weight_bytes"] == 80 * layer_bytes + tables + norm_and_rotary
  small = plans[24]
  n = small["offload_tail_layers"]
  assert 40 < n < 80
  assert small["weight_transfer_bytes_per_step"] == small["host_weight_bytes"] == n * layer_bytes


def test_tensor_parallel_keeps_a_gptq_checkpoint_compact_in_stacked_layers():
  """TP=2 on 8 CPU devices: scanned layers hold the compact weights sharded as the float kernels
  are (values and scales split by heads or MLP columns; a row-parallel projection's scales
  replicated), unrolled ones the dequantized floats (not fused there, so not packed); the greedy
  tokens those of TP=1 either way."""
  rows = run_worker(os.path.join(ROOT, "gptq_4bit"), 2, "plain", "scan", max_tokens=12)
  for case in ("plain", "scan"):
    assert rows[case]["tp2"]["tokens"] == rows[case]["tp1"]["tokens"], case
    assert rows[case]["tp2"]["memory_report"]["checkpoint_quantization"] == "gptq"
  assert rows["plain"]["tp2"]["q_proj_spec"] == [None, "tp"]  # a float kernel
  scan = rows["scan"]["tp2"]
  assert scan["q_proj_spec"] == [None, None, "tp"]  # the stacked 4-bit values, by heads
  collectives = scan["collectives"]  # each shard dequantizes its own rows: no gather
  assert sum(collectives.values()) == collectives["all-reduce"] == 2, collectives
  formats = scan["memory_report"]["weight_bytes_by_format"]
  assert "u4x2" in formats, formats
  per_device, total = scan["weight_bytes_per_device"]["device"], scan["weight_bytes"]["device"]
  tables = 300 * 128 * 4 + 128 * 4 + 32 // 2 * 4  # the tied table, final norm, rotary: replicated
  assert per_device - tables < 0.55 * (total - tables)  # the layers split
  plan = jaxtier.llm.dry_run(os.path.join(ROOT, "gptq_4bit"), tensor_parallel_size=2,
                             layer_execution="scan", max_model_len=256, max_num_seqs=4)
  assert plan["device_weight_bytes_per_device"] == per_device  # the plan counts what is held
  assert plan["device_weight_bytes"] == total


def test_a_quantized_config_alone_plans_floats_and_says_so(tmp_path):
  directory = tmp_path / "config_only"
  directory.mkdir()
  shutil.copy(os.path.join(ROOT, "awq_4bit", "config.json"), directory)
  plan = jaxtier.llm.dry_run(str(directory))
  assert any("quantized checkpoint" in a for a in plan["assumed"]), plan["assumed"]
  assert plan["checkpoint_quantization"] is None


def test_the_expert_cost_model_prices_the_held_experts():
  """Planned for a GPU, a layer's compact experts stream in the time of their held bytes (4-bit
  values with float32 scales and minimums per 32 rows: 0.75 of bfloat16's 2 bytes a weight)."""
  kw = dict(platform="cuda", offload_expert_layers=1, device_memory_gb=1, host_memory_gb=4)
  compact = jaxtier.llm.dry_run(os.path.join(ROOT, MOE), **kw)
  floats = jaxtier.llm.dry_run(os.path.join(ROOT, MOE), weight_format="float", **kw)
  assert compact["host_expert_bytes"] == 0.375 * floats["host_expert_bytes"]
  assert compact["expert_offload"]["stream_s"] == pytest.approx(
      0.375 * floats["expert_offload"]["stream_s"])
