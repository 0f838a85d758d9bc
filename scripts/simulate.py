"""Replays a workload through jaxtier's scheduler with a cost model and prints a JSON report.

    python scripts/simulate.py --preset=article --preemption_mode=swap
    python scripts/simulate.py --trace=requests.jsonl --num_device_blocks=2048 --num_host_blocks=8192
    python scripts/simulate.py --workload=chat --num_conversations=50 --enable_prefix_caching

The `article_chat` preset predicts prefix caching's three modes on a multi-turn chat workload:

    python scripts/simulate.py --preset=article_chat --noenable_prefix_caching
    python scripts/simulate.py --preset=article_chat --enable_prefix_caching --nohost_prefix_caching
    python scripts/simulate.py --preset=article_chat --enable_prefix_caching --host_prefix_caching

The scheduler's settings are the engine flags (`jaxtier.engine.flags`: the names, defaults and
checks of `jaxtier.LLM`'s arguments; `--kv_cache_dtype=auto` is bfloat16, an accelerator's). Pool
sizes come from memory sizes and the model's shape unless --num_device_blocks / --num_host_blocks
give them: device KV = device_gb - weights_gb - reserve_gb; GB here are 1e9 bytes.
The report holds throughput, TTFT and per-token latency percentiles, swap count, bytes and seconds,
preemptions, peak pool usage and the prefix cache's hits, write-backs and loads (see
jaxtier/tools/simulator.py for the cost model). The chat workload (--workload=chat) gives each
request its prompt token ids, which prefix caching needs; the synthetic one and traces give only
lengths, so caching finds nothing to share there.
"""

import json

from absl import app, flags

from jaxtier.common.kv_bytes import kv_block_bytes
from jaxtier.engine import flags as engine_flags
from jaxtier.engine.args import EngineArgs
from jaxtier.scheduler import SchedulerConfig
from jaxtier.tools import simulator

_GB = 1e9
WORKLOADS = ("synthetic", "chat")

# The source article's example: a 7B model with 28 layers and 32 x 128 KV
# heads in fp16 (bfloat16 here, the same two bytes), 100 concurrent requests averaging 4000 tokens,
# an 80 GB device, PCIe 4.0 at 22 GB/s.
# Our assumptions: 14 GB of weights (7e9 x 2 bytes), 8 GB for activations (the article's own split),
# a 180 GB host pool (its section 4.2), a 5 GB watermark (its section 3.2), 10 ms per decode step and
# 90 us of compute per token (14 GFLOP at half of a 312 TFLOP/s peak).
# Its 5 GB watermark as the share of the device KV pool (80 - 14 - 8 GB) the engine argument is.
_ARTICLE_WATERMARK = 5.0 / (80.0 - 14.0 - 8.0)
PRESETS = {
    "article": dict(
        num_layers=28, kv_heads=32, head_dim=128, kv_cache_dtype="bfloat16", device_gb=80.0,
        weights_gb=14.0, reserve_gb=8.0, host_gb=180.0, watermark=_ARTICLE_WATERMARK,
        num_requests=100, arrival_rate=0.0, prompt_len=3000, output_len=1000,
        length_dist="uniform", step_base_ms=10.0, per_token_us=90.0, link_gb_per_s=22.0,
        max_num_seqs=256, max_num_batched_tokens=4096, enable_prefix_caching=False),
}
# The article's model, memory, link and cost figures serving multi-turn chats, sized so that the
# distinct prefixes outgrow the device pool but fit in the host pool. One block holds 16 tokens x
# 28 layers x 2 (K, V) x 32 heads x 128 x 2 bytes = 7,340,032 bytes, so the device KV pool
# (80 - 14 - 8 = 58 GB) has 7,901 blocks and the 180 GB host pool 24,523. Turn k's prompt is
# 1000 + 500 k + 200 tokens, and every turn's prompt starts with the previous one, so a conversation
# of T turns caches the full blocks of its last prompt: at 7 turns on average 4,200 tokens, 262
# blocks, of which the first 62 (the system prompt) all conversations share. All 100 conversations
# start at once and each turn follows the last reply at once, so all stay live to the end: 62 + 100
# x 200 = 20,062 distinct blocks (147 GB), 2.5 times the device pool (which also holds the running
# requests' KV) but within the host pool, with room left for swapped-out requests.
PRESETS["article_chat"] = PRESETS["article"] | dict(
    workload="chat", num_conversations=100, min_turns=6, max_turns=8, system_len=1000,
    user_len=200, output_len=300, num_system_prompts=1, arrival_rate=0.0, think_time_s=0.0)

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", None, sorted(PRESETS), "Defaults for every flag not given explicitly.")
flags.DEFINE_string("trace", None, "JSONL trace: arrival_time, prompt_len, output_len per line.")
flags.DEFINE_enum("workload", "synthetic", WORKLOADS,
                  "Without --trace: synthetic requests of given lengths, or multi-turn chats.")
flags.DEFINE_integer("num_requests", 100, "Synthetic workload: requests.")
flags.DEFINE_float("arrival_rate", 0.0,
                   "Requests (chat: first turns) per second (0: all at once).")
flags.DEFINE_integer("prompt_len", 512, "Synthetic workload: mean prompt tokens.")
flags.DEFINE_integer("output_len", 256, "Mean output tokens (chat: every reply's tokens).")
flags.DEFINE_integer("num_conversations", 100, "Chat workload: conversations.")
flags.DEFINE_integer("min_turns", 2, "Chat workload: fewest turns of a conversation.")
flags.DEFINE_integer("max_turns", 6, "Chat workload: most turns of a conversation.")
flags.DEFINE_integer("system_len", 1000, "Chat workload: tokens of each shared system prompt.")
flags.DEFINE_integer("user_len", 200, "Chat workload: tokens of each user message.")
flags.DEFINE_integer("num_system_prompts", 1, "Chat workload: distinct system prompts.")
flags.DEFINE_float("think_time_s", 0.0, "Chat workload: seconds from a reply to the next turn.")
flags.DEFINE_enum("length_dist", "uniform", simulator.LENGTH_DISTRIBUTIONS, "Length distribution.")
flags.DEFINE_integer("max_tokens", 0, "max_tokens of each request (0: its output length).")
flags.DEFINE_integer("seed", 0, "Synthetic or chat workload seed.")
flags.DEFINE_integer("num_layers", 28, "Model layers.")
flags.DEFINE_integer("kv_heads", 32, "KV heads per layer.")
flags.DEFINE_integer("head_dim", 128, "Head dimension.")
flags.DEFINE_float("device_gb", 80.0, "Device memory (sizes the device pool without "
                   "--num_device_blocks).")
flags.DEFINE_float("weights_gb", 14.0, "Resident weights.")
flags.DEFINE_float("reserve_gb", 8.0, "Activations and scratch.")
flags.DEFINE_float("host_gb", 180.0, "Host KV pool (without --num_host_blocks).")
flags.DEFINE_enum("host_full", "recompute", ["recompute", "abort_oldest"], "Host pool full.")
flags.DEFINE_bool("prefetch_swap_in", True, "Plan swap-ins one step early.")
flags.DEFINE_float("step_base_ms", 10.0, "Cost of a step that computes anything.")
flags.DEFINE_float("per_token_us", 90.0, "Compute per token.")
flags.DEFINE_float("link_gb_per_s", 22.0, "Host link bandwidth.")
# The engine's own flags (jaxtier.engine.flags: names, defaults and help of EngineArgs) for what
# the scheduler takes from the engine arguments.
ENGINE_FLAGS = ("kv_cache_dtype", "num_device_blocks", "num_host_blocks", "block_size",
                "max_num_seqs", "max_num_batched_tokens", "watermark", "preemption_mode",
                "victim_policy", "enable_prefix_caching", "host_prefix_caching")
for _name in ENGINE_FLAGS:
  flags.declare_key_flag(_name)


def _apply_preset():
  for name, value in PRESETS.get(FLAGS.preset, {}).items():
    if not FLAGS[name].present:
      FLAGS[name].value = value


def _engine_args() -> EngineArgs:
  """The engine flags, checked as the engine checks them (a bad value is a usage error)."""
  try:
    return EngineArgs(**engine_flags.llm_kwargs())
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def _kv_cache_dtype(args: EngineArgs) -> str:
  """`--kv_cache_dtype`, with "auto" the simulated accelerator's model dtype, bfloat16."""
  return "bfloat16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype


def _config(args: EngineArgs, block_bytes: int) -> SchedulerConfig:
  device_blocks = args.num_device_blocks or int(
      (FLAGS.device_gb - FLAGS.weights_gb - FLAGS.reserve_gb) * _GB // block_bytes)
  host_blocks = (args.num_host_blocks if args.num_host_blocks is not None
                 else int(FLAGS.host_gb * _GB // block_bytes))
  return SchedulerConfig(
      num_device_blocks=device_blocks, num_host_blocks=host_blocks, block_size=args.block_size,
      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.token_budget,
      watermark=args.watermark, preemption_mode=args.preemption_mode,
      victim_policy=args.victim_policy, host_full=FLAGS.host_full,
      prefetch_swap_in=FLAGS.prefetch_swap_in, block_bytes=block_bytes,
      enable_prefix_caching=args.enable_prefix_caching,
      host_prefix_caching=args.host_prefix_caching)


def _workload() -> tuple[simulator.WorkItem, ...]:
  if FLAGS.trace:
    if FLAGS.workload != "synthetic":
      raise app.UsageError(f"--trace with --workload={FLAGS.workload}: expected one of the two")
    with open(FLAGS.trace) as f:
      return simulator.read_trace(f)
  if FLAGS.workload == "chat":
    return simulator.chat_workload(
        FLAGS.num_conversations, FLAGS.min_turns, FLAGS.max_turns, FLAGS.system_len,
        FLAGS.user_len, FLAGS.output_len, FLAGS.num_system_prompts,
        arrival_rate=FLAGS.arrival_rate, think_time_s=FLAGS.think_time_s, seed=FLAGS.seed)
  return simulator.synthetic_workload(
      FLAGS.num_requests, FLAGS.arrival_rate, FLAGS.prompt_len, FLAGS.output_len,
      FLAGS.length_dist, FLAGS.max_tokens, FLAGS.seed)


def main(argv):
  del argv
  _apply_preset()
  args = _engine_args()
  block_bytes = kv_block_bytes(FLAGS.num_layers, FLAGS.kv_heads, FLAGS.head_dim,
                               _kv_cache_dtype(args), args.block_size)
  workload = _workload()
  cost = simulator.CostModel(FLAGS.step_base_ms / 1e3, FLAGS.per_token_us / 1e6,
                             FLAGS.link_gb_per_s * _GB, block_bytes)
  config = _config(args, block_bytes)
  report = simulator.simulate(config, cost, workload)
  report["config"] = {"preset": FLAGS.preset,
                      "workload": "trace" if FLAGS.trace else FLAGS.workload,
                      "preemption_mode": config.preemption_mode,
                      "victim_policy": config.victim_policy, "host_full": config.host_full,
                      "watermark_blocks": config.watermark_block_count,
                      "block_size": config.block_size}
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
