"""Tests of the scheduler simulator, scripts/simulate.py and scripts/bench_scheduler.py."""

import json
import pathlib
import subprocess
import sys

import pytest

from jaxtier.scheduler import ComputeBatch, Plan, Request, SchedulerConfig
from jaxtier.scheduler.state import EMPTY_BATCH
from jaxtier.tools import simulator

_ROOT = pathlib.Path(__file__).parent.parent
_COST = simulator.CostModel(step_base_s=0.01, per_token_s=1e-4, link_bytes_per_s=1e6,
                            block_bytes=1000)


def _config(**fields) -> SchedulerConfig:
  """A scheduler config; the engine-argument fields not given are filled in here."""
  return SchedulerConfig(**{**dict(block_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
                                   watermark=0.0, preemption_mode="swap",
                                   victim_policy="longest_waiting", enable_prefix_caching=False,
                                   host_prefix_caching=True), **fields})


def _run(mode, num_host_blocks=256):
  config = _config(num_device_blocks=64, num_host_blocks=num_host_blocks, block_size=16,
                   max_num_seqs=16, max_num_batched_tokens=256, watermark=4 / 64,
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


def test_writebacks_block_like_swap_outs():
  batch = ComputeBatch((0,), (10,), (11,), ((0,),), (True,))
  plan = Plan(0, EMPTY_BATCH, batch, swap_out=(), swap_in=(), prefetch=(), free_device=(),
              free_host=(), preempted=(), ended=(), kv_swap_bytes=2000, weight_prefetch_bytes=0,
              writeback=((1, 0), (2, 1)))
  seconds, link = _COST.step_seconds(plan)
  assert seconds == pytest.approx(0.002 + 0.01 + 1e-4) and link == pytest.approx(0.002)


def _conversations(workload):
  turns = {}
  for item in workload:
    conversation, turn = item.request.request_id[1:].split("t")
    turns.setdefault(int(conversation), []).append((int(turn), item))
  return turns


def test_chat_workload_prompts_grow_by_the_previous_turns():
  workload = simulator.chat_workload(6, 2, 4, system_len=20, user_len=7, output_len=5,
                                     num_system_prompts=2, seed=3)
  assert workload == simulator.chat_workload(6, 2, 4, 20, 7, 5, num_system_prompts=2, seed=3)
  assert len({item.request.request_id for item in workload}) == len(workload)
  systems = set()
  for conversation, turns in _conversations(workload).items():
    assert [t for t, _ in turns] == list(range(len(turns))) and 2 <= len(turns) <= 4
    systems.add(turns[0][1].request.prompt_token_ids[:20])
    previous = None
    for t, item in turns:
      request = item.request
      assert request.prompt_len == len(request.prompt_token_ids) == 20 + t * (7 + 5) + 7
      assert request.max_tokens == item.output_len == 5 and request.arrival_time == 0.0
      if previous is None:
        assert item.after is None
      else:
        assert item.after == previous.request_id
        assert request.prompt_token_ids[:previous.prompt_len] == previous.prompt_token_ids
      previous = request
  assert len(systems) <= 2 and all(len(s) == 20 for s in systems)


def test_chat_workload_first_turns_arrive_by_poisson_and_rejects_bad_arguments():
  workload = simulator.chat_workload(5, 1, 1, 8, 4, 4, arrival_rate=10.0, seed=0)
  arrivals = [item.request.arrival_time for item in workload]
  assert all(0 < a < b for a, b in zip(arrivals, arrivals[1:]))
  with pytest.raises(ValueError, match="max_turns=2: expected an int >= 3"):
    simulator.chat_workload(2, 3, 2, 8, 4, 4)
  with pytest.raises(ValueError, match="think_time_s=-1"):
    simulator.chat_workload(2, 1, 2, 8, 4, 4, think_time_s=-1)


def test_dependent_items_must_follow_an_earlier_item():
  first = simulator.WorkItem(Request("a", 4, 2), 2)
  second = simulator.WorkItem(Request("b", 4, 2), 2, after="a")
  config = _config(num_device_blocks=16, num_host_blocks=0, max_num_seqs=4,
                   max_num_batched_tokens=64)
  with pytest.raises(ValueError, match="after='a' names no earlier item"):
    simulator.simulate(config, _COST, (second, first))
  with pytest.raises(ValueError, match="after='x' names no earlier item"):
    simulator.simulate(config, _COST, (first, simulator.WorkItem(Request("b", 4, 2), 2, after="x")))
  with pytest.raises(ValueError, match="think_time_s=1.0 with after=None"):
    simulator.WorkItem(Request("a", 4, 2), 2, think_time_s=1.0)
  assert simulator.simulate(config, _COST, (first, second))["finished"] == 2


def test_each_turn_arrives_after_the_previous_one_ended_plus_think_time():
  workload = simulator.chat_workload(6, 2, 4, 32, 16, 16, arrival_rate=4.0, think_time_s=0.25,
                                     seed=2)
  config = _config(num_device_blocks=128, num_host_blocks=64, block_size=16, max_num_seqs=8,
                   max_num_batched_tokens=256, block_bytes=1000, enable_prefix_caching=True)
  result = simulator.replay(config, _COST, workload)
  times = result.times
  for item in workload:
    own = times[item.request.request_id]
    assert own.arrival <= own.started < own.first_token <= own.last_token == own.ended
    if item.after is None:
      assert own.arrival == item.request.arrival_time
    else:
      before = times[item.after]
      assert own.arrival == pytest.approx(before.last_token + 0.25)
      assert own.started >= before.ended + 0.25
  ttft = [t.first_token - t.arrival for t in times.values()]
  assert result.report["ttft_s"]["mean"] == pytest.approx(sum(ttft) / len(ttft))
  assert result.report["finished"] == len(workload)


def test_idle_clock_jumps_to_the_next_dependent_arrival():
  workload = simulator.chat_workload(1, 3, 3, 16, 16, 4, think_time_s=50.0, seed=0)
  config = _config(num_device_blocks=64, num_host_blocks=0, max_num_seqs=4,
                   max_num_batched_tokens=64)
  report = simulator.simulate(config, _COST, workload)
  assert report["finished"] == 3 and 100 < report["makespan_s"] < 101


def _chat_config(**kwargs):
  return _config(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, block_bytes=1000,
                 **kwargs)


def test_prefix_caching_computes_each_turn_only_past_the_previous_prompt():
  # No system prompt and block-aligned turns: turn k reuses exactly turn k - 1's whole prompt.
  workload = simulator.chat_workload(6, 2, 4, system_len=0, user_len=16, output_len=16, seed=1)
  decodes = sum(item.output_len - 1 for item in workload)
  without = sum(item.request.prompt_len for item in workload) + decodes
  last_prompts = sum(turns[-1][1].request.prompt_len for turns in _conversations(workload).values())
  reports = [simulator.simulate(_chat_config(num_device_blocks=256, num_host_blocks=0,
                                             enable_prefix_caching=on), _COST, workload)
             for on in (False, True)]
  off, on = reports
  assert off["finished"] == on["finished"] == len(workload)
  assert off["computed_tokens"] == without and off["prefix_query_tokens"] == 0
  assert on["computed_tokens"] == last_prompts + decodes
  assert on["prefix_device_hit_tokens"] == without - on["computed_tokens"]
  assert on["prefix_query_tokens"] == sum(item.request.prompt_len for item in workload)
  assert on["prefix_device_hit_rate"] == pytest.approx(
      on["prefix_device_hit_tokens"] / on["prefix_query_tokens"])
  assert on["recomputed_tokens"] == off["recomputed_tokens"] == 0
  assert on["makespan_s"] < off["makespan_s"] and on["enable_prefix_caching"]


def test_small_device_pool_spills_the_prefix_cache_to_the_host():
  workload = simulator.chat_workload(8, 3, 3, 32, 16, 16, think_time_s=0.2, seed=0)
  with_host, device_only = [
      simulator.simulate(_chat_config(num_device_blocks=32, num_host_blocks=128,
                                      enable_prefix_caching=True, host_prefix_caching=host),
                         _COST, workload) for host in (True, False)]
  assert with_host["finished"] == device_only["finished"] == 24
  assert with_host["prefix_host_hit_tokens"] > 0 and with_host["prefix_load_blocks"] > 0
  assert with_host["prefix_writeback_blocks"] > 0
  assert with_host["prefix_load_bytes"] == with_host["prefix_load_blocks"] * 1000
  copies = (with_host["swap_blocks"] + with_host["prefix_writeback_blocks"]
            + with_host["prefix_load_blocks"])
  assert with_host["swap_seconds"] == pytest.approx(copies * 1000 / 1e6)
  assert with_host["computed_tokens"] < device_only["computed_tokens"]
  for key in ("prefix_host_hit_tokens", "prefix_load_blocks", "prefix_writeback_blocks"):
    assert device_only[key] == 0
  assert device_only["prefix_host_hit_rate"] == 0.0 and not device_only["host_prefix_caching"]


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


def test_simulate_script_runs_a_chat_workload_with_prefix_caching():
  report = _script("simulate.py", "--workload=chat", "--enable_prefix_caching",
                   "--num_conversations=4", "--min_turns=2", "--max_turns=3", "--system_len=32",
                   "--user_len=16", "--output_len=8", "--num_device_blocks=64",
                   "--num_host_blocks=64")
  assert report["finished"] == report["requests"] >= 8
  assert report["enable_prefix_caching"] and report["prefix_device_hit_tokens"] > 0
  assert report["config"]["workload"] == "chat"


def test_bench_script_prints_json():
  report = _script("bench_scheduler.py", "--running=4,8", "--steps=20", "--finish_every=5")
  assert set(report["results"]) == {"running_4", "running_8"}
  assert report["results"]["running_8"]["median_us"] > 0
