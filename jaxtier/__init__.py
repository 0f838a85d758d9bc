"""jaxtier: JAX inference for LLMs that keeps working when device memory runs out.

The top-level names load lazily, so `import jaxtier.scheduler` (pure Python) does not import JAX.
"""

from importlib import import_module as _import_module

_EXPORTS = {"LLM": "jaxtier.llm", "RequestOutput": "jaxtier.llm", "CompletionOutput": "jaxtier.llm",
            "SamplingParams": "jaxtier.sampling", "Logprob": "jaxtier.logprobs"}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(_import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'jaxtier' has no attribute {name!r}")


def __dir__():
  """The public names and the subpackages imported so far (no helpers of this module)."""
  return sorted({n for n in globals() if not n.startswith("_")} | set(_EXPORTS) | {"__version__"})
