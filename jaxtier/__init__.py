"""jaxtier: JAX inference for LLMs that keeps working when device memory runs out.

The top-level names load lazily, so `import jaxtier.scheduler` (pure Python) does not import JAX.

Modules that moved keep their old import paths for one release: `import jaxtier.engine_args`
(or any old path listed below) imports the new module under the old name, with a
DeprecationWarning that names the new path.
"""

import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
import warnings as _warnings
from importlib import import_module as _import_module

_EXPORTS = {"LLM": "jaxtier.llm", "RequestOutput": "jaxtier.llm", "CompletionOutput": "jaxtier.llm",
            "SamplingParams": "jaxtier.sampling", "Logprob": "jaxtier.sampling.logprobs",
            "rollout_arrays": "jaxtier.llm"}

# Old module path -> where it lives now (deprecated paths, kept for one release).
_MOVED_MODULES = {
    "jaxtier.batch_input": "jaxtier.batch.reader",
    "jaxtier.batch_output": "jaxtier.batch.files",
    "jaxtier.buckets": "jaxtier.common.buckets",
    "jaxtier.cache_dirs": "jaxtier.common.cache_dirs",
    "jaxtier.checks": "jaxtier.common.checks",
    "jaxtier.config": "jaxtier.model.config",
    "jaxtier.cpu_allocator": "jaxtier.kernels.cpu.heap",
    "jaxtier.cpu_kernels": "jaxtier.kernels.cpu.library",
    "jaxtier.detokenize": "jaxtier.text.detokenize",
    "jaxtier.engine.batch": "jaxtier.engine.step_inputs",
    "jaxtier.engine.logprobs": "jaxtier.engine.logprob_requests",
    "jaxtier.engine_args": "jaxtier.engine.args",
    "jaxtier.engine_flags": "jaxtier.engine.flags",
    "jaxtier.generate": "jaxtier.engine.padded",
    "jaxtier.kv_bytes": "jaxtier.common.kv_bytes",
    "jaxtier.kvcache.attention": "jaxtier.attention.dense",
    "jaxtier.kvcache.paged_attention": "jaxtier.attention",
    "jaxtier.kvcache.paged_attention_gpu": "jaxtier.attention.pallas_gpu",
    "jaxtier.kvcache.quant": "jaxtier.attention.page_format",
    "jaxtier.logprobs": "jaxtier.sampling.logprobs",
    "jaxtier.matmul": "jaxtier.kernels.cpu.matmul",
    "jaxtier.moe": "jaxtier.model.moe",
    "jaxtier.outputs": "jaxtier.engine.outputs",
    "jaxtier.quant": "jaxtier.model.quant",
    "jaxtier.rotary": "jaxtier.model.rotary",
    "jaxtier.scheduler.config": "jaxtier.scheduler.scheduler_config",
    "jaxtier.server.detokenize": "jaxtier.server.stream_text",
    "jaxtier.server.logprobs": "jaxtier.server.openai_logprobs",
    "jaxtier.server.metrics": "jaxtier.server.prometheus",
    "jaxtier.server.tools": "jaxtier.server.tool_calls",
    "jaxtier.sharding": "jaxtier.model.sharding",
    "jaxtier.softcap": "jaxtier.model.softcap",
    "jaxtier.structured": "jaxtier.sampling.structured",
    "jaxtier.tokenizer": "jaxtier.text.tokenizer",
    "jaxtier.tools.doctor": "jaxtier.engine.doctor",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


class _MovedModules(_abc.MetaPathFinder, _abc.Loader):
  """Imports a module's old path as the module at its new path (the same module object)."""

  def find_spec(self, name, path=None, target=None):
    del path, target
    return _util.spec_from_loader(name, self) if name in _MOVED_MODULES else None

  def create_module(self, spec):
    new = _MOVED_MODULES[spec.name]
    _warnings.warn(f"{spec.name} moved to {new}; the old path will be removed in the next "
                   "release", DeprecationWarning, stacklevel=2)
    module = _import_module(new)
    self._spec = module.__spec__  # importlib sets the alias's spec on it; put the real one back
    return module

  def exec_module(self, module):
    module.__spec__ = self._spec


if not any(isinstance(f, _MovedModules) for f in _sys.meta_path):
  _sys.meta_path.insert(0, _MovedModules())


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(_import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'jaxtier' has no attribute {name!r}")


def __dir__():
  """The public names and the subpackages imported so far (no helpers of this module)."""
  return sorted({n for n in globals() if not n.startswith("_")} | set(_EXPORTS) | {"__version__"})
