"""Tests of the scheduler simulator, scripts/simulate.py and scripts/bench_scheduler.py."""

import json
import pathlib
import subprocess
import sys

import pytest

from jaxtier.scheduler import ComputeBatch, Plan, SchedulerConfig, simulator
from jaxtier.scheduler.state import EMPTY_BATCH

_ROOT = pathlib.Path(__file__).parent.parent
_COST = simulator.CostModel(step_base_s=0.01, per_token_s=1e-4, link_bytes_per_s=1e6,
                            block_bytes=1000)


def _run(mode, num_host_blocks=256):
  config = SchedulerConfig(num_device_blocks=64, num_host_blocks=num_host_blocks, block_size=16,
                           max_running=16, max_tokens_per_step=256, watermark_blocks=4,
                           preemption_mode=mode, block_bytes=1000)
  workload = simulator.synthetic_workload(20, 0.0, 100, 60, "uniform", 0, seed=1)
  return simulator.simulate(config, _COST, workload)


def test_swap_mode_finishes_everything_and_accounts_swaps():
  report = _run("swap")
  assert report["finished"] == 20 and report["aborted"] == {}
  assert report["swap_outs"] > 0 and report["swap_outs"] == report["swap_ins"]
  assert report["swap_bytes"] == report["swap_blocks"] * 1000
  assert report["swap_seconds"] == pytest.approx(report["swap_bytes"] / 1e6)
  assert report["recomputed_tokens"] == 0
  assert report["peak_device_blocks"] <= 64 and 0 < report["peak_host_blocks"] <= 256
  assert report["ttft_s"]["p50"] <= report["ttft_s"]["p99"]


def test_recompute_mode_recomputes_instead_of_swapping():
  report = _run("recompute")
  assert report["finished"] == 20 and report["swap_count"] == 0 and report["swap_bytes"] == 0
  assert report["preemptions"]["recompute"] > 0 and report["recomputed_tokens"] > 0


def test_full_host_pool_falls_back_to_recompute():
  report = _run("swap", num_host_blocks=4)
  assert report["finished"] == 20 and report["preemptions"].get("recompute", 0) > 0


def test_prefetch_overlaps_compute_but_blocking_copies_do_not():
  batch = ComputeBatch((0,), (10,), (11,), ((0,),), (True,))
  plan = Plan(0, EMPTY_BATCH, batch, swap_out=((1, 0),), swap_in=(), prefetch=((0, 2), (1, 3)),
              free_device=(), free_host=(), preempted=(), ended=(), kv_swap_bytes=3000,
              weight_prefetch_bytes=0)
  seconds, link = _COST.step_seconds(plan)
  compute = 0.01 + 1e-4
  assert seconds == pytest.approx(0.001 + max(compute, 0.002)) and link == pytest.approx(0.003)


def test_read_trace():
  lines = ['{"arrival_time": 0.5, "prompt_len": 10, "output_len": 4}', "",
           '{"arrival_time": 1, "prompt_len": 3, "output_len": 9, "max_tokens": 5, "priority": 1}']
  first, second = simulator.read_trace(lines)
  assert (first.request.prompt_len, first.request.max_tokens, first.output_len) == (10, 4, 4)
  assert (second.request.max_tokens, second.output_len, second.request.priority) == (5, 5, 1)
  with pytest.raises(ValueError, match="line 1: missing"):
    simulator.read_trace(['{"prompt_len": 3}'])


def _script(name, *args):
  result = subprocess.run([sys.executable, str(_ROOT / "scripts" / name), *args], cwd=_ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
  return json.loads(result.stdout)


def test_simulate_script_prints_json(tmp_path):
  trace = tmp_path / "trace.jsonl"
  trace.write_text("".join(f'{{"arrival_time": {i}, "prompt_len": 40, "output_len": 8}}\n'
                           for i in range(5)))
  report = _script("simulate.py", f"--trace={trace}", "--num_device_blocks=32",
                   "--num_host_blocks=32", "--preemption_mode=recompute")
  assert report["finished"] == 5 and report["config"]["preemption_mode"] == "recompute"


def test_bench_script_prints_json():
  report = _script("bench_scheduler.py", "--running=4,8", "--steps=20", "--finish_every=5")
  assert set(report["results"]) == {"running_4", "running_8"}
  assert report["results"]["running_8"]["median_us"] > 0
