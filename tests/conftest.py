"""Shared fixtures: tiny Hugging Face checkpoints (in git), the real default model (fetched once) and
the CPU kernels (built once)."""

import os

import pytest

# Compiled programs persist across test processes and runs (the scripts' subprocess tests compile
# the same shapes); set before JAX is imported.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(__file__), "..", ".pytest_cache", "jax-compilation"))

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
DEFAULT_MODEL = "smollm2-135m-instruct"


def fixture_path(*parts: str) -> str:
  return os.path.join(FIXTURES, *parts)


@pytest.fixture(scope="session")
def smollm_llm():
  """The default model as a `jaxtier.LLM`, loaded once for the whole session (float32, its GGUF
  blocks kept and multiplied with the default `block_activations`)."""
  import jaxtier
  return jaxtier.LLM(DEFAULT_MODEL, max_model_len=2048)


@pytest.fixture(scope="session")
def built_cpu_kernels():
  """The CPU kernels (`jaxtier.kernels.cpu.library`), built (or found in the kernel cache) once for
  the whole session, before the first test that uses it: this process keeps the library it loaded,
  so no later test builds it again, even one that points JAXTIER_CACHE_DIR elsewhere. Skips where no
  C++ compiler exists; a build that fails is a failure, not a fallback to the XLA paths."""
  from jaxtier.kernels.cpu import library as cpu_kernels
  if cpu_kernels._compiler() is None:
    pytest.skip("no C++ compiler to build the CPU kernels")
  if not cpu_kernels.available():
    pytest.fail(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
  return cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
  """After each test file, drops the programs compiled for it (`runner.release_programs`). Kept
  for the whole run, their executables' memory mappings passed vm.max_map_count near the end of
  the suite and the next executable loaded crashed the process. A later file that needs a
  program compiles it again."""
  yield
  from jaxtier.engine import runner  # pylint: disable=import-outside-toplevel
  runner.release_programs()
