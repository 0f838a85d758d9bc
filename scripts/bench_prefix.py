"""Prefix caching on a multi-turn chat workload: off, device-only and device+host, as one JSON object.

The workload (deterministic in `--seed`): `--num_conversations` conversations share one system
prompt of about `--system_tokens` tokens; each has `--min_turns`..`--max_turns` turns. A turn's
prompt is the conversation so far rendered with the model's chat template: the system prompt, every
earlier user message (`--min_user`..`--max_user` tokens of text) and assistant reply, and the new
user message. Earlier replies are fixed texts of about `--reply_tokens` tokens, so every mode sees
the same prompts; each turn generates `--reply_tokens` tokens (greedy, `ignore_eos`).

`--active` conversations have a turn in flight at once (a closed loop, like users waiting for
their answer). A conversation whose turn finishes goes to the back of the queue, so between two of
its turns about `num_conversations / active` other turns run: the distinct prefixes of all
conversations are many times what the device pool holds (`workload.distinct_prefix_blocks` against
`pools.device_blocks`), and a conversation's history has usually left the device when it returns.

Each mode runs the same workload on a fresh engine of the same model (programs compiled once,
before any timing): `off` recomputes every prompt; `device` reuses blocks still on the device;
`device+host` also writes evicted blocks back to the host pool and loads them on a hit. Reported per
mode: generated tokens/s, time to first token (p50/p90; from `add_request` to the step that returned
the token), hit tokens and rates per tier, host-tier bytes moved, computed tokens, and whether
every request's tokens equal the `off` run's. `host_hits` compares the TTFT of the requests that
loaded blocks from the host tier with the same requests' TTFT when recomputed (`off`) and when only
the device tier exists (`device`).

`simulator` holds the scheduler simulator's prediction for the same three modes at GPU scale (the
source article's 7B model, 80 GB device, PCIe 4.0): `scripts/simulate.py --preset=article_chat`.

Targets: device+host >= 3x the throughput of off; TTFT on host hits <= 0.5x the recompute TTFT.

    python scripts/bench_prefix.py
    python scripts/bench_prefix.py --num_conversations=8 --min_turns=2 --max_turns=3 \
        --system_tokens=200 --reply_tokens=8 --skip_simulator     # a quick look
"""

import collections
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from jaxtier.engine import flags as engine_flags

import benchlib

FLAGS = flags.FLAGS
flags.DEFINE_integer("seed", 0, "seed of the workload (texts, turn counts)")
flags.DEFINE_integer("num_conversations", 24, "conversations", lower_bound=1)
flags.DEFINE_integer("min_turns", 6, "fewest turns of a conversation", lower_bound=1)
flags.DEFINE_integer("max_turns", 8, "most turns of a conversation", lower_bound=1)
flags.DEFINE_integer("system_tokens", 1000, "tokens of the shared system prompt (about)",
                     lower_bound=1)
flags.DEFINE_integer("min_user", 20, "fewest tokens of a user message (about)", lower_bound=1)
flags.DEFINE_integer("max_user", 60, "most tokens of a user message (about)", lower_bound=1)
flags.DEFINE_integer("reply_tokens", 32, "tokens each turn generates, and the length of the "
                     "earlier replies in later prompts (about)", lower_bound=1)
flags.DEFINE_integer("active", 4, "conversations with a turn in flight at once", lower_bound=1)
flags.DEFINE_list("modes", ["off", "device", "device+host"], "modes to run, in order")
flags.DEFINE_float("device_pool_fraction", 0.5, "default device pool (without "
                   "--num_device_blocks): this share of the workload's distinct prefix blocks, "
                   "at least what the active conversations' longest turns need")
flags.DEFINE_bool("skip_simulator", False, "leave out the simulator's GPU-scale prediction")
flags.DEFINE_string("out", None, "also write the JSON object to this file")

MODES = {"off": dict(enable_prefix_caching=False),
         "device": dict(enable_prefix_caching=True, host_prefix_caching=False),
         "device+host": dict(enable_prefix_caching=True, host_prefix_caching=True)}
TARGETS = {"throughput_device_host_vs_off": 3.0, "host_hit_ttft_vs_recompute": 0.5}

_WORDS = ("the service keeps a record of every order and answers questions about shipping, "
          "returns, warranties and payments; it is polite, brief and exact, quotes the policy "
          "when asked, never invents a tracking number, and asks for the order id before "
          "looking anything up. Refunds take five to seven business days after the parcel "
          "arrives at the warehouse, exchanges ship within two days, and damaged goods are "
          "replaced without a return when the customer sends a photo.").split()
_ASKS = ("Where is my order", "Can I return the blue jacket", "How long does a refund take",
         "The box arrived damaged", "Can I change the delivery address", "Do you ship abroad",
         "My discount code did not work", "I was charged twice", "Which warranty covers this",
         "Can I exchange it for a larger size")


# Workload.


@dataclasses.dataclass(frozen=True)
class Conversation:
  prompts: tuple[tuple[int, ...], ...]  # [turns] token ids of each turn's prompt


def text_of(rng: np.random.Generator, tokenizer, tokens: int) -> str:
  """Running text of about `tokens` tokens."""
  words: list[str] = []
  while len(tokenizer.encode(" ".join(words))) < tokens:
    start = int(rng.integers(len(_WORDS)))
    words.extend(_WORDS[start:start + 12])
  return " ".join(words)


def build_workload(tokenizer, seed: int) -> list[Conversation]:
  rng = np.random.default_rng(seed)
  system = "You are the support assistant of a shop. " + text_of(rng, tokenizer,
                                                                  FLAGS.system_tokens)
  conversations = []
  for _ in range(FLAGS.num_conversations):
    messages = [{"role": "system", "content": system}]
    prompts = []
    for turn in range(int(rng.integers(FLAGS.min_turns, FLAGS.max_turns + 1))):
      ask = str(rng.choice(_ASKS))
      user = ask + "? " + text_of(rng, tokenizer, int(rng.integers(FLAGS.min_user,
                                                                   FLAGS.max_user + 1)))
      messages.append({"role": "user", "content": user})
      prompts.append(tuple(tokenizer.encode(tokenizer.apply_chat_template(messages),
                                            add_special_tokens=False)))
      messages.append({"role": "assistant",
                       "content": text_of(rng, tokenizer, FLAGS.reply_tokens)})
    conversations.append(Conversation(tuple(prompts)))
  return conversations


def describe(conversations: list[Conversation], block_size: int) -> dict:
  prompts = [p for c in conversations for p in c.prompts]
  distinct = set()  # full prompt blocks, named by their token prefix
  for prompt in prompts:
    for end in range(block_size, len(prompt) + 1, block_size):
      distinct.add(hash(prompt[:end]))
  return {"conversations": len(conversations), "turns": len(prompts),
          "prompt_tokens": {"min": min(map(len, prompts)), "mean": statistics.mean(map(len, prompts)),
                            "max": max(map(len, prompts)), "total": sum(map(len, prompts))},
          "shared_system_prompt_tokens": _common_prefix(prompts),
          "distinct_prefix_blocks": len(distinct), "reply_tokens": FLAGS.reply_tokens,
          "active_conversations": FLAGS.active}


def _common_prefix(prompts) -> int:
  first = prompts[0]
  return min(next((i for i, (a, b) in enumerate(zip(first, p)) if a != b), min(len(first), len(p)))
             for p in prompts[1:]) if len(prompts) > 1 else len(first)


# Runs.


def run_mode(engine, conversations: list[Conversation]) -> dict:
  """Runs every conversation through `engine` (closed loop, `--active` at once)."""
  from jaxtier.sampling import SamplingParams
  params = SamplingParams(max_tokens=FLAGS.reply_tokens, temperature=0, ignore_eos=True)
  queue = collections.deque(range(len(conversations)))
  next_turn = [0] * len(conversations)
  active, added, first, done = {}, {}, {}, {}
  before = engine.stats()
  start = time.perf_counter()

  def launch():
    while len(active) < FLAGS.active and queue:
      c = queue.popleft()
      request_id = f"c{c}t{next_turn[c]}"
      engine.add_request(request_id, conversations[c].prompts[next_turn[c]], params, seed=0)
      added[request_id] = time.perf_counter()
      active[request_id] = c

  launch()
  while active:
    updates = engine.step()
    now = time.perf_counter()
    for update in updates:
      if update.new_token_ids:
        first.setdefault(update.request_id, now)
      if update.completion is None:
        continue
      done[update.request_id] = update.completion
      c = active.pop(update.request_id)
      next_turn[c] += 1
      if next_turn[c] < len(conversations[c].prompts):
        queue.append(c)
    launch()
  wall = time.perf_counter() - start
  after = engine.stats()
  generated = sum(len(c.token_ids) for c in done.values())
  ttft = {rid: first[rid] - added[rid] for rid in done}
  delta = lambda key: after[key] - before[key]
  return {
      "seconds": wall, "generated_tokens": generated, "tokens_per_s": generated / wall,
      "requests_per_s": len(done) / wall, "ttft_s": percentiles(list(ttft.values())),
      "computed_tokens": delta("computed_tokens"), "prompt_tokens": delta("prompt_tokens"),
      "prefix_query_tokens": delta("prefix_query_tokens"),
      "device_hit_tokens": delta("prefix_device_hit_tokens"),
      "host_hit_tokens": delta("prefix_host_hit_tokens"),
      "device_hit_rate": rate(delta("prefix_device_hit_tokens"), delta("prefix_query_tokens")),
      "host_hit_rate": rate(delta("prefix_host_hit_tokens"), delta("prefix_query_tokens")),
      "host_hits_recomputed_tokens": delta("prefix_host_hit_recomputed_tokens"),
      "writeback_bytes": delta("prefix_writeback_bytes"), "load_bytes": delta("prefix_load_bytes"),
      # Write-through would copy every block when it is registered: each registered block is
      # either still cached or was evicted since.
      "write_through_bytes": (delta("prefix_device_evictions") + delta("device_blocks_cached"))
      * after["block_bytes"] if after["host_prefix_caching"] else 0,
      "device_evictions": delta("prefix_device_evictions"),
      "host_evictions": delta("prefix_host_evictions"),
      "swap_out_count": delta("swap_out_count"), "swap_seconds": delta("swap_seconds"),
      "preemptions": after["preemptions"], "steps": delta("steps"),
      "host_blocks_cached": after["host_blocks_cached"],
      "host_blocks_swapped": after["host_blocks_swapped"],
      "_tokens": {rid: c.token_ids for rid, c in done.items()}, "_ttft": ttft,
      "_host_cached": {rid: c.host_cached_tokens for rid, c in done.items()},
  }


def rate(part: float, whole: float) -> float:
  return part / whole if whole else 0.0


def percentiles(values: list[float]) -> dict:
  if not values:
    return {}
  ordered = sorted(values)
  pick = lambda q: float(np.percentile(ordered, q))
  return {"p50": pick(50), "p90": pick(90), "mean": statistics.mean(ordered), "n": len(ordered)}


def host_hit_section(results: dict) -> dict | None:
  """TTFT of the requests that loaded host-tier blocks, against the same requests elsewhere."""
  if "device+host" not in results:
    return None
  tiered = results["device+host"]
  hit = sorted(rid for rid, tokens in tiered["_host_cached"].items() if tokens)
  section = {"requests": len(hit),
             "host_cached_tokens_mean": statistics.mean(tiered["_host_cached"][r] for r in hit)
             if hit else 0, "ttft_s": percentiles([tiered["_ttft"][r] for r in hit])}
  for mode in ("off", "device"):
    if mode in results and hit:
      same = percentiles([results[mode]["_ttft"][r] for r in hit])
      section[f"{mode}_ttft_s"] = same
      section[f"ttft_p50_vs_{mode}"] = section["ttft_s"]["p50"] / same["p50"]
  return section


def simulator_section() -> dict:
  """The simulator's prediction for the article's configuration, in the three modes."""
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "simulate.py")
  keys = ("throughput_tokens_per_s", "makespan_s", "ttft_s", "computed_tokens",
          "prefix_device_hit_rate", "prefix_host_hit_rate", "prefix_load_bytes",
          "prefix_writeback_bytes", "device_blocks", "host_blocks")
  section = {"command": "python scripts/simulate.py --preset=article_chat "
                        "--enable_prefix_caching=... --host_prefix_caching=..."}
  for mode, settings in MODES.items():
    argv = [sys.executable, script, "--preset=article_chat",
            f"--enable_prefix_caching={settings['enable_prefix_caching']}",
            f"--host_prefix_caching={settings.get('host_prefix_caching', True)}"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
      section[mode] = {"error": done.stderr.strip().splitlines()[-1:]}
      continue
    report = json.loads(done.stdout)
    section[mode] = {k: report[k] for k in keys if k in report}
  if all("throughput_tokens_per_s" in section.get(m, {}) for m in ("off", "device+host")):
    section["throughput_device_host_vs_off"] = (section["device+host"]["throughput_tokens_per_s"]
                                                / section["off"]["throughput_tokens_per_s"])
  return section


def main(argv):
  del argv
  engine_flags.prepare()
  modes = [m.strip() for m in FLAGS.modes if m.strip()]
  for mode in modes:
    if mode not in MODES:
      engine_flags.usage_error(f"--modes: {mode!r} is not one of {tuple(MODES)}")
  for low, high in (("min_turns", "max_turns"), ("min_user", "max_user")):
    if FLAGS[low].value > FLAGS[high].value:
      engine_flags.usage_error(f"--{low}={FLAGS[low].value} is more than --{high}="
                               f"{FLAGS[high].value}")
  import jax
  from flax import nnx

  import jaxtier
  from jaxtier.engine.engine import Engine
  llm = jaxtier.LLM(**{**engine_flags.llm_kwargs(), "seed": FLAGS.seed})  # pools: per mode below
  conversations = build_workload(llm.tokenizer, FLAGS.seed)
  block_size = FLAGS.block_size
  workload = describe(conversations, block_size)
  longest = workload["prompt_tokens"]["max"] + FLAGS.reply_tokens
  max_model_len = FLAGS.max_model_len or -(-longest // block_size) * block_size
  if max_model_len < longest:
    engine_flags.usage_error(f"--max_model_len={max_model_len} is less than the longest turn "
                             f"({longest} tokens)")
  need = FLAGS.active * -(-longest // block_size)
  device_blocks = FLAGS.num_device_blocks or max(
      need + 2, int(FLAGS.device_pool_fraction * workload["distinct_prefix_blocks"]))
  host_blocks = (FLAGS.num_host_blocks if FLAGS.num_host_blocks is not None
                 else workload["distinct_prefix_blocks"] + need)
  pools = dict(max_model_len=max_model_len, num_device_blocks=device_blocks,
               num_host_blocks=host_blocks)
  report = {"model": FLAGS.model, "dtype": FLAGS.dtype, "backend": jax.default_backend(),
            "block_size": block_size, "block_bytes": llm.block_bytes,
            "max_num_seqs": FLAGS.max_num_seqs, "workload": workload,
            "pools": {"device_blocks": device_blocks, "host_blocks": host_blocks,
                      "device_kv_bytes": device_blocks * llm.block_bytes,
                      "host_kv_bytes": host_blocks * llm.block_bytes,
                      "device_pool_over_distinct_prefixes":
                          device_blocks / workload["distinct_prefix_blocks"]}}
  results, warm = {}, None
  for mode in modes:
    config = dataclasses.replace(llm.engine_config, **pools, **MODES[mode])
    engine = Engine(nnx.merge(llm.graphdef, llm.state), llm.tokenizer, config)
    if warm is None:
      warm = engine.warmup()
      report["warmup"] = warm
    print(f"{mode}: running {workload['turns']} turns", file=sys.stderr)
    results[mode] = run_mode(engine, conversations)
    engine.close()
    del engine
    gc.collect()
  reference = results.get("off")
  for mode, result in results.items():
    if reference is not None:
      result["outputs_equal_off"] = result["_tokens"] == reference["_tokens"]
      result["requests_differing_from_off"] = sum(
          result["_tokens"][r] != reference["_tokens"][r] for r in reference["_tokens"])
  report["host_hits"] = host_hit_section(results)
  report["modes"] = {mode: {k: v for k, v in r.items() if not k.startswith("_")}
                     for mode, r in results.items()}
  if "off" in results:
    for mode in results:
      report["modes"][mode]["throughput_vs_off"] = (results[mode]["tokens_per_s"]
                                                    / results["off"]["tokens_per_s"])
  if not FLAGS.skip_simulator:
    report["simulator"] = simulator_section()
  measured = {}
  if "off" in results and "device+host" in results:
    measured["throughput_device_host_vs_off"] = report["modes"]["device+host"]["throughput_vs_off"]
  if report["host_hits"] and "ttft_p50_vs_off" in report["host_hits"]:
    measured["host_hit_ttft_vs_recompute"] = report["host_hits"]["ttft_p50_vs_off"]
  report["targets"] = {
      name: {"target": target, "measured": measured.get(name),
             "met": None if name not in measured else (
                 measured[name] >= target if name.startswith("throughput")
                 else measured[name] <= target)}
      for name, target in TARGETS.items()}
  benchlib.print_report(report, FLAGS.out, indent=2)


if __name__ == "__main__":
  app.run(main)
