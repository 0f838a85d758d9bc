"""README.md's examples run as written.

Every ```python block runs on its own in a fresh interpreter from the repository root (its own
imports, no names from other blocks). A block that needs several devices names them in its fence
info string or first line (`tensor_parallel`, with a `..._size=N` or `device_count=N` in it) and
runs on that many fake CPU devices; one that needs several processes (`distributed`,
`num_processes`) or an accelerator (`cuda`, `tpu`) is skipped where it cannot run. ```bash blocks
run too, except those that install packages, start a server, or need other processes or hosts.
Files a block writes into the repository root (a trace, an output file) are removed after it.

The blocks share the persistent compilation cache of the test session (JAX_COMPILATION_CACHE_DIR,
set in conftest.py), so a rerun skips their compiles.
"""

import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TIMEOUT_S = 400
DEVICE_MARKERS = ("tensor_parallel",)
PROCESS_MARKERS = ("distributed", "num_processes")
ACCELERATOR_MARKERS = {"cuda": "gpu", "tpu": "tpu"}  # marker -> jax.default_backend()
SKIPPED_BASH = {"pip install": "installs packages", "serve.py": "starts a server",
                "curl ": "needs a server", "--num_processes": "starts several processes",
                "/path/to/": "needs a model path of your own", "/shared/": "needs other hosts"}
_FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks(kind: str) -> list[tuple[int, str, str]]:
  """(line, fence info, code) of every ```kind block of README.md."""
  with open(README) as f:
    text = f.read()
  return [(text.count("\n", 0, m.start()) + 1, m.group(2).strip(), m.group(3))
          for m in _FENCE.finditer(text) if m.group(1) == kind]


def _header(info: str, code: str) -> str:
  """The fence info string and the block's first line, where its requirements are named."""
  return f"{info} {code.splitlines()[0] if code.strip() else ''}"


def _fake_devices(header: str) -> int:
  sizes = [int(n) for n in re.findall(r"(?:_size|device_count)=(\d+)", header)]
  return max(sizes, default=4)


def _names(markers, header: str) -> bool:
  """Whether `header` names one of `markers` as a word (`tpu` is not in `outputs`)."""
  return any(re.search(rf"\b{m}", header) for m in markers)


def _skip_reason(kind: str, header: str, code: str) -> str | None:
  wanted = {backend for m, backend in ACCELERATOR_MARKERS.items() if _names([rf"{m}\b"], header)}
  if wanted:
    import jax  # pylint: disable=import-outside-toplevel
    if jax.default_backend() not in wanted:
      return f"needs an accelerator ({header.strip()})"
  if _names(PROCESS_MARKERS, header):
    return f"needs several processes ({header.strip()})"
  if kind == "bash":
    return next((why for needle, why in SKIPPED_BASH.items() if needle in code), None)
  return None


def _environment(header: str) -> dict[str, str]:
  env = dict(os.environ)
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  if "xla_force_host_platform_device_count" in header:  # a block that fakes CPU devices itself
    env["JAX_PLATFORMS"] = "cpu"
  if _names(DEVICE_MARKERS, header):
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                        f"{_fake_devices(header)}").strip()
  return env


def _run(kind: str, line: int, info: str, code: str) -> None:
  header = _header(info, code)
  reason = _skip_reason(kind, header, code)
  if reason:
    pytest.skip(f"README.md:{line}: {reason}")
  before = set(os.listdir(ROOT))
  command = [sys.executable, "-c", code] if kind == "python" else ["bash", "-euo", "pipefail",
                                                                   "-c", code]
  start = time.perf_counter()
  try:
    done = subprocess.run(command, cwd=ROOT, env=_environment(header), capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)
  finally:
    for name in set(os.listdir(ROOT)) - before:  # what the block wrote (names it mentions)
      if name.split(".")[0] in code and os.path.isfile(os.path.join(ROOT, name)):
        os.remove(os.path.join(ROOT, name))
  seconds = time.perf_counter() - start
  assert done.returncode == 0, (f"README.md:{line} ({kind} block) exited {done.returncode} after "
                                f"{seconds:.0f} s:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
  print(f"README.md:{line}: {seconds:.1f} s\n{done.stdout[-800:]}")  # shown with -s


@pytest.mark.parametrize("line, info, code", readme_blocks("python"),
                         ids=[f"line{b[0]}" for b in readme_blocks("python")])
def test_python_block_runs(line, info, code):
  _run("python", line, info, code)


@pytest.mark.parametrize("line, info, code", readme_blocks("bash"),
                         ids=[f"line{b[0]}" for b in readme_blocks("bash")])
def test_bash_block_runs(line, info, code):
  _run("bash", line, info, code)


def test_readme_has_python_blocks_of_its_own():
  blocks = readme_blocks("python")
  assert len(blocks) >= 8
  assert all("import" in code for _, _, code in blocks)  # each block brings its own imports
