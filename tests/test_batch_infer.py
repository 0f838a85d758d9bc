"""scripts/batch_infer.py end to end on the tiny Llama: output format, resuming, bad input."""

import json
import os
import subprocess
import sys

from conftest import fixture_path

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "batch_infer.py")


def run(tmp_path, lines, *flags):
  src = tmp_path / "in.jsonl"
  src.write_text("".join(line + "\n" for line in lines))
  out = tmp_path / "out.jsonl"
  proc = subprocess.run([sys.executable, SCRIPT, f"--model={fixture_path('tiny_llama')}",
                         f"--input={src}", f"--output={out}", "--max_tokens=4", *flags],
                        capture_output=True, text=True, timeout=300)
  rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
  return proc, rows


def test_writes_one_line_per_record_and_resumes(tmp_path):
  lines = [json.dumps({"id": "a", "prompt": "Hello"}),
           json.dumps({"id": 2, "messages": [{"role": "user", "content": "hi"}]})]
  proc, rows = run(tmp_path, lines[:1])
  assert proc.returncode == 0, proc.stderr
  assert [r["id"] for r in rows] == ["a"]
  assert set(rows[0]) == {"id", "text", "token_ids", "finish_reason"}
  assert len(rows[0]["token_ids"]) <= 4 and rows[0]["finish_reason"] in ("stop", "length")
  proc, rows = run(tmp_path, lines)  # same output file: "a" is skipped, 2 is added
  assert proc.returncode == 0, proc.stderr
  assert "1 already in" in proc.stderr
  assert [r["id"] for r in rows] == ["a", 2]


def test_invalid_lines_are_reported_before_any_work(tmp_path):
  lines = ["{not json", json.dumps({"prompt": "no id"}), json.dumps({"id": 1}),
           json.dumps({"id": 3, "prompt": "x"}), json.dumps({"id": 3, "prompt": "y"})]
  proc, rows = run(tmp_path, lines)
  assert proc.returncode != 0 and rows == []
  for expected in ("line 1: not valid JSON", "line 2: expected an object with an 'id'",
                   "line 3: expected exactly one of 'prompt' or 'messages'", "line 5: duplicate id 3"):
    assert expected in proc.stderr


def test_bad_sampling_flag_is_a_clear_error(tmp_path):
  proc, rows = run(tmp_path, [json.dumps({"id": 1, "prompt": "x"})], "--top_p=2")
  assert proc.returncode != 0 and "top_p must be in (0, 1]" in proc.stderr
