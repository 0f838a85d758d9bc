"""Step time with offloaded tail layers against the all-resident step, side by side, as JSON.

`--mode=cpu` (default): the default model's decode step with 0/5/10/20 tail layers offloaded at
depths 1-3. On CPU the memory kinds are one physical memory: a "transfer" is the copy of a layer
slice out of the host stack, so the ratio measures the prefetch machinery's own cost (target
<= 1.05x). Each configuration is timed in alternating rounds with the resident model whose head runs
the same way ("scan": every layer a scan iteration; "unrolled": per-layer buffers, what
`layer_execution="auto"` picks on CPU), so drift on a shared machine hits both alike; compilation is
timed apart. Each row also counts the step's minor page faults: XLA:CPU temporaries above 32 MB
(d + 1 fetched layers of 14 MB from d = 2 on) page-fault on every step unless freed memory is
retained (`jaxtier.kernels.cpu.heap`, on by default here as in the batch and serving scripts;
`--noretain_freed_memory` shows the cost). The planner's predictions for the same configurations
on the GPU presets close it.

`--mode=device` (run by scripts/bench_offload_gpu.sh on a GPU): pinned host -> device bandwidth by
`device_put` size, then a Llama-8B-sized synthetic model (random bf16 weights, `--synthetic_*`)
for a decode and a prefill step: resident step, offloaded steps at each depth, each against the
bound max(N t_c, n L / link) with t_c = resident step / N and the link measured here.

  python scripts/bench_offload.py --offloaded=0,5,10,20 --depths=1,2,3 --heads=scan,unrolled
"""

import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from jaxtier import checkpoint, offload
from jaxtier.engine.padded import model_step, step_fn
from jaxtier.kernels.cpu import heap as cpu_allocator
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.model import GroupedTransformer, Transformer
from jaxtier.model.config import ModelConfig
from jaxtier.offload import measure
from jaxtier.sampling import SamplingArrays, SamplingParams
from jaxtier.tools import hlo

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "cpu", ["cpu", "device"], "see the module docstring")
flags.DEFINE_string("model", "smollm2-135m-instruct",
                    "cpu mode: registry name or path, or \"synthetic\" (random float32 weights, "
                    "--synthetic_* sizes)")
flags.DEFINE_list("offloaded", ["0", "5", "10", "20"], "tail layers offloaded (0: resident)")
flags.DEFINE_list("depths", ["1", "2", "3"], "prefetch depths")
flags.DEFINE_list("heads", ["scan", "unrolled"], "cpu mode: how the resident head runs")
flags.DEFINE_string("order", "auto", "fetch order of the prefetch scan: auto, data or none")
flags.DEFINE_integer("batch", 1, "decode batch")
flags.DEFINE_integer("context", 256, "cached tokens the step attends over")
flags.DEFINE_integer("rounds", 15, "alternating rounds per configuration")
flags.DEFINE_integer("steps", 3, "steps per round")
flags.DEFINE_integer("synthetic_layers", 16, "device mode: layers of the synthetic model")
flags.DEFINE_integer("synthetic_hidden", 4096, "device mode: hidden size (Llama-3-8B: 4096)")
flags.DEFINE_integer("synthetic_intermediate", 14336, "device mode: MLP width (Llama-3-8B: 14336)")
flags.DEFINE_integer("prefill_batch", 4, "device mode: prefill step sequences")
flags.DEFINE_integer("prefill_tokens", 1024, "device mode: prefill step tokens per sequence")
flags.DEFINE_bool("retain_freed_memory", True, "keep freed host memory for reuse "
                  "(jaxtier.kernels.cpu.heap), as the batch and serving scripts do")


class Stepper:
  """One model's jitted step (`tokens` new tokens per row after `context` cached), own cache."""

  def __init__(self, model, batch: int, tokens: int, context: int):
    c = model.config
    dtype = jax.tree.leaves(nnx.state(model))[0].dtype
    graphdef, self.state = nnx.split(model)
    self.run = step_fn(graphdef)
    self.cache = ContiguousKVCache.create(c.num_layers, batch, context + tokens, c.num_kv_heads,
                                          c.head_dim, dtype)
    pos = jnp.broadcast_to(jnp.arange(context, context + tokens, dtype=jnp.int32), (batch, tokens))
    self.args = (jnp.ones((batch, tokens), jnp.int32), pos, jnp.full(batch, tokens - 1, jnp.int32),
                 SamplingArrays.from_params([SamplingParams(temperature=0)] * batch, [0] * batch,
                                            [0] * batch))
    start = time.perf_counter()
    self.step()
    self.compile_s = time.perf_counter() - start
    self.faults: list[int] = []  # minor page faults of each timed step

  def step(self):
    token, self.cache = self.run(self.state, self.cache, *self.args)
    token.block_until_ready()

  def time(self, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
      faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
      self.step()
      out.append(time.perf_counter() - start)
      self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return out


def side_by_side(resident: Stepper, other: Stepper) -> tuple[float, float, float]:
  """Median step seconds of resident and other, timed in alternating rounds, and the median over
  rounds of the ratio of the two rounds' medians (robust to drift between rounds)."""
  a, b, ratios = [], [], []
  for _ in range(FLAGS.rounds):
    a.append(resident.time(FLAGS.steps))
    b.append(other.time(FLAGS.steps))
    ratios.append(statistics.median(b[-1]) / statistics.median(a[-1]))
  flat = lambda rounds: statistics.median(t for r in rounds for t in r)
  return flat(a), flat(b), statistics.median(ratios)


def sweep(model, head: str, offloaded, depths, batch: int, tokens: int) -> list[dict]:
  """Rows for the resident model and every (n, d), each timed against the resident one."""
  resident_model = (model if head == "scan" else
                    GroupedTransformer(model, [(model.config.num_layers, "unrolled")]))
  resident = Stepper(resident_model, batch, tokens, FLAGS.context)
  rows = [{"head": head, "offloaded": 0, "depth": 0, "compile_s": resident.compile_s,
           "step_ms": 1e3 * statistics.median(resident.time(FLAGS.rounds * FLAGS.steps)),
           "page_faults_per_step": statistics.median(resident.faults)}]
  for n in [n for n in offloaded if n]:
    for d in [d for d in depths if d <= n]:
      other = Stepper(offload.offload_tail(model, n, d, head, order=FLAGS.order), batch, tokens,
                      FLAGS.context)
      base_s, step_s, ratio = side_by_side(resident, other)
      rows.append({"head": head, "offloaded": n, "depth": d, "compile_s": other.compile_s,
                   "step_ms": 1e3 * step_s, "resident_step_ms": 1e3 * base_s,
                   "ratio_vs_resident": ratio,
                   "page_faults_per_step": statistics.median(other.faults),
                   "host_weight_bytes": offload.bytes_by_memory_kind(other.state)["pinned_host"]})
      del other
  return rows


def cuda_export_check(model, offloaded, depths, batch: int) -> list[dict]:
  """The decode step of each (n, d) exported for CUDA on this machine: what its StableHLO moves
  host -> device per step, in how many transfers, how many layers ahead, and any host compute."""
  c = model.config
  layer_bytes = c.layer_param_count * jax.tree.leaves(nnx.state(model))[0].dtype.itemsize
  cache = ContiguousKVCache.create(c.num_layers, batch, FLAGS.context + 1, c.num_kv_heads,
                                   c.head_dim)
  args = (jnp.ones((batch, 1), jnp.int32), jnp.full((batch, 1), FLAGS.context, jnp.int32),
          jnp.zeros(batch, jnp.int32),
          SamplingArrays.from_params([SamplingParams(temperature=0)] * batch, [0] * batch,
                                     [0] * batch))
  rows = []
  for n in [n for n in offloaded if n]:
    for d in [d for d in depths if d <= n]:
      graphdef, state = nnx.split(offload.offload_tail(model, n, d))
      report = hlo.placement_report(hlo.exported_text(model_step, graphdef, state, cache, *args))
      in_loop = report.to_device(in_loop=True)
      rows.append({"offloaded": n, "depth": d, "offloaded_bytes": n * layer_bytes,
                   "host_argument_bytes": sum(report.host_arguments.values()),
                   "to_device_bytes_per_step": report.to_device_bytes_per_call(),
                   "transfers": len(report.to_device()),
                   "largest_transfer_bytes": max(t.nbytes for t in report.to_device()),
                   "layers_ahead_in_loop": sorted({t.layers_ahead for t in in_loop}),
                   "host_compute_ops": len(report.host_compute)})
  return rows


def gpu_predictions(config, offloaded, depths) -> dict:
  """The planner's step time for the same configurations on every preset (roofline compute)."""
  bytes_ = offload.ModelBytes.from_config(config, "float32")
  out = {}
  for name, hw in offload.PRESETS.items():
    t_c = offload.layer_seconds(bytes_, hw, FLAGS.batch, 1, FLAGS.context)
    t_x = bytes_.layer_bytes / hw.link_bytes_per_s
    rows = [{"offloaded": n, "depth": d,
             "predicted_step_ms": 1e3 * offload.simulate_step(bytes_.num_layers, n, d, t_c, t_x),
             "bound_ms": 1e3 * max(bytes_.num_layers * t_c, n * t_x)}
            for n in offloaded for d in ([0] if n == 0 else [d for d in depths if d <= n])]
    plan = offload.plan(bytes_, device_memory_bytes=hw.device_memory_bytes,
                        link_bytes_per_s=hw.link_bytes_per_s, layer_compute_s=t_c,
                        offload_tail_layers=max(offloaded))
    out[name] = {"layer_compute_ms": 1e3 * t_c, "layer_transfer_ms": 1e3 * t_x,
                 "resident_step_ms": 1e3 * bytes_.num_layers * t_c, "message": plan.message(),
                 "rows": rows}
  return out


def against_bound(rows: list[dict], num_layers: int, layer_bytes: int, link: float) -> list[dict]:
  """Adds t_c (resident step / N), the bound max(N t_c, n L / link) and the ratio to it."""
  t_c = rows[0]["step_ms"] / 1e3 / num_layers
  for row in rows:
    n, d = row["offloaded"], row["depth"]
    row["bound_ms"] = 1e3 * max(num_layers * t_c, n * layer_bytes / link)
    row["predicted_ms"] = 1e3 * offload.simulate_step(num_layers, n, d, t_c, layer_bytes / link)
    row["ratio_to_bound"] = row["step_ms"] / row["bound_ms"]
  return rows


def synthetic_model(dtype) -> Transformer:
  """A Llama-shaped model of random weights, sized by the --synthetic_* flags (head dim 128)."""
  c = ModelConfig(architecture="llama", vocab_size=32000, hidden_size=FLAGS.synthetic_hidden,
                  intermediate_size=FLAGS.synthetic_intermediate,
                  num_layers=FLAGS.synthetic_layers, num_heads=FLAGS.synthetic_hidden // 128,
                  num_kv_heads=min(8, FLAGS.synthetic_hidden // 128), head_dim=128,
                  max_position_embeddings=8192)
  return Transformer(c, dtype, rngs=nnx.Rngs(0))


def device_report(offloaded, depths) -> dict:
  links = {mb: measure.link_bytes_per_s(mb * 2**20) for mb in (16, 64, 256, 1024)}
  link = max(links.values())
  model = synthetic_model(jnp.bfloat16)
  c = model.config
  layer_bytes = c.layer_param_count * 2
  steps = {"decode": (FLAGS.batch, 1), "prefill": (FLAGS.prefill_batch, FLAGS.prefill_tokens)}
  return {"link_gbps_by_mib": {mb: bw / 1e9 for mb, bw in links.items()},
          "model": {"num_layers": c.num_layers, "layer_bytes": layer_bytes, "dtype": "bfloat16"},
          **{name: against_bound(sweep(model, "scan", offloaded, depths, b, t), c.num_layers,
                                 layer_bytes, link) for name, (b, t) in steps.items()}}


def main(argv):
  del argv
  retained = FLAGS.retain_freed_memory and cpu_allocator.retain_freed_memory(single_arena=True)
  offloaded, depths = [int(n) for n in FLAGS.offloaded], [int(d) for d in FLAGS.depths]
  common = {"backend": jax.default_backend(), "device": str(jax.local_devices()[0]),
            "order": FLAGS.order, "rounds": FLAGS.rounds, "steps_per_round": FLAGS.steps,
            "context": FLAGS.context, "retain_freed_memory": retained}
  if FLAGS.mode == "device":
    print(json.dumps(common | device_report(offloaded, depths), indent=1))
    return
  if FLAGS.model == "synthetic":
    model = synthetic_model(jnp.float32)
  else:
    model, _ = checkpoint.load_model(FLAGS.model)
  layer_bytes = model.config.layer_param_count * 4
  print(json.dumps(common | {
      "what": ("CPU decode step (one token per row, float32) with the last `offloaded` layers in "
               "pinned_host memory prefetched `depth` ahead, against the all-resident model with "
               "the same head execution timed alternately in the same run; step_ms and "
               "resident_step_ms are medians over all steps, ratio_vs_resident the median over "
               "rounds of the per-round ratio; compile excluded. cuda_export: the same steps "
               "exported for CUDA here, their host -> device transfers counted in the StableHLO. "
               "gpu_presets_predicted: the "
               "planner's step time for the same configurations (roofline compute, preset link)."),
      "model": FLAGS.model, "num_layers": model.config.num_layers, "layer_bytes": layer_bytes,
      "batch": FLAGS.batch,
      "cpu": [row for head in FLAGS.heads
              for row in sweep(model, head, offloaded, depths, FLAGS.batch, 1)],
      "cuda_export": cuda_export_check(model, offloaded, depths, FLAGS.batch),
      "gpu_presets_predicted": gpu_predictions(model.config, offloaded, depths)}, indent=1))


if __name__ == "__main__":
  app.run(main)
