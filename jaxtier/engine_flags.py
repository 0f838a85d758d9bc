"""`jaxtier.LLM`'s engine arguments as absl flags, with the same names, for the scripts.

Importing this module defines `--config` and the engine flags. A script calls `prepare()` first
thing in `main` and builds the engine with `jaxtier.LLM(**llm_kwargs())`. Flag values are checked
together (`jaxtier.engine_args.EngineArgs`) when the command line is parsed, before any model is
loaded; importing this module does not import JAX.
"""

import os
import sys
from typing import Any, NoReturn

from absl import flags, logging
from ml_collections import config_flags

from jaxtier import cpu_allocator, engine_args

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "optional ml_collections config file whose fields "
                                "give defaults for the flags (flags given explicitly win)")
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name, HF directory, .gguf file or "
                    "Orbax directory")
flags.DEFINE_enum("dtype", "float32", list(engine_args.DTYPES), "parameter dtype")
flags.DEFINE_integer("max_model_len", None, "context window; default: the model's")
flags.DEFINE_integer("max_num_seqs", 64, "most requests running at once")
flags.DEFINE_integer("max_num_batched_tokens", None, "token budget of one step (decodes plus "
                     "prefill chunks); default: max(2048, max_num_seqs)")
flags.DEFINE_integer("block_size", 16, "tokens per KV block")
flags.DEFINE_integer("num_device_blocks", None, "device KV pool in blocks (or "
                     "--kv_cache_memory_gb)")
flags.DEFINE_float("kv_cache_memory_gb", None, "device KV pool in GB; default: device memory left "
                   "after weights, or on CPU room for max_num_seqs requests of min(max_model_len, "
                   f"{engine_args.CPU_DEFAULT_REQUEST_TOKENS}) tokens, at most "
                   f"{engine_args.CPU_DEFAULT_KV_GB * 1000:g} MB and at least one max_model_len "
                   "sequence")
flags.DEFINE_integer("num_host_blocks", None, "pinned-host KV pool in blocks (or --swap_space_gb); "
                     "default: as many as the device pool (on CPU with the default device pool: "
                     f"{engine_args.CPU_DEFAULT_HOST_FRACTION:g} of it)")
flags.DEFINE_float("swap_space_gb", None, "pinned-host KV pool in GB")
flags.DEFINE_float("gpu_memory_utilization", 0.9, "share of device memory the default KV pool "
                   "sizing may fill")
flags.DEFINE_enum("kv_cache_dtype", "auto", list(engine_args.KV_CACHE_DTYPES),
                  "KV cache dtype; auto: the model dtype; int8 keeps a float32 scale per token")
flags.DEFINE_enum("preemption_mode", "swap", ["swap", "recompute"], "what happens to a preempted "
                  "request's KV: moved to the host pool, or dropped and prefilled again")
flags.DEFINE_float("watermark", 0.01, "share of device KV blocks kept free for running requests")
flags.DEFINE_string("victim_policy", "longest_waiting", "which running request is preempted first: "
                    "longest_waiting, closest_to_finish or shortest_predicted_remaining")
flags.DEFINE_bool("enable_prefix_caching", True, "reuse the KV of full prompt blocks earlier "
                  "requests computed (shared system prompts, earlier chat turns)")
flags.DEFINE_bool("host_prefix_caching", True, "keep prefix blocks evicted from the device in the "
                  "host pool and load them back on a hit")
flags.DEFINE_bool("async_scheduling", True, "plan and dispatch the next decode step before this "
                  "one's tokens are read, overlapping host and device work (same tokens)")
flags.DEFINE_enum("layer_execution", "auto", list(engine_args.LAYER_EXECUTIONS),
                  "how resident layers run; auto: unrolled on CPU, scan elsewhere")
flags.DEFINE_string("offload_tail_layers", "0", "last layers kept in pinned host memory and "
                    "streamed to the device every step: an int >= 0 or 'auto' (the offload "
                    "planner)")
flags.DEFINE_string("prefetch_depth", "auto", "layers the offloaded tail is fetched ahead: 1-4 or "
                    "'auto'")
flags.DEFINE_float("device_memory_gb", None, "device memory for offload_tail_layers=auto and the "
                   "default KV pool, GB; default: what the device reports (nothing on CPU)")
flags.DEFINE_integer("tensor_parallel_size", 1, "devices the model and KV pools are sharded over "
                     "(tensor parallel, split by heads; must divide the model's kv heads)")
flags.DEFINE_string("trace_path", None, "append a per-step JSONL trace of the engine here (read "
                    "by scripts/doctor.py)")
flags.DEFINE_enum("attention_impl", "auto", list(engine_args.ATTENTION_IMPLS), "paged attention: "
                  "cpu (C++ kernels over the paged pool, built on first use), xla, pallas (GPU "
                  "decode steps); "
                  "auto: cpu on one CPU device when a C++ compiler is found, else xla")
flags.DEFINE_enum("weight_format", "auto", list(engine_args.WEIGHT_FORMATS), "auto: a GGUF "
                  "file's quantized weights (Q4_0/1, Q5_0/1, Q8_0 and the k-quants Q2_K-Q6_K) "
                  "stay in blocks where the CPU kernels multiply them (2.7-5x fewer bytes per step; "
                  "see --block_activations); float: dequantize every weight on load")
flags.DEFINE_enum("block_activations", "auto", list(engine_args.BLOCK_ACTIVATIONS), "how "
                  "the kept blocks multiply: int16 (inputs quantized per 32 values, integer "
                  "block sums: faster, logits within ~3e-3), float32 (bit for bit the "
                  "dequantized model), or auto: int16 where the CPU kernels have integer vector "
                  "products (AVX2 or AVX-512), else float32")
flags.DEFINE_string("chat_template", None, "chat template for chat requests instead of the "
                    "model's: a .jinja file path or the template itself (as vLLM's "
                    "--chat-template); default: the model's")

# `seed` stays with each script: the batch job's --seed seeds its records' sampling.
ENGINE_FLAGS = tuple(name for name in engine_args.ARG_NAMES if name != "seed")


def usage_error(message: str) -> NoReturn:
  """Ends the script with one line on stderr, `<script>: error: <message>`, and exit status 2."""
  print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
  sys.exit(2)


def apply_config_defaults() -> None:
  """Copies --config fields into flags not given on the command line, then checks every flag."""
  if FLAGS.config is None:
    return
  for name, value in FLAGS.config.items():
    if name not in FLAGS:
      usage_error(f"--config field {name!r} is not a flag of this script")
    if not FLAGS[name].present:
      FLAGS[name].value = value
  try:
    FLAGS.validate_all_flags()
  except flags.IllegalFlagValueError as e:
    usage_error(str(e))


def prepare() -> None:
  """What an engine script does first: warnings-only logging unless --verbosity is given, --config
  defaults applied, the engine flags checked together (`EngineArgs`; a bad value is one line),
  freed memory retained (`jaxtier.cpu_allocator`, before JAX starts its threads; in one arena
  when offloading), and compiled programs kept on disk (`enable_compilation_cache`)."""
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  apply_config_defaults()
  try:
    args = engine_args.EngineArgs(**llm_kwargs())
  except ValueError as e:
    usage_error(str(e))
  # One arena for every thread only where a step's temporaries may be whole layers (an offloaded
  # tail, or "auto"): it makes the host thread's dispatch contend with XLA's threads for the lock.
  cpu_allocator.retain_freed_memory(single_arena=args.offload_tail_layers != 0)
  enable_compilation_cache()


def enable_compilation_cache() -> None:
  """Keeps compiled programs on disk (JAX's persistent compilation cache) in the model cache's
  `xla/` folder, unless JAX_COMPILATION_CACHE_DIR chooses another: a rerun of a script skips the
  compiles of every shape it ran before (seconds each on CPU)."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  import jax  # pylint: disable=g-import-not-at-top  (JAX loads only once a script runs)
  from jaxtier.checkpoint import registry  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_compilation_cache_dir", os.path.join(registry.cache_dir(), "xla"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def llm_kwargs() -> dict[str, Any]:
  """The engine flags as keyword arguments of `jaxtier.LLM` (the model included, as `model`)."""
  kwargs = {name: FLAGS[name].value for name in ENGINE_FLAGS}
  for name, low, high in (("offload_tail_layers", 0, None),
                          ("prefetch_depth", 1, engine_args.MAX_PREFETCH_DEPTH)):
    kwargs[name] = engine_args.int_or_auto(name, kwargs[name], low, high)
  return kwargs
