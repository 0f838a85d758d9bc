"""The HTTP server under concurrent streaming clients, against `LLM.generate` in the same run, as JSON.

Starts the server in this process (uvicorn on a free local port, same engine object as the
offline run), then for the same prompts and greedy settings (`ignore_eos`, so every request
generates `--max_tokens`):
  offline: `llm.generate(all prompts)` in batches of `--max_num_seqs`;
  server:  `--num_requests` streamed `/v1/completions` requests, `--concurrency` at a time, each
           client timing its first text chunk (TTFT) and its last.
The step is first compiled for every batch bucket (however the server's batches form), then each
side is timed over `--repeats` runs after one untimed run.

  python scripts/bench_serve.py --num_requests=32 --concurrency=16 --max_tokens=64
"""

import asyncio
import json
import socket
import statistics
import threading
import time

from absl import app, flags

from jaxtier import engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("prompts", "examples/prompts.jsonl", "JSONL with a 'prompt' or 'messages' "
                    "field per line; prompts are cycled to make --num_requests")
flags.DEFINE_integer("num_requests", 32, "requests per timed run", lower_bound=1)
flags.DEFINE_integer("concurrency", 16, "client requests in flight at once", lower_bound=1)
flags.DEFINE_integer("max_tokens", 64, "tokens generated per request", lower_bound=1)
flags.DEFINE_integer("repeats", 2, "timed runs of each side", lower_bound=1)
flags.DEFINE_float("batch_wait_ms", 5.0, "the server's wait for a fuller batch (as serve.py's)",
                   lower_bound=0)


def read_prompts(path: str, count: int) -> list[str]:
  """`count` prompt strings, cycling the file's prompts (conversations use their last message)."""
  prompts = []
  with open(path) as f:
    for line in f:
      if line.strip():
        record = json.loads(line)
        prompts.append(record["prompt"] if "prompt" in record else record["messages"][-1]["content"])
  if not prompts:
    raise app.UsageError(f"--prompts={path} has no prompts")
  return [prompts[i % len(prompts)] for i in range(count)]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


async def one_request(client, url: str, model: str, prompt: str) -> dict:
  """Streams one completion; returns its TTFT, latency and generated tokens."""
  body = {"model": model, "prompt": prompt, "max_tokens": FLAGS.max_tokens, "temperature": 0,
          "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
  start, first, tokens = time.perf_counter(), None, 0
  async with client.stream("POST", url, json=body) as response:
    response.raise_for_status()
    async for line in response.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[len("data: "):])
      if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
      elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
        first = time.perf_counter() - start
  return {"ttft_s": first, "latency_s": time.perf_counter() - start, "tokens": tokens}


async def server_run(base: str, model: str, prompts: list[str]) -> dict:
  import httpx
  limit = asyncio.Semaphore(FLAGS.concurrency)

  async def limited(client, prompt):
    async with limit:
      return await one_request(client, f"{base}/v1/completions", model, prompt)

  async with httpx.AsyncClient(timeout=None) as client:
    start = time.perf_counter()
    results = await asyncio.gather(*(limited(client, p) for p in prompts))
    wall = time.perf_counter() - start
  ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
  tokens = sum(r["tokens"] for r in results)
  return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
          "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
          "latency_p50_s": statistics.median(r["latency_s"] for r in results)}


def offline_run(llm, prompts: list[str]) -> dict:
  import jaxtier
  params = jaxtier.SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0, ignore_eos=True)
  start = time.perf_counter()
  outputs = llm.generate(prompts, params)
  wall = time.perf_counter() - start
  tokens = sum(len(o.token_ids) for o in outputs)
  return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def warm_up(llm, prompts: list[str]) -> None:
  """Compiles the step for every batch bucket up to max_num_seqs, with the longest and the
  shortest prompts (however the server's batches form, their shapes are then compiled)."""
  import jaxtier
  params = jaxtier.SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0, ignore_eos=True)
  by_length = sorted(set(prompts), key=lambda p: len(llm.prompt_token_ids(p)))
  size = 1
  while size <= llm.max_num_seqs:
    for chosen in (by_length[:size], by_length[-size:]):
      llm.generate([chosen[i % len(chosen)] for i in range(size)], params)
    size *= 2


def main(argv):
  del argv
  engine_flags.prepare()
  import uvicorn

  import jaxtier
  from jaxtier.server import AsyncEngine, create_app
  prompts = read_prompts(FLAGS.prompts, FLAGS.num_requests)
  llm = jaxtier.LLM(**engine_flags.llm_kwargs())
  engine = AsyncEngine(llm, batch_wait_s=FLAGS.batch_wait_ms / 1e3)
  port = free_port()
  server = uvicorn.Server(uvicorn.Config(create_app(engine, FLAGS.model), host="127.0.0.1",
                                         port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.05)
  base = f"http://127.0.0.1:{port}"
  try:
    warm_up(llm, prompts)
    asyncio.run(server_run(base, FLAGS.model, prompts))
    offline = [offline_run(llm, prompts) for _ in range(FLAGS.repeats)]
    served = [asyncio.run(server_run(base, FLAGS.model, prompts)) for _ in range(FLAGS.repeats)]
  finally:
    server.should_exit = True
    thread.join()
    engine.close()
  best = lambda runs: max(runs, key=lambda r: r["tokens_per_s"])
  print(json.dumps({
      "what": ("generated tokens per second, offline LLM.generate vs the HTTP server under "
               "concurrent streaming clients, same engine and prompts, greedy with ignore_eos; "
               "best of --repeats runs, every batch bucket compiled first"),
      "model": FLAGS.model, "num_requests": FLAGS.num_requests, "concurrency": FLAGS.concurrency,
      "max_num_seqs": llm.max_num_seqs, "max_tokens": FLAGS.max_tokens,
      "batch_wait_ms": FLAGS.batch_wait_ms,
      "offline": best(offline), "server": best(served),
      "server_vs_offline": best(served)["tokens_per_s"] / best(offline)["tokens_per_s"]},
      indent=1))


if __name__ == "__main__":
  app.run(main)
