"""Batch inference: JSONL in, JSONL out, each result written as soon as it finishes; rerunning
resumes where it stopped.

Each input line is {"id": ..., "prompt": ...} or {"id": ..., "messages": [{"role", "content"}...]},
checked by the rules of the HTTP server (`jaxtier.server.records`) before the model loads; token ids
and prompt lengths are checked for every record once the tokenizer is loaded, before anything is
generated (--on_bad_record says whether an invalid record stops the run or is skipped). Each output
line is {"id", "text", "token_ids", "finish_reason"}, appended and synced to disk when its record
finishes (records finish out of input order). Records whose id is already in the output file are
skipped, so an interrupted run continues when started again with the same flags. The last line on
stderr is `summary: {...}` (JSON).

  python scripts/batch_infer.py --input=examples/prompts.jsonl --output=out.jsonl
"""

import itertools
import json
import os
import sys
import time
from typing import Any, Iterator, NoReturn

from absl import app, flags
import jinja2
from tqdm import tqdm

import jaxtier
from jaxtier import engine_flags
from jaxtier.server.records import BatchRecord, parse_record

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "input JSONL file", required=True)
flags.DEFINE_string("output", None, "output JSONL file (appended to; existing ids are skipped)",
                    required=True)
flags.DEFINE_enum("on_bad_record", "fail", ["fail", "skip"], "what an invalid record does: 'fail' "
                  "reports the invalid records and exits before generating anything; 'skip' "
                  "reports them and generates the others")
flags.DEFINE_string("stats_json", None, "optional file written at the end with the engine's "
                    "statistics (`LLM.stats()`), where the engine provides them")
flags.DEFINE_integer("max_tokens", 64, "maximum generated tokens per record")
flags.DEFINE_float("temperature", 0.0, "sampling temperature; 0 is greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
flags.DEFINE_integer("top_k", -1, "top-k sampling; <= 0 disables it")
flags.DEFINE_integer("seed", None, "sampling seed; the record on the i-th non-blank input line "
                     "(from 0) uses seed + i")
flags.DEFINE_multi_string("stop", [], "stop string (repeat the flag for several)")
flags.adopt_module_key_flags(engine_flags)

PROG = os.path.basename(sys.argv[0])
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "stop")
SUMMARY_STATS = ("swap_out_count", "swap_in_count", "swap_out_bytes", "swap_in_bytes", "swap_seconds",
              "prefix_device_hit_rate", "prefix_host_hit_rate")
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
      jaxtier.SamplingParams(**{name: FLAGS[name].value})
    except ValueError as e:
      engine_flags.usage_error(f"--{name}={FLAGS[name].value}: {e}")
  try:
    sampling_params(0)
  except ValueError as e:
    engine_flags.usage_error(str(e))


def sampling_params(ordinal: int) -> jaxtier.SamplingParams:
  seed = None if FLAGS.seed is None else (FLAGS.seed + ordinal) % 2**32
  return jaxtier.SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                                top_p=FLAGS.top_p, top_k=FLAGS.top_k, seed=seed, stop=FLAGS.stop)


def input_lines(path: str) -> Iterator[tuple[int, int, str]]:
  """(line number from 1, ordinal among non-blank lines from 0, text) of each non-blank line."""
  with open(path) as f:
    ordinals = itertools.count()
    for number, line in enumerate(f, 1):
      if line.strip():
        yield number, next(ordinals), line


def check_records(path: str) -> tuple[dict[int, tuple[int, str]], dict[int, str]]:
  """Reads every line of `path` once, keeping only line numbers and ids.

  Returns:
    ({line number: (ordinal, id key)} of the valid records, {line number: problem} of the invalid
    and duplicate ones).
  """
  valid, keys, errors = {}, set(), {}
  for number, ordinal, line in input_lines(path):
    try:
      record = parse_record(line)
    except ValueError as e:
      errors[number] = str(e)
      continue
    if record.key in keys:
      errors[number] = f"duplicate id {record.id!r}"
      continue
    keys.add(record.key)
    valid[number] = (ordinal, record.key)
  return valid, errors


def handle_bad_records(path: str, errors: dict[int, str], when: str) -> None:
  """Exits listing `errors` under --on_bad_record=fail; lists them on stderr under skip."""
  if not errors:
    return
  shown = [f"line {number}: {problem}" for number, problem in sorted(errors.items())]
  if len(shown) > MAX_REPORTED:
    shown[MAX_REPORTED:] = [f"... and {len(shown) - MAX_REPORTED} more"]
  listing = "".join(f"\n  {line}" for line in shown)
  if FLAGS.on_bad_record == "fail":
    fail(f"{path}: {len(errors)} invalid record(s) {when}; nothing was generated "
         f"(--on_bad_record=skip generates the others):{listing}")
  print(f"{PROG}: skipping {len(errors)} invalid record(s) of {path} {when}:{listing}",
        file=sys.stderr)


def done_ids(path: str) -> set[str]:
  """Ids already in the output file. A last line cut short by a killed run is removed."""
  if not os.path.isfile(path):
    return set()
  ids, complete = set(), 0
  with open(path, "rb") as f:
    for number, line in enumerate(f, 1):
      if not line.endswith(b"\n"):
        break
      complete += len(line)
      if not line.strip():
        continue
      try:
        ids.add(str(json.loads(line)["id"]))
      except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
        fail(f"--output={path}: line {number} is not an output record; not appending to this file")
  if complete < os.path.getsize(path):
    print(f"{PROG}: removing an incomplete last line from {path}", file=sys.stderr)
    with open(path, "rb+") as f:
      f.truncate(complete)
      os.fsync(f.fileno())
  return ids


def token_id_errors(llm: jaxtier.LLM, path: str, todo: dict[int, int]) -> dict[int, str]:
  """Tokenizes every record to generate; returns {line number: problem} for those the engine
  rejects (token ids outside the vocabulary, prompts that leave no room in the context window, chat
  template errors)."""
  errors = {}
  for number, _, record in records(path, todo):
    try:
      if record.messages is None:
        llm.prompt_token_ids(record.prompt)
      else:
        llm.chat_token_ids(record.conversation())
    except (ValueError, TypeError, jinja2.TemplateError) as e:
      errors[number] = str(e).replace("prompt 0 ", "prompt ", 1)
  return errors


def input_fingerprint(path: str) -> tuple[int, int]:
  stat = os.stat(path)
  return stat.st_size, stat.st_mtime_ns


def check_unchanged(path: str, fingerprint: tuple[int, int]) -> None:
  """Exits if `path` was modified since it was checked: it is read again, not kept in memory."""
  if input_fingerprint(path) != fingerprint:
    fail(f"{path} changed during the run; nothing more was generated")


def records(path: str, todo: dict[int, int]) -> Iterator[tuple[int, int, BatchRecord]]:
  """(line number, ordinal, record) of the lines in `todo`, read from `path` again."""
  for number, ordinal, line in input_lines(path):
    if number in todo:
      try:
        record = parse_record(line)
      except ValueError as e:
        fail(f"{path} changed during the run: line {number}: {e}")
      yield number, ordinal, record


def write_stats(llm: jaxtier.LLM | None) -> dict[str, Any]:
  """`llm.stats()` (written to --stats_json when given), or {} where the engine has none."""
  if llm is None or not hasattr(llm, "stats"):
    if FLAGS.stats_json:
      print(f"{PROG}: no engine statistics to write to --stats_json={FLAGS.stats_json}",
            file=sys.stderr)
    return {}
  stats = llm.stats()
  if FLAGS.stats_json:
    with open(FLAGS.stats_json, "w") as f:
      json.dump(stats, f, indent=1, default=_json_number)
      f.write("\n")
  return stats


def _json_number(value: Any) -> Any:
  if hasattr(value, "item"):
    return value.item()
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


def generate(llm: jaxtier.LLM, path: str, todo: dict[int, int]) -> dict[str, Any]:
  """Generates the records on the lines in `todo`, appending each output line as its record
  finishes; returns the run's counts and seconds."""
  in_flight: dict[int, str | int] = {}

  def items() -> Iterator[tuple[int, Any, jaxtier.SamplingParams]]:
    for number, ordinal, record in records(path, todo):
      in_flight[number] = record.id
      yield number, record.engine_input(), sampling_params(ordinal)

  counts = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}
  start = time.perf_counter()
  with open(FLAGS.output, "a") as out, tqdm(total=len(todo), unit="record", desc="batch") as bar:
    for number, result in llm.generate_stream(items(), use_tqdm=False):
      out.write(json.dumps({"id": in_flight.pop(number), "text": result.text,
                            "token_ids": list(result.token_ids),
                            "finish_reason": result.finish_reason}) + "\n")
      out.flush()
      os.fsync(out.fileno())
      counts["requests"] += 1
      counts["prompt_tokens"] += len(result.prompt_token_ids)
      counts["generated_tokens"] += len(result.token_ids)
      bar.update(1)
  return {**counts, "seconds": time.perf_counter() - start}


def main(argv):
  if len(argv) > 1:
    engine_flags.usage_error(f"unexpected arguments: {' '.join(argv[1:])}")
  engine_flags.prepare()
  check_sampling_flags()
  if not os.path.isfile(FLAGS.input):
    engine_flags.usage_error(f"--input={FLAGS.input} does not exist")
  fingerprint = input_fingerprint(FLAGS.input)

  valid, errors = check_records(FLAGS.input)
  handle_bad_records(FLAGS.input, errors, "found before loading the model")
  invalid = len(errors)
  done = done_ids(FLAGS.output)
  todo = {number: ordinal for number, (ordinal, key) in valid.items() if key not in done}
  print(f"{len(valid)} records, {len(valid) - len(todo)} already in {FLAGS.output}, "
        f"{len(todo)} to generate", file=sys.stderr)

  llm, run = None, {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "seconds": 0.0}
  if todo:
    try:
      llm = jaxtier.LLM(**engine_flags.llm_kwargs())
    except ValueError as e:
      fail(str(e))
    if llm.offload.offload_tail_layers:
      print(f"memory: {json.dumps(llm.memory_report())}", file=sys.stderr)
    check_unchanged(FLAGS.input, fingerprint)
    errors = token_id_errors(llm, FLAGS.input, todo)
    handle_bad_records(FLAGS.input, errors, "found by the tokenizer")
    invalid += len(errors)
    for number in errors:
      del todo[number]
    check_unchanged(FLAGS.input, fingerprint)
    run = generate(llm, FLAGS.input, todo)

  stats = write_stats(llm)
  seconds = run["seconds"]
  summary = {**run, "seconds": round(seconds, 3),
             "tokens_per_s": round(run["generated_tokens"] / seconds, 2) if seconds else 0.0,
             "invalid_records": invalid}
  summary.update((k, stats[k]) for k in SUMMARY_STATS if k in stats)
  print(f"summary: {json.dumps(summary, default=_json_number)}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
