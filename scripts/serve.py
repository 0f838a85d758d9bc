"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (streaming with
stream=true), /v1/models, /health and Prometheus /metrics.

  python scripts/serve.py --port=8000
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

Requests are run in batches of up to --max_num_seqs; requests that arrive while a batch runs wait
for the next one. Flag values are checked before the model is loaded.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "optional ml_collections config file whose fields "
                                "give defaults for the flags below (flags given explicitly win)")
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name, HF directory, .gguf file or "
                    "Orbax directory")
flags.DEFINE_string("served_model_name", None, "model name clients send and /v1/models lists; "
                    "default: --model")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
flags.DEFINE_integer("port", 8000, "port to listen on", lower_bound=1, upper_bound=65535)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
flags.DEFINE_integer("max_model_len", None, "context window; default: the model's", lower_bound=2)
flags.DEFINE_integer("max_num_seqs", 16, "requests generated together in one batch", lower_bound=1)
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "float32", "bfloat16"],
                  "KV cache dtype; auto: the model dtype")
flags.DEFINE_integer("seed", 0, "seeds the sampling seeds of requests that send none",
                     lower_bound=0)
flags.DEFINE_enum("layer_execution", "auto", ["auto", "scan", "unrolled"],
                  "how resident layers run; auto: unrolled on CPU, scan elsewhere")
flags.DEFINE_string("offload_tail_layers", "0", "last layers kept in pinned host memory and "
                    "streamed to the device every step: an int >= 0 or 'auto' (the offload "
                    "planner)")
flags.DEFINE_string("prefetch_depth", "auto", "layers the offloaded tail is fetched ahead: 1-4 or "
                    "'auto'")
flags.DEFINE_float("device_memory_gb", None, "device memory for offload_tail_layers=auto, GB; "
                   "default: what the device reports (nothing on CPU: auto offloads nothing)")

INT_OR_AUTO_RANGES = {"offload_tail_layers": (0, None), "prefetch_depth": (1, 4)}


def int_or_auto(name: str, value) -> int | str:
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


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  apply_config_defaults()
  # Imported here so that a bad flag is reported without waiting for JAX to import.
  import uvicorn

  import jaxtier
  from jaxtier.server import AsyncEngine, create_app
  try:
    llm = jaxtier.LLM(FLAGS.model, dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len,
                      max_num_seqs=FLAGS.max_num_seqs, kv_cache_dtype=FLAGS.kv_cache_dtype,
                      seed=FLAGS.seed, layer_execution=FLAGS.layer_execution,
                      offload_tail_layers=int_or_auto("offload_tail_layers",
                                                      FLAGS.offload_tail_layers),
                      prefetch_depth=int_or_auto("prefetch_depth", FLAGS.prefetch_depth),
                      device_memory_gb=FLAGS.device_memory_gb)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(f"memory: {json.dumps(llm.memory_report())}", file=sys.stderr)
  engine = AsyncEngine(llm)
  try:
    uvicorn.run(create_app(engine, FLAGS.served_model_name or FLAGS.model), host=FLAGS.host,
                port=FLAGS.port)
  finally:
    engine.close()


if __name__ == "__main__":
  app.run(main)
