"""`--dry_run` / `jaxtier.llm.dry_run`: the plan printed before anything loads is what the engine
then holds (`LLM.memory_report()` counts the loaded state), for the ways a pool and an offload
are sized; and the scripts print it as their last stdout line without loading weights."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import jaxtier
from jaxtier.llm import dry_run
from conftest import fixture_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = fixture_path("tiny_llama")


@pytest.mark.parametrize("kwargs", [
    dict(max_num_seqs=2),
    dict(max_num_seqs=2, offload_tail_layers=2),
    dict(max_num_seqs=2, device_memory_gb=0.0006, max_model_len=64),
    dict(max_num_seqs=2, offload_tail_layers="auto", device_memory_gb=0.0005, max_model_len=64),
    dict(max_num_seqs=2, layer_execution="scan", dtype="bfloat16", kv_cache_dtype="int8"),
    dict(max_num_seqs=2, num_device_blocks=40, swap_space_gb=0.001),
], ids=["cpu-defaults", "offload", "device-memory", "auto-offload", "scan-bf16-int8", "explicit"])
def test_dry_run_equals_the_loaded_engines_memory_report(kwargs):
  plan = dry_run(TINY, **kwargs)
  report = jaxtier.LLM(TINY, **kwargs).memory_report()
  shared = set(plan) & set(report)
  assert set(report) - shared == {"weight_bytes_by_format"}
  assert {k: plan[k] for k in shared} == {k: report[k] for k in shared}
  assert plan["dtype"] == ("bfloat16" if kwargs.get("dtype") == "bfloat16" else "float32")


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args],
                        capture_output=True, text=True, env=env, timeout=300, check=False)


def test_serve_dry_run_plans_a_141gb_gpu_host_within_its_memories():
  proc = run_script("serve.py", "--dry_run", "--kernels=portable", f"--model={TINY}",
                    "--device_memory_gb=141", "--host_memory_gb=128", "--max_model_len=256")
  assert proc.returncode == 0, proc.stderr[-2000:]
  plan = json.loads(proc.stdout.strip().splitlines()[-1])
  pinned = plan["host_kv_bytes"] + plan["host_weight_bytes"]
  assert 0 < pinned <= 0.5 * 128e9
  device = plan["device_kv_bytes"] + plan["device_weight_bytes"]
  assert 0.85 * 141e9 < device <= 0.9 * 141e9  # gpu_memory_utilization, less the activations
  assert plan["tensor_parallel_size"] == 1 and plan["offload_tail_layers"] == 0
  assert (plan["kernels"], plan["layer_execution"], plan["attention_impl"]) == (
      "portable", "scan", "xla")


def test_batch_infer_dry_run_reads_no_input_and_a_host_too_small_is_a_usage_error(tmp_path):
  files = (f"--input={tmp_path / 'missing.jsonl'}", f"--output={tmp_path / 'out.jsonl'}")
  proc = run_script("batch_infer.py", "--dry_run", f"--model={TINY}", "--num_device_blocks=64",
                    "--offload_tail_layers=1", *files)
  assert proc.returncode == 0, proc.stderr[-2000:]
  plan = json.loads(proc.stdout.strip().splitlines()[-1])
  assert plan["device_kv_blocks"] == 64 and plan["offload_tail_layers"] == 1
  assert not (tmp_path / "out.jsonl").exists()
  proc = run_script("batch_infer.py", "--dry_run", f"--model={TINY}", "--swap_space_gb=200",
                    "--host_memory_gb=128", *files)
  assert proc.returncode == 2
  assert "need 200.000 GB of pinned host memory; the host has 128.000 GB" in proc.stderr


def test_dry_run_for_a_gpu_plans_its_defaults_from_a_cpu(monkeypatch):
  """`--platform=cuda` plans what a GPU would run from this CPU: bfloat16 weights and KV, the
  portable kernels and scanned layers; the offload planner runs on the GPU preset's link and
  compute, never measuring this machine's."""
  proc = run_script("serve.py", "--dry_run", "--platform=cuda", f"--model={TINY}",
                    "--device_memory_gb=80", "--host_memory_gb=128", "--max_model_len=256")
  assert proc.returncode == 0, proc.stderr[-2000:]
  plan = json.loads(proc.stdout.strip().splitlines()[-1])
  assert (plan["dtype"], plan["kv_cache_dtype"], plan["kernels"], plan["layer_execution"]) == (
      "bfloat16", "bfloat16", "portable", "scan")
  on_cpu = dry_run(TINY, max_model_len=256, device_memory_gb=80, host_memory_gb=128)
  assert on_cpu["dtype"] == "float32"
  # bfloat16 weights are half of float32's (the rotary frequencies stay float32)
  assert 0.49 < plan["device_weight_bytes"] / on_cpu["device_weight_bytes"] < 0.51
  assert plan["kv_block_bytes"] * 2 == on_cpu["kv_block_bytes"]

  def measured(*_):
    raise AssertionError("measured this machine")
  from jaxtier.offload import measure  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(measure, "link_bytes_per_s", measured)
  kwargs = dict(offload_tail_layers=1, prefetch_depth="auto", max_model_len=64, max_num_seqs=2)
  assert dry_run(TINY, platform="gpu", **kwargs)["prefetch_depth"] >= 1
  from jaxtier.offload import hardware  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(hardware, "PLATFORM_PRESETS", {})  # no preset: the planner measures
  with pytest.raises(AssertionError, match="measured this machine"):
    dry_run(TINY, platform="gpu", **kwargs)


def _header_only_checkpoint(directory, layers: int, hidden: int, heads: int, kv_heads: int,
                            head_dim: int, mlp: int, vocab: int) -> str:
  """A Llama checkpoint whose safetensors file has a real header and zero (sparse) data: all a
  dry run reads is the config and the tensors' shapes."""
  with open(os.path.join(TINY, "config.json")) as f:
    config = json.load(f)
  config.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, intermediate_size=mlp, num_hidden_layers=layers,
                vocab_size=vocab, max_position_embeddings=8192, dtype="bfloat16",
                rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
  os.makedirs(directory)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(TINY, name)) as src, open(os.path.join(directory, name), "w") as dst:
      dst.write(src.read())
  shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden],
            "lm_head.weight": [vocab, hidden]}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes |= {p + "self_attn.q_proj.weight": [heads * head_dim, hidden],
               p + "self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
               p + "self_attn.v_proj.weight": [kv_heads * head_dim, hidden],
               p + "self_attn.o_proj.weight": [hidden, heads * head_dim],
               p + "mlp.gate_proj.weight": [mlp, hidden], p + "mlp.up_proj.weight": [mlp, hidden],
               p + "mlp.down_proj.weight": [hidden, mlp],
               p + "input_layernorm.weight": [hidden],
               p + "post_attention_layernorm.weight": [hidden]}
  return write_header_only(directory, shapes)


def write_header_only(directory: str, shapes: dict) -> str:
  """`directory`/model.safetensors with tensors of `shapes` (a shape: bfloat16; or a (dtype,
  shape) pair, dtype "BF16", "F16" or "I32"): a real header over zero (sparse) data."""
  header, offset = {}, 0
  for name, shape in shapes.items():
    dtype, shape = shape if isinstance(shape[0], str) else ("BF16", shape)
    size = {"BF16": 2, "F16": 2, "I32": 4}[dtype] * int(np.prod(shape))
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  with open(os.path.join(directory, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text)
    f.truncate(8 + len(text) + offset)
  return directory


def test_dry_run_plans_tensor_parallel_8_on_one_cpu(tmp_path):
  """Llama-3-8B's shape over 8 GPUs of 80 GB, planned here: each device's share of weights and
  KV within 95% of its memory, pinned memory within half the host's."""
  model = _header_only_checkpoint(str(tmp_path / "llama8b"), 32, 4096, 32, 8, 128, 14336, 128256)
  proc = run_script("serve.py", "--dry_run", "--platform=cuda", f"--model={model}",
                    "--tensor_parallel_size=8", "--device_memory_gb=80",
                    "--host_memory_gb=512", "--max_model_len=8192")
  assert proc.returncode == 0, proc.stderr[-2000:]
  plan = json.loads(proc.stdout.strip().splitlines()[-1])
  assert plan["tensor_parallel_size"] == 8
  weights = 2 * (32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)
                 + 2 * 128256 * 4096 + 4096)
  assert plan["device_weight_bytes"] == weights + 128 // 2 * 4  # and the rotary frequencies
  per_device = plan["device_weight_bytes_per_device"] + plan["device_kv_bytes_per_device"]
  assert 0.85 * 80e9 < per_device <= 0.95 * 80e9
  assert plan["kv_block_bytes"] == 2 * 32 * 8 * 16 * 128 * 2  # K and V, all layers, bfloat16
  assert 0 < plan["host_kv_bytes"] + plan["host_weight_bytes"] <= 0.5 * 512e9
