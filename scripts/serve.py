"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (streaming with
stream=true), /v1/models, /health and Prometheus /metrics.

  python scripts/serve.py --port=8000
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

One engine thread steps continuously: a request joins the running batch at the next step. At
start-up a warm-up thread compiles every program the engine can run (kept in JAX's persistent
compilation cache, --compilation_cache_dir, so a restart compiles nothing), its progress logged,
those of an ordinary request first: /health answers 503 until those exist, 200 after, while the
rest compile (reported in /metrics). Requests are served from the start, each compiling the
programs it needs ahead of the warm-up (a warm-up that fails before it is ready leaves /health at
503 with the reason, while requests are still served). One line logs the start-up's phases
(size, load, engine, compile, ready). The server logs at INFO unless --verbosity is given. SIGTERM (or Ctrl-C) stops
accepting requests, lets running ones finish for up to --shutdown_timeout_s, ends the rest with
finish_reason "abort" and exits 0; a second signal exits at once. Flag values are checked, and
the port taken, before the model is loaded: a port already in use ends the process at once.
"""

import importlib.util
import json
import os
import socket
import sys
import threading

from absl import app, flags, logging

from jaxtier.engine import flags as engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("served_model_name", None, "model name clients send and /v1/models lists; "
                    "default: --model")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
flags.DEFINE_integer("port", 8000, "port to listen on", lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("max_request_bytes", 4 * 1024 * 1024, "largest request body in bytes; a "
                     "larger one is answered 413 before it is read (default 4 MiB)", lower_bound=1)
flags.DEFINE_string("api_key", None, "when set, every route but /health requires the header "
                    "'Authorization: Bearer <key>' (401 otherwise); default: $JAXTIER_API_KEY")


def _api_key(flag_value: str | None) -> str | None:
  """--api_key, else $JAXTIER_API_KEY (empty counts as unset)."""
  return flag_value if flag_value is not None else os.environ.get("JAXTIER_API_KEY") or None


flags.register_validator(
    "api_key", lambda value: (key := _api_key(value)) is None or (
        key != "" and all(33 <= ord(c) <= 126 for c in key)),
    message="the API key (--api_key or $JAXTIER_API_KEY) must be printable ASCII without spaces")
engine_flags.define_flag("seed")  # LLM's seed: requests that send none get seeds from it
flags.DEFINE_integer("max_queued_requests", 1024, "most requests waiting for admission; more "
                     "get 429 with a Retry-After header", lower_bound=1)
flags.DEFINE_float("shutdown_timeout_s", 30.0, "on SIGTERM, how long running requests may still "
                   "run before they end with finish_reason 'abort'", lower_bound=0)
flags.DEFINE_boolean("warmup", True, "compile every program on a warm-up thread while serving, "
                     "an ordinary request's first, /health ok once those exist (else /health is "
                     "ok at once and the first request of each shape waits for its compile)")
flags.adopt_module_key_flags(engine_flags)  # --help lists the engine flags (and --seed)

def _draining_server(config, engine, timeout_s: float):
  """A uvicorn server whose first SIGTERM/SIGINT drains the engine (`AsyncEngine.drain`) before
  uvicorn shuts down, so the process exits 0; a second signal exits at once."""
  import uvicorn

  class DrainingServer(uvicorn.Server):

    def __init__(self):
      super().__init__(config)
      self.draining = False

    def handle_exit(self, sig, frame):
      if self.draining:
        self.should_exit = self.force_exit = True
        return
      self.draining = True
      logging.info("signal %d: draining (up to %.1f s)", sig, timeout_s)
      threading.Thread(target=self._drain, name="jaxtier-drain", daemon=True).start()

    def _drain(self):
      ended = engine.drain(timeout_s)
      logging.info("drained; %d request(s) ended with finish_reason 'abort'", ended)
      self.should_exit = True

  return DrainingServer()


def _listen(host: str, port: int) -> socket.socket:
  """A socket bound to host:port for uvicorn (it listens on it), taken before the model loads so
  that a port already in use ends the process in seconds, not after the load and warm-up."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise app.UsageError(f"--port={port}: cannot listen on {host}:{port}: {e.strerror} (is "
                         "another server running there?)") from None
  sock.set_inheritable(True)
  return sock


def _report_ready(engine) -> None:
  """Prints the start-up line once /health answers 200 (or why it never will)."""
  from jaxtier.engine import startup  # pylint: disable=g-import-not-at-top
  if engine.wait_ready():
    print(startup.startup_line(engine.engine.startup_figures()), file=sys.stderr, flush=True)
  elif engine.warmup_error is not None:
    print(f"warm-up failed: {engine.warmup_error} (/health answers 503)", file=sys.stderr,
          flush=True)


# The [server] extra: `pip install -e ".[server]"` (or `pip install "jaxtier[server]"`).
SERVER_EXTRA = ("fastapi", "uvicorn", "prometheus_client")


def _require_server_extra() -> None:
  """Ends the script with one line naming the [server] extra when a module of it is missing
  (--help works without it; the base install runs the batch job only)."""
  missing = [name for name in SERVER_EXTRA if importlib.util.find_spec(name) is None]
  if missing:
    print(f"serve.py: error: {', '.join(missing)} not installed; the server needs the [server] "
          "extra: pip install -e \".[server]\" (or pip install \"jaxtier[server]\")",
          file=sys.stderr)
    sys.exit(1)


def main(argv):
  del argv
  _require_server_extra()
  # The port first: taken in milliseconds, before JAX is imported (`prepare` turns on the
  # compilation cache) and long before the model loads.
  sock = None if FLAGS.dry_run else _listen(FLAGS.host, FLAGS.port)
  engine_flags.prepare()
  engine_flags.check_model(FLAGS.model)  # an unreadable --model: one line, before JAX starts
  if not FLAGS["verbosity"].present:  # the warm-up's progress and failures, a failed step
    logging.set_verbosity(logging.INFO)
  # Imported here so that a bad flag is reported without waiting for JAX to import.
  import uvicorn

  import jaxtier
  from jaxtier.server import AsyncEngine, create_app
  try:
    llm = jaxtier.LLM(**engine_flags.llm_kwargs(), seed=FLAGS.seed)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(f"memory: {json.dumps(llm.memory_report())}", file=sys.stderr)
  engine = AsyncEngine(llm, max_queued_requests=FLAGS.max_queued_requests, warmup=FLAGS.warmup)
  threading.Thread(target=_report_ready, args=(engine,), daemon=True).start()
  try:
    config = uvicorn.Config(create_app(engine, FLAGS.served_model_name or FLAGS.model,
                                       max_request_bytes=FLAGS.max_request_bytes,
                                       api_key=_api_key(FLAGS.api_key)),
                            host=FLAGS.host, port=FLAGS.port)
    _draining_server(config, engine, FLAGS.shutdown_timeout_s).run(sockets=[sock])
  finally:
    engine.close()


if __name__ == "__main__":
  app.run(main)
