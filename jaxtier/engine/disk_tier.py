"""The engine's disk tier: prefix KV blocks in files that outlive the process.

The files and their checks are `jaxtier.kvcache.disk.DiskStore`'s; the decisions are the
scheduler's (`jaxtier.scheduler.disk_index`). This module is the glue between them and the device:

- **Namespace.** A directory holds namespaces; an engine reads and writes only its own, named by a
  hash of everything its KV bytes depend on (`namespace_parts`): the weights' content (the
  checkpoint files' checksums, or a digest of the arrays of an in-memory model or of weights an
  update replaced), the model config, the compute dtype, the quantization, the kernels, the KV
  dtype, the block size and the KV layout (the host block's shapes, the tensor-parallel split),
  and the file format's version. Two engines see each other's blocks only when all of these are
  equal; `update_weights` moves the engine to the new weights' namespace.
- **Write-through.** A block registered on the device that the disk lacks is copied out to a
  pinned-host buffer of its own at the start of the next plan (before anything can overwrite
  it; the swap-out programs) and handed to the store's writer thread, which waits for the copy
  and writes the file off the step. Write-through rather than write-back (at eviction from the
  host tier): a block is on disk seconds after it was computed, so it survives a crash or a
  SIGTERM without a flush of every cached block at exit, and it costs one device-to-host copy
  per prompt block, once per namespace (the store skips hashes it holds).
- **Reads.** An arriving request whose next blocks (after its device and host hits) the disk
  holds is held in the queue while a reader thread reads and checks them in order into pinned
  host memory (`jax.device_put` to the host tier's placement), stopping at the first that fails
  (a miss: the store removes the file and counts it); then `DiskLoaded` books host blocks for
  those read, and the next plan's `disk_fills` puts them in the host tier, from where they load
  to the device as host-tier hits do.
- **Checksums of the weights** are cached per file under the disk directory
  (`checksums.json`, keyed by path, size and modification time), so a restart does not read the
  checkpoint twice.
"""

import atexit
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Hashable, Mapping, Sequence

import jax
import numpy as np

from jaxtier import scheduler
from jaxtier.kvcache import disk
from jaxtier.kvcache.paged import KVBlocks, PagedKVCache
from jaxtier.kvcache.swap import HostTier, host_block_shardings, host_block_specs

GB = 1e9
QUEUE_BYTES = 512 << 20  # blocks waiting for the writer, at most
_NAMES = ("k", "v", "k_scales", "v_scales")
_CHUNK = 1 << 24


def block_layout(cache: PagedKVCache) -> disk.BlockLayout:
  """What one host block holds: K and V (and int8 scales), [kv heads, layers, block, head dim]."""
  (spec,) = host_block_specs(cache, 1)
  return disk.BlockLayout(tuple(
      (name, tuple(a.shape), np.dtype(a.dtype).name)
      for name, a in zip(_NAMES, (spec.k, spec.v, spec.k_scales, spec.v_scales))
      if a is not None))


def file_digest(path: str, cache_path: str | None = None) -> str:
  """A checksum of the file or directory at `path` (every regular file under it, by relative
  path and content); a file's checksum is kept in the JSON file `cache_path`, keyed by its path,
  size and modification time, and reused while those are unchanged."""
  files = ([path] if os.path.isfile(path) else sorted(
      os.path.join(root, name) for root, _, names in os.walk(path) for name in names))
  known = {}
  if cache_path is not None and os.path.exists(cache_path):
    try:
      with open(cache_path, encoding="utf-8") as f:
        known = json.load(f)
    except (OSError, ValueError):
      known = {}
  total, changed = hashlib.blake2b(digest_size=16), False
  for name in files:
    stat = os.stat(name)
    key = f"{os.path.abspath(name)}|{stat.st_size}|{stat.st_mtime_ns}"
    if key not in known:
      h = hashlib.blake2b(digest_size=16)
      with open(name, "rb") as f:
        while chunk := f.read(_CHUNK):
          h.update(chunk)
      known[key], changed = h.hexdigest(), True
    total.update(os.path.relpath(name, path).encode() + b"\0" + known[key].encode())
  if changed and cache_path is not None:
    _write_json(cache_path, known)
  return total.hexdigest()


def arrays_digest(state) -> str:
  """A checksum of the arrays of `state` (an `nnx.State` or any pytree): paths, shapes, dtypes
  and contents."""
  h = hashlib.blake2b(digest_size=16)
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if not hasattr(leaf, "shape"):
      continue
    array = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)}|{array.shape}|{array.dtype}".encode())
    h.update(np.ascontiguousarray(array).view(np.uint8).data)
  return h.hexdigest()


def _write_json(path: str, value) -> None:
  directory = os.path.dirname(path) or "."
  with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp",
                                   encoding="utf-8") as f:
    json.dump(value, f)
  os.replace(f.name, path)


def namespace_parts(weights: str, model_config, settings: Mapping, cache: PagedKVCache) -> dict:
  """Everything the KV bytes of an engine depend on (see the module docstring)."""
  mesh = cache.device.k.sharding
  devices = len(getattr(mesh, "device_set", ())) or 1
  c = cache.config
  return {"weights": weights, "model": dataclasses.asdict(model_config), **dict(settings),
          "kv_cache_dtype": c.kv_cache_dtype, "block_size": c.block_size,
          "kv_layout": {"block": [list(a) for a in block_layout(cache).arrays],
                        "devices": devices}}


class DiskTier:
  """One engine's disk tier: the store of its namespace, a reader thread, the blocks read and
  waiting for their host blocks (see the module docstring)."""

  def __init__(self, path: str, gb: float, cache: PagedKVCache, parts: Mapping,
               info: Mapping):
    os.makedirs(path, exist_ok=True)
    self.path, self.budget_bytes = path, int(gb * GB)
    self.parts, self.info = dict(parts), dict(info)
    self._places = host_block_shardings(cache)
    self._layout = block_layout(cache)
    self._queue_blocks = max(16, QUEUE_BYTES // self._layout.nbytes)
    self.store = self._open()
    self._reader = concurrent.futures.ThreadPoolExecutor(1, "jaxtier-disk-read")
    self._reads: dict[Hashable, concurrent.futures.Future] = {}
    self.staged: dict[bytes, KVBlocks] = {}  # read, waiting for their host block
    # a batch job's blocks are written before the interpreter ends (the writer is a daemon)
    atexit.register(self._flush_at_exit)

  @property
  def namespace(self) -> str:
    return self.store.namespace

  def renamed(self, weights: str) -> scheduler.DiskIndexed:
    """Moves to the namespace of new weights (`Engine.update_weights`); returns the event that
    resets the scheduler's index to it."""
    self.store.close()
    self.parts = {**self.parts, "weights": weights}
    self.store = self._open()
    self.staged.clear()
    added, _ = self.store.changes()
    return scheduler.DiskIndexed(added=added, reset=True)

  def _open(self) -> disk.DiskStore:
    """The store of the current namespace; at most `QUEUE_BYTES` of blocks wait for its writer
    (pinned host buffers: the writes past it are dropped and counted, never a step slowed)."""
    return disk.DiskStore(self.path, disk.namespace_name(self.parts), self._layout,
                          self.budget_bytes, info=self.info, max_queue_blocks=self._queue_blocks)

  def changes(self) -> scheduler.DiskIndexed | None:
    """The store's index changes since the last call, as an event (None: none)."""
    added, removed = self.store.changes()
    return scheduler.DiskIndexed(added, removed) if added or removed else None

  # Reads.

  def read(self, request_id: Hashable, hashes: Sequence[bytes]) -> None:
    """Starts reading `hashes` (in order) for a held request."""
    self._reads[request_id] = self._reader.submit(self._read, tuple(hashes))

  def _read(self, hashes: tuple[bytes, ...]) -> tuple[tuple[bytes, ...], list[KVBlocks]]:
    names, blocks = [], []
    for block_hash in hashes:
      arrays = self.store.read(block_hash)
      if arrays is None:  # a miss: this block and the ones after it are recomputed
        break
      fields = dict(zip((name for name, _, _ in self._layout.arrays), arrays))
      blocks.append(KVBlocks(*(None if fields.get(name) is None else
                               jax.device_put(fields[name], getattr(self._places, name))
                               for name in _NAMES)))
      names.append(block_hash)
    return tuple(names), blocks

  def __contains__(self, request_id: Hashable) -> bool:
    return request_id in self._reads

  def __len__(self) -> int:
    return len(self._reads)

  def pending(self) -> set:
    return set(self._reads)

  def cancel(self, request_id: Hashable) -> None:
    future = self._reads.pop(request_id, None)
    if future is not None:
      future.cancel()

  def wait(self, timeout: float) -> None:
    """Waits until a read finishes, at most `timeout` seconds."""
    if self._reads:
      concurrent.futures.wait(list(self._reads.values()), timeout,
                              concurrent.futures.FIRST_COMPLETED)

  def finished(self) -> list[tuple[Hashable, tuple[bytes, ...]]]:
    """The requests whose reads finished, with the hashes read (their blocks staged)."""
    done = []
    for request_id, future in list(self._reads.items()):
      if not future.done():
        continue
      del self._reads[request_id]
      try:
        names, blocks = future.result()
      except Exception:  # pylint: disable=broad-except  # a failed read is a miss, not an error
        names, blocks = (), []
      self.staged.update(zip(names, blocks))
      done.append((request_id, names))
    return done

  def unstage(self, hashes) -> None:
    """Lets go of staged blocks the scheduler booked no host block for (the host index had
    them already, or the host pool had no room)."""
    for block_hash in hashes:
      self.staged.pop(block_hash, None)

  def fill(self, host: HostTier, fills: Sequence[tuple[bytes, int]]) -> HostTier:
    """The host tier with the staged blocks of `fills` (hash, host block) in their slots."""
    fills = [(h, b) for h, b in fills if h in self.staged]
    if not fills:
      return host
    return host.stored([b for _, b in fills], [self.staged.pop(h) for h, _ in fills])

  # Writes.

  def write(self, pairs: Sequence[tuple[int, bytes]], blocks: Sequence[KVBlocks]) -> None:
    """Hands copied-out blocks to the writer thread (it waits for their copies)."""
    for (_, block_hash), block in zip(pairs, blocks):
      self.store.write(block_hash, jax.tree.leaves(block))  # K, V (and scales): the layout's order

  def read_rate(self) -> float | None:
    return self.store.read_rate()

  def figures(self, block_size: int, loaded_blocks: int) -> dict:
    """The tier's figures for `stats()` (the store's, and the hits the scheduler counted)."""
    return {**self.store.figures(), "kv_disk_path": self.path,
            "disk_hit_blocks": loaded_blocks, "disk_hit_tokens": loaded_blocks * block_size,
            "disk_read_queue": len(self._reads), "disk_staged_blocks": len(self.staged)}

  def _flush_at_exit(self) -> None:
    self.store.flush(60.0)

  def close(self) -> None:
    """Writes what is queued, then stops the threads."""
    atexit.unregister(self._flush_at_exit)
    self._reader.shutdown(wait=True, cancel_futures=True)
    self.store.close()

