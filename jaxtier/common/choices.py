"""The fixed value sets of engine arguments whose owners need JAX: the platforms, the model's
dtypes with their bytes per value, the compact-weight quantizations, how kept blocks multiply and
how offloaded experts run. Standard library only: written once here, so that
`jaxtier.engine.args` checks them before JAX loads and every layer reads the same sets (the KV
cache dtypes are `kv_bytes.ELEMENT_BYTES`' names, the attention implementations
`jaxtier.attention.names`', the scheduler's policies `jaxtier.scheduler`'s)."""

from jaxtier.common.checks import check_choice

# `Machine.platform`s, and the JAX platform names that are one of them.
PLATFORMS = ("cpu", "gpu", "tpu")
PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
# Parameter and activation dtypes -> bytes per value.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# What the offload planner and the expert cost model price, which plan models jaxtier does not
# run too: the model dtypes and float16.
PLANNED_DTYPE_BYTES = {**DTYPE_BYTES, "float16": 2}
# `quantization`: a float checkpoint's projections quantized on load (None: as stored).
QUANTIZATIONS = ("int8", "int4", "fp8")
# `quantization_group_size`: the input rows of one int4 scale and minimum.
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
# `block_activations`: how kept GGUF blocks multiply (`jaxtier.kernels.cpu.matmul`).
BLOCK_ACTIVATIONS = ("float32", "int16")
# `expert_offload_mode`: offloaded experts streamed to the device or computed on the host
# (`jaxtier.offload.expert_cost`), or "auto", the cost model's choice per call.
EXPERT_OFFLOAD_MODES = ("auto", "stream", "host")


def check_dtype(name: str, dtype, planned: bool = False) -> None:
  """Raises ValueError naming `name` unless `dtype` is a model dtype (a name of DTYPE_BYTES; with
  `planned`, of PLANNED_DTYPE_BYTES)."""
  check_choice(name, dtype, tuple(PLANNED_DTYPE_BYTES if planned else DTYPE_BYTES))


def check_quantization(quantization, group_size: int = QUANTIZATION_GROUP_SIZES[0],
                       optional: bool = True) -> None:
  """The one check of `quantization` (one of QUANTIZATIONS, or None where `optional`) and its
  group size."""
  if quantization is not None or not optional:
    check_choice("quantization", quantization, QUANTIZATIONS)
  check_choice("quantization_group_size", group_size, QUANTIZATION_GROUP_SIZES)
