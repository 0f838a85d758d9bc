"""The disk tier (`--kv_disk_path`) across restarts, and what it costs a step; prints JSON.

Sections (`--disk_sections`):
  server:  `serve.py` with a new disk directory answers a chat whose ~1,500-token system prompt
           is new (cold), is stopped with SIGTERM and started again on the same directory, and
           answers the same chat (warm): time to first token of each (streamed, after each
           server's warm-up), the warm one's disk hit tokens (/metrics), and its text against a
           third server with prefix caching off.
  batch:   the same across two processes of the offline path (`jaxtier.LLM`), and a third with
           prefix caching off.
  mixed:   the mixed workload (`bench_engine`'s) with the disk tier on (writing: a new directory
           and new prompts each round) and off, interleaved rounds in one process: tokens/s and
           the bytes written.
  index:   a namespace of `--index_blocks` files of a small block layout: how long a store takes
           to index it at start-up.

    python scripts/bench_kv_disk.py --model=smollm2-135m-instruct
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from absl import app, flags

import bench_engine
from benchlib import print_report
from jaxtier.engine import flags as engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_list("disk_sections", ["server", "batch", "mixed", "index"], "sections to run")
flags.DEFINE_integer("system_tokens", 1500, "tokens of the new system prompt", lower_bound=16)
flags.DEFINE_integer("answer_tokens", 32, "tokens each answer asks for", lower_bound=1)
flags.DEFINE_integer("mixed_rounds", 3, "interleaved rounds of the mixed workload", lower_bound=1)
flags.DEFINE_integer("index_blocks", 100_000, "files of the index section", lower_bound=1)
flags.DEFINE_float("server_timeout_s", 1200, "longest wait for a server", lower_bound=1)
flags.DEFINE_string("batch_worker", None, "internal: one offline process (JSON arguments)")

SERVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py")


def system_prompt(tokenizer, tokens: int, seed: int) -> str:
  """A system prompt of about `tokens` tokens that no earlier run has seen (random words)."""
  rng = np.random.default_rng(seed)
  words = ["river", "lantern", "copper", "meadow", "signal", "harbor", "orbit", "cedar",
           "violet", "granite", "thunder", "pepper", "marble", "falcon", "ember", "quartz"]
  text = ""
  while len(tokenizer.encode(text)) < tokens:
    text += " ".join(rng.choice(words, 50)) + f" {rng.integers(1 << 30)}. "
  return "You follow these notes: " + text


def chat(system: str) -> list[dict]:
  return [{"role": "system", "content": system},
          {"role": "user", "content": "Summarize the notes in one sentence."}]


# Servers.


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def server(extra: list[str]):
  """A serve.py process with the engine flags given to this script and `extra`; yields its url
  once /health is 200 and its warm-up is done; stopped with SIGTERM."""
  import httpx  # pylint: disable=import-outside-toplevel
  port = free_port()
  argv = [f"--{name}={getattr(FLAGS, name)}" for name in engine_flags.ENGINE_FLAGS
          if FLAGS[name].present and name != "kv_disk_path"]
  proc = subprocess.Popen([sys.executable, SERVE, f"--port={port}", *argv, *extra],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  stderr: list[str] = []
  threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
  url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + FLAGS.server_timeout_s
  try:
    while True:
      if proc.poll() is not None:
        raise RuntimeError(f"serve.py exited: {''.join(stderr)[-2000:]}")
      if time.monotonic() > deadline:
        raise RuntimeError("serve.py did not warm up in time")
      try:
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        done = [line for line in metrics.splitlines()
                if line.startswith(("jaxtier_warmup_programs_compiled ", "jaxtier_warmup_programs "))]
        values = {line.split()[0]: float(line.split()[1]) for line in done}
        if (httpx.get(f"{url}/health", timeout=5).status_code == 200 and len(values) == 2
            and values["jaxtier_warmup_programs"] > 0
            and values["jaxtier_warmup_programs_compiled"] == values["jaxtier_warmup_programs"]):
          break
      except httpx.TransportError:
        pass
      time.sleep(0.2)
    yield url
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGTERM)
      proc.wait(timeout=120)


def streamed_chat(url: str, messages: list[dict]) -> tuple[float, str]:
  """(seconds to the first content token, the whole text) of one streamed greedy chat."""
  import httpx  # pylint: disable=import-outside-toplevel
  body = {"messages": messages, "temperature": 0, "max_tokens": FLAGS.answer_tokens,
          "stream": True}
  start, first, text = time.perf_counter(), None, ""
  with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
    for line in response.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
      if delta:
        first = first or time.perf_counter() - start
        text += delta
  return first, text


def disk_hit_tokens(url: str) -> float:
  import httpx  # pylint: disable=import-outside-toplevel
  for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
    if line.startswith("jaxtier_disk_hit_tokens_total "):
      return float(line.split()[1])
  return 0.0


def server_section(tokenizer, directory: str) -> dict:
  messages = chat(system_prompt(tokenizer, FLAGS.system_tokens, time.time_ns()))
  disk = [f"--kv_disk_path={directory}"]
  with server(disk) as url:
    cold, cold_text = streamed_chat(url, messages)
  with server(disk) as url:
    warm, warm_text = streamed_chat(url, messages)
    hits = disk_hit_tokens(url)
  with server(["--enable_prefix_caching=false"]) as url:
    _, reference = streamed_chat(url, messages)
  prompt_tokens = len(tokenizer.encode_chat(messages))
  return {"prompt_tokens": prompt_tokens,
          "cold_ttft_s": cold, "restart_ttft_s": warm, "restart_ttft_ratio": warm / cold,
          "restart_disk_hit_tokens": hits, "restart_disk_hit_rate": hits / prompt_tokens, "same_text_as_cold": warm_text == cold_text,
          "same_text_as_no_caching": warm_text == reference}


# The offline path.


def batch_worker(spec: dict) -> dict:
  """One process's pass: warm-up, then the chat's first token timed (max_tokens=1), then, on an
  emptied device and host cache, its whole answer."""
  import jaxtier  # pylint: disable=import-outside-toplevel
  llm = jaxtier.LLM(**spec["llm"])
  llm.engine.warmup()
  params = jaxtier.SamplingParams(max_tokens=1, temperature=0)
  ids = llm.tokenizer.encode_chat(spec["messages"])
  start = time.perf_counter()
  llm.generate([ids], params, use_tqdm=False)
  ttft = time.perf_counter() - start
  hits = llm.stats().get("disk_hit_tokens", 0)
  llm.reset_prefix_cache()
  params = jaxtier.SamplingParams(max_tokens=spec["max_tokens"], temperature=0)
  (out,) = llm.generate([ids], params, use_tqdm=False)
  return {"ttft_s": ttft, "disk_hit_tokens": hits, "token_ids": list(out.token_ids)}


def batch_run(llm_kwargs: dict, messages: list[dict]) -> dict:
  spec = {"llm": llm_kwargs, "messages": messages, "max_tokens": FLAGS.answer_tokens}
  done = subprocess.run([sys.executable, os.path.abspath(__file__),
                         f"--batch_worker={json.dumps(spec)}"], capture_output=True, text=True,
                        check=False)
  if done.returncode:
    raise RuntimeError(f"batch worker failed: {done.stderr[-2000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def batch_section(tokenizer, directory: str) -> dict:
  messages = chat(system_prompt(tokenizer, FLAGS.system_tokens, time.time_ns()))
  kwargs = engine_flags.llm_kwargs()
  cold = batch_run({**kwargs, "kv_disk_path": directory}, messages)
  warm = batch_run({**kwargs, "kv_disk_path": directory}, messages)
  reference = batch_run({**kwargs, "kv_disk_path": None, "enable_prefix_caching": False},
                        messages)
  prompt_tokens = len(tokenizer.encode_chat(messages))
  return {"prompt_tokens": prompt_tokens, "cold_ttft_s": cold["ttft_s"],
          "restart_ttft_s": warm["ttft_s"], "restart_ttft_ratio": warm["ttft_s"] / cold["ttft_s"],
          "restart_disk_hit_tokens": warm["disk_hit_tokens"],
          "restart_disk_hit_rate": warm["disk_hit_tokens"] / prompt_tokens,
          "same_tokens_as_no_caching": warm["token_ids"] == reference["token_ids"]}


# Steps.


def mixed_section(directory: str) -> dict:
  """Interleaved rounds, the disk tier off and on, each round new prompts and (on) a new
  directory, so the tier writes every prompt block and reads none."""
  off = bench_engine.make_llm(kv_disk_path=None)
  rates = {"off": [], "on": []}
  written, hits = [], []
  for round_ in range(FLAGS.mixed_rounds):
    workload = bench_engine.build_workload(off.tokenizer, FLAGS.num_prompts, FLAGS.min_prompt,
                                           FLAGS.max_prompt, FLAGS.seed + 1000 * round_)
    path = os.path.join(directory, f"round{round_}")
    on = bench_engine.make_llm(kv_disk_path=path)
    if round_ == 0:  # compiles, untimed
      bench_engine.run_engine(off, workload[:4])
      bench_engine.run_engine(on, workload[:4])
    first, second = (off, on) if round_ % 2 == 0 else (on, off)
    runs = {id(first): bench_engine.run_engine(first, workload),
            id(second): bench_engine.run_engine(second, workload)}
    rates["off"].append(runs[id(off)]["tokens_per_s"])
    rates["on"].append(runs[id(on)]["tokens_per_s"])
    on.engine.flush_disk()
    stats = on.stats()
    written.append((stats["disk_bytes_written"], stats["disk_write_seconds"]))
    hits.append(stats["disk_hit_tokens"])  # a pass's own prompts read back after eviction
    if runs[id(on)]["token_ids"] != runs[id(off)]["token_ids"]:
      raise RuntimeError("the disk tier changed the mixed workload's tokens")
    on.engine.close()
    del on
  ratios = [b / a for a, b in zip(rates["off"], rates["on"])]
  return {"tokens_per_s_off": rates["off"], "tokens_per_s_on": rates["on"],
          "on_over_off": ratios, "on_over_off_median": statistics.median(ratios),
          "write_mb_per_s": sum(b for b, _ in written) / max(sum(s for _, s in written), 1e-9) / 1e6,
          "bytes_written_per_round": [b for b, _ in written], "disk_hit_tokens_per_round": hits}


def index_section(directory: str) -> dict:
  """`--index_blocks` files written, then a new store indexes them."""
  from jaxtier.kvcache import disk  # pylint: disable=import-outside-toplevel
  layout = disk.BlockLayout((("k", (1, 2, 4, 8), "bfloat16"), ("v", (1, 2, 4, 8), "bfloat16")))
  block = [np.zeros((1, 2, 4, 8), np.float32).astype(disk.dtype_of("bfloat16"))] * 2
  start = time.perf_counter()
  with disk.DiskStore(directory, "index-bench", layout, 1 << 40) as store:
    for i in range(FLAGS.index_blocks):
      while not store.write(i.to_bytes(16, "little"), block):
        if store.figures()["disk_write_errors"]:
          raise RuntimeError(f"writing to {directory} failed: see the warning above")
        time.sleep(0.001)  # the queue is full: let the writer catch up
    store.flush()
  write_s = time.perf_counter() - start
  start = time.perf_counter()
  with disk.DiskStore(directory, "index-bench", layout, 1 << 40) as store:
    seconds = time.perf_counter() - start
    count = len(store)
  return {"blocks": count, "index_rebuild_s": seconds, "write_s": write_s}


def main(argv):
  del argv
  if FLAGS.batch_worker:
    print(json.dumps(batch_worker(json.loads(FLAGS.batch_worker))))
    return
  from jaxtier import checkpoint  # pylint: disable=import-outside-toplevel
  with checkpoint.open_metadata(FLAGS.model) as opened:
    tokenizer = opened.tokenizer
  report = {"model": FLAGS.model}
  root = tempfile.mkdtemp(prefix="kv-disk-bench-")
  try:
    for name in FLAGS.disk_sections:
      directory = os.path.join(root, name)
      section = {"server": lambda: server_section(tokenizer, directory),
                 "batch": lambda: batch_section(tokenizer, directory),
                 "mixed": lambda: mixed_section(directory),
                 "index": lambda: index_section(directory)}[name]
      report[name] = section()
      print(json.dumps({name: report[name]}), file=sys.stderr, flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print_report(report, FLAGS.out, 2)


if __name__ == "__main__":
  app.run(main)
