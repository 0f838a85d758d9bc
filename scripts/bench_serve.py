"""The HTTP server under load, against the offline engine on the same requests, as one JSON object.

Starts the server in this process (uvicorn on a free loopback port, its own `LLM`), and an offline
`LLM` of the same arguments as the reference. Requests are token-id prompts of mixed lengths
(`--min_prompt`..`--max_prompt`) with mixed outputs (`--min_output`..`--max_output`), greedy with
`ignore_eos`, so both sides generate the same tokens. Sections (`--sections`):
  load:      for each `--concurrency`, that many streaming clients at once: generated tokens/s
             against `llm.generate` on the same requests, TTFT and inter-token latency p50/p99,
             errors, and whether every output equals the offline one.
  hol:       head-of-line: TTFT of a short request sent while a long one streams, over its TTFT
             alone.
  pressure:  the load again with the device pool at a quarter of the load's peak: the same
             figures plus the swap counts, bytes and seconds from /metrics, and lost or duplicated
             tokens.
  attack:    while streams run, `--oversized` bodies of `--oversized_mb` MB and `--flood` requests
             beyond `--max_queued_requests`: RSS growth, status counts, and the streams' outputs.
  warmup:    `scripts/serve.py` started twice on an empty compilation cache: seconds until /health
             is 200, cold and with the cache.
  fuzz:      the schema fuzz of `tests/test_server_fuzz.py` with `--fuzz_examples` bodies per
             endpoint (CI runs 1,000): no 5xx, every 4xx an OpenAI error.

  python scripts/bench_serve.py --num_requests=64 --concurrency=32,64
  python scripts/bench_serve.py --sections=hol,attack --num_requests=16   # quicker
"""

import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from absl import app, flags

from jaxtier.engine import flags as engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sections", ["load", "hol", "pressure", "attack", "warmup", "fuzz"],
                  "parts to run")
flags.DEFINE_integer("fuzz_examples", 5000, "request bodies per endpoint of the fuzz section",
                     lower_bound=1)
flags.DEFINE_integer("num_requests", 64, "requests of the load", lower_bound=1)
flags.DEFINE_list("concurrency", ["32", "64"], "streaming clients at once, one run each")
flags.DEFINE_integer("min_prompt", 16, "shortest prompt, tokens", lower_bound=1)
flags.DEFINE_integer("max_prompt", 512, "longest prompt, tokens", lower_bound=1)
flags.DEFINE_integer("min_output", 16, "fewest generated tokens", lower_bound=1)
flags.DEFINE_integer("max_output", 128, "most generated tokens", lower_bound=1)
flags.DEFINE_integer("oversized", 20, "oversized bodies of the attack", lower_bound=0)
flags.DEFINE_float("oversized_mb", 20.0, "size of each oversized body", lower_bound=0)
flags.DEFINE_integer("flood", 200, "requests of the attack beyond the queue cap", lower_bound=0)
flags.DEFINE_integer("max_queued_requests", 32, "the server's queue cap in the attack section",
                     lower_bound=1)
flags.DEFINE_integer("max_request_bytes", 4 << 20, "the server's request body cap",
                     lower_bound=1)
flags.DEFINE_integer("seed", 0, "workload seed", lower_bound=0)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def workload(vocab_size: int, count: int, seed: int) -> list[dict]:
  """`count` requests {"prompt": token ids, "max_tokens"}, deterministic in `seed`."""
  rng = np.random.default_rng(seed)
  return [{"prompt": rng.integers(100, vocab_size, int(rng.integers(FLAGS.min_prompt,
                                                                     FLAGS.max_prompt + 1))).tolist(),
           "max_tokens": int(rng.integers(FLAGS.min_output, FLAGS.max_output + 1))}
          for _ in range(count)]


def percentile(values: list[float], q: float) -> float | None:
  return float(np.percentile(values, q)) if values else None


class Server:
  """uvicorn serving `create_app(AsyncEngine(llm))` on a loopback port, in a thread."""

  def __init__(self, llm, **engine_kwargs):
    import uvicorn

    from jaxtier.server import AsyncEngine, create_app
    self.engine = AsyncEngine(llm, **engine_kwargs)
    self.engine.wait_warm()  # every program built: none compiles mid-measurement
    self.port = free_port()
    application = create_app(self.engine, FLAGS.model, max_request_bytes=FLAGS.max_request_bytes)
    self.server = uvicorn.Server(uvicorn.Config(application,
                                                host="127.0.0.1", port=self.port,
                                                log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, daemon=True)
    self.thread.start()
    while not self.server.started:
      time.sleep(0.05)
    self.url = f"http://127.0.0.1:{self.port}"

  def close(self) -> None:
    self.server.should_exit = True
    self.thread.join()
    self.engine.close()


async def stream(client, url: str, request: dict) -> dict:
  """Streams one completion: its token ids (from the usage-free text deltas' count), TTFT,
  inter-token gaps and status."""
  body = {"model": FLAGS.model, **request, "temperature": 0, "ignore_eos": True, "stream": True}
  start, arrivals, text = time.perf_counter(), [], ""
  async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
    if response.status_code != 200:
      await response.aread()
      return {"status": response.status_code}
    async for line in response.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[len("data: "):])
      if "error" in chunk:
        return {"status": 500}
      if chunk["choices"] and chunk["choices"][0]["text"]:
        arrivals.append(time.perf_counter())
        text += chunk["choices"][0]["text"]
  gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
  return {"status": 200, "text": text, "ttft_s": arrivals[0] - start if arrivals else None,
          "gaps_s": gaps, "latency_s": time.perf_counter() - start}


async def load(url: str, requests: list[dict], concurrency: int) -> dict:
  import httpx
  limit = asyncio.Semaphore(concurrency)

  async def limited(client, request):
    async with limit:
      return await stream(client, url, request)

  async with httpx.AsyncClient(timeout=None) as client:
    start = time.perf_counter()
    results = await asyncio.gather(*(limited(client, r) for r in requests))
    wall = time.perf_counter() - start
  return {"wall_s": wall, "results": results}


def summarize(run: dict, requests: list[dict], offline_texts: list[str]) -> dict:
  ok = [r for r in run["results"] if r["status"] == 200]
  ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
  gaps = [g for r in ok for g in r["gaps_s"]]
  tokens = sum(r["max_tokens"] for r in requests)
  return {"wall_s": run["wall_s"], "tokens": tokens, "tokens_per_s": tokens / run["wall_s"],
          "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
          "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
          "errors": len(run["results"]) - len(ok),
          "outputs_equal_offline": [r.get("text") for r in run["results"]] == offline_texts}


def offline(llm, requests: list[dict]) -> tuple[list[str], dict]:
  """The offline engine's texts and tokens/s on `requests` (its programs compiled first)."""
  import jaxtier
  params = [jaxtier.SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True)
            for r in requests]
  llm.engine.warmup()
  start = time.perf_counter()
  outputs = llm.generate([r["prompt"] for r in requests], params)
  wall = time.perf_counter() - start
  tokens = sum(len(o.token_ids) for o in outputs)
  return [o.text for o in outputs], {"wall_s": wall, "tokens": tokens,
                                     "tokens_per_s": tokens / wall}


def scrape(url: str) -> dict[str, float]:
  import httpx
  from prometheus_client.parser import text_string_to_metric_families
  text = httpx.get(f"{url}/metrics").text
  return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def load_section(llm, requests, texts, offline_figures) -> dict:
  server = Server(llm)
  try:
    asyncio.run(load(server.url, requests[:4], 4))  # one untimed pass through the HTTP stack
    runs = {c: summarize(asyncio.run(load(server.url, requests, int(c))), requests, texts)
            for c in FLAGS.concurrency}
  finally:
    server.close()
  for figures in runs.values():
    figures["vs_offline"] = figures["tokens_per_s"] / offline_figures["tokens_per_s"]
  return {"offline": offline_figures, "server": runs,
          "warmup": server.engine.warmup_report}


def hol_section(llm) -> dict:
  long = {"prompt": list(range(100, 100 + FLAGS.max_prompt)), "max_tokens": FLAGS.max_output}
  short = {"prompt": [101, 102, 103, 104], "max_tokens": 4}
  server = Server(llm)

  async def scenario():
    import httpx
    async with httpx.AsyncClient(timeout=None) as client:
      alone = [(await stream(client, server.url, short))["ttft_s"] for _ in range(3)]
      generated = lambda: server.engine.stats().engine["generated_tokens"]
      before = generated()
      running = asyncio.ensure_future(stream(client, server.url, long))
      while generated() < before + 4:  # the long request has been prefilled and is decoding
        await asyncio.sleep(0.001)
      during = await stream(client, server.url, short)
      long_done = running.done()
      await running
      return statistics.median(alone), during["ttft_s"], long_done

  try:
    alone, during, long_done = asyncio.run(scenario())
  finally:
    server.close()
  return {"short_ttft_alone_s": alone, "short_ttft_during_long_s": during,
          "ratio": during / alone, "long_finished_first": long_done}


def pressure_section(args: dict, reference, requests, texts) -> dict:
  import jaxtier
  peak = reference.stats()["device_blocks_peak_used"]
  blocks = max(peak // 4, -(-reference.max_model_len // reference.args.block_size))
  llm = jaxtier.LLM(**{**args, "num_device_blocks": blocks})
  server = Server(llm)
  try:
    before = scrape(server.url)
    run = asyncio.run(load(server.url, requests, int(FLAGS.concurrency[0])))
    after = scrape(server.url)
  finally:
    server.close()
  moved = lambda name: after.get(name, 0) - before.get(name, 0)
  figures = summarize(run, requests, texts)
  lost = sum(r["text"] != t for r, t in zip(run["results"], texts) if r["status"] == 200)
  figures.update(
      device_blocks=blocks, unconstrained_peak_blocks=peak,
      swap_out=moved("jaxtier_swap_out_total"), swap_in=moved("jaxtier_swap_in_total"),
      swap_out_bytes=moved("jaxtier_swap_out_bytes_total"),
      swap_in_bytes=moved("jaxtier_swap_in_bytes_total"),
      swap_seconds=moved("jaxtier_swap_seconds_total"),
      preemptions_swap=moved("jaxtier_preemptions_total{swap}"),
      preemptions_recompute=moved("jaxtier_preemptions_total{recompute}"),
      outputs_differing=lost)
  return figures


def rss_mb() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def attack_section(llm, requests, texts) -> dict:
  import httpx
  server = Server(llm, max_queued_requests=FLAGS.max_queued_requests)
  oversized = b'{"prompt": "' + b"x" * int(FLAGS.oversized_mb * 1e6) + b'"}'

  async def scenario():
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=None) as client:
      streams = asyncio.ensure_future(load(server.url, requests, len(requests)))
      deadline = time.monotonic() + 30
      while (not streams.done() and time.monotonic() < deadline
             and server.engine.stats().running + server.engine.stats().waiting < len(requests)):
        await asyncio.sleep(0.001)  # every stream is admitted before the attack starts
      rss_before = rss_mb()
      big = [client.post(f"{server.url}/v1/completions", content=oversized,
                         headers={"content-type": "application/json"})
             for _ in range(FLAGS.oversized)]
      flood = [client.post(f"{server.url}/v1/completions",
                           json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
               for _ in range(FLAGS.flood)]
      for response in await asyncio.gather(*big, *flood):
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
      rss_after = rss_mb()
      run = await streams
    return statuses, rss_before, rss_after, run

  try:
    statuses, rss_before, rss_after, run = asyncio.run(scenario())
  finally:
    server.close()
  return {"oversized_bodies": FLAGS.oversized, "oversized_mb": FLAGS.oversized_mb,
          "flood": FLAGS.flood, "max_queued_requests": FLAGS.max_queued_requests,
          "statuses": {str(k): v for k, v in sorted(statuses.items())},
          "rss_before_mb": rss_before, "rss_after_mb": rss_after,
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "streams": summarize(run, requests, texts)}


def warmup_section() -> dict:
  """Seconds from starting `scripts/serve.py` to /health 200, on an empty compilation cache and
  again with it."""
  import httpx
  serve = os.path.join(os.path.dirname(__file__), "serve.py")
  engine = [f"--{name}={getattr(FLAGS, name)}" for name in engine_flags.ENGINE_FLAGS
            if getattr(FLAGS, name) is not None]
  times = {}
  with tempfile.TemporaryDirectory() as cache:
    for label in ("cold", "cached"):
      port = free_port()
      start = time.perf_counter()
      proc = subprocess.Popen([sys.executable, serve, f"--port={port}", *engine],
                              env={**os.environ, "JAX_COMPILATION_CACHE_DIR": cache},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
      try:
        while True:
          if proc.poll() is not None:
            raise RuntimeError(f"serve.py exited: {proc.stderr.read()[-2000:]}")
          try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
              break
          except httpx.TransportError:
            pass
          time.sleep(0.2)
        times[f"{label}_s"] = time.perf_counter() - start
      finally:
        proc.terminate()
        proc.wait(timeout=120)
      ready = [line for line in proc.stderr.read().splitlines() if line.startswith("start-up:")]
      times[f"{label}_ready_line"] = ready[-1] if ready else None
  return times


def fuzz_section() -> dict:
  """Runs the schema fuzz test with `--fuzz_examples` examples per endpoint."""
  root = os.path.join(os.path.dirname(__file__), "..")
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "tests/test_server_fuzz.py"], cwd=root, capture_output=True, text=True,
                        env={**os.environ, "JAXTIER_FUZZ_EXAMPLES": str(FLAGS.fuzz_examples)})
  return {"examples_per_endpoint": FLAGS.fuzz_examples, "passed": proc.returncode == 0,
          "seconds": time.perf_counter() - start,
          "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else None}


def main(argv):
  del argv
  engine_flags.prepare()
  import jaxtier
  args = engine_flags.llm_kwargs()
  result = {"model": FLAGS.model, "engine_args": {k: v for k, v in args.items() if k != "model"},
            "num_requests": FLAGS.num_requests,
            "prompt_tokens": [FLAGS.min_prompt, FLAGS.max_prompt],
            "output_tokens": [FLAGS.min_output, FLAGS.max_output]}
  unknown = set(FLAGS.sections) - {"load", "hol", "pressure", "attack", "warmup", "fuzz"}
  if unknown:
    raise app.UsageError(f"--sections: unknown sections {sorted(unknown)}")
  if {"load", "hol", "pressure", "attack"} & set(FLAGS.sections):
    reference, llm = jaxtier.LLM(**args), jaxtier.LLM(**args)
    requests = workload(reference.config.vocab_size, FLAGS.num_requests, FLAGS.seed)
    texts, offline_figures = offline(reference, requests)
  for section in FLAGS.sections:
    if section == "load":
      result["load"] = load_section(llm, requests, texts, offline_figures)
    elif section == "hol":
      result["hol"] = hol_section(llm)
    elif section == "pressure":
      result["pressure"] = pressure_section(args, reference, requests, texts)
    elif section == "attack":
      count = min(16, llm.max_num_seqs + FLAGS.max_queued_requests // 2)
      result["attack"] = attack_section(llm, requests[:count], texts[:count])
    elif section == "warmup":
      result["warmup"] = warmup_section()
    else:
      result["fuzz"] = fuzz_section()
    print(json.dumps({section: result[section]}), file=sys.stderr, flush=True)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)
