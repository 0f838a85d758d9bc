"""What the server tests share: a free loopback port, uvicorn serving an app in a thread, waiting
for a server process to answer /health, and a warmed-up engine."""

import contextlib
import socket
import threading
import time

import uvicorn


def free_port() -> int:
  """A port on 127.0.0.1 that nothing listens on (as of now)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_on_localhost(app):
  """Serves `app` with uvicorn on a free loopback port in a thread; yields the port."""
  port = free_port()
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 30
    while not server.started:
      assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
      time.sleep(0.05)
    yield port
  finally:
    server.should_exit = True
    thread.join(timeout=30)


def wait_until_healthy(proc, url: str, timeout_s: float = 240) -> None:
  """Waits until the server process `proc` (scripts/serve.py) answers 200 at `url`/health."""
  import httpx  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout_s
  while True:
    assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
    try:
      if httpx.get(f"{url}/health").status_code == 200:
        return
    except httpx.TransportError:
      pass
    time.sleep(0.2)


@contextlib.contextmanager
def warm_engine(llm):
  """An `AsyncEngine` over `llm` once its warm-up has finished; closed on exit."""
  from jaxtier.server import AsyncEngine  # pylint: disable=g-import-not-at-top
  engine = AsyncEngine(llm)
  try:
    assert engine.wait_warm(timeout_s=300), "warm-up did not finish"
    yield engine
  finally:
    engine.close()


@contextlib.contextmanager
def cold_app(llm, model_name: str):
  """The HTTP app over an `AsyncEngine` of `llm` that compiles programs when first needed (no
  warm-up); the engine is closed on exit."""
  from jaxtier.server import AsyncEngine, create_app  # pylint: disable=g-import-not-at-top
  engine = AsyncEngine(llm, warmup=False)
  try:
    yield create_app(engine, model_name)
  finally:
    engine.close()
