"""Checks the accelerator path on the machine it runs on and writes one JSON object.

What a GPU (or TPU) user runs, checked in one short process (`scripts/validate_gpu.sh` wraps it for a
machine that has JAX but not jaxtier's other dependencies):
- `env`: JAX and its devices, each device's memory kinds and limit.
- `link`: host <-> device copy rates with `pinned_host` buffers at 4, 64 and 512 MiB, and the device's
  own copy rate (bytes read plus written), which bounds a decode step.
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
- `decode`: a random-weight model of TinyLlama-1.1B's shape in bfloat16 (smaller with
  `--allow_cpu`): decode tokens/s at batch 1, 8 and 32 against the bound weight bytes / device copy
  rate, and with offloaded tail layers against max(resident step, offloaded bytes / host-to-device
  rate).
- `experts`: two mixture-of-experts layers (8 experts of 2048 x 5632, 2 per token, bfloat16;
  smaller with `--allow_cpu`) with their experts in pinned host memory: seconds of a forward call
  of 1 to 256 tokens when the experts stream to the device and when the host computes them, the
  measured crossover, and the cost model's (`jaxtier.offload.expert_cost`) at the measured
  host-to-device rate.
- `quant`: one projection of Llama-8B's MLP (4096 x 14336; smaller with `--allow_cpu`) as
  bfloat16, int8 (a scale per output channel) and int4 (uint4, a scale and minimum per 32 rows,
  `jaxtier.model.quant`): seconds of x @ w at 1, 8 and 32 rows against the bound weight bytes /
  device copy rate, the largest difference from the dequantized weight's product, and whether XLA
  fused the dequantization into the dot: no instruction outside a fusion's body produces a float
  array of the weight's shape (`float_weight_copies`, the names of any that do; XLA:CPU does write
  one, so a dry run reports `fused` false); and the engine on the tiny Qwen3 fixture quantized to
  int4, resident and with an offloaded tail, giving the same greedy tokens.
- `attention`: paged attention at the default model's attention shape (3 kv heads, 9 query heads,
  head_dim 64, bfloat16 pages of 16 slots): the Pallas Triton kernel
  (`jaxtier.attention.pallas_gpu`) against the XLA path (`paged_attention`), seconds per
  decode call at batch 1, 8 and 32 with contexts of 1024 and 4096, the bytes/s achieved on the K
  and V pages read against the device's read rate (half its copy rate), and prefill tokens/s of a
  512-token chunk at contexts 0 and 2048; the largest difference between the two. With
  `--allow_cpu` on a CPU it runs tiny shapes with the kernel in Pallas interpret mode (`interpret`
  true in its JSON), only so that the section executes.

Each section is timed and guarded: an error is recorded in the section and the next one runs; a
section that would start past `--budget_s` is skipped. The JSON is rewritten after every section,
so a run cut short still leaves what it measured.

  python scripts/validate_gpu.py --out=validate_gpu.json             # on a GPU or TPU
  python scripts/validate_gpu.py --out=/tmp/v.json --allow_cpu       # a dry run on a CPU
"""

import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

from absl import app, flags

import benchlib

_OUT = flags.DEFINE_string("out", "validate_gpu.json", "where the JSON goes")
_ALLOW_CPU = flags.DEFINE_bool("allow_cpu", False, "run on a CPU (small shapes; a dry run)")
_BUDGET = flags.DEFINE_float("budget_s", 420.0, "no section starts after this many seconds")
_SECTIONS = flags.DEFINE_list("sections", ["env", "link", "hf_tiny", "engine_tiny", "sampling",
                                           "decode", "experts", "quant", "attention"],
                              "sections to run, in order")
_DECODE_BATCHES = flags.DEFINE_list("decode_batches", ["1", "8", "32"], "decode batch sizes")
_DECODE_OFFLOAD = flags.DEFINE_list("decode_offload", ["8", "16"],
                                    "offloaded tail layers for the decode section (2 and 4 of the "
                                    "small model's 8 with --allow_cpu)")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
MIB = 1 << 20


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


def _random_llama_dir(directory: str, small: bool) -> dict:
  """A Hugging Face Llama directory with random float16 weights of TinyLlama-1.1B's shape (or a
  small one), and the tiny fixture's tokenizer (token ids are what the benchmark feeds)."""
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


def section_decode(link: dict | None) -> dict:
  import numpy as np
  import jaxtier
  small = _ALLOW_CPU.value
  tmp = tempfile.mkdtemp(prefix="jaxtier-validate-")
  try:
    start = time.perf_counter()
    cfg = _random_llama_dir(tmp, small)
    out = {"model": cfg, "write_seconds": time.perf_counter() - start}
    new_tokens = 32 if not small else 8
    prompt_len = 16
    batches = [int(b) for b in _DECODE_BATCHES.value]
    copy_gbps = (link or {}).get("device_copy_gbps")
    h2d = ((link or {}).get("512MiB") or (link or {}).get("64MiB") or {}).get("h2d_gbps")
    rng = np.random.default_rng(1)
    offloads = [2, 4] if small else [int(n) for n in _DECODE_OFFLOAD.value]
    runs = [("resident", 0)] + [(f"offload_{n}", n) for n in offloads]
    resident_step = {}
    for label, offloaded in runs:
      if offloaded >= cfg["num_hidden_layers"]:
        continue
      load_start = time.perf_counter()
      llm = jaxtier.LLM(tmp, dtype="bfloat16", max_model_len=256, max_num_seqs=max(batches),
                        block_size=16, num_device_blocks=max(batches) * 8 + 16,
                        num_host_blocks=64, offload_tail_layers=offloaded,
                        enable_prefix_caching=False)
      report = llm.memory_report()
      entry = {"load_seconds": time.perf_counter() - load_start, "memory_report": report}
      weight_bytes = report.get("device_weight_bytes", 0) + report.get("host_weight_bytes", 0)
      for b in batches if offloaded == 0 else [1, max(batches)]:
        prompts = [rng.integers(3, cfg["vocab_size"], size=prompt_len).tolist() for _ in range(b)]
        params = jaxtier.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        first = time.perf_counter()
        llm.generate(prompts, params)
        compile_and_run = time.perf_counter() - first
        short = jaxtier.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        # medians of a few runs each; prefill and set-up cancel out in the difference
        t_short = _timed(lambda: llm.generate(prompts, short), 3)
        t_long = _timed(lambda: llm.generate(prompts, params), 3)
        if t_long <= t_short:  # noise swamped the decode steps: no figure rather than a wrong one
          entry[f"batch_{b}"] = {"first_call_seconds": compile_and_run, "step_ms": None,
                                 "error": f"a {new_tokens}-token run ({t_long:.4f} s) was not "
                                          f"slower than a 2-token one ({t_short:.4f} s)"}
          continue
        step = (t_long - t_short) / (new_tokens - 2)
        cell = {"first_call_seconds": compile_and_run, "step_ms": step * 1e3,
                "tokens_per_s": b / step}
        if copy_gbps:
          bound = weight_bytes / (copy_gbps * 1e9)
          cell["hbm_bound_ms"] = bound * 1e3
          cell["ratio_to_hbm_bound"] = step / bound
        if offloaded:
          cell["resident_step_ms"] = resident_step.get(b)
          if h2d and resident_step.get(b):
            link_s = report.get("host_weight_bytes", 0) / (h2d * 1e9)
            bound = max(resident_step[b] / 1e3, link_s)
            cell["link_bound_ms"] = link_s * 1e3
            cell["ratio_to_max_compute_link"] = step / bound
        else:
          resident_step[b] = step * 1e3
        entry[f"batch_{b}"] = cell
      out[label] = entry
      del llm
      gc.collect()
    return out
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


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


def main(argv):
  del argv
  import jax
  if jax.default_backend() == "cpu" and not _ALLOW_CPU.value:
    raise SystemExit("no accelerator: JAX runs on the CPU (pass --allow_cpu for a dry run)")
  began = time.perf_counter()
  result = {"sections": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
  for name in _SECTIONS.value:
    if time.perf_counter() - began > _BUDGET.value:
      result["sections"][name] = {"skipped": "time budget"}
      continue
    start = time.perf_counter()
    try:
      if name in ("decode", "experts", "quant", "attention"):
        value = globals()[f"section_{name}"](result["sections"].get("link"))
      else:
        value = globals()[f"section_{name}"]()
    except Exception as e:  # pylint: disable=broad-except  (one section's failure is its result)
      value = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    value["section_seconds"] = time.perf_counter() - start
    result["sections"][name] = value
    result["total_seconds"] = time.perf_counter() - began
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1, default=str)
    print(f"validate_gpu: {name} done in {value['section_seconds']:.1f} s", flush=True)
  print(json.dumps(result, default=str))


if __name__ == "__main__":
  app.run(main)
