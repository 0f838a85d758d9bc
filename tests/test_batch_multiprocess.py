"""scripts/batch_infer.py over two JAX processes on the tiny Llama, and its Grain checkpoints.

End to end: two processes (each its own shard and part, process 0 merging) give the records and
texts of a one-process run; a rerun on an input with records appended, and a run stopped after a
few records then started again, finish every record exactly once with the uninterrupted run's
texts. In process: `jaxtier.batch_input` (the data source, shards that partition the records, the
iterator state, the low-water mark, the checkpoint's fit to the input).
"""

import collections
import json
import os
import socket
import subprocess
import sys

import grain
import pytest

from conftest import fixture_path
from jaxtier import batch_input

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
SCRIPT = os.path.join(SCRIPTS, "batch_infer.py")
RECORDS = [{"id": "a", "prompt": "Hello"}, {"id": 1, "prompt": "The sea"},
           {"id": "c", "messages": [{"role": "user", "content": "hi"}]},
           {"id": "d", "prompt": [5, 17, 42]}, {"id": "e", "prompt": "Once upon"},
           {"id": 5, "prompt": "A cat"}, {"id": "g", "prompt": "Why is the sky"},
           {"id": "h", "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Name a color"}]},
           {"id": "i", "prompt": "In the morning"}, {"id": "j", "prompt": "My name is"}]
# The tiny model's first token for "The sea" (record 1) is "X": it stops there, before record 0.
FLAGS = (f"--model={fixture_path('tiny_llama')}", "--max_tokens=4", "--max_num_seqs=2", "--stop=X")
TIMEOUT_S = 240


def write_input(path, records) -> None:
  """One record a line, with a blank line after the second (blank lines are not records)."""
  lines = [json.dumps(r) for r in records]
  path.write_text("".join(line + "\n" + ("\n" if i == 1 else "") for i, line in enumerate(lines)))


def read_rows(path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def env() -> dict[str, str]:
  return {**os.environ, "JAX_PLATFORMS": "cpu"}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_one(src, out, *flags) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, SCRIPT, *FLAGS, f"--input={src}", f"--output={out}",
                         *flags], capture_output=True, text=True, timeout=TIMEOUT_S, env=env())


def run_two(tmp_path, src, out) -> list[str]:
  """Processes 0 and 1 of a two-process run at once; returns their stderr (both must succeed)."""
  address = f"--coordinator_address=localhost:{free_port()}"
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, "w") as f:
      procs.append(subprocess.Popen(
          [sys.executable, SCRIPT, *FLAGS, f"--input={src}", f"--output={out}",
           "--num_processes=2", f"--process_id={i}", address], stderr=f, env=env()))
  try:
    codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  stderr = [log.read_text() for log in logs]
  assert codes == [0, 0], stderr
  return stderr


def summary(stderr: str, prefix: str = "summary: ") -> dict:
  lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
  assert len(lines) == 1, stderr
  return json.loads(lines[0].removeprefix(prefix))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
  """{id: output row} of an uninterrupted one-process run over RECORDS."""
  tmp = tmp_path_factory.mktemp("reference")
  write_input(tmp / "in.jsonl", RECORDS)
  proc = run_one(tmp / "in.jsonl", tmp / "out.jsonl")
  assert proc.returncode == 0, proc.stderr
  rows = read_rows(tmp / "out.jsonl")
  assert len(rows) == len(RECORDS)
  return {r["id"]: r for r in rows}


def test_two_processes_match_one_and_resume_an_appended_input(tmp_path, reference):
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  first = RECORDS[:6]
  write_input(src, first)
  stderr = run_two(tmp_path, src, out)
  assert read_rows(out) == [reference[r["id"]] for r in first]  # merged in input order
  for i in range(2):  # each process generated its own shard only: records i, i + 2, ...
    part = read_rows(tmp_path / f"out.jsonl.part-{i}-of-2")
    assert sorted(str(r["id"]) for r in part) == sorted(str(r["id"]) for r in first[i::2])
    assert summary(stderr[i])["requests"] == len(first[i::2])
  assert summary(stderr[0], "totals: ")["requests"] == len(first)
  assert "totals: " not in stderr[1]

  # Records appended; process 1 was killed after writing a line but before its checkpoint.
  write_input(src, RECORDS)
  with open(tmp_path / "out.jsonl.part-1-of-2", "a") as part:
    part.write(json.dumps(reference[RECORDS[7]["id"]]) + "\n" + '{"id": "h", "te')
  stderr = run_two(tmp_path, src, out)
  assert read_rows(out) == [reference[r["id"]] for r in RECORDS]
  assert "after its last checkpoint" in stderr[1]
  assert [summary(s)["requests"] for s in stderr] == [2, 2]
  assert summary(stderr[0], "totals: ")["requests"] == len(RECORDS) - len(first)


STOPPED_RUN = """
import sys
sys.path.insert(0, {scripts!r})
sys.argv = [{script!r}, *{argv!r}]
from absl import app
import batch_infer
app.run(lambda argv: batch_infer.main(argv, stop_after={stop_after}),
        flags_parser=batch_infer.parse_flags)
"""


def test_a_stopped_run_resumes_from_its_checkpoint(tmp_path, reference):
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_input(src, RECORDS)
  argv = [*FLAGS, f"--input={src}", f"--output={out}"]
  program = STOPPED_RUN.format(scripts=SCRIPTS, script=SCRIPT, argv=argv, stop_after=1)
  proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                        timeout=TIMEOUT_S, env=env())
  assert proc.returncode == 0, proc.stderr
  assert "summary: " not in proc.stderr  # stopped as if killed, records 0, 2, 3 in the engine
  assert [r["id"] for r in read_rows(out)] == [1] and reference[1]["finish_reason"] == "stop"
  checkpoint = batch_input.load_checkpoint(f"{out}.checkpoint.json")
  assert checkpoint.finished_after == (1,) and not checkpoint.complete  # finished beyond the mark
  assert checkpoint.output_bytes == os.path.getsize(out)

  proc = run_one(src, out)
  assert proc.returncode == 0, proc.stderr
  assert f"{len(RECORDS)} records, 1 already in" in proc.stderr
  assert summary(proc.stderr)["requests"] == len(RECORDS) - 1
  rows = read_rows(out)
  assert collections.Counter(str(r["id"]) for r in rows) == {str(r["id"]): 1 for r in RECORDS}
  assert {r["id"]: r for r in rows} == reference


def test_process_flag_errors_are_one_line(tmp_path):
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_input(src, RECORDS[:2])
  for flags, message in ((["--num_processes=2"], "--process_id is required"),
                         (["--num_processes=2", "--process_id=2"], "--process_id=2: must be in"),
                         (["--num_processes=2", "--process_id=1"], "--coordinator_address is "
                          "required")):
    proc = run_one(src, out, *flags)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("batch_infer.py: error: ") and message in proc.stderr


def test_an_output_without_its_checkpoint_or_of_another_process_count_is_refused(tmp_path):
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_input(src, RECORDS[:2])
  out.write_text('{"id": "a", "text": "x", "token_ids": [1], "finish_reason": "stop"}\n')
  proc = run_one(src, out, "--model=/nonexistent/model")  # both fail before the model loads
  assert proc.returncode == 1 and "has no checkpoint" in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr

  with batch_input.JsonlSource(str(src)) as source:  # as a two-process run leaves it
    batch_input.save_checkpoint(f"{out}.part-1-of-2.checkpoint.json",
                                batch_input.start_checkpoint(source, shard(1, 2)))
  proc = run_one(src, out, "--model=/nonexistent/model", "--num_processes=3", "--process_id=0",
                 "--coordinator_address=localhost:1")
  assert proc.returncode == 1, proc.stderr
  assert "has checkpoints of a run with --num_processes=2" in proc.stderr, proc.stderr


# --- jaxtier.batch_input in process ---------------------------------------------------------------

def shard(index: int, count: int) -> grain.sharding.ShardOptions:
  return grain.sharding.ShardOptions(shard_index=index, shard_count=count)


def test_source_has_the_non_blank_lines(tmp_path):
  text = 'one\n\n  \t\ntwo\r\n\u00a0\n{"é": 3}\n\nlast'  # the last line has no newline
  path = tmp_path / "in.jsonl"
  path.write_bytes(text.encode())
  expected = [(n, line.rstrip("\r")) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
  with batch_input.JsonlSource(str(path)) as source:
    assert len(source) == 4 and source.size == len(text.encode())
    assert [(line.number, line.text.rstrip("\r")) for line in source] == expected
    assert [line.ordinal for line in source] == [0, 1, 2, 3]
    assert source[-1] == source[3] == batch_input.InputLine(8, 3, "last")


def test_shards_partition_the_records_in_input_order(tmp_path):
  for num_records in (0, 1, 7):
    path = tmp_path / f"in{num_records}.jsonl"
    path.write_text("".join(f"{i}\n" for i in range(num_records)))
    with batch_input.JsonlSource(str(path)) as source:
      for count in (1, 2, 3):
        shards = [[line.ordinal for line in batch_input.shard_iterator(source, shard(i, count))]
                  for i in range(count)]
        assert sorted(sum(shards, [])) == list(range(num_records))
        for i, ordinals in enumerate(shards):
          assert ordinals == list(batch_input.shard_ordinals(num_records, shard(i, count)))
          assert ordinals == sorted(ordinals)


def test_iterator_state_round_trips(tmp_path):
  path = tmp_path / "in.jsonl"
  path.write_text("".join(f"{i}\n" for i in range(9)))
  with batch_input.JsonlSource(str(path)) as source:
    iterator = batch_input.shard_iterator(source, shard(1, 2))
    assert [next(iterator).text for _ in range(2)] == ["1", "3"]
    state = json.loads(json.dumps(iterator.get_state()))
    assert [line.text for line in batch_input.shard_iterator(source, shard(1, 2), state)] == [
        "5", "7"]
    assert [line.text for line in iterator] == ["5", "7"]


def test_progress_keeps_the_low_water_mark_and_what_finished_after_it(tmp_path):
  path = tmp_path / "in.jsonl"
  path.write_text("".join(f"{i}\n" for i in range(8)))
  with batch_input.JsonlSource(str(path)) as source:
    iterator = batch_input.shard_iterator(source, shard(0, 2))
    start = iterator.get_state()
    progress = batch_input.Progress(start)
    lines = batch_input.read_tracked(iterator, progress)
    assert [next(lines).ordinal for _ in range(3)] == [0, 2, 4]
    progress.finish(4)  # out of input order
    progress.finish(2)
    state, finished_after = progress.position()
    assert state == start and finished_after == (2, 4)

    # A restart reads from the mark and skips (finishes at once) what finished after it.
    resumed = batch_input.Progress(state, finished_after)
    lines = batch_input.read_tracked(batch_input.shard_iterator(source, shard(0, 2), state),
                                     resumed)
    assert next(lines).ordinal == 0
    state, finished_after = resumed.position()  # 2 and 4 are not read again yet: still kept
    assert state == start and finished_after == (2, 4)
    assert next(lines).ordinal == 2
    resumed.finish(2)
    resumed.finish(0)
    state, finished_after = resumed.position()  # 0 and 2 are under the mark now
    assert finished_after == (4,)
    assert [line.ordinal for line in batch_input.shard_iterator(source, shard(0, 2), state)] == [
        4, 6]
    assert [line.ordinal for line in lines] == [4, 6]
    resumed.finish(4)
    resumed.finish(6)
    state, finished_after = resumed.position()
    assert finished_after == ()
    assert list(batch_input.shard_iterator(source, shard(0, 2), state)) == []

    # One shard: the record right after the last one read was finished before the restart.
    iterator = batch_input.shard_iterator(source, shard(0, 1))
    progress = batch_input.Progress(iterator.get_state(), finished_after=(1, 3))
    lines = batch_input.read_tracked(iterator, progress)
    assert next(lines).ordinal == 0
    progress.finish(0)
    state, finished_after = progress.position()
    assert finished_after == (1, 3)
    assert next(batch_input.shard_iterator(source, shard(0, 1), state)).ordinal == 1


def test_checkpoint_fits_the_same_shard_of_the_input_or_an_appended_one(tmp_path):
  path = tmp_path / "in.jsonl"
  path.write_text("a\nb")
  with batch_input.JsonlSource(str(path)) as source:
    checkpoint = batch_input.start_checkpoint(source, shard(0, 2))
    assert batch_input.checkpoint_mismatch(checkpoint, source, shard(0, 2)) is None
    assert "process 0 of 2" in batch_input.checkpoint_mismatch(checkpoint, source, shard(1, 2))
  for text, fits in (("a\nb", True), ("a\nb\nc\n", True), ("a\nbc\n", False), ("a\nB\nc", False),
                     ("a\n", False)):
    path.write_text(text)
    with batch_input.JsonlSource(str(path)) as source:
      assert (batch_input.checkpoint_mismatch(checkpoint, source, shard(0, 2)) is None) == fits

  saved = tmp_path / "checkpoint.json"
  batch_input.save_checkpoint(str(saved), checkpoint)
  assert batch_input.load_checkpoint(str(saved)) == checkpoint
  assert batch_input.load_checkpoint(str(tmp_path / "none.json")) is None
  saved.write_text('{"shard_index": 0}')
  with pytest.raises(ValueError, match="is not a checkpoint"):
    batch_input.load_checkpoint(str(saved))
