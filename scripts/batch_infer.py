"""Batch inference: JSONL in, JSONL out, each result written as soon as it finishes; rerunning
resumes where it stopped; several JAX processes can share the input, data parallel.

Each input line is {"id": ..., "prompt": ...} or {"id": ..., "messages": [{"role", "content"}...]},
optionally with "structured_outputs" (vLLM's) or "response_format" (OpenAI's) constraining its text,
checked by the rules of the HTTP server (`jaxtier.server.records`) before the model loads (every
process checks the whole file); token ids and prompt lengths are checked for every record to
generate once the tokenizer is loaded, before anything is generated (--on_bad_record says whether
an invalid record stops the run or is skipped). Each output line is {"id", "text", "token_ids",
"finish_reason"}, appended and synced to disk when its record finishes (records finish out of input
order). Skipped records are listed in `<output>.rejects.jsonl` ({"id", "line", "reason"}) and
checked again by the next run, which generates those that are valid then (e.g. under a larger
--max_model_len); the file is rewritten to what is still rejected, removed when nothing is.

Input: `jaxtier.batch.reader`, a Grain data source over the file's non-blank lines. With
--num_processes=N, process i takes records i, i + N, i + 2N, ... (a Grain iterator sharded by JAX
process) and runs its own engine on its own local devices.

Output: with one process, --output, in finish order. With N processes, process i writes
`<output>.part-<i>-of-<N>`; once every process is done, process 0 merges the parts into --output
in input order: the records and texts of a one-process run (on several hosts, --output must be on
a filesystem they share).

Resume: beside each output file is `<file>.checkpoint.json`, replaced atomically after every
record written: the Grain iterator state at the low-water mark (every record read before it is
written), the records finished after it, the records rejected, and the file's length then, with the
settings the records were generated with (every `SamplingParams` field and the engine flags that
change tokens, `OUTPUT_ENGINE_FLAGS`). Started again with the same flags, a process cuts its file
back to that length, restores the iterator and skips the finished records, so a killed run neither
redoes finished records nor writes duplicates. Records appended to the input since are generated
too. A run refuses to start, with one line naming every file to delete, when the input changed in
any other way, --num_processes or the settings differ (it names the settings, old -> new), or an
output file has no checkpoint; --overwrite deletes those files and starts over.

The last line on stderr is `summary: {...}` (JSON), one per process; with N processes, process 0
then prints `totals: {...}` over all of them, and each process writes its own part of
--stats_json and --trace_path.

  python scripts/batch_infer.py --input=examples/prompts.jsonl --output=out.jsonl
  python scripts/batch_infer.py --input=examples/prompts.jsonl --output=out.jsonl \\
      --num_processes=2 --process_id=0 --coordinator_address=localhost:12345  # and process_id=1
"""

import dataclasses
import json
import os
import sys
import time
from typing import Any, NoReturn

from absl import app, flags
import grain
import jinja2
import numpy as np
from tqdm import tqdm

import jaxtier
from jaxtier.batch import reader as batch_input, files as batch_output
from jaxtier.engine import flags as engine_flags
from jaxtier.server.records import BatchRecord, parse_record

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "input JSONL file", required=True)
flags.DEFINE_string("output", None, "output JSONL file (appended to and resumed from its "
                    "checkpoint, <output>.checkpoint.json; with --num_processes > 1, written by "
                    "process 0 from the processes' parts at the end)", required=True)
flags.DEFINE_enum("on_bad_record", "fail", ["fail", "skip"], "what an invalid record does: 'fail' "
                  "reports the invalid records and exits before generating anything; 'skip' "
                  "reports them and generates the others")
flags.DEFINE_string("stats_json", None, "optional file written at the end with the engine's "
                    "statistics (`LLM.stats()`), where the engine provides them (with "
                    "--num_processes > 1, one per process: <stats_json>.part-<i>-of-<n>)")
flags.DEFINE_integer("max_tokens", 64, "maximum generated tokens per record")
flags.DEFINE_float("temperature", 0.0, "sampling temperature; 0 is greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
flags.DEFINE_integer("top_k", -1, "top-k sampling; <= 0 disables it")
flags.DEFINE_integer("seed", None, "sampling seed; the record on the i-th non-blank input line "
                     "(from 0) uses seed + i")
flags.DEFINE_multi_string("stop", [], "stop string (repeat the flag for several)")
flags.DEFINE_float("repetition_penalty", 1.0, "divides positive (multiplies negative) logits of "
                   "tokens in the prompt or the output so far (Hugging Face's and vLLM's); 1 is off")
flags.DEFINE_float("frequency_penalty", 0.0, "subtracted from a token's logit once per time it was "
                   "generated (OpenAI's), in [-2, 2]")
flags.DEFINE_float("presence_penalty", 0.0, "subtracted from the logit of every token generated at "
                   "least once (OpenAI's), in [-2, 2]")
flags.DEFINE_float("min_p", 0.0, "drops tokens less likely than min_p times the most likely one, in "
                   "[0, 1]; 0 is off")
flags.DEFINE_integer("min_tokens", 0, "end-of-sequence and stop token ids are masked until this "
                     "many tokens were generated")
flags.DEFINE_multi_string("logit_bias", [], "TOKEN_ID=BIAS added to that token's logit, clamped to "
                          "[-100, 100] (repeat the flag for several)")
flags.DEFINE_list("allowed_token_ids", None, "comma-separated token ids: only these may be "
                  "generated")
flags.DEFINE_multi_string("bad_words", [], "a word never generated (vLLM's bad_words; repeat the "
                          "flag for several)")
flags.DEFINE_integer("num_processes", 1, "JAX processes sharing the input, data parallel: process "
                     "i generates records i, i + num_processes, ... on its local devices")
flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes); required "
                     "when --num_processes > 1")
flags.DEFINE_string("coordinator_address", None, "host:port where process 0 serves JAX's "
                    "coordination service (e.g. localhost:12345); required when "
                    "--num_processes > 1")
flags.DEFINE_bool("overwrite", False, "delete --output and every file of an earlier run beside it "
                  "(checkpoints, rejects, part files) and start over, instead of resuming")
flags.adopt_module_key_flags(engine_flags)

PROG = os.path.basename(sys.argv[0])
# Flags named as the `SamplingParams` fields they set (--seed is per record: `record_sampling`).
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "stop", "repetition_penalty",
                  "frequency_penalty", "presence_penalty", "min_p", "min_tokens", "logit_bias",
                  "allowed_token_ids", "bad_words")
# Engine flags that change a record's tokens, recorded in the checkpoints and compared on a rerun.
# The others size pools and batches, schedule, place and cache the same computation.
OUTPUT_ENGINE_FLAGS = ("model", "dtype", "max_model_len", "kv_cache_dtype", "weight_format",
                       "block_activations")
SUMMARY_STATS = ("swap_out_count", "swap_in_count", "swap_out_bytes", "swap_in_bytes", "swap_seconds",
              "prefix_device_hit_rate", "prefix_host_hit_rate")
SUMMED = ("requests", "prompt_tokens", "generated_tokens", "invalid_records", "swap_out_count",
          "swap_in_count", "swap_out_bytes", "swap_in_bytes", "swap_seconds")
MAX_REPORTED = 20


def fail(message: str) -> NoReturn:
  """Exits with one `batch_infer.py: error: ...` message and status 1 (bad input data); flag errors
  go through `engine_flags.usage_error` (status 2)."""
  sys.exit(f"{PROG}: error: {message}")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, with a bad flag reported in one line instead of a usage text."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    engine_flags.usage_error(str(e).removeprefix("flag "))


def check_sampling_flags() -> None:
  """Ends the script with one line naming the first sampling flag out of range (given on the command
  line or by --config)."""
  for name in SAMPLING_FLAGS:
    try:
      # min_tokens is bounded by max_tokens, whose own check comes first.
      paired = {"max_tokens": max(FLAGS.max_tokens, 1)} if name == "min_tokens" else {}
      jaxtier.SamplingParams(**{name: sampling_flag(name)}, **paired)
    except ValueError as e:
      engine_flags.usage_error(f"--{name}={FLAGS[name].value}: {e}")
  try:
    job_sampling()
  except ValueError as e:
    engine_flags.usage_error(str(e))


def check_process_flags() -> None:
  """Ends the script with one line if --num_processes, --process_id or --coordinator_address do not
  describe one process of a run."""
  count, index = FLAGS.num_processes, FLAGS.process_id
  if count < 1:
    engine_flags.usage_error(f"--num_processes={count}: must be >= 1")
  if count > 1 and index is None:
    engine_flags.usage_error(f"--process_id is required with --num_processes={count}")
  if index is not None and not 0 <= index < count:
    engine_flags.usage_error(f"--process_id={index}: must be in [0, {count}) "
                             f"(--num_processes={count})")
  if count > 1 and not FLAGS.coordinator_address:
    engine_flags.usage_error(f"--coordinator_address is required with --num_processes={count} "
                             "(host:port of process 0, e.g. localhost:12345)")


def _logit_bias(values: list[str]) -> dict[int, float] | None:
  """--logit_bias values (`TOKEN_ID=BIAS`) as a dict, or ValueError naming the bad one."""
  bias = {}
  for value in values:
    token, _, amount = value.partition("=")
    try:
      bias[int(token)] = float(amount)
    except ValueError:
      raise ValueError(f"expected TOKEN_ID=BIAS (e.g. 504=-100), got {value!r}") from None
  return bias or None


def sampling_flag(name: str) -> Any:
  """The value of sampling flag `name` as its `SamplingParams` field takes it."""
  value = FLAGS[name].value
  if name == "logit_bias":
    return _logit_bias(value)
  if name == "allowed_token_ids" and value is not None:
    try:
      return [int(v) for v in value]
    except ValueError:
      raise ValueError(f"expected comma-separated token ids, got {','.join(value)!r}") from None
  return value


def job_sampling() -> jaxtier.SamplingParams:
  """The sampling flags as the job's `SamplingParams` (the one place flags map to fields); its seed
  is --seed, which record i adds i to (`record_sampling`)."""
  seed = None if FLAGS.seed is None else FLAGS.seed % 2**32
  return jaxtier.SamplingParams(**{name: sampling_flag(name) for name in SAMPLING_FLAGS}, seed=seed)


def record_sampling(job: jaxtier.SamplingParams, ordinal: int) -> jaxtier.SamplingParams:
  """The parameters of the record with `ordinal`: the job's, seeded with --seed + ordinal."""
  return job if job.seed is None else dataclasses.replace(job, seed=(job.seed + ordinal) % 2**32)


def job_settings(sampling: jaxtier.SamplingParams) -> dict[str, Any]:
  """What decides a record's output, as a checkpoint records it (JSON values): every field of the
  job's `SamplingParams` and the engine flags in OUTPUT_ENGINE_FLAGS."""
  engine = engine_flags.llm_kwargs()
  settings = {"sampling": dataclasses.asdict(sampling),
              "engine": {name: engine[name] for name in OUTPUT_ENGINE_FLAGS}}
  return json.loads(json.dumps(settings, default=_json_number))


def sampling_defaults() -> dict[str, Any]:
  """Every `SamplingParams` field at its default (JSON values): the value of a field that a
  checkpoint's settings lack because the field was added to `SamplingParams` since."""
  return json.loads(json.dumps(dataclasses.asdict(jaxtier.SamplingParams()),
                               default=_json_number))


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


def handle_bad_records(source: batch_input.JsonlSource, errors: dict[int, str],
                       when: str) -> None:
  """Exits listing `errors` ({ordinal: problem}) by line number under --on_bad_record=fail; lists
  them on stderr under skip."""
  if not errors:
    return
  shown = [f"line {source.line_number(ordinal)}: {problem}"
           for ordinal, problem in sorted(errors.items())]
  if len(shown) > MAX_REPORTED:
    shown[MAX_REPORTED:] = [f"... and {len(shown) - MAX_REPORTED} more"]
  listing = "".join(f"\n  {line}" for line in shown)
  if FLAGS.on_bad_record == "fail":
    fail(f"{source.path}: {len(errors)} invalid record(s) {when}; nothing was generated "
         f"(--on_bad_record=skip generates the others):{listing}")
  print(f"{PROG}: skipping {len(errors)} invalid record(s) of {source.path} {when}:{listing}",
        file=sys.stderr)


def start_processes() -> grain.sharding.ShardOptions:
  """This process's shard of the input. With --num_processes > 1 it first joins the other processes
  (`jax.distributed.initialize`, before anything touches JAX devices); its shard is then that of
  its JAX process (`ShardByJaxProcess`), and its engine uses `jax.local_devices()`."""
  if FLAGS.num_processes == 1:
    return grain.sharding.NoSharding()
  import jax  # pylint: disable=g-import-not-at-top  (JAX loads only once a script runs)
  try:
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                               num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
  except (RuntimeError, ValueError) as e:
    fail(f"--coordinator_address={FLAGS.coordinator_address}: could not join the other "
         f"processes: {str(e).strip().splitlines()[0]}")
  return grain.sharding.ShardByJaxProcess()


def all_gather_json(value: Any) -> list[Any]:
  """`value` (JSON) of every process, in process order; also a barrier. Two `process_allgather`s:
  the encoded lengths, then the bytes padded to the longest (uint8: no 64-bit JAX types needed)."""
  if FLAGS.num_processes == 1:
    return [value]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(json.dumps(value, default=_json_number).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([len(data)], np.int32)).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  rows = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths)]


def process_label(shard: grain.sharding.ShardOptions) -> str:
  """'process i of n: ' before a process's messages when there are several, else ''."""
  return "" if shard.shard_count == 1 else f"process {shard.shard_index} of {shard.shard_count}: "


def llm_kwargs(shard: grain.sharding.ShardOptions) -> dict[str, Any]:
  """The engine's arguments; with several processes each appends its own --trace_path part."""
  kwargs = engine_flags.llm_kwargs()
  if kwargs.get("trace_path"):
    kwargs["trace_path"] = batch_output.part_path(kwargs["trace_path"], shard.shard_index,
                                                  shard.shard_count)
  return kwargs


def refuse(problem: str, advice: str = "") -> NoReturn:
  """Exits with `problem`, then every file of --output to delete to start over (or --overwrite)."""
  files = " ".join(batch_output.output_files(FLAGS.output))
  fail(f"{problem}; {advice}to start over, delete {files} or pass --overwrite")


def check_earlier_runs(source: batch_input.JsonlSource,
                       settings: dict[str, Any]) -> dict[int, batch_input.Checkpoint]:
  """The checkpoints of every process's files under --output, by process; exits (`refuse`) when
  this run cannot continue them: checkpoints of another --num_processes (their records would be
  generated again, and a merge would replace a one-process run's output), an output file without
  its checkpoint, a checkpoint of another input or changed outside this job, or other settings.
  Every process checks every part before they join, so all of them refuse together."""
  output, count = FLAGS.output, FLAGS.num_processes
  others = batch_output.process_counts(output) - {count}
  if others:
    refuse(f"--output={output} has checkpoints of a run with --num_processes="
           f"{' and '.join(map(str, sorted(others)))}, not {count}",
           "rerun with that to resume it; ")
  checkpoints = {}
  for index in range(count):
    paths = batch_output.output_paths(output, index, count)
    try:
      checkpoint = batch_input.load_checkpoint(paths.checkpoint)
    except ValueError as e:
      refuse(str(e))
    size = os.path.getsize(paths.records) if os.path.exists(paths.records) else 0
    if checkpoint is None:
      if size:
        refuse(f"{paths.records} exists but has no checkpoint {paths.checkpoint}, so which of its "
               "records are complete is unknown")
      continue
    shard = grain.sharding.ShardOptions(shard_index=index, shard_count=count)
    problem = batch_input.checkpoint_mismatch(checkpoint, source, shard)
    if problem:
      refuse(f"{paths.checkpoint} does not fit --input={source.path}: {problem}")
    if size < checkpoint.output_bytes:
      refuse(f"{paths.records} has {size} bytes, fewer than the {checkpoint.output_bytes} its "
             f"checkpoint {paths.checkpoint} counts: it was changed outside this job")
    if checkpoint.settings is None:
      refuse(f"{paths.checkpoint} does not record the settings its records were generated with")
    checkpoints[index] = checkpoint
  check_settings(list(checkpoints.values()), settings)
  return checkpoints


def check_settings(checkpoints: list[batch_input.Checkpoint], settings: dict[str, Any]) -> None:
  """Exits (`refuse`) naming the settings, old -> new, that differ from those the checkpoints'
  records were generated with. max_model_len may change while no record written came within the
  smaller window: a record stops with "length" only when it fills it, so their tokens are the
  same."""
  changes = {}
  for checkpoint in checkpoints:
    changes.update(batch_output.settings_changes(checkpoint.settings, settings,
                                                 sampling_defaults()))
  old, new = changes.get("max_model_len", (None, None))
  longest = max((checkpoint.longest_context for checkpoint in checkpoints), default=0)
  if isinstance(old, int) and isinstance(new, int) and longest < min(old, new):
    del changes["max_model_len"]
  if changes:
    refuse(f"--output={FLAGS.output} was generated with other settings: "
           f"{batch_output.describe_changes(changes)}",
           "rerun with the earlier settings to resume, or write to another --output; ")


def start_over(shard: grain.sharding.ShardOptions) -> None:
  """--overwrite: process 0 deletes every file of --output; every process waits for it."""
  if shard.shard_index == 0:
    for path in batch_output.output_files(FLAGS.output):
      os.remove(path)
      print(f"{PROG}: --overwrite: deleted {path}", file=sys.stderr)
  all_gather_json(None)


def begin_output(paths: batch_output.Paths, resume: batch_input.Checkpoint) -> None:
  """Makes the output file agree with `resume`: the checkpoint saved first (with this run's
  settings), then the file cut back to the bytes it counts (what a killed run wrote after it)."""
  batch_input.save_checkpoint(paths.checkpoint, resume)
  if os.path.exists(paths.records) and os.path.getsize(paths.records) > resume.output_bytes:
    print(f"{PROG}: removing {os.path.getsize(paths.records) - resume.output_bytes} bytes written "
          f"to {paths.records} after its last checkpoint", file=sys.stderr)
    with open(paths.records, "rb+") as f:
      f.truncate(resume.output_bytes)
      os.fsync(f.fileno())


def write_rejects(path: str, source: batch_input.JsonlSource, rejects: dict[int, str]) -> None:
  """Writes this run's rejects ({ordinal: reason}) to `path` in input order, one
  {"id", "line", "reason"} a line; removes the file when there are none."""
  batch_output.write_lines(path, [
      {"id": batch_output.record_id(source[ordinal].text), "line": source.line_number(ordinal),
       "reason": reason} for ordinal, reason in sorted(rejects.items())])


def parse_again(path: str, line: batch_input.InputLine) -> BatchRecord:
  """The record on a line checked before: an error now means the file changed."""
  try:
    return parse_record(line.text)
  except ValueError as e:
    fail(f"{path} changed during the run: line {line.number}: {e}")


def token_id_errors(llm: jaxtier.LLM, source: batch_input.JsonlSource,
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
  stat = os.stat(path)
  return stat.st_size, stat.st_mtime_ns


def check_unchanged(path: str, fingerprint: tuple[int, int]) -> None:
  """Exits if `path` was modified since it was checked: it is read again, not kept in memory."""
  if input_fingerprint(path) != fingerprint:
    fail(f"{path} changed during the run; nothing more was generated")


def write_stats(llm: jaxtier.LLM | None, path: str | None) -> dict[str, Any]:
  """`llm.stats()` (written to `path`, this process's --stats_json, when given), or {} where the
  engine has none."""
  if llm is None or not hasattr(llm, "stats"):
    if path:
      print(f"{PROG}: no engine statistics to write to --stats_json={path}", file=sys.stderr)
    return {}
  stats = llm.stats()
  if path:
    with open(path, "w") as f:
      json.dump(stats, f, indent=1, default=_json_number)
      f.write("\n")
  return stats


def _json_number(value: Any) -> Any:
  if hasattr(value, "item"):
    return value.item()
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one process does: `todo` ({ordinal: line number}) the records to generate, `behind` those
  of them the shard's iterator does not read again (rejected by an earlier run behind its low-water
  mark; read by ordinal, first), `rejects` ({ordinal: reason}) the records it skips."""
  todo: dict[int, int]
  behind: frozenset[int]
  rejects: dict[int, str]


def generate(llm: jaxtier.LLM | None, source: batch_input.JsonlSource,
             shard: grain.sharding.ShardOptions, resume: batch_input.Checkpoint, plan: Plan,
             paths: batch_output.Paths, stop_after: int | None = None) -> dict[str, Any] | None:
  """Generates the plan's records: those behind the mark first, then the shard from `resume` on
  (records not in `plan.todo` are passed: invalid, or finished before), appending each output
  line as its record finishes and then saving the checkpoint, whose `rejected` holds the records
  skipped and those behind not written yet. Returns the run's counts and seconds; None if it
  stopped after `stop_after` records, as a killed run would (no final checkpoint). `llm` is None
  only when `plan.todo` is empty."""
  begin_output(paths, resume)
  write_rejects(paths.rejects, source, plan.rejects)
  progress = batch_input.Progress(resume.iterator_state, resume.finished_after)
  lines = batch_input.read_tracked(batch_input.shard_iterator(source, shard, resume.iterator_state),
                                   progress)
  rejected = set(plan.rejects) | plan.behind
  in_flight: dict[int, str | int] = {}
  output_bytes, longest = resume.output_bytes, resume.longest_context
  sampling = job_sampling()

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
      counts["requests"] += 1
      counts["prompt_tokens"] += len(result.prompt_token_ids)
      counts["generated_tokens"] += len(result.token_ids)
      bar.update(1)
      if counts["requests"] == stop_after:
        results.close()
        return None
  save(complete=True)
  return {**counts, "seconds": time.perf_counter() - start}


def merge_parts(output: str, num_processes: int, source: batch_input.JsonlSource,
                valid: dict[int, str]) -> tuple[int, int]:
  """Process 0, once every process is done: the records of every part in input order, written to
  `output` atomically, and their rejects to `<output>.rejects.jsonl`. Returns how many of each
  there are."""
  ordinals = {key: ordinal for ordinal, key in valid.items()}
  rows = []
  for process_id in range(num_processes):
    paths = batch_output.output_paths(output, process_id, num_processes)
    try:
      checkpoint = batch_input.load_checkpoint(paths.checkpoint)
    except ValueError as e:
      fail(str(e))
    if checkpoint is None or not os.path.exists(paths.records):
      fail(f"{paths.records} of process {process_id} is not here to merge: with processes on "
           "several hosts, --output must be on a filesystem they share")
    if not checkpoint.complete or checkpoint.input_sha256 != source.sha256:
      fail(f"{paths.records} of process {process_id} is not a finished part of "
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


def main(argv, stop_after: int | None = None):
  """The job. `stop_after` (for tests calling it in process, one process only) returns after that
  many records are written, as a killed run would."""
  if len(argv) > 1:
    engine_flags.usage_error(f"unexpected arguments: {' '.join(argv[1:])}")
  engine_flags.prepare()
  check_sampling_flags()
  check_process_flags()
  if not os.path.isfile(FLAGS.input):
    engine_flags.usage_error(f"--input={FLAGS.input} does not exist")
  fingerprint = input_fingerprint(FLAGS.input)
  with batch_input.JsonlSource(FLAGS.input) as source:
    run_job(source, fingerprint, stop_after)


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


def drop_token_id_errors(llm: jaxtier.LLM | None, source: batch_input.JsonlSource,
                         plan: Plan) -> Plan:
  """`plan` less the records the tokenizer rejects, which join its rejects. Every process checks
  its own records; under --on_bad_record=fail all of them exit if any found one."""
  errors = token_id_errors(llm, source, plan.todo) if llm is not None else {}
  found = sum(all_gather_json(len(errors)))
  if found and not errors and FLAGS.on_bad_record == "fail":
    fail(f"{FLAGS.input}: {found} invalid record(s) found by the tokenizer in other processes' "
         "shards; nothing was generated (--on_bad_record=skip generates the others)")
  handle_bad_records(source, errors, "found by the tokenizer")
  return Plan({o: n for o, n in plan.todo.items() if o not in errors}, plan.behind - set(errors),
              {**plan.rejects, **errors})


def resume_point(source: batch_input.JsonlSource, shard: grain.sharding.ShardOptions,
                 earlier: dict[int, batch_input.Checkpoint],
                 settings: dict[str, Any]) -> batch_input.Checkpoint:
  """Where this process continues: its checkpoint (checked by `check_earlier_runs`), or the start
  of its shard; with this run's settings either way."""
  checkpoint = earlier.get(shard.shard_index) or batch_input.start_checkpoint(source, shard)
  return dataclasses.replace(checkpoint, settings=settings)


def run_job(source: batch_input.JsonlSource, fingerprint: tuple[int, int],
            stop_after: int | None) -> None:
  """Checks the records and the files of earlier runs, joins the other processes, generates this
  process's shard from its checkpoint on and prints its summary; process 0 of several then merges
  the parts."""
  valid, invalid = check_records(source)
  handle_bad_records(source, invalid, "found before loading the model")
  settings = job_settings(job_sampling())
  earlier = {} if FLAGS.overwrite else check_earlier_runs(source, settings)
  shard = start_processes()
  if FLAGS.overwrite:
    start_over(shard)
  label = process_label(shard)
  paths = batch_output.output_paths(FLAGS.output, shard.shard_index, shard.shard_count)
  resume = resume_point(source, shard, earlier, settings)
  plan = plan_records(source, shard, resume, valid, invalid)
  records = sum(1 for ordinal in batch_input.shard_ordinals(len(source), shard)
                if ordinal in valid)
  retried = len(set(resume.rejected) & set(plan.todo))
  again = f" ({retried} of them rejected by an earlier run)" if retried else ""
  print(f"{label}{records} records, {records - len(plan.todo)} already in {paths.records}, "
        f"{len(plan.todo)} to generate{again}", file=sys.stderr)

  llm = None
  if plan.todo:
    try:
      llm = jaxtier.LLM(**llm_kwargs(shard))
    except ValueError as e:
      fail(str(e))
    if llm.offload.offload_tail_layers:
      print(f"{label}memory: {json.dumps(llm.memory_report())}", file=sys.stderr)
    check_unchanged(FLAGS.input, fingerprint)
  plan = drop_token_id_errors(llm, source, plan)
  check_unchanged(FLAGS.input, fingerprint)
  if plan.rejects:
    print(f"{label}{len(plan.rejects)} rejected record(s) listed in {paths.rejects}; a rerun "
          "checks them again", file=sys.stderr)
  run = generate(llm, source, shard, resume, plan, paths, stop_after)
  if run is None:
    return

  stats_json = FLAGS.stats_json and batch_output.part_path(FLAGS.stats_json, shard.shard_index,
                                                           shard.shard_count)
  summary = summarize(run, len(plan.rejects), write_stats(llm, stats_json))
  if shard.shard_count > 1:
    summary["process_id"] = shard.shard_index
  print(f"summary: {json.dumps(summary, default=_json_number)}", file=sys.stderr)
  summaries = all_gather_json(summary)  # also waits until every part is finished
  if shard.shard_count > 1 and shard.shard_index == 0:
    merged, rejects = merge_parts(FLAGS.output, shard.shard_count, source, valid)
    print(f"{label}merged {merged} records of {shard.shard_count} parts into {FLAGS.output}"
          + (f", {rejects} rejects into {FLAGS.output}{batch_output.REJECTS_SUFFIX}"
             if rejects else ""), file=sys.stderr)
    print(f"totals: {json.dumps(totals(summaries))}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
