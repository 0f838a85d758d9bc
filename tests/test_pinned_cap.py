"""XLA's cap on pinned host memory on a GPU in the plan (`jaxtier.engine.pinned_cap`): a plan
never takes more than the cap; where the arguments may pin more than XLA's default and JAX has not
started, the cap is raised (the environment variable set before JAX starts); where it had started,
or the user set the variable, the plan keeps within it or says why it cannot. Hosts: an H200's
128 GB, 8 x H100 on 2 TB at TP=8, and a variable the user set."""

import json
import os
import subprocess
import sys

import pytest

from jaxtier.engine import pinned_cap, sizing
from jaxtier.engine.args import EngineArgs
from test_sizing import H100, H100_X8, H200, LLAMA_8B, LLAMA_70B, SMOLLM, never

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
ENV = pinned_cap.ENV


@pytest.fixture(autouse=True)
def _no_variable(monkeypatch):
  monkeypatch.delenv(ENV, raising=False)


def _size(args: EngineArgs, config, machine, started: bool) -> sizing.Sizing:
  cap = pinned_cap.cap_for(args, "gpu", machine.host_memory_bytes, started)
  return sizing.size(args, config, machine, timing=never, cap=cap)


def test_an_h200_with_a_128gb_host_plans_within_xlas_default_or_raises_it():
  s = _size(EngineArgs(model="m", dtype="bfloat16"), SMOLLM, H200, started=True)
  assert s.pinned_cap.bytes == 64 * GIB and "XLA's default of 64 GiB" in s.pinned_cap.setting
  assert 0 < s.pinned_bytes <= s.pinned_cap.bytes
  # An explicit 100 GB host pool may pin up to the host's 128 GB: raised to 120 GiB before JAX
  # starts; where JAX had started first, refused, naming the variable.
  asked = EngineArgs(model="m", dtype="bfloat16", swap_space_gb=100)
  s = _size(asked, LLAMA_8B, H200, started=False)
  assert s.pinned_cap.bytes == 120 * GIB and f"{ENV}=120 (set by jaxtier" in s.pinned_cap.setting
  assert 99e9 < s.pinned_bytes <= s.pinned_cap.bytes
  with pytest.raises(ValueError, match=rf"XLA pins at most 68\.719 GB \({ENV} unset: XLA's "
                     r"default of 64 GiB; JAX had started"):
    _size(asked, LLAMA_8B, H200, started=True)


def test_eight_h100_on_a_2tb_host_raise_the_cap_or_keep_within_it():
  args = EngineArgs(model="m", dtype="bfloat16", tensor_parallel_size=8)
  raised = _size(args, LLAMA_70B, H100_X8, started=False)
  assert raised.pinned_cap.bytes == 954 * GIB  # half of 2048 GB, in whole GiB
  assert raised.num_host_blocks == raised.num_device_blocks  # every request can be swapped out
  assert 64 * GIB < raised.pinned_bytes <= raised.pinned_cap.bytes
  kept = _size(args, LLAMA_70B, H100_X8, started=True)
  assert kept.pinned_cap.bytes == 64 * GIB
  assert kept.pinned_bytes <= 64 * GIB < kept.pinned_bytes + kept.block_bytes
  assert kept.num_device_blocks == raised.num_device_blocks


def test_a_variable_the_user_set_is_the_cap(monkeypatch):
  monkeypatch.setenv(ENV, "16")
  s = _size(EngineArgs(model="m", dtype="bfloat16"), LLAMA_8B, H100, started=False)
  assert s.pinned_cap == pinned_cap.PinnedCap(16 * GIB, f"{ENV}=16 (set in the environment)")
  assert s.pinned_bytes <= 16 * GIB < s.pinned_bytes + s.block_bytes
  with pytest.raises(ValueError, match=rf"\({ENV}=16 \(set in the environment\)\): lower "):
    _size(EngineArgs(model="m", dtype="bfloat16", swap_space_gb=100), LLAMA_8B, H100, False)
  with pytest.raises(ValueError, match="offloaded weights need .* XLA pins at most"):
    _size(EngineArgs(model="m", dtype="bfloat16", offload_tail_layers=70, prefetch_depth=1),
          LLAMA_70B, H100, False)
  monkeypatch.setenv(ENV, "lots")
  with pytest.raises(ValueError, match=f"{ENV}='lots': expected a whole number of GiB"):
    _size(EngineArgs(model="m"), LLAMA_8B, H100, False)


def test_no_cap_off_a_gpu():
  for platform in ("cpu", "tpu"):
    assert pinned_cap.cap_for(EngineArgs(), platform, 2048 * 10**9, started=False) is None


RAISE = """
import json, os, sys
from jaxtier.engine import pinned_cap
from jaxtier.engine.args import EngineArgs
if sys.argv[1] == "started":
  import jax
  jax.devices()
value = pinned_cap.raise_before_start(EngineArgs(host_memory_gb=512), 512 * 10**9)
print(json.dumps([value, os.environ.get(pinned_cap.ENV)]))
"""


@pytest.mark.parametrize("case, env, expected", [
    ("fresh", None, [239, "239"]), ("started", None, [None, None]), ("fresh", "8", [None, "8"])])
def test_the_entry_point_raises_the_variable_only_before_jax_starts(case, env, expected):
  environ = {k: v for k, v in os.environ.items() if k != ENV} | {"PYTHONPATH": ROOT}
  if env is not None:
    environ[ENV] = env
  proc = subprocess.run([sys.executable, "-c", RAISE, case], capture_output=True, text=True,
                        env=environ, timeout=120, check=True)
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected


def test_a_dry_run_for_eight_gpus_on_a_512gb_host_shows_the_cap_and_keeps_within_it(tmp_path):
  with open(os.path.join(ROOT, "tests", "fixtures", "tiny_llama", "config.json")) as f:
    config = json.load(f)
  config.update(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=14336, num_hidden_layers=32, vocab_size=128256,
                max_position_embeddings=8192, dtype="bfloat16")
  (tmp_path / "llama8b").mkdir()
  (tmp_path / "llama8b" / "config.json").write_text(json.dumps(config))
  environ = {k: v for k, v in os.environ.items() if k != ENV} | {"PYTHONPATH": ROOT}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--dry_run", "--platform=cuda",
       f"--model={tmp_path / 'llama8b'}", "--host_memory_gb=512", "--tensor_parallel_size=8",
       "--device_memory_gb=80", "--max_model_len=8192"],
      capture_output=True, text=True, env=environ, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  plan = json.loads(proc.stdout.strip().splitlines()[-1])
  assert plan["pinned_cap_setting"].startswith(f"{ENV}=239 (set by jaxtier before JAX starts")
  assert plan["pinned_cap_bytes"] == 239 * GIB
  assert 64 * GIB < plan["pinned_bytes"] <= plan["pinned_cap_bytes"]
  assert plan["pinned_bytes"] == plan["host_kv_bytes"] + plan["host_weight_bytes"]
