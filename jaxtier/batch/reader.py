"""The batch job's input (`scripts/batch_infer.py`): a JSONL file's records as a Grain data source,
shared out between JAX processes, and how far one process has got through its share.

- `JsonlSource` is a Grain random-access data source over the non-blank lines of a file. It reads
  the file once to index where each such line starts and ends (and hashes it); an item is an
  `InputLine` (line number, ordinal among non-blank lines, text), read back by offset.
- `shard_iterator` is a Grain iterator over one process's shard: records `shard_index`,
  `shard_index + shard_count`, ... in order, one epoch, no shuffling (`ShardByJaxProcess` gives
  the index and count). The shard is strided rather than Grain's contiguous `even_split`: a record
  keeps its process when records are appended to the file, so a checkpoint of the shorter file
  still describes the longer one (appended records are generated on the next run).
- Resuming uses the iterator's own `get_state()`/`set_state()`. The engine finishes records out
  of order, so the state after the last record read says nothing about which records are written.
  `Progress` keeps the state from before each record read and not finished yet, and a
  `Checkpoint` holds both pieces a restart needs: the state at the low-water mark (every record
  read before it is finished) and the ordinals finished after it. With the state alone a restart
  would redo those finished records and write them twice; with the finished set alone it would
  have to read the whole shard again and keep a set as large as the output.
- A record the job rejects (`--on_bad_record=skip`) is passed by the iterator like a finished
  one, so the low-water mark moves on; the checkpoint lists it in `rejected` instead, and the next
  run checks it again (an earlier run's rejects behind the mark are read back by ordinal).
- The checkpoint also records the settings its records were generated with (`settings`, compared
  by the job on a rerun) and the longest prompt + generated tokens among them (`longest_context`:
  a context window above it gives those records the same tokens).
- `save_checkpoint` writes the file atomically (temporary file, fsync, `os.replace`), so a killed
  process leaves the previous checkpoint or the new one, never half of one.

Ordinals are positions among the file's non-blank lines from 0 (the job's per-record seed is
`--seed + ordinal`); line numbers count every line from 1 (error messages name them).
"""

import array
import copy
import dataclasses
import hashlib
import json
import os
from typing import Any, Iterable, Iterator

import grain

_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # read on demand


@dataclasses.dataclass(frozen=True)
class InputLine:
  """One non-blank input line: its line number (from 1), ordinal (from 0) and text (no newline)."""
  number: int
  ordinal: int
  text: str


def _is_blank(line: bytes) -> bool:
  """Whitespace only, Unicode whitespace included (as `str.strip` sees it)."""
  return not line.strip() or (not line.isascii() and not line.decode("utf-8", "replace").strip())


class JsonlSource:
  """Random access to the non-blank lines of a text file (a Grain `RandomAccessDataSource`).

  The constructor reads the file once, keeping the line number and byte span of each non-blank
  line (24 bytes a line) and the file's size and SHA-256; `source[i]` reads line i back with one
  `os.pread`, so the source may be read from several threads. Invalid UTF-8 reads as U+FFFD. Call
  `close()` (or use it as a context manager) to close the file.
  """

  def __init__(self, path: str):
    self.path = path
    self._numbers, self._starts, self._ends = array.array("q"), array.array("q"), array.array("q")
    digest, offset = hashlib.sha256(), 0
    with open(path, "rb") as f:
      for number, line in enumerate(f, 1):
        digest.update(line)
        if not _is_blank(line):
          self._numbers.append(number)
          self._starts.append(offset)
          self._ends.append(offset + len(line.rstrip(b"\n")))
        offset += len(line)
    self.size, self.sha256 = offset, digest.hexdigest()
    self._fd = os.open(path, os.O_RDONLY)

  def __len__(self) -> int:
    return len(self._starts)

  def line_number(self, ordinal: int) -> int:
    """The line number (from 1) of record `ordinal`, without reading the file."""
    return self._numbers[ordinal]

  def __getitem__(self, ordinal: int) -> InputLine:
    start = self._starts[ordinal]
    raw = os.pread(self._fd, self._ends[ordinal] - start, start)
    return InputLine(self._numbers[ordinal], ordinal % len(self), raw.decode("utf-8", "replace"))

  def __repr__(self) -> str:
    return f"JsonlSource({self.path!r}, records={len(self)}, sha256={self.sha256[:16]})"

  def close(self) -> None:
    if self._fd >= 0:
      os.close(self._fd)
      self._fd = -1

  def __enter__(self) -> "JsonlSource":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def starts_with(self, size: int, sha256: str) -> bool:
    """Whether the file's first `size` bytes hash to `sha256` and end where a line ends: the file
    is the one hashed then, perhaps with lines appended, so its first records are unchanged."""
    if size > self.size:
      return False
    if size == self.size:
      return sha256 == self.sha256
    digest, left = hashlib.sha256(), size
    with open(self.path, "rb") as f:
      while left:
        chunk = f.read(min(left, 1 << 20))
        digest.update(chunk)
        left -= len(chunk)
      next_byte = f.read(1)
      f.seek(max(size - 1, 0))
      last_byte = f.read(1) if size else b"\n"
    return b"\n" in (last_byte, next_byte) and digest.hexdigest() == sha256


def shard_slice(shard: grain.sharding.ShardOptions) -> slice:
  """The records of one shard, as a slice of the ordinals: every shard_count-th from shard_index."""
  return slice(shard.shard_index, None, shard.shard_count)


def shard_ordinals(num_records: int, shard: grain.sharding.ShardOptions) -> range:
  """The ordinals `shard_iterator` yields, in order (the same rule, without reading anything)."""
  return range(num_records)[shard_slice(shard)]


def shard_iterator(source: JsonlSource, shard: grain.sharding.ShardOptions,
                   state: dict[str, Any] | None = None) -> grain.DatasetIterator:
  """A Grain iterator over the shard's records in input order (one epoch), started from `state`
  (a `get_state()` of an iterator over the same shard) when given."""
  dataset = grain.MapDataset.source(source)[shard_slice(shard)]
  iterator = dataset.to_iter_dataset(_READ_OPTIONS).__iter__()
  if state is not None:
    iterator.set_state(state)
  return iterator


class Progress:
  """Which records of a shard are finished, in the two pieces a checkpoint keeps.

  `read` is called for each record as it is taken from the iterator (with the iterator's state
  before and after), `finish` once its output is written (in any order); a record that is not to
  be generated (invalid, or in `finished_after` of the checkpoint resumed from) is finished as soon
  as it is read. `position()` is the iterator state at the low-water mark (before the first record
  read and not finished; after the last record read when none is pending) and the ordinals
  finished after it.
  """

  def __init__(self, state: dict[str, Any], finished_after: Iterable[int] = ()):
    self._state = state  # after the last record read
    self._last = -1  # ordinal of the last record read
    self._pending: dict[int, dict[str, Any]] = {}  # read, not finished: state before it, read order
    self._finished = set(finished_after)

  def read(self, ordinal: int, before: dict[str, Any], after: dict[str, Any]) -> None:
    self._pending[ordinal] = before
    self._state, self._last = after, ordinal

  def finish(self, ordinal: int) -> None:
    del self._pending[ordinal]
    self._finished.add(ordinal)

  @property
  def pending(self) -> int:
    return len(self._pending)

  def position(self) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(iterator state at the low-water mark, sorted ordinals finished after it). Ordinals at or
    before the mark are dropped from the finished set: the state covers them."""
    if self._pending:
      mark, state = next(iter(self._pending.items()))  # read, not finished: not in the set
    else:
      mark, state = self._last, self._state  # everything read is finished
    self._finished = {o for o in self._finished if o > mark}
    return state, tuple(sorted(self._finished))


def read_tracked(iterator: grain.DatasetIterator, progress: Progress) -> Iterator[InputLine]:
  """The iterator's records, each reported to `progress.read` with the states around it."""
  while True:
    before = copy.deepcopy(iterator.get_state())
    try:
      line = next(iterator)
    except StopIteration:
      return
    progress.read(line.ordinal, before, copy.deepcopy(iterator.get_state()))
    yield line


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """One process's resume point: its shard, the input it was reading (size and SHA-256 then), the
  Grain iterator state at the low-water mark, the ordinals finished after it, the bytes of its
  output that hold those records (anything after them was written after the checkpoint and is
  cut off on resume), and whether the shard was finished. Besides: the ordinals rejected and not
  written (counted as passed by the iterator state, checked again by the next run), the settings
  the records were generated with (None in checkpoints from before they were recorded), and the
  longest prompt + generated tokens of a record written."""
  shard_index: int
  shard_count: int
  input_bytes: int
  input_sha256: str
  iterator_state: dict[str, Any]
  finished_after: tuple[int, ...] = ()
  output_bytes: int = 0
  complete: bool = False
  rejected: tuple[int, ...] = ()
  settings: dict[str, Any] | None = None
  longest_context: int = 0


def start_checkpoint(source: JsonlSource, shard: grain.sharding.ShardOptions,
                     settings: dict[str, Any] | None = None) -> Checkpoint:
  """The checkpoint of a shard nothing has been generated of, with the run's settings."""
  return Checkpoint(shard.shard_index, shard.shard_count, source.size, source.sha256,
                    shard_iterator(source, shard).get_state(), settings=settings)


def checkpoint_mismatch(checkpoint: Checkpoint, source: JsonlSource,
                        shard: grain.sharding.ShardOptions) -> str | None:
  """Why `checkpoint` does not describe this shard of `source` (None when it does: same shard,
  and the input is the checkpointed file, perhaps with records appended)."""
  if (checkpoint.shard_index, checkpoint.shard_count) != (shard.shard_index, shard.shard_count):
    return (f"it was written by process {checkpoint.shard_index} of {checkpoint.shard_count}, "
            f"not {shard.shard_index} of {shard.shard_count}")
  if not source.starts_with(checkpoint.input_bytes, checkpoint.input_sha256):
    return (f"the input's first {checkpoint.input_bytes} bytes changed since (only appending "
            "records keeps a checkpoint valid)")
  return None


def save_checkpoint(path: str, checkpoint: Checkpoint) -> None:
  """Writes `checkpoint` as JSON to `path` atomically: a temporary file beside it, synced, then
  renamed over it."""
  temporary = f"{path}.tmp"
  with open(temporary, "w") as f:
    json.dump(dataclasses.asdict(checkpoint), f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)


def load_checkpoint(path: str) -> Checkpoint | None:
  """The checkpoint in `path`, None if there is no such file; ValueError if it is not one."""
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      fields = json.load(f)
    checkpoint = Checkpoint(**fields)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
    raise ValueError(f"{path} is not a checkpoint of the batch job ({e})") from None
  return dataclasses.replace(checkpoint, finished_after=tuple(checkpoint.finished_after),
                             rejected=tuple(checkpoint.rejected))
