"""Runs tensor-parallel cases in a process of 8 CPU devices and prints one JSON line of results.

`tests/test_tensor_parallel.py` and `tests/test_smollm.py` start it in a subprocess (the rest of
the suite stays single-device): `python tests/multidevice_worker.py MODEL TP [CASE ...]` (env: MULTIDEVICE_MAX_TOKENS,
MULTIDEVICE_LAYER_EXECUTION for every case's layer_execution). Each case
runs the same prompts at tensor-parallel size 1 and TP on an 8-device process and reports the
greedy tokens of both, the engine's swap and preemption counts, where the parameters and pools
live, the collectives of the compiled decode step and, for offloaded cases, the host -> device bytes
per device of the decode step exported for CUDA.
"""

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position

from jaxtier import offload  # pylint: disable=wrong-import-position
import jaxtier  # pylint: disable=wrong-import-position
from jaxtier.engine.step_inputs import GREEDY, StepArrays  # pylint: disable=wrong-import-position
from jaxtier.sampling.samplers import SamplingArrays  # pylint: disable=wrong-import-position
from jaxtier.tools import hlo  # pylint: disable=wrong-import-position

PROMPTS = ["The capital of France is", "Write a short poem about the sea.\n",
           "1, 2, 3, 4, 5,", "def fibonacci(n):"]
# case name -> engine arguments beside tensor_parallel_size
CASES = {
    "plain": {},
    "scan": dict(layer_execution="scan"),
    "offload": dict(offload_tail_layers="half"),
    # a device pool of one max_model_len sequence and a block: a quarter of the four prompts' peak
    "pressure": dict(max_model_len=64, num_device_blocks=5, preemption_mode="swap"),
}


def _spec(array) -> list:
  return [None if a is None else str(a) for a in tuple(array.sharding.spec)]


def _host_block(host) -> dict:
  """Where the host tier's stored blocks live (None before any swap-out)."""
  stored = [block for block in host.slots if block is not None]
  if not stored:
    return {"host_block_spec": None, "host_block_kind": None}
  return {"host_block_spec": [list(t) for t in sorted({tuple(_spec(b.k)) for b in stored})],
          "host_block_kind": sorted({b.k.sharding.memory_kind for b in stored})}


def _decode_args(llm: jaxtier.LLM) -> tuple:
  """The engine's decode step program (`Runner._step`, its sampling in it) and its arguments at
  batch 2, one token, as `Runner._build_each` makes them."""
  engine, runner = llm.engine, llm.engine.runner
  tokens, last = np.zeros((2, 1), np.int32), np.zeros(2, np.int32)
  sampling = SamplingArrays.from_params([GREEDY] * 2, [0] * 2, [0] * 2)
  arrays = StepArrays((), (), tokens, tokens, np.zeros((2, 8), np.int32), last, sampling)
  return runner._step, runner.step_args(engine.cache, arrays)  # pylint: disable=protected-access


def _collectives(llm: jaxtier.LLM) -> dict[str, int]:
  """Collective ops in the compiled decode step (batch 2, one token) after partitioning."""
  step, args = _decode_args(llm)
  text = step.lower(*args).compile().as_text()
  kinds = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
  return {k: len(re.findall(rf"= \S+ {k}(?:-start)?\(", text)) for k in kinds}


def _exported_transfers(llm: jaxtier.LLM) -> dict[str, int]:
  step, args = _decode_args(llm)
  report = hlo.placement_report(hlo.exported_text(step, *args, platform="cuda"))
  return {"per_call": report.to_device_bytes_per_call(),
          "per_device": report.to_device_bytes_per_device(),
          "host_compute": len(report.host_compute)}


def run_case(model: str, tp: int, name: str, max_tokens: int) -> dict:
  kwargs = dict(CASES[name])
  base = dict(max_model_len=256, max_num_seqs=4)
  if os.environ.get("MULTIDEVICE_LAYER_EXECUTION"):
    base["layer_execution"] = os.environ["MULTIDEVICE_LAYER_EXECUTION"]
  probe = jaxtier.checkpoint.open_checkpoint(model)
  config = probe.config
  probe.close()
  if kwargs.get("offload_tail_layers") == "half":
    kwargs["offload_tail_layers"] = min(10, config.num_layers - 1)
  out = {}
  for size in (1, tp):
    llm = jaxtier.LLM(model, tensor_parallel_size=size, **(base | kwargs))
    results = llm.generate(PROMPTS, jaxtier.SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0, ignore_eos=True))
    stats = llm.stats()
    row = {"tokens": [list(r.token_ids) for r in results],
           "swap_out_count": stats["swap_out_count"], "swap_in_count": stats["swap_in_count"],
           "preemptions": stats["preemptions"],
           "device_blocks_free": stats["device_blocks_free"],
           "device_blocks_total": stats["device_blocks_total"]}
    if size > 1:
      leaves = {"/".join(map(str, path)): v[...] for path, v in
                nnx.to_flat_state(llm.state)}
      q = next(a for p, a in leaves.items() if p.endswith(("q_proj/kernel", "q_proj/values")))
      embed = next(a for p, a in leaves.items() if p.endswith("embedding"))
      row |= {
          "q_proj_spec": _spec(q), "embedding_spec": _spec(embed),
          "device_pool_spec": _spec(llm.engine.cache.device.k),
          **_host_block(llm.engine.host),
          "device_pool_devices": len(llm.engine.cache.device.k.sharding.device_set),
          "weight_bytes": offload.bytes_by_memory_kind(llm.state),
          "weight_bytes_per_device": offload.bytes_per_device(llm.state),
          "collectives": _collectives(llm), "num_layers": config.num_layers,
          "layer_execution": llm.layer_execution,
          "offload_tail_layers": llm.offload.offload_tail_layers,
          "memory_report": llm.memory_report(),
      }
      if llm.offload.offload_tail_layers:
        row["transfers"] = _exported_transfers(llm)
        row["tail_kinds"] = sorted({a.sharding.memory_kind for p, a in leaves.items()
                                    if p.startswith("groups/1/")})
        row["tail_specs"] = sorted({str(_spec(a)) for p, a in leaves.items()
                                    if p.startswith("groups/1/")})
    out[f"tp{size}"] = row
    del llm
  return out


def main(argv: list[str]) -> None:
  model, tp = argv[1], int(argv[2])
  names = argv[3:] or list(CASES)
  max_tokens = int(os.environ.get("MULTIDEVICE_MAX_TOKENS", "24"))
  print(json.dumps({name: run_case(model, tp, name, max_tokens) for name in names}))


if __name__ == "__main__":
  main(sys.argv)
