"""Tests of the on-disk KV block store (jaxtier/kvcache/disk.py) and scripts/kv_disk.py: round
trips and restarts, every kind of bad file as a removed miss, start-up clean-up, the LRU budget,
write errors, two processes sharing a directory, namespaces, and the listing tool."""

import errno
import inspect
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxtier.kvcache import disk

ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(ROOT, "scripts", "kv_disk.py")
MODULE = os.path.join(ROOT, "jaxtier", "kvcache", "disk.py")
SHAPE = (2, 3, 4, 8)
BF16 = disk.BlockLayout((("k", SHAPE, "bfloat16"), ("v", SHAPE, "bfloat16")))
INT8 = disk.BlockLayout((("k", SHAPE, "int8"), ("v", SHAPE, "int8"),
                         ("k_scales", (2, 3, 4), "float32"), ("v_scales", (2, 3, 4), "float32")))
NS = "a" * 32
TICK = 0.015  # longer than the file system's mtime granularity (4 ms on ext4)



def block(layout, i):
  """Block `i`'s arrays: the same in this process and in the writer processes of the sharing test
  (which run this function's source)."""
  rng = np.random.default_rng(i)
  return tuple(np.asarray(rng.integers(-100, 100, shape) * 0.37, np.float32).astype(dtype)
               for _, shape, dtype in layout.arrays)


def h(i: int) -> bytes:
  return i.to_bytes(16, "big")


def store(tmp_path, layout=BF16, namespace=NS, blocks=1000, **kwargs) -> disk.DiskStore:
  return disk.DiskStore(tmp_path, namespace, layout, budget_bytes=blocks * file_bytes(layout),
                        **kwargs)


def file_bytes(layout, namespace=NS) -> int:
  header = disk.header_bytes(namespace, layout, "0" * 32, "0" * (2 * disk.CHECKSUM_BYTES))
  return 8 + len(header) + layout.nbytes


def same(got, want) -> bool:
  """Bit for bit (bfloat16 compared as its 16-bit patterns)."""
  return len(got) == len(want) and all(
      g.dtype == w.dtype and g.shape == w.shape
      and g.tobytes() == np.ascontiguousarray(w).tobytes() for g, w in zip(got, want))


def files(tmp_path, namespace=NS, suffix=".kvb") -> set[str]:
  base = tmp_path / namespace
  return {p.name for p in base.glob(f"*/*{suffix}")}


def write_all(s, indices, layout=BF16) -> None:
  for i in indices:
    assert s.write(h(i), block(layout, i))
  assert s.flush(timeout=10)


# The layout.

def test_layout_sizes_and_names_the_mismatch():
  assert BF16.nbytes == 2 * 192 * 2
  assert INT8.nbytes == 2 * 192 + 2 * 24 * 4
  arrays = block(BF16, 0)
  BF16.check(arrays)
  with pytest.raises(ValueError, match="2 arrays for a block layout of 4"):
    INT8.check(arrays)
  with pytest.raises(ValueError, match="'v' has shape"):
    BF16.check((arrays[0], arrays[1][:1]))
  with pytest.raises(ValueError, match="'k' has dtype float32"):
    BF16.check((arrays[0].astype(np.float32), arrays[1]))
  with pytest.raises(ValueError, match="unknown dtype"):
    disk.BlockLayout((("k", (1,), "bfloat17"),))
  assert disk.BlockLayout.of({"k": arrays[0], "v": arrays[1]}) == BF16


# Round trips and restarts.

@pytest.mark.parametrize("layout", [BF16, INT8], ids=["bfloat16", "int8"])
def test_roundtrip_and_restart(tmp_path, layout):
  s = store(tmp_path, layout)
  assert s.changes() == ((), ())
  assert s.read_rate() is None
  write_all(s, range(4), layout)
  for i in range(4):
    got = s.read(h(i))
    assert same(got, block(layout, i))
    assert all(a.flags.writeable for a in got)
  assert s.changes() == (tuple(h(i) for i in range(4)), ())
  f = s.figures()
  assert (f["disk_blocks"], f["disk_blocks_written"], f["disk_reads"]) == (4, 4, 4)
  assert f["disk_bytes"] == 4 * s.file_bytes == 4 * file_bytes(layout)
  assert f["disk_read_bytes"] == 4 * layout.nbytes and s.read_rate() > 0
  assert sorted(os.path.getsize(tmp_path / NS / n[:2] / n) for n in files(tmp_path)) == [
      s.file_bytes] * 4
  s.close()
  s.close()  # idempotent

  again = store(tmp_path, layout)
  added, removed = again.changes()
  assert set(added) == {h(i) for i in range(4)} and removed == ()
  assert len(again) == 4 and h(2) in again
  for i in range(4):
    assert same(again.read(h(i)), block(layout, i))
  assert again.figures()["disk_corrupt_files"] == 0
  assert again.read(h(99)) is None and again.figures()["disk_read_misses"] == 1
  again.close()


def test_write_converts_on_the_writer_thread_and_drops_what_it_cannot_queue(tmp_path):
  """`write` returns at once: the conversion (a device transfer for a JAX array) runs on the
  writer thread; a full queue or a known hash drops the write."""
  release = threading.Event()
  threads = []

  class Slow:
    def __init__(self, array):
      self.array = array

    def __array__(self, dtype=None, copy=None):
      threads.append(threading.current_thread())
      release.wait(10)
      return self.array

  s = store(tmp_path, max_queue_blocks=2)
  k, v = block(BF16, 0)
  assert s.write(h(0), (Slow(k), v))
  deadline = time.monotonic() + 10
  while not threads and time.monotonic() < deadline:  # the writer took block 0
    time.sleep(0.001)
  assert s.write(h(1), block(BF16, 1)) and s.write(h(2), block(BF16, 2))
  assert s.queue_depth == 2
  assert not s.write(h(3), block(BF16, 3))  # the queue is full
  assert not s.write(h(1), block(BF16, 1))  # queued already
  release.set()
  assert s.flush(timeout=10)
  assert threads and threading.current_thread() not in threads
  assert not s.write(h(0), block(BF16, 0))  # indexed already
  f = s.figures()
  assert f["disk_writes_dropped"] == 3 and f["disk_blocks_written"] == 3
  assert same(s.read(h(0)), (k, v))
  s.close()
  assert not s.write(h(5), block(BF16, 5))


def test_a_block_file_appears_whole_by_rename(tmp_path, monkeypatch):
  """What keeps readers (of any process) from seeing a partial file: each file is complete under
  a temporary name in its final directory before one rename puts it in place."""
  renames = []
  real = os.replace

  def spy(src, dst):
    renames.append((src, dst, os.path.getsize(src), os.path.exists(dst)))
    real(src, dst)

  s = store(tmp_path)
  monkeypatch.setattr(disk.os, "replace", spy)
  write_all(s, range(3))
  monkeypatch.undo()
  assert [dst for _, dst, _, _ in renames] == [s.path(h(i)) for i in range(3)]
  for src, dst, size, existed in renames:
    assert os.path.dirname(src) == os.path.dirname(dst) and src.endswith(".tmp")
    assert f".{os.getpid()}." in os.path.basename(src)
    assert size == s.file_bytes and not existed
  s.close()


def test_mismatched_arrays_are_a_write_error(tmp_path):
  s = store(tmp_path)
  k, v = block(BF16, 0)
  assert s.write(h(0), (k, v[:1]))
  assert s.flush(timeout=10)
  assert s.figures()["disk_write_errors"] == 1 and h(0) not in s and not files(tmp_path)
  write_all(s, [1])  # writing goes on
  assert same(s.read(h(1)), block(BF16, 1))
  s.close()


# Bad files.

def rewrite_namespace(data: bytes, namespace: str) -> bytes:
  (length,) = struct.unpack("<I", data[4:8])
  header = json.loads(data[8:8 + length])
  header["namespace"] = namespace
  text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
  assert len(text) == length
  return data[:8] + text + data[8 + length:]


CORRUPTIONS = {
    "flipped_payload_byte": lambda d: d[:-1] + bytes([d[-1] ^ 1]),
    "flipped_header_byte": lambda d: d[:20] + bytes([d[20] ^ 0x40]) + d[21:],
    "truncated": lambda d: d[:-1],
    "extended": lambda d: d + b"\0",
    "other_namespace": lambda d: rewrite_namespace(d, "b" * 32),
    "garbage": lambda d: bytes(np.random.default_rng(0).integers(0, 256, len(d), np.uint8)),
    "bad_magic": lambda d: b"JXKW" + d[4:],
    "empty": lambda d: b"",
}


@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS))
def test_bad_file_is_a_removed_miss(tmp_path, corrupt):
  s = store(tmp_path)
  write_all(s, range(2))
  s.changes()
  path = s.path(h(0))
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(CORRUPTIONS[corrupt](data))
  assert s.read(h(0)) is None
  assert not os.path.exists(path)
  f = s.figures()
  assert f["disk_corrupt_files"] == 1 and f["disk_read_misses"] == 0 and f["disk_reads"] == 0
  assert h(0) not in s and s.changes() == ((), (h(0),))
  assert same(s.read(h(1)), block(BF16, 1))
  s.close()


def test_file_removed_by_another_process_is_a_miss(tmp_path):
  s = store(tmp_path)
  write_all(s, range(2))
  s.changes()
  os.unlink(s.path(h(1)))
  assert s.read(h(1)) is None
  f = s.figures()
  assert f["disk_read_misses"] == 1 and f["disk_corrupt_files"] == 0
  assert s.changes() == ((), (h(1),)) and len(s) == 1
  s.close()


def test_start_up_removes_torn_files_and_dead_writers_temporaries(tmp_path):
  s = store(tmp_path)
  write_all(s, range(3))
  s.close()
  torn = s.path(h(1))
  with open(torn, "r+b") as f:
    f.truncate(s.file_bytes - 5)
  directory = os.path.dirname(s.path(h(7)))
  os.makedirs(directory, exist_ok=True)
  child = subprocess.Popen(["true"])
  child.wait()
  dead = os.path.join(directory, f"{h(7).hex()}.{child.pid}.0a1b2c3d.tmp")
  live = os.path.join(directory, f"{h(8).hex()}.{os.getpid()}.0a1b2c3d.tmp")
  for path in (dead, live):
    with open(path, "wb") as f:
      f.write(b"JXKV partial")

  again = store(tmp_path)
  assert not os.path.exists(torn) and not os.path.exists(dead) and os.path.exists(live)
  assert again.figures()["disk_corrupt_files"] == 2
  assert set(again.changes()[0]) == {h(0), h(2)}
  assert again.figures()["disk_index_seconds"] > 0
  again.close()


def test_layout_the_namespace_did_not_record_is_refused(tmp_path):
  store(tmp_path).close()
  with pytest.raises(ValueError, match="must include the layout"):
    store(tmp_path, INT8)


# The budget.

def test_budget_evicts_least_recently_used_and_restart_keeps_the_order(tmp_path):
  s = store(tmp_path, blocks=5)
  for i in range(5):
    write_all(s, [i])
    time.sleep(TICK)
  s.changes()
  assert s.read(h(0)) is not None  # now the most recently used
  time.sleep(TICK)
  write_all(s, [5])
  assert s.changes() == ((h(5),), (h(1),))  # the least recently used went first
  for i in range(6, 12):
    time.sleep(TICK)
    write_all(s, [i])
    time.sleep(TICK)
    assert s.read(h(0)) is not None
  order = (h(8), h(9), h(10), h(11), h(0))
  assert s.hashes() == order
  assert files(tmp_path) == {x.hex() + ".kvb" for x in order}
  f = s.figures()
  assert f["disk_evictions"] == 7 and f["disk_bytes"] == 5 * s.file_bytes <= f["disk_budget_bytes"]
  s.close()

  again = store(tmp_path, blocks=5)
  assert again.hashes() == order
  again.close()
  smaller = store(tmp_path, blocks=2)  # a lower budget evicts at start-up, oldest first
  assert smaller.hashes() == order[-2:] and smaller.figures()["disk_evictions"] == 3
  assert files(tmp_path) == {x.hex() + ".kvb" for x in order[-2:]}
  smaller.close()


# Write errors.

def test_write_error_stops_writing_with_one_warning(tmp_path, monkeypatch, caplog):
  s = store(tmp_path)
  write_all(s, [0])

  def full(src, dst):
    raise OSError(errno.ENOSPC, "No space left on device", dst)

  monkeypatch.setattr(disk.os, "replace", full)
  caplog.set_level(logging.WARNING, logger=disk.__name__)
  for i in (1, 2, 3):
    s.write(h(i), block(BF16, i))
  assert s.flush(timeout=10)
  monkeypatch.undo()
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1
  assert "ENOSPC" in warnings[0].getMessage() and str(tmp_path / NS) in warnings[0].getMessage()
  f = s.figures()
  assert f["disk_write_errors"] == 1 and f["disk_blocks_written"] == 1
  assert not files(tmp_path, suffix=".tmp")  # the temporary file is gone
  assert not s.write(h(4), block(BF16, 4))  # writing has stopped
  assert same(s.read(h(0)), block(BF16, 0))  # reads go on
  assert len(s) == 1
  s.close()
  assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


# Sharing a directory.

CHILD = """
import importlib.util, os, sys, time
import numpy as np
spec = importlib.util.spec_from_file_location("kv_disk_store", sys.argv[1])
disk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(disk)
""" + inspect.getsource(block) + """
root, go, ready = sys.argv[2], sys.argv[3], sys.argv[4]
layout = disk.BlockLayout((("k", (4, 8, 16, 64), "bfloat16"), ("v", (4, 8, 16, 64), "bfloat16")))
store = disk.DiskStore(root, "shared", layout, budget_bytes=1 << 30)
open(ready, "w").close()
while not os.path.exists(go):
  time.sleep(0.0005)
blocks = [block(layout, i) for i in range(50)]
for i in range(50):
  assert store.write(i.to_bytes(16, "big"), blocks[i])
good = set()
while True:  # reads race this process's writer and the other process's, until one round after
  written = store.flush(timeout=0)  # this process's writes are all in place
  for i in set(range(50)) - good:
    got = store.read(i.to_bytes(16, "big"))
    if got is not None:
      assert all(g.tobytes() == w.tobytes() for g, w in zip(got, blocks[i])), i
      good.add(i)
  if written:
    break
  time.sleep(0.001)
store.close()
f = store.figures()
assert len(good) == 50, sorted(set(range(50)) - good)
assert f["disk_write_errors"] == 0 and f["disk_corrupt_files"] == 0, f
assert f["disk_blocks_written"] == 50, f
"""


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
  """(stdout, stderr) of a child; killed (and the test failed) when it runs past `timeout`."""
  try:
    return process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    process.communicate()
    raise


def test_two_processes_write_the_same_blocks(tmp_path):
  root = tmp_path / "kv"
  go = tmp_path / "go"
  children = [subprocess.Popen([sys.executable, "-c", CHILD, MODULE, str(root), str(go),
                                str(tmp_path / f"ready{n}")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for n in range(2)]
  try:
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{n}").exists() for n in range(2)):
      assert time.monotonic() < deadline and all(c.poll() is None for c in children)
      time.sleep(0.005)
    go.touch()
    for c in children:
      out, _ = finish(c, 60)
      assert c.returncode == 0, out
  finally:
    for c in children:
      if c.poll() is None:
        c.kill()
        c.wait()
  layout = disk.BlockLayout((("k", (4, 8, 16, 64), "bfloat16"),
                             ("v", (4, 8, 16, 64), "bfloat16")))
  assert len(files(root, "shared")) == 50 and not files(root, "shared", ".tmp")
  s = disk.DiskStore(root, "shared", layout, budget_bytes=1 << 30)
  assert len(s) == 50
  for i in range(50):
    assert same(s.read(h(i)), block(layout, i))
  assert s.figures()["disk_corrupt_files"] == 0
  s.close()


# Namespaces.

def test_namespace_changes_with_every_part(monkeypatch):
  parts = {"model": "smollm2-135m", "kv_cache_dtype": "bfloat16", "block_size": 16}
  name = disk.namespace_name(parts)
  assert len(name) == 32 and int(name, 16) >= 0
  assert disk.namespace_name(dict(reversed(parts.items()))) == name
  for key, other in (("model", "smollm2-360m"), ("kv_cache_dtype", "int8"), ("block_size", 32)):
    assert disk.namespace_name({**parts, key: other}) != name
  assert disk.namespace_name({**parts, "extra": None}) != name
  monkeypatch.setattr(disk, "FORMAT_VERSION", disk.FORMAT_VERSION + 1)
  assert disk.namespace_name(parts) != name


def test_a_store_never_reads_another_namespace_file(tmp_path):
  a = store(tmp_path, namespace="a" * 32)
  b = store(tmp_path, namespace="b" * 32)
  write_all(a, [0])
  assert a.file_bytes == b.file_bytes
  os.makedirs(os.path.dirname(b.path(h(0))), exist_ok=True)
  shutil.copyfile(a.path(h(0)), b.path(h(0)))
  assert b.read(h(0)) is None
  assert not os.path.exists(b.path(h(0))) and b.figures()["disk_corrupt_files"] == 1
  assert same(a.read(h(0)), block(BF16, 0))
  a.close()
  b.close()


def test_bad_namespace_name_is_refused(tmp_path):
  for bad in ("", "../up", "a/b", ".hidden"):
    with pytest.raises(ValueError, match="namespace"):
      disk.DiskStore(tmp_path, bad, BF16, budget_bytes=1)


# The listing tool.

def two_namespaces(tmp_path) -> tuple[str, str]:
  a, b = disk.namespace_name({"model": "m1"}), disk.namespace_name({"model": "m2"})
  with disk.DiskStore(tmp_path, a, BF16, 1 << 20, info={"model": "m1"}) as s:
    write_all(s, range(3))
  with disk.DiskStore(tmp_path, b, INT8, 1 << 20, info={"model": "m2"}) as s:
    write_all(s, range(2), INT8)
  return a, b


def test_list_and_purge(tmp_path):
  a, b = two_namespaces(tmp_path)
  rows = {r["namespace"]: r for r in disk.list_namespaces(tmp_path)}
  assert set(rows) == {a, b}
  assert rows[a]["info"] == {"model": "m1"} and rows[a]["format"] == disk.FORMAT_VERSION
  assert rows[a]["blocks"] == 3 and rows[a]["bytes"] == 3 * file_bytes(BF16, a)
  assert rows[b]["blocks"] == 2 and rows[b]["last_use"].endswith("+00:00")
  with pytest.raises(ValueError, match=f"known: {min(a, b)}, {max(a, b)}"):
    disk.purge(tmp_path, "c" * 32)
  assert disk.purge(tmp_path, a) == 1
  assert [r["namespace"] for r in disk.list_namespaces(tmp_path)] == [b]
  assert disk.purge(tmp_path) == 1 and disk.list_namespaces(tmp_path) == []


def script(*args) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_script_lists_purges_and_refuses_a_missing_directory(tmp_path):
  """One test, its listings run side by side: each run of the script starts JAX."""
  a, b = two_namespaces(tmp_path / "kv")
  kv, nowhere = tmp_path / "kv", tmp_path / "nowhere"
  runs = [script(f"--path={kv}", "--json"), script(f"--path={kv}"), script(f"--path={nowhere}")]
  (listing, err), (table, _), (_, missing) = [finish(r) for r in runs]
  assert [r.returncode for r in runs] == [0, 0, 1], err
  assert missing.strip() == f"kv_disk: error: {nowhere} does not exist"
  rows = {r["namespace"]: r for r in json.loads(listing)}
  assert rows[a]["info"]["model"] == "m1" and rows[a]["blocks"] == 3
  assert rows[b]["info"]["model"] == "m2" and rows[b]["blocks"] == 2
  head, *lines = table.splitlines()
  assert head.split() == ["namespace", "model", "format", "blocks", "bytes", "last", "use"]
  by_name = {line.split()[0]: line.split() for line in lines}
  assert by_name[a][1:5] == ["m1", "1", "3", f"{3 * file_bytes(BF16, a) / 1024:.1f}"]
  assert by_name[a][5] == "KiB" and by_name[b][1:4] == ["m2", "1", "2"]
  purge = script(f"--path={kv}", "--purge=all")
  purged, err = finish(purge)
  assert purge.returncode == 0, err
  assert a in purged and b in purged and "3 blocks" in purged
  assert disk.list_namespaces(kv) == []
