"""Tests of the run doctor: each table row on a stats dict built to show its symptom, thresholds at
their boundaries, the report, the trace reader and plot, and scripts/doctor.py as a subprocess."""

import ast
import json
import os
import struct
import subprocess
import sys

import pytest

from jaxtier.engine import doctor

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "doctor.py")
ROOT = os.path.join(os.path.dirname(__file__), "..")
MIB = 2**20


def healthy() -> dict:
  """A run with swapping, offload and long prompts that shows no symptom."""
  return {
      "steps": 1000, "run_seconds": 20.0,
      "swap_out_count": 4, "swap_in_count": 4, "swap_out_blocks": 64, "swap_in_blocks": 64,
      "swap_out_bytes": 64 * MIB, "swap_in_bytes": 64 * MIB, "swap_seconds": 0.2,
      "preemptions": {"swap": 4, "recompute": 0},
      "device_blocks_total": 512, "device_blocks_free": 100, "device_blocks_peak_used": 500,
      "host_blocks_total": 1024, "host_blocks_free": 1024, "host_blocks_peak_used": 64,
      "requests_finished": 31,
      "requests_aborted": {"client_abort": 1, "host_pool_full": 0, "exceeds_kv_capacity": 0},
      "compiled_variants": 6, "compile_seconds": 3.0, "generated_tokens": 8192,
      "prompt_tokens": 32 * 600, "block_size": 16, "block_bytes": MIB,
      "kv_cache_dtype": "bfloat16", "preemption_mode": "swap", "watermark_blocks": 8,
      "offload_tail_layers": 4, "prefetch_depth": 2, "weight_transfer_bytes_per_step": 40 * MIB,
      "decode_step_seconds_mean": 0.011, "offload_predicted_step_seconds": 0.010,
      "offload_compute_step_seconds": 0.010,
  }


def with_(**changes) -> dict:
  stats = healthy()
  stats.update(changes)
  return stats


def symptoms(stats: dict) -> list[str]:
  return [f.symptom for f in doctor.diagnose(stats)]


# One stats dict per row, each changing the healthy run just enough to show that row's symptom.
SICK = {
    doctor.SYMPTOM_SMALL_SWAPS: with_(swap_out_count=64, swap_in_count=64, swap_out_blocks=128,
                                      swap_in_blocks=128, watermark_blocks=64),
    doctor.SYMPTOM_SWAP_TIME: with_(swap_seconds=8.0),
    doctor.SYMPTOM_HOST_FULL: with_(
        requests_aborted={"client_abort": 1, "host_pool_full": 3, "exceeds_kv_capacity": 0}),
    doctor.SYMPTOM_PREFETCH: with_(decode_step_seconds_mean=0.02),
    doctor.SYMPTOM_KV_CAPACITY: with_(
        requests_aborted={"client_abort": 1, "host_pool_full": 0, "exceeds_kv_capacity": 2}),
    doctor.SYMPTOM_RECOMPUTE: with_(preemption_mode="recompute",
                                    preemptions={"swap": 0, "recompute": 10}),
    doctor.SYMPTOM_PREFIX_EVICTED: with_(prefix_caching=True, host_prefix_caching=False,
                                         prefix_device_evictions=400, prefix_device_hit_tokens=8000,
                                         prefix_host_hit_tokens=0),
}


def test_prefix_evicted_boundaries_and_tiers():
  base = dict(prefix_caching=True, host_prefix_caching=False, prefix_device_hit_tokens=1024,
              prefix_host_hit_tokens=0)
  # 64 evicted blocks of 16 tokens over 1024 hit tokens: 1.0 evicted token per hit token.
  assert symptoms(with_(**base, prefix_device_evictions=64)) == [doctor.SYMPTOM_PREFIX_EVICTED]
  assert symptoms(with_(**base, prefix_device_evictions=63)) == []
  # 32 evicted tokens per 64 hit tokens is the 0.5 boundary; fewer evictions per hit: healthy.
  assert symptoms(with_(**{**base, "prefix_device_hit_tokens": 4096},
                        prefix_device_evictions=128)) == [doctor.SYMPTOM_PREFIX_EVICTED]
  assert symptoms(with_(**{**base, "prefix_device_hit_tokens": 4097},
                        prefix_device_evictions=128)) == []
  # With the host tier, device evictions are write-backs, not losses: only host evictions count.
  tiered = with_(**{**base, "host_prefix_caching": True}, prefix_device_evictions=500,
                 prefix_host_evictions=0)
  assert symptoms(tiered) == []
  finding, = doctor.diagnose(with_(**{**base, "host_prefix_caching": True},
                                   prefix_host_evictions=100))
  assert "num_host_blocks" in finding.remedy and finding.figures["prefix_host_evictions"] == 100
  finding, = doctor.diagnose(with_(**base, prefix_device_evictions=100))
  assert "host_prefix_caching" in finding.remedy
  assert symptoms(with_(**{**base, "prefix_caching": False}, prefix_device_evictions=100)) == []


def test_healthy_run_has_no_symptoms():
  assert doctor.diagnose(healthy()) == ()


@pytest.mark.parametrize("symptom", list(SICK))
def test_each_symptom_triggers_exactly_its_row(symptom):
  findings = doctor.diagnose(SICK[symptom])
  assert [f.symptom for f in findings] == [symptom]
  finding = findings[0]
  assert finding.cause and finding.remedy and finding.figures
  assert all(isinstance(v, (int, float)) for v in finding.figures.values())


def test_findings_are_frozen_and_in_table_order():
  stats = with_(swap_seconds=8.0, decode_step_seconds_mean=0.02,
                requests_aborted={"host_pool_full": 1, "exceeds_kv_capacity": 1})
  findings = doctor.diagnose(stats)
  assert [f.symptom for f in findings] == [doctor.SYMPTOM_SWAP_TIME, doctor.SYMPTOM_HOST_FULL,
                                           doctor.SYMPTOM_PREFETCH, doctor.SYMPTOM_KV_CAPACITY]
  with pytest.raises(AttributeError):
    findings[0].symptom = "x"


def test_figures_name_the_triggering_numbers():
  small = doctor.diagnose(SICK[doctor.SYMPTOM_SMALL_SWAPS])[0].figures
  assert small == {"swap_out_count": 64, "requests": 32, "swaps_per_request": 2.0,
                   "blocks_per_swap": 2.0, "watermark_blocks": 64}
  swap = doctor.diagnose(SICK[doctor.SYMPTOM_SWAP_TIME])[0].figures
  assert swap["swap_time_share"] == 0.4 and swap["swap_seconds"] == 8.0
  prefetch = doctor.diagnose(SICK[doctor.SYMPTOM_PREFETCH])[0].figures
  assert prefetch["step_over_compute"] == 2.0 and prefetch["prefetch_depth"] == 2
  recompute = doctor.diagnose(SICK[doctor.SYMPTOM_RECOMPUTE])[0].figures
  assert recompute == {"recompute_preemptions": 10, "recompute_share": 1.0,
                       "prompt_tokens_per_request": 600.0}


def test_remedies_name_the_engine_arguments():
  remedies = {s: doctor.diagnose(stats)[0].remedy for s, stats in SICK.items()}
  assert "watermark" in remedies[doctor.SYMPTOM_SMALL_SWAPS].lower()
  assert "victim_policy" in remedies[doctor.SYMPTOM_SMALL_SWAPS]
  for name in ("kv_cache_dtype=int8", "num_device_blocks", "kv_cache_memory_gb"):
    assert name in remedies[doctor.SYMPTOM_SWAP_TIME]
  for name in ("preemption_mode=recompute", "num_host_blocks", "swap_space_gb"):
    assert name in remedies[doctor.SYMPTOM_HOST_FULL]
  for name in ("prefetch_depth", "offload_tail_layers"):
    assert name in remedies[doctor.SYMPTOM_PREFETCH]
  for name in ("num_device_blocks", "max_tokens"):
    assert name in remedies[doctor.SYMPTOM_KV_CAPACITY]
  assert "preemption_mode=swap" in remedies[doctor.SYMPTOM_RECOMPUTE]


def test_small_swaps_without_a_watermark_blame_the_victim_policy():
  finding, = doctor.diagnose(with_(**{**SICK[doctor.SYMPTOM_SMALL_SWAPS], "watermark_blocks": 0}))
  assert "already 0" in finding.cause and "victim_policy" in finding.remedy
  assert "Lower the watermark" not in finding.remedy


def test_swap_time_with_int8_cache_asks_only_for_a_larger_pool():
  remedy = doctor.diagnose(with_(swap_seconds=8.0, kv_cache_dtype="int8"))[0].remedy
  assert "already int8" in remedy and "num_device_blocks" in remedy


# --------------------------------------------------------------------------------------------------
# Threshold boundaries (every comparison is inclusive)


def _small_swaps(count: int, blocks: int, requests: int) -> dict:
  return with_(swap_out_count=count, swap_out_blocks=blocks, requests_finished=requests,
               requests_aborted={})


def test_small_swaps_boundaries():
  n = doctor.MIN_SWAPS
  per_swap = int(doctor.SMALL_SWAP_BLOCKS)
  assert symptoms(_small_swaps(n, n * per_swap, n)) == [doctor.SYMPTOM_SMALL_SWAPS]
  assert symptoms(_small_swaps(n - 1, (n - 1) * per_swap, n - 1)) == []  # too few swaps
  assert symptoms(_small_swaps(n, n * per_swap, n + 1)) == []  # under one swap per request
  assert symptoms(_small_swaps(n, n * per_swap + 1, n)) == []  # swaps just over the small size


def test_swap_time_boundary():
  run = 10.0
  at = run * doctor.SWAP_TIME_FRACTION
  assert symptoms(with_(run_seconds=run, swap_seconds=at)) == [doctor.SYMPTOM_SWAP_TIME]
  assert symptoms(with_(run_seconds=run, swap_seconds=at * 0.999)) == []


def test_host_full_boundaries_and_triggers():
  total = 200
  at = int(total * doctor.HOST_FULL_FRACTION)
  assert symptoms(with_(host_blocks_total=total, host_blocks_peak_used=at)) == [
      doctor.SYMPTOM_HOST_FULL]
  assert symptoms(with_(host_blocks_total=total, host_blocks_peak_used=at - 1)) == []
  # In swap mode a recompute preemption means the victim did not fit in the host pool.
  fallback = with_(preemptions={"swap": 4, "recompute": 1})
  assert symptoms(fallback) == [doctor.SYMPTOM_HOST_FULL]
  assert doctor.diagnose(fallback)[0].figures["recompute_preemptions_in_swap_mode"] == 1


def test_prefetch_boundary_and_planner_fallback():
  compute = 0.004
  at = compute * doctor.PREFETCH_EXPOSED_RATIO
  assert symptoms(with_(offload_compute_step_seconds=compute, decode_step_seconds_mean=at)) == [
      doctor.SYMPTOM_PREFETCH]
  assert symptoms(with_(offload_compute_step_seconds=compute,
                        decode_step_seconds_mean=at * 0.99)) == []
  # Without a measured decode step, the planner's prediction is compared.
  planned = with_(decode_step_seconds_mean=None, offload_predicted_step_seconds=0.03)
  finding, = doctor.diagnose(planned)
  assert finding.figures["offload_predicted_step_seconds"] == 0.03
  # No offloaded layers: no prefetch to hide.
  assert symptoms(with_(decode_step_seconds_mean=0.02, offload_tail_layers=0)) == []


def test_kv_capacity_boundary():
  def aborts(n):
    return with_(requests_aborted={"exceeds_kv_capacity": n})
  assert symptoms(aborts(doctor.KV_CAPACITY_ABORTS)) == [doctor.SYMPTOM_KV_CAPACITY]
  assert symptoms(aborts(doctor.KV_CAPACITY_ABORTS - 1)) == []


def test_recompute_boundaries():
  def run(recomputes, swaps, prompt_mean):
    return with_(preemption_mode="recompute", preemptions={"swap": swaps, "recompute": recomputes},
                 requests_finished=10, requests_aborted={}, prompt_tokens=prompt_mean * 10)
  long = doctor.LONG_PROMPT_TOKENS
  n = doctor.MIN_RECOMPUTES
  assert symptoms(run(n, 0, long)) == [doctor.SYMPTOM_RECOMPUTE]
  assert symptoms(run(n - 1, 0, long)) == []
  assert symptoms(run(n, 0, long - 1)) == []  # short prompts: recompute is the right call
  assert symptoms(run(n, n, long)) == [doctor.SYMPTOM_RECOMPUTE]  # exactly half
  assert symptoms(run(n, n + 1, long)) == []


# --------------------------------------------------------------------------------------------------
# Missing and invalid input


# The keys each row cannot do without (figures beyond these are reported when present).
REQUIRED = {
    doctor.SYMPTOM_SMALL_SWAPS: ("swap_out_count", "swap_out_blocks", "requests_finished"),
    doctor.SYMPTOM_SWAP_TIME: ("swap_seconds", "run_seconds"),
    doctor.SYMPTOM_HOST_FULL: ("requests_aborted",),
    doctor.SYMPTOM_PREFETCH: ("offload_tail_layers", "offload_compute_step_seconds"),
    doctor.SYMPTOM_KV_CAPACITY: ("requests_aborted",),
    doctor.SYMPTOM_RECOMPUTE: ("preemptions", "prompt_tokens", "requests_finished"),
    doctor.SYMPTOM_PREFIX_EVICTED: ("prefix_caching", "prefix_device_evictions", "block_size"),
}


@pytest.mark.parametrize("symptom", list(SICK))
def test_missing_figures_make_rows_not_apply(symptom):
  for key in REQUIRED[symptom]:
    partial = {k: v for k, v in SICK[symptom].items() if k != key}
    assert symptom not in symptoms(partial), key
  assert doctor.diagnose({}) == ()


def test_null_and_non_numeric_figures_are_missing():
  assert symptoms(with_(swap_seconds=None)) == []
  assert symptoms(with_(swap_seconds="8.0")) == []
  assert symptoms(with_(swap_seconds=float("nan"))) == []
  assert symptoms(with_(requests_aborted=None)) == []
  assert symptoms(with_(requests_aborted={"exceeds_kv_capacity": True})) == []


@pytest.mark.parametrize("bad", [None, [], "stats", 3])
def test_diagnose_rejects_non_dicts(bad):
  with pytest.raises(TypeError, match="expected a dict"):
    doctor.diagnose(bad)


def test_load_stats(tmp_path):
  good = tmp_path / "stats.json"
  good.write_text(json.dumps(healthy()))
  assert doctor.load_stats(str(good)) == healthy()
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="not valid JSON"):
    doctor.load_stats(str(bad))
  listed = tmp_path / "list.json"
  listed.write_text("[1, 2]")
  with pytest.raises(ValueError, match="expected a JSON object"):
    doctor.load_stats(str(listed))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    doctor.load_stats(str(tmp_path / "missing.json"))


# --------------------------------------------------------------------------------------------------
# Report


def test_report_without_symptoms_prints_the_numbers_to_watch():
  text = doctor.report(doctor.diagnose(healthy()), healthy())
  assert "no symptoms found" in text
  assert "swap_count=8" in text
  assert "swap_bytes=128.00 MiB" in text
  assert "swap_seconds=200.00 ms" in text
  bare = doctor.report(())
  assert "no symptoms found" in bare and "swap_count=n/a" in bare


def test_report_lists_each_finding_with_its_figures():
  stats = with_(swap_seconds=8.0, requests_aborted={"exceeds_kv_capacity": 2})
  text = doctor.report(doctor.diagnose(stats), stats)
  assert text.startswith("2 symptoms found:")
  assert "1. swap time dominates" in text and "2. requests exceed KV capacity" in text
  assert "swap_time_share=0.4" in text and "exceeds_kv_capacity_aborts=2" in text
  assert "swap_seconds=8.000 s" in text
  assert "no symptoms found" not in text
  assert max(len(line) for line in text.splitlines()) <= doctor.REPORT_WIDTH
  assert "\0" not in text


def test_module_imports_no_jax_and_matplotlib_only_lazily():
  with open(doctor.__file__) as f:
    tree = ast.parse(f.read())
  top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
  names = [a.name for n in top for a in n.names] + [n.module for n in top
                                                     if isinstance(n, ast.ImportFrom)]
  assert not any(str(n).split(".")[0] in ("jax", "jaxlib", "flax", "matplotlib") for n in names)
  every = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
  assert not any("jax" in (getattr(n, "module", None) or "") or
                 any("jax" in a.name for a in n.names) for n in every)


def test_importing_the_doctor_loads_no_jax():
  program = ("import sys, jaxtier.engine.doctor; "
             "assert not any(m.split('.')[0] in ('jax', 'jaxlib') for m in sys.modules)")
  proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------------
# Trace


def synthetic_trace(steps: int = 40) -> list[dict]:
  rows = []
  for s in range(steps):
    out = 3 if s % 10 == 5 else 0
    into = 3 if s % 10 == 8 else 0
    swapped = int(s % 10 in (5, 6, 7))
    rows.append({"step": s, "time": s * 0.01, "running": 4 - swapped,
                 "waiting": max(0, 6 - s // 5), "swapped": swapped,
                 "device_blocks_used": min(60, 20 + s), "host_blocks_used": 3 * swapped,
                 "swap_out_blocks": out, "swap_in_blocks": into, "swap_out_bytes": out * MIB,
                 "swap_in_bytes": into * MIB, "prefill_tokens": 64 * (s < 6), "decode_tokens": 4,
                 "preempted": int(out > 0), "finished": int(s % 9 == 8)})
  return rows


def write_trace(path, rows) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_read_trace_round_trips_and_skips_blank_lines(tmp_path):
  rows = synthetic_trace(5)
  path = tmp_path / "trace.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
  assert doctor.read_trace(str(path)) == rows


@pytest.mark.parametrize("line, error", [
    ("{bad", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ('{"running": 1}', "line 2: expected a numeric 'step'"),
])
def test_read_trace_names_the_bad_line(tmp_path, line, error):
  path = tmp_path / "trace.jsonl"
  path.write_text(json.dumps({"step": 0}) + "\n" + line + "\n")
  with pytest.raises(ValueError, match=error):
    doctor.read_trace(str(path))


def test_read_trace_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    doctor.read_trace(str(tmp_path / "nope.jsonl"))


def png_size(path) -> tuple[int, int]:
  with open(path, "rb") as f:
    head = f.read(24)
  assert head[:8] == b"\x89PNG\r\n\x1a\n"
  assert head[12:16] == b"IHDR"
  return struct.unpack(">II", head[16:24])


def test_plot_trace_writes_a_png(tmp_path):
  out = tmp_path / "trace.png"
  assert doctor.plot_trace(synthetic_trace(), str(out), "synthetic run", device_blocks_total=64,
                           host_blocks_total=16) == str(out)
  assert png_size(out) == (1000, 900)
  assert 20_000 < out.stat().st_size < 2_000_000


def test_plot_trace_with_partial_rows_and_errors(tmp_path):
  out = tmp_path / "partial.png"
  doctor.plot_trace([{"step": 0, "running": 1}, {"step": 1}], str(out))
  assert png_size(out) == (1000, 900)
  with pytest.raises(ValueError, match="empty"):
    doctor.plot_trace([], str(out))
  with pytest.raises(ValueError, match="row 1"):
    doctor.plot_trace([{"step": 0}, {"running": 2}], str(out))


# --------------------------------------------------------------------------------------------------
# scripts/doctor.py


def run_script(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT,
                        timeout=60)


def test_script_prints_the_rows_that_apply_and_plots(tmp_path):
  stats = with_(swap_seconds=8.0, requests_aborted={"exceeds_kv_capacity": 2})
  stats_path = tmp_path / "run_stats.json"
  stats_path.write_text(json.dumps(stats))
  trace = write_trace(tmp_path / "trace.jsonl", synthetic_trace())
  plot = tmp_path / "out.png"
  proc = run_script(f"--stats={stats_path}", f"--trace={trace}", f"--plot={plot}")
  assert proc.returncode == 0, proc.stderr
  assert "swap time dominates" in proc.stdout
  assert "requests exceed KV capacity" in proc.stdout
  for other in (doctor.SYMPTOM_SMALL_SWAPS, doctor.SYMPTOM_HOST_FULL, doctor.SYMPTOM_PREFETCH,
                doctor.SYMPTOM_RECOMPUTE):
    assert other not in proc.stdout
  assert "numbers to watch: swap_count=8" in proc.stdout
  assert "trace: 40 steps" in proc.stdout
  assert png_size(plot) == (1000, 900)


def test_script_healthy_run(tmp_path):
  stats_path = tmp_path / "run_stats.json"
  stats_path.write_text(json.dumps(healthy()))
  proc = run_script(f"--stats={stats_path}")
  assert proc.returncode == 0, proc.stderr
  assert "no symptoms found" in proc.stdout and "swap_seconds=200.00 ms" in proc.stdout


@pytest.mark.parametrize("content, args, error", [
    (None, [], "stats file"),
    ("{bad", [], "not valid JSON"),
    ("{}", ["--trace=missing.jsonl"], "trace file"),
    ("{}", ["--plot=out.png"], "--plot needs --trace"),
])
def test_script_errors_are_one_line(tmp_path, content, args, error):
  stats_path = tmp_path / "run_stats.json"
  if content is not None:
    stats_path.write_text(content)
  args = [a.replace("missing.jsonl", str(tmp_path / "missing.jsonl")) for a in args]
  proc = run_script(f"--stats={stats_path}", *args)
  assert proc.returncode == 1
  assert error in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1
  assert not proc.stdout
