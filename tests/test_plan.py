"""One plan (`jaxtier.engine.build.plan`) for `jaxtier.LLM`, the dry run, the program export and
`scripts/plan_offload.py`: the four make equal plans for a dense, a kept-block GGUF, an offloaded
and a mixture-of-experts model; a directory holding only a config.json plans; a plan for another
platform says what it assumed."""

import json
import os
import subprocess
import sys

import pytest

import jaxtier
from jaxtier.engine import build
from jaxtier.engine.args import EngineArgs
from jaxtier.llm import dry_run
from jaxtier.tools import export
from conftest import fixture_path
from test_checkpoint import write_tiny_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = fixture_path("tiny_llama")
SHORT = dict(max_num_seqs=2, max_model_len=64)
CASES = {
    "dense": (TINY, SHORT),
    # kept blocks: the file's Q8_0 down projections held compact on the portable path
    "gguf_blocks": (None, SHORT | dict(kernels="portable")),
    "offloaded": (TINY, SHORT | dict(offload_tail_layers=1)),
    "experts": (fixture_path("tiny_mixtral"), SHORT | dict(offload_expert_layers=1)),
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
  write_tiny_gguf(path)
  return path


def _plain(value):
  """`value` as JSON has it (tuples as lists, keys as strings)."""
  return json.loads(json.dumps(value))


def _plan_offload(model: str, kwargs: dict) -> subprocess.Popen:
  flags = [f"--{name}={value}" for name, value in kwargs.items()]
  if "offload_tail_layers" not in kwargs:
    flags.append("--offload_tail_layers=0")  # the script's default is "auto"
  return subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "scripts", "plan_offload.py"), f"--model={model}",
       *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=ROOT))


def test_llm_dry_run_export_and_plan_offload_make_one_plan(tiny_gguf):
  cases = {name: (model or tiny_gguf, kwargs) for name, (model, kwargs) in CASES.items()}
  scripts = {name: _plan_offload(model, kwargs) for name, (model, kwargs) in cases.items()}
  for name, (model, kwargs) in cases.items():
    planned = _plain(build.plan(model, EngineArgs(model=model, **kwargs)).summary())
    llm = jaxtier.LLM(model, **kwargs)
    assert _plain(llm.plan.summary()) == planned, name
    assert _plain(dry_run(model, **kwargs)) == planned["memory"], name
    assert _plain(export.abstract_engine(model, "cpu", **kwargs).plan.summary()) == planned, name
    out, err = scripts[name].communicate(timeout=300)
    assert scripts[name].returncode == 0, err[-2000:]
    reported = json.loads(out)["measured"]
    assert reported.pop("scheduler") is None
    assert reported == planned, name
    if name == "gguf_blocks":  # the loader's compact bytes, not the float parameters'
      assert planned["memory"]["device_weight_bytes"] == llm.memory_report()["device_weight_bytes"]
    if name == "experts":
      assert planned["memory"]["host_expert_bytes"] > 0 and planned["layout"]["groups"][-1] == [
          1, "experts"]


def _mixtral_8x7b_config_dir(directory) -> str:
  with open(fixture_path("tiny_mixtral", "config.json")) as f:
    config = json.load(f)
  config.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8,
                num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
                dtype="bfloat16")
  os.makedirs(directory)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  return directory


def test_a_config_json_alone_plans_mixtral_8x7b_for_gpus(tmp_path):
  model = _mixtral_8x7b_config_dir(str(tmp_path / "mixtral"))
  plan = dry_run(model, platform="cuda", device_memory_gb=80, host_memory_gb=512,
                 max_model_len=4096, offload_expert_layers=16)
  experts = 3 * 8 * 4096 * 14336 * 2  # one layer's routed experts, bfloat16
  assert plan["host_expert_bytes"] == 16 * experts == plan["host_weight_bytes"]
  attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
  dense = 32 * (attention + 4096 * 8 + 2 * 4096) + 2 * 32000 * 4096 + 4096
  assert plan["device_weight_bytes"] == 2 * dense + 16 * experts + 128 // 2 * 4
  assert plan["dtype"] == "bfloat16" and plan["offload_expert_layers"] == 16
  assert plan["assumed"] == []
  with pytest.raises(FileNotFoundError, match="holds a config.json but no weights"):
    jaxtier.LLM(model, max_model_len=64)


def test_a_plan_for_another_platform_says_what_it_assumed():
  plan = dry_run(TINY, platform="cuda", max_model_len=256)
  device, host = plan["assumed"]
  assert device.startswith("device_memory_gb=85.5, the h100-80gb-pcie4 preset's")
  assert host.startswith("host memory unknown")
  # the preset's memory, less the weights and activations: a pool of gigabytes, not CPU's default
  assert plan["device_kv_bytes"] > 50e9
  given = dry_run(TINY, platform="cuda", max_model_len=256, device_memory_gb=1, host_memory_gb=8)
  assert given["assumed"] == [] and given["device_kv_bytes"] < 1e9
