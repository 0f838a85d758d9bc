"""`scripts/validate_gpu.py` as a dry run on the CPU: its sections run and its checks hold here."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_validate_gpu_dry_run(tmp_path):
  out = tmp_path / "v.json"
  subprocess.run([sys.executable, "scripts/validate_gpu.py", f"--out={out}", "--allow_cpu",
                  "--sections=env,link,hf_tiny,engine_tiny,sampling,experts,quant,attention"],
                 cwd=ROOT, check=True, capture_output=True, timeout=600)
  sections = json.loads(out.read_text())["sections"]
  assert all("error" not in s for s in sections.values()), sections
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


def test_validate_gpu_refuses_cpu_without_flag(tmp_path):
  result = subprocess.run([sys.executable, "scripts/validate_gpu.py", f"--out={tmp_path}/v.json",
                           "--sections=env"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "--allow_cpu" in result.stderr
