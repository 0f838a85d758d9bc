"""Batch inference: JSONL in, JSONL out, with a progress bar; rerunning resumes where it stopped.

Each input line is {"id": ..., "prompt": "..."} or {"id": ..., "messages": [{"role", "content"}...]}.
Each output line is {"id", "text", "token_ids", "finish_reason"}. Records whose id is already in the
output file are skipped, so an interrupted run continues when started again with the same flags.

  python scripts/batch_infer.py --input=examples/prompts.jsonl --output=out.jsonl
"""

import json
import os
import sys

from absl import app, flags
from tqdm import tqdm

import jaxtier
from jaxtier import engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "input JSONL file", required=True)
flags.DEFINE_string("output", None, "output JSONL file (appended to; existing ids are skipped)",
                    required=True)
flags.DEFINE_integer("chunk_size", 64, "records generated between two writes of the output file")
flags.DEFINE_integer("max_tokens", 64, "maximum generated tokens per record")
flags.DEFINE_float("temperature", 0.0, "sampling temperature; 0 is greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
flags.DEFINE_integer("top_k", -1, "top-k sampling; <= 0 disables it")
flags.DEFINE_integer("seed", None, "sampling seed; record i uses seed + i")
flags.DEFINE_multi_string("stop", [], "stop string (repeat the flag for several)")


def read_records(path: str) -> list[dict]:
  """Parses and validates every line first, so a bad line is reported before any work is done."""
  if not os.path.isfile(path):
    raise app.UsageError(f"--input={path} does not exist")
  records, errors, seen = [], [], set()
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        errors.append(f"line {number}: not valid JSON ({e.msg})")
        continue
      if not isinstance(record, dict) or "id" not in record:
        errors.append(f"line {number}: expected an object with an 'id'")
      elif ("prompt" in record) == ("messages" in record):
        errors.append(f"line {number}: expected exactly one of 'prompt' or 'messages'")
      elif str(record["id"]) in seen:
        errors.append(f"line {number}: duplicate id {record['id']!r}")
      else:
        seen.add(str(record["id"]))
        records.append(record)
  if errors:
    raise app.UsageError(f"{path} has {len(errors)} invalid line(s):\n  " + "\n  ".join(errors[:20]))
  return records


def done_ids(path: str) -> set[str]:
  if not os.path.isfile(path):
    return set()
  with open(path) as f:
    return {str(json.loads(line)["id"]) for line in f if line.strip()}


def sampling_params(index: int) -> jaxtier.SamplingParams:
  seed = None if FLAGS.seed is None else (FLAGS.seed + index) % 2**32
  return jaxtier.SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                                top_p=FLAGS.top_p, top_k=FLAGS.top_k, seed=seed, stop=FLAGS.stop)


def generate(llm: jaxtier.LLM, records: list[dict], first_index: int) -> list:
  """Outputs for a chunk of records, in order (prompts and conversations may be mixed)."""
  outputs: dict[int, jaxtier.RequestOutput] = {}
  for kind, call in (("prompt", llm.generate), ("messages", llm.chat)):
    picked = [i for i, r in enumerate(records) if kind in r]
    if picked:
      results = call([records[i][kind] for i in picked],
                     [sampling_params(first_index + i) for i in picked])
      outputs.update(zip(picked, results))
  return [outputs[i] for i in range(len(records))]


def main(argv):
  del argv
  engine_flags.prepare()
  try:
    sampling_params(0)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  records = read_records(FLAGS.input)
  skip = done_ids(FLAGS.output)
  todo = [(i, r) for i, r in enumerate(records) if str(r["id"]) not in skip]
  print(f"{len(records)} records, {len(records) - len(todo)} already in {FLAGS.output}, "
        f"{len(todo)} to generate", file=sys.stderr)
  if not todo:
    return
  try:
    llm = jaxtier.LLM(**engine_flags.llm_kwargs())
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if llm.offload.offload_tail_layers:
    print(f"memory: {json.dumps(llm.memory_report())}", file=sys.stderr)
  with open(FLAGS.output, "a") as out, tqdm(total=len(todo), unit="record", desc="batch") as bar:
    for start in range(0, len(todo), FLAGS.chunk_size):
      chunk = todo[start:start + FLAGS.chunk_size]
      try:
        results = generate(llm, [r for _, r in chunk], chunk[0][0])
      except ValueError as e:
        raise app.UsageError(f"records {chunk[0][1]['id']!r}..{chunk[-1][1]['id']!r}: {e}") from None
      for (_, record), result in zip(chunk, results):
        out.write(json.dumps({"id": record["id"], "text": result.text,
                              "token_ids": list(result.token_ids),
                              "finish_reason": result.finish_reason}) + "\n")
      out.flush()
      os.fsync(out.fileno())
      bar.update(len(chunk))


if __name__ == "__main__":
  app.run(main)
