"""Start-up as a new user meets it, as one JSON object: the server's programs, a cold start on an
empty compilation cache, warm restarts, a port already in use, and an offline workload's first
pass against its second.

  python scripts/bench_startup.py                       # the default model and server flags
  python scripts/bench_startup.py --sections=cold,warm  # some of the sections

  programs:  the default server configuration's warm-up list (`warmup_programs`), by kind.
  cold:      `scripts/serve.py` started on an empty compilation cache (JAX_COMPILATION_CACHE_DIR,
             a fresh folder): seconds from the process start until the first chat completion
             answers (sent as soon as the port accepts connections, max_tokens `--chat_tokens`),
             until /health answers 200, and until the warm-up has every program
             (jaxtier_warmup_programs_compiled in /metrics).
  warm:      the same server started `--warm_starts` times more on that cache: /health 200 seconds
             and the programs each start compiled, counted twice: the cache files it added (JAX
             writes one per program it compiles) and, where the server reports them, its own
             counts of programs compiled and loaded from the cache.
  port:      a server started on a port another socket holds: seconds until it exits, its exit
             status, and whether its message names the port.
  offline:   a fresh process (`LLM`, empty cache, then again with the cache it filled) runs one
             short request, then `--conversations` mixed-length chat conversations through
             `LLM.chat` twice, the same work (the prefix cache emptied before each pass):
             tokens/s of each pass, the programs each compiled (or loaded) and their ratio.

Every server is started as a user would (`python scripts/serve.py --port=...`) with the engine
flags given here, and stopped with SIGTERM.
"""

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from jaxtier.engine import flags as engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sections", ["programs", "cold", "warm", "port", "offline"], "sections to run")
flags.DEFINE_integer("warm_starts", 2, "warm restarts measured", lower_bound=1)
flags.DEFINE_integer("chat_tokens", 16, "tokens the cold start's chat request asks for",
                     lower_bound=1)
flags.DEFINE_integer("conversations", 24, "conversations of the offline workload", lower_bound=1)
flags.DEFINE_integer("offline_tokens", 256, "most tokens each offline conversation asks for",
                     lower_bound=1)
flags.DEFINE_float("timeout_s", 1200, "longest wait for a server or a worker", lower_bound=1)
flags.DEFINE_string("offline_worker", None, "internal: run the offline passes and print JSON")
flags.DEFINE_string("out", None, "also write the JSON object to this file")
flags.adopt_module_key_flags(engine_flags)

SERVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py")
CHAT = {"messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
        "temperature": 0}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def engine_argv() -> list[str]:
  return [f"--{name}={getattr(FLAGS, name)}" for name in engine_flags.ENGINE_FLAGS
          if FLAGS[name].present]


def metric_values(url: str) -> dict[str, float]:
  import httpx  # pylint: disable=g-import-not-at-top
  from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=g-import-not-at-top
  text = httpx.get(f"{url}/metrics", timeout=30).text
  return {s.name: s.value for family in text_string_to_metric_families(text)
          for s in family.samples}


def cache_files(cache: str) -> int:
  return sum(len(files) for _, _, files in os.walk(cache))


@contextlib.contextmanager
def server(cache: str, port: int | None = None, extra: tuple[str, ...] = ()):
  """A `serve.py` process on an unused port with JAX's cache at `cache`: (process, its url, its
  start time); stopped with SIGTERM on exit."""
  port = port or free_port()
  start = time.perf_counter()
  proc = subprocess.Popen([sys.executable, SERVE, f"--port={port}", *engine_argv(), *extra],
                          env={**os.environ, "JAX_COMPILATION_CACHE_DIR": cache},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  stderr: list[str] = []
  reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
  reader.start()
  try:
    yield proc, f"http://127.0.0.1:{port}", start, stderr
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(timeout=120)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=10)


def wait_for(proc, stderr, check, what: str) -> None:
  deadline = time.monotonic() + FLAGS.timeout_s
  while not check():
    if proc.poll() is not None:
      raise RuntimeError(f"serve.py exited before {what}: {''.join(stderr)[-2000:]}")
    if time.monotonic() > deadline:
      raise RuntimeError(f"no {what} within {FLAGS.timeout_s} s")
    time.sleep(0.1)


def healthy(url: str) -> bool:
  import httpx  # pylint: disable=g-import-not-at-top
  try:
    return httpx.get(f"{url}/health", timeout=5).status_code == 200
  except httpx.TransportError:
    return False


def warmed(url: str) -> bool:
  try:
    values = metric_values(url)
  except Exception:  # pylint: disable=broad-except  (not up yet)
    return False
  total = values.get("jaxtier_warmup_programs", 0)
  return total > 0 and values.get("jaxtier_warmup_programs_compiled") == total


def accepting(url: str) -> bool:
  import httpx  # pylint: disable=g-import-not-at-top
  try:
    httpx.get(f"{url}/v1/models", timeout=5)
    return True
  except httpx.TransportError:
    return False


def startup_line(stderr: list[str]) -> str | None:
  lines = [line.strip() for line in stderr if line.startswith(("start-up:", "ready:"))]
  return lines[-1] if lines else None


def compile_counts(url: str) -> dict:
  values = metric_values(url)
  return {name: values[metric + "_total"] for name, metric in
          (("compiled", "jaxtier_compile_programs_compiled"),
           ("cache_hits", "jaxtier_compile_cache_hits")) if metric + "_total" in values}


def cold_and_warm(sections) -> dict:
  """The cold start and the warm restarts, on one fresh cache folder."""
  import httpx  # pylint: disable=g-import-not-at-top
  out = {}
  with tempfile.TemporaryDirectory() as cache:
    with server(cache) as (proc, url, start, stderr):
      wait_for(proc, stderr, lambda: accepting(url), "an open port")
      accepted = time.perf_counter() - start
      chat = {}

      def first_chat():
        response = httpx.post(f"{url}/v1/chat/completions", timeout=FLAGS.timeout_s,
                              json={**CHAT, "max_tokens": FLAGS.chat_tokens})
        chat["seconds"] = time.perf_counter() - start
        chat["status"] = response.status_code

      sender = threading.Thread(target=first_chat)
      sender.start()
      wait_for(proc, stderr, lambda: healthy(url), "/health 200")
      health = time.perf_counter() - start
      sender.join(FLAGS.timeout_s)
      wait_for(proc, stderr, lambda: warmed(url), "every program compiled")
      out["cold"] = {"port_open_s": accepted, "first_chat_s": chat.get("seconds"),
                     "first_chat_status": chat.get("status"), "health_200_s": health,
                     "all_programs_s": time.perf_counter() - start,
                     "programs": metric_values(url).get("jaxtier_warmup_programs"),
                     "cache_files": cache_files(cache), **compile_counts(url)}
    out["cold"]["startup_line"] = startup_line(stderr)
    if "warm" not in sections:
      return out
    starts = []
    for _ in range(FLAGS.warm_starts):
      before = cache_files(cache)
      with server(cache) as (proc, url, start, stderr):
        wait_for(proc, stderr, lambda: healthy(url), "/health 200")
        health = time.perf_counter() - start
        wait_for(proc, stderr, lambda: warmed(url), "every program compiled")
        starts.append({"health_200_s": health, "all_programs_s": time.perf_counter() - start,
                       "new_cache_files": cache_files(cache) - before, **compile_counts(url)})
      starts[-1]["startup_line"] = startup_line(stderr)
    out["warm"] = starts
  return out


def port_section() -> dict:
  with socket.socket() as holder:
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    with tempfile.TemporaryDirectory() as cache:
      with server(cache, port) as (proc, _, start, stderr):
        try:
          rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
          rc = None
        seconds = time.perf_counter() - start
  message = "".join(stderr).strip().splitlines()
  return {"port": port, "exit_s": seconds, "returncode": rc,
          "names_the_port": any(str(port) in line for line in message),
          "message": message[-1] if message else None}


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
  """`n` chat conversations of one to three turns and 5 to 300 words, deterministic."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  words = ("the river north light stone garden market winter engine paper window story "
           "question answer music travel harbour mountain letter morning").split()
  out = []
  for _ in range(n):
    turns = []
    for turn in range(int(rng.integers(1, 4))):
      text = " ".join(rng.choice(words, int(rng.integers(5, 100 if turn else 300))))
      turns.append({"role": "user", "content": f"Summarize: {text}"})
      turns.append({"role": "assistant", "content": " ".join(rng.choice(words, 12))})
    out.append(turns[:-1])
  return out


def offline_worker(label: str) -> None:
  """In a fresh process: one short request, then two identical passes of the workload."""
  start = time.perf_counter()
  import jaxtier  # pylint: disable=g-import-not-at-top
  from jaxtier import SamplingParams  # pylint: disable=g-import-not-at-top
  llm = jaxtier.LLM(FLAGS.model, **{k: v for k, v in engine_flags.llm_kwargs().items()
                                    if k != "model"})
  loaded = time.perf_counter() - start
  llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, temperature=0),
           use_tqdm=False)
  warmed_up = time.perf_counter() - start
  convs = conversations(FLAGS.conversations)
  params = [SamplingParams(max_tokens=8 + (37 * i) % FLAGS.offline_tokens, temperature=0,
                           ignore_eos=True) for i in range(len(convs))]
  passes = []
  for _ in range(2):
    llm.reset_prefix_cache()  # the same work each pass: no prompt found cached from the last
    before = llm.engine.stats()
    t = time.perf_counter()
    outputs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    passes.append({"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
                   "compiled_variants": after["compiled_variants"] - before["compiled_variants"],
                   "compile_seconds": after["compile_seconds"] - before["compile_seconds"]})
  print(json.dumps({"label": label, "load_s": loaded, "after_short_request_s": warmed_up,
                    "passes": passes, "first_over_second": passes[0]["tok_s"] / passes[1]["tok_s"]}))


def offline_section() -> dict:
  out = {}
  with tempfile.TemporaryDirectory() as cache:
    for label in ("empty_cache", "filled_cache"):
      proc = subprocess.run([sys.executable, os.path.abspath(__file__),
                             f"--offline_worker={label}", *engine_argv(),
                             f"--conversations={FLAGS.conversations}",
                             f"--offline_tokens={FLAGS.offline_tokens}"],
                            env={**os.environ, "JAX_COMPILATION_CACHE_DIR": cache},
                            capture_output=True, text=True, timeout=FLAGS.timeout_s)
      if proc.returncode:
        raise RuntimeError(f"offline worker failed: {proc.stderr[-3000:]}")
      out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
  return out


def programs_section() -> dict:
  from jaxtier.engine import build  # pylint: disable=g-import-not-at-top
  from jaxtier.engine.args import EngineArgs  # pylint: disable=g-import-not-at-top
  from jaxtier.engine.engine import warmup_programs  # pylint: disable=g-import-not-at-top
  kwargs = engine_flags.llm_kwargs()
  plan = build.plan(kwargs["model"], EngineArgs(**kwargs))
  keys = warmup_programs(plan.engine_config, plan.config.vocab_size)
  return {"count": len(keys), "by_kind": dict(collections.Counter(k[0] for k in keys))}


def main(argv):
  del argv
  if FLAGS.offline_worker:
    engine_flags.prepare()
    offline_worker(FLAGS.offline_worker)
    return
  unknown = set(FLAGS.sections) - {"programs", "cold", "warm", "port", "offline"}
  if unknown:
    raise app.UsageError(f"--sections: unknown {sorted(unknown)}")
  result = {"model": FLAGS.model, "engine_args": engine_argv()}
  if "programs" in FLAGS.sections:
    result["programs"] = programs_section()
  if "cold" in FLAGS.sections or "warm" in FLAGS.sections:
    result.update(cold_and_warm(FLAGS.sections))
  if "port" in FLAGS.sections:
    result["port_in_use"] = port_section()
  if "offline" in FLAGS.sections:
    result["offline"] = offline_section()
  text = json.dumps(result, indent=1)
  print(text)
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
