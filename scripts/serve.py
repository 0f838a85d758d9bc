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

from absl import app, flags

from jaxtier import engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("served_model_name", None, "model name clients send and /v1/models lists; "
                    "default: --model")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
flags.DEFINE_integer("port", 8000, "port to listen on", lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("seed", 0, "seeds the sampling seeds of requests that send none",
                     lower_bound=0)
flags.DEFINE_float("batch_wait_ms", 5.0, "a batch that is not full starts once no request has "
                   "arrived for this long (at most 20 such waits)", lower_bound=0)


def main(argv):
  del argv
  engine_flags.prepare()
  # Imported here so that a bad flag is reported without waiting for JAX to import.
  import uvicorn

  import jaxtier
  from jaxtier.server import AsyncEngine, create_app
  try:
    llm = jaxtier.LLM(**engine_flags.llm_kwargs(), seed=FLAGS.seed)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(f"memory: {json.dumps(llm.memory_report())}", file=sys.stderr)
  engine = AsyncEngine(llm, batch_wait_s=FLAGS.batch_wait_ms / 1e3)
  try:
    uvicorn.run(create_app(engine, FLAGS.served_model_name or FLAGS.model), host=FLAGS.host,
                port=FLAGS.port)
  finally:
    engine.close()


if __name__ == "__main__":
  app.run(main)
