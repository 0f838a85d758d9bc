"""A restart-safe on-disk store of KV-cache blocks, content-addressed by block hash.

A block is the same few arrays for every hash of a namespace (K and V, and the scales of an int8
cache), so a store is described by a `BlockLayout` and a namespace: a directory name that stands
for everything that decides a block's contents (model, dtypes, block size, ...), made from those
parts by `namespace_name`. Two engines whose parts differ never share files.

Layout on disk: `<root>/<namespace>/namespace.json` (what the namespace is, for the listing tool
`scripts/kv_disk.py`) and one file per block at `<root>/<namespace>/<hh>/<hash hex>.kvb`, `hh` the
first two hex digits (so no directory holds more than a few hundred files per 100,000 blocks).

File format: the magic `b"JXKV"`, the header length as a little-endian uint32, a UTF-8 JSON
header (format, namespace, hash, the layout, the payload size and the payload's CRC-32, as 8
hex digits; sorted keys, no spaces) and the payload: each array's C-order bytes in layout order.
Every field of the header has the same length in every file of a namespace, so every block file
has the same size (`DiskStore.file_bytes`): a file of another size is torn, and the budget is a
block count.

Why temp + rename: the writer writes a whole file under a temporary name in the target directory
and renames it into place. A rename is atomic, so a reader (this process or another) sees either
no file or a complete one, never a partial one; two writers of the same hash each rename a
complete file of identical content, and both succeed. No fsync: after a power loss a file may be
torn or hold zeros, and the size, header and checksum checks catch that on read.

Why a bad file is a miss and is removed: the store is a cache, a block it cannot return is one the
engine recomputes. A read that finds anything wrong (magic, header, another namespace's or hash's
header, size, checksum, an unreadable file) returns None, unlinks the file so it is not read again
and drops the hash from the index; it never raises for a file's contents. Start-up removes torn
files (wrong size) and the temporary files of writers that died (their pid no longer runs).

Budget: after each write, the least recently used files are unlinked until the namespace's bytes
are within `budget_bytes`, so it never holds more than one block over budget (between the rename
and the eviction). Recency is the index order: a write or a successful read makes a hash the
newest, and a read also sets the file's mtime, so a restart, which orders the files it finds by
mtime, keeps the order.

Several processes may share a directory. Each keeps its own index and enforces the budget on what
it knows; a file one process evicts or finds corrupt is a miss for another that had indexed it
(the miss drops the hash there too), and a hash another process wrote is found by a read and
indexed then. Writes never block the caller: they queue for one writer thread, which converts the
arrays (waiting for a device transfer there, not in the caller), writes and evicts. The first
`OSError` while writing (a full disk, no permission) stops writing with one warning; reads go on.

numpy, ml_dtypes and the standard library only: no JAX.
"""

import collections
import dataclasses
import datetime
import errno
import functools
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import struct
import threading
import time
import types
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

FORMAT_VERSION = 1
MAGIC = b"JXKV"
BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
NAMESPACE_FILE = "namespace.json"
# A temporary file older than this is a leftover even when its pid runs: the pid was reused, or
# the writer ran in another pid namespace (a container sharing the directory).
STALE_TMP_SECONDS = 3600.0
WRITER_NICE = 10  # the writer thread's nice value, above the process's
CHECKSUM_BYTES = 4  # CRC-32: it catches torn and flipped bytes (identity is the namespace and
# hash in the header, not the checksum) at ~3x blake2b's rate, which both the writer thread
# beside the steps and a restart's reads pay
HASH_BYTES = 16  # the block hash length `file_bytes` reports (any length is accepted)

_LENGTH = struct.Struct("<I")
_PREFIX_BYTES = len(MAGIC) + _LENGTH.size
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HEADER_KEYS = frozenset(("arrays", "checksum", "format", "hash", "namespace", "payload_bytes"))

_NO_INFO: Mapping[str, Any] = types.MappingProxyType({})

_log = logging.getLogger(__name__)


def namespace_name(parts: Mapping[str, Any]) -> str:
  """32 hex digits naming everything that decides a block's bytes (and the file format): blocks
  of engines whose parts differ land in different directories and are never mixed."""
  text = json.dumps({**parts, "format": FORMAT_VERSION}, sort_keys=True, separators=(",", ":"),
                    default=str)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def dtype_of(name: str) -> np.dtype:
  """The numpy dtype of a dtype name, ml_dtypes' (bfloat16, float8_*) included."""
  try:
    return np.dtype(name)
  except TypeError:
    pass
  found = getattr(ml_dtypes, name, None)
  if found is None:
    raise ValueError(f"unknown dtype {name!r}")
  return np.dtype(found)


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """What every block file of a namespace holds, in order: (name, shape, dtype name) per array,
  e.g. (("k", (2, 24, 16, 64), "bfloat16"), ("v", (2, 24, 16, 64), "bfloat16")); an int8 cache
  adds its scales, ("k_scales", shape, "float32") and so on. Fixed shapes are what make every
  file of a namespace the same size."""
  arrays: tuple[tuple[str, tuple[int, ...], str], ...]

  def __post_init__(self):
    arrays = tuple((str(name), tuple(int(d) for d in shape), str(dtype))
                   for name, shape, dtype in self.arrays)
    if not arrays:
      raise ValueError("a block layout needs at least one array")
    names = [name for name, _, _ in arrays]
    if len(set(names)) != len(names):
      raise ValueError(f"array names repeat in the block layout: {names}")
    for name, shape, dtype in arrays:
      if any(d < 0 for d in shape):
        raise ValueError(f"array {name!r}: negative dimension in {shape}")
      dtype_of(dtype)
    object.__setattr__(self, "arrays", arrays)

  @classmethod
  def of(cls, named: Mapping[str, Any]) -> "BlockLayout":
    """The layout of example arrays, in the mapping's order."""
    return cls(tuple((name, np.shape(a), np.asarray(a).dtype.name) for name, a in named.items()))

  @functools.cached_property
  def dtypes(self) -> tuple[np.dtype, ...]:
    return tuple(dtype_of(dtype) for _, _, dtype in self.arrays)

  @functools.cached_property
  def nbytes(self) -> int:
    """Payload bytes of one block."""
    return sum(math.prod(shape) * dt.itemsize
               for (_, shape, _), dt in zip(self.arrays, self.dtypes))

  def as_json(self) -> list:
    """The layout as JSON lists, as block headers and namespace.json hold it."""
    return [[name, list(shape), dtype] for name, shape, dtype in self.arrays]

  def check(self, arrays: Sequence[np.ndarray]) -> None:
    """Raises ValueError naming the first difference between `arrays` and the layout."""
    if len(arrays) != len(self.arrays):
      raise ValueError(f"{len(arrays)} arrays for a block layout of {len(self.arrays)} "
                       f"({', '.join(name for name, _, _ in self.arrays)})")
    for array, (name, shape, dtype), dt in zip(arrays, self.arrays, self.dtypes):
      if tuple(array.shape) != shape:
        raise ValueError(f"array {name!r} has shape {tuple(array.shape)}, the layout {shape}")
      if array.dtype != dt:
        raise ValueError(f"array {name!r} has dtype {array.dtype.name}, the layout {dtype}")


def _crc_hex(crc: int) -> str:
  return f"{crc:0{2 * CHECKSUM_BYTES}x}"


def header_bytes(namespace: str, layout: BlockLayout, hash_hex: str, checksum: str) -> bytes:
  """A block file's JSON header: sorted keys and no spaces, so its length depends only on the
  namespace, the layout and the hash length."""
  return json.dumps({"arrays": layout.as_json(), "checksum": checksum, "format": FORMAT_VERSION,
                     "hash": hash_hex, "namespace": namespace, "payload_bytes": layout.nbytes},
                    sort_keys=True, separators=(",", ":")).encode("utf-8")


def _utc(seconds: float) -> str:
  return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc).isoformat(
      timespec="seconds")


def _pid_runs(pid: int) -> bool:
  """Whether a process `pid` exists (one of another user counts: it may be writing)."""
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:
    return True
  return True


def _tmp_pid(name: str) -> int | None:
  """The writer's pid in a temporary file's name `<hash hex>.<pid>.<random hex>.tmp`."""
  parts = name.split(".")
  if len(parts) != 4 or not parts[1].isdigit():
    return None
  return int(parts[1])


def _block_hash(name: str, directory: str) -> bytes | None:
  """The hash of a block file name, None unless it is `<hash hex>.kvb` in its `<hh>` directory."""
  stem = name[:-len(BLOCK_SUFFIX)]
  try:
    block_hash = bytes.fromhex(stem)
  except ValueError:
    return None
  if not block_hash or stem != block_hash.hex() or stem[:2] != directory:
    return None
  return block_hash


def _unlink(path: str) -> None:
  """Removes a file another process may have removed first (or may be unable to remove)."""
  try:
    os.unlink(path)
  except OSError:
    pass


def _read_into(f, view: memoryview) -> bool:
  """Fills `view` from `f`; False when the file ends first."""
  done = 0
  while done < len(view):
    got = f.readinto(view[done:])
    if not got:
      return False
    done += got
  return True


def _write_parts(path: str, parts: Sequence) -> None:
  """Writes a new file of `parts` (bytes or byte arrays) in order, making its directory when
  missing (the first block of a directory, or a purge removed it)."""
  try:
    f = open(path, "wb")  # noqa: SIM115  (closed below: the retry needs the open apart)
  except FileNotFoundError:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    f = open(path, "wb")  # noqa: SIM115
  with f:
    f.writelines(parts)


def _write_atomic(path: str, data: bytes) -> None:
  tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
  try:
    _write_parts(tmp, [data])
    os.replace(tmp, path)
  except OSError:
    _unlink(tmp)
    raise


def _read_json(path: str) -> dict | None:
  """A JSON object file's contents; None when it is missing, unreadable or not an object."""
  try:
    with open(path, "rb") as f:
      value = json.loads(f.read())
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None


class DiskStore:
  """One namespace of KV blocks on disk: `write` queues a block for the writer thread, `read`
  returns it (or None), `changes` tells the scheduler what appeared and disappeared.

  `root` holds the namespaces (the engine's kv_disk_path), `namespace` names this one's
  directory (`namespace_name`), `layout` is every block's arrays, `budget_bytes` the most its
  files may take (least recently used evicted first), `info` what namespace.json records for
  the listing (the model, ...), `max_queue_blocks` how many blocks may wait for the writer
  before `write` drops them (a slow disk costs dropped writes, never a blocked caller)."""

  def __init__(self, root: str | os.PathLike, namespace: str, layout: BlockLayout,
               budget_bytes: int, info: Mapping[str, Any] = _NO_INFO,
               max_queue_blocks: int = 1024):
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
      raise ValueError(f"namespace {namespace!r}: letters, digits, '.', '_', '-' only, not "
                       "starting with '.'")
    if budget_bytes < 0:
      raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if max_queue_blocks < 1:
      raise ValueError(f"max_queue_blocks must be >= 1, got {max_queue_blocks}")
    self.root = os.fspath(root)
    self.namespace = namespace
    self.layout = layout
    self._layout_json = layout.as_json()
    self.budget_bytes = int(budget_bytes)
    self.max_queue_blocks = int(max_queue_blocks)
    self.directory = os.path.join(self.root, namespace)
    self._sizes: dict[int, int] = {}
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)
    self._index: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    self._bytes = 0
    # hash -> whether it was indexed at the previous `changes()` call (its first change since).
    self._changed: dict[bytes, bool] = {}
    self._queue: collections.deque[tuple[bytes, Any]] = collections.deque()
    self._queued: set[bytes] = set()
    self._busy = False
    self._stopped = False  # after a write error: nothing more is written
    self._closing = False
    self._counts = collections.Counter()
    self._seconds = collections.Counter()
    try:
      os.makedirs(self.directory, exist_ok=True)
      self._namespace_file(info)
    except OSError as e:
      self._stop(e)
    start = time.perf_counter()
    self._scan()
    self._seconds["index"] = time.perf_counter() - start
    with self._lock:
      self._evict_locked()
    self._thread = threading.Thread(target=self._writer, name=f"kv-disk-{namespace[:8]}",
                                    daemon=True)
    self._thread.start()

  # Sizes and paths.

  def _file_size(self, hash_len: int) -> int:
    """Bytes of a block file whose hash has `hash_len` bytes (the header holds its hex)."""
    size = self._sizes.get(hash_len)
    if size is None:
      header = header_bytes(self.namespace, self.layout, "0" * (2 * hash_len),
                            "0" * (2 * CHECKSUM_BYTES))
      size = self._sizes[hash_len] = _PREFIX_BYTES + len(header) + self.layout.nbytes
    return size

  @property
  def file_bytes(self) -> int:
    """Bytes of every block file of this namespace (for `HASH_BYTES`-byte hashes)."""
    return self._file_size(HASH_BYTES)

  def path(self, block_hash: bytes) -> str:
    name = block_hash.hex()
    return os.path.join(self.directory, name[:2], name + BLOCK_SUFFIX)

  # The index (callers hold the lock).

  def _add_locked(self, block_hash: bytes) -> None:
    if block_hash in self._index:
      self._index.move_to_end(block_hash)
      return
    self._index[block_hash] = None
    self._bytes += self._file_size(len(block_hash))
    self._changed.setdefault(block_hash, False)

  def _drop_locked(self, block_hash: bytes) -> None:
    if block_hash in self._index:
      del self._index[block_hash]
      self._bytes -= self._file_size(len(block_hash))
      self._changed.setdefault(block_hash, True)

  def _evict_locked(self) -> None:
    while self._index and self._bytes > self.budget_bytes:
      oldest = next(iter(self._index))
      self._drop_locked(oldest)
      _unlink(self.path(oldest))
      self._counts["evictions"] += 1

  # Start-up.

  def _namespace_file(self, info: Mapping[str, Any]) -> None:
    """Writes namespace.json once; refuses a namespace whose file records another layout (the
    caller's parts left out something that changes the blocks: its files would all read as
    torn here, and this store would delete them)."""
    path = os.path.join(self.directory, NAMESPACE_FILE)
    existing = _read_json(path)
    if existing is not None:
      if existing.get("layout", self._layout_json) != self._layout_json:
        raise ValueError(f"{self.directory} holds blocks of layout {existing['layout']}, not "
                         f"{self._layout_json}: the namespace's parts must include the layout")
      return
    doc = {"namespace": self.namespace, "format": FORMAT_VERSION, "layout": self._layout_json,
           "info": dict(info), "created": _utc(time.time())}
    _write_atomic(path, json.dumps(doc, indent=1, sort_keys=True, default=str).encode("utf-8"))

  def _scan(self) -> None:
    """Indexes the namespace's block files, oldest mtime first; removes torn files and the
    temporary files of writers that no longer run."""
    found = []
    total = 0
    live: dict[int, bool] = {}
    now = time.time()
    try:
      subdirs = [e for e in os.scandir(self.directory) if e.is_dir(follow_symlinks=False)]
    except OSError:
      subdirs = []
    for sub in subdirs:
      try:
        entries = list(os.scandir(sub.path))
      except OSError:
        continue
      for entry in entries:
        name = entry.name
        if name.endswith(BLOCK_SUFFIX):
          try:
            st = entry.stat()
          except OSError:
            continue  # removed meanwhile
          block_hash = _block_hash(name, sub.name)
          if block_hash is None or st.st_size != self._file_size(len(block_hash)):
            _unlink(entry.path)
            self._counts["corrupt"] += 1
            continue
          found.append((st.st_mtime_ns, name, block_hash))
          total += st.st_size
        elif name.endswith(TMP_SUFFIX):
          pid = _tmp_pid(name)
          if pid is not None and pid not in live:
            live[pid] = _pid_runs(pid)
          try:
            old = now - entry.stat().st_mtime > STALE_TMP_SECONDS
          except OSError:
            continue  # renamed into place meanwhile
          if pid is None or not live[pid] or old:
            _unlink(entry.path)
            self._counts["corrupt"] += 1
    found.sort()
    with self._lock:  # the index is empty still: filled at once, 100,000 files in a second
      self._index = collections.OrderedDict.fromkeys(block_hash for _, _, block_hash in found)
      self._bytes = total
      self._changed = dict.fromkeys(self._index, False)

  # Writing.

  def write(self, block_hash: bytes, arrays: Sequence[Any]) -> bool:
    """Queues a block for the writer thread and returns True at once; False (a dropped write)
    when writing has stopped, the queue is full or the hash is indexed or queued already.
    `arrays` are in layout order, anything `np.asarray` takes: a device array is copied to the
    host on the writer thread."""
    block_hash = bytes(block_hash)
    if not block_hash:
      raise ValueError("an empty block hash names no file")
    with self._cond:
      if (self._stopped or self._closing or len(self._queue) >= self.max_queue_blocks
          or block_hash in self._index or block_hash in self._queued):
        self._counts["writes_dropped"] += 1
        return False
      self._queue.append((block_hash, arrays))
      self._queued.add(block_hash)
      self._cond.notify_all()
    return True

  def _writer(self) -> None:
    # Below the steps' threads: on a machine whose cores the model's steps keep busy, the
    # writes take the gaps (Linux gives each thread its own nice value; elsewhere a no-op).
    try:
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):
      pass
    while True:
      with self._cond:
        while not self._queue and not self._closing:
          self._cond.wait()
        if not self._queue:
          return
        block_hash, arrays = self._queue.popleft()
        self._busy = True
      try:
        self._write_one(block_hash, arrays)
      except Exception as e:  # noqa: BLE001  (the writer thread outlives a bad block)
        self._write_failed(block_hash, e)
      finally:
        with self._cond:
          self._queued.discard(block_hash)
          self._busy = False
          self._cond.notify_all()

  def _write_failed(self, block_hash: bytes, error: Exception) -> None:
    """A block that cannot be written as given (wrong shapes or dtypes, an unconvertible
    object): a bug in the caller, counted and logged, and writing goes on."""
    _log.warning("kv disk store %s: block %s not written: %s", self.directory, block_hash.hex(),
                 error)
    with self._lock:
      self._counts["write_errors"] += 1

  def _write_one(self, block_hash: bytes, arrays: Sequence[Any]) -> None:
    arrays = [np.ascontiguousarray(np.asarray(a)) for a in arrays]
    self.layout.check(arrays)
    raw = [a.reshape(-1).view(np.uint8) for a in arrays]
    crc = 0
    for r in raw:
      crc = zlib.crc32(r, crc)
    name = block_hash.hex()
    header = header_bytes(self.namespace, self.layout, name, _crc_hex(crc))
    directory = os.path.join(self.directory, name[:2])
    tmp = os.path.join(directory, f"{name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    start = time.perf_counter()
    try:
      _write_parts(tmp, [MAGIC + _LENGTH.pack(len(header)) + header, *raw])
      os.replace(tmp, os.path.join(directory, name + BLOCK_SUFFIX))
    except OSError as e:
      _unlink(tmp)
      self._stop(e)
      return
    seconds = time.perf_counter() - start
    with self._lock:
      self._add_locked(block_hash)
      self._counts["blocks_written"] += 1
      self._counts["bytes_written"] += _PREFIX_BYTES + len(header) + self.layout.nbytes
      self._seconds["write"] += seconds
      self._evict_locked()

  def _stop(self, error: OSError) -> None:
    """Stops all writing after the first error, with one warning: a full or read-only disk
    stays so, and retrying every block would only repeat the error."""
    with self._cond:
      if self._stopped:
        return
      self._stopped = True
      self._counts["write_errors"] += 1
      self._counts["writes_dropped"] += len(self._queue)
      self._queue.clear()
      self._queued.clear()
      self._cond.notify_all()
    reason = errno.errorcode.get(error.errno, "") if error.errno else ""
    _log.warning("kv disk store: cannot write to %s (%s%s); blocks are no longer written to "
                 "disk, reads go on", self.directory, f"{reason}: " if reason else "",
                 error.strerror or error)

  # Reading.

  def read(self, block_hash: bytes) -> tuple[np.ndarray, ...] | None:
    """The block's arrays (layout shapes and dtypes, writable), or None: a miss when there is no
    file, and a removed corrupt file when any check fails."""
    block_hash = bytes(block_hash)
    path = self.path(block_hash)
    start = time.perf_counter()
    try:
      result = self._load(block_hash, path)
    except FileNotFoundError:
      with self._lock:
        self._counts["read_misses"] += 1
        self._drop_locked(block_hash)
      return None
    except OSError as e:
      result = f"unreadable: {e}"
    if isinstance(result, str):
      _log.debug("kv disk store: removing %s: %s", path, result)
      _unlink(path)
      with self._lock:
        self._counts["corrupt"] += 1
        self._drop_locked(block_hash)
      return None
    seconds = time.perf_counter() - start
    with self._lock:
      self._add_locked(block_hash)
      self._counts["reads"] += 1
      self._counts["read_bytes"] += self.layout.nbytes
      self._seconds["read"] += seconds
    try:
      os.utime(path)  # the recency a restart reads back
    except OSError:
      pass
    return result

  def _load(self, block_hash: bytes, path: str) -> tuple[np.ndarray, ...] | str:
    """The arrays of a block file, or why it is not a good one."""
    expected = self._file_size(len(block_hash))
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size != expected:
        return f"{size} bytes, not {expected}"
      prefix = f.read(_PREFIX_BYTES)
      if len(prefix) != _PREFIX_BYTES or prefix[:len(MAGIC)] != MAGIC:
        return "bad magic"
      (length,) = _LENGTH.unpack(prefix[len(MAGIC):])
      if length != expected - _PREFIX_BYTES - self.layout.nbytes:
        return f"header length {length}"
      try:
        header = json.loads(f.read(length))
      except ValueError:
        return "header is not JSON"
      if not isinstance(header, dict) or header.keys() != _HEADER_KEYS:
        return "header fields"
      for key, want in (("format", FORMAT_VERSION), ("namespace", self.namespace),
                        ("hash", block_hash.hex()), ("arrays", self._layout_json),
                        ("payload_bytes", self.layout.nbytes)):
        if header[key] != want:
          return f"header {key} is {header[key]!r:.80}"
      crc = 0
      arrays = []
      for (_, shape, _), dt in zip(self.layout.arrays, self.layout.dtypes):
        array = np.empty(shape, dt)
        raw = array.reshape(-1).view(np.uint8)
        if not _read_into(f, memoryview(raw)):
          return "payload ends early"
        crc = zlib.crc32(raw, crc)
        arrays.append(array)
    if _crc_hex(crc) != header["checksum"]:
      return "checksum"
    return tuple(arrays)

  # What the engine asks.

  def changes(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """(added, removed): hashes indexed now that were not at the previous call, and hashes
    indexed then that are not now. The first call reports what the start-up scan found."""
    with self._lock:
      changed, self._changed = self._changed, {}
      added = tuple(h for h, was in changed.items() if not was and h in self._index)
      removed = tuple(h for h, was in changed.items() if was and h not in self._index)
    return added, removed

  def discover(self, hashes: Sequence[bytes]) -> int:
    """Indexes the files of `hashes` that another process wrote since this store's scan, from
    the first on, stopping at the first with no file (a chain of prefix blocks is useful only
    up to its first gap); returns how many of `hashes` are indexed from the first on. Costs one
    `stat` per hash not indexed yet; a file found is checked when it is read."""
    count = 0
    for block_hash in hashes:
      block_hash = bytes(block_hash)
      with self._lock:
        known = block_hash in self._index
      if not known:
        try:
          if os.stat(self.path(block_hash)).st_size != self._file_size(len(block_hash)):
            break
        except OSError:
          break
        with self._lock:
          self._add_locked(block_hash)
      count += 1
    return count

  def __contains__(self, block_hash: object) -> bool:
    with self._lock:
      return block_hash in self._index

  def __len__(self) -> int:
    with self._lock:
      return len(self._index)

  def hashes(self) -> tuple[bytes, ...]:
    """The indexed hashes, least recently used first."""
    with self._lock:
      return tuple(self._index)

  @property
  def queue_depth(self) -> int:
    """Blocks waiting for the writer."""
    with self._lock:
      return len(self._queue)

  def flush(self, timeout: float | None = None) -> bool:
    """Waits until every queued block is written (or dropped); False when `timeout` passed
    first."""
    with self._cond:
      return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

  def close(self) -> None:
    """Writes what is queued, then stops the writer thread. Reads still work afterwards."""
    self.flush()
    with self._cond:
      self._closing = True
      self._cond.notify_all()
    self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def read_rate(self) -> float | None:
    """Bytes per second of the successful reads so far (None before the first)."""
    with self._lock:
      if not self._counts["reads"]:
        return None
      return self._counts["read_bytes"] / max(self._seconds["read"], 1e-9)

  def figures(self) -> dict[str, Any]:
    with self._lock:
      c, s = self._counts, self._seconds
      return {
          "disk_blocks": len(self._index), "disk_bytes": self._bytes,
          "disk_budget_bytes": self.budget_bytes, "disk_write_queue": len(self._queue),
          "disk_blocks_written": c["blocks_written"], "disk_bytes_written": c["bytes_written"],
          "disk_write_seconds": s["write"], "disk_writes_dropped": c["writes_dropped"],
          "disk_evictions": c["evictions"], "disk_corrupt_files": c["corrupt"],
          "disk_write_errors": c["write_errors"], "disk_reads": c["reads"],
          "disk_read_misses": c["read_misses"], "disk_read_bytes": c["read_bytes"],
          "disk_read_seconds": s["read"], "disk_index_seconds": s["index"],
          "disk_namespace": self.namespace,
      }


# The listing tool's side.

def _namespace_dirs(root: str | os.PathLike) -> list[str]:
  """The namespace directories under `root` (raises FileNotFoundError when it does not exist)."""
  with os.scandir(root) as entries:
    return sorted(e.name for e in entries
                  if e.is_dir(follow_symlinks=False) and _NAMESPACE.fullmatch(e.name))


def list_namespaces(root: str | os.PathLike) -> list[dict[str, Any]]:
  """One dict per namespace under `root`: namespace, info (what namespace.json records: the
  model, ...), format, created, blocks, bytes and last_use (the newest block mtime, ISO-8601
  UTC, None without blocks)."""
  out = []
  for name in _namespace_dirs(root):
    directory = os.path.join(root, name)
    doc = _read_json(os.path.join(directory, NAMESPACE_FILE)) or {}
    blocks = size = 0
    newest = None
    with os.scandir(directory) as subs:
      subdirs = [e.path for e in subs if e.is_dir(follow_symlinks=False)]
    for sub in subdirs:
      try:
        entries = list(os.scandir(sub))
      except OSError:
        continue
      for entry in entries:
        if not entry.name.endswith(BLOCK_SUFFIX):
          continue
        try:
          st = entry.stat()
        except OSError:
          continue
        blocks += 1
        size += st.st_size
        newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
    out.append({"namespace": name, "info": doc.get("info", {}), "format": doc.get("format"),
                "created": doc.get("created"), "blocks": blocks, "bytes": size,
                "last_use": None if newest is None else _utc(newest)})
  return out


def purge(root: str | os.PathLike, namespace: str | None = None) -> int:
  """Removes one namespace's directory, or every namespace's under `root` (None); returns how
  many were removed. A store still running on a removed namespace sees misses."""
  known = _namespace_dirs(root)
  if namespace is not None and namespace not in known:
    raise ValueError(f"no namespace {namespace!r} under {os.fspath(root)}; known: "
                     f"{', '.join(known) or 'none'}")
  names = known if namespace is None else [namespace]
  for name in names:
    shutil.rmtree(os.path.join(root, name))
  return len(names)
