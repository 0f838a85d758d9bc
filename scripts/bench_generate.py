"""jaxtier vs Hugging Face transformers on the same checkpoint and prompts, side by side in one run.

Prints JSON: batch-1 greedy decode tokens/s, time to first token, jaxtier's compile time (reported
separately, excluded from the rest), the jaxtier/HF ratio, and jaxtier's decode step time against
the bound weight_bytes / memory read bandwidth, with the bandwidth measured in the same run.
Needs the `ref` extra (torch, transformers) for the Hugging Face side; `--skip_hf` runs without it.
"""

import json
import os
import statistics
import time

import jax
import numpy as np
from absl import app, flags, logging

from jaxtier import checkpoint
import jaxtier
from jaxtier.checkpoint import registry
from jaxtier.engine.padded import generate_batch
from jaxtier.offload import measure
from jaxtier.sampling import SamplingParams
from jaxtier.scheduler import Request

import benchlib

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name of a GGUF model")
flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt")
flags.DEFINE_integer("repeats", 3, "timed repeats per prompt (median reported)")
flags.DEFINE_integer("threads", os.cpu_count(), "torch CPU threads")
flags.DEFINE_bool("skip_hf", False, "measure jaxtier only")

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the mountains,",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


def memory_bandwidth(nbytes: int = 512 << 20, repeats: int = 7) -> dict[str, float]:
  """Read bandwidth (bytes/s) of a jitted sum over a large array, the access pattern of a decode
  step's weight reads, using every core XLA uses; and a numpy copy's (read + write) for reference."""
  host = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(host)
  copies = benchlib.timed_calls(lambda: np.copyto(dst, host), repeats)
  return {"xla_read": measure.read_bytes_per_s(nbytes, repeats),
          "numpy_copy": 2 * nbytes / statistics.median(copies)}


def timed_generation(run) -> tuple[float, float]:
  """(time to first token, decode tokens/s) of one generation; `run(on_token)` drives it."""
  stamps = []
  start = time.perf_counter()
  run(lambda *_: stamps.append(time.perf_counter()))
  ttft = stamps[0] - start
  return ttft, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def jaxtier_runner(llm: jaxtier.LLM):
  params = SamplingParams(max_tokens=FLAGS.new_tokens, temperature=0, ignore_eos=True)

  def run(ids, on_token):
    generate_batch(llm.graphdef, llm.state, llm.tokenizer, [Request.of(0, ids, params, 0)],
                   llm.max_model_len, llm.cache_dtype, on_token=on_token)

  return run


def hf_runner():
  import torch
  import transformers
  torch.set_num_threads(FLAGS.threads)
  path = registry.fetch(registry.find_manifest(FLAGS.model))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()

  class Stamp(transformers.generation.streamers.BaseStreamer):
    def __init__(self, on_token):
      self.on_token, self.prompt_seen = on_token, False

    def put(self, value):
      if self.prompt_seen:
        self.on_token()
      self.prompt_seen = True

    def end(self):
      pass

  def run(ids, on_token):
    with torch.no_grad():
      model.generate(torch.tensor([ids]), max_new_tokens=FLAGS.new_tokens,
                     min_new_tokens=FLAGS.new_tokens, do_sample=False,
                     streamer=Stamp(on_token) if on_token else None, pad_token_id=0)

  return run, {"transformers": transformers.__version__, "torch": torch.__version__,
               "torch_threads": FLAGS.threads}


def load_times() -> dict:
  """Seconds to load the model from its GGUF file (dequantizing) and from its Orbax copy."""
  gguf_path = registry.fetch(registry.find_manifest(FLAGS.model))
  gguf_load = checkpoint.load(gguf_path)
  orbax_load = checkpoint.load(FLAGS.model)
  return {"gguf": round(gguf_load.seconds, 3), f"{orbax_load.kind}_copy": round(orbax_load.seconds, 3)}


def summarize(results: list[tuple[float, float]]) -> dict:
  return {"ttft_s": statistics.median(r[0] for r in results),
          "decode_tokens_per_s": statistics.median(r[1] for r in results)}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  llm = jaxtier.LLM(FLAGS.model)
  prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
  bandwidth = memory_bandwidth()
  runners = {"jaxtier": jaxtier_runner(llm)}
  versions = {}
  if not FLAGS.skip_hf:
    runners["hf"], versions = hf_runner()
  compile_start = time.perf_counter()
  for ids in prompt_ids:  # compiles every prompt-length bucket and the decode step
    runners["jaxtier"](ids, None)
  first_pass = time.perf_counter() - compile_start
  runners.get("hf", lambda *_: None)(prompt_ids[0], None)  # warm-up
  results = {name: [] for name in runners}
  for _ in range(FLAGS.repeats):  # interleaved, so load changes hit both sides alike
    for ids in prompt_ids:
      for name, run in runners.items():
        results[name].append(timed_generation(lambda cb: run(ids, cb)))
  ours = summarize(results["jaxtier"])
  steady = sum(t + (FLAGS.new_tokens - 1) / tps for t, tps in results["jaxtier"]) / FLAGS.repeats
  ours["compile_s"] = max(first_pass - steady, 0.0)
  weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(llm.state))
  step_s = 1 / ours["decode_tokens_per_s"]
  report = {
      "model": FLAGS.model, "dtype": "float32", "new_tokens": FLAGS.new_tokens,
      "prompts": len(PROMPTS), "repeats": FLAGS.repeats, "layer_execution": llm.layer_execution,
      "load_seconds": load_times(),
      "jaxtier": ours,
      "decode_step_vs_bound": {
          "weight_bytes": weight_bytes,
          "read_bandwidth_gb_s": bandwidth["xla_read"] / 1e9,
          "numpy_copy_bandwidth_gb_s": bandwidth["numpy_copy"] / 1e9,
          "bound_step_s": weight_bytes / bandwidth["xla_read"], "step_s": step_s,
          "step_over_bound": step_s / (weight_bytes / bandwidth["xla_read"])},
  }
  if "hf" in results:
    hf = {**summarize(results["hf"]), **versions}
    report["hf"] = hf
    report["decode_speedup_vs_hf"] = ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
    report["ttft_speedup_vs_hf"] = hf["ttft_s"] / ours["ttft_s"]
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
