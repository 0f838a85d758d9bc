"""The programs an engine runs, exported for a platform (`jax.export`) without weights, and what
each asks of that platform, read from its StableHLO.

`export_programs(model, platform, **engine_args)` plans the engine for `platform` (every "auto" of
the engine arguments resolved for it, not for this process's machine: `sizing.detect_machine`
with `platform`), builds the model's state and the paged cache from abstract values with the
shardings and memory kinds loading would give them (`placed.abstract`: the offloaded tail in
pinned host memory; `PagedKVCache.abstract`: the device pool; `swap.host_block_specs`: host
blocks in pinned host memory), and exports
the programs the engine's `Runner` builds (`Runner._build_each`, the same functions and
arguments its warm-up compiles), one representative shape each:

- "decode": ("step", rows, 1, width), the most rows a decode call has: one program
  (`Runner._step`) holds the model call, the plain sampler, a decode call's input tokens taken
  from the previous call's (`follow`) and the sampled tokens' log-probabilities;
- "prefill": ("step", rows, tokens, width), the call of the most token slots, its prompt
  log-probabilities in it;
- "sample_transformed": ("sample_transformed", rows, *widths), the sampler of rows with logit
  transforms (penalties, biases, allowed ids, a structured output's grammar mask), from the
  decode call's logits: at the decode rows and its narrowest widths with a whole-vocabulary
  grammar mask (`LogitsArrays.grammar_widths`, what the warm-up compiles);
- "swap_out", "swap_in": ("swap", direction, x) at one block count x (the prefix cache's host
  tier loads and writes back blocks with the same programs).

A transformed call's log-probabilities ("logprobs", "processed_logprobs") compile on demand, at
widths a request sets, and are not exported.

No tensor is read: the checkpoint gives its config (a registry model is not converted). Each
program's entry holds:

- `ok`, `error`: whether it exported (a failure is recorded, never raised);
- `cpu_custom_calls`: custom calls only a CPU runs (`hlo.cpu_only`: jaxtier's C++ kernels and
  others);
- `host_offload_compute_ops`: operations placed on the host on purpose
  (`compute_on("device_host")`: an offloaded layer's experts computed where they live;
  `hlo.placement_report`'s `host_offload_compute`, listed in `host_offload_compute`);
- `host_compute_ops`: the accidental ones: operations on host-memory values, other than data
  movement, not placed on the host (`hlo.placement_report`'s `host_compute`, listed in
  `host_compute`);
- `h2d_bytes`, `d2h_bytes`: bytes one call moves to and from the device (a swap of x blocks: all
  x of them; a decode step with offloaded layers: every offloaded weight once);
- `pallas_kernels`: Pallas (Triton, Mosaic) custom calls;
- `attention`: the paged attention implementations the program calls (`attention_paths`; see
  `jaxtier.attention`): "pallas" (the GPU kernel), "pallas_tpu" (the TPU kernel),
  "cpu" (the C++ kernels), "xla_gathered" (the accelerators' XLA path), "xla" (the chunked
  loop, CPU's XLA path) or "reference", several joined by "+" (a kernel and the XLA path its
  sliding-window or soft-capped layers take), None for a program without attention;
- `key`: the `Runner` program it is.
"""

import contextlib
import dataclasses
import functools
import re

import jax
from flax import nnx

from jaxtier import checkpoint
from jaxtier.checkpoint import placed
from jaxtier.attention.names import ATTENTION_PATHS
from jaxtier.engine import build, sizing
from jaxtier.engine.args import EngineArgs
from jaxtier.engine.engine import EngineConfig, cache_config, warmup_programs
from jaxtier.engine.runner import Runner
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.kvcache import PagedKVCache
from jaxtier.model import quant, sharding
from jaxtier.offload import placement
from jaxtier.sampling.samplers import LogitsArrays
from jaxtier.tools import hlo

PROGRAMS = ("prefill", "decode", "sample_transformed", "swap_out", "swap_in")
EXPORT_PLATFORMS = ("cuda", "rocm", "tpu", "cpu")  # jax.export's names
SWAP_BLOCKS = 4  # the block count the swaps are exported at (fewer where the pools hold fewer)


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
  """An engine's programs' arguments, abstract: what `Engine` would build for the plan."""
  plan: build.Plan
  runner: Runner
  cache: PagedKVCache
  host_weight_bytes: int  # the state's bytes in a host memory kind
  vocab_size: int

  @property
  def sizing(self) -> sizing.Sizing:
    return self.plan.sizing

  @property
  def engine_config(self) -> EngineConfig:
    return self.plan.engine_config


def abstract_engine(model: str, platform: str, hardware_preset: str | None = None,
                    **engine_args) -> AbstractEngine:
  """The engine `jaxtier.LLM(model, **engine_args)` would build on `platform` (a `jax.export`
  platform name), planned for that platform (`jaxtier.engine.build.plan`), its state and cache
  abstract (see the module docstring). Where the offload planner runs (a prefetch depth or
  offload left "auto"), its link rate and layer time are `hardware_preset`'s (default: the
  platform's preset, `jaxtier.offload.hardware.PLATFORM_PRESETS`; this machine's measurements
  where it is the platform), not measured. Raises ValueError as `LLM` would for arguments the
  platform cannot run."""
  args = EngineArgs(model=model, **engine_args)
  mesh = sharding.make_mesh(args.tensor_parallel_size)
  with build.planned(model, args, platform, mesh=mesh, hardware_preset=hardware_preset) as (
      plan, opened):
    state_abstract = placed.abstract(plan.config, checkpoint.resolve_dtype(plan.sizing.dtype),
                                     plan.layout, opened.source)
  graphdef, state = nnx.split(state_abstract)
  cache = PagedKVCache.abstract(cache_config(plan.config, plan.engine_config), mesh,
                                plan.machine.platform)
  runner = Runner(graphdef, state, cache, portable=plan.sizing.kernels == "portable")
  host = sum(quant.array_bytes(a) for a in jax.tree.leaves(state)
             if a.sharding.memory_kind != placement.DEVICE)
  return AbstractEngine(plan, runner, cache, host, plan.config.vocab_size)


def representative_programs(engine_config, vocab_size: int) -> dict[str, tuple]:
  """{name: `Runner` key} of the programs exported (see the module docstring), from the keys the
  engine's warm-up compiles (`warmup_programs`), and the transformed sampler for a vocabulary of
  `vocab_size`."""
  keys = warmup_programs(engine_config, vocab_size)
  steps = [k for k in keys if k[0] == "step"]
  decode = max((k for k in steps if k[2] == 1), key=lambda k: k[1])
  prefill = max((k for k in steps if k[2] > 1), key=lambda k: (k[1] * k[2], k[2]))
  swaps = sorted({k[2] for k in keys if k[0] == "swap"})
  out = {"decode": decode, "prefill": prefill,
         "sample_transformed": ("sample_transformed", decode[1])
                               + LogitsArrays.grammar_widths(vocab_size)}
  if swaps:
    x = max(s for s in swaps if s <= SWAP_BLOCKS) if swaps[0] <= SWAP_BLOCKS else swaps[0]
    out.update(swap_out=("swap", "out", x), swap_in=("swap", "in", x))
  return out


# jaxtier's CPU kernels and Pallas' Triton calls carry no compatibility guarantee, which
# `jax.export` refuses by default: exported anyway, so that a program calling them is counted
# (`cpu_custom_calls`, `pallas_kernels`), not lost.
_UNCHECKED = tuple(jax.export.DisabledSafetyCheck.custom_call(t)
                   for t in cpu_kernels.TARGETS + hlo.KERNEL_TARGETS)

# How each attention implementation shows in a program: a kernel by its custom-call targets...
ATTENTION_TARGETS = {
    "pallas": tuple(t for t in hlo.KERNEL_TARGETS if t != "tpu_custom_call"),
    "pallas_tpu": ("tpu_custom_call",),
    "cpu": (cpu_kernels.ATTENTION_TARGET, cpu_kernels.PREFILL_ATTENTION_TARGET,
            cpu_kernels.WRITE_ATTENTION_TARGET)}
# ... an XLA path by its jitted function (`jaxtier.attention`; a function name
# repeated takes a suffix "_<n>"). JAX's TPU kernel is a function "paged_attention" too: the
# chunked loop's is the one with a loop.
ATTENTION_FUNCTIONS = {"xla_gathered": "paged_attention_gathered",
                       "reference": "paged_attention_reference", "xla": "paged_attention"}
_FUNCTION = re.compile(r"^\s*func\.func (?:public |private )?@([\w$.-]+)", re.MULTILINE)

# Programs exported together: a program after the ones whose outputs it takes (`_build_each`:
# the transformed sampler takes the decode call's logits).
_GROUPS = (("decode", "sample_transformed"), ("prefill",), ("swap_out",), ("swap_in",))


def attention_paths(mlir_text: str, targets: dict[str, int] | None = None) -> str | None:
  """The paged attention implementations a module calls (ATTENTION_PATHS' names, in that order,
  joined by "+"), or None where it calls none; `targets`: its `hlo.custom_call_targets`, where
  already counted."""
  targets = hlo.custom_call_targets(mlir_text) if targets is None else targets
  found = {path for path, names in ATTENTION_TARGETS.items() if any(targets.get(t) for t in names)}
  starts = list(_FUNCTION.finditer(mlir_text)) + [None]
  for match, end in zip(starts, starts[1:]):
    body = mlir_text[match.end():end.start() if end else len(mlir_text)]
    name = re.sub(r"_\d+$", "", match.group(1))
    for path, function in ATTENTION_FUNCTIONS.items():
      if name == function and (path != "xla" or "stablehlo.while" in body):
        found.add(path)
  return "+".join(p for p in ATTENTION_PATHS if p in found) or None


def program_facts(mlir_text: str, unknown_trips: int | None = None) -> dict:
  """What an exported program asks of its platform (see the module docstring); a loop of unknown
  trip count runs `unknown_trips` times."""
  report = hlo.placement_report(mlir_text)
  targets = hlo.custom_call_targets(mlir_text)
  return {"cpu_custom_calls": sum(n for t, n in targets.items() if hlo.cpu_only(t)),
          "host_compute_ops": len(report.host_compute),
          "host_offload_compute_ops": len(report.host_offload_compute),
          "h2d_bytes": report.transfer_bytes(True, unknown_trips),
          "d2h_bytes": report.transfer_bytes(False, unknown_trips),
          "pallas_kernels": sum(n for t, n in targets.items() if hlo.is_kernel(t)),
          "attention": attention_paths(mlir_text, targets),
          "host_compute": list(report.host_compute),
          "host_offload_compute": list(report.host_offload_compute)}


def _message(e: Exception, most: int = 2000) -> str:
  """An error's type and message, cut to `most` characters (an export error quotes whole ops)."""
  text = f"{type(e).__name__}: {e}"
  return text if len(text) <= most else text[:most] + " ..."


def _failed(key: tuple, error: str) -> dict:
  return {"ok": False, "error": error, "cpu_custom_calls": None, "host_compute_ops": None,
          "host_offload_compute_ops": None, "h2d_bytes": None, "d2h_bytes": None,
          "pallas_kernels": None, "attention": None, "host_compute": None,
          "host_offload_compute": None, "key": list(key)}


def export_engine_programs(engine: AbstractEngine, platform: str,
                           texts: dict[str, str] | None = None) -> dict[str, dict]:
  """{name: facts} of the representative programs of `engine` exported for `platform`; `texts`,
  where given, receives each exported program's StableHLO text by name."""
  if platform not in EXPORT_PLATFORMS:
    raise ValueError(f"platform={platform!r}: expected one of {EXPORT_PLATFORMS}")
  wanted = representative_programs(engine.engine_config, engine.vocab_size)
  names = {key: name for name, key in wanted.items()}
  results: dict[str, dict] = {}

  def build(key, jitted, args, static):
    name = names[key]
    try:
      exported = jax.export.export(jitted, platforms=[platform],
                                   disabled_checks=_UNCHECKED)(*args, **static)
      module = exported.mlir_module()
      results[name] = {"ok": True, "error": None, **program_facts(module), "key": list(key)}
      if texts is not None:
        texts[name] = module
      return jax.tree.unflatten(exported.out_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype)
                                                    for a in exported.out_avals])
    except Exception as e:  # pylint: disable=broad-except  (recorded: the others still export)
      results[name] = _failed(key, _message(e))
      # the outputs a later program of the group takes, if tracing alone works
      return jax.eval_shape(functools.partial(jitted, **static), *args)

  every = (contextlib.nullcontext() if platform == "cpu"
           else cpu_kernels.traced_for_every_platform())
  with every:
    for group in _GROUPS:
      keys = [wanted[name] for name in group if name in wanted]
      try:
        engine.runner._build_each(engine.cache, keys, build)  # pylint: disable=protected-access
      except Exception as e:  # pylint: disable=broad-except
        for key in keys:
          if names[key] not in results:
            results[names[key]] = _failed(key, "not exported: a program it takes outputs from "
                                          f"could not be traced ({_message(e)})")
  return {name: results[name] for name in PROGRAMS if name in results}


def export_programs(model: str, platform: str = "cuda", hardware_preset: str | None = None,
                    **engine_args) -> dict:
  """The engine of `jaxtier.LLM(model, **engine_args)` planned for `platform` ("cuda", "tpu",
  ...) and its programs exported for it: {"platform", "model", "host_weight_bytes", "plan"
  (`jaxtier.engine.build.Plan.memory_plan`, what `--dry_run --platform` prints), "planner_preset"
  (the preset the offload planner ran with, or None where it did not run or measured this
  machine), "programs": {name: facts}} (see the module docstring)."""
  if platform not in EXPORT_PLATFORMS:
    raise ValueError(f"platform={platform!r}: expected one of {EXPORT_PLATFORMS}")
  engine = abstract_engine(model, platform, hardware_preset, **engine_args)
  return {"platform": platform, "model": model, "host_weight_bytes": engine.host_weight_bytes,
          "plan": engine.plan.memory_plan(), "planner_preset": engine.plan.planner_preset,
          "programs": export_engine_programs(engine, platform)}
