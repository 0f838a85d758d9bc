"""Weight formats of one model side by side: quality and decode speed, as one JSON object.

The formats, all of the default model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file):

  float32                the GGUF file's weights dequantized once into a float32 Hugging Face
                         directory (`--hf_dir`, built on first use, see below): the reference
  int8, int4_g{32,64,128}  that directory quantized on load (`quantization="int8"`, or "int4"
                         with `quantization_group_size` 32, 64 or 128)
  gguf_q4_1_blocks       the registry model as it is (its blocks kept where the CPU kernels run)
  gguf_q4_1_dequantized  the registry model with `weight_format="float"`

The float32 weights are the file's Q4_1 weights dequantized (the only real weights available
offline), so int4 in groups of 32 with a scale and minimum, Q4_1's own scheme, lands on the file's
grid again and loses next to nothing; the other group sizes and int8 put the weights on other
grids, and their losses are those of quantizing these weights a second time, not those of
quantizing the model's original weights.

quality: each format with each of `--kernels` ("auto", and "portable": the code an accelerator
  runs) is loaded alone, measured, and freed before the next. Perplexity of `--heldout` (original
  expository prose written for this benchmark, so no model has seen it in training) in windows of
  `--window` tokens, each window's first token unscored, from the engine's prompt
  log-probabilities (`SamplingParams(prompt_logprobs=0)`); greedy agreement on `--num_prompts`
  prompts (examples/prompts.jsonl, then `EXTRA_PROMPTS`, chat and raw): the share of prompts
  whose first `--greedy_tokens` greedy tokens (EOS ignored) equal the reference's, and the mean
  length of the matching prefix. The reference of a row is float32 with the same kernels
  (float32 portable is measured against float32 auto, which shows what the kernels alone move).
  Each row also has its perplexity over the reference's, the mean and largest difference of the
  scored tokens' log-probabilities from the reference's, and where the weights live
  (`LLM.memory_report()`: device and host weight bytes, bytes by format, the device bytes over
  the reference's).

speed: decode tokens/s at each of `--batches` for the resident formats (float32, int8, int4,
  gguf_q4_1_blocks) and with the last `--offload_layers` layers in pinned host memory (float32,
  int4, gguf_q4_1_blocks). Every engine is built first and all are held at once (the default
  seven peaked at 3.3 GB resident here), each with a KV pool for the widest batch and no prefix
  cache; then one untimed round compiles each batch, and `--rounds` timed rounds visit every
  (batch, format), formats in a rotated order each round, so drift on a shared machine hits all
  alike. A visit adds `batch` requests of `--speed_prompt_tokens` prompt tokens asking for
  `--new_tokens` tokens (greedy, EOS ignored), steps the engine until every request has its first
  token (the prefill, not timed), then times the steps to the end: tokens/s is the tokens those
  steps produced over their seconds. A row reports the median over rounds, every round's figure,
  and against each of its baselines (a compact format against float32, an offloaded one against
  the same format resident and, if compact, against float32 offloaded) the median over rounds of
  the ratio of the two visits of that round. With an offloaded format among them, freed memory
  is retained in one arena for the whole process (`jaxtier.kernels.cpu.heap`, as
  `scripts/bench_offload.py` runs), so every row runs with the same allocator.

Formats the engine does not offer (an engine argument `jaxtier.engine.args.EngineArgs` does not
have yet) or refuses (a ValueError while building) are rows with a "skipped" reason.

The float32 Hugging Face directory: config.json (LlamaForCausalLM), model.safetensors (float32,
[out, in] linear weights), tokenizer.json and tokenizer_config.json (special tokens, EOS ids,
chat template), written from jaxtier's GGUF reader (`scripts/hf_dirs.py`), checked on the way
(the config and the tokenizer read back equal) and moved into place only when complete.
`--check_conversion` adds a section comparing it with the registry model loaded with
`weight_format="float"` (the same float32 values, so greedy tokens and log-probabilities should
match exactly).

Prints {"model", "hf_dir", "machine", "settings", "conversion" (with --check_conversion),
"quality": [rows], "speed": [rows]}; progress goes to stderr. A quick run (about a minute on two
cores):

  python scripts/bench_quant.py --formats=float32,gguf_q4_1_blocks --kernels=auto \
      --max_windows=1 --window=256 --num_prompts=6 --speed_formats=float32,gguf_q4_1_blocks \
      --batches=1,8 --new_tokens=16 --rounds=2

The whole benchmark: `python scripts/bench_quant.py --check_conversion`.
"""

import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time

import numpy as np
from absl import app, flags, logging

import jaxtier
from jaxtier.common import cache_dirs
from jaxtier.engine import args as engine_args
from jaxtier.kernels.cpu import heap as cpu_allocator

import benchlib
import hf_dirs

FLAGS = flags.FLAGS
_HERE = os.path.dirname(os.path.abspath(__file__))
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name of a GGUF model")
flags.DEFINE_string("hf_dir", None, "the float32 Hugging Face directory made from the GGUF "
                    "file (built if missing); default: <jaxtier cache>/models/<model>-hf-f32")
flags.DEFINE_bool("rebuild_hf_dir", False, "build the Hugging Face directory even if it exists")
flags.DEFINE_bool("check_conversion", False, "compare the Hugging Face directory with the "
                  "registry model loaded with weight_format='float'")
flags.DEFINE_bool("quality", True, "run the quality section")
flags.DEFINE_bool("speed", True, "run the speed section")
flags.DEFINE_list("formats", ["float32", "int8", "int4_g32", "int4_g64", "int4_g128",
                              "gguf_q4_1_blocks", "gguf_q4_1_dequantized"],
                  "quality section: the formats (rows)")
flags.DEFINE_list("kernels", ["auto", "portable"], "quality section: kernels of each format")
flags.DEFINE_string("heldout", os.path.join(_HERE, "..", "examples", "heldout.txt"),
                    "text of the perplexity measurement")
flags.DEFINE_string("prompts", os.path.join(_HERE, "..", "examples", "prompts.jsonl"),
                    "JSONL prompts of the greedy agreement ({\"prompt\"} or {\"messages\"}), "
                    "followed by the script's own")
flags.DEFINE_integer("window", 512, "tokens per perplexity window", lower_bound=2)
flags.DEFINE_integer("max_windows", 0, "perplexity windows at most (0: the whole text)",
                     lower_bound=0)
flags.DEFINE_integer("num_prompts", 24, "prompts of the greedy agreement", lower_bound=1)
flags.DEFINE_integer("greedy_tokens", 16, "greedy tokens compared per prompt", lower_bound=1)
flags.DEFINE_list("speed_formats", ["float32", "int8", "int4", "gguf_q4_1_blocks",
                                    "float32_offload", "int4_offload",
                                    "gguf_q4_1_blocks_offload"],
                  "speed section: the formats (*_offload: with --offload_layers offloaded)")
flags.DEFINE_integer("offload_layers", 10, "speed section: tail layers of the *_offload formats",
                     lower_bound=1)
flags.DEFINE_integer("speed_group_size", None, "speed section: quantization_group_size of int4 "
                     "(default: the engine's)")
flags.DEFINE_list("batches", ["1", "8", "32"], "speed section: decode batches")
flags.DEFINE_integer("speed_prompt_tokens", 32, "speed section: prompt tokens per request",
                     lower_bound=1)
flags.DEFINE_integer("new_tokens", 64, "speed section: tokens each request generates",
                     lower_bound=2)
flags.DEFINE_integer("rounds", 3, "speed section: timed rounds (after one untimed round)",
                     lower_bound=1)
flags.DEFINE_bool("retain_freed_memory", True, "keep freed host memory for reuse "
                  "(jaxtier.kernels.cpu.heap, in one arena when offloading), as the batch and "
                  "serving scripts do")
flags.DEFINE_string("out", None, "also write the JSON object to this file")

BLOCK_SIZE = 16  # the engine's default KV block
_VISITS = itertools.count()  # numbers the decode visits (their request ids)


@dataclasses.dataclass(frozen=True)
class Format:
  """A weight format: which checkpoint ("hf": the float32 directory, "registry": --model) and
  the engine arguments that select it."""
  source: str
  args: dict


QUALITY_FORMATS = {
    "float32": Format("hf", {}),
    # no quantization, bfloat16 compute: how far rounding alone moves the greedy tokens
    "bfloat16": Format("hf", {"dtype": "bfloat16"}),
    "int8": Format("hf", {"quantization": "int8"}),
    "int4_g32": Format("hf", {"quantization": "int4", "quantization_group_size": 32}),
    "int4_g64": Format("hf", {"quantization": "int4", "quantization_group_size": 64}),
    "int4_g128": Format("hf", {"quantization": "int4", "quantization_group_size": 128}),
    "gguf_q4_1_blocks": Format("registry", {}),
    "gguf_q4_1_dequantized": Format("registry", {"weight_format": "float"}),
}
SPEED_RESIDENT = ("float32", "int8", "int4", "gguf_q4_1_blocks")
SPEED_OFFLOADED = ("float32", "int4", "gguf_q4_1_blocks")
REFERENCE = "float32"

# Greedy prompts after examples/prompts.jsonl: chat conversations and raw text.
EXTRA_PROMPTS = [
    {"id": "boil", "messages": [{"role": "user", "content": "Why does water boil at a lower "
                                                            "temperature on a mountain?"}]},
    {"id": "recipe", "messages": [{"role": "user", "content": "Give me a simple recipe for "
                                                              "pancakes."}]},
    {"id": "translate", "messages": [{"role": "user", "content": "Translate 'good morning' into "
                                                                 "French and Spanish."}]},
    {"id": "email", "messages": [{"role": "system", "content": "You write short, polite emails."},
                                 {"role": "user", "content": "Ask my landlord to fix the "
                                                             "heating."}]},
    {"id": "sort", "messages": [{"role": "user", "content": "Write a Python function that sorts "
                                                            "a list of numbers."}]},
    {"id": "moon", "messages": [{"role": "user", "content": "Why does the moon have phases?"}]},
    {"id": "exercise", "messages": [{"role": "user", "content": "List three benefits of regular "
                                                                "exercise."}]},
    {"id": "followup", "messages": [
        {"role": "user", "content": "What is a prime number?"},
        {"role": "assistant", "content": "A prime number is a whole number greater than 1 whose "
                                         "only divisors are 1 and itself."},
        {"role": "user", "content": "Is 51 a prime number?"}]},
    {"id": "sleep", "messages": [{"role": "user", "content": "Give two tips for sleeping "
                                                             "better."}]},
    {"id": "history", "prompt": "The Industrial Revolution began in Britain because"},
    {"id": "science", "prompt": "Photosynthesis is the process by which plants"},
    {"id": "letter", "prompt": "Dear Sir or Madam,\n\nI am writing to"},
    {"id": "numbers", "prompt": "1, 1, 2, 3, 5, 8, 13,"},
    {"id": "json", "prompt": "{\"name\": \"Alice\", \"age\": 30, \"city\":"},
    {"id": "weather", "prompt": "The weather forecast for tomorrow says that"},
    {"id": "howto", "prompt": "To change a flat tyre, first"},
    {"id": "sql", "prompt": "SELECT name, email FROM users WHERE"},
    {"id": "poem", "prompt": "Roses are red, violets are blue,"},
]


def log(message: str) -> None:
  print(f"bench_quant: {message}", file=sys.stderr, flush=True)


def blocks_for(tokens: int) -> int:
  return -(-tokens // BLOCK_SIZE)


# The float32 Hugging Face directory.


def default_hf_dir(model: str) -> str:
  return os.path.join(cache_dirs.cache_dir(), "models", f"{model}-hf-f32")


def ensure_hf_dir(text: str) -> str:
  """The float32 Hugging Face directory of --model, built if missing (or --rebuild_hf_dir)."""
  from jaxtier.checkpoint import registry
  directory = FLAGS.hf_dir or default_hf_dir(FLAGS.model)
  complete = all(os.path.isfile(os.path.join(directory, name))
                 for name in ("config.json", "model.safetensors", "tokenizer.json"))
  if complete and not FLAGS.rebuild_hf_dir:
    return directory
  manifest = registry.find_manifest(FLAGS.model)
  if manifest is None or manifest.format != "gguf":
    raise app.UsageError(f"--model={FLAGS.model!r} is not a registered GGUF model")
  log(f"building the float32 Hugging Face directory {directory}")
  os.makedirs(os.path.dirname(directory), exist_ok=True)
  gguf_path = registry.fetch(manifest)
  start = time.perf_counter()
  hf_dirs.build_hf_dir(gguf_path, directory, text)
  log(f"wrote {directory} in {time.perf_counter() - start:.1f} s")
  return directory


# Engines.


def missing_args(kwargs: dict) -> list[str]:
  """The names in `kwargs` that are not engine arguments of this jaxtier."""
  known = {f.name for f in dataclasses.fields(engine_args.EngineArgs)}
  return sorted(set(kwargs) - known)


def make_llm(model: str, kwargs: dict):
  """(LLM, None), or (None, why not) where an argument is unknown or the engine refuses."""
  missing = missing_args(kwargs)
  if missing:
    return None, f"this jaxtier's EngineArgs has no {', '.join(missing)}"
  try:
    return jaxtier.LLM(model, **kwargs), None
  except (ValueError, NotImplementedError) as e:
    return None, f"{type(e).__name__}: {e}"


def weight_figures(llm) -> dict:
  """Where the weights live and how they are held (`LLM.memory_report`); `block_activations`
  "none" where no weight is held in blocks."""
  from jaxtier.kernels.cpu import matmul
  report = llm.memory_report()
  blocks = any(fmt in matmul.BYTES_PER_COLUMN for fmt in report["weight_bytes_by_format"])
  return {key: report[key] for key in ("device_weight_bytes", "host_weight_bytes",
                                       "weight_bytes_by_format", "offload_tail_layers",
                                       "prefetch_depth")} | {
      "layer_execution": llm.layer_execution,
      "block_activations": llm.block_activations if blocks else "none"}


# Quality.


def load_prompts(path: str, count: int) -> list[dict]:
  """The first `count` of the prompts in `path` and then `EXTRA_PROMPTS`."""
  with open(path) as f:
    prompts = [json.loads(line) for line in f if line.strip()]
  prompts += EXTRA_PROMPTS
  if count > len(prompts):
    raise app.UsageError(f"--num_prompts={count}: there are {len(prompts)} prompts")
  return prompts[:count]


def prompt_ids(llm, prompt: dict) -> list[int]:
  if "messages" in prompt:
    return llm.chat_token_ids(prompt["messages"])
  return llm.prompt_token_ids(prompt["prompt"])


def windows_of(ids: list[int]) -> list[list[int]]:
  """The text's tokens in windows of --window (the last one shorter), at most --max_windows."""
  windows = [ids[i:i + FLAGS.window] for i in range(0, len(ids), FLAGS.window)]
  windows = [w for w in windows if len(w) >= 2]
  return windows[:FLAGS.max_windows] if FLAGS.max_windows else windows


def token_logprobs(llm, windows: list[list[int]]) -> list[np.ndarray]:
  """Each window's log-probabilities of its tokens after the first, from the prompt
  log-probabilities of one generate call."""
  outputs = llm.generate(windows, jaxtier.SamplingParams(max_tokens=1, prompt_logprobs=0))
  return [np.array([entry[token].logprob for token, entry in
                    zip(window[1:], out.prompt_logprobs[1:])], np.float64)
          for window, out in zip(windows, outputs)]


def greedy(llm, prompts: list[dict]) -> list[tuple[int, ...]]:
  params = jaxtier.SamplingParams(max_tokens=FLAGS.greedy_tokens, temperature=0, ignore_eos=True)
  return [out.token_ids for out in llm.generate([prompt_ids(llm, p) for p in prompts], params)]


def evaluate(llm, text: str, prompts: list[dict]) -> dict:
  """Perplexity of `text` and the greedy tokens of `prompts` under one engine."""
  start = time.perf_counter()
  windows = windows_of(llm.tokenizer.encode(text))
  per_window = token_logprobs(llm, windows)
  scored = np.concatenate(per_window)
  return {"perplexity": math.exp(-scored.mean()),
          "window_perplexities": [math.exp(-w.mean()) for w in per_window],
          "windows": len(windows), "scored_tokens": int(scored.size),
          "logprobs": scored, "greedy": greedy(llm, prompts),
          "eval_s": time.perf_counter() - start,
          "compile_s": llm.stats()["compile_seconds"]}


def common_prefix(a, b) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def against(result: dict, ref: dict) -> dict:
  """A result's figures relative to the reference's."""
  diff = np.abs(result["logprobs"] - ref["logprobs"]) if (
      result["logprobs"].shape == ref["logprobs"].shape) else None
  prefixes = [common_prefix(a, b) for a, b in zip(result["greedy"], ref["greedy"])]
  return {"perplexity_ratio": result["perplexity"] / ref["perplexity"],
          "mean_abs_logprob_diff": None if diff is None else float(diff.mean()),
          "max_abs_logprob_diff": None if diff is None else float(diff.max()),
          "greedy_agreement": float(np.mean(
              [a == b for a, b in zip(result["greedy"], ref["greedy"])])),
          "greedy_mean_matching_prefix": float(np.mean(prefixes))}


def public(result: dict) -> dict:
  return {k: v for k, v in result.items() if k not in ("logprobs", "greedy")}


def quality_engine_args(fmt: Format, kernels: str) -> dict:
  """The engine arguments of a quality row: the format's, the kernels, a context window."""
  kwargs = dict(fmt.args)
  if kernels != "auto":
    kwargs["kernels"] = kernels
  # room for a window and its one generated token, and for every greedy prompt
  kwargs["max_model_len"] = max(blocks_for(FLAGS.window + 1), blocks_for(256)) * BLOCK_SIZE
  return kwargs


def reference_of(name: str, kernels: str, done) -> tuple[str, str] | None:
  """The (format, kernels) a row is measured against, among those `done`: float32 with the
  same kernels (float32 itself against float32 auto), else any float32 row."""
  wanted = (REFERENCE, kernels if name != REFERENCE else "auto")
  if wanted in done:
    return wanted
  return next((key for key in done if key[0] == REFERENCE), None)


def quality_row(name: str, kernels: str, hf_dir: str, text: str, prompts: list[dict]
                ) -> tuple[dict, dict | None]:
  """(the row's own figures, the evaluation) of one format and kernels; (row, None) if the
  engine does not offer it."""
  fmt = QUALITY_FORMATS[name]
  kwargs = quality_engine_args(fmt, kernels)
  row = {"format": name, "kernels": kernels,
         "model": hf_dir if fmt.source == "hf" else FLAGS.model,
         "engine_args": {k: v for k, v in kwargs.items() if k != "max_model_len"}}
  log(f"quality: {name}, kernels={kernels}")
  start = time.perf_counter()
  llm, skipped = make_llm(row["model"], kwargs)
  if llm is None:
    log(f"  skipped: {skipped}")
    return row | {"skipped": skipped}, None
  row["load_s"] = time.perf_counter() - start
  row |= weight_figures(llm)
  result = evaluate(llm, text, prompts)
  benchlib.release(llm)
  return row | public(result), result


def quality_section(hf_dir: str, text: str, prompts: list[dict]) -> list[dict]:
  """One row per (format, kernels), the reference format first, each engine freed after it."""
  names = sorted(FLAGS.formats, key=lambda name: name != REFERENCE)
  kernels_list = sorted(FLAGS.kernels, key=lambda k: k != "auto")
  results, rows = {}, {}
  for name in names:
    for kernels in kernels_list:
      row, result = quality_row(name, kernels, hf_dir, text, prompts)
      rows[name, kernels] = row
      if result is None:
        continue
      results[name, kernels] = result
      ref = reference_of(name, kernels, results)
      if ref is not None:
        row |= {"reference": "/".join(ref)} | against(result, results[ref]) | {
            "device_weight_ratio": row["device_weight_bytes"] / rows[ref]["device_weight_bytes"]}
      log(f"  perplexity {row['perplexity']:.4f}, agreement {row.get('greedy_agreement')}")
  return list(rows.values())


def conversion_section(hf_dir: str, text: str, prompts: list[dict]) -> dict:
  """The Hugging Face directory against the registry model dequantized on load."""
  results = {}
  for name, model, kwargs in (("hf_dir", hf_dir, {}),
                              ("registry_float", FLAGS.model, {"weight_format": "float"})):
    log(f"conversion check: {name}")
    llm, skipped = make_llm(model, kwargs | {"max_model_len": quality_engine_args(
        QUALITY_FORMATS[REFERENCE], "auto")["max_model_len"]})
    if llm is None:
      raise RuntimeError(f"conversion check: {model} does not load: {skipped}")
    results[name] = evaluate(llm, text, prompts)
    benchlib.release(llm)
  a, b = results["hf_dir"], results["registry_float"]
  return {"hf_dir": hf_dir,
          "perplexity": {name: r["perplexity"] for name, r in results.items()},
          "greedy_identical": sum(x == y for x, y in zip(a["greedy"], b["greedy"])),
          "greedy_prompts": len(prompts), "scored_tokens": a["scored_tokens"],
          "max_abs_logprob_diff": float(np.abs(a["logprobs"] - b["logprobs"]).max())}


# Speed.


def speed_formats() -> dict[str, Format]:
  """The speed section's formats by name (`--speed_formats`)."""
  int4 = {"quantization": "int4"} | ({} if FLAGS.speed_group_size is None else
                                     {"quantization_group_size": FLAGS.speed_group_size})
  resident = {"float32": Format("hf", {}), "int8": Format("hf", {"quantization": "int8"}),
              "int4": Format("hf", int4), "gguf_q4_1_blocks": Format("registry", {})}
  every = dict(resident)
  for name in SPEED_OFFLOADED:
    fmt = resident[name]
    every[f"{name}_offload"] = Format(fmt.source,
                                      fmt.args | {"offload_tail_layers": FLAGS.offload_layers})
  return {name: every[name] for name in FLAGS.speed_formats}


def baselines(name: str) -> list[str]:
  """What a speed row is compared with: a compact resident format with float32; an offloaded
  one with the same format resident and, if compact, with float32 offloaded."""
  if name.endswith("_offload"):
    resident = name[:-len("_offload")]
    return [resident] + ([f"{REFERENCE}_offload"] if resident != REFERENCE else [])
  return [] if name == REFERENCE else [REFERENCE]


def speed_engine_args(fmt: Format, batches: list[int]) -> dict:
  """A KV pool with room for the widest batch, no host pool, no prefix cache (every visit
  prefills its prompts afresh)."""
  per_request = blocks_for(FLAGS.speed_prompt_tokens + FLAGS.new_tokens + 1)
  widest = max(batches)
  return fmt.args | {"max_model_len": per_request * BLOCK_SIZE, "max_num_seqs": widest,
                     "num_device_blocks": widest * per_request + max(2, widest // 8),
                     "num_host_blocks": 0, "enable_prefix_caching": False}


def speed_prompts(tokenizer, text: str, count: int) -> list[list[int]]:
  """`count` distinct prompts of --speed_prompt_tokens tokens, cut from `text`."""
  ids, size = tokenizer.encode(text), FLAGS.speed_prompt_tokens
  while len(ids) < count * size:
    ids = ids + ids[1:]
  return [ids[i * size:(i + 1) * size] for i in range(count)]


def decode_visit(llm, prompts: list[list[int]], batch: int) -> tuple[float, float]:
  """(decode tokens/s, compile seconds spent) of `batch` requests, timed from the step after
  which every request has its first token to the end."""
  engine = llm.engine
  compile_before = engine.stats(wait_for_swaps=False)["compile_seconds"]
  params = jaxtier.SamplingParams(max_tokens=FLAGS.new_tokens, temperature=0, ignore_eos=True)
  visit = f"visit-{next(_VISITS)}"
  counts = {f"{visit}-{i}": 0 for i in range(batch)}
  for i, request_id in enumerate(counts):
    engine.add_request(request_id, prompts[i], params, seed=0)

  def advance():
    for update in engine.step():
      if update.request_id in counts:
        counts[update.request_id] += len(update.new_token_ids)

  while min(counts.values()) == 0 and engine.has_unfinished():
    advance()
  start, before = time.perf_counter(), sum(counts.values())
  while engine.has_unfinished():
    advance()
  seconds = time.perf_counter() - start
  compile_s = engine.stats(wait_for_swaps=False)["compile_seconds"] - compile_before
  return (sum(counts.values()) - before) / seconds, compile_s


def speed_engines(hf_dir: str, batches: list[int]) -> tuple[dict, dict, list[dict]]:
  """({name: LLM}, {name: its engine arguments and weight figures}, rows of the formats the
  engine does not offer), every engine built at once."""
  engines, info, skipped_rows = {}, {}, []
  for name, fmt in speed_formats().items():
    log(f"speed: loading {name}")
    model = hf_dir if fmt.source == "hf" else FLAGS.model
    llm, skipped = make_llm(model, speed_engine_args(fmt, batches))
    if llm is None:
      log(f"  skipped: {skipped}")
      skipped_rows.append({"format": name, "engine_args": fmt.args, "skipped": skipped})
      continue
    engines[name] = llm
    info[name] = {"engine_args": fmt.args} | weight_figures(llm)
  return engines, info, skipped_rows


def timed_rounds(engines: dict, prompts: list[list[int]], batches: list[int]
                 ) -> tuple[dict, dict]:
  """({(name, batch): tokens/s of each round}, {name: compile seconds within timed visits})
  after one untimed round (the compiles); formats in a rotated order each round."""
  names = list(engines)
  for batch in batches:
    for name in names:
      log(f"speed: untimed round, {name}, batch {batch}")
      decode_visit(engines[name], prompts, batch)
  rates = {(name, batch): [] for name in names for batch in batches}
  compile_s = dict.fromkeys(names, 0.0)
  for r in range(FLAGS.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for batch in batches:
      for name in order:
        rate, compiled = decode_visit(engines[name], prompts, batch)
        rates[name, batch].append(rate)
        compile_s[name] += compiled
    log(f"speed: round {r + 1} of {FLAGS.rounds} done")
  return rates, compile_s


def speed_section(hf_dir: str, text: str) -> list[dict]:
  """Rows per (format, batch): median decode tokens/s over rounds, every round's, and the
  median per-round ratio to each baseline."""
  batches = sorted(set(int(b) for b in FLAGS.batches))
  engines, info, rows = speed_engines(hf_dir, batches)
  if not engines:
    return rows
  prompts = speed_prompts(next(iter(engines.values())).tokenizer, text, max(batches))
  rates, compile_s = timed_rounds(engines, prompts, batches)
  for name in engines:
    for batch in batches:
      runs = rates[name, batch]
      ratios = {base: statistics.median(a / b for a, b in zip(runs, rates[base, batch]))
                for base in baselines(name) if (base, batch) in rates}
      rows.append({"format": name, "batch": batch, "tokens_per_s": statistics.median(runs),
                   "runs_tokens_per_s": runs,
                   "step_ms": 1e3 * batch / statistics.median(runs), "ratios": ratios,
                   "compile_s_in_timed_rounds": compile_s[name]} | info[name])
  for llm in engines.values():
    llm.engine.close()
  return rows


# Report.


def machine() -> dict:
  import jax
  cpu = None
  if os.path.isfile("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                 None)
  return {"backend": jax.default_backend(), "device": str(jax.local_devices()[0]),
          "cpu": cpu, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
          "jax": jax.__version__}


def enable_compilation_cache() -> None:
  """Compiled programs on disk in the cache's xla/ folder, as the engine scripts keep them."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  import jax
  jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dirs.cache_dir(), "xla"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def check_flags() -> None:
  for name in FLAGS.formats:
    if name not in QUALITY_FORMATS:
      raise app.UsageError(f"--formats: {name!r} is not one of {list(QUALITY_FORMATS)}")
  for kernels in FLAGS.kernels:
    if kernels not in engine_args.KERNELS:
      raise app.UsageError(f"--kernels: {kernels!r} is not one of {engine_args.KERNELS}")
  known = list(SPEED_RESIDENT) + [f"{name}_offload" for name in SPEED_OFFLOADED]
  for name in FLAGS.speed_formats:
    if name not in known:
      raise app.UsageError(f"--speed_formats: {name!r} is not one of {known}")
  if not all(b.isdigit() and int(b) >= 1 for b in FLAGS.batches):
    raise app.UsageError(f"--batches: {FLAGS.batches} must be positive integers")


def main(argv):
  del argv
  check_flags()
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  offloading = FLAGS.speed and any(n.endswith("_offload") for n in FLAGS.speed_formats)
  retained = FLAGS.retain_freed_memory and cpu_allocator.retain_freed_memory(
      single_arena=offloading)
  enable_compilation_cache()
  with open(FLAGS.heldout, encoding="utf-8") as f:
    text = f.read()
  prompts = load_prompts(FLAGS.prompts, FLAGS.num_prompts)
  hf_dir = ensure_hf_dir(text)
  report = {"model": FLAGS.model, "hf_dir": hf_dir, "machine": machine() | {
      "retain_freed_memory": retained}, "settings": {
          "heldout": os.path.basename(FLAGS.heldout), "window": FLAGS.window,
          "max_windows": FLAGS.max_windows, "greedy_prompts": len(prompts),
          "greedy_tokens": FLAGS.greedy_tokens, "batches": [int(b) for b in FLAGS.batches],
          "speed_prompt_tokens": FLAGS.speed_prompt_tokens, "new_tokens": FLAGS.new_tokens,
          "rounds": FLAGS.rounds, "offload_layers": FLAGS.offload_layers}}
  if FLAGS.check_conversion:
    report["conversion"] = conversion_section(hf_dir, text, prompts)
  if FLAGS.quality:
    report["quality"] = quality_section(hf_dir, text, prompts)
  if FLAGS.speed:
    report["speed"] = speed_section(hf_dir, text)
  report["machine"]["load_average_at_end"] = os.getloadavg()
  benchlib.print_report(report, FLAGS.out, indent=1)


if __name__ == "__main__":
  app.run(main)
