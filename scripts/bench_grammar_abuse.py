"""Adversarial structured-output constraints sent to a running server, as any client could send
them; prints one JSON object (logs go to stderr).

Starts `scripts/serve.py --model=... --port=<free port> <--server_flags>` and waits for /health 200
(the server compiles its programs first: minutes), or targets `--url`. Sections:
  stall:   a plain streamed /v1/completions (80 tokens, greedy, ignore_eos): time to first token
           and to the last token alone (median of 3), then again while a chat completion with
           `structured_outputs.choice` of `--big_choice` random strings, sent just before it, is
           in flight; the ratio, and the big request's status and seconds.
  cases:   each sent once on /v1/completions (max_tokens 16): choices of `--big_choice` and
           `--huge_choice` strings, a JSON schema `--deep_schema` levels deep, a schema
           `{"enum": [--enum_size strings]}`, the invalid regex `(unclosed`, the ambiguous regex
           `(a|aa)*(b|bb)*c{1000}`, an unknown field in structured_outputs: status, seconds, and
           the error message and param of a 4xx.
  memory:  the server's RSS after the first and the last of `--memory_requests` constrained
           requests (a fresh `--big_choice` list and a mid-size JSON schema, alternating); only
           when this script started the server.
  fuzz:    `--fuzz` constraints from a seeded generator (half JSON schemas, half regexes, some
           invalid), `--concurrency` at a time, max_tokens 8: statuses by code, 5xx, hangs (no
           answer within `--timeout_s`), lost requests (connection errors), seconds.
`--sections` picks some of them. The script exits 0 whatever the server answers, 1 when the
server does not start. A fuzz failure is listed with its index: `Fuzzer(--seed).constraint(i)`,
called for i = 0, 1, ... in order, makes it again.

  python scripts/bench_grammar_abuse.py --model=smollm2-135m-instruct
  python scripts/bench_grammar_abuse.py --model=tests/fixtures/tiny_llama_chat --fuzz=40 \\
      --big_choice=2000 --server_flags=--max_model_len=256
  python scripts/bench_grammar_abuse.py --url=http://127.0.0.1:8000 --fuzz=200
"""

import asyncio
import collections
import json
import logging
import os
import random
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time

import httpx
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "--model of the server this script starts")
SECTIONS = ("stall", "cases", "memory", "fuzz")
flags.DEFINE_list("sections", list(SECTIONS), "sections to run, in this order")
flags.register_validator("sections", lambda value: set(value) <= set(SECTIONS),
                         message=f"--sections: each must be one of {', '.join(SECTIONS)}")
flags.DEFINE_string("url", None, "base URL of a running server (e.g. http://127.0.0.1:8000); "
                    "default: start scripts/serve.py")
flags.DEFINE_list("server_flags", [], "more flags for scripts/serve.py, comma-separated "
                  "(e.g. --max_model_len=256,--max_num_seqs=8)")
flags.DEFINE_integer("fuzz", 1000, "generated constraints of the fuzz section", lower_bound=0)
flags.DEFINE_float("timeout_s", 60.0, "seconds a request may take before it counts as a hang",
                   lower_bound=0.1)
flags.DEFINE_integer("seed", 0, "seed of the random strings, schemas and regexes")
flags.DEFINE_integer("big_choice", 50_000, "strings of the big choice (stall, cases, memory)",
                     lower_bound=1)
flags.DEFINE_integer("huge_choice", 150_000, "strings of the huge choice case", lower_bound=1)
flags.DEFINE_integer("deep_schema", 2_000, "nesting depth of the deep JSON schema case",
                     lower_bound=1)
flags.DEFINE_integer("enum_size", 100_000, "strings of the enum schema case", lower_bound=1)
flags.DEFINE_integer("memory_requests", 20, "constrained requests of the memory section",
                     lower_bound=1)
flags.DEFINE_integer("concurrency", 8, "fuzz requests in flight at once", lower_bound=1)
flags.DEFINE_float("startup_timeout_s", 1800.0, "how long to wait for /health 200",
                   lower_bound=1)

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
JSON_HEADERS = {"content-type": "application/json"}
LEAD_S = 0.05  # how long before the plain stream the big choice request is sent
MESSAGE_CHARS = 300  # error messages are cut to this many characters in the report


def log(message: str) -> None:
  print(f"[bench_grammar_abuse] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# The server


class Server:
  """`scripts/serve.py` in a subprocess (its output in a log file), or a server at `--url`."""

  def __init__(self):
    self.proc, self.log_path = None, None
    if FLAGS.url:
      self.url = FLAGS.url.rstrip("/")
      return
    port = free_port()
    self.url = f"http://127.0.0.1:{port}"
    serve = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py")
    command = [sys.executable, serve, f"--model={FLAGS.model}", f"--port={port}",
               *FLAGS.server_flags]
    fd, self.log_path = tempfile.mkstemp(prefix="bench_grammar_abuse_", suffix=".log")
    log(f"starting {' '.join(command)} (log: {self.log_path})")
    with os.fdopen(fd, "w") as log_file:
      self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)

  @property
  def pid(self) -> int | None:
    return None if self.proc is None else self.proc.pid

  def log_tail(self, lines: int = 20) -> str:
    if self.log_path is None:
      return ""
    with open(self.log_path, errors="replace") as f:
      return "".join(f.readlines()[-lines:])

  def last_progress_line(self) -> str:
    """The server log's last line that is not a /health poll (the warm-up's progress)."""
    lines = [line for line in self.log_tail(200).splitlines() if "GET /health" not in line]
    return lines[-1].strip()[-160:] if lines else ""

  def wait_healthy(self) -> None:
    """Returns once /health answers 200; RuntimeError if the server exits, its warm-up fails or
    `--startup_timeout_s` passes."""
    start = time.monotonic()
    last_report, state = start, "no answer"
    while True:
      if self.proc is not None and self.proc.poll() is not None:
        raise RuntimeError(f"serve.py exited with {self.proc.returncode}:\n{self.log_tail()}")
      try:
        response = httpx.get(f"{self.url}/health", timeout=10)
        if response.status_code == 200:
          log(f"/health 200 after {time.monotonic() - start:.1f} s")
          return
        state = f"{response.status_code} {response.text[:200]}"
        if "warm-up failed" in response.text:
          raise RuntimeError(f"the server's warm-up failed: {response.text[:2000]}")
      except httpx.TransportError as e:
        state = f"no answer ({type(e).__name__})"
      elapsed = time.monotonic() - start
      if elapsed > FLAGS.startup_timeout_s:
        raise RuntimeError(f"/health not 200 after {elapsed:.0f} s ({state}):\n{self.log_tail()}")
      if time.monotonic() - last_report >= 10:
        last_report = time.monotonic()
        last_line = self.last_progress_line()
        log(f"waiting for /health ({elapsed:.0f} s): {state}" +
            (f"; server: {last_line}" if last_line else ""))
      time.sleep(0.5)

  def close(self) -> None:
    """SIGTERM (the server drains, then exits), SIGKILL if it has not exited within 90 s."""
    if self.proc is None or self.proc.poll() is not None:
      return
    self.proc.send_signal(signal.SIGTERM)
    try:
      self.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
      log("serve.py did not exit within 90 s of SIGTERM; killing it")
      self.proc.kill()
      self.proc.wait()
    log(f"serve.py exited with {self.proc.returncode} (log: {self.log_path})")


def rss_mb(pid: int) -> float | None:
  """Resident set size of process `pid` in MB (psutil, else /proc/<pid>/status)."""
  try:
    import psutil
    return psutil.Process(pid).memory_info().rss / 2**20
  except ImportError:
    pass
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return None


# ---------------------------------------------------------------------------------------------
# Requests


def encode(body: dict, raw: dict[str, str] | None = None) -> bytes:
  """`body` as JSON bytes; each string value equal to a key of `raw` is replaced by that key's
  raw JSON text (for values too deep for `json.dumps`)."""
  text = json.dumps(body, separators=(",", ":"))
  for placeholder, value in (raw or {}).items():
    text = text.replace(json.dumps(placeholder), value, 1)
  return text.encode()


def completion(constraint: dict, max_tokens: int, raw: dict[str, str] | None = None) -> bytes:
  """A greedy /v1/completions body under `structured_outputs=constraint`."""
  return encode({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                 "structured_outputs": constraint}, raw)


def chat(constraint: dict, max_tokens: int) -> bytes:
  """A greedy /v1/chat/completions body under `structured_outputs=constraint`."""
  return encode({"messages": [{"role": "user", "content": "Pick one of the options."}],
                 "max_tokens": max_tokens, "temperature": 0, "structured_outputs": constraint})


def describe(status: int, payload: bytes) -> dict:
  """The report's view of a response: an error's message, param and code, or a completion's
  text and finish_reason."""
  try:
    body = json.loads(payload)
  except ValueError:
    return {"body": payload[:MESSAGE_CHARS].decode(errors="replace")}
  if not isinstance(body, dict):
    return {"body": str(body)[:MESSAGE_CHARS]}
  if isinstance(body.get("error"), dict):
    error = body["error"]
    message = str(error.get("message"))
    return {"error": message[:MESSAGE_CHARS], "message_chars": len(message),
            "param": error.get("param"), "code": error.get("code")}
  if status == 200 and body.get("choices"):
    choice = body["choices"][0]
    text = choice.get("text", (choice.get("message") or {}).get("content"))
    return {"text": None if text is None else text[:80],
            "finish_reason": choice.get("finish_reason")}
  return {}


def outcome(status: int | None) -> str:
  return {2: "ok", 4: "4xx", 5: "5xx"}.get((status or 0) // 100, "other")


async def guarded(work, timeout_s: float) -> dict:
  """Awaits `work` (a coroutine returning a dict with "status") for at most `timeout_s`: its dict
  with "seconds" and "outcome" added, or outcome "hang" (no answer in time) or "lost" (an
  exception: connection refused or reset, a broken response)."""
  start = time.perf_counter()
  try:
    result = await asyncio.wait_for(work, timeout_s)
  except (TimeoutError, httpx.TimeoutException):
    return {"status": None, "outcome": "hang", "seconds": time.perf_counter() - start}
  except Exception as e:  # anything else a client would see as a lost request
    return {"status": None, "outcome": "lost", "seconds": time.perf_counter() - start,
            "error": f"{type(e).__name__}: {e}"[:MESSAGE_CHARS]}
  return {"status": result["status"], "outcome": outcome(result["status"]),
          "seconds": time.perf_counter() - start, **result}


async def post(client: httpx.AsyncClient, url: str, body: bytes, timeout_s: float) -> dict:
  """POSTs `body` and waits for the whole answer (see `guarded`)."""

  async def work():
    response = await client.post(url, content=body, headers=JSON_HEADERS)
    return {"status": response.status_code, **describe(response.status_code, response.content)}

  return {**await guarded(work(), timeout_s), "body_bytes": len(body)}


async def stream_plain(client: httpx.AsyncClient, base: str, timeout_s: float) -> dict:
  """A plain streamed completion of 80 tokens: seconds to the first text and to the end."""
  body = encode({"prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                 "stream": True})
  start = time.perf_counter()

  async def work():
    first, chunks = None, 0
    async with client.stream("POST", f"{base}/v1/completions", content=body,
                             headers=JSON_HEADERS) as response:
      if response.status_code != 200:
        return {"status": response.status_code,
                **describe(response.status_code, await response.aread())}
      async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
          return {"status": 200, "error": str(event["error"])[:MESSAGE_CHARS]}
        if event.get("choices") and event["choices"][0].get("text"):
          chunks += 1
          first = first if first is not None else time.perf_counter() - start
    return {"status": 200, "ttft_s": first, "total_s": time.perf_counter() - start,
            "text_chunks": chunks}

  return await guarded(work(), timeout_s)


def client(timeout_s: float) -> httpx.AsyncClient:
  """An async client whose own timeouts are looser than `guarded`'s (which counts the hangs)."""
  return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s + 30),
                           limits=httpx.Limits(max_connections=64))


# ---------------------------------------------------------------------------------------------
# Constraints


def random_strings(rng: random.Random, count: int) -> list[str]:
  """`count` distinct strings of 4 to 10 lowercase letters and digits."""
  alphabet = string.ascii_lowercase + string.digits
  seen: set[str] = set()
  while len(seen) < count:
    seen.add("".join(rng.choices(alphabet, k=rng.randint(4, 10))))
  return sorted(seen, key=lambda _: rng.random())


def deep_schema_text(depth: int) -> str:
  """JSON text of an object schema nested `depth` levels deep (too deep for `json.dumps`)."""
  opening = '{"type":"object","properties":{"a":'
  closing = '},"required":["a"]}'
  return opening * depth + '{"type":"string","maxLength":4}' + closing * depth


def mid_schema() -> dict:
  """A mid-size JSON schema: 24 properties of every kind, nested objects and arrays."""
  properties = {}
  for i in range(24):
    kind = i % 6
    if kind == 0:
      properties[f"name_{i}"] = {"type": "string", "minLength": 1, "maxLength": 16}
    elif kind == 1:
      properties[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
    elif kind == 2:
      properties[f"tag_{i}"] = {"enum": [f"tag{j}" for j in range(20)]}
    elif kind == 3:
      properties[f"list_{i}"] = {"type": "array", "items": {"type": "number"}, "maxItems": 4}
    elif kind == 4:
      properties[f"code_{i}"] = {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}
    else:
      properties[f"child_{i}"] = {"type": "object", "properties": {
          "ok": {"type": "boolean"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
          "required": ["ok"], "additionalProperties": False}
  return {"type": "object", "properties": properties, "required": sorted(properties)[:12],
          "additionalProperties": False}


class Fuzzer:
  """Seeded random JSON schemas (no $ref) and regexes, some of them invalid."""

  INVALID_REGEXES = ("(", ")", "[z-a]", "a{5,2}", "*", "\\", "(?P<", "[", "a{99999999999}",
                     "(?<=a)", "\\p{Nope}", "x**")
  INVALID_SCHEMAS = ({"type": "strnig"}, {"type": "integer", "minimum": "zero"},
                     {"properties": [1, 2]}, {"type": "string", "pattern": "(unclosed"},
                     {"type": "array", "minItems": -1}, {"enum": []}, {"anyOf": []},
                     {"type": "integer", "minimum": 10, "maximum": 1},
                     {"type": "string", "minLength": 9, "maxLength": 2}, {"required": "a"})

  def __init__(self, seed: int):
    self.rng = random.Random(seed)

  def count(self, low: int, high: int) -> int:
    """A repetition bound: mostly small, sometimes up to 200, rarely up to 1,000."""
    roll = self.rng.random()
    return self.rng.randint(low, high if roll < 0.85 else 200 if roll < 0.97 else 1000)

  # Regexes

  def atom(self, depth: int) -> str:
    rng = self.rng
    kind = rng.randrange(8 if depth < 3 else 6)
    if kind == 0:
      return rng.choice("abcxyz019 -_:")
    if kind == 1:
      return "\\" + rng.choice(".+*?()[]{}|^$\\")
    if kind == 2:
      low = rng.choice("a0A")
      return f"[{low}-{chr(ord(low) + rng.randint(0, 9))}{rng.choice(['', '_', '.', ' '])}]"
    if kind == 3:
      return rng.choice(['[^"\\n]', "[^a-z]", "[^ ]"])
    if kind == 4:
      return rng.choice(["\\d", "\\w", "\\s", "\\D", "\\W"])
    if kind == 5:
      return "."
    return ("(" if kind == 6 else "(?:") + self.alternation(depth + 1) + ")"

  def quantifier(self) -> str:
    rng, kind = self.rng, self.rng.randrange(10)
    if kind < 4:
      return ""
    if kind < 7:
      return rng.choice(["*", "+", "?"])
    m = self.count(0, 5)
    if kind == 7:
      return f"{{{m}}}"
    if kind == 8:
      return f"{{{m},{m + self.count(0, 10)}}}"
    return f"{{{m},}}"

  def alternation(self, depth: int = 0) -> str:
    rng = self.rng
    branches = ["".join(self.atom(depth) + self.quantifier() for _ in range(rng.randint(1, 4)))
                for _ in range(rng.choice([1, 1, 2, 3]))]
    return "|".join(branches)

  def regex(self) -> str:
    """A random regex; about one in seven is made invalid."""
    pattern = self.alternation()
    if self.rng.random() < 0.15:
      bad = self.rng.choice(self.INVALID_REGEXES)
      cut = self.rng.randint(0, len(pattern))
      pattern = pattern[:cut] + bad + pattern[cut:]
    return pattern

  # JSON schemas

  def scalar(self):
    rng = self.rng
    return rng.choice([rng.randint(-1000, 1000), round(rng.uniform(-10, 10), 3), True, None,
                       "".join(rng.choices(string.ascii_letters + " \"\\é", k=rng.randint(0, 8)))])

  def schema(self, depth: int = 0) -> dict:
    rng = self.rng
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const"]
    if depth < 4:
      kinds += ["array", "object", "object", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
      out = {"type": "string"}
      if rng.random() < 0.4:
        out["minLength"] = self.count(0, 5)
      if rng.random() < 0.4:
        out["maxLength"] = out.get("minLength", 0) + self.count(0, 20)
      if rng.random() < 0.3:
        out["pattern"] = self.alternation()
      elif rng.random() < 0.15:
        out["format"] = rng.choice(["date-time", "date", "email", "uuid", "uri"])
      return out
    if kind in ("integer", "number"):
      out = {"type": kind}
      if rng.random() < 0.5:
        out["minimum"] = rng.randint(-10**6, 100)
      if rng.random() < 0.5:
        out["maximum"] = out.get("minimum", -100) + rng.randint(0, 10**6)
      if rng.random() < 0.1:
        out["exclusiveMinimum" if rng.random() < 0.5 else "multipleOf"] = rng.randint(1, 7)
      return out
    if kind in ("boolean", "null"):
      return {"type": kind}
    if kind == "enum":
      return {"enum": [self.scalar() for _ in range(rng.randint(1, 8))]}
    if kind == "const":
      return {"const": self.scalar()}
    if kind == "array":
      out = {"type": "array", "items": self.schema(depth + 1)}
      if rng.random() < 0.5:
        out["minItems"] = self.count(0, 3)
      if rng.random() < 0.5:
        out["maxItems"] = out.get("minItems", 0) + self.count(0, 5)
      return out
    if kind == "anyOf":
      return {"anyOf": [self.schema(depth + 1) for _ in range(rng.randint(2, 3))]}
    names = [f"{rng.choice(['id', 'name', 'x', 'value', 'ключ', 'a b'])}{i}"
             for i in range(rng.randint(0, 5))]
    out = {"type": "object", "properties": {n: self.schema(depth + 1) for n in names}}
    if names and rng.random() < 0.7:
      out["required"] = rng.sample(names, rng.randint(1, len(names)))
    if rng.random() < 0.6:
      out["additionalProperties"] = rng.random() < 0.3
    return out

  def json_schema(self) -> dict:
    """A random schema (an object at the top two times in three); one in ten is invalid."""
    if self.rng.random() < 0.1:
      return dict(self.rng.choice(self.INVALID_SCHEMAS))
    while True:
      schema = self.schema()
      if schema.get("type") == "object" or self.rng.random() < 0.33:
        return schema

  def constraint(self, i: int) -> dict:
    """The i-th fuzz constraint: a JSON schema for even i, a regex for odd i."""
    return {"json": self.json_schema()} if i % 2 == 0 else {"regex": self.regex()}


# ---------------------------------------------------------------------------------------------
# Sections


async def stall_section(base: str) -> dict:
  """The plain stream alone (after one untimed run), then with the big choice request in flight."""
  strings = random_strings(random.Random(FLAGS.seed), FLAGS.big_choice)
  big_body = chat({"choice": strings}, 16)
  async with client(FLAGS.timeout_s) as http:
    await stream_plain(http, base, FLAGS.timeout_s)
    runs = [await stream_plain(http, base, FLAGS.timeout_s) for _ in range(3)]
    timed = sorted((r for r in runs if r.get("total_s") is not None), key=lambda r: r["total_s"])
    alone = timed[len(timed) // 2] if timed else runs[-1]  # the median run
    big = asyncio.create_task(post(http, f"{base}/v1/chat/completions", big_body,
                                   FLAGS.timeout_s))
    await asyncio.sleep(LEAD_S)
    during = await stream_plain(http, base, FLAGS.timeout_s)
    big_done_first = big.done()
    big_result = await big
  ratio = lambda key: (during[key] / alone[key] if during.get(key) and alone.get(key) else None)
  return {"alone": alone, "alone_total_s_runs": [r.get("total_s") for r in runs],
          "during_big": during, "total_ratio": ratio("total_s"), "ttft_ratio": ratio("ttft_s"),
          "big": {"choices": FLAGS.big_choice, "endpoint": "/v1/chat/completions",
                  "finished_before_plain": big_done_first, **big_result}}


def cases() -> dict[str, tuple[str, bytes]]:
  """Name -> (what it is, /v1/completions body) of each adversarial case."""
  rng = random.Random(FLAGS.seed + 1)
  return {
      "choice_big": (f"choice of {FLAGS.big_choice} strings",
                     completion({"choice": random_strings(rng, FLAGS.big_choice)}, 16)),
      "choice_huge": (f"choice of {FLAGS.huge_choice} strings",
                      completion({"choice": random_strings(rng, FLAGS.huge_choice)}, 16)),
      "json_deep": (f"JSON schema nested {FLAGS.deep_schema} levels",
                    completion({"json": "@DEEP@"}, 16,
                               raw={"@DEEP@": deep_schema_text(FLAGS.deep_schema)})),
      "json_enum": (f"JSON schema enum of {FLAGS.enum_size} strings",
                    completion({"json": {"enum": random_strings(rng, FLAGS.enum_size)}}, 16)),
      "regex_invalid": ("regex (unclosed", completion({"regex": "(unclosed"}, 16)),
      "regex_ambiguous": ("regex (a|aa)*(b|bb)*c{1000}",
                          completion({"regex": "(a|aa)*(b|bb)*c{1000}"}, 16)),
      "unknown_field": ("structured_outputs with an unknown field",
                        completion({"choice": ["yes", "no"], "unknown_field": True}, 16)),
  }


async def cases_section(base: str) -> dict:
  results = {}
  async with client(FLAGS.timeout_s) as http:
    for name, (what, body) in cases().items():
      results[name] = {"what": what, **await post(http, f"{base}/v1/completions", body,
                                                    FLAGS.timeout_s)}
      log(f"case {name}: {results[name]['outcome']} {results[name]['status']} in "
          f"{results[name]['seconds']:.2f} s")
  return results


async def memory_section(base: str, pid: int) -> dict:
  """RSS after the first and the last of `--memory_requests` constrained requests."""
  rng = random.Random(FLAGS.seed + 2)
  schema = mid_schema()
  statuses: collections.Counter = collections.Counter()
  rss = {"rss_before_mb": rss_mb(pid)}
  async with client(FLAGS.timeout_s) as http:
    for i in range(FLAGS.memory_requests):
      constraint = ({"choice": random_strings(rng, FLAGS.big_choice)} if i % 2 == 0
                    else {"json": schema})
      result = await post(http, f"{base}/v1/completions", completion(constraint, 16),
                          FLAGS.timeout_s)
      statuses[str(result["status"] if result["status"] is not None else result["outcome"])] += 1
      if i == 0:
        rss["rss_after_first_mb"] = rss_mb(pid)
  rss["rss_after_last_mb"] = rss_mb(pid)
  first, last = rss.get("rss_after_first_mb"), rss["rss_after_last_mb"]
  return {"requests": FLAGS.memory_requests, "choices": FLAGS.big_choice, **rss,
          "growth_mb": None if first is None or last is None else last - first,
          "statuses": dict(sorted(statuses.items()))}


async def fuzz_section(base: str) -> dict:
  """`--fuzz` generated constraints, `--concurrency` at a time."""
  fuzzer = Fuzzer(FLAGS.seed)
  bodies = [(i, fuzzer.constraint(i)) for i in range(FLAGS.fuzz)]
  limit = asyncio.Semaphore(FLAGS.concurrency)
  async with client(FLAGS.timeout_s) as http:

    async def one(constraint: dict) -> dict:
      async with limit:
        return await post(http, f"{base}/v1/completions", completion(constraint, 8),
                          FLAGS.timeout_s)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(c) for _, c in bodies))
    seconds = time.perf_counter() - start
  statuses: collections.Counter = collections.Counter()
  by_kind: dict[str, collections.Counter] = {"json": collections.Counter(),
                                             "regex": collections.Counter()}
  samples = []
  for (i, constraint), result in zip(bodies, results):
    key = str(result["status"]) if result["status"] is not None else result["outcome"]
    statuses[key] += 1
    by_kind[next(iter(constraint))][key] += 1
    if result["outcome"] in ("5xx", "hang", "lost") and len(samples) < 10:
      samples.append({"index": i, "outcome": result["outcome"], "status": result["status"],
                      "error": result.get("error"),
                      "constraint": constraint})
  count = lambda kind: sum(r["outcome"] == kind for r in results)
  return {"sent": len(results), "concurrency": FLAGS.concurrency, "seconds": seconds,
          "statuses": dict(sorted(statuses.items())),
          "by_kind": {k: dict(sorted(v.items())) for k, v in by_kind.items()},
          "5xx": count("5xx"), "hangs": count("hang"), "lost": count("lost"),
          "max_seconds": max((r["seconds"] for r in results), default=None),
          "failures": samples}


def healthy(base: str) -> bool:
  try:
    return httpx.get(f"{base}/health", timeout=10).status_code == 200
  except httpx.HTTPError:
    return False


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
  server = Server()
  try:
    try:
      server.wait_healthy()
    except RuntimeError as e:
      log(f"the server did not start: {e}")
      sys.exit(1)
    report = {"url": server.url, "model": None if FLAGS.url else FLAGS.model,
              "server_flags": FLAGS.server_flags}
    sections = {"stall": lambda: stall_section(server.url),
                "cases": lambda: cases_section(server.url),
                "memory": lambda: memory_section(server.url, server.pid),
                "fuzz": lambda: fuzz_section(server.url)}
    for name in FLAGS.sections:
      section = sections[name]
      if name == "memory" and server.pid is None:
        report[name] = {"skipped": "--url: the server was not started by this script"}
        continue
      log(f"section {name}")
      start = time.perf_counter()
      report[name] = asyncio.run(section())
      report[name]["section_seconds"] = time.perf_counter() - start
      log(json.dumps({name: report[name]}))
    report["healthy_after"] = healthy(server.url)
  finally:
    server.close()
  if server.proc is not None:
    report["server_exit_code"] = server.proc.returncode
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
