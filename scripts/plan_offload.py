"""How many tail layers to offload and how deep to prefetch, for a model on a device: JSON out.

The model is a registry name or path (`--model`), or raw numbers (`--num_layers`, `--layer_gb`,
`--other_gb`); `--tensor_parallel_size` plans one device's share of a sharded model. Device
memory, link bandwidth and per-layer compute time come from flags, from a hardware preset
(`--hardware`; compute time by roofline for the step `--batch` x `--tokens` after `--context`
cached tokens), or are measured on this machine (`--measure`). The KV reservation is
`--kv_reserve_gb` or `--concurrency` x `--context_len` tokens. The plan's advice, in plain words,
goes to stderr; `--all_presets` plans the same step on every preset.

  python scripts/plan_offload.py --config=configs/offload_plan_article.py
  python scripts/plan_offload.py --model=smollm2-135m-instruct --hardware=h100-80gb-pcie4 \\
      --concurrency=64 --context_len=8192 --batch=64
"""

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxtier import checkpoint, offload
from jaxtier.model import sharding
from jaxtier.offload import measure

FLAGS = flags.FLAGS
GB = 1e9
config_flags.DEFINE_config_file("config", None, "ml_collections config giving flag defaults")
flags.DEFINE_string("model", None, "registry name, HF directory or jaxtier Orbax directory")
flags.DEFINE_integer("num_layers", None, "raw model: number of layers (with --layer_gb)")
flags.DEFINE_float("layer_gb", None, "raw model: GB of one layer")
flags.DEFINE_float("other_gb", 0.0, "raw model: GB of embeddings and LM head")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16", "float16"], "parameter dtype")
flags.DEFINE_string("hardware", None, f"preset: one of {sorted(offload.PRESETS)}")
flags.DEFINE_bool("all_presets", False, "plan on every preset (roofline compute)")
flags.DEFINE_bool("measure", False, "measure link bandwidth and layer compute on this machine")
flags.DEFINE_float("device_memory_gb", None, "device memory M, GB (overrides the preset)")
flags.DEFINE_float("kv_reserve_gb", None, "KV reservation K, GB")
flags.DEFINE_integer("concurrency", None, "K from concurrency x context_len tokens")
flags.DEFINE_integer("context_len", None, "K from concurrency x context_len tokens")
flags.DEFINE_float("activation_reserve_gb", 0.0, "activation reserve A, GB")
flags.DEFINE_float("link_gbps", None, "host -> device bandwidth, GB/s (overrides the preset)")
flags.DEFINE_float("layer_compute_ms", None, "compute time of one layer, ms (overrides the rest)")
flags.DEFINE_integer("batch", 1, "step shape for roofline or measured compute: sequences")
flags.DEFINE_integer("tokens", 1, "step shape: new tokens per sequence (1: decode)")
flags.DEFINE_integer("context", 1024, "step shape: cached tokens per sequence")
flags.DEFINE_integer("offload_tail_layers", None, "fix n; the plan then only picks the depth")
flags.DEFINE_float("kv_swap_gb_per_step", 0.0, "KV swap bytes per step, which use the link first")
flags.DEFINE_integer("tensor_parallel_size", 1, "plan one device of a tensor-parallel group: its "
                     "share of the weights and KV (--model only)", lower_bound=1)


def model_bytes() -> tuple[offload.ModelBytes, object]:
  """(per-device ModelBytes, the model's config or None) from --model or the raw-number flags;
  a model's config is read from its checkpoint's metadata, without loading weights."""
  if FLAGS.model is None:
    if FLAGS.num_layers is None or FLAGS.layer_gb is None:
      raise app.UsageError("give --model, or --num_layers and --layer_gb")
    return offload.ModelBytes(FLAGS.num_layers, round(FLAGS.layer_gb * GB),
                              round(FLAGS.other_gb * GB)), None
  opened = checkpoint.open_checkpoint(FLAGS.model)
  opened.close()
  try:
    sharding.check_tensor_parallel(opened.config, FLAGS.tensor_parallel_size)
    return offload.ModelBytes.from_config(opened.config, FLAGS.dtype,
                                          tensor_parallel_size=FLAGS.tensor_parallel_size), \
        opened.config
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def plan_args(m: offload.ModelBytes, config, hardware) -> dict:
  """plan() keyword arguments from the flags, the preset and measurements."""
  def pick(flag_value, scale, preset_value, name):
    if flag_value is not None:
      return flag_value * scale
    if preset_value is None:
      raise app.UsageError(f"--{name} is needed (or --hardware / --measure)")
    return preset_value
  measured_link = measure.link_bytes_per_s() if FLAGS.measure else None
  if FLAGS.measure and config is None:
    raise app.UsageError("--measure needs --model (it times a layer of that model)")
  measured_compute = (measure.layer_compute_s(config, FLAGS.dtype, FLAGS.batch, FLAGS.tokens,
                                              FLAGS.context) if FLAGS.measure else None)
  roofline = hardware and offload.layer_seconds(m, hardware, FLAGS.batch, FLAGS.tokens,
                                                FLAGS.context)
  if FLAGS.kv_reserve_gb is not None:
    kv = round(FLAGS.kv_reserve_gb * GB)
  elif FLAGS.concurrency and FLAGS.context_len:
    kv = offload.kv_reservation(m, FLAGS.concurrency, FLAGS.context_len)
  else:
    kv = 0
  return dict(
      device_memory_bytes=round(pick(FLAGS.device_memory_gb, GB, hardware and
                                     hardware.device_memory_bytes, "device_memory_gb")),
      link_bytes_per_s=pick(FLAGS.link_gbps, GB, measured_link or
                            (hardware and hardware.link_bytes_per_s), "link_gbps"),
      layer_compute_s=pick(FLAGS.layer_compute_ms, 1e-3, measured_compute or roofline,
                           "layer_compute_ms"),
      kv_reserve_bytes=kv, activation_reserve_bytes=round(FLAGS.activation_reserve_gb * GB),
      kv_swap_bytes_per_step=round(FLAGS.kv_swap_gb_per_step * GB),
      offload_tail_layers=FLAGS.offload_tail_layers)


def apply_config_defaults() -> None:
  for name, value in (FLAGS.config or {}).items():
    if name not in FLAGS:
      raise app.UsageError(f"--config field {name!r} is not a flag of this script")
    if not FLAGS[name].present:
      FLAGS[name].value = value


def main(argv):
  del argv
  apply_config_defaults()
  m, config = model_bytes()
  names = sorted(offload.PRESETS) if FLAGS.all_presets else [FLAGS.hardware]
  out = {}
  try:
    for name in names:
      hardware = offload.preset(name) if name else None
      p = offload.plan(m, **plan_args(m, config, hardware))
      out[name or "given"] = p.to_dict() | {"scheduler": offload.scheduler_link_fields(p)}
      print(f"[{name or 'given'}] {p.message()}", file=sys.stderr)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  app.run(main)
