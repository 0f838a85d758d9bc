"""Exports the programs an engine runs for a GPU or TPU, without weights or the device, and prints
what each asks of that platform, read from its StableHLO, as one JSON object.

The engine flags are `scripts/batch_infer.py`'s (`jaxtier.engine.flags`); every "auto" is resolved
for `--platform` (default cuda; bfloat16, the portable kernels, scanned layers), not for this
machine. The
model's state and KV cache are abstract, with the shardings and memory kinds loading would give
them (the offloaded tail and the host KV pool in pinned host memory); only the checkpoint's
config is read. For the prefill step and the decode step (each with its sampling and
log-probabilities), the transformed sampler and both swaps (one representative shape each), the
object holds `ok` / `error`, `cpu_custom_calls` (calls only a CPU runs), `host_compute_ops`
(ops on host-memory values other than data movement), `h2d_bytes` / `d2h_bytes` (bytes one call
moves to / from the device) and `pallas_kernels` (see `jaxtier.tools.export`). A program that
fails to export is reported with ok=false; the script still exits 0 (1 with --strict).

  python scripts/export_programs.py --platform=cuda --offload_tail_layers=10 --json=cuda.json
  python scripts/export_programs.py --platform=tpu --model=tests/fixtures/tiny_llama
"""

import json
import os
import sys

from absl import app, flags, logging

from jaxtier.engine import flags as engine_flags
from jaxtier.engine.args import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("json", None, "also write the JSON object to this file")
flags.DEFINE_string("hardware", None, "the offload planner's link rate and layer time, where it "
                    "runs (offload or prefetch depth left 'auto'): a preset of "
                    "jaxtier.offload.hardware; default: the platform's (h100-80gb-pcie4 for cuda "
                    "and tpu)")
flags.DEFINE_bool("strict", False, "exit 1 when a program fails to export")
flags.adopt_module_key_flags(engine_flags)


def main(argv):
  if len(argv) > 1:
    engine_flags.usage_error(f"unexpected arguments {argv[1:]}")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  engine_flags.apply_config_defaults()
  kwargs = engine_flags.llm_kwargs()
  try:
    EngineArgs(**kwargs)
  except ValueError as e:
    engine_flags.usage_error(str(e))
  if FLAGS.dry_run:
    engine_flags.usage_error("--dry_run plans for this machine; this script plans for --platform "
                             "and prints the plan it used under \"plan\"")
  # Nothing runs here: the programs are only traced and exported, on this process's CPU.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from jaxtier.tools import export  # pylint: disable=import-outside-toplevel  (imports JAX)
  try:
    # --platform is the engine flags' (--dry_run plans for it too); "gpu" exports for CUDA
    platform = {None: "cuda", "gpu": "cuda"}.get(FLAGS.platform, FLAGS.platform)
    result = export.export_programs(platform=platform, hardware_preset=FLAGS.hardware,
                                    **kwargs)
  except ValueError as e:
    engine_flags.usage_error(str(e))
  text = json.dumps(result)
  if FLAGS.json:
    with open(FLAGS.json, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  print(text, flush=True)
  failed = [name for name, facts in result["programs"].items() if not facts["ok"]]
  if failed:
    print(f"{os.path.basename(sys.argv[0])}: not exported: {', '.join(failed)}", file=sys.stderr)
  return 1 if failed and FLAGS.strict else 0


if __name__ == "__main__":
  app.run(main)
