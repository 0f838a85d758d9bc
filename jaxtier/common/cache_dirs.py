"""Where jaxtier keeps what it builds or downloads: one cache directory for every layer.

`$JAXTIER_CACHE_DIR`, else `~/.cache/jaxtier`. The registry puts model weights under `models/`, the
CPU kernels their library under `kernels/`, the scripts compiled programs under `xla/`. A leaf
module (standard library only) so that the kernels, at the bottom of the import graph, need not
import the checkpoint package to find it.
"""

import os


def cache_dir() -> str:
  """The cache directory, read from the environment on every call (tests point it elsewhere)."""
  return os.environ.get("JAXTIER_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxtier"))
