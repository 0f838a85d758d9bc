"""The batch job's files beside its records (`scripts/batch_infer.py`): which files an --output
owns, the rejects file, and how a rerun's settings differ from those its checkpoints record.

- With one process the job writes `<output>`, `<output>.checkpoint.json` and, when it skips
  records, `<output>.rejects.jsonl`. With N processes, process i writes the same three for its part
  `<output>.part-<i>-of-<N>`, and process 0 merges the parts' records into `<output>` and their
  rejects into `<output>.rejects.jsonl`. `output_files` lists every such file that exists, so a
  refusal names exactly what to delete.
- A rejects file holds one line per record skipped under `--on_bad_record=skip`,
  `{"id", "line", "reason"}` in input order (`id` is null where the line has no usable id; `line`
  counts every input line from 1, as the job's error messages do). It is a report, rewritten by
  every run to what that run rejected: which records a rerun checks again is kept in the
  checkpoint (`batch_input.Checkpoint.rejected`), which is replaced atomically with the records.
- The settings record (`batch_input.Checkpoint.settings`) is `{"sampling": {...}, "engine":
  {...}}`: every field of the job's `SamplingParams` and the engine settings that change tokens.
  `settings_changes` lists how a rerun's settings differ from it.
"""

import dataclasses
import glob
import json
import os
import re
from typing import Any

CHECKPOINT_SUFFIX = ".checkpoint.json"
REJECTS_SUFFIX = ".rejects.jsonl"
_OWNED = re.compile(r"(\.part-\d+-of-\d+)?(\.checkpoint\.json|\.rejects\.jsonl)?(\.tmp)?")
_PART_CHECKPOINT = re.compile(r"\.part-\d+-of-(\d+)\.checkpoint\.json")


@dataclasses.dataclass(frozen=True)
class Paths:
  """The files one process writes: its records, its checkpoint and its rejects."""
  records: str
  checkpoint: str
  rejects: str


def part_path(path: str, process_id: int, num_processes: int) -> str:
  """The file one process writes for a file named by a flag: that file itself with one process,
  else `<path>.part-<i>-of-<n>`."""
  return path if num_processes == 1 else f"{path}.part-{process_id}-of-{num_processes}"


def output_paths(output: str, process_id: int, num_processes: int) -> Paths:
  """The files of one process: its part of --output, `<part>.checkpoint.json` and
  `<part>.rejects.jsonl`."""
  path = part_path(output, process_id, num_processes)
  return Paths(path, path + CHECKPOINT_SUFFIX, path + REJECTS_SUFFIX)


def output_files(output: str) -> list[str]:
  """Every file of --output that exists (the output, checkpoints, rejects, part files and their
  temporary files), as absolute paths in sorted order: what deleting starts a run over."""
  candidates = [output, *glob.glob(f"{glob.escape(output)}.*")]
  return sorted(os.path.abspath(path) for path in candidates
                if os.path.isfile(path) and _OWNED.fullmatch(path[len(output):]))


def process_counts(output: str) -> set[int]:
  """The --num_processes of the runs whose checkpoints --output has (1 for `<output>`'s own)."""
  counts = {1} if os.path.exists(output + CHECKPOINT_SUFFIX) else set()
  for path in glob.glob(f"{glob.escape(output)}.part-*-of-*{CHECKPOINT_SUFFIX}"):
    match = _PART_CHECKPOINT.fullmatch(path[len(output):])
    if match:
      counts.add(int(match.group(1)))
  return counts


def record_id(text: str) -> str | int | None:
  """The id of an input line as the rejects file shows it: the line's "id" when the line is a JSON
  object whose id is a string or an integer, else None."""
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return None
  identifier = value.get("id") if isinstance(value, dict) else None
  if isinstance(identifier, bool) or not isinstance(identifier, (str, int)):
    return None
  return identifier


def write_lines(path: str, rows: list[dict[str, Any]]) -> None:
  """Writes `rows` as JSON lines to `path` atomically (a temporary file, synced, renamed over it);
  removes `path` instead when there are none."""
  if not rows:
    if os.path.exists(path):
      os.remove(path)
    return
  temporary = f"{path}.tmp"
  with open(temporary, "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)


def read_rejects(path: str) -> list[dict[str, Any]]:
  """The rows of a rejects file; [] when there is none."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def merge_rejects(parts: list[str], output: str) -> int:
  """The rows of every part's rejects file, in input order, written to `output` (removed when
  there are none). Returns how many there are."""
  rows = sorted((row for part in parts for row in read_rejects(part)), key=lambda row: row["line"])
  write_lines(output, rows)
  return len(rows)


def settings_changes(recorded: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]],
                     defaults: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """{name: (recorded value, current value)} for every setting that differs, over all groups. A
  name missing from the record takes its value from `defaults` (a field added to
  `SamplingParams` since, at its default, samples as before), else reads as None."""
  changes = {}
  for group in sorted(set(recorded) | set(current)):
    old, new = recorded.get(group, {}), current.get(group, {})
    for name in [*new, *(name for name in old if name not in new)]:
      before = old.get(name, defaults.get(name))
      if before != new.get(name):
        changes[name] = (before, new.get(name))
  return changes


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
  """'name old -> new, ...' with values as JSON."""
  return ", ".join(f"{name} {json.dumps(old)} -> {json.dumps(new)}"
                   for name, (old, new) in changes.items())
