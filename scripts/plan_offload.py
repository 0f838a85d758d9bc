"""How many tail layers to offload and how deep to prefetch, for a model on a device: JSON out.

For a model (`--model`), the engine flags are the scripts' (`jaxtier.engine.flags`, here with
`--offload_tail_layers=auto` by default) and the plan is the one the engine, `--dry_run` and
`scripts/export_programs.py` make (`jaxtier.engine.build.plan`): for this machine, measured, or
for `--platform` (cuda, tpu) on a hardware preset (`--hardware`, default the platform's; its
device memory unless `--device_memory_gb` gives one; `--all_presets` plans on every preset). The
planner times the decode step of `--max_num_seqs` rows over `--max_model_len` tokens, and
reserves the device KV pool given (`--kv_cache_memory_gb` / `--num_device_blocks`) or one
`--max_model_len` sequence. Each plan prints as `jaxtier.engine.build.Plan.summary()` (the memory
plan `--dry_run` prints, the layout, the engine configuration and the offload planner's plan)
with the scheduler's link fields; the planner's advice, in plain words, goes to stderr.

Without a model, raw numbers plan one step of the planner alone (`jaxtier.offload.plan`): a model
of `--num_layers` layers of `--layer_gb` (plus `--other_gb`), `--device_memory_gb`, a KV
reservation of `--kv_reserve_gb`, a link of `--link_gbps` and `--layer_compute_ms` per layer.

  python scripts/plan_offload.py --model=smollm2-135m-instruct --platform=cuda --all_presets
  python scripts/plan_offload.py --model=smollm2-135m-instruct --platform=cuda \\
      --hardware=h200-141gb --max_num_seqs=64 --max_model_len=8192
  python scripts/plan_offload.py --config=configs/offload_plan_article.py
"""

import json
import sys

from absl import app, flags, logging

from jaxtier.engine import flags as engine_flags
from jaxtier.engine.args import GB, EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("hardware", None, "a preset of jaxtier.offload.hardware for the planner's link "
                    "rate and layer time (and, for another --platform, the device memory); "
                    "default: the platform's preset, or measured on this machine")
flags.DEFINE_bool("all_presets", False, "plan on every preset of jaxtier.offload.hardware (for "
                  "--platform, default gpu)")
flags.DEFINE_integer("num_layers", None, "raw numbers instead of --model: layers (with --layer_gb)")
flags.DEFINE_float("layer_gb", None, "raw numbers: GB of one layer")
flags.DEFINE_float("other_gb", 0.0, "raw numbers: GB of embeddings and LM head")
flags.DEFINE_float("kv_reserve_gb", 0.0, "raw numbers: the KV reservation K, GB")
flags.DEFINE_float("link_gbps", None, "raw numbers: host -> device bandwidth, GB/s")
flags.DEFINE_float("layer_compute_ms", None, "raw numbers: compute time of one layer, ms")
flags.adopt_module_key_flags(engine_flags)
FLAGS.set_default("offload_tail_layers", "auto")

RAW_FLAGS = ("num_layers", "layer_gb", "other_gb", "kv_reserve_gb", "link_gbps",
             "layer_compute_ms")


def model_plans(kwargs: dict) -> dict:
  """{preset name, or "measured": plan summary with the scheduler's link fields} for the model."""
  from jaxtier import offload  # pylint: disable=import-outside-toplevel  (JAX loads only now)
  from jaxtier.engine import build  # pylint: disable=import-outside-toplevel
  platform = FLAGS.platform or ("gpu" if FLAGS.all_presets else None)
  names = sorted(offload.PRESETS) if FLAGS.all_presets else [FLAGS.hardware]
  args = EngineArgs(**kwargs)
  out = {}
  for name in names:
    plan = build.plan(args.model, args, platform, hardware_preset=name)
    offload_plan = plan.sizing.offload.plan
    key = plan.planner_preset or name or "measured"
    out[key] = plan.summary() | {
        "scheduler": None if offload_plan is None else offload.scheduler_link_fields(offload_plan)}
    advice = (offload_plan.message() if offload_plan is not None else
              f"no planning needed: offload_tail_layers={plan.sizing.offload.offload_tail_layers}, "
              f"prefetch_depth={plan.sizing.offload.prefetch_depth}")
    print(f"[{key}] {advice}", file=sys.stderr)
    for assumption in plan.assumed:
      print(f"[{key}] assumed {assumption}", file=sys.stderr)
  return out


def raw_plan() -> dict:
  """The planner alone on the raw-number flags (see the module docstring)."""
  from jaxtier import offload  # pylint: disable=import-outside-toplevel  (JAX loads only now)
  missing = [f"--{name}" for name in ("num_layers", "layer_gb", "device_memory_gb", "link_gbps",
                                      "layer_compute_ms") if FLAGS[name].value is None]
  if missing:
    engine_flags.usage_error(f"without --model, raw numbers need {', '.join(missing)}")
  model = offload.ModelBytes(FLAGS.num_layers, round(FLAGS.layer_gb * GB),
                             round(FLAGS.other_gb * GB))
  kwargs = engine_flags.llm_kwargs()
  n, depth = kwargs["offload_tail_layers"], kwargs["prefetch_depth"]
  p = offload.plan(model, device_memory_bytes=round(FLAGS.device_memory_gb * GB),
                   link_bytes_per_s=FLAGS.link_gbps * GB,
                   layer_compute_s=FLAGS.layer_compute_ms * 1e-3,
                   kv_reserve_bytes=round(FLAGS.kv_reserve_gb * GB),
                   offload_tail_layers=None if n == "auto" else n,
                   prefetch_depth=None if depth == "auto" else depth)
  print(f"[given] {p.message()}", file=sys.stderr)
  return {"given": p.to_dict() | {"scheduler": offload.scheduler_link_fields(p)}}


def main(argv):
  if len(argv) > 1:
    engine_flags.usage_error(f"unexpected arguments {argv[1:]}")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  engine_flags.apply_config_defaults()
  raw = FLAGS.num_layers is not None or FLAGS.layer_gb is not None
  if raw and FLAGS["model"].present:
    engine_flags.usage_error("give --model or the raw numbers (--num_layers, --layer_gb), not both")
  if not raw and any(FLAGS[name].value != FLAGS[name].default for name in RAW_FLAGS):
    engine_flags.usage_error(f"--{', --'.join(RAW_FLAGS)} plan raw numbers: give --num_layers "
                             "and --layer_gb with them, and no --model")
  kwargs = engine_flags.llm_kwargs()
  try:
    EngineArgs(**kwargs)
    out = raw_plan() if raw else model_plans(kwargs)
  except ValueError as e:
    engine_flags.usage_error(str(e))
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  app.run(main)
