"""Replays a workload through jaxtier's scheduler with a cost model and prints a JSON report.

    python scripts/simulate.py --preset=article --preemption_mode=swap
    python scripts/simulate.py --trace=requests.jsonl --num_device_blocks=2048 --num_host_blocks=8192

Pool sizes come from memory sizes and the model's shape unless --num_device_blocks /
--num_host_blocks give them: device KV = device_gb - weights_gb - reserve_gb; GB here are 1e9 bytes.
The report holds throughput, TTFT and per-token latency percentiles, swap count, bytes and seconds,
preemptions and peak pool usage (see jaxtier/scheduler/simulator.py for the cost model).
"""

import json
import math

from absl import app, flags

from jaxtier.kv_bytes import ELEMENT_BYTES, kv_block_bytes
from jaxtier.scheduler import SchedulerConfig
from jaxtier.scheduler import simulator
from jaxtier.scheduler.policies import VICTIM_POLICIES

_GB = 1e9

# The source article's example: a 7B model with 28 layers and 32 x 128 KV
# heads in fp16 (bfloat16 here, the same two bytes), 100 concurrent requests averaging 4000 tokens,
# an 80 GB device, PCIe 4.0 at 22 GB/s.
# Our assumptions: 14 GB of weights (7e9 x 2 bytes), 8 GB for activations (the article's own split),
# a 180 GB host pool (its section 4.2), a 5 GB watermark (its section 3.2), 10 ms per decode step and
# 90 us of compute per token (14 GFLOP at half of a 312 TFLOP/s peak).
PRESETS = {
    "article": dict(
        num_layers=28, kv_heads=32, head_dim=128, kv_cache_dtype="bfloat16", device_gb=80.0,
        weights_gb=14.0, reserve_gb=8.0, host_gb=180.0, watermark_gb=5.0, num_requests=100,
        arrival_rate=0.0, prompt_len=3000, output_len=1000, length_dist="uniform",
        step_base_ms=10.0, per_token_us=90.0, link_gb_per_s=22.0, max_tokens_per_step=4096),
}

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", None, sorted(PRESETS), "Defaults for every flag not given explicitly.")
flags.DEFINE_string("trace", None, "JSONL trace: arrival_time, prompt_len, output_len per line.")
flags.DEFINE_integer("num_requests", 100, "Synthetic workload: requests.")
flags.DEFINE_float("arrival_rate", 0.0, "Synthetic workload: requests per second (0: all at once).")
flags.DEFINE_integer("prompt_len", 512, "Synthetic workload: mean prompt tokens.")
flags.DEFINE_integer("output_len", 256, "Synthetic workload: mean output tokens.")
flags.DEFINE_enum("length_dist", "uniform", simulator.LENGTH_DISTRIBUTIONS, "Length distribution.")
flags.DEFINE_integer("max_tokens", 0, "max_tokens of each request (0: its output length).")
flags.DEFINE_integer("seed", 0, "Synthetic workload seed.")
flags.DEFINE_integer("num_layers", 28, "Model layers.")
flags.DEFINE_integer("kv_heads", 32, "KV heads per layer.")
flags.DEFINE_integer("head_dim", 128, "Head dimension.")
flags.DEFINE_enum("kv_cache_dtype", "bfloat16", sorted(ELEMENT_BYTES),
                  "KV storage dtype (int8 counts its float32 scales).")
flags.DEFINE_float("device_gb", 80.0, "Device memory.")
flags.DEFINE_float("weights_gb", 14.0, "Resident weights.")
flags.DEFINE_float("reserve_gb", 8.0, "Activations and scratch.")
flags.DEFINE_float("host_gb", 180.0, "Host KV pool.")
flags.DEFINE_integer("num_device_blocks", 0, "Device KV blocks (0: from the memory sizes).")
flags.DEFINE_integer("num_host_blocks", -1, "Host KV blocks (-1: from host_gb).")
flags.DEFINE_integer("block_size", 16, "Tokens per block.")
flags.DEFINE_integer("max_running", 256, "Most running requests.")
flags.DEFINE_integer("max_tokens_per_step", 2048, "Token budget per step.")
flags.DEFINE_float("watermark_gb", 0.0, "Device KV kept free.")
flags.DEFINE_enum("preemption_mode", "swap", ["swap", "recompute"], "Preemption mode.")
flags.DEFINE_enum("victim_policy", "longest_waiting", sorted(VICTIM_POLICIES), "Victim policy.")
flags.DEFINE_enum("host_full", "recompute", ["recompute", "abort_oldest"], "Host pool full.")
flags.DEFINE_bool("prefetch_swap_in", True, "Plan swap-ins one step early.")
flags.DEFINE_float("step_base_ms", 10.0, "Cost of a step that computes anything.")
flags.DEFINE_float("per_token_us", 90.0, "Compute per token.")
flags.DEFINE_float("link_gb_per_s", 22.0, "Host link bandwidth.")


def _apply_preset():
  for name, value in PRESETS.get(FLAGS.preset, {}).items():
    if not FLAGS[name].present:
      FLAGS[name].value = value


def _config(block_bytes: int) -> SchedulerConfig:
  device_blocks = FLAGS.num_device_blocks or int(
      (FLAGS.device_gb - FLAGS.weights_gb - FLAGS.reserve_gb) * _GB // block_bytes)
  host_blocks = (FLAGS.num_host_blocks if FLAGS.num_host_blocks >= 0
                 else int(FLAGS.host_gb * _GB // block_bytes))
  return SchedulerConfig(
      num_device_blocks=device_blocks, num_host_blocks=host_blocks, block_size=FLAGS.block_size,
      max_running=FLAGS.max_running, max_tokens_per_step=FLAGS.max_tokens_per_step,
      watermark_blocks=math.ceil(FLAGS.watermark_gb * _GB / block_bytes),
      preemption_mode=FLAGS.preemption_mode, victim_policy=FLAGS.victim_policy,
      host_full=FLAGS.host_full, prefetch_swap_in=FLAGS.prefetch_swap_in, block_bytes=block_bytes)


def main(argv):
  del argv
  _apply_preset()
  block_bytes = kv_block_bytes(FLAGS.num_layers, FLAGS.kv_heads, FLAGS.head_dim,
                               FLAGS.kv_cache_dtype, FLAGS.block_size)
  if FLAGS.trace:
    with open(FLAGS.trace) as f:
      workload = simulator.read_trace(f)
  else:
    workload = simulator.synthetic_workload(
        FLAGS.num_requests, FLAGS.arrival_rate, FLAGS.prompt_len, FLAGS.output_len,
        FLAGS.length_dist, FLAGS.max_tokens, FLAGS.seed)
  cost = simulator.CostModel(FLAGS.step_base_ms / 1e3, FLAGS.per_token_us / 1e6,
                             FLAGS.link_gb_per_s * _GB, block_bytes)
  config = _config(block_bytes)
  report = simulator.simulate(config, cost, workload)
  report["config"] = {"preset": FLAGS.preset, "preemption_mode": config.preemption_mode,
                      "victim_policy": config.victim_policy, "host_full": config.host_full,
                      "watermark_blocks": config.watermark, "block_size": config.block_size}
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
