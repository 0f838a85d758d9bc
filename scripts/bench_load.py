"""What loading a model costs, before and after placement-first loading, as one JSON object.

For each source (`--sources`: the registry model's Orbax copy, a Hugging Face safetensors directory
and its original GGUF file), each number of offloaded tail layers n (`--offload_layers`) and each
method, one row:

  before: the old path. `model_from_params(config, source.read_all(), dtype)` builds the whole
          stacked model on the default device from the whole parameter dict in host memory (the
          dict is dropped once the model exists, as the old `checkpoint.load` did), then
          `offload_tail(model, n, 1, "unrolled")` copies the tail out into pinned host memory and
          the head into per-layer buffers (n = 0: `GroupedTransformer(model, [(L, "unrolled")])`,
          what the CPU engine runs); the stacked model is dropped last.
  after:  `checkpoint.load(path, dtype, placed.Layout.of(L, n, 1, "unrolled"))`: every tensor read
          from the source and put straight into its final placement.

Measured per row:
  peak_{device,pinned_host}_bytes: the most bytes of live JAX arrays (`jax.live_arrays()`, summed
      by memory kind) above what was live before the load. "after" samples after every placed
      tensor (the loader's `observe` hook) and once at the end; "before" samples after
      `model_from_params` and after `offload_tail`, while the stacked model still exists (the old
      peak), and once more after dropping it. Only live arrays are seen: XLA-internal staging
      buffers, host numpy copies and the transient device slices `offload_tail` cuts out before it
      copies them to host memory are not, so "before" peaks are lower bounds; RSS shows the rest.
  final_{device,pinned_host}_bytes: the loaded model's parameters by memory kind;
      final_live_*_bytes: live array bytes above the start once the load has returned and garbage
      is collected (more than the model's bytes would be a leak).
  seconds: wall time of the whole load (opening the checkpoint to every array ready), median over
      `--repeats`; a fresh process pays its first compiles in it (the old path runs small jitted
      programs: dtype casts, layer slices, the q/k/v and gate/up concatenations).
  peak_rss_bytes: the process's peak resident set (`getrusage(RUSAGE_SELF).ru_maxrss`), with
      rss_at_start_bytes, the resident set once JAX is up and before the load starts,
      rss_after_bytes, the resident set once the load has returned (file pages of a source's
      memory maps count while they are mapped), and vm_hwm_bytes, the kernel's high-water mark
      of this process image (`VmHWM`), a cross-check.

Every (source, n, method) measurement runs in a fresh subprocess of this script (`--one`), so each
peak is its own; repeats run as rounds over all rows. Linux keeps `ru_maxrss` across `execve`
(a child starts at its parent's peak), so the parent process stays small: writing and checking
the safetensors copy runs in a subprocess too (`--one=prepare`), and the parent never loads JAX.
On CPU the memory kinds are one physical memory: device and pinned_host bytes are bookkeeping of
where the arrays would live on an accelerator, and RSS is their sum plus host copies and the
sources' memory maps.

There is no safetensors copy of the registry model, so one is written once (to `--workdir`, else a
temporary directory removed at exit) from the Orbax parameters: Hugging Face names, linear weights
[out, in], a llama `config.json`, the Orbax copy's tokenizer files. Before measuring, loading it
must give exactly the Orbax parameters.

`decode` (`--decode`): what offloading costs when it is not needed, once per n: batch-1 tokens/s of
`jaxtier.LLM(model, offload_tail_layers=n, max_model_len=512, max_num_seqs=1)` generating
`--decode_tokens` greedy tokens (`ignore_eos`) after one warm-up generate (median of
`--decode_repeats` timed generates, each including its short prompt's prefill), each n in its own
process with freed memory retained (`jaxtier.kernels.cpu.heap`), and the ratio to n = 0.

`summary`: per source and n, after against before for peak device bytes, seconds and peak RSS.

  python scripts/bench_load.py --repeats=3
  python scripts/bench_load.py --sources=gguf --offload_layers=0,20 --nodecode   # a quick look
"""

import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from jaxtier.common.choices import DTYPE_BYTES

import benchlib

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "registry name of the model")
flags.DEFINE_enum("dtype", "float32", list(DTYPE_BYTES),
                  "parameter dtype of the loaded model")
flags.DEFINE_list("sources", ["orbax", "safetensors", "gguf"], "checkpoint formats to load from")
flags.DEFINE_list("offload_layers", ["0", "10", "20"], "offloaded tail layers (0: all resident)")
flags.DEFINE_list("methods", ["before", "after"], "loading methods (see the module docstring)")
flags.DEFINE_integer("repeats", 1, "rounds of every measurement (median seconds and RSS)",
                     lower_bound=1)
flags.DEFINE_bool("decode", True, "also measure batch-1 decode tokens/s at each offload")
flags.DEFINE_integer("decode_tokens", 64, "tokens each decode generate produces", lower_bound=2)
flags.DEFINE_integer("decode_repeats", 3, "timed decode generates per n (median)", lower_bound=1)
flags.DEFINE_string("workdir", None, "where the safetensors copy is written (and reused); default "
                    "a temporary directory removed at exit")
flags.DEFINE_string("out", None, "also write the JSON object to this file")
flags.DEFINE_string("one", None, "internal: run one step in this process, 'source,n,method', "
                    "'decode,n' or 'prepare', and print its result as JSON")
flags.DEFINE_string("path", None, "internal: the checkpoint --one loads")
flags.DEFINE_integer("num_layers", None, "internal: the model's layers, for --one")

SOURCES = ("orbax", "safetensors", "gguf")
METHODS = ("before", "after")
KINDS = ("device", "pinned_host")
DECODE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def progress(message: str) -> None:
  print(f"bench_load: {message}", file=sys.stderr, flush=True)


# Memory.


def live_bytes() -> dict[str, int]:
  """Bytes of live JAX arrays by memory kind."""
  import jax
  from jaxtier import offload
  return offload.bytes_by_memory_kind(jax.live_arrays())


class Sampler:
  """Peak live bytes per memory kind above those live at construction."""

  def __init__(self):
    gc.collect()
    self.start = live_bytes()
    self.peak = {kind: 0 for kind in KINDS}
    self.samples = 0

  def delta(self) -> dict[str, int]:
    now = live_bytes()
    return {kind: now.get(kind, 0) - self.start.get(kind, 0) for kind in KINDS}

  def sample(self) -> None:
    for kind, value in self.delta().items():
      self.peak[kind] = max(self.peak[kind], value)
    self.samples += 1

  def observe(self, name: str, array) -> None:
    del name, array
    self.sample()


def current_rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def vm_hwm() -> int | None:
  """The peak resident set of this process image (reset by `execve`, unlike `ru_maxrss`)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return None


# Loading, in one process.


def ready(model) -> None:
  import jax
  from flax import nnx
  jax.block_until_ready(nnx.state(model))


def load_before(path: str, num_layers: int, n: int, dtype, sampler: Sampler):
  """The old path: the whole stacked model on the device, then the tail copied out."""
  from jaxtier import checkpoint, offload
  from jaxtier.checkpoint.params import model_from_params
  from jaxtier.model import GroupedTransformer
  opened = checkpoint.open_checkpoint(path)
  with opened.source:
    params = opened.source.read_all()
  stacked = model_from_params(opened.config, params, dtype, opened.path)
  del params
  ready(stacked)
  sampler.sample()
  model = (offload.offload_tail(stacked, n, 1, "unrolled") if n
           else GroupedTransformer(stacked, [(num_layers, "unrolled")]))
  ready(model)
  sampler.sample()
  del stacked
  gc.collect()
  sampler.sample()
  return model


def load_after(path: str, num_layers: int, n: int, dtype, sampler: Sampler):
  """Placement-first: every tensor straight into its final placement."""
  from jaxtier import checkpoint
  from jaxtier.checkpoint import placed
  layout = placed.Layout.of(num_layers, n, 1, "unrolled")
  model = checkpoint.load(path, dtype, layout, observe=sampler.observe).model
  ready(model)
  sampler.sample()
  return model


def measure_load(source: str, n: int, method: str, path: str, num_layers: int) -> dict:
  import jax
  from flax import nnx
  from jaxtier import checkpoint, offload
  dtype = checkpoint.resolve_dtype(FLAGS.dtype)
  jax.devices()  # the backend up before the baseline
  gc.collect()
  rss_start = current_rss()
  sampler = Sampler()
  load = load_before if method == "before" else load_after
  start = time.perf_counter()
  model = load(path, num_layers, n, dtype, sampler)
  seconds = time.perf_counter() - start
  gc.collect()
  final = offload.bytes_by_memory_kind(nnx.state(model))
  live = sampler.delta()
  row = {"source": source, "offload_layers": n, "method": method, "seconds": seconds,
         "samples": sampler.samples, "peak_rss_bytes": peak_rss(), "vm_hwm_bytes": vm_hwm(),
         "rss_at_start_bytes": rss_start, "rss_after_bytes": current_rss()}
  for kind in KINDS:
    row[f"peak_{kind}_bytes"] = sampler.peak[kind]
    row[f"final_{kind}_bytes"] = final.get(kind, 0)
    row[f"final_live_{kind}_bytes"] = live[kind]
  return row


def measure_decode(n: int) -> dict:
  from jaxtier.kernels.cpu import heap as cpu_allocator
  # before JAX starts its threads; one arena, as the scripts that offload
  retained = cpu_allocator.retain_freed_memory(single_arena=n > 0)
  import jaxtier
  llm = jaxtier.LLM(FLAGS.model, dtype=FLAGS.dtype, offload_tail_layers=n, max_model_len=512,
                    max_num_seqs=1)
  params = jaxtier.SamplingParams(max_tokens=FLAGS.decode_tokens, temperature=0.0,
                                  ignore_eos=True)
  llm.generate(DECODE_PROMPT, params)  # warm-up: compiles
  seconds, tokens = [], 0
  for _ in range(FLAGS.decode_repeats):
    start = time.perf_counter()
    out = llm.generate(DECODE_PROMPT, params)
    seconds.append(time.perf_counter() - start)
    tokens = len(out[0].token_ids)
  median = statistics.median(seconds)
  return {"offload_layers": n, "layer_execution": llm.layer_execution,
          "prompt_tokens": len(llm.prompt_token_ids(DECODE_PROMPT)), "generated_tokens": tokens,
          "seconds": median, "seconds_all": seconds, "decode_tokens_per_s": tokens / median,
          "retain_freed_memory": retained}


def run_one(spec: str) -> dict:
  parts = spec.split(",")
  if parts[0] == "prepare":
    return prepare_sources(FLAGS.workdir)
  if parts[0] == "decode":
    return measure_decode(int(parts[1]))
  source, n, method = parts
  return measure_load(source, int(n), method, FLAGS.path, FLAGS.num_layers)


# The safetensors copy.


def write_safetensors(orbax_dir: str, directory: str) -> None:
  """A Hugging Face directory of the Orbax copy's parameters (written once, then reused)."""
  import numpy as np
  from safetensors.numpy import save_file
  from jaxtier.checkpoint import orbax_io
  from jaxtier.checkpoint.params import HF_GLOBAL_NAMES, HF_LAYER_NAMES
  if os.path.isfile(os.path.join(directory, "model.safetensors")):
    return
  config, params, _ = orbax_io.load(orbax_dir)
  tensors = {}
  for name, path in HF_LAYER_NAMES.items():
    if path in params:
      for i, layer in enumerate(params[path]):
        tensors[f"model.layers.{i}.{name}"] = np.ascontiguousarray(
            layer.T if name.endswith("proj.weight") else layer)
  for name, path in HF_GLOBAL_NAMES.items():
    if path in params:
      tensors[name] = np.ascontiguousarray(params[path])
  os.makedirs(directory, exist_ok=True)
  save_file(tensors, os.path.join(directory, "model.safetensors.partial"),
            metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config(config), f, indent=1)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(orbax_dir, name), directory)
  os.replace(os.path.join(directory, "model.safetensors.partial"),
             os.path.join(directory, "model.safetensors"))


def hf_config(config) -> dict:
  """The `config.json` fields `jaxtier.model.config.config_from_hf` reads, for `config`."""
  scaling = config.rope_scaling
  rope = None if scaling.rope_type == "default" else {
      "rope_type": scaling.rope_type, "factor": scaling.factor,
      "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
      "original_max_position_embeddings": scaling.original_max_position_embeddings}
  return {"architectures": ["LlamaForCausalLM"], "model_type": config.architecture,
          "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
          "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
          "head_dim": config.head_dim, "rope_theta": config.rope_theta, "rope_scaling": rope,
          "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
          "attention_bias": config.attention_bias, "hidden_act": "silu",
          "max_position_embeddings": config.max_position_embeddings, "torch_dtype": "float32"}


def check_same_params(orbax_dir: str, hf_dir: str) -> None:
  """Loading the safetensors copy gives exactly the Orbax config and parameters."""
  import numpy as np
  from jaxtier import checkpoint
  from jaxtier.checkpoint import orbax_io
  from jaxtier.checkpoint.params import params_from_model
  config, params, _ = orbax_io.load(orbax_dir)
  loaded = checkpoint.load(hf_dir, "float32")
  if loaded.kind != "hf" or loaded.model.config != config:
    raise SystemExit(f"{hf_dir}: loads as {loaded.kind} with {loaded.model.config}, expected hf "
                     f"with {config}")
  got = params_from_model(loaded.model)
  if got.keys() != params.keys():
    raise SystemExit(f"{hf_dir}: parameters {sorted(got)} differ from {sorted(params)}")
  differ = [p for p in params if not np.array_equal(np.asarray(got[p]), params[p])]
  if differ:
    raise SystemExit(f"{hf_dir}: parameters {differ} differ from the Orbax copy's")


# Orchestration.


def prepare_sources(workdir: str) -> dict:
  """{source: checkpoint path} for the registry model, its number of layers and the backend."""
  import jax
  from jaxtier import checkpoint
  from jaxtier.checkpoint import orbax_io, registry
  manifest = registry.find_manifest(FLAGS.model)
  if manifest is None:
    raise app.UsageError(f"--model={FLAGS.model!r} is not a registered model "
                         f"({registry.known_models()})")
  checkpoint.open_checkpoint(FLAGS.model).close()  # makes the Orbax copy if there is none yet
  orbax_dir = os.path.join(registry.model_dir(manifest), "orbax")
  paths = {"orbax": orbax_dir}
  if "gguf" in FLAGS.sources:
    if manifest.format != "gguf":
      raise app.UsageError(f"model {manifest.name!r} is registered as {manifest.format}, not gguf")
    paths["gguf"] = registry.fetch(manifest)
  if "safetensors" in FLAGS.sources:
    paths["safetensors"] = os.path.join(workdir, "safetensors")
    progress(f"writing the safetensors copy to {paths['safetensors']} ...")
    write_safetensors(orbax_dir, paths["safetensors"])
    check_same_params(orbax_dir, paths["safetensors"])
    progress("the safetensors copy loads as the Orbax parameters")
  return {"paths": {s: p for s, p in paths.items() if s in FLAGS.sources},
          "num_layers": orbax_io.read_config(orbax_dir).num_layers,
          "backend": jax.default_backend()}


def subprocess_row(spec: str, extra: list[str]) -> dict:
  """The row `--one=spec` prints, measured in a fresh process."""
  argv = [sys.executable, os.path.abspath(__file__), f"--one={spec}", f"--model={FLAGS.model}",
          f"--dtype={FLAGS.dtype}", f"--sources={','.join(FLAGS.sources)}",
          f"--decode_tokens={FLAGS.decode_tokens}", f"--decode_repeats={FLAGS.decode_repeats}"]
  argv += extra
  done = subprocess.run(argv, capture_output=True, text=True, check=False)
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    tail = done.stderr.strip().splitlines()[-5:]
    progress(f"--one={spec} failed (exit {done.returncode}): " + " | ".join(tail))
    return {"error": tail, "returncode": done.returncode}
  return json.loads(lines[-1])


def merge_repeats(runs: list[dict]) -> dict:
  """One row from repeated runs: median seconds and RSS, largest peaks."""
  good = [r for r in runs if "error" not in r]
  if not good:
    return runs[-1]
  row = dict(good[0])
  row["seconds"] = statistics.median(r["seconds"] for r in good)
  row["seconds_all"] = [r["seconds"] for r in good]
  for key in ("peak_rss_bytes", "vm_hwm_bytes", "rss_at_start_bytes", "rss_after_bytes"):
    row[key] = int(statistics.median(r[key] for r in good))
  for kind in KINDS:
    row[f"peak_{kind}_bytes"] = max(r[f"peak_{kind}_bytes"] for r in good)
  row["repeats"] = len(good)
  return row


def load_rows(paths: dict[str, str], num_layers: int, offloads: list[int]) -> list[dict]:
  keys = [(s, n, m) for s in FLAGS.sources for n in offloads for m in FLAGS.methods]
  runs: dict[tuple, list[dict]] = {k: [] for k in keys}
  for repeat in range(FLAGS.repeats):
    for source, n, method in keys:
      row = subprocess_row(f"{source},{n},{method}",
                           [f"--path={paths[source]}", f"--num_layers={num_layers}"])
      runs[(source, n, method)].append(row)
      if "error" not in row:
        progress(f"[{repeat + 1}/{FLAGS.repeats}] {source} n={n} {method}: "
                 f"{row['seconds']:.2f} s, peak device {row['peak_device_bytes'] / 1e6:.0f} MB, "
                 f"pinned_host {row['peak_pinned_host_bytes'] / 1e6:.0f} MB, RSS "
                 f"{row['peak_rss_bytes'] / 1e6:.0f} MB")
  return [merge_repeats(runs[k]) for k in keys]


def decode_section(offloads: list[int]) -> dict:
  section = {"prompt": DECODE_PROMPT, "max_tokens": FLAGS.decode_tokens, "max_model_len": 512,
             "max_num_seqs": 1, "prefetch_depth": 1}
  rows = {}
  for n in offloads:
    row = subprocess_row(f"decode,{n}", [])
    rows[str(n)] = row
    if "error" not in row:
      progress(f"decode n={n}: {row['decode_tokens_per_s']:.1f} tokens/s")
  base = rows.get("0", {}).get("decode_tokens_per_s")
  for row in rows.values():
    if base and "decode_tokens_per_s" in row:
      row["vs_offload_0"] = row["decode_tokens_per_s"] / base
  section["by_offload_layers"] = rows
  return section


def ratio(a, b):
  return a / b if a is not None and b else None


def summary(rows: list[dict]) -> dict:
  """Per source and n: before, after and after / before of peak device bytes, seconds, RSS."""
  by = {(r["source"], r["offload_layers"], r["method"]): r for r in rows if "error" not in r}
  out: dict[str, dict] = {}
  for source, n, _ in sorted(by, key=lambda k: (SOURCES.index(k[0]), k[1])):
    entry = {}
    for key in ("peak_device_bytes", "peak_pinned_host_bytes", "final_device_bytes", "seconds",
                "peak_rss_bytes"):
      before = by.get((source, n, "before"), {}).get(key)
      after = by.get((source, n, "after"), {}).get(key)
      entry[key] = {"before": before, "after": after, "after_over_before": ratio(after, before)}
    out.setdefault(source, {})[str(n)] = entry
  return out


def check_flags() -> list[int]:
  for source in FLAGS.sources:
    if source not in SOURCES:
      raise app.UsageError(f"--sources: {source!r} is not one of {SOURCES}")
  for method in FLAGS.methods:
    if method not in METHODS:
      raise app.UsageError(f"--methods: {method!r} is not one of {METHODS}")
  try:
    return [int(n) for n in FLAGS.offload_layers]
  except ValueError:
    raise app.UsageError(f"--offload_layers={FLAGS.offload_layers}: expected integers") from None


def main(argv):
  del argv
  if FLAGS.one:
    print(json.dumps(run_one(FLAGS.one)))
    return
  offloads = check_flags()
  workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="bench_load_")
  try:
    prepared = subprocess_row("prepare", [f"--workdir={workdir}"])
    if "error" in prepared:
      raise SystemExit("could not prepare the sources: " + " | ".join(prepared["error"]))
    report = {"model": FLAGS.model, "dtype": FLAGS.dtype, "num_layers": prepared["num_layers"],
              "backend": prepared["backend"], "paths": prepared["paths"],
              "repeats": FLAGS.repeats, "cpu_count": os.cpu_count()}
    report["rows"] = load_rows(prepared["paths"], prepared["num_layers"], offloads)
  finally:
    if FLAGS.workdir is None:
      shutil.rmtree(workdir, ignore_errors=True)
  report["decode"] = decode_section(offloads) if FLAGS.decode else None
  report["summary"] = summary(report["rows"])
  benchlib.print_report(report, FLAGS.out, indent=2)


if __name__ == "__main__":
  app.run(main)
