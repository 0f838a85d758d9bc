"""Checks the accelerator path on the machine it runs on and writes one JSON object.

What a GPU (or TPU) user runs, checked in one short process (`scripts/validate_gpu.sh` wraps it
for a machine that has JAX but not jaxtier's other dependencies). The sections, in their default
order (cheap ones first):
- `env`: JAX and its devices, each device's memory kinds and limit.
- `swap`: the engine's own swap programs (`jaxtier.kvcache.swap` on a `PagedKVCache` and its
  `HostTier`) with blocks of TinyLlama-1.1B's shape (22 layers, 4 kv heads, head_dim 64, 16
  tokens, bfloat16; smaller with `--allow_cpu`): GB/s each way at 1, 8 and 64 blocks (medians of
  5 after a warm-up), and what the host tier's pinned buffers cost the first time it takes blocks
  (swap-outs into slots never used, every earlier block kept, against rewriting used slots:
  seconds per block). It runs before `link`, whose 512 MiB buffers would grow XLA's pinned pool
  first.
- `link`: host <-> device copy rates with `pinned_host` buffers at 4, 64 and 512 MiB, and the
  device's own copy rate (bytes read plus written), which bounds a decode step.
- `hf_tiny`: the tiny Hugging Face fixtures' logits (committed, computed by transformers in float32;
  one per family: Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE)
  against jaxtier's at the highest matmul precision, at the platform's default precision (TF32 on
  NVIDIA GPUs) and with bfloat16 weights: worst absolute error and greedy (argmax) agreement.
- `engine_tiny`: `jaxtier.LLM` on the tiny Llama fixture: greedy tokens of the contiguous-cache
  reference driver, the resident engine, the engine with offloaded tail layers, and the engine
  under a device pool small enough to swap, which must all be identical; swap bytes and seconds.
  In the same engines: a prompt and then the same prompt and another with its 16-token prefix,
  identical to the reference with the prefix-cache hits counted in the stats; and a JSON-schema
  request per prompt (sampled with seeds), whose tokens must be identical resident, offloaded and
  swapping and whose texts must parse. Then the tiny Mixtral fixture with every layer's experts
  in pinned host memory (`offload_expert_layers=-1`), streamed and computed on the host: the
  reference driver's tokens.
- `sampling`: prompt log-probabilities of 24 and 40 prompts in one call against each alone, and the
  logit controls (penalties, min_p, logit_bias) identical under swapping and without planning
  ahead.
- `quant`: one projection of Llama-8B's MLP (4096 x 14336; smaller with `--allow_cpu`) as
  bfloat16, int8 (a scale per output channel) and int4 (uint4, a scale and minimum per 32 rows,
  `jaxtier.model.quant`): seconds of x @ w at 1, 8 and 32 rows against the bound weight bytes /
  device copy rate, the largest difference from the dequantized weight's product, and whether XLA
  fused the dequantization into the dot: no instruction outside a fusion's body produces a float
  array of the weight's shape (`float_weight_copies`, the names of any that do; XLA:CPU does write
  one, so a dry run reports `fused` false); and the engine on the tiny Qwen3 fixture quantized to
  int4, resident and with an offloaded tail, giving the same greedy tokens.
- `experts`: two mixture-of-experts layers (8 experts of 2048 x 5632, 2 per token, bfloat16;
  smaller with `--allow_cpu`) with their experts in pinned host memory: seconds of a forward call
  of 1 to 256 tokens when the experts stream to the device and when the host computes them, the
  measured crossover, and the cost model's (`jaxtier.offload.expert_cost`) at the measured
  host-to-device rate.
- `attention`: paged attention at the default model's attention shape (3 kv heads, 9 query heads,
  head_dim 64, bfloat16 pages of 16 slots): the Pallas Triton kernel
  (`jaxtier.attention.pallas_gpu`) against the XLA path (`paged_attention`), seconds per
  decode call at batch 1, 8 and 32 with contexts of 1024 and 4096, the bytes/s achieved on the K
  and V pages read against the device's read rate (half its copy rate), and prefill tokens/s of a
  512-token chunk at contexts 0 and 2048; the largest difference between the two. With
  `--allow_cpu` on a CPU it runs tiny shapes with the kernel in Pallas interpret mode (`interpret`
  true in its JSON), only so that the section executes.
- `compile`: the programs the default server configuration (`configs/serve_default.py`, its model
  replaced by TinyLlama-1.1B's shape; smaller with `--allow_cpu`) compiles at warm-up
  (`jaxtier.engine.engine.warmup_programs`), counted by kind (decode and prefill steps, each with
  its sampling and log-probabilities in it; transformed samplers; swaps), and the compile seconds
  of a representative few (`jaxtier.tools.export.representative_programs`: the widest decode
  step, the transformed sampler at its rows, the largest prefill step, a swap-out), built from
  abstract state (no weight is read) with JAX's persistent compilation cache off; the warm-up
  estimated as count x mean and by kind.
- `startup`: a server's start on the 1.1B-shaped model (random weights) with the default server
  configuration, in two fresh processes on one empty persistent compilation cache: the first
  (cold) builds `jaxtier.LLM` and compiles the warm-up's programs in order
  (`warmup_programs`; an ordinary request's first, `ready_programs`) until its share of the
  time box is spent; the second (warm) loads the same programs. Each reports the program count,
  how many it compiled and how many came from the cache, the seconds to the ready programs and
  to all it built, and the seconds since its process started.
- `pinned_cap`: XLA's GPU client caps pinned host memory at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64
  GiB unset), read when the backend starts: a child process started with the variable above 64
  allocates pinned_host buffers of 1 GiB past 64 GiB in all, where the host's available memory
  allows (else the section says why it did not); whether that worked, the bytes and the seconds.
  Off a GPU there is no cap: the same code pins 64 MiB and reports `cap` "none".
- `profile`: a `jax.profiler` trace (its perfetto JSON, parsed with the standard library) of a few
  decode steps of the 1.1B-shaped model (below) at the decode section's first batch size, resident
  and with its last 8 layers offloaded, in engines built as the decode section builds them (whose
  first runs then find their programs compiled): the time per kind of event (kernels, gathers,
  host-to-device and device-to-host copies, host dispatch, host waiting, other; self time, so
  nested events count once) in all and per step, and the top 10 events by time. The trace files
  go to a directory beside the JSON (`<out>_profile/`).
- `decode`: a random-weight model of TinyLlama-1.1B's shape in bfloat16 (smaller with
  `--allow_cpu`): decode tokens/s against the bound weight bytes / device copy rate, and with
  offloaded tail layers against max(resident step of the same weights, offloaded bytes /
  host-to-device rate). In this order, until the section's time box is spent: at batch 1
  (`--decode_batches`' first) resident, with 8 and 16 layers offloaded (`--decode_offload`) at the
  default prefetch depth, at each depth 1-4 (`--decode_depths`), and with `quantization="int8"`
  and `"int4"` (`--decode_quantizations`; `kernels="portable"`, what "auto" is on an accelerator:
  on a CPU the C++ kernels would keep bfloat16 weights unquantized) resident and offloaded; then
  resident at batch 8 and 32 and offloaded at 32.

Each section is timed and guarded: an error is recorded in the section and the next one runs; a
section that would start past `--budget_s` is skipped. The sections that could run long
(`TIME_BOX_S`) have a time box, cut to what is left of the budget: past it they start no new
measurement and list the ones they left out (`skipped_by_time_box`). The JSON is rewritten after
every section, so a run cut short still leaves what it measured. `--doc=FILE` appends a table of
each section's headline figures, with the commit and the device, to FILE after the run.

  python scripts/validate_gpu.py --out=validate_gpu.json             # on a GPU or TPU
  python scripts/validate_gpu.py --out=/tmp/v.json --allow_cpu       # a dry run on a CPU
"""

import atexit
import collections
import dataclasses
import gc
import glob
import gzip
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from absl import app, flags

import benchlib

SECTIONS = ["env", "swap", "link", "hf_tiny", "engine_tiny", "sampling", "quant", "experts",
            "attention", "compile", "startup", "pinned_cap", "profile", "decode"]
# Seconds each long section may take at most (cut to what is left of --budget_s): on an H200 the
# whole run is meant to fit 8 minutes.
TIME_BOX_S = {"swap": 30.0, "compile": 60.0, "startup": 150.0, "pinned_cap": 75.0,
              "profile": 60.0, "decode": 200.0}

_OUT = flags.DEFINE_string("out", "validate_gpu.json", "where the JSON goes")
_ALLOW_CPU = flags.DEFINE_bool("allow_cpu", False, "run on a CPU (small shapes; a dry run)")
_BUDGET = flags.DEFINE_float("budget_s", 450.0, "no section starts after this many seconds; the "
                             "time boxes are cut to what is left of it")
_SECTIONS = flags.DEFINE_list("sections", SECTIONS, "sections to run, in order")
_DOC = flags.DEFINE_string("doc", None, "after the run, append a table of each section's "
                           "headline figures, the commit and the device to this markdown file "
                           "(e.g. docs/gpu_validation.md)")
_DECODE_BATCHES = flags.DEFINE_list("decode_batches", ["1", "8", "32"], "decode batch sizes")
_DECODE_OFFLOAD = flags.DEFINE_list("decode_offload", ["8", "16"],
                                    "offloaded tail layers for the decode section (2 and 4 of the "
                                    "small model's 8 with --allow_cpu)")
_DECODE_DEPTHS = flags.DEFINE_list("decode_depths", ["1", "2", "3", "4"],
                                   "prefetch depths of the decode section's offloaded runs (at "
                                   "most 2, for 2 layers only, with --allow_cpu)")
_DECODE_QUANT = flags.DEFINE_list("decode_quantizations", ["int8", "int4"],
                                  "weight quantizations of the decode section (resident and "
                                  "offloaded at the default depth)")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
MIB = 1 << 20
GIB = 1 << 30


class _Box:
  """A section's time box: `allows(label)` is False once its seconds are spent, and then records
  the measurement `label` as left out."""

  def __init__(self, seconds: float):
    self.seconds = seconds
    self.end = time.perf_counter() + seconds
    self.skipped: list[str] = []

  def allows(self, label: str) -> bool:
    if time.perf_counter() < self.end:
      return True
    self.skipped.append(label)
    return False

  def left(self) -> float:
    return self.end - time.perf_counter()


def _median(values):
  values = sorted(values)
  return values[len(values) // 2]


def _timed(fn, repeats: int) -> float:
  """Median seconds of `fn()` (which blocks until its work is done) after one warm-up call."""
  return _median(benchlib.timed_calls(fn, repeats))


def section_env() -> dict:
  import jax
  import flax
  devices = jax.devices()
  out = {"jax": jax.__version__, "flax": flax.__version__, "backend": jax.default_backend(),
         "python": sys.version.split()[0], "devices": []}
  for d in devices:
    entry = {"kind": d.device_kind, "memory_kinds": [m.kind for m in d.addressable_memories()]}
    stats = d.memory_stats() or {}
    entry["bytes_limit"] = stats.get("bytes_limit")
    out["devices"].append(entry)
  return out


def section_swap(box: _Box) -> dict:
  """Host-tier swap rates and the first-use cost of its pinned buffers (see the module
  docstring)."""
  import numpy as np
  from jaxtier.kvcache import HostTier, PagedCacheConfig, PagedKVCache, swap_in, swap_out
  small = _ALLOW_CPU.value
  layers, kv_heads, head_dim, block_size = (4, 2, 32, 16) if small else (22, 4, 64, 16)
  counts, repeats = (1, 8, 64), 5
  chunk, fresh_chunks = (16, 4) if small else (64, 16)  # first-use swaps: chunk blocks each
  used = max(counts)
  config = PagedCacheConfig(layers, kv_heads, head_dim, 2 * used, block_size,
                            used + chunk * fresh_chunks, "bfloat16", "xla")
  cache, host = PagedKVCache.create(config), HostTier.empty(config.num_host_blocks)
  rng = np.random.default_rng(0)
  out = {"block": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                   "block_size": block_size, "dtype": "bfloat16",
                   "bytes": config.bytes_per_block}, "blocks": {}}
  for n in counts:
    if not box.allows(f"{n}_blocks"):
      continue
    reports = {"out": [], "in": []}
    for _ in range(repeats + 1):  # the first pair compiles (and is left out of the medians)
      slots = np.arange(n)  # used slots, rewritten: the host pool has the memory already
      host, report = swap_out(cache, host, rng.choice(config.num_device_blocks, n, False), slots)
      reports["out"].append(report)
      cache, report = swap_in(cache, host, rng.permutation(slots),
                              rng.choice(config.num_device_blocks, n, False))
      reports["in"].append(report)
    row = {"bytes": n * config.bytes_per_block, "parts": list(reports["out"][0].parts)}
    for direction, rs in reports.items():
      seconds = _median([r.seconds for r in rs[1:]])
      name = "d2h" if direction == "out" else "h2d"
      row[f"{name}_gbps"] = row["bytes"] / seconds / 1e9
      row[f"{name}_ms"] = seconds * 1e3
      row[f"{name}_compile_s"] = rs[0].compile_seconds
    out["blocks"][str(n)] = row
  # first use: swap-outs of `chunk` blocks into slots never written, every earlier block kept,
  # so the pool takes new pinned memory; against the same swap-out into used slots
  if box.allows("first_use"):
    steady = []
    for _ in range(repeats + 1):
      host, report = swap_out(cache, host, rng.choice(config.num_device_blocks, chunk, False),
                              np.arange(chunk))
      steady.append(report)
    fresh = []
    for i in range(fresh_chunks):
      slots = used + i * chunk + np.arange(chunk)
      host, report = swap_out(cache, host, rng.choice(config.num_device_blocks, chunk, False),
                              slots)
      fresh.append(report.seconds)
    steady_s = _median([r.seconds for r in steady[1:]])
    extra = sum(fresh) - fresh_chunks * steady_s
    out["first_use"] = {"blocks": chunk * fresh_chunks, "chunk_blocks": chunk,
                        "bytes": chunk * fresh_chunks * config.bytes_per_block,
                        "fresh_chunk_ms": [s * 1e3 for s in fresh],
                        "used_slots_chunk_ms": steady_s * 1e3,
                        "seconds_per_block": extra / (chunk * fresh_chunks),
                        "host_bytes_stored": host.bytes_stored()}
  return out


def section_link() -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import SingleDeviceSharding
  device = jax.devices()[0]
  on_device = SingleDeviceSharding(device, memory_kind="device")
  pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
  out = {}
  sizes = (4, 64, 512) if not _ALLOW_CPU.value else (4, 64)
  for mib in sizes:
    n = mib * MIB // 4
    x_dev = jax.device_put(np.random.default_rng(0).standard_normal(n, np.float32), on_device)
    x_host = jax.device_put(x_dev, pinned)
    x_host.block_until_ready()
    d2h = _timed(lambda: jax.device_put(x_dev, pinned).block_until_ready(), 5)
    h2d = _timed(lambda: jax.device_put(x_host, on_device).block_until_ready(), 5)
    out[f"{mib}MiB"] = {"h2d_gbps": mib * MIB / h2d / 1e9, "d2h_gbps": mib * MIB / d2h / 1e9}
    del x_dev, x_host
  n = (1024 if not _ALLOW_CPU.value else 128) * MIB // 4
  x = jnp.ones(n, jnp.float32) * 1.5
  copy = jax.jit(lambda a: a * 1.0001)
  seconds = _timed(lambda: copy(x).block_until_ready(), 10)
  out["device_copy_gbps"] = 2 * n * 4 / seconds / 1e9
  return out


def _logit_errors(model, ref, ids_key, logits_key) -> tuple[float, float]:
  import jax.numpy as jnp
  import numpy as np
  from jaxtier.kvcache import ContiguousKVCache
  c = model.config
  ids = jnp.asarray(ref[ids_key])[None]
  t = ids.shape[1]
  cache = ContiguousKVCache.create(c.num_layers, 1, t, c.num_kv_heads, c.head_dim, jnp.float32)
  logits, _ = model(ids, jnp.arange(t, dtype=jnp.int32)[None], cache)
  got = np.asarray(logits[0], np.float32)
  want = ref[logits_key]
  return float(np.abs(got - want).max()), float((got.argmax(-1) == want.argmax(-1)).mean())


HF_TINY = ("tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral", "tiny_phi3", "tiny_gemma2",
           "tiny_gemma3", "tiny_mixtral", "tiny_qwen3_moe")


def section_hf_tiny() -> dict:
  import jax
  import numpy as np
  from jaxtier import checkpoint
  out = {}
  for name in HF_TINY:
    directory = os.path.join(FIXTURES, name)
    ref = dict(np.load(os.path.join(directory, "hf_logits.npz")))
    entry = {}
    for label, dtype, precision in (("float32_highest", "float32", "highest"),
                                    ("float32_default", "float32", None),
                                    ("bfloat16", "bfloat16", None)):
      model, _ = checkpoint.load_model(directory, dtype=dtype)
      with jax.default_matmul_precision(precision) if precision else _nothing():
        errors = [_logit_errors(model, ref, f"ids_{k}", f"logits_{k}") for k in ("a", "b")]
      entry[label] = {"max_abs_err": max(e for e, _ in errors),
                      "argmax_agreement": min(a for _, a in errors)}
    out[name] = entry
  out["float32_highest_ok"] = all(
      out[n]["float32_highest"]["max_abs_err"] < 1e-4 for n in HF_TINY)
  return out


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _greedy_ids(llm, prompts, max_tokens):
  import jaxtier
  params = jaxtier.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
  return [list(o.token_ids) for o in llm.generate(prompts, params)]


# Every text this schema accepts is short (an enum, an integer below 100, a boolean): random
# weights close it within a few dozen tokens, so each output must parse.
JSON_SCHEMA = {"type": "object",
               "properties": {"kind": {"enum": ["cat", "dog"]},
                              "age": {"type": "integer", "minimum": 0, "maximum": 99},
                              "ok": {"type": "boolean"}},
               "required": ["kind", "age", "ok"], "additionalProperties": False}


def _schema_ok(text: str) -> bool:
  """Whether `text` is a JSON object JSON_SCHEMA accepts."""
  try:
    value = json.loads(text)
  except ValueError:
    return False
  return (isinstance(value, dict) and set(value) == {"kind", "age", "ok"}
          and value["kind"] in ("cat", "dog") and type(value["age"]) is int
          and 0 <= value["age"] <= 99 and type(value["ok"]) is bool)


def _reference_ids(directory: str, batches, max_tokens: int) -> list[list[list[int]]]:
  """Greedy tokens of the contiguous-cache reference driver (`jaxtier.engine.padded`) on a
  fixture in float32, one list per batch of prompts in `batches` (each its own driver call)."""
  import numpy as np
  from flax import nnx
  from jaxtier import checkpoint
  from jaxtier.engine.padded import generate_batch
  from jaxtier.sampling import SamplingParams
  from jaxtier.scheduler import Request
  loaded = checkpoint.load(directory, "float32")
  greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
  graphdef, state = nnx.split(loaded.model)
  out = []
  for prompts in batches:
    requests = [Request.of(i, p, greedy, 0) for i, p in enumerate(prompts)]
    out.append([list(c.token_ids) for c in generate_batch(graphdef, state, loaded.tokenizer,
                                                          requests, 64, np.float32)])
  return out


def _guarded(out: dict, label: str, fn) -> None:
  """out[label] = fn(), or {"error": ...} where it raises: one part's failure keeps the section's
  other parts (a section's own error would replace them all)."""
  try:
    out[label] = fn()
  except Exception as e:  # pylint: disable=broad-except  (recorded, and the next part runs)
    out[label] = {"error": f"{type(e).__name__}: {e}"[:2000],
                  "traceback": traceback.format_exc()[-2000:]}


def section_engine_tiny() -> dict:
  import jax
  import numpy as np
  import jaxtier
  directory = os.path.join(FIXTURES, "tiny_llama")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 300, size=n).tolist() for n in (5, 11, 23, 3, 17, 30, 9, 14)]
  shared = rng.integers(3, 300, size=16).tolist()
  prefixed = [shared + rng.integers(3, 300, size=n).tolist() for n in (5, 9)]
  max_tokens = 24
  structured = [jaxtier.SamplingParams(max_tokens=40, temperature=0.8, seed=i,
                                       structured_outputs={"json": JSON_SCHEMA})
                for i in range(len(prompts))]
  common = dict(max_model_len=64, max_num_seqs=8, block_size=4, dtype="float32")
  out, structured_ids = {}, {}

  def llama(extra: dict, ref, ref_prefixed) -> dict:
    llm = jaxtier.LLM(directory, **common, **extra)
    start = time.perf_counter()
    got = _greedy_ids(llm, prompts, max_tokens)
    stats = llm.stats()
    entry = {"identical_to_reference": got == ref, "seconds": time.perf_counter() - start,
             "swap_out_count": stats.get("swap_out_count"),
             "swap_out_bytes": stats.get("swap_out_bytes"),
             "swap_in_bytes": stats.get("swap_in_bytes"),
             "swap_seconds": stats.get("swap_seconds")}
    if stats.get("swap_seconds"):
      entry["swap_gbps"] = ((stats.get("swap_out_bytes") or 0) + (stats.get("swap_in_bytes") or 0)
                            ) / stats["swap_seconds"] / 1e9
    # one JSON-schema request per prompt, all at once (the small pool swaps them)
    start = time.perf_counter()
    outputs = [o.outputs[0] for o in llm.generate(prompts, structured)]
    entry["structured_seconds"] = time.perf_counter() - start
    entry["structured_ids"] = [list(o.token_ids) for o in outputs]
    entry["structured_parse"] = all(_schema_ok(o.text) for o in outputs)
    entry["structured_finish_reasons"] = sorted({o.finish_reason for o in outputs})
    entry["structured_swap_out_count"] = (llm.stats().get("swap_out_count") or 0) - (
        stats.get("swap_out_count") or 0)
    if extra.get("enable_prefix_caching", True):
      # a prompt, then the same prompt and another with its 16-token prefix: cache hits
      hits, start = llm.stats()["prefix_device_hit_tokens"], time.perf_counter()
      again = _greedy_ids(llm, prefixed[:1], max_tokens) + _greedy_ids(llm, prefixed, max_tokens)
      entry["prefix_identical_to_reference"] = again == ref_prefixed[:1] + ref_prefixed
      entry["prefix_hit_tokens"] = llm.stats()["prefix_device_hit_tokens"] - hits
      entry["prefix_seconds"] = time.perf_counter() - start
    benchlib.release(llm)
    return entry

  def mixtral(mode: str, directory: str, ref) -> dict:
    llm = jaxtier.LLM(directory, **common, num_device_blocks=128, num_host_blocks=64,
                      offload_expert_layers=-1, expert_offload_mode=mode)
    start = time.perf_counter()
    got = _greedy_ids(llm, prompts, max_tokens)
    report = llm.memory_report()
    entry = {"identical_to_reference": got == ref, "seconds": time.perf_counter() - start,
             "offload_expert_layers": report["offload_expert_layers"],
             "host_expert_bytes": report["host_expert_bytes"],
             "expert_stream_from_tokens": llm.stats().get("expert_stream_from_tokens")}
    benchlib.release(llm)
    return entry

  with jax.default_matmul_precision("highest"):
    ref, ref_prefixed = _reference_ids(directory, [prompts, prefixed], max_tokens)
    runs = {
        "resident": dict(num_device_blocks=128, num_host_blocks=64),
        "offload_2_layers": dict(num_device_blocks=128, num_host_blocks=64, offload_tail_layers=2,
                                 prefetch_depth=1),
        "small_pool_swap": dict(num_device_blocks=24, num_host_blocks=96, preemption_mode="swap",
                                enable_prefix_caching=False),
    }
    for label, extra in runs.items():
      _guarded(out, label, lambda extra=extra: llama(extra, ref, ref_prefixed))
      structured_ids[label] = out[label].pop("structured_ids", None)
    out["structured_identical"] = all(ids == structured_ids["resident"]
                                      for ids in structured_ids.values())
    # every layer's routed experts in pinned host memory, streamed and computed on the host
    moe = os.path.join(FIXTURES, "tiny_mixtral")
    (moe_ref,) = _reference_ids(moe, [prompts], max_tokens)
    for mode in ("stream", "host"):
      _guarded(out, f"mixtral_experts_{mode}", lambda mode=mode: mixtral(mode, moe, moe_ref))
  parts = [v for v in out.values() if isinstance(v, dict)]
  out["all_identical"] = (all(v.get("identical_to_reference") for v in parts)
                          and all(v.get("prefix_identical_to_reference", True) for v in parts)
                          and out["structured_identical"])
  out["structured_parse"] = all(out[label].get("structured_parse") for label in runs)
  out["prefix_hits_counted"] = all(out[label].get("prefix_hit_tokens", 1) > 0 for label in runs)
  return out


def section_sampling() -> dict:
  """Prompt log-probabilities at row buckets that are not powers of two (24 and 40 prompts against
  each prompt alone), and the logit controls: a penalized greedy run equal under a swapping pool
  and with planning ahead off, and a logit_bias of -100 on the greedy token changing it."""
  import jax
  import numpy as np
  import jaxtier
  directory = os.path.join(FIXTURES, "tiny_llama")
  rng = np.random.default_rng(2)
  out = {}
  with jax.default_matmul_precision("highest"):
    llm = jaxtier.LLM(directory, max_model_len=64, max_num_seqs=40, block_size=4,
                      num_device_blocks=512, num_host_blocks=64, dtype="float32")
    scored = jaxtier.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    for n in (24, 40):
      prompts = [rng.integers(3, 300, size=int(rng.integers(4, 20))).tolist() for _ in range(n)]
      together = llm.generate(prompts, scored)
      worst = 0.0
      for prompt, out_together in zip(prompts[:6], together[:6]):
        alone = llm.generate([prompt], scored)[0]
        for a, b in zip(alone.prompt_logprobs[1:], out_together.prompt_logprobs[1:]):
          worst = max(worst, max(abs(a[t].logprob - b[t].logprob) for t in a))
      out[f"prompt_logprobs_{n}_rows_max_diff"] = worst
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (5, 11, 23, 3, 17, 30)]
    penalized = jaxtier.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                       repetition_penalty=1.3, frequency_penalty=0.5,
                                       presence_penalty=0.25, min_p=0.05)
    base = _greedy_with(llm, prompts, penalized)
    plain = _greedy_with(llm, prompts, dataclasses.replace(
        penalized, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0))
    out["penalties_change_tokens"] = base != plain
    del llm
    gc.collect()
    for label, extra in (("swap", dict(num_device_blocks=24, num_host_blocks=96,
                                       enable_prefix_caching=False)),
                         ("no_async", dict(num_device_blocks=512, num_host_blocks=64,
                                           async_scheduling=False))):
      other = jaxtier.LLM(directory, max_model_len=64, max_num_seqs=8, block_size=4,
                          dtype="float32", **extra)
      out[f"penalties_identical_{label}"] = _greedy_with(other, prompts, penalized) == base
      if label == "swap":
        out["swap_out_count"] = other.stats().get("swap_out_count")
      del other
      gc.collect()
    llm = jaxtier.LLM(directory, max_model_len=64, max_num_seqs=8, block_size=4,
                      num_device_blocks=128, num_host_blocks=32, dtype="float32")
    greedy = jaxtier.SamplingParams(max_tokens=1, temperature=0)
    first = llm.generate([prompts[0]], greedy)[0].token_ids[0]
    biased = llm.generate([prompts[0]], dataclasses.replace(greedy, logit_bias={first: -100.0}))
    out["logit_bias_changes_greedy"] = biased[0].token_ids[0] != first
  out["ok"] = (out["prompt_logprobs_24_rows_max_diff"] < 1e-4
               and out["prompt_logprobs_40_rows_max_diff"] < 1e-4
               and out["penalties_identical_swap"] and out["penalties_identical_no_async"]
               and out["penalties_change_tokens"] and out["logit_bias_changes_greedy"])
  return out


def _greedy_with(llm, prompts, params):
  return [list(o.token_ids) for o in llm.generate(prompts, params)]


def _random_llama_dir(directory: str, small: bool, weights: bool = True) -> dict:
  """A Hugging Face Llama directory with random float16 weights of TinyLlama-1.1B's shape (or a
  small one), and the tiny fixture's tokenizer (token ids are what the benchmark feeds); without
  `weights`, its config.json and tokenizer only (what a plan reads)."""
  import numpy as np
  from safetensors.numpy import save_file
  cfg = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
  if small:
    cfg = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000)
  config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_id=2,
                torch_dtype="float16", **cfg)
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(FIXTURES, "tiny_llama", name), directory)
  if not weights:
    return cfg
  rng = np.random.default_rng(0)
  h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  hd = h // cfg["num_attention_heads"]
  kv = cfg["num_key_value_heads"] * hd

  def w(*shape):
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)

  tensors = {"model.embed_tokens.weight": w(v, h), "lm_head.weight": w(v, h),
             "model.norm.weight": np.ones(h, np.float16)}
  for layer in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{layer}."
    tensors.update({p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                    p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                    p + "mlp.down_proj.weight": w(h, i),
                    p + "input_layernorm.weight": np.ones(h, np.float16),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float16)})
  save_file(tensors, os.path.join(directory, "model.safetensors"))
  return cfg


_LLAMA_DIRS: dict[bool, tuple[str, dict]] = {}


def _llama_dir(weights: bool) -> tuple[str, dict, float]:
  """(directory, config, seconds spent writing it now) of the run's random 1.1B-shaped model
  (`_random_llama_dir`), written once per run and removed at exit; without `weights`, a directory
  with weights serves too."""
  for have in ((True,) if weights else (True, False)):
    if have in _LLAMA_DIRS:
      return (*_LLAMA_DIRS[have], 0.0)
  start = time.perf_counter()
  directory = tempfile.mkdtemp(prefix="jaxtier-validate-")
  atexit.register(shutil.rmtree, directory, ignore_errors=True)
  cfg = _random_llama_dir(directory, _ALLOW_CPU.value, weights)
  _LLAMA_DIRS[weights] = (directory, cfg)
  return directory, cfg, time.perf_counter() - start


def _rates(link: dict | None) -> tuple[float | None, float | None]:
  """(device copy GB/s, host-to-device GB/s at the largest size measured) of the link section."""
  link = link or {}
  h2d = (link.get("512MiB") or link.get("64MiB") or {}).get("h2d_gbps")
  return link.get("device_copy_gbps"), h2d


def _decode_cell(llm, batch: int, vocab: int, rng, new_tokens: int, prompt_len: int) -> dict:
  """One decode step at `batch` rows: the difference of a `new_tokens`-token and a 2-token run
  over the steps between (medians of 3, after a first run that compiles)."""
  import jaxtier
  prompts = [rng.integers(3, vocab, size=prompt_len).tolist() for _ in range(batch)]
  params = jaxtier.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
  short = dataclasses.replace(params, max_tokens=2)
  first = time.perf_counter()
  llm.generate(prompts, params)
  first = time.perf_counter() - first
  # prefill and set-up cancel out in the difference
  t_short = _median(benchlib.timed_calls(lambda: llm.generate(prompts, short), 3, warmup=False))
  t_long = _median(benchlib.timed_calls(lambda: llm.generate(prompts, params), 3, warmup=False))
  if t_long <= t_short:  # noise swamped the decode steps: no figure rather than a wrong one
    return {"first_call_seconds": first, "step_ms": None,
            "error": f"a {new_tokens}-token run ({t_long:.4f} s) was not slower than a 2-token "
                     f"one ({t_short:.4f} s)"}
  step = (t_long - t_short) / (new_tokens - 2)
  return {"first_call_seconds": first, "step_ms": step * 1e3, "tokens_per_s": batch / step}


def _decode_llm(directory: str, offloaded: int, depth="auto", quantization: str | None = None):
  """An engine of the random 1.1B-shaped model as the decode section builds it; the profile
  section builds the same, so that decode's first runs find their programs compiled."""
  import jaxtier
  most = max(int(b) for b in _DECODE_BATCHES.value)
  return jaxtier.LLM(directory, dtype="bfloat16", max_model_len=256, max_num_seqs=most,
                     block_size=16, num_device_blocks=most * 8 + 16, num_host_blocks=64,
                     offload_tail_layers=offloaded, prefetch_depth=depth,
                     quantization=quantization, enable_prefix_caching=False,
                     kernels="portable" if quantization else "auto")


def _decode_runs(offloads: list[int], batches: list[int]) -> list[tuple]:
  """The decode section's runs in order: (label, offloaded layers, prefetch depth, quantization,
  batches). The first batch size first, in every configuration; then the resident run's other
  batch sizes and the default-depth runs' largest (a run of a label seen before adds cells)."""
  small = _ALLOW_CPU.value
  swept = offloads[:1] if small else offloads  # fewer shapes in a dry run
  depths = [int(d) for d in _DECODE_DEPTHS.value if not small or int(d) <= 2]
  first, more = batches[:1], batches[1:]
  runs = [("resident", 0, "auto", None, first)]
  runs += [(f"offload_{n}", n, "auto", None, first) for n in offloads]
  runs += [(f"offload_{n}_depth_{d}", n, d, None, first) for n in swept for d in depths]
  for q in _DECODE_QUANT.value:
    runs += [(f"{q}_resident", 0, "auto", q, first)]
    runs += [(f"{q}_offload_{n}", n, "auto", q, first) for n in swept]
  if more:
    runs += [("resident", 0, "auto", None, more)]
    runs += [(f"offload_{n}", n, "auto", None, [max(more)]) for n in offloads]
  return runs


def section_decode(link: dict | None, box: _Box) -> dict:
  import numpy as np
  small = _ALLOW_CPU.value
  directory, cfg, wrote = _llama_dir(weights=True)
  new_tokens = 32 if not small else 8
  prompt_len = 16
  out = {"model": cfg, "write_seconds": wrote, "prompt_tokens": prompt_len,
         "new_tokens": new_tokens}
  batches = [int(b) for b in _DECODE_BATCHES.value]
  copy_gbps, h2d = _rates(link)
  rng = np.random.default_rng(1)
  offloads = [2, 4] if small else [int(n) for n in _DECODE_OFFLOAD.value]
  resident_step = {}  # (quantization, batch) -> ms
  default_depth = {}  # offloaded layers -> the depth "auto" took

  def run(offloaded: int, depth, quantization: str | None, run_batches: list[int]) -> dict:
    load_start = time.perf_counter()
    llm = _decode_llm(directory, offloaded, depth, quantization)
    report = llm.memory_report()
    entry = {"load_seconds": time.perf_counter() - load_start,
             "prefetch_depth": report["prefetch_depth"], "quantization": quantization}
    if quantization is None and depth == "auto":
      entry["memory_report"] = report
      if offloaded:
        default_depth[offloaded] = report["prefetch_depth"]
    else:
      entry.update({k: report[k] for k in ("device_weight_bytes", "host_weight_bytes",
                                           "weight_bytes_by_format")})
    weight_bytes = report.get("device_weight_bytes", 0) + report.get("host_weight_bytes", 0)
    for b in run_batches:
      cell = _decode_cell(llm, b, cfg["vocab_size"], rng, new_tokens, prompt_len)
      entry[f"batch_{b}"] = cell
      if cell["step_ms"] is None:
        continue
      step = cell["step_ms"] / 1e3
      if copy_gbps:
        bound = weight_bytes / (copy_gbps * 1e9)
        cell["hbm_bound_ms"] = bound * 1e3
        cell["ratio_to_hbm_bound"] = step / bound
      resident = resident_step.get((quantization, b))
      if not offloaded:
        resident_step[quantization, b] = cell["step_ms"]
        continue
      cell["resident_step_ms"] = resident
      if h2d and resident:
        link_s = report.get("host_weight_bytes", 0) / (h2d * 1e9)
        bound = max(resident / 1e3, link_s)
        cell["link_bound_ms"] = link_s * 1e3
        cell["ratio_to_max_compute_link"] = step / bound
    benchlib.release(llm)
    return entry

  for label, offloaded, depth, quantization, run_batches in _decode_runs(offloads, batches):
    if offloaded >= cfg["num_hidden_layers"] or (depth != "auto" and depth > offloaded):
      continue
    if depth != "auto" and default_depth.get(offloaded) == depth:
      out[label] = {"same_as": f"offload_{offloaded}"}
    elif box.allows(f"{label} (batch {', '.join(map(str, run_batches))})"):
      part = {}
      _guarded(part, label, lambda: run(offloaded, depth, quantization, run_batches))
      out.setdefault(label, {}).update(part[label])
  return out


def section_experts(link: dict | None) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jaxtier.kvcache import ContiguousKVCache
  from jaxtier.model import GroupedTransformer, Transformer
  from jaxtier.model.config import ModelConfig
  from jaxtier.offload import expert_cost, hardware
  from jaxtier.offload.experts import expert_group
  small = _ALLOW_CPU.value
  h, f, heads = (256, 512, 4) if small else (2048, 5632, 16)
  config = ModelConfig(architecture="mixtral", vocab_size=256, hidden_size=h, intermediate_size=f,
                       num_layers=2, num_heads=heads, num_kv_heads=heads // 2, head_dim=h // heads,
                       max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=f, norm_topk_prob=True)
  model = Transformer(config, jnp.bfloat16, rngs=nnx.Rngs(0))
  tokens_list = (1, 4, 16, 64) if small else (1, 4, 16, 64, 256)
  forward = nnx.jit(lambda m, cache, t, p: m(t, p, cache)[0])
  out = {"shape": {"experts": 8, "per_token": 2, "hidden": h, "width": f, "layers": 2,
                   "dtype": "bfloat16"}, "calls": {}}
  placed = {mode: GroupedTransformer(model, [(2, expert_group(1, None if mode == "host" else 1))])
            for mode in ("host", "stream")}
  del model
  for n in tokens_list:
    ids = jnp.asarray(np.random.default_rng(n).integers(0, 256, (1, n)), jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    cache = ContiguousKVCache.create(2, 1, 512, config.num_kv_heads, config.head_dim,
                                     jnp.bfloat16)
    row, logits = {}, {}
    for mode, m in placed.items():
      logits[mode] = np.asarray(forward(m, cache, ids, pos), np.float32)
      row[f"{mode}_s"] = _timed(lambda m=m: jax.block_until_ready(forward(m, cache, ids, pos)), 3)
    row["max_abs_diff"] = float(np.abs(logits["host"] - logits["stream"]).max())
    row["faster"] = "stream" if row["stream_s"] < row["host_s"] else "host"
    out["calls"][str(n)] = row
  faster = [n for n in tokens_list if out["calls"][str(n)]["faster"] == "stream"]
  out["measured_stream_from_tokens"] = faster[0] if faster else None
  preset = hardware.preset(hardware.PLATFORM_PRESETS["gpu"])
  rates = expert_cost.rates_of(preset)
  measured = (link or {}).get("512MiB", (link or {}).get("64MiB", {})).get("h2d_gbps")
  if measured:
    rates = dataclasses.replace(rates, link_bytes_per_s=measured * 1e9)
  shape = expert_cost.ExpertShape.of(config, "bfloat16")
  out["model_stream_from_tokens"] = expert_cost.stream_from_tokens(shape, rates)
  out["model_rates"] = dataclasses.asdict(rates)
  return out


def _float_weight_copies(hlo_text: str, shape: tuple[int, int]) -> list[str]:
  """Names of the instructions of an optimized HLO module's non-fusion computations (the ENTRY
  one and loops) whose result is a float array of `shape` (or its transpose): a weight
  dequantized whole into memory instead of inside the dot's fusion."""
  import re
  dims = {f"{shape[0]},{shape[1]}", f"{shape[1]},{shape[0]}"}
  out, in_fusion = [], False
  for line in hlo_text.splitlines():
    if line and not line.startswith(" "):  # a computation's header
      in_fusion = "fused" in line.split("(")[0] or "fusion" in line.split("(")[0]
      continue
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (f32|bf16|f16)\[([\d,]+)\]", line)
    if m and not in_fusion and m.group(3) in dims:
      out.append(m.group(1))
  return out


def section_quant(link: dict | None) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxtier.model import quant
  k, n = (512, 1024) if _ALLOW_CPU.value else (4096, 14336)
  rng = np.random.default_rng(0)
  w = (rng.normal(size=(k, n)) * 0.02).astype(np.float32)
  platform = jax.default_backend()
  formats = {"int8": quant.quantized_format("int8"),
             "int4": quant.quantized_format("int4", 32).on(platform)}
  weights = {"bfloat16": (jnp.asarray(w, jnp.bfloat16),)}
  for name, fmt in formats.items():
    weights[name] = tuple(jnp.asarray(p) for p in quant.quantize(w, fmt))
  copy_gbps = (link or {}).get("device_copy_gbps")
  out = {"shape": [k, n], "platform": platform, "rows": {}}
  for name, parts in weights.items():
    nbytes = sum(quant.array_bytes(p) for p in parts)
    fn = jax.jit(lambda x, *p: x @ p[0]) if name == "bfloat16" else jax.jit(quant.qmatmul)
    row = {"weight_bytes": nbytes}
    for b in (1, 8, 32):
      x = jnp.asarray(rng.normal(size=(b, k)), jnp.bfloat16)
      compiled = fn.lower(x, *parts).compile()
      seconds = _timed(lambda: jax.block_until_ready(compiled(x, *parts)), 5)
      entry = {"seconds": seconds}
      if copy_gbps:  # reading the weight once, at the device's copy rate (read plus write) / 2
        entry["bound_seconds"] = nbytes / (copy_gbps * 1e9 / 2)
        entry["over_bound"] = seconds / entry["bound_seconds"]
      if name != "bfloat16":
        held = quant.dequantize(*parts, dtype=jnp.float32)
        ref = np.asarray(x.astype(jnp.float32) @ held)
        entry["max_rel_diff"] = float(np.abs(np.asarray(compiled(x, *parts), np.float32)
                                             - ref).max() / np.abs(ref).max())
        entry["float_weight_copies"] = _float_weight_copies(compiled.as_text(), (k, n))
      row[str(b)] = entry
    out["rows"][name] = row
  # XLA:CPU dequantizes into a temporary before its dot (expected there: not the GPU's fusion)
  out["fused"] = all(not row[b]["float_weight_copies"] for name, row in out["rows"].items()
                     if name != "bfloat16" for b in ("1", "8", "32"))
  # the engine's compiled programs on 4-bit weights (their buffers' layouts included), resident
  # and with an offloaded tail: the same greedy tokens
  import jaxtier
  tokens = {}
  for offloaded in (0, 1):
    llm = jaxtier.LLM(os.path.join(FIXTURES, "tiny_qwen3"), quantization="int4",
                      kernels="portable", offload_tail_layers=offloaded, max_model_len=128)
    params = jaxtier.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens[offloaded] = [o.outputs[0].token_ids for o in llm.generate(["hello", "a b c"], params)]
    if offloaded:
      report = llm.memory_report()
      out["engine_int4"] = {"host_weight_bytes": report["host_weight_bytes"],
                            "weight_bytes_by_format": report["weight_bytes_by_format"]}
    del llm
  out["engine_int4"]["offloaded_equals_resident"] = tokens[0] == tokens[1]
  return out


def _attention_args(rng, b: int, t: int, context: int, kv: int, n: int, d: int, c: int, dtype):
  """Paged attention arguments: b rows whose t queries end at position context + t - 1, each row's
  pages a random part of a pool of exactly the pages the rows use."""
  import jax.numpy as jnp
  import numpy as np
  blocks = -(-(context + t) // c)
  f = b * blocks
  k_kfcd, v_kfcd = (jnp.asarray(rng.standard_normal((kv, f, c, d), np.float32), dtype)
                    for _ in range(2))
  pages_bm = jnp.asarray(rng.permutation(f).reshape(b, blocks), jnp.int32)
  pos_bt = jnp.broadcast_to(jnp.arange(context, context + t, dtype=jnp.int32), (b, t))
  q_btnd = jnp.asarray(rng.standard_normal((b, t, n, d)), dtype)
  return q_btnd, k_kfcd, v_kfcd, pages_bm, pos_bt


def section_attention(link: dict | None) -> dict:
  """The Pallas Triton paged attention kernel against the XLA path (see the module docstring)."""
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxtier.attention.pallas_gpu import paged_attention_gpu
  from jaxtier.attention.xla_chunked import paged_attention
  interpret = jax.default_backend() == "cpu"
  kv, n, d, c = 3, 9, 64, 16
  batches, contexts, chunk, chunk_contexts, repeats = (1, 8, 32), (1024, 4096), 512, (0, 2048), 10
  if interpret:
    batches, contexts, chunk, chunk_contexts, repeats = (1, 2), (64,), 16, (0, 32), 2
  kernel = jax.jit(functools.partial(paged_attention_gpu, interpret=interpret))
  impls = {"pallas": kernel, "xla": paged_attention}
  copy_gbps = (link or {}).get("device_copy_gbps")
  out = {"shape": {"kv_heads": kv, "q_heads": n, "head_dim": d, "block_size": c,
                   "dtype": "bfloat16"}, "interpret": interpret, "decode": {}, "prefill": {}}
  if interpret:
    out["note"] = "CPU dry run: tiny shapes, the kernel in Pallas interpret mode; not a timing"
  rng = np.random.default_rng(0)
  worst = 0.0

  def run_all(args):
    nonlocal worst
    results = {name: np.asarray(fn(*args), np.float32) for name, fn in impls.items()}
    worst = max(worst, float(np.abs(results["pallas"] - results["xla"]).max()))
    return {f"{name}_s": _timed(lambda fn=fn: jax.block_until_ready(fn(*args)), repeats)
            for name, fn in impls.items()}

  for context in contexts:
    for b in batches:
      args = _attention_args(rng, b, 1, context - 1, kv, n, d, c, jnp.bfloat16)
      cell = run_all(args)
      kv_bytes = 2 * b * context * kv * d * 2  # K and V slots read, bfloat16
      cell["kv_bytes"] = kv_bytes
      for name in impls:
        cell[f"{name}_gbps"] = kv_bytes / cell[f"{name}_s"] / 1e9
        if copy_gbps:  # reading at the device's copy rate (read plus write) / 2
          cell[f"{name}_over_hbm_bound"] = cell[f"{name}_s"] / (kv_bytes / (copy_gbps * 1e9 / 2))
      out["decode"][f"batch_{b}_context_{context}"] = cell
  for context in chunk_contexts:
    cell = run_all(_attention_args(rng, 1, chunk, context, kv, n, d, c, jnp.bfloat16))
    for name in impls:
      cell[f"{name}_tokens_per_s"] = chunk / cell[f"{name}_s"]
    out["prefill"][f"chunk_{chunk}_context_{context}"] = cell
  out["max_abs_diff_pallas_xla"] = worst
  return out


def _server_engine_args() -> dict:
  """The engine arguments of the default server configuration (`configs/serve_default.py`), its
  model, address and port left out."""
  from jaxtier.engine import args as engine_args
  spec = importlib.util.spec_from_file_location(
      "serve_default", os.path.join(ROOT, "configs", "serve_default.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config().to_dict()
  fields = {f.name for f in dataclasses.fields(engine_args.EngineArgs)} - {"model"}
  out = {k: v for k, v in config.items() if k in fields}
  for name, low, high in (("offload_tail_layers", 0, None),
                          ("prefetch_depth", 1, engine_args.MAX_PREFETCH_DEPTH)):
    if name in out:
      out[name] = engine_args.int_or_auto(name, out[name], low, high)
  return out


def _program_label(key: tuple) -> str:
  """A `Runner` program's kind as the compile section counts it: "decode" or "prefill" for a
  model call ("step": its sampling and log-probabilities in it), else the key's kind
  ("sample_transformed", "swap", and the on-demand "logprobs" and "processed_logprobs")."""
  if key[0] == "step":
    return "decode" if key[2] == 1 else "prefill"
  return key[0]


def _program_kind(key: tuple) -> str:
  """Which measured program stands for a warm-up program in the estimate by kind: a step by the
  decode or the prefill step, a swap by the swap-out, a program on a call's logits (the
  transformed sampler, a transformed call's log-probabilities) by the transformed sampler."""
  label = _program_label(key)
  if label == "swap":
    return "swap_out"
  if label in ("logprobs", "processed_logprobs"):
    return "sample_transformed"
  return label


def section_compile(box: _Box) -> dict:
  """The default server configuration's warm-up: its program count and the compile seconds of a
  representative few (see the module docstring)."""
  import jax
  from jaxtier.engine.engine import warmup_programs
  from jaxtier.tools import export
  directory, cfg, _ = _llama_dir(weights=False)
  args = _server_engine_args()
  platform = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
  engine = export.abstract_engine(directory, platform, **args)
  keys = warmup_programs(engine.engine_config, engine.vocab_size)
  out = {"model": cfg, "engine_args": args,
         "engine_config": dataclasses.asdict(engine.engine_config), "programs": len(keys),
         "programs_by_kind": dict(collections.Counter(_program_label(k) for k in keys))}
  wanted = export.representative_programs(engine.engine_config, engine.vocab_size)
  # the transformed sampler after the step whose logits it takes
  groups = (("decode", "sample_transformed"), ("prefill",), ("swap_out",))
  seconds, keys_of, errors = {}, {}, {}
  cache_was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)  # compile, do not read a cache
  try:
    for group in groups:
      names = [n for n in group if n in wanted]
      if not names or not box.allows("+".join(names)):
        continue
      mark = [engine.runner.compile_seconds]

      def progress(done, total, key, mark=mark):
        del done, total
        seconds[key] = engine.runner.compile_seconds - mark[0]
        mark[0] = engine.runner.compile_seconds

      try:
        engine.runner.compile_programs(engine.cache, [wanted[n] for n in names], progress)
      except Exception as e:  # pylint: disable=broad-except  (the other groups still compile)
        errors.update({n: f"{type(e).__name__}: {e}"[:2000] for n in names})
        continue
      keys_of.update({n: wanted[n] for n in names})
  finally:
    jax.config.update("jax_enable_compilation_cache", cache_was)
  measured = {n: seconds[k] for n, k in keys_of.items()}
  out["compiled"] = {n: {"key": list(keys_of[n]), "seconds": s} for n, s in measured.items()}
  out["compiled"].update({n: {"key": list(wanted[n]), "error": e} for n, e in errors.items()})
  if measured:
    mean = sum(measured.values()) / len(measured)
    out["seconds_per_program"] = mean
    out["warmup_estimate_seconds"] = mean * len(keys)
    # each program at the seconds of the measured one of its kind (`_program_kind`): a step at
    # the decode or the prefill step's, a swap at the swap-out's, a transformed sampler at the
    # measured one's; the mean where that one was not measured
    out["warmup_estimate_by_kind_seconds"] = sum(measured.get(_program_kind(k), mean)
                                                 for k in keys)
  return out


def startup_child(directory: str, engine_args: str, seconds: float, keys_most: int) -> None:
  """(The `startup` section's child process.) Builds `jaxtier.LLM` on `directory` with
  `engine_args` (JSON), then compiles the warm-up's programs in order, at most `keys_most`,
  until `seconds` have passed since it began compiling; prints one JSON line of figures."""
  import jaxtier
  from jaxtier.engine import startup
  from jaxtier.engine.engine import ready_programs, warmup_programs
  began = time.perf_counter()
  llm = jaxtier.LLM(directory, **json.loads(engine_args))
  engine = llm.engine
  built = time.perf_counter()
  keys = warmup_programs(engine.config, engine.grammar_vocab)
  ready = len(ready_programs(engine.config, engine.grammar_vocab))
  out = {"programs": len(keys), "ready_programs": ready, "build_seconds": built - began}
  runner, done = engine.runner, [0]

  class _Spent(Exception):
    pass

  def progress(count, total, key):
    del total, key
    done[0] = count
    if count == ready:
      out["ready_seconds"] = time.perf_counter() - built
      out["ready_process_seconds"] = startup.process_seconds()
    if count >= ready and time.perf_counter() - built > seconds:
      raise _Spent

  try:  # in order, each program after the one whose logits it takes
    engine.compile_programs(keys[:keys_most], progress)
  except _Spent:
    pass
  done = done[0]
  out.update(built_programs=done, compiled=runner.compiled_programs, cache_hits=runner.cache_hits,
             compile_seconds=runner.compile_seconds, seconds=time.perf_counter() - built,
             process_seconds=startup.process_seconds())
  print(json.dumps(out), flush=True)


def section_startup(box: _Box) -> dict:
  """A cold start and a warm one of the 1.1B shape (see the module docstring)."""
  directory, cfg, _ = _llama_dir(weights=True)
  args = {**_server_engine_args(), "max_model_len": 2048}
  out = {"model": cfg, "engine_args": args}
  keys_most = None
  with tempfile.TemporaryDirectory() as cache:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    for label, share in (("cold", 0.65), ("warm", 1.0)):
      # a dry run builds the ready programs and a few more: the section only has to run
      seconds = 5.0 if _ALLOW_CPU.value else max(box.left() * share - 20, 1.0)
      most = keys_most if keys_most is not None else 1 << 30
      code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
              f"import validate_gpu; validate_gpu.startup_child({directory!r}, "
              f"{json.dumps(args)!r}, {seconds}, {most})")
      start = time.perf_counter()
      try:
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               text=True, timeout=max(box.left(), 10.0))
      except subprocess.TimeoutExpired:
        out[label] = {"error": f"the child ran past the section's {box.seconds:.0f} s time box"}
        break
      lines = child.stdout.strip().splitlines()
      if child.returncode != 0 or not lines:
        out[label] = {"error": f"exited with {child.returncode}: {child.stderr.strip()[-1500:]}"}
        break
      out[label] = {**json.loads(lines[-1]), "wall_seconds": time.perf_counter() - start}
      keys_most = out[label]["built_programs"]  # the warm start loads what the cold one built
  cold, warm = out.get("cold", {}), out.get("warm", {})
  if cold.get("compiled"):
    out["cold_seconds_per_program"] = cold["compile_seconds"] / cold["compiled"]
    out["cold_estimate_all_seconds"] = out["cold_seconds_per_program"] * cold["programs"]
  if "compiled" in warm:
    out["warm_compiled_nothing"] = warm["compiled"] == 0
  return out


def pin_buffers(total_bytes: int, chunk_bytes: int) -> None:
  """(The `pinned_cap` section's child process.) Allocates `pinned_host` buffers of
  `chunk_bytes`, each a copy of one device buffer, until `total_bytes` are held or an allocation
  fails; prints one JSON line: the bytes held, the seconds, the error if any."""
  started = time.perf_counter()
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding
  device = jax.devices()[0]
  pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
  source = jnp.zeros(chunk_bytes, jnp.uint8).block_until_ready()
  held, error = [], None
  start = time.perf_counter()
  try:
    while len(held) * chunk_bytes < total_bytes:
      held.append(jax.device_put(source, pinned).block_until_ready())
  except Exception as e:  # pylint: disable=broad-except  (how far it got is the answer)
    error = f"{type(e).__name__}: {e}"[:1000]
  seconds = time.perf_counter() - start
  print(json.dumps({"platform": device.platform, "allocated_bytes": len(held) * chunk_bytes,
                    "buffers": len(held), "seconds": seconds, "error": error,
                    "startup_seconds": start - started}), flush=True)


def _available_memory() -> int | None:
  """The host's available memory in bytes (MemAvailable), else its RAM, else None."""
  from jaxtier.engine import pinned_cap
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return pinned_cap.host_memory_bytes()


def section_pinned_cap(box: _Box) -> dict:
  """Pinned host memory past XLA's default cap, in a child process (see the module docstring)."""
  import jax
  from jaxtier.engine import pinned_cap
  gpu = jax.default_backend() == "gpu"
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env.pop(pinned_cap.ENV, None)
  if gpu:
    total, chunk = (pinned_cap.XLA_DEFAULT_GIB + 2) * GIB, GIB
    cap_gib = pinned_cap.XLA_DEFAULT_GIB + 8
    env[pinned_cap.ENV] = str(cap_gib)
    out = {"cap": f"{pinned_cap.ENV}={cap_gib}"}
  else:
    total, chunk = 64 * MIB, 16 * MIB
    out = {"cap": "none"}  # XLA's cap is its GPU client's
  available = _available_memory()
  out.update(requested_bytes=total, chunk_bytes=chunk, host_available_bytes=available)
  if gpu and (available is None or available < total + 8 * GIB):
    out["skipped"] = (f"the host has {(available or 0) / GIB:.0f} GiB available; pinning "
                      f"{total / GIB:.0f} GiB needs {total / GIB + 8:.0f}")
    return out
  code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
          f"import validate_gpu; validate_gpu.pin_buffers({total}, {chunk})")
  start = time.perf_counter()
  try:
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=max(box.left(), 10.0))
  except subprocess.TimeoutExpired:
    out["error"] = f"the child process ran past the section's {box.seconds:.0f} s time box"
    return out
  out["child_seconds"] = time.perf_counter() - start
  lines = child.stdout.strip().splitlines()
  if child.returncode != 0 or not lines:
    out["error"] = (f"the child process exited with {child.returncode}: "
                    f"{child.stderr.strip()[-1500:]}")
    return out
  result = json.loads(lines[-1])
  result["allocation_error"] = result.pop("error")
  out.update(result)
  out["ok"] = result["allocation_error"] is None and result["allocated_bytes"] >= total
  if result["seconds"] > 0:
    out["gbps"] = result["allocated_bytes"] / result["seconds"] / 1e9
  return out


# How `_trace_summary` sorts a trace's events. Derived device lines (the trace viewer's per-op and
# per-module views of the same kernels) are not counted.
_DERIVED = re.compile(r"^(XLA (Modules|Ops|TraceMe|Async Ops)|Steps|TensorFlow|Framework|Source|"
                      r"Launch Stats)", re.I)
_H2D = re.compile(r"h2d|htod|host ?to ?device", re.I)
_D2H = re.compile(r"d2h|dtoh|device ?to ?host", re.I)
_COMPUTE_THREAD = re.compile(r"XLAEigen|XLAPjRtCpuClient|intra.?op", re.I)
_COMPILE = re.compile(r"compil|codegen|llvm|autotun", re.I)
# a wait, or reading a result (the Python tracer does not see the wait inside numpy's asarray)
_WAIT = re.compile(r"wait|block_until_ready|sleep|acquire|synchroniz|numpy asarray|__array__",
                   re.I)
TRACE_KINDS = ("kernels", "gathers", "host_to_device", "device_to_host", "host_dispatch",
               "host_wait", "other")


def _event_kind(name: str, process: str, thread: str) -> str:
  """One of TRACE_KINDS for an event `name` on `thread` of `process` ("/device:GPU:0",
  "/host:CPU"). On a CPU backend the compiled programs run on host threads (XLA's compute
  threads are counted as kernels)."""
  on_device = process.startswith("/device:")
  python = name.startswith("$")  # the Python tracer's function events
  if not on_device and _WAIT.search(name):
    return "host_wait"
  if not python and (_H2D.search(name) or on_device and _H2D.search(thread)):
    return "host_to_device"
  if not python and (_D2H.search(name) or on_device and _D2H.search(thread)):
    return "device_to_host"
  if on_device or _COMPUTE_THREAD.search(thread):
    return "gathers" if "gather" in name.lower() else "kernels"
  if _COMPILE.search(thread) or not python and _COMPILE.search(name):
    return "other"
  return "host_dispatch"


def _self_times(events: list[dict]) -> list[float]:
  """Each event's duration less its children's, for the complete events of one thread (sorted
  by start here), so nested events count once."""
  events.sort(key=lambda e: (e["ts"], -e["dur"]))
  own = [float(e["dur"]) for e in events]
  stack = []  # (end, index) of the open events
  for i, e in enumerate(events):
    while stack and stack[-1][0] <= e["ts"]:
      stack.pop()
    if stack:
      own[stack[-1][1]] -= min(e["dur"], stack[-1][0] - e["ts"])
    stack.append((e["ts"] + e["dur"], i))
  return [max(t, 0.0) for t in own]


def _trace_summary(trace: dict, steps: int) -> dict:
  """A perfetto JSON trace as time per kind of event (TRACE_KINDS; self time, summed over threads
  and streams, so work in parallel adds up) in all and per step, its tracks, and the top 10
  events by time."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, threads, tracks = {}, {}, collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[e["pid"], e.get("tid")] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "X" and "dur" in e:
      tracks[e["pid"], e.get("tid")].append(e)
  by_kind = dict.fromkeys(TRACE_KINDS, 0.0)
  by_name = collections.defaultdict(lambda: [0.0, 0, ""])
  rows, profiler = [], 0.0
  for (pid, tid), track in tracks.items():
    process, thread = processes.get(pid, str(pid)), threads.get((pid, tid), str(tid))
    counted = not _DERIVED.search(thread)
    own = _self_times(track)
    rows.append({"process": process, "thread": thread, "events": len(track),
                 "self_ms": sum(own) / 1e3, "counted": counted})
    if not counted:
      continue
    for e, t in zip(track, own):
      if "profiler.py" in e.get("name", ""):  # the trace's own start and stop
        profiler += t
        continue
      kind = _event_kind(e.get("name", ""), process, thread)
      by_kind[kind] += t
      entry = by_name[e.get("name", "")[:120]]
      entry[0] += t
      entry[1] += 1
      entry[2] = kind
  top = sorted(by_name.items(), key=lambda item: -item[1][0])[:10]
  return {"events": sum(len(t) for t in tracks.values()), "steps": steps,
          "span_ms": (max(e["ts"] + e["dur"] for t in tracks.values() for e in t)
                      - min(e["ts"] for t in tracks.values() for e in t)) / 1e3 if tracks else 0.0,
          "device_events": sum(len(t) for (pid, _), t in tracks.items()
                               if processes.get(pid, "").startswith("/device:")),
          "by_kind_ms": {k: v / 1e3 for k, v in by_kind.items()},
          "profiler_ms": profiler / 1e3,  # the trace's own start and stop, not counted
          "by_kind_per_step_ms": {k: v / 1e3 / steps for k, v in by_kind.items()},
          "top_events": [{"name": name, "kind": kind, "count": count, "ms": t / 1e3,
                          "per_step_ms": t / 1e3 / steps}
                         for name, (t, count, kind) in top],
          "tracks": sorted(rows, key=lambda r: -r["self_ms"])[:16]}


def _profiled_steps(llm, trace_dir: str, batch: int, steps: int, vocab: int, rng) -> dict:
  """`steps` decode steps of `batch` 16-token prompts, once untimed by the profiler and once
  inside `jax.profiler.trace` (perfetto output), after a run that compiles what they run; the
  wall time per step of each, and the trace summarized (`_trace_summary`)."""
  import jax
  import jaxtier
  engine = llm.engine
  prompts = [rng.integers(3, vocab, size=16).tolist() for _ in range(batch)]
  params = jaxtier.SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
  llm.generate(prompts, params)
  out = {}
  for label in ("untraced", "traced"):
    for i, prompt in enumerate(prompts):
      engine.add_request((label, i), prompt, params, seed=0)
    engine.step()  # the prompts' step
    engine.step()  # the first decode step: the ones measured follow it
    tracing = jax.profiler.trace(trace_dir, create_perfetto_trace=True) if label == "traced" \
        else _nothing()
    with tracing:
      start = time.perf_counter()
      for _ in range(steps):
        engine.step()
      out[f"{label}_step_ms"] = (time.perf_counter() - start) / steps * 1e3
    while engine.has_unfinished():
      engine.step()
  found = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not found:
    files = [os.path.relpath(p, trace_dir) for p in glob.glob(os.path.join(trace_dir, "**", "*"),
                                                                recursive=True)]
    out["parse_error"] = f"no perfetto_trace.json.gz under {trace_dir} (files: {files[:10]})"
    return out
  out["trace_file"] = max(found, key=os.path.getmtime)
  try:
    with gzip.open(out["trace_file"], "rt") as f:
      out["summary"] = _trace_summary(json.load(f), steps)
  except Exception as e:  # pylint: disable=broad-except  (the raw trace is still there)
    out["parse_error"] = f"{type(e).__name__}: {e}"
  return out


def section_profile(box: _Box) -> dict:
  """Profiler traces of resident and offloaded decode steps (see the module docstring)."""
  import jax
  import numpy as np
  small = _ALLOW_CPU.value
  directory, cfg, wrote = _llama_dir(weights=True)
  root = os.path.splitext(os.path.abspath(_OUT.value))[0] + "_profile"
  shutil.rmtree(root, ignore_errors=True)
  batch, steps = int(_DECODE_BATCHES.value[0]), 4 if small else 5
  out = {"model": cfg, "write_seconds": wrote, "trace_dir": root, "batch": batch, "steps": steps}
  rng = np.random.default_rng(3)

  def profiled(label: str, offloaded: int) -> dict:
    llm = _decode_llm(directory, offloaded)
    entry = {"offload_tail_layers": offloaded,
             "prefetch_depth": llm.memory_report()["prefetch_depth"]}
    entry.update(_profiled_steps(llm, os.path.join(root, label), batch, steps,
                                 cfg["vocab_size"], rng))
    summary = entry.get("summary")
    if summary and not summary["device_events"] and jax.default_backend() != "cpu":
      entry["note"] = ("no device events in the trace: the profiler saw the host only (is "
                       "CUPTI missing?)")
    benchlib.release(llm)
    return entry

  for label, offloaded in (("resident", 0), ("offloaded", 2 if small else 8)):
    if not box.allows(label):
      continue
    _guarded(out, label, lambda label=label, offloaded=offloaded: profiled(label, offloaded))
  return out


def _commit() -> str:
  """The commit this tree is at (`git rev-parse HEAD`), or "unknown"."""
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=10, check=True).stdout.strip() or "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def _fmt(x, digits: int = 3) -> str:
  """A figure for the doc's table: `digits` significant digits, "-" for none."""
  return "-" if x is None else f"{x:.{digits}g}"


def _cell_ms(entry: dict | None, batch: int = 1) -> str:
  """A decode run's step milliseconds at `batch` rows, for the doc's table."""
  return _fmt(((entry or {}).get(f"batch_{batch}") or {}).get("step_ms"))


def _headline(name: str, v: dict) -> tuple[str, str]:
  """(pass / fail / ran, the key figures) of a section's JSON, for the doc's table."""
  def passed(ok):
    return "pass" if ok else "fail"
  if name == "env":
    kinds = ", ".join(d["kind"] for d in v["devices"])
    return "ran", f"JAX {v['jax']}, flax {v['flax']}, {v['backend']}: {kinds}"
  if name == "swap":
    rows = v["blocks"]
    rates = "; ".join(f"{n}: {_fmt(r['h2d_gbps'])} in / {_fmt(r['d2h_gbps'])} out"
                      for n, r in rows.items())
    first = v.get("first_use", {}).get("seconds_per_block")
    return "ran", (f"GB/s by blocks ({_fmt(v['block']['bytes'] / 1e6)} MB each) {rates}; "
                   f"first use {_fmt(first and first * 1e6)} us/block")
  if name == "link":
    big = v.get("512MiB") or v.get("64MiB") or {}
    return "ran", (f"pinned h2d {_fmt(big.get('h2d_gbps'))} / d2h {_fmt(big.get('d2h_gbps'))} "
                   f"GB/s; device copy {_fmt(v.get('device_copy_gbps'))} GB/s")
  if name == "hf_tiny":
    worst = max(v[n]["float32_highest"]["max_abs_err"] for n in HF_TINY)
    return passed(v["float32_highest_ok"]), f"float32 highest: worst error {_fmt(worst)}"
  if name == "engine_tiny":
    swaps = v.get("small_pool_swap", {}).get("swap_out_count")
    hits = v.get("resident", {}).get("prefix_hit_tokens")
    return (passed(v["all_identical"] and v["structured_parse"] and v["prefix_hits_counted"]),
            f"identical to the reference: {v['all_identical']} (resident, offloaded, {swaps} "
            f"swaps, prefix hits {hits} tokens, experts streamed and on the host); JSON "
            f"identical {v['structured_identical']}, parses {v['structured_parse']}")
  if name == "sampling":
    return passed(v["ok"]), (f"prompt logprobs 40 rows max diff "
                             f"{_fmt(v['prompt_logprobs_40_rows_max_diff'])}")
  if name == "quant":
    rows = v["rows"]
    return passed(v["engine_int4"]["offloaded_equals_resident"]), (
        f"fused {v['fused']}; batch 1 ms bf16 {_fmt(rows['bfloat16']['1']['seconds'] * 1e3)}, "
        f"int8 {_fmt(rows['int8']['1']['seconds'] * 1e3)}, "
        f"int4 {_fmt(rows['int4']['1']['seconds'] * 1e3)}")
  if name == "experts":
    return "ran", (f"stream faster from {v['measured_stream_from_tokens']} tokens (cost model: "
                   f"{v['model_stream_from_tokens']})")
  if name == "attention":
    cell = max(v["decode"].items(), key=lambda kv: kv[1]["kv_bytes"])
    return "ran", (f"{cell[0]}: pallas {_fmt(cell[1]['pallas_s'] * 1e3)} ms, xla "
                   f"{_fmt(cell[1]['xla_s'] * 1e3)} ms; max diff "
                   f"{_fmt(v['max_abs_diff_pallas_xla'])}")
  if name == "compile":
    each = ", ".join(f"{n} {_fmt(c['seconds'])} s" if "seconds" in c else f"{n} failed"
                     for n, c in v["compiled"].items())
    kinds = ", ".join(f"{k} {n}" for k, n in v["programs_by_kind"].items())
    return "ran", (f"{v['programs']} warm-up programs ({kinds}); {each}; warm-up ~"
                   f"{_fmt(v.get('warmup_estimate_seconds'))} s (count x mean), "
                   f"~{_fmt(v.get('warmup_estimate_by_kind_seconds'))} s by kind")
  if name == "startup":
    cold, warm = v.get("cold", {}), v.get("warm", {})
    return passed(v.get("warm_compiled_nothing")), (
        f"{cold.get('programs')} programs; cold: ready {_fmt(cold.get('ready_seconds'))} s, "
        f"{cold.get('built_programs')} built in {_fmt(cold.get('seconds'))} s "
        f"(~{_fmt(v.get('cold_estimate_all_seconds'))} s for all); warm: ready "
        f"{_fmt(warm.get('ready_seconds'))} s, {warm.get('built_programs')} in "
        f"{_fmt(warm.get('seconds'))} s, {warm.get('compiled')} compiled")
  if name == "pinned_cap":
    if "skipped" in v:
      return "skipped", v["skipped"]
    return passed(v.get("ok")), (f"cap {v['cap']}: {_fmt(v.get('allocated_bytes', 0) / GIB)} "
                                 f"GiB pinned in {_fmt(v.get('seconds'))} s"
                                 + (f" ({v['allocation_error']})"
                                    if v.get("allocation_error") else ""))
  if name == "profile":
    parts = []
    for label in ("resident", "offloaded"):
      s = (v.get(label) or {}).get("summary")
      if s:
        kinds = ", ".join(f"{k} {_fmt(t)}" for k, t in s["by_kind_per_step_ms"].items() if t)
        parts.append(f"{label} step {_fmt(v[label]['traced_step_ms'])} ms (self ms per step: "
                     f"{kinds})")
      elif v.get(label):
        parts.append(f"{label}: {v[label].get('parse_error')}")
    return "ran", "; ".join(parts)
  if name == "decode":
    resident = v.get("resident") or {}
    parts = ["step ms (over max(compute, link)): resident " + ", ".join(
        f"batch {k[6:]} {_cell_ms(resident, int(k[6:]))}" for k in resident
        if k.startswith("batch_"))]
    for label, entry in v.items():
      if isinstance(entry, dict) and label != "resident" and "batch_1" in entry:
        ratio = entry["batch_1"].get("ratio_to_max_compute_link")
        parts.append(f"{label} {_cell_ms(entry)}" + (f" ({_fmt(ratio)}x)" if ratio else ""))
    return "ran", "; ".join(parts)
  return "ran", ""


def append_doc(path: str, result: dict) -> None:
  """Appends a markdown table of the run's headline figures per section to `path`."""
  lines = ["", f"### Run at {result['commit']} on {result['device']}, {result['started']}", "",
           f"`scripts/validate_gpu.py`, {result.get('total_seconds', 0):.0f} s in all; each "
           "section's figures are in its JSON.", "",
           "| section | result | headline figures | seconds |", "| --- | --- | --- | --- |"]
  for name, v in result["sections"].items():
    if "skipped" in v and len(v) <= 2:
      status, figures = "skipped", v["skipped"]
    elif v.get("error"):
      status, figures = "error", str(v["error"])[:300]
    else:
      try:
        status, figures = _headline(name, v)
      except Exception as e:  # pylint: disable=broad-except  (a figure missing from the JSON)
        status, figures = "ran", f"(no headline: {type(e).__name__}: {e})"
      failed = [k for k, part in v.items() if isinstance(part, dict) and part.get("error")]
      if failed:
        status, figures = "fail", f"{figures}; errors in: {', '.join(failed)}"
      if v.get("skipped_by_time_box"):
        figures += f"; left out by its time box: {', '.join(v['skipped_by_time_box'])}"
    figures = figures.replace("|", "\\|").replace("\n", " ")
    lines.append(f"| {name} | {status} | {figures} | {v.get('section_seconds', 0):.0f} |")
  with open(path, "a") as f:
    f.write("\n".join(lines) + "\n")


def main(argv):
  del argv
  import jax
  if jax.default_backend() == "cpu" and not _ALLOW_CPU.value:
    raise SystemExit("no accelerator: JAX runs on the CPU (pass --allow_cpu for a dry run)")
  began = time.perf_counter()
  result = {"sections": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": _commit(),
            "device": jax.devices()[0].device_kind}
  for name in _SECTIONS.value:
    elapsed = time.perf_counter() - began
    if elapsed > _BUDGET.value:
      result["sections"][name] = {"skipped": "time budget"}
      continue
    start = time.perf_counter()
    fn = globals()[f"section_{name}"]
    params = inspect.signature(fn).parameters
    kwargs = {}
    if "link" in params:
      kwargs["link"] = result["sections"].get("link")
    if "box" in params:
      kwargs["box"] = _Box(min(TIME_BOX_S[name], _BUDGET.value - elapsed))
    try:
      value = fn(**kwargs)
    except Exception as e:  # pylint: disable=broad-except  (one section's failure is its result)
      value = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    if "box" in kwargs:
      value["time_box_s"] = kwargs["box"].seconds
      if kwargs["box"].skipped:
        value["skipped_by_time_box"] = kwargs["box"].skipped
    value["section_seconds"] = time.perf_counter() - start
    result["sections"][name] = value
    result["total_seconds"] = time.perf_counter() - began
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1, default=str)
    print(f"validate_gpu: {name} done in {value['section_seconds']:.1f} s", flush=True)
  print(json.dumps(result, default=str))
  if _DOC.value:
    append_doc(_DOC.value, result)


if __name__ == "__main__":
  app.run(main)
