"""The continuous-batching engine against the padded driver and Hugging Face, as one JSON object.

Every figure comes from the same run, so ratios compare like with like on a noisy machine:

  mixed:        an offline workload of `--num_prompts` prompts (chat conversations rendered with the
                chat template, and raw text) of `--min_prompt`..`--max_prompt` tokens, each asking
                for `--min_output`..`--max_output` tokens (greedy, `ignore_eos`, so every request
                generates what it asks), built deterministically from `--seed`. Generated tokens/s
                of (a) the engine (`LLM.generate` with one SamplingParams per prompt), (b) today's
                padded driver (`LLM.run_batch` on length-sorted chunks of max_num_seqs, as
                `LLM.generate` ran before the engine), (c) Hugging Face transformers `generate` on
                the same token ids in left-padded static batches of `--hf_batch_size` (torch CPU,
                float32; each batch runs to its longest request, only requested tokens count).
                Each side runs once untimed (compiles its shapes) before its timed passes.
  pressure:     `--pressure_prompts` long prompts (`--pressure_min_prompt` tokens or more) with the
                device KV pool unconstrained (room for every request at once), then cut to
                `--pressure_fraction` of the unconstrained run's peak device blocks (at least what
                the largest request needs), with swap and with recompute preemption: tokens/s of
                each, the ratio to unconstrained, whether the token ids are identical, swap counts,
                bytes and seconds, and preemptions.
  decode_steps: the engine's pure decode step (median of `--decode_steps` steps, timed around
                `Engine.step()`) at each batch in `--batches` and prompt length in `--contexts`,
                against the bound max((weight bytes + KV bytes read) / read bandwidth,
                FLOPs / matmul rate), both rates measured in this run (a jitted sum over a large
                array; a jitted float32 matmul) before every visit of a (batch, context) point
                and after the last. Each point is visited `--decode_rounds` times, in rounds
                over all the points (the machine's rates and the steps' times drift by tens of
                percent within minutes on shared hosts, so no one slow or fast stretch decides
                a point). A point's `step_ms` is the median of its visits' medians, and its
                `ratio` divides it by the bound at the median rates of the samples just before
                and just after its visits (central estimates over the same minutes: the sum's
                rate here ranges over 20-50 GB/s, and its highest samples do not show in the
                steps). `visits_ratio` holds each visit against the better of its two samples,
                `ratio_at_better_samples` their median, and `ratio_vs_best_rates` the point's
                step against the bound at the best samples of the whole run, the strictest
                bound. All samples are reported.
                FLOPs: 2 x params x batch + 4 x batch x context x layers x heads x head_dim.
                Beside it, the step's weight matmuls alone at that batch
                (`measure.weight_matmuls_s`: the model's projection and LM-head shapes,
                random weights, one jitted program), what the matmul kernels need for the
                weights: packed as the engine holds them (`packed_weights`), and with XLA's
                matmuls on [in, out] weights (`xla_weight_matmuls_alone_ms`).
                Also batch-1 decode tokens/s of the engine and of Hugging Face
                (`--hf_decode_tokens` tokens after the shortest context's prompt).
                `block_activations` names how the kept GGUF blocks multiply ("int16" or
                "float32", `--block_activations` resolved; "none" without blocks). With
                `--decode_other_activations` (and blocks kept), the same again with the other
                one (`decode_steps_float32` or `decode_steps_int16`; batch 1 against the same
                Hugging Face figure).
  penalties:    (not run by default) one batch of `--penalty_prompts` greedy raw prompts of
                64-128 tokens generating `--penalty_tokens` each, without and with
                repetition_penalty=1.1 and frequency_penalty=0.5, alternating passes: tokens/s of
                each and their ratio (the cost of the transformed sampler and of not planning
                ahead), on the mixed section's engine.
  compile:      compiled variants and compile seconds of every engine this run built.
  targets:      engine >= 3x HF and faster than the padded driver (mixed); under pressure >= 0.7x
                unconstrained with identical outputs; step <= 1.5x its bound; batch 1 >= 2.5x HF.

Needs the `ref` extra (torch, transformers) for the Hugging Face side; `--skip_hf` runs without it.
Engine flags are those of the batch job (`--max_num_seqs`, `--block_size`, ...). A quick run:

  python scripts/bench_engine.py --num_prompts=4 --max_prompt=128 --max_output=16 --skip_hf \
      --pressure_prompts=4 --pressure_min_prompt=64 --pressure_max_prompt=128 --batches=1,2 \
      --contexts=32

Timings on shared machines are noisy (torch threads contending with other processes slow the
Hugging Face side badly; set `--threads` to the idle cores): compare ratios from one quiet run.
"""

import dataclasses
import math
import os
import statistics
import time

import numpy as np
from absl import app, flags

from jaxtier.engine import flags as engine_flags

import benchlib

FLAGS = flags.FLAGS
flags.DEFINE_integer("seed", 0, "seed of the workloads (prompt kinds, lengths, texts, max_tokens)")
flags.DEFINE_list("sections", ["mixed", "pressure", "decode_steps"], "sections to run")
flags.DEFINE_bool("decode_other_activations", True, "also time decode steps with the other "
                  "block_activations (float32 where the run's resolve to int16, and the reverse), "
                  "where the engine keeps GGUF blocks")
flags.DEFINE_integer("num_prompts", 64, "prompts of the mixed workload", lower_bound=1)
flags.DEFINE_integer("min_prompt", 16, "shortest mixed-workload prompt, tokens", lower_bound=1)
flags.DEFINE_integer("max_prompt", 512, "longest mixed-workload prompt, tokens", lower_bound=1)
flags.DEFINE_integer("min_output", 16, "fewest tokens a request asks for", lower_bound=1)
flags.DEFINE_integer("max_output", 256, "most tokens a request asks for", lower_bound=1)
flags.DEFINE_float("chat_fraction", 0.5, "share of prompts that are chat conversations",
                   lower_bound=0, upper_bound=1)
flags.DEFINE_integer("repeats", 1, "timed passes of each throughput measurement (best reported)",
                     lower_bound=1)
flags.DEFINE_integer("pressure_prompts", 16, "prompts of the pressure workload", lower_bound=1)
flags.DEFINE_integer("pressure_min_prompt", 512, "shortest prompt of the pressure workload",
                     lower_bound=1)
flags.DEFINE_integer("pressure_max_prompt", 1024, "longest prompt of the pressure workload",
                     lower_bound=1)
flags.DEFINE_float("pressure_fraction", 0.25, "device KV pool under pressure, as a share of the "
                   "unconstrained run's peak device blocks", lower_bound=0, upper_bound=1)
flags.DEFINE_list("batches", ["1", "8", "16", "32"], "decode step batches")
flags.DEFINE_list("contexts", ["32", "512"], "decode step prompt lengths, tokens")
flags.DEFINE_integer("decode_steps", 20, "timed pure decode steps per (batch, context)",
                     lower_bound=1)
# Each (batch, context) point compiles its prefill and decode shapes just before its steps; the
# first few steps after a compile ran up to ~30% slower here (batch 1, 512 tokens: 6.6-8.7 ms for
# steps 3-8 of a fresh process against ~6 ms later): with 2 warm steps, those went into the median.
flags.DEFINE_integer("warm_steps", 8, "untimed decode steps before the timed ones", lower_bound=1)
# The machine's rates and the steps' times both swing by tens of percent within minutes here, so
# every (batch, context) point is visited this many times, in rounds over all the points (the
# first round compiles), and a point's figures are the medians over its visits.
flags.DEFINE_integer("decode_rounds", 3, "visits of each (batch, context) decode point, in rounds",
                     lower_bound=1)
flags.DEFINE_integer("hf_batch_size", 8, "static batch of the Hugging Face side", lower_bound=1)
flags.DEFINE_integer("hf_decode_tokens", 64, "tokens of the batch-1 decode comparison",
                     lower_bound=2)
flags.DEFINE_integer("decode_repeats", 3, "runs of the batch-1 decode comparison (median)",
                     lower_bound=1)
flags.DEFINE_integer("penalty_prompts", 16, "prompts of the penalties section (one batch)",
                     lower_bound=1)
flags.DEFINE_integer("penalty_tokens", 64, "tokens each request of the penalties section generates",
                     lower_bound=1)
flags.DEFINE_integer("threads", os.cpu_count(), "torch CPU threads")
flags.DEFINE_bool("skip_hf", False, "measure jaxtier only")
flags.DEFINE_string("out", None, "also write the JSON object to this file")

SECTIONS = ("mixed", "pressure", "decode_steps", "penalties")
TARGETS = {"mixed_engine_vs_hf": 3.0, "pressure_ratio": 0.7, "decode_step_over_bound": 1.5,
           "batch1_vs_hf": 2.5}

_SUBJECTS = ["the old lighthouse keeper", "a careful engineer", "the river", "our small team",
             "the northern train", "a curious student", "the city library", "every morning bell",
             "the quiet orchard", "a patient gardener", "the harbour crane", "the weather station"]
_VERBS = ["watched", "repaired", "described", "measured", "followed", "remembered", "painted",
          "counted", "carried", "explained", "ignored", "welcomed"]
_OBJECTS = ["the long shadows of the hills", "a broken clock", "seven letters from abroad",
            "the price of bread", "the storm over the bay", "an unfinished map",
            "the sound of distant engines", "a box of old photographs", "the first snow",
            "the rules of a forgotten game", "the tide tables", "a crowded market square"]
_TAILS = ["", " before the sun went down", " while everyone else was asleep",
          " with more attention than anyone expected", " and wrote everything down in a notebook",
          " because nobody else would", " during the longest week of the year"]
_QUESTIONS = ["Summarize the passage above in a few sentences.", "What happens next? Continue.",
              "Rewrite this as a short poem.", "List the people and places mentioned.",
              "Explain what the author is describing."]


# Workloads.


def sentence(rng: np.random.Generator) -> str:
  """One sentence of varying length, picked by `rng`."""
  parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
  text = " ".join(parts) + rng.choice(_TAILS)
  return text[0].upper() + text[1:] + "."


def raw_prompt(tokenizer, rng: np.random.Generator, length: int) -> list[int]:
  """Exactly `length` token ids of running text."""
  text = ""
  ids: list[int] = []
  while len(ids) < length:
    text += " ".join(sentence(rng) for _ in range(max(4, (length - len(ids)) // 8)))
    text += " "
    ids = tokenizer.encode(text)
  return ids[:length]


def chat_prompt(tokenizer, rng: np.random.Generator, length: int, at_least: int = 0
                ) -> list[int] | None:
  """A rendered conversation of at most `length` tokens, as close to it as whole sentences allow,
  and of at least `at_least` (then one sentence past `length` if need be: whole sentences may
  not land in [at_least, length]); None if the template with one sentence is longer already."""
  earlier = []
  if rng.random() < 0.5:  # some conversations have an earlier exchange
    earlier = [{"role": "user", "content": sentence(rng)},
               {"role": "assistant", "content": sentence(rng) + " " + sentence(rng)}]
  question = str(rng.choice(_QUESTIONS))
  render = lambda body: tokenizer.encode(tokenizer.apply_chat_template(
      earlier + [{"role": "user", "content": body + "\n\n" + question}]), add_special_tokens=False)
  body = sentence(rng)
  best = render(body)
  if len(best) > length:
    return None
  while True:
    longer = body + " " + sentence(rng)
    ids = render(longer)
    if len(ids) > length:
      return best if len(best) >= at_least else ids
    body, best = longer, ids


def build_workload(tokenizer, count: int, min_prompt: int, max_prompt: int,
                   seed: int) -> list[dict]:
  """`count` requests: {"ids", "kind", "max_tokens"}, deterministic in `seed`."""
  rng = np.random.default_rng(seed)
  requests = []
  for _ in range(count):
    length = int(rng.integers(min_prompt, max_prompt + 1))
    max_tokens = int(rng.integers(FLAGS.min_output, FLAGS.max_output + 1))
    ids, kind = None, "raw"
    if rng.random() < FLAGS.chat_fraction and tokenizer.chat_template is not None:
      ids, kind = chat_prompt(tokenizer, rng, length, at_least=min_prompt), "chat"
    if ids is None:
      ids, kind = raw_prompt(tokenizer, rng, length), "raw"
    requests.append({"ids": ids, "kind": kind, "max_tokens": max_tokens})
  return requests


def describe(workload: list[dict]) -> dict:
  lengths = [len(r["ids"]) for r in workload]
  outputs = [r["max_tokens"] for r in workload]
  return {"prompts": len(workload), "chat": sum(r["kind"] == "chat" for r in workload),
          "raw": sum(r["kind"] == "raw" for r in workload),
          "prompt_tokens": {"min": min(lengths), "mean": statistics.mean(lengths),
                            "max": max(lengths), "total": sum(lengths)},
          "max_tokens": {"min": min(outputs), "mean": statistics.mean(outputs),
                         "max": max(outputs), "total": sum(outputs)}}


def sampling(max_tokens: int):
  from jaxtier.sampling import SamplingParams
  return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def blocks_for(tokens: int) -> int:
  return -(-tokens // FLAGS.block_size)


# Engines.


def make_llm(**overrides):
  """An LLM from the engine flags, with `overrides` (pool sizes replace their GB forms)."""
  import jaxtier
  kwargs = engine_flags.llm_kwargs()
  kwargs["seed"] = FLAGS.seed
  if "num_device_blocks" in overrides:
    kwargs["kv_cache_memory_gb"] = None
  if "num_host_blocks" in overrides:
    kwargs["swap_space_gb"] = None
  kwargs.update(overrides)
  if FLAGS.max_model_len is not None:
    kwargs["max_model_len"] = FLAGS.max_model_len
  return jaxtier.LLM(**kwargs)


COMPILES: dict[str, dict] = {}


def record_compiles(name: str, llm) -> None:
  stats = llm.stats()
  COMPILES[name] = {"compiled_variants": stats["compiled_variants"],
                    "compile_seconds": stats["compile_seconds"]}


def run_engine(llm, workload: list[dict]) -> dict:
  """One `LLM.generate` pass; tokens/s, token ids and what the engine counted during it.

  The prefix cache is emptied first: a pass must not reuse the KV an earlier pass of the same
  prompts left behind (the other sides recompute every prompt). Prefixes the workload's own
  requests share stay cached within the pass, as in any run."""
  llm.reset_prefix_cache()
  before = llm.stats()
  start = time.perf_counter()
  outputs = llm.generate([r["ids"] for r in workload],
                         [sampling(r["max_tokens"]) for r in workload])
  wall = time.perf_counter() - start
  after = llm.stats()
  tokens = sum(len(o.token_ids) for o in outputs)
  return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
          "compile_s": after["compile_seconds"] - before["compile_seconds"],
          "token_ids": [o.token_ids for o in outputs], "before": before, "after": after}


def run_padded(llm, workload: list[dict]) -> dict:
  """One pass of the padded driver: length-sorted chunks of max_num_seqs, each one static batch."""
  requests = [llm.make_request(r["ids"], sampling(r["max_tokens"])) for r in workload]
  order = sorted(range(len(requests)), key=lambda i: len(workload[i]["ids"]))
  results = {}
  start = time.perf_counter()
  for first in range(0, len(order), llm.max_num_seqs):
    chunk = order[first:first + llm.max_num_seqs]
    results.update(zip(chunk, llm.run_batch([requests[i] for i in chunk])))
  wall = time.perf_counter() - start
  tokens = sum(len(c.token_ids) for c in results.values())
  return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
          "token_ids": [results[i].token_ids for i in range(len(workload))]}


def best(runs: list[dict]) -> dict:
  return max(runs, key=lambda r: r["tokens_per_s"])


def public(run: dict) -> dict:
  return {k: v for k, v in run.items() if k not in ("token_ids", "before", "after")}


def differing(a: list, b: list) -> int:
  return sum(tuple(x) != tuple(y) for x, y in zip(a, b))


# Hugging Face.


class HuggingFace:
  """The same checkpoint in transformers (torch CPU, float32), loaded as bench_generate.py does."""

  def __init__(self):
    import torch
    import transformers
    from jaxtier.checkpoint import registry
    torch.set_num_threads(FLAGS.threads)
    self.torch = torch
    manifest = registry.find_manifest(FLAGS.model)
    if manifest is not None:
      path = registry.fetch(manifest)
      self.model = transformers.AutoModelForCausalLM.from_pretrained(
          os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    elif FLAGS.model.endswith(".gguf"):
      self.model = transformers.AutoModelForCausalLM.from_pretrained(
          os.path.dirname(os.path.abspath(FLAGS.model)), gguf_file=os.path.basename(FLAGS.model),
          dtype=torch.float32)
    else:  # a Hugging Face directory
      self.model = transformers.AutoModelForCausalLM.from_pretrained(FLAGS.model,
                                                                     dtype=torch.float32)
    self.model.eval()
    self.versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                     "torch_threads": FLAGS.threads}
    self.streamer_base = transformers.generation.streamers.BaseStreamer

  def generate(self, rows: list[list[int]], new_tokens: int, streamer=None):
    """Greedy, exactly `new_tokens` per row, rows left-padded to the longest."""
    torch = self.torch
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
      ids[i, width - len(row):] = torch.tensor(row)
      mask[i, width - len(row):] = 1
    with torch.no_grad():
      return self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 streamer=streamer)

  def run_mixed(self, workload: list[dict]) -> dict:
    """Length-sorted static batches; only each row's requested tokens count as generated."""
    order = sorted(range(len(workload)), key=lambda i: len(workload[i]["ids"]))
    size = FLAGS.hf_batch_size
    start = time.perf_counter()
    computed = 0
    for first in range(0, len(order), size):
      chunk = [workload[i] for i in order[first:first + size]]
      longest = max(r["max_tokens"] for r in chunk)
      self.generate([r["ids"] for r in chunk], longest)
      computed += longest * len(chunk)
    wall = time.perf_counter() - start
    tokens = sum(r["max_tokens"] for r in workload)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "computed_tokens": computed, "batch_size": size}

  def decode_tokens_per_s(self, ids: list[int], new_tokens: int) -> float:
    """Batch-1 decode tokens/s from the times the streamer sees each generated token."""
    stamps = []

    class Stamp(self.streamer_base):
      prompt_seen = False

      def put(self, value):
        if self.prompt_seen:
          stamps.append(time.perf_counter())
        self.prompt_seen = True

      def end(self):
        pass

    self.generate([ids], new_tokens, Stamp())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


# Sections.


def penalties_section(llm, tokenizer) -> dict:
  """Tokens/s of one batch of greedy requests without and with repetition_penalty=1.1 and
  frequency_penalty=0.5 (the transformed sampler, and no planning ahead for their steps), in
  alternating passes after one untimed pass each way (their compiles); best of the rest."""
  workload = build_workload(tokenizer, FLAGS.penalty_prompts, 64, 128, FLAGS.seed + 2)
  plain = sampling(FLAGS.penalty_tokens)
  ways = {"plain": plain, "penalized": dataclasses.replace(plain, repetition_penalty=1.1,
                                                             frequency_penalty=0.5)}
  runs = {name: [] for name in ways}
  for _ in range(1 + max(FLAGS.repeats, 2)):
    for name, params in ways.items():
      llm.reset_prefix_cache()
      before = llm.stats()
      start = time.perf_counter()
      outputs = llm.generate([r["ids"] for r in workload], params)
      wall = time.perf_counter() - start
      after = llm.stats()
      tokens = sum(len(o.token_ids) for o in outputs)
      runs[name].append({"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                         "steps_planned_ahead": (after["steps_planned_ahead"]
                                                 - before["steps_planned_ahead"])})
  report = {name: {**best(passes[1:]), "all_tokens_per_s": [r["tokens_per_s"] for r in passes]}
            for name, passes in runs.items()}
  report["penalized_over_plain"] = (report["penalized"]["tokens_per_s"]
                                    / report["plain"]["tokens_per_s"])
  report["targets"] = {}
  return report


def mixed_section(llm, workload: list[dict], hf) -> dict:
  warm = {"engine": run_engine(llm, workload), "padded": run_padded(llm, workload)}
  runs = {"engine": [], "padded": []}
  for _ in range(FLAGS.repeats):  # interleaved, so load changes hit every side alike
    runs["engine"].append(run_engine(llm, workload))
    runs["padded"].append(run_padded(llm, workload))
  engine, padded = best(runs["engine"]), best(runs["padded"])
  first, last = engine["before"], engine["after"]
  report = {
      "workload": describe(workload), "max_num_seqs": llm.max_num_seqs,
      "engine": {**public(engine), "untimed_pass_s": warm["engine"]["wall_s"],
                 "untimed_pass_compile_s": warm["engine"]["compile_s"],
                 "preemptions": {k: last["preemptions"][k] - first["preemptions"][k]
                                 for k in last["preemptions"]},
                 "device_blocks_total": last["device_blocks_total"],
                 "device_blocks_peak_used": last["device_blocks_peak_used"],
                 "prefix_hit_tokens": (last["prefix_device_hit_tokens"]
                                       - first["prefix_device_hit_tokens"]),
                 "model_calls": last["model_calls"] - first["model_calls"],
                 "steps": last["steps"] - first["steps"]},
      "padded": {**public(padded), "untimed_pass_s": warm["padded"]["wall_s"]},
      "engine_vs_padded": engine["tokens_per_s"] / padded["tokens_per_s"],
      "requests_differing_engine_vs_padded": differing(engine["token_ids"], padded["token_ids"]),
  }
  targets = {"engine_faster_than_padded": report["engine_vs_padded"] > 1}
  if hf is not None:
    hf.generate([workload[0]["ids"]], 2)  # warm-up
    hf_runs = [hf.run_mixed(workload) for _ in range(FLAGS.repeats)]
    report["hf"] = {**best(hf_runs), **hf.versions}
    report["engine_vs_hf"] = engine["tokens_per_s"] / report["hf"]["tokens_per_s"]
    targets["engine_ge_3x_hf"] = report["engine_vs_hf"] >= TARGETS["mixed_engine_vs_hf"]
  report["targets"] = targets
  return report


def pressure_run(llm, workload: list[dict]) -> dict:
  """An untimed pass (compiles), then the timed passes; the best one with its engine figures."""
  run_engine(llm, workload)
  run = best([run_engine(llm, workload) for _ in range(FLAGS.repeats)])
  first, last = run["before"], run["after"]
  delta = lambda key: last[key] - first[key]
  # Compiles left in a timed pass (a preemption pattern not seen before) are taken out of its time.
  seconds = run["wall_s"] - run["compile_s"]
  return {
      "tokens": run["tokens"], "wall_s": run["wall_s"], "compile_s_in_timed_pass": run["compile_s"],
      "tokens_per_s": run["tokens"] / seconds,
      "device_blocks_total": last["device_blocks_total"],
      "device_blocks_peak_used": last["device_blocks_peak_used"],
      "host_blocks_total": last["host_blocks_total"],
      "host_blocks_peak_used": last["host_blocks_peak_used"],
      "swap_out_count": delta("swap_out_count"), "swap_in_count": delta("swap_in_count"),
      "swap_out_bytes": delta("swap_out_bytes"), "swap_in_bytes": delta("swap_in_bytes"),
      "swap_seconds": delta("swap_seconds"),
      "preemptions": {k: last["preemptions"][k] - first["preemptions"][k]
                      for k in last["preemptions"]},
      "requests_aborted": {k: v - first["requests_aborted"].get(k, 0)
                           for k, v in last["requests_aborted"].items()},
      "finished_by_reason": {k: v - first["finished_by_reason"].get(k, 0)
                             for k, v in last["finished_by_reason"].items()},
      "token_ids": run["token_ids"]}


def pressure_section(workload: list[dict]) -> dict:
  longest = max(len(r["ids"]) + r["max_tokens"] for r in workload)
  max_model_len = FLAGS.max_model_len or blocks_for(longest) * FLAGS.block_size
  demand = sum(blocks_for(len(r["ids"]) + r["max_tokens"]) for r in workload)
  room = demand + max(2, math.ceil(0.02 * demand))  # every request at once, plus the watermark
  llm = make_llm(max_model_len=max_model_len, num_device_blocks=room, num_host_blocks=0)
  runs = {"unconstrained": pressure_run(llm, workload)}
  record_compiles("pressure_unconstrained", llm)
  benchlib.release(llm)
  peak = runs["unconstrained"]["device_blocks_peak_used"]
  constrained = max(math.ceil(FLAGS.pressure_fraction * peak), blocks_for(max_model_len))
  for mode in ("swap", "recompute"):
    llm = make_llm(max_model_len=max_model_len, num_device_blocks=constrained,
                   num_host_blocks=peak if mode == "swap" else 0, preemption_mode=mode)
    runs[mode] = pressure_run(llm, workload)
    record_compiles(f"pressure_{mode}", llm)
    benchlib.release(llm)
  base = runs["unconstrained"]
  report = {"workload": describe(workload), "max_model_len": max_model_len,
            "demand_blocks": demand, "unconstrained_peak_blocks": peak,
            "constrained_device_blocks": constrained,
            "constrained_share_of_peak": constrained / peak, "targets": {}}
  for name, run in runs.items():
    report[name] = {k: v for k, v in run.items() if k != "token_ids"}
    if name != "unconstrained":
      ratio = run["tokens_per_s"] / base["tokens_per_s"]
      diff = differing(run["token_ids"], base["token_ids"])
      report[name].update(vs_unconstrained=ratio, requests_differing=diff,
                          outputs_identical=diff == 0)
      report["targets"][f"{name}_ge_0_7x_unconstrained"] = ratio >= TARGETS["pressure_ratio"]
      report["targets"][f"{name}_outputs_identical"] = diff == 0
  return report


def filler(tokenizer, length: int, offset: int) -> list[int]:
  """A prompt of exactly `length` tokens; `offset` varies its text."""
  return raw_prompt(tokenizer, np.random.default_rng(FLAGS.seed + 1000 + offset), length)


def settle(engine, ids: list[str], counts: dict) -> None:
  """Steps until every request in `ids` has its first token (all prefills done)."""
  while any(counts[i] == 0 for i in ids):
    for update in engine.step():
      if update.request_id in counts:
        counts[update.request_id] += len(update.new_token_ids)


def decode_step(llm, batch: int, context: int, prompts: list[list[int]]) -> dict:
  """Median seconds of a pure decode step of `batch` requests with `context`-token prompts."""
  engine = llm.engine
  prefill_steps = -(-batch * context // llm.args.token_budget) + 1
  params = sampling(prefill_steps + FLAGS.warm_steps + FLAGS.decode_steps + 4)
  ids = [f"decode-{batch}-{context}-{i}" for i in range(batch)]
  counts = dict.fromkeys(ids, 0)
  for i, request_id in enumerate(ids):
    engine.add_request(request_id, prompts[i % len(prompts)], params, seed=0)
  settle(engine, ids, counts)
  for _ in range(FLAGS.warm_steps):  # compiles this batch and table width
    for update in engine.step():
      counts[update.request_id] += len(update.new_token_ids)
  compile_before = engine.stats()["compile_seconds"]
  times, generated = [], []
  for _ in range(FLAGS.decode_steps):
    generated.append(statistics.mean(counts.values()))
    start = time.perf_counter()
    updates = engine.step()
    times.append(time.perf_counter() - start)
    if len(updates) != batch or any(u.completion is not None for u in updates):
      raise RuntimeError(f"batch {batch}, context {context}: a timed step was not a pure decode "
                         f"step of {batch} requests ({len(updates)} updates)")
    for update in updates:
      counts[update.request_id] += len(update.new_token_ids)
  for request_id in ids:
    engine.abort(request_id)
  return {"step_s": statistics.median(times),
          "mean_context": context + statistics.mean(generated),
          "compile_s_in_timed_steps": engine.stats()["compile_seconds"] - compile_before}


def engine_decode_tokens_per_s(llm, ids: list[int], new_tokens: int, request_id: str) -> float:
  """Batch-1 decode tokens/s from the times `Engine.step()` returns each generated token."""
  engine = llm.engine
  engine.add_request(request_id, ids, sampling(new_tokens), seed=0)
  stamps = []
  while engine.has_unfinished():
    if any(u.new_token_ids for u in engine.step()):
      stamps.append(time.perf_counter())
  return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def decode_section(tokenizer, hf, name: str = "decode_steps", **overrides) -> dict:
  import jax
  from flax import nnx
  from jaxtier.common.kv_bytes import kv_bytes_per_token
  from jaxtier.kernels.cpu import matmul
  batches = sorted(int(b) for b in FLAGS.batches)
  contexts = sorted(int(c) for c in FLAGS.contexts)
  widest = max(batches)
  budget = max(FLAGS.max_num_batched_tokens or 2048, widest)
  prefill_steps = -(-widest * max(contexts) // budget) + 1
  longest_tokens = prefill_steps + FLAGS.warm_steps + FLAGS.decode_steps + 4
  longest = max(max(contexts) + longest_tokens, min(contexts) + FLAGS.hf_decode_tokens)
  max_model_len = FLAGS.max_model_len or blocks_for(longest) * FLAGS.block_size
  room = widest * blocks_for(max(contexts) + longest_tokens)
  llm = make_llm(max_model_len=max_model_len, max_num_seqs=widest,
                 max_num_batched_tokens=budget,
                 num_device_blocks=max(room + max(2, math.ceil(0.02 * room)),
                                       blocks_for(max_model_len)), num_host_blocks=0,
                 **overrides)
  c = llm.config
  leaves = jax.tree_util.tree_leaves(llm.state)
  weight_bytes = sum(x.nbytes for x in leaves)
  params = sum(matmul.parameter_count(x) for x in leaves)
  per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, llm.kv_cache_dtype)
  from jaxtier.offload import measure
  # The machine's rates vary over minutes (shared cores): they are sampled before each visit of
  # a point and after the last.
  rates = []

  def sample_rates():
    rates.append((measure.read_bytes_per_s(), *measure.matmul_flops_per_s()))

  dtype = next(x.dtype for x in leaves if np.issubdtype(x.dtype, np.floating))
  model = nnx.merge(llm.graphdef, llm.state)
  packed = any(getattr(node, "packed", False) is True for _, node in nnx.iter_graph(model))
  # the formats the model holds its packed layers and head in (`jaxtier.kernels.cpu.matmul`)
  from jaxtier.model import FusedDecoderLayer
  kernels = ("qkv_kernel", "o_kernel", "gate_up_kernel", "down_kernel")  # measure's order
  layer_formats = [[matmul.weight_format(getattr(node, name)[...]) for name in kernels]
                   for _, node in nnx.iter_graph(model)
                   if isinstance(node, FusedDecoderLayer) and node.packed]
  distinct = sorted({fmt for formats in layer_formats for fmt in formats})
  # one format, or the formats joined by "+" where a file mixes GGUF types ("q4_1+q8_0+q8_16")
  layer_format = "+".join(distinct) if distinct else "float32"
  head = getattr(model, "packed_head", None)
  head_format = matmul.weight_format(head[...]) if head is not None else "float32"
  matmuls = {batch: measure.weight_matmuls_s(
      c, batch, dtype, packed=packed, head_format=head_format,
      layer_format=layer_formats if len(layer_formats) == c.num_layers else distinct[0] if distinct
      else "float32") for batch in batches}
  xla_matmuls = (matmuls if not packed else
                 {batch: measure.weight_matmuls_s(c, batch, dtype) for batch in batches})
  prompts = {ctx: [filler(tokenizer, ctx, i) for i in range(4)] for ctx in contexts}
  visits = {(batch, ctx): [] for ctx in contexts for batch in batches}
  for _ in range(FLAGS.decode_rounds):
    for batch, ctx in visits:
      sample_rates()
      visits[batch, ctx].append((len(rates) - 1, decode_step(llm, batch, ctx, prompts[ctx])))
  sample_rates()
  bandwidth = max(r[0] for r in rates)
  flops_rate, n = max(r[1] for r in rates), rates[0][2]
  table = []
  for (batch, ctx), visited in visits.items():
    context = visited[0][1]["mean_context"]
    kv_bytes = batch * context * per_token
    flops = 2 * params * batch + 4 * batch * context * c.num_layers * c.num_heads * c.head_dim

    def times(read_rate, matmul_rate):  # (memory seconds, compute seconds) at these rates
      return (weight_bytes + kv_bytes) / read_rate, flops / matmul_rate

    # The samples just before and just after each visit: a point's bound uses their medians,
    # a central estimate of the rates over the minutes of its visits, as its step is the median
    # of its steps. `visits_ratio` is each visit against the better of its two samples.
    around = [r for i, _ in visited for r in rates[i:i + 2]]
    memory_s, compute_s = times(statistics.median(r[0] for r in around),
                                statistics.median(r[1] for r in around))
    bound = max(memory_s, compute_s)
    step_s = statistics.median(step["step_s"] for _, step in visited)
    visits_ratio = [step["step_s"] / max(times(max(r[0] for r in rates[i:i + 2]),
                                               max(r[1] for r in rates[i:i + 2])))
                    for i, step in visited]
    strictest = max(times(bandwidth, flops_rate))
    table.append({"batch": batch, "context": ctx, "step_ms": 1e3 * step_s,
                  "bound_ms": 1e3 * bound, "ratio": step_s / bound,
                  "visits_step_ms": [1e3 * step["step_s"] for _, step in visited],
                  "visits_ratio": visits_ratio,
                  "ratio_at_better_samples": statistics.median(visits_ratio),
                  "ratio_vs_best_rates": step_s / strictest,
                  "weight_matmuls_alone_ms": 1e3 * matmuls[batch],
                  "xla_weight_matmuls_alone_ms": 1e3 * xla_matmuls[batch],
                  "step_over_weight_matmuls": step_s / matmuls[batch],
                  "bound_by": "memory" if memory_s >= compute_s else "compute",
                  "mean_context": context, "kv_bytes_read": int(kv_bytes), "flops": int(flops),
                  "compile_s_in_timed_steps": sum(step["compile_s_in_timed_steps"]
                                                  for _, step in visited)})
  report = {
      "weight_bytes": weight_bytes, "params": params, "kv_bytes_per_token": per_token,
      "read_bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": flops_rate / 1e9,
      "read_bandwidth_gb_s_samples": [r[0] / 1e9 for r in rates],
      "matmul_gflop_s_samples": [r[1] / 1e9 for r in rates], "matmul_n": n,
      "packed_weights": packed, "layer_format": layer_format, "head_format": head_format,
      "block_activations": (llm.block_activations if any(
          fmt in matmul.BYTES_PER_COLUMN for fmt in distinct + [head_format]) else "none"),
      "steps_timed": FLAGS.decode_steps, "rounds": FLAGS.decode_rounds, "table": table,
      "targets": {
          "all_steps_le_1_5x_bound": all(
              row["ratio"] <= TARGETS["decode_step_over_bound"] for row in table),
          "all_steps_le_1_5x_bound_at_better_samples": all(
              row["ratio_at_better_samples"] <= TARGETS["decode_step_over_bound"]
              for row in table),
          "all_steps_le_1_5x_bound_at_best_rates": all(
              row["ratio_vs_best_rates"] <= TARGETS["decode_step_over_bound"] for row in table)}}
  # Batch 1 against Hugging Face, same prompt and tokens, per-token times on each side.
  ids = prompts[min(contexts)][0]
  engine_decode_tokens_per_s(llm, ids, FLAGS.hf_decode_tokens, "batch1-warm-up")
  ours = [engine_decode_tokens_per_s(llm, ids, FLAGS.hf_decode_tokens, f"batch1-{i}")
          for i in range(FLAGS.decode_repeats)]
  batch1 = {"prompt_tokens": len(ids), "new_tokens": FLAGS.hf_decode_tokens,
            "engine_decode_tokens_per_s": statistics.median(ours)}
  if hf is not None:
    hf.decode_tokens_per_s(ids, 2)  # warm-up
    theirs = [hf.decode_tokens_per_s(ids, FLAGS.hf_decode_tokens)
              for _ in range(FLAGS.decode_repeats)]
    batch1["hf_decode_tokens_per_s"] = statistics.median(theirs)
    batch1["engine_vs_hf"] = batch1["engine_decode_tokens_per_s"] / batch1["hf_decode_tokens_per_s"]
    report["targets"]["batch1_ge_2_5x_hf"] = batch1["engine_vs_hf"] >= TARGETS["batch1_vs_hf"]
  report["batch1"] = batch1
  record_compiles(name, llm)
  benchlib.release(llm)
  return report


def main(argv):
  del argv
  engine_flags.prepare()
  sections = [s.strip() for s in FLAGS.sections if s.strip()]
  for name in sections:
    if name not in SECTIONS:
      engine_flags.usage_error(f"--sections: {name!r} is not one of {SECTIONS}")
  for low, high in (("min_prompt", "max_prompt"), ("min_output", "max_output"),
                    ("pressure_min_prompt", "pressure_max_prompt")):
    if FLAGS[low].value > FLAGS[high].value:
      engine_flags.usage_error(f"--{low}={FLAGS[low].value} is more than --{high}="
                               f"{FLAGS[high].value}")
  import jax  # after prepare(): the allocator setting precedes JAX's threads
  from jaxtier.kvcache.paged import resolve_attention_impl
  hf = None if FLAGS.skip_hf else HuggingFace()
  longest = FLAGS.max_prompt + FLAGS.max_output
  llm = make_llm(max_model_len=blocks_for(longest) * FLAGS.block_size)
  tokenizer = llm.tokenizer
  report = {"model": FLAGS.model, "dtype": FLAGS.dtype, "backend": jax.default_backend(),
            "seed": FLAGS.seed, "layer_execution": llm.layer_execution,
            "kv_cache_dtype": llm.kv_cache_dtype, "block_size": FLAGS.block_size,
            "max_num_seqs": FLAGS.max_num_seqs,
            "attention_impl": resolve_attention_impl(llm.engine_config.attention_impl, llm.mesh)}
  if "mixed" in sections:
    workload = build_workload(tokenizer, FLAGS.num_prompts, FLAGS.min_prompt, FLAGS.max_prompt,
                              FLAGS.seed)
    report["mixed"] = mixed_section(llm, workload, hf)
  if "penalties" in sections:
    report["penalties"] = penalties_section(llm, tokenizer)
  record_compiles("mixed", llm)
  benchlib.release(llm)
  if "pressure" in sections:
    workload = build_workload(tokenizer, FLAGS.pressure_prompts, FLAGS.pressure_min_prompt,
                              FLAGS.pressure_max_prompt, FLAGS.seed + 1)
    report["pressure"] = pressure_section(workload)
  if "decode_steps" in sections:
    report["decode_steps"] = decode_section(tokenizer, hf)
    ran = report["decode_steps"]["block_activations"]
    if FLAGS.decode_other_activations and ran != "none":
      other = "float32" if ran == "int16" else "int16"
      name = f"decode_steps_{other}"
      section = decode_section(tokenizer, None, name, block_activations=other)
      theirs = report["decode_steps"]["batch1"].get("hf_decode_tokens_per_s")
      if theirs:
        section["batch1"]["hf_decode_tokens_per_s"] = theirs
        section["batch1"]["engine_vs_hf"] = (section["batch1"]["engine_decode_tokens_per_s"]
                                             / theirs)
      report[name] = section
  report["compile"] = {
      "compiled_variants": sum(c["compiled_variants"] for c in COMPILES.values()),
      "compile_seconds": sum(c["compile_seconds"] for c in COMPILES.values()),
      "by_engine": COMPILES}
  report["targets"] = {f"{section}.{name}": value for section in SECTIONS if section in report
                       for name, value in report[section]["targets"].items()}
  benchlib.print_report(report, FLAGS.out, indent=1)


if __name__ == "__main__":
  app.run(main)
