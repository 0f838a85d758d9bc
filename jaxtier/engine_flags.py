"""`jaxtier.LLM`'s engine arguments as absl flags, with the same names, for the scripts.

Importing this module defines `--config` and the engine flags. A script calls
`prepare()` first thing in `main` and builds the engine with `jaxtier.LLM(**llm_kwargs())`. Flag values are checked when the command line is parsed, before any
model is loaded; importing this module does not import JAX.
"""

from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

from jaxtier import cpu_allocator

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "optional ml_collections config file whose fields "
                                "give defaults for the flags (flags given explicitly win)")
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name, HF directory, .gguf file or "
                    "Orbax directory")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
flags.DEFINE_integer("max_model_len", None, "context window; default: the model's", lower_bound=2)
flags.DEFINE_integer("max_num_seqs", 16, "requests generated together in one batch", lower_bound=1)
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "float32", "bfloat16"],
                  "KV cache dtype; auto: the model dtype")
flags.DEFINE_enum("layer_execution", "auto", ["auto", "scan", "unrolled"],
                  "how resident layers run; auto: unrolled on CPU, scan elsewhere")
flags.DEFINE_string("offload_tail_layers", "0", "last layers kept in pinned host memory and "
                    "streamed to the device every step: an int >= 0 or 'auto' (the offload "
                    "planner)")
flags.DEFINE_string("prefetch_depth", "auto", "layers the offloaded tail is fetched ahead: 1-4 or "
                    "'auto'")
flags.DEFINE_float("device_memory_gb", None, "device memory for offload_tail_layers=auto, GB; "
                   "default: what the device reports (nothing on CPU: auto offloads nothing)")

ENGINE_FLAGS = ("model", "dtype", "max_model_len", "max_num_seqs", "kv_cache_dtype",
                "layer_execution", "offload_tail_layers", "prefetch_depth", "device_memory_gb")
# prefetch_depth's bound is jaxtier.offload.prefetch.MAX_DEPTH, written out: that module loads JAX.
INT_OR_AUTO_RANGES = {"offload_tail_layers": (0, None), "prefetch_depth": (1, 4)}


def int_or_auto(name: str, value: Any) -> int | str:
  """`value` of flag `name` as an int in its range or "auto"; ValueError otherwise."""
  low, high = INT_OR_AUTO_RANGES[name]
  if value == "auto":
    return value
  try:
    number = int(value)
  except (TypeError, ValueError):
    raise ValueError("expected an integer or 'auto'") from None
  if number < low or (high is not None and number > high):
    expected = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"expected 'auto' or an integer {expected}")
  return number


def _checker(name: str):
  def check(value) -> bool:
    try:
      int_or_auto(name, value)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from None
    return True
  return check


for _name in INT_OR_AUTO_RANGES:
  flags.register_validator(_name, _checker(_name))
flags.register_validator("device_memory_gb", lambda v: v is None or v > 0,
                         "--device_memory_gb must be a positive number of GB")


def apply_config_defaults() -> None:
  """Copies --config fields into flags not given on the command line, then checks every flag."""
  if FLAGS.config is None:
    return
  for name, value in FLAGS.config.items():
    if name not in FLAGS:
      raise app.UsageError(f"--config field {name!r} is not a flag of this script")
    if not FLAGS[name].present:
      FLAGS[name].value = value
  try:
    FLAGS.validate_all_flags()
  except flags.IllegalFlagValueError as e:
    raise app.UsageError(str(e)) from None


def prepare() -> None:
  """What an engine script does first: warnings-only logging unless --verbosity is given, --config
  defaults applied and checked, and freed memory retained (`jaxtier.cpu_allocator`, before JAX
  starts its threads)."""
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  apply_config_defaults()
  cpu_allocator.retain_freed_memory()


def llm_kwargs() -> dict[str, Any]:
  """The engine flags as keyword arguments of `jaxtier.LLM` ("auto" kept where given)."""
  kwargs = {name: FLAGS[name].value for name in ENGINE_FLAGS}
  for name in INT_OR_AUTO_RANGES:
    kwargs[name] = int_or_auto(name, kwargs[name])
  return kwargs
