"""Shared fixtures: tiny Hugging Face checkpoints (in git) and the real default model (fetched once)."""

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
