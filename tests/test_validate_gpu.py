"""`scripts/validate_gpu.py` as a dry run on the CPU: its sections run and its checks hold here."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
SECTIONS = ("env,swap,link,hf_tiny,engine_tiny,sampling,quant,experts,attention,compile,"
            "startup,pinned_cap,profile,decode")


def test_validate_gpu_dry_run(tmp_path):
  out, doc = tmp_path / "v.json", tmp_path / "doc.md"
  doc.write_text("# Runs\n")
  subprocess.run([sys.executable, "scripts/validate_gpu.py", f"--out={out}", "--allow_cpu",
                  f"--sections={SECTIONS}", "--decode_batches=1", "--decode_depths=2",
                  "--decode_quantizations=int4", f"--doc={doc}"],
                 cwd=ROOT, check=True, capture_output=True, timeout=600)
  result = json.loads(out.read_text())
  sections = result["sections"]
  assert list(sections) == SECTIONS.split(",")
  assert all("error" not in s and "skipped" not in s and "skipped_by_time_box" not in s
             for s in sections.values()), sections
  assert sections["env"]["backend"] == "cpu"
  assert sections["hf_tiny"]["float32_highest_ok"]
  engine = sections["engine_tiny"]
  assert engine["all_identical"]
  assert engine["small_pool_swap"]["swap_out_count"] > 0
  # structured outputs: the same tokens resident, offloaded and swapping, and texts that parse
  assert engine["structured_identical"] and engine["structured_parse"]
  assert engine["small_pool_swap"]["structured_swap_out_count"] > 0
  assert engine["prefix_hits_counted"] and engine["resident"]["prefix_hit_tokens"] >= 16
  assert engine["resident"]["prefix_identical_to_reference"]
  for mode in ("stream", "host"):
    experts_entry = engine[f"mixtral_experts_{mode}"]
    assert experts_entry["identical_to_reference"] and experts_entry["host_expert_bytes"] > 0
  assert sections["sampling"]["ok"], sections["sampling"]
  assert sections["sampling"]["swap_out_count"] > 0
  experts = sections["experts"]
  assert set(experts["calls"]) == {"1", "4", "16", "64"}
  assert all(call["host_s"] > 0 and call["stream_s"] > 0 for call in experts["calls"].values())
  quant = sections["quant"]["rows"]
  assert set(quant) == {"bfloat16", "int8", "int4"}
  assert all(quant[f][b]["max_rel_diff"] < 1e-2 for f in ("int8", "int4") for b in ("1", "8", "32"))
  # XLA:CPU writes the dequantized weight before its dot: the check sees it (a GPU must not)
  assert not sections["quant"]["fused"] and quant["int4"]["1"]["float_weight_copies"]
  assert sections["quant"]["engine_int4"]["offloaded_equals_resident"]
  attention = sections["attention"]
  assert attention["interpret"] and set(attention["decode"]) == {"batch_1_context_64",
                                                                 "batch_2_context_64"}
  assert all(cell["pallas_s"] > 0 and cell["xla_s"] > 0 for cell in attention["decode"].values())
  assert attention["max_abs_diff_pallas_xla"] < 2e-2

  swap = sections["swap"]
  assert set(swap["blocks"]) == {"1", "8", "64"}
  assert all(r["h2d_gbps"] > 0 and r["d2h_gbps"] > 0 for r in swap["blocks"].values())
  assert swap["blocks"]["64"]["parts"] == [16, 16, 16, 16]
  assert swap["first_use"]["blocks"] == 64 and "seconds_per_block" in swap["first_use"]
  compiled = sections["compile"]
  assert compiled["engine_args"]["max_num_seqs"] == 16  # configs/serve_default.py's
  assert compiled["programs"] == sum(compiled["programs_by_kind"].values()) > 10
  assert set(compiled["programs_by_kind"]) == {"decode", "prefill", "sample_transformed", "swap"}
  assert set(compiled["compiled"]) == {"decode", "sample_transformed", "prefill", "swap_out"}
  assert all(c["seconds"] > 0 for c in compiled["compiled"].values())
  assert compiled["warmup_estimate_seconds"] > 0 and compiled["warmup_estimate_by_kind_seconds"] > 0
  started = sections["startup"]
  cold, warm = started["cold"], started["warm"]
  assert cold["programs"] == warm["programs"] > cold["ready_programs"] > 0
  assert cold["built_programs"] == warm["built_programs"] >= cold["ready_programs"]
  assert cold["compiled"] >= cold["built_programs"] and cold["ready_seconds"] > 0
  assert warm["compiled"] == 0 and warm["cache_hits"] >= warm["built_programs"]
  assert started["warm_compiled_nothing"] and started["cold_estimate_all_seconds"] > 0
  pinned = sections["pinned_cap"]
  assert pinned["cap"] == "none" and pinned["ok"]
  assert pinned["allocated_bytes"] == pinned["requested_bytes"] > 0
  profile = sections["profile"]
  assert profile["trace_dir"] == str(tmp_path / "v_profile")
  for label in ("resident", "offloaded"):
    assert "parse_error" not in profile[label] and os.path.exists(profile[label]["trace_file"])
    summary = profile[label]["summary"]
    assert summary["by_kind_ms"]["kernels"] > 0 and summary["by_kind_ms"]["host_dispatch"] > 0
    assert len(summary["top_events"]) == 10
  assert profile["offloaded"]["offload_tail_layers"] == 2
  decode = sections["decode"]
  assert "step_ms" in decode["resident"]["batch_1"]
  # a depth of the sweep (it may be the default run's) and the quantized runs, each at batch 1
  assert set(decode) >= {"offload_2", "offload_4", "offload_2_depth_2", "int4_resident",
                         "int4_offload_2"}
  for label in ("offload_2", "offload_4", "offload_2_depth_2", "int4_resident", "int4_offload_2"):
    assert "batch_1" in decode[label] or decode[label] == {"same_as": "offload_2"}, label
  assert decode["offload_2_depth_2"].get("prefetch_depth", 2) == 2
  assert (decode["int4_resident"]["device_weight_bytes"]
          < decode["resident"]["memory_report"]["device_weight_bytes"])

  # --doc: a row per section under the commit and the device
  table = doc.read_text()
  assert table.startswith("# Runs\n") and f"### Run at {result['commit']} on cpu" in table
  rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
  assert [row.split(" | ")[0][2:] for row in rows] == SECTIONS.split(",")
  assert all(" | error | " not in row for row in rows), table


def test_trace_summary_sorts_events_by_kind(tmp_path):
  """The profile section's summary on a GPU-shaped trace: device streams, a derived line that is
  not counted, and nested Python events counted once (self time)."""
  def event(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

  def meta(pid, tid, kind, name):
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}

  trace = {"traceEvents": [
      meta(1, None, "process_name", "/host:CPU"), meta(1, 1, "thread_name", "python"),
      meta(1, 2, "thread_name", "tf_pjrt_client"),
      meta(2, None, "process_name", "/device:GPU:0"),
      meta(2, 7, "thread_name", "Stream #7(Compute)"),
      meta(2, 9, "thread_name", "Stream #9(MemcpyH2D)"), meta(2, 100, "thread_name", "XLA Ops"),
      event(1, 1, "$engine.py:1 step", 0, 100), event(1, 1, "$runner.py:2 _program", 10, 30),
      event(1, 1, "$numpy asarray", 45, 50),
      event(1, 2, "PjRtStreamExecutorLoadedExecutable::Execute", 12, 10),
      event(2, 7, "loop_gather_fusion", 20, 5), event(2, 7, "gemm_fusion_3", 25, 20),
      event(2, 9, "MemcpyH2D", 20, 15), event(2, 100, "gather.3", 20, 5)]}
  path = tmp_path / "trace.json"
  path.write_text(json.dumps(trace))
  code = ("import json, sys; sys.path.insert(0, 'scripts'); import validate_gpu; "
          f"print(json.dumps(validate_gpu._trace_summary(json.load(open({str(path)!r})), 2)))")
  summary = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                                      capture_output=True, text=True, timeout=120).stdout)
  assert summary["by_kind_ms"] == pytest.approx({
      "kernels": 0.02, "gathers": 0.005, "host_to_device": 0.015, "device_to_host": 0.0,
      "host_dispatch": 0.06, "host_wait": 0.05, "other": 0.0})
  assert summary["by_kind_per_step_ms"]["host_dispatch"] == pytest.approx(0.03)
  assert summary["device_events"] == 4
  assert [e["name"] for e in summary["top_events"][:2]] == ["$numpy asarray",
                                                            "$runner.py:2 _program"]
  assert {t["thread"]: t["counted"] for t in summary["tracks"]}["XLA Ops"] is False


def test_validate_gpu_refuses_cpu_without_flag(tmp_path):
  result = subprocess.run([sys.executable, "scripts/validate_gpu.py", f"--out={tmp_path}/v.json",
                           "--sections=env"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "--allow_cpu" in result.stderr
