"""Modules that moved keep their old import paths for one release: the old path imports the
module at its new path (the same module object) with a DeprecationWarning naming the new path,
and `from <old path> import <name>` gives the same objects."""

import json
import os
import subprocess
import sys

import jaxtier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = """
import importlib, json, sys, warnings
import jaxtier
out = {}
for old, new in jaxtier._MOVED_MODULES.items():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    module = importlib.import_module(old)
  notes = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
  out[old] = {"same": module is importlib.import_module(new), "notes": notes,
              "spec": module.__spec__.name}
from jaxtier.kvcache.paged_attention import paged_attention_gathered, tpu_kernel_fits
from jaxtier.engine_args import EngineArgs
from jaxtier.cpu_kernels import available
import jaxtier.attention.xla_gathered, jaxtier.attention.pallas_tpu, jaxtier.engine.args
import jaxtier.kernels.cpu.library
out["names"] = [
    paged_attention_gathered is jaxtier.attention.xla_gathered.paged_attention_gathered,
    tpu_kernel_fits is jaxtier.attention.pallas_tpu.tpu_kernel_fits,
    EngineArgs is jaxtier.engine.args.EngineArgs,
    available is jaxtier.kernels.cpu.library.available]
print(json.dumps(out))
"""


def test_old_module_paths_import_the_new_modules_with_a_deprecation_note():
  proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                        timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out.pop("names") == [True] * 4
  assert set(out) == set(jaxtier._MOVED_MODULES)  # pylint: disable=protected-access
  for old, new in jaxtier._MOVED_MODULES.items():  # pylint: disable=protected-access
    assert out[old]["same"], old
    assert out[old]["spec"] == new, old  # the module keeps its own spec
    assert any(f"{old} moved to {new}" in note for note in out[old]["notes"]), (old, out[old])
