"""scripts/batch_infer.py end to end on the tiny Llama: outputs against the offline API, resuming
(records appended to the input, a line cut short after the last checkpoint), bad records (before
the model loads and once the tokenizer is loaded), skipped records in the rejects file and retried
by a rerun, reruns with other settings refused (naming them and the files) or started over with
--overwrite, flag errors, --help; and the record rules of `jaxtier.server.records` in process."""

import json
import os
import subprocess
import sys

import pytest

from conftest import fixture_path
from jaxtier.server.records import parse_record

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "batch_infer.py")
VOCAB_SIZE = 300  # tests/fixtures/tiny_llama/config.json


def run(tmp_path, lines, *flags):
  src = tmp_path / "in.jsonl"
  src.write_text("".join(line + "\n" for line in lines))
  out = tmp_path / "out.jsonl"
  proc = subprocess.run([sys.executable, SCRIPT, f"--model={fixture_path('tiny_llama')}",
                         f"--input={src}", f"--output={out}",
                         "--max_tokens=4", *flags], capture_output=True, text=True, timeout=300)
  rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
  return proc, rows


def read_rows(path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_line(proc) -> str:
  """The stderr of a refused run, checked to be one error line."""
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
  assert proc.stderr.startswith("batch_infer.py: error: "), proc.stderr
  return proc.stderr


def summary(stderr: str) -> dict:
  lines = [line for line in stderr.splitlines() if line.startswith("summary: ")]
  assert len(lines) == 1, stderr
  return json.loads(lines[0].removeprefix("summary: "))


@pytest.mark.parametrize("record", [
    {"id": "a", "prompt": "Hello"},
    {"id": 0, "prompt": [0, 5, VOCAB_SIZE + 10]},  # the vocabulary is checked once it is loaded
    {"id": 1, "messages": [{"role": "developer", "content": "x"},
                           {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    {"id": 2, "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}},
    {"id": 3, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}}}},
])
def test_valid_records(record):
  assert parse_record(json.dumps(record)).id == record["id"]


@pytest.mark.parametrize("record, message", [
    ({"id": 1, "prompt": ""}, "prompt: is an empty string"),
    ({"id": 1, "prompt": []}, "prompt: is an empty list"),
    ({"id": 1, "prompt": None}, "prompt: expected a non-empty string or a non-empty list of token "
     "ids, got null"),
    ({"id": 1, "prompt": 42}, "got a number"),
    ({"id": 1, "prompt": True}, "got a boolean"),
    ({"id": 1, "prompt": ["a"]}, "prompt: token ids must be integers >= 0"),
    ({"id": 1, "prompt": [1, True, -1, 2.0]},
     "token ids must be integers >= 0, got [true, -1, 2.0]"),
    ({"id": 1, "messages": []}, "messages: List should have at least 1 item"),
    ({"id": 1, "messages": None}, "messages: Input should be a valid list"),
    ({"id": 1, "messages": [{"role": "tool", "content": "x"}]},
     "tool messages need a tool_call_id"),
    ({"id": 1, "messages": [{"role": "robot", "content": "x"}]},
     "messages.0.role: Input should be"),
    ({"id": 1, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"id": 1, "messages": [{"role": "user", "content": "x", "name": "n"}]},
     "messages.0.name is not a supported field"),
    ({"id": 1, "prompt": "x", "max_tokens": 3}, "max_tokens is not a supported field"),
    ({"id": 1, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of"),
    ({"id": True, "prompt": "x"}, "id: expected a string or an integer, got a boolean"),
    ({"id": None, "prompt": "x"}, "id: expected a string or an integer, got null"),
    ({"prompt": "x"}, "expected an object with an 'id'"),
    ([1], "expected an object with an 'id'"),
    ({"id": 1, "prompt": "x", "structured_outputs": {"regex": "("}},
     "structured_outputs.regex is invalid"),
    ({"id": 1, "prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"id": 1, "prompt": "x", "structured_outputs": {"choice": ["a"]},
      "response_format": {"type": "json_object"}}, "at most one of"),
])
def test_invalid_records(record, message):
  with pytest.raises(ValueError) as error:
    parse_record(json.dumps(record))
  assert message in str(error.value)


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
  assert summary(proc.stderr)["requests"] == 1


def test_outputs_match_the_offline_api_skipping_bad_and_finished_records(tmp_path):
  import jaxtier
  good = [{"id": "s", "prompt": "The sea"},
          {"id": "t", "prompt": [5, 17, 42]},
          {"id": "done", "prompt": "Hello"},
          {"id": 7, "messages": [{"role": "user", "content": "hi"}]},
          {"id": "m", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
          {"id": "cut", "prompt": "Once upon"}]
  bad_before_load = {"id": "empty", "prompt": ""}
  bad_after_load = {"id": "long", "prompt": [5] * 70}
  lines = [json.dumps(r) for r in good[:3]] + [json.dumps(bad_before_load)]
  lines += [json.dumps(r) for r in good[3:5]] + [json.dumps(bad_after_load), json.dumps(good[5])]
  flags = ("--on_bad_record=skip", "--max_num_seqs=2", "--max_model_len=64", "--max_tokens=6")
  proc, finished = run(tmp_path, lines[:3], *flags)  # an earlier run finished the first three
  assert proc.returncode == 0, proc.stderr
  with open(tmp_path / "out.jsonl", "a") as out:
    out.write('{"id": "cut", "te')  # a line cut short by a killed run, after its last checkpoint
  stats_json = tmp_path / "stats.json"
  proc, rows = run(tmp_path, lines, *flags, f"--stats_json={stats_json}")
  assert proc.returncode == 0, proc.stderr
  assert "line 4: prompt: is an empty string" in proc.stderr
  assert "line 7: prompt has 70 tokens; the context window max_model_len is 64" in proc.stderr
  assert "3 already in" in proc.stderr and "after its last checkpoint" in proc.stderr
  assert rows[:3] == finished
  assert sorted(map(str, (r["id"] for r in rows))) == sorted(str(r["id"]) for r in good)
  totals = summary(proc.stderr)
  assert totals["requests"] == len(good) - 3 and totals["invalid_records"] == 2
  assert totals["generated_tokens"] == sum(len(r["token_ids"]) for r in rows[3:])
  engine_stats = hasattr(jaxtier.LLM, "stats")
  assert ("swap_out_bytes" in totals) == engine_stats == stats_json.exists()

  llm = jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=64)
  params = jaxtier.SamplingParams(max_tokens=6, temperature=0)
  by_id = {r["id"]: r for r in rows}
  for record in good:
    if "prompt" in record:
      reference = llm.generate(record["prompt"], params)[0]
    else:
      conversation = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                       else "".join(p["text"] for p in m["content"])} for m in record["messages"]]
      reference = llm.chat(conversation, params)[0]
    row = by_id[record["id"]]
    assert (row["text"], row["token_ids"], row["finish_reason"]) == (
        reference.text, list(reference.token_ids), reference.finish_reason), record


def test_skipped_records_go_to_the_rejects_file_and_a_rerun_retries_them(tmp_path):
  lines = [json.dumps({"id": "a", "prompt": "Hello"}),
           json.dumps({"id": "long", "prompt": [5] * 40}), json.dumps({"id": "empty", "prompt": ""})]
  rejects = tmp_path / "out.jsonl.rejects.jsonl"
  proc, rows = run(tmp_path, lines, "--on_bad_record=skip", "--max_model_len=32")
  assert proc.returncode == 0, proc.stderr
  assert [r["id"] for r in rows] == ["a"]
  assert read_rows(rejects) == [
      {"id": "long", "line": 2, "reason": "prompt has 40 tokens; the context window max_model_len "
       "is 32 and at least one token must be generated"},
      {"id": "empty", "line": 3, "reason": "prompt: is an empty string"}]
  assert summary(proc.stderr)["invalid_records"] == 2

  # A larger window: the record rejected for its length is generated, the other reported again.
  proc, rows = run(tmp_path, lines, "--on_bad_record=skip", "--max_model_len=64")
  assert proc.returncode == 0, proc.stderr
  assert "2 records, 1 already in" in proc.stderr and "1 to generate (1 of them rejected" in (
      proc.stderr)
  assert [r["id"] for r in rows] == ["a", "long"] and rows[1]["token_ids"]
  assert read_rows(rejects) == [{"id": "empty", "line": 3, "reason": "prompt: is an empty string"}]
  assert summary(proc.stderr)["requests"] == 1

  proc, rows = run(tmp_path, lines, "--on_bad_record=skip", "--max_model_len=64")
  assert proc.returncode == 0, proc.stderr
  assert "2 records, 2 already in" in proc.stderr and "0 to generate" in proc.stderr
  assert [r["id"] for r in rows] == ["a", "long"]
  assert len(read_rows(rejects)) == 1


def test_a_rerun_with_other_settings_is_refused_or_started_over(tmp_path):
  lines = [json.dumps({"id": "a", "prompt": "Hello"})]
  proc, first = run(tmp_path, lines)
  assert proc.returncode == 0, proc.stderr
  proc, rows = run(tmp_path, lines, "--temperature=0.5", "--max_tokens=3",
                   "--model=/nonexistent/model", "--quantization=int8",
                   "--kernels=portable")  # refused before the model loads
  message = one_line(proc)
  assert rows == first
  for expected in ('model "', ' -> "/nonexistent/model"', "temperature 0.0 -> 0.5",
                   "max_tokens 4 -> 3", 'quantization null -> "int8"',
                   'kernels "auto" -> "portable"', f"delete {tmp_path / 'out.jsonl'} "
                   f"{tmp_path / 'out.jsonl.checkpoint.json'} or pass --overwrite",
                   "write to another --output"):
    assert expected in message, message

  proc, rows = run(tmp_path, lines, "--temperature=0.5", "--seed=3", "--overwrite")
  assert proc.returncode == 0, proc.stderr
  assert f"deleted {tmp_path / 'out.jsonl'}" in proc.stderr and "0 already in" in proc.stderr
  assert [r["id"] for r in rows] == ["a"]
  with open(tmp_path / "out.jsonl.checkpoint.json") as f:
    sampling = json.load(f)["settings"]["sampling"]
  assert (sampling["temperature"], sampling["seed"], sampling["max_tokens"]) == (0.5, 3, 4)
  proc, _ = run(tmp_path, lines, "--temperature=0.5", "--seed=4")
  assert "seed 3 -> 4" in one_line(proc)


def test_a_two_process_run_after_a_one_process_run_names_the_files_to_delete(tmp_path):
  from jaxtier.batch import reader as batch_input  # pylint: disable=g-import-not-at-top
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  src.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n")
  out.write_text("")  # as the README's main job leaves --output, with its checkpoint
  with batch_input.JsonlSource(str(src)) as source:
    batch_input.save_checkpoint(f"{out}.checkpoint.json",
                                batch_input.start_checkpoint(source, shard(0, 1), {}))
  stray = tmp_path / "out.jsonl.part-1-of-2.rejects.jsonl"
  stray.write_text("")
  proc = subprocess.run([sys.executable, SCRIPT, "--model=/nonexistent/model", f"--input={src}",
                         f"--output={out}", "--num_processes=2", "--process_id=0",
                         "--coordinator_address=localhost:1"],
                        capture_output=True, text=True, timeout=300)
  message = one_line(proc)
  assert "has checkpoints of a run with --num_processes=1, not 2" in message, message
  assert (f"delete {out} {out}.checkpoint.json {stray} or pass --overwrite") in message, message


def shard(index: int, count: int):
  import grain  # pylint: disable=g-import-not-at-top
  return grain.sharding.ShardOptions(shard_index=index, shard_count=count)


def test_invalid_records_are_reported_before_the_model_loads(tmp_path):
  lines = ["{not json", json.dumps({"prompt": "no id"}), json.dumps({"id": 1}),
           json.dumps({"id": 3, "prompt": "x"}), json.dumps({"id": 3, "prompt": "y"}),
           json.dumps({"id": 4, "prompt": ""}), json.dumps({"id": 5, "messages": []}),
           json.dumps({"id": 6, "prompt": None}), json.dumps({"id": 7, "prompt": 42}),
           json.dumps({"id": 8, "prompt": True}),
           json.dumps({"id": 9, "messages": [{"role": "robot", "content": "x"}]})]
  proc, rows = run(tmp_path, lines, "--model=/nonexistent/model")
  assert proc.returncode != 0 and rows == []
  assert not (tmp_path / "out.jsonl").exists()
  assert "Traceback" not in proc.stderr and "to generate" not in proc.stderr
  for expected in ("line 1: not valid JSON", "line 2: expected an object with an 'id'",
                   "line 3: expected exactly one of 'prompt' or 'messages'",
                   "line 5: duplicate id 3", "line 6: prompt: is an empty string",
                   "line 7: messages: List should have at least",
                   "line 8: prompt: expected a non-empty string", "line 9: prompt: expected",
                   "line 10: prompt: expected", "line 11: messages.0.role: Input should be"):
    assert expected in proc.stderr
  assert "line 4" not in proc.stderr


def test_token_ids_and_lengths_are_checked_before_generating(tmp_path):
  lines = [json.dumps({"id": "ok", "prompt": "Hello"}),
           json.dumps({"id": "oov", "prompt": [3, VOCAB_SIZE]}),
           json.dumps({"id": "long", "prompt": "Hello " * 20})]
  proc, rows = run(tmp_path, lines, "--max_model_len=16")
  assert proc.returncode != 0 and rows == []
  assert not (tmp_path / "out.jsonl").exists()
  assert f"line 2: prompt has token ids outside [0, {VOCAB_SIZE}): [{VOCAB_SIZE}]" in proc.stderr
  assert "line 3: prompt has" in proc.stderr and "max_model_len is 16" in proc.stderr


def test_flag_errors_are_one_line(tmp_path):
  for flag, message in (("--top_p=2", "--top_p=2.0: top_p must be in (0, 1]"),
                        ("--max_num_seqs=0", "max_num_seqs=0: ")):
    proc, rows = run(tmp_path, [json.dumps({"id": 1, "prompt": "x"})], flag)
    assert proc.returncode != 0 and rows == []
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("batch_infer.py: error: ") and message in proc.stderr, proc.stderr


def test_help_lists_the_engine_flags():
  proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                        timeout=300)
  for flag in ("--model", "--max_num_seqs", "--on_bad_record", "--max_tokens"):
    assert flag in proc.stdout, proc.stdout
  assert "--chunk_size" not in proc.stdout


def test_logit_flags_reach_the_sampling_params(tmp_path):
  import jaxtier
  lines = [json.dumps({"id": "a", "prompt": [5, 17, 17, 42, 9]}),
           json.dumps({"id": "b", "prompt": "Hello"})]
  flags = ("--max_tokens=6", "--repetition_penalty=1.3", "--frequency_penalty=0.5",
           "--presence_penalty=0.25", "--min_p=0.05", "--min_tokens=2", "--logit_bias=7=-100",
           "--logit_bias=11=4.5", "--bad_words=Hello")
  proc, rows = run(tmp_path, lines, *flags)
  assert proc.returncode == 0, proc.stderr
  llm = jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=64)
  params = jaxtier.SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3,
                                  frequency_penalty=0.5, presence_penalty=0.25, min_p=0.05,
                                  min_tokens=2, logit_bias={7: -100.0, 11: 4.5},
                                  bad_words=["Hello"])
  plain = jaxtier.SamplingParams(max_tokens=6, temperature=0)
  prompts = {json.loads(line)["id"]: json.loads(line)["prompt"] for line in lines}
  assert sorted(row["id"] for row in rows) == sorted(prompts)
  for row in rows:
    assert row["token_ids"] == list(llm.generate(prompts[row["id"]], params)[0].token_ids)
  assert any(row["token_ids"] != list(llm.generate(prompts[row["id"]], plain)[0].token_ids)
             for row in rows)


@pytest.mark.parametrize("flag, message", [
    ("--logit_bias=7", "expected TOKEN_ID=BIAS"),
    ("--allowed_token_ids=3,x", "expected comma-separated token ids"),
    ("--repetition_penalty=0", "repetition_penalty"),
    ("--min_tokens=9", "min_tokens"),
])
def test_bad_logit_flags_are_refused(tmp_path, flag, message):
  proc, _ = run(tmp_path, [json.dumps({"id": "a", "prompt": "Hello"})], flag)
  assert proc.returncode == 2, proc.stderr
  assert message in proc.stderr


def test_records_with_structured_outputs_follow_their_constraint(tmp_path):
  schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}}, "required": ["n"]}
  lines = [json.dumps({"id": "c", "prompt": "Hello", "structured_outputs": {
               "choice": ["yes", "no"]}}),
           json.dumps({"id": "j", "messages": [{"role": "user", "content": "hi"}],
                       "response_format": {"type": "json_schema", "json_schema": {
                           "name": "n", "schema": schema, "strict": True}}}),
           json.dumps({"id": "r", "prompt": "Hello", "structured_outputs": {"regex": "[a-c]{4}"}})]
  proc, rows = run(tmp_path, lines, "--max_tokens=30", "--temperature=0.8", "--seed=1")
  assert proc.returncode == 0, proc.stderr
  by_id = {row["id"]: row for row in rows}
  assert by_id["c"]["text"] in ("yes", "no")
  assert set(json.loads(by_id["j"]["text"])) == {"n"}
  assert len(by_id["r"]["text"]) == 4 and set(by_id["r"]["text"]) <= set("abc")
  assert all(row["finish_reason"] == "stop" for row in rows)


def test_a_second_run_reads_the_prompts_from_the_disk_tier_and_writes_the_same_rows(tmp_path):
  prompt = list(range(3, 120))
  lines = [json.dumps({"id": i, "prompt": prompt[:100 + i]}) for i in range(3)]
  disk = f"--kv_disk_path={tmp_path / 'kv'}"
  rows = []
  for run_dir in ("first", "second"):
    (tmp_path / run_dir).mkdir()
    proc, out = run(tmp_path / run_dir, lines, disk)
    assert proc.returncode == 0, proc.stderr
    rows.append(out)
    if run_dir == "first":
      assert summary(proc.stderr)["disk_hit_tokens"] == 0
      assert summary(proc.stderr)["disk_blocks_written"] > 0
  assert summary(proc.stderr)["disk_hit_tokens"] >= 96
  assert rows[0] == rows[1]
