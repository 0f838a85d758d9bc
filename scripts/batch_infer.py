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
change tokens, `jaxtier.batch.job.OUTPUT_ENGINE_FLAGS`). Started again with the same flags, a
process cuts its file back to that length, restores the iterator and skips the finished records,
so a killed run neither redoes finished records nor writes duplicates. Records appended to the
input since are generated too. A run refuses to start, with one line naming every file to delete,
when the input changed in any other way, --num_processes or the settings differ (it names the
settings, old -> new), or an output file has no checkpoint; --overwrite deletes those files and
starts over.

The last line on stderr is `summary: {...}` (JSON), one per process; with N processes, process 0
then prints `totals: {...}` over all of them, and each process writes its own part of
--stats_json and --trace_path.

This script holds the flags and the wiring (messages, exit codes); the job itself is in
`jaxtier.batch`: `reader` (the input), `files` (the files beside the records) and `job` (what a
process generates, resuming, refusing a rerun, merging the parts).

  python scripts/batch_infer.py --input=examples/prompts.jsonl --output=out.jsonl
  python scripts/batch_infer.py --input=examples/prompts.jsonl --output=out.jsonl \\
      --num_processes=2 --process_id=0 --coordinator_address=localhost:12345  # and process_id=1
"""

import json
import os
import sys
from typing import Any, NoReturn

from absl import app, flags
import grain

import jaxtier
from jaxtier.batch import files as batch_output, job as batch_job, reader as batch_input
from jaxtier.engine import flags as engine_flags

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

# Flags named as the `SamplingParams` fields they set (--seed is per record:
# `jaxtier.batch.job.record_sampling`).
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "stop", "repetition_penalty",
                  "frequency_penalty", "presence_penalty", "min_p", "min_tokens", "logit_bias",
                  "allowed_token_ids", "bad_words")


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
  is --seed, which record i adds i to (`batch_job.record_sampling`)."""
  seed = None if FLAGS.seed is None else FLAGS.seed % 2**32
  return jaxtier.SamplingParams(**{name: sampling_flag(name) for name in SAMPLING_FLAGS}, seed=seed)


def handle_bad_records(source: batch_input.JsonlSource, errors: dict[int, str],
                       when: str) -> None:
  """Exits listing `errors` ({ordinal: problem}) by line number under --on_bad_record=fail; lists
  them on stderr under skip."""
  if not errors:
    return
  listing = batch_job.bad_record_listing(source, errors)
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


def start_over(shard: grain.sharding.ShardOptions) -> None:
  """--overwrite: process 0 deletes every file of --output; every process waits for it."""
  if shard.shard_index == 0:
    for path in batch_output.output_files(FLAGS.output):
      os.remove(path)
      print(f"{PROG}: --overwrite: deleted {path}", file=sys.stderr)
  batch_job.all_gather_json(None, FLAGS.num_processes)


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
      json.dump(stats, f, indent=1, default=batch_job.json_number)
      f.write("\n")
  return stats


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
  fingerprint = batch_job.input_fingerprint(FLAGS.input)
  with batch_input.JsonlSource(FLAGS.input) as source:
    try:
      run_job(source, fingerprint, stop_after)
    except batch_job.JobError as e:
      fail(str(e))


def drop_token_id_errors(llm: jaxtier.LLM | None, source: batch_input.JsonlSource,
                         plan: batch_job.Plan) -> batch_job.Plan:
  """`plan` less the records the tokenizer rejects, which join its rejects. Every process checks
  its own records; under --on_bad_record=fail all of them exit if any found one."""
  errors = batch_job.token_id_errors(llm, source, plan.todo) if llm is not None else {}
  found = sum(batch_job.all_gather_json(len(errors), FLAGS.num_processes))
  if found and not errors and FLAGS.on_bad_record == "fail":
    fail(f"{FLAGS.input}: {found} invalid record(s) found by the tokenizer in other processes' "
         "shards; nothing was generated (--on_bad_record=skip generates the others)")
  handle_bad_records(source, errors, "found by the tokenizer")
  return plan.without(errors)


def run_job(source: batch_input.JsonlSource, fingerprint: tuple[int, int],
            stop_after: int | None) -> None:
  """Checks the records and the files of earlier runs, joins the other processes, generates this
  process's shard from its checkpoint on and prints its summary; process 0 of several then merges
  the parts. Raises `batch_job.JobError` where the input or the files of an earlier run stop it."""
  valid, invalid = batch_job.check_records(source)
  handle_bad_records(source, invalid, "found before loading the model")
  sampling = job_sampling()
  settings = batch_job.job_settings(sampling, engine_flags.llm_kwargs())
  earlier = {} if FLAGS.overwrite else batch_job.check_earlier_runs(
      FLAGS.output, FLAGS.num_processes, source, settings)
  shard = start_processes()
  if FLAGS.overwrite:
    start_over(shard)
  label = process_label(shard)
  paths = batch_output.output_paths(FLAGS.output, shard.shard_index, shard.shard_count)
  resume = batch_job.resume_point(source, shard, earlier, settings)
  plan = batch_job.plan_records(source, shard, resume, valid, invalid)
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
    batch_job.check_unchanged(FLAGS.input, fingerprint)
  plan = drop_token_id_errors(llm, source, plan)
  batch_job.check_unchanged(FLAGS.input, fingerprint)
  if plan.rejects:
    print(f"{label}{len(plan.rejects)} rejected record(s) listed in {paths.rejects}; a rerun "
          "checks them again", file=sys.stderr)
  removed = batch_job.begin_output(paths, resume)
  if removed:
    print(f"{PROG}: removing {removed} bytes written to {paths.records} after its last "
          "checkpoint", file=sys.stderr)
  batch_job.write_rejects(paths.rejects, source, plan.rejects)
  run = batch_job.generate(llm, source, shard, resume, plan, paths, sampling, stop_after)
  if run is None:
    return

  stats_json = FLAGS.stats_json and batch_output.part_path(FLAGS.stats_json, shard.shard_index,
                                                           shard.shard_count)
  summary = batch_job.summarize(run, len(plan.rejects), write_stats(llm, stats_json))
  if shard.shard_count > 1:
    summary["process_id"] = shard.shard_index
  print(f"summary: {json.dumps(summary, default=batch_job.json_number)}", file=sys.stderr)
  # also waits until every part is finished
  summaries = batch_job.all_gather_json(summary, FLAGS.num_processes)
  if shard.shard_count > 1 and shard.shard_index == 0:
    merged, rejects = batch_job.merge_parts(FLAGS.output, shard.shard_count, source, valid)
    print(f"{label}merged {merged} records of {shard.shard_count} parts into {FLAGS.output}"
          + (f", {rejects} rejects into {FLAGS.output}{batch_output.REJECTS_SUFFIX}"
             if rejects else ""), file=sys.stderr)
    print(f"totals: {json.dumps(batch_job.totals(summaries))}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
