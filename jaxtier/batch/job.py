"""The batch job's logic between its input and its files (`scripts/batch_infer.py`): what one
process generates, resuming and refusing reruns, writing each result as it finishes, and merging
the parts of a multi-process run.

- Settings. `job_settings` is what decides a record's tokens, as a checkpoint records it: every
  field of the job's `SamplingParams` and the engine arguments named in `OUTPUT_ENGINE_FLAGS`
  (the others size pools and batches, schedule, place and cache the same computation). The record
  with ordinal i samples with the job's seed + i (`record_sampling`).
- Refusal. `check_earlier_runs` reads the checkpoint of every process under --output, before the
  processes join, and raises `JobError` when this run cannot continue them: another
  --num_processes, an output file without its checkpoint, another or a changed input, other
  settings (named old -> new). The message names every file to delete to start over.
- Resume. `resume_point` and `plan_records` give what one process generates from its checkpoint
  on; `begin_output` cuts its output back to what the checkpoint counts, and `generate` appends
  each output line as its record finishes, then replaces the checkpoint.
- Merge. With several processes, process 0 merges the finished parts into --output in input order
  (`merge_parts`); `all_gather_json` carries the messages between the processes.

`JobError` covers every condition that stops the job for its data rather than its flags: the input
changed during the run, or the files of an earlier run do not fit this one.
"""

import dataclasses
import json
import os
import sys
import time
from typing import Any, NoReturn

import grain
import jinja2
import numpy as np
from tqdm import tqdm

from jaxtier.batch import files as batch_output, reader as batch_input
from jaxtier.engine import startup
from jaxtier.engine.args import EngineArgs
from jaxtier.llm import LLM
from jaxtier.sampling import SamplingParams
from jaxtier.server.records import BatchRecord, parse_record

# Engine arguments that change a record's tokens, recorded in the checkpoints and compared on a
# rerun. The others size pools and batches, schedule, place and cache the same computation.
OUTPUT_ENGINE_FLAGS = ("model", "dtype", "max_model_len", "kv_cache_dtype", "weight_format",
                       "block_activations", "quantization", "quantization_group_size", "kernels")
SUMMARY_STATS = ("swap_out_count", "swap_in_count", "swap_out_bytes", "swap_in_bytes",
                 "swap_seconds", "prefix_device_hit_rate", "prefix_host_hit_rate",
                 "disk_hit_tokens", "disk_blocks_written", "disk_corrupt_files")
SUMMED = ("requests", "prompt_tokens", "generated_tokens", "invalid_records", "swap_out_count",
          "swap_in_count", "swap_out_bytes", "swap_in_bytes", "swap_seconds", "disk_hit_tokens",
          "disk_blocks_written", "disk_corrupt_files")
MAX_REPORTED = 20


class JobError(Exception):
  """The job cannot go on with this input and these files; the message is one line to show."""


def json_number(value: Any) -> Any:
  """`json.dumps`'s `default` for numpy and JAX scalars: their Python value."""
  if hasattr(value, "item"):
    return value.item()
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


# Settings.


def record_sampling(job: SamplingParams, ordinal: int) -> SamplingParams:
  """The parameters of the record with `ordinal`: the job's, seeded with the job's seed +
  ordinal."""
  return job if job.seed is None else dataclasses.replace(job, seed=(job.seed + ordinal) % 2**32)


def job_settings(sampling: SamplingParams, engine: dict[str, Any]) -> dict[str, Any]:
  """What decides a record's output, as a checkpoint records it (JSON values): every field of the
  job's `SamplingParams` and the engine arguments (`jaxtier.LLM`'s keywords) in
  OUTPUT_ENGINE_FLAGS."""
  settings = {"sampling": dataclasses.asdict(sampling),
              "engine": {name: engine[name] for name in OUTPUT_ENGINE_FLAGS}}
  return json.loads(json.dumps(settings, default=json_number))


def setting_defaults() -> dict[str, Any]:
  """Every `SamplingParams` field and every engine argument of OUTPUT_ENGINE_FLAGS at its
  default (JSON values): the value of a setting that a checkpoint lacks because it was added to
  `SamplingParams` or to OUTPUT_ENGINE_FLAGS since (at its default, it computes as before)."""
  engine = {f.name: f.default for f in dataclasses.fields(EngineArgs)
            if f.name in OUTPUT_ENGINE_FLAGS and f.default is not dataclasses.MISSING}
  return json.loads(json.dumps({**engine, **dataclasses.asdict(SamplingParams())},
                               default=json_number))


# Records.


def check_records(source: batch_input.JsonlSource) -> tuple[dict[int, str], dict[int, str]]:
  """Reads every record of the input once, keeping only ids.

  Returns:
    ({ordinal: id key} of the valid records, {ordinal: problem} of the invalid and duplicate
    ones).
  """
  valid, keys, errors = {}, set(), {}
  for ordinal in range(len(source)):
    line = source[ordinal]
    try:
      record = parse_record(line.text)
    except ValueError as e:
      errors[ordinal] = str(e)
      continue
    if record.key in keys:
      errors[ordinal] = f"duplicate id {record.id!r}"
      continue
    keys.add(record.key)
    valid[ordinal] = record.key
  return valid, errors


def bad_record_listing(source: batch_input.JsonlSource, errors: dict[int, str]) -> str:
  """`errors` ({ordinal: problem}) by line number, one indented line each after a newline, at
  most MAX_REPORTED of them and then how many more there are."""
  shown = [f"line {source.line_number(ordinal)}: {problem}"
           for ordinal, problem in sorted(errors.items())]
  if len(shown) > MAX_REPORTED:
    shown[MAX_REPORTED:] = [f"... and {len(shown) - MAX_REPORTED} more"]
  return "".join(f"\n  {line}" for line in shown)


def parse_again(path: str, line: batch_input.InputLine) -> BatchRecord:
  """The record on a line checked before: an error now means the file changed (JobError)."""
  try:
    return parse_record(line.text)
  except ValueError as e:
    raise JobError(f"{path} changed during the run: line {line.number}: {e}") from None


def token_id_errors(llm: LLM, source: batch_input.JsonlSource,
                    todo: dict[int, int]) -> dict[int, str]:
  """Tokenizes every record to generate ({ordinal: line number}); returns {ordinal: problem} for
  those the engine rejects (token ids outside the vocabulary, prompts that leave no room in the
  context window, chat template errors)."""
  errors = {}
  for ordinal in todo:
    record = parse_again(source.path, source[ordinal])
    try:
      if record.messages is None:
        llm.prompt_token_ids(record.prompt)
      else:
        llm.chat_token_ids(record.conversation())
    except (ValueError, TypeError, jinja2.TemplateError) as e:
      errors[ordinal] = str(e).replace("prompt 0 ", "prompt ", 1)
  return errors


def input_fingerprint(path: str) -> tuple[int, int]:
  """The file's size and modification time: what `check_unchanged` compares."""
  stat = os.stat(path)
  return stat.st_size, stat.st_mtime_ns


def check_unchanged(path: str, fingerprint: tuple[int, int]) -> None:
  """Raises JobError if `path` was modified since it was checked: it is read again, not kept in
  memory."""
  if input_fingerprint(path) != fingerprint:
    raise JobError(f"{path} changed during the run; nothing more was generated")


# Processes.


def all_gather_json(value: Any, num_processes: int) -> list[Any]:
  """`value` (JSON) of every process, in process order; also a barrier. Two `process_allgather`s:
  the encoded lengths, then the bytes padded to the longest (uint8: no 64-bit JAX types needed)."""
  if num_processes == 1:
    return [value]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(json.dumps(value, default=json_number).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([len(data)], np.int32)).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  rows = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths)]


# Refusal.


def _refuse(output: str, problem: str, advice: str = "") -> NoReturn:
  """Raises JobError with `problem`, then every file of --output to delete to start over (or
  --overwrite)."""
  files = " ".join(batch_output.output_files(output))
  raise JobError(f"{problem}; {advice}to start over, delete {files} or pass --overwrite")


def check_earlier_runs(output: str, num_processes: int, source: batch_input.JsonlSource,
                       settings: dict[str, Any]) -> dict[int, batch_input.Checkpoint]:
  """The checkpoints of every process's files under `output`, by process; raises JobError when
  this run cannot continue them: checkpoints of another `num_processes` (their records would be
  generated again, and a merge would replace a one-process run's output), an output file without
  its checkpoint, a checkpoint of another input or changed outside this job, or other settings.
  Every process checks every part before they join, so all of them refuse together."""
  others = batch_output.process_counts(output) - {num_processes}
  if others:
    _refuse(output, f"--output={output} has checkpoints of a run with --num_processes="
            f"{' and '.join(map(str, sorted(others)))}, not {num_processes}",
            "rerun with that to resume it; ")
  checkpoints = {}
  for index in range(num_processes):
    paths = batch_output.output_paths(output, index, num_processes)
    try:
      checkpoint = batch_input.load_checkpoint(paths.checkpoint)
    except ValueError as e:
      _refuse(output, str(e))
    size = os.path.getsize(paths.records) if os.path.exists(paths.records) else 0
    if checkpoint is None:
      if size:
        _refuse(output, f"{paths.records} exists but has no checkpoint {paths.checkpoint}, so "
                "which of its records are complete is unknown")
      continue
    shard = grain.sharding.ShardOptions(shard_index=index, shard_count=num_processes)
    problem = batch_input.checkpoint_mismatch(checkpoint, source, shard)
    if problem:
      _refuse(output, f"{paths.checkpoint} does not fit --input={source.path}: {problem}")
    if size < checkpoint.output_bytes:
      _refuse(output, f"{paths.records} has {size} bytes, fewer than the "
              f"{checkpoint.output_bytes} its checkpoint {paths.checkpoint} counts: it was "
              "changed outside this job")
    if checkpoint.settings is None:
      _refuse(output, f"{paths.checkpoint} does not record the settings its records were "
              "generated with")
    checkpoints[index] = checkpoint
  check_settings(output, list(checkpoints.values()), settings)
  return checkpoints


def check_settings(output: str, checkpoints: list[batch_input.Checkpoint],
                   settings: dict[str, Any]) -> None:
  """Raises JobError naming the settings, old -> new, that differ from those the checkpoints'
  records were generated with. max_model_len may change while no record written came within the
  smaller window: a record stops with "length" only when it fills it, so their tokens are the
  same."""
  changes = {}
  for checkpoint in checkpoints:
    changes.update(batch_output.settings_changes(checkpoint.settings, settings,
                                                 setting_defaults()))
  old, new = changes.get("max_model_len", (None, None))
  longest = max((checkpoint.longest_context for checkpoint in checkpoints), default=0)
  if isinstance(old, int) and isinstance(new, int) and longest < min(old, new):
    del changes["max_model_len"]
  if changes:
    _refuse(output, f"--output={output} was generated with other settings: "
            f"{batch_output.describe_changes(changes)}",
            "rerun with the earlier settings to resume, or write to another --output; ")


# Resume.


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one process does: `todo` ({ordinal: line number}) the records to generate, `behind` those
  of them the shard's iterator does not read again (rejected by an earlier run behind its low-water
  mark; read by ordinal, first), `rejects` ({ordinal: reason}) the records it skips."""
  todo: dict[int, int]
  behind: frozenset[int]
  rejects: dict[int, str]

  def without(self, errors: dict[int, str]) -> "Plan":
    """This plan less the records in `errors` ({ordinal: problem}), which join its rejects."""
    return Plan({o: n for o, n in self.todo.items() if o not in errors},
                self.behind - set(errors), {**self.rejects, **errors})


def resume_point(source: batch_input.JsonlSource, shard: grain.sharding.ShardOptions,
                 earlier: dict[int, batch_input.Checkpoint],
                 settings: dict[str, Any]) -> batch_input.Checkpoint:
  """Where this process continues: its checkpoint (checked by `check_earlier_runs`), or the start
  of its shard; with this run's settings either way."""
  checkpoint = earlier.get(shard.shard_index) or batch_input.start_checkpoint(source, shard)
  return dataclasses.replace(checkpoint, settings=settings)


def plan_records(source: batch_input.JsonlSource, shard: grain.sharding.ShardOptions,
                 resume: batch_input.Checkpoint, valid: dict[int, str],
                 invalid: dict[int, str]) -> Plan:
  """The records to generate: the valid ones the shard's iterator still reads from `resume`, less
  those finished after its low-water mark, and the valid ones `resume` lists as rejected behind it
  (first). Rejects: the shard's invalid records (`invalid`: {ordinal: problem})."""
  finished = set(resume.finished_after)
  ahead = {line.ordinal: line.number
           for line in batch_input.shard_iterator(source, shard, resume.iterator_state)
           if line.ordinal in valid and line.ordinal not in finished}
  behind = {ordinal: source.line_number(ordinal) for ordinal in resume.rejected
            if ordinal in valid and ordinal not in ahead}
  mine = batch_input.shard_ordinals(len(source), shard)
  return Plan({**behind, **ahead}, frozenset(behind),
              {ordinal: problem for ordinal, problem in invalid.items() if ordinal in mine})


def begin_output(paths: batch_output.Paths, resume: batch_input.Checkpoint) -> int:
  """Makes the output file agree with `resume`: the checkpoint saved first (with this run's
  settings), then the file cut back to the bytes it counts. Returns how many bytes were cut
  (what a killed run wrote after its last checkpoint)."""
  batch_input.save_checkpoint(paths.checkpoint, resume)
  size = os.path.getsize(paths.records) if os.path.exists(paths.records) else 0
  if size <= resume.output_bytes:
    return 0
  with open(paths.records, "rb+") as f:
    f.truncate(resume.output_bytes)
    os.fsync(f.fileno())
  return size - resume.output_bytes


def write_rejects(path: str, source: batch_input.JsonlSource, rejects: dict[int, str]) -> None:
  """Writes this run's rejects ({ordinal: reason}) to `path` in input order, one
  {"id", "line", "reason"} a line; removes the file when there are none."""
  batch_output.write_lines(path, [
      {"id": batch_output.record_id(source[ordinal].text), "line": source.line_number(ordinal),
       "reason": reason} for ordinal, reason in sorted(rejects.items())])


def generate(llm: LLM | None, source: batch_input.JsonlSource, shard: grain.sharding.ShardOptions,
             resume: batch_input.Checkpoint, plan: Plan, paths: batch_output.Paths,
             sampling: SamplingParams, stop_after: int | None = None) -> dict[str, Any] | None:
  """Generates the plan's records, once `begin_output` made the files agree with `resume`: those
  behind the mark first, then the shard from `resume` on (records not in `plan.todo` are passed:
  invalid, or finished before), each with `sampling` seeded for its ordinal, appending each output
  line as its record finishes and then saving the checkpoint, whose `rejected` holds the records
  skipped and those behind not written yet. Returns the run's counts and seconds; None if it
  stopped after `stop_after` records, as a killed run would (no final checkpoint). `llm` is None
  only when `plan.todo` is empty."""
  progress = batch_input.Progress(resume.iterator_state, resume.finished_after)
  lines = batch_input.read_tracked(batch_input.shard_iterator(source, shard, resume.iterator_state),
                                   progress)
  rejected = set(plan.rejects) | plan.behind
  in_flight: dict[int, str | int] = {}
  output_bytes, longest = resume.output_bytes, resume.longest_context

  def save(complete: bool = False) -> None:
    state, finished_after = progress.position()
    batch_input.save_checkpoint(paths.checkpoint, dataclasses.replace(
        resume, input_bytes=source.size, input_sha256=source.sha256, iterator_state=state,
        finished_after=finished_after, output_bytes=output_bytes, complete=complete,
        rejected=tuple(sorted(rejected)), longest_context=longest))

  def request(line: batch_input.InputLine):
    record = parse_again(source.path, line)
    in_flight[line.ordinal] = record.id
    params = record_sampling(sampling, line.ordinal)
    if record.constraint() is not None:
      params = dataclasses.replace(params, structured_outputs=record.constraint())
    return line.ordinal, record.engine_input(), params

  def items():
    for ordinal in plan.todo:
      if ordinal in plan.behind:
        yield request(source[ordinal])
    for line in lines:
      if line.ordinal in plan.todo:
        yield request(line)
      else:
        progress.finish(line.ordinal)

  counts = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}
  start = time.perf_counter()
  # Without an engine there is nothing to generate: iterating `items()` only reads the shard.
  results = llm.generate_stream(items(), use_tqdm=False) if llm is not None else items()
  desc = "batch" if shard.shard_count == 1 else f"batch {shard.shard_index}/{shard.shard_count}"
  with open(paths.records, "ab") as out, tqdm(total=len(plan.todo), unit="record",
                                              desc=desc) as bar:
    for ordinal, result in results:
      data = (json.dumps({"id": in_flight.pop(ordinal), "text": result.text,
                          "token_ids": list(result.token_ids),
                          "finish_reason": result.finish_reason}) + "\n").encode()
      out.write(data)
      out.flush()
      os.fsync(out.fileno())
      output_bytes += len(data)
      longest = max(longest, len(result.prompt_token_ids) + len(result.token_ids))
      if ordinal in plan.behind:
        rejected.discard(ordinal)
      else:
        progress.finish(ordinal)
      save()
      if not counts["requests"] and llm is not None:  # ready: the first record is out
        figures = {**llm.engine.startup_figures(), "ready_seconds": startup.process_seconds()}
        print(f"{desc}: {startup.startup_line(figures)}", file=sys.stderr, flush=True)
      counts["requests"] += 1
      counts["prompt_tokens"] += len(result.prompt_token_ids)
      counts["generated_tokens"] += len(result.token_ids)
      bar.update(1)
      if counts["requests"] == stop_after:
        results.close()
        return None
  save(complete=True)
  return {**counts, "seconds": time.perf_counter() - start}


# Merge and summaries.


def merge_parts(output: str, num_processes: int, source: batch_input.JsonlSource,
                valid: dict[int, str]) -> tuple[int, int]:
  """Process 0, once every process is done: the records of every part in input order, written to
  `output` atomically, and their rejects to `<output>.rejects.jsonl`. Returns how many of each
  there are; raises JobError when a part is missing or unfinished."""
  ordinals = {key: ordinal for ordinal, key in valid.items()}
  rows = []
  for process_id in range(num_processes):
    paths = batch_output.output_paths(output, process_id, num_processes)
    try:
      checkpoint = batch_input.load_checkpoint(paths.checkpoint)
    except ValueError as e:
      raise JobError(str(e)) from None
    if checkpoint is None or not os.path.exists(paths.records):
      raise JobError(f"{paths.records} of process {process_id} is not here to merge: with "
                     "processes on several hosts, --output must be on a filesystem they share")
    if not checkpoint.complete or checkpoint.input_sha256 != source.sha256:
      raise JobError(f"{paths.records} of process {process_id} is not a finished part of "
                     f"--input={source.path}")
    with open(paths.records, "rb") as f:
      data = f.read(checkpoint.output_bytes)
    rows += [(ordinals[str(json.loads(line)["id"])], line) for line in data.splitlines()]
  rows.sort()
  temporary = f"{output}.tmp"
  with open(temporary, "wb") as f:
    f.writelines(line + b"\n" for _, line in rows)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, output)
  rejects = batch_output.merge_rejects(
      [batch_output.output_paths(output, i, num_processes).rejects for i in range(num_processes)],
      output + batch_output.REJECTS_SUFFIX)
  return len(rows), rejects


def summarize(run: dict[str, Any], invalid: int, stats: dict[str, Any]) -> dict[str, Any]:
  """One process's summary line: its counts, seconds, tokens/s, invalid records and engine stats."""
  seconds = run["seconds"]
  summary = {**run, "seconds": round(seconds, 3),
             "tokens_per_s": round(run["generated_tokens"] / seconds, 2) if seconds else 0.0,
             "invalid_records": invalid}
  summary.update((k, stats[k]) for k in SUMMARY_STATS if k in stats)
  return summary


def totals(summaries: list[dict[str, Any]]) -> dict[str, Any]:
  """Every process's summary added up; seconds are the slowest process's, so tokens/s is the
  run's."""
  total = {k: sum(s.get(k, 0) for s in summaries) for k in SUMMED}
  seconds = max(s["seconds"] for s in summaries)
  return {"processes": len(summaries), **total, "seconds": seconds,
          "tokens_per_s": round(total["generated_tokens"] / seconds, 2) if seconds else 0.0}
