"""What the server tests share: a free loopback port and uvicorn serving an app in a thread."""

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
