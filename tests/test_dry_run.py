"""`--dry_run` / `jaxtier.llm.dry_run`: the plan printed before anything loads is what the engine
then holds (`LLM.memory_report()` counts the loaded state), for the ways a pool and an offload
are sized; and the scripts print it as their last stdout line without loading weights."""

import json
import os
import subprocess
import sys

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
