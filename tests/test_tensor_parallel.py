"""Tensor parallelism on the tiny fixtures: a subprocess with 8 CPU devices runs each case at TP=1
and TP=2 (tests/multidevice_worker.py); outputs must be identical and the placements, collectives
and per-device transfers what tensor parallelism needs. The default model's TP=3 run is in
test_smollm.py."""

import json
import os
import subprocess
import sys

import pytest

from jaxtier import offload
import jaxtier
from jaxtier.checkpoint import hf
from jaxtier.model import sharding
from conftest import fixture_path

WORKER = os.path.join(os.path.dirname(__file__), "multidevice_worker.py")


def run_worker(model: str, tp: int, *cases: str, max_tokens: int = 24,
               layer_execution: str = "") -> dict:
  env = dict(os.environ, MULTIDEVICE_MAX_TOKENS=str(max_tokens),
             MULTIDEVICE_LAYER_EXECUTION=layer_execution)
  proc = subprocess.run([sys.executable, WORKER, model, str(tp), *cases], capture_output=True,
                        text=True, env=env, timeout=1800, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_tp2():
  return run_worker(fixture_path("tiny_llama"), 2)


def test_tp2_outputs_equal_tp1_in_every_case(tiny_tp2):
  assert set(tiny_tp2) == {"plain", "scan", "offload", "pressure"}
  for case, rows in tiny_tp2.items():
    assert rows["tp2"]["tokens"] == rows["tp1"]["tokens"], case
    assert all(len(t) == 24 for t in rows["tp1"]["tokens"]), case


def test_tp2_shards_weights_and_the_kv_pool_over_kv_heads(tiny_tp2):
  row = tiny_tp2["plain"]["tp2"]
  assert row["q_proj_spec"] == [None, "tp"]  # unrolled layer kernels [in, heads]: by heads
  assert row["embedding_spec"] == [None, None]  # vocab tables replicated
  assert row["device_pool_spec"][0] == "tp" and row["device_pool_devices"] == 2  # [k, l, p, c, d]
  assert row["host_block_spec"] is None  # nothing swapped: the host tier holds nothing
  assert tiny_tp2["scan"]["tp2"]["q_proj_spec"] == [None, None, "tp"]  # stacked [l, in, heads]
  # Each device holds its half of the projections plus the replicated tables and norms.
  c = hf.read_config(fixture_path("tiny_llama"))
  norms = 2 * c.hidden_size * c.num_layers + c.hidden_size
  tables = 2 * c.vocab_size * c.hidden_size
  rotary = c.head_dim // 2
  total = row["weight_bytes"]["device"] // 4
  assert row["weight_bytes_per_device"]["device"] // 4 == (
      (total - norms - tables - rotary) // 2 + norms + tables + rotary)
  report = row["memory_report"]
  assert report["tensor_parallel_size"] == 2
  assert report["device_weight_bytes_per_device"] == row["weight_bytes_per_device"]["device"]
  assert report["device_kv_bytes_per_device"] * 2 == report["device_kv_bytes"]


def test_planner_counts_what_one_device_really_holds(tiny_tp2):
  c = hf.read_config(fixture_path("tiny_llama"))
  per_device = tiny_tp2["plain"]["tp2"]["weight_bytes_per_device"]["device"]
  planned = offload.ModelBytes.from_config(c, "float32", tensor_parallel_size=2)
  assert planned.weight_bytes == per_device  # the rotary frequencies (float32) included
  whole = offload.ModelBytes.from_config(c, "float32")
  assert planned.kv_bytes_per_token * 2 == whole.kv_bytes_per_token


def test_dry_run_plans_tp2_in_one_device_as_eight_devices_run_it(tiny_tp2):
  """`jaxtier.llm.dry_run` in this process (one CPU device) plans what the 8-device worker's
  TP=2 engines hold: every key of `memory_report()` it gives is the measured one."""
  from jaxtier.llm import dry_run  # pylint: disable=import-outside-toplevel
  for case, kwargs in (("plain", {}), ("pressure", dict(max_model_len=64, num_device_blocks=5,
                                                         preemption_mode="swap"))):
    report = tiny_tp2[case]["tp2"]["memory_report"]
    plan = dry_run(fixture_path("tiny_llama"), tensor_parallel_size=2,
                   **{**dict(max_model_len=256, max_num_seqs=4), **kwargs})
    # what running measures (the swaps of the worker's generation) is left out
    shared = set(plan) & set(report) - {"kv_swap_bytes_per_step", "kv_swap_bytes_max_step"}
    assert len(shared) >= 15, case
    assert {k: plan[k] for k in shared} == {k: report[k] for k in shared}, case


def test_tp2_decode_step_needs_two_all_reduces_per_layer_and_nothing_else(tiny_tp2):
  for case in ("plain", "offload", "pressure"):  # unrolled or offloaded layers: all in the text
    row = tiny_tp2[case]["tp2"]
    assert row["collectives"]["all-reduce"] == 2 * row["num_layers"], case
    assert sum(row["collectives"].values()) == row["collectives"]["all-reduce"], case
  scan = tiny_tp2["scan"]["tp2"]  # one loop body for every layer
  assert scan["collectives"] == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0,
                                 "collective-permute": 0, "all-to-all": 0}


def test_tp2_offloaded_tail_is_sharded_in_pinned_host_and_streams_its_share(tiny_tp2):
  row = tiny_tp2["offload"]["tp2"]
  assert row["offload_tail_layers"] == 2 and row["tail_kinds"] == ["pinned_host"]
  assert "[None, None, 'tp']" in row["tail_specs"]  # stacked kernels split like resident ones
  c = hf.read_config(fixture_path("tiny_llama"))
  layer_bytes = c.layer_param_count * 4
  norm_bytes = 2 * c.hidden_size * 4  # replicated: every device fetches them whole
  assert row["weight_bytes"]["pinned_host"] == 2 * layer_bytes
  t = row["transfers"]  # the decode step exported for CUDA: what crosses each device's link
  assert t["host_compute"] == 0
  assert t["per_call"] == 2 * layer_bytes
  assert t["per_device"] == 2 * ((layer_bytes - norm_bytes) // 2 + norm_bytes)


def test_tp2_swaps_each_shard_under_a_small_pool(tiny_tp2):
  rows = tiny_tp2["pressure"]
  assert rows["tp2"]["swap_out_count"] > 0 and rows["tp2"]["preemptions"]["swap"] > 0
  assert rows["tp2"]["device_blocks_free"] == rows["tp2"]["device_blocks_total"]
  # each swapped block went to the host as each device's own kv-head shard: [k, l, c, d]
  specs = rows["tp2"]["host_block_spec"]
  assert len(specs) == 1 and specs[0][0] == "tp" and not any(specs[0][1:]), specs
  assert rows["tp2"]["host_block_kind"] == ["pinned_host"]


def test_tensor_parallel_size_is_checked_before_loading():
  with pytest.raises(ValueError, match=r"tensor_parallel_size=2: expected 1 to 1"):
    jaxtier.LLM("no/such/model", tensor_parallel_size=2)
  with pytest.raises(ValueError, match=r"tensor_parallel_size=0: expected an int"):
    jaxtier.LLM(fixture_path("tiny_llama"), tensor_parallel_size=0)
  c = hf.read_config(fixture_path("tiny_llama"))  # 4 query heads, 2 kv heads
  with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide .*num_kv_heads"):
    sharding.check_tensor_parallel(c, 4)
  sharding.check_tensor_parallel(c, 2)


def test_logical_axes_cover_every_arrangement_of_the_parameters():
  assert sharding.param_axes(("layers", "q_proj", "kernel"), 3) == ("layers", "embed", "heads")
  assert sharding.param_axes(("groups", "0", "layers", "3", "o_proj", "kernel"), 2) == (
      "heads", "embed")
  assert sharding.param_axes(("embed", "embedding"), 2) == ("vocab", "embed")
  with pytest.raises(ValueError, match="has no logical axes"):
    sharding.param_axes(("layers", "mystery"), 2)
  assert sharding.spec(("layers", "embed", "mlp")) == jax_spec(None, None, "tp")


def jax_spec(*axes):
  from jax.sharding import PartitionSpec  # pylint: disable=import-outside-toplevel
  return PartitionSpec(*axes)


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_phi3"])
def test_tp2_other_families_equal_tp1(name):
  """Qwen3's q/k norms (replicated over the head dim) and Phi-3's split fused projections."""
  rows = run_worker(fixture_path(name), 2, "plain", "scan", max_tokens=12)
  for case in ("plain", "scan"):
    assert rows[case]["tp2"]["tokens"] == rows[case]["tp1"]["tokens"], case
