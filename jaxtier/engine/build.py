"""One road from the engine arguments to an engine's plan, for `jaxtier.LLM`, the dry run, the
program export and `scripts/plan_offload.py` alike.

    p = plan("smollm2-135m-instruct", EngineArgs(offload_tail_layers=10), platform="cuda")
    p.memory_plan()   # what --dry_run prints; p.sizing, p.layout, p.engine_config

`plan` reads a checkpoint's metadata, never a tensor (a directory holding only a Hugging Face
`config.json` plans too), and decides everything in order: the machine's `Settings`
(`sizing.resolve`: dtypes, kernels, layer execution, kept blocks), the weight bytes as the loader
will hold them (`placed.resident_bytes` where layers keep blocks, which are smaller than their
floats), the `Sizing` (both KV pools, the offloaded tail and experts, the step budgets), then the
`placed.Layout` the loader builds and the `EngineConfig` the engine runs. `jaxtier.LLM` calls
`plan_checkpoint` with the checkpoint it then loads, so it reads the metadata once.

The offload planner, where it runs, times the link and a layer: measured on this machine, or for
another platform (or with `hardware_preset`) taken from a hardware preset
(`jaxtier.offload.hardware`). A plan for another platform measures nothing of this machine: a
device memory not given is the platform preset's, and what was assumed is listed in
`Plan.assumed` (and the dry run's JSON).
"""

import contextlib
import dataclasses
from collections.abc import Iterator

from jaxtier import checkpoint
from jaxtier.checkpoint import placed, prequantized
from jaxtier.checkpoint.params import ArraySource, params_from_model
from jaxtier.checkpoint.quantized import QuantizedSource, block_format
from jaxtier.engine import pinned_cap, sizing
from jaxtier.engine.args import GB, EngineArgs
from jaxtier.engine.engine import EngineConfig
from jaxtier.model.config import ModelConfig
from jaxtier.model.transformer import Transformer
from jaxtier.offload import expert_cost, hardware, measure
from jaxtier.offload.planner import ModelBytes
from jaxtier.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Plan:
  """An engine decided before any weight is read.

  `model`: the checkpoint it plans; `machine`: what it plans for; `settings`: the machine's
  resolved choices; `sizing`: pools, offload, experts, budgets and weight bytes; `layout`: how the
  loader arranges and places the model (its `mesh` is the caller's: None in a dry run);
  `engine_config`: the engine's sizes and policies; `planner_preset`: the hardware preset the
  offload planner's timing came from (None where it measured this machine or did not run);
  `assumed`: what a plan for another machine took without being told (each a sentence).
  """
  model: str
  args: EngineArgs
  machine: sizing.Machine
  config: ModelConfig
  settings: sizing.Settings
  sizing: sizing.Sizing
  layout: placed.Layout
  engine_config: EngineConfig
  planner_preset: str | None = None
  assumed: tuple[str, ...] = ()
  checkpoint_quantization: str | None = None  # a pre-quantized checkpoint's scheme

  def memory_plan(self) -> dict:
    """The plan in `jaxtier.LLM.memory_report()`'s keys, with the resolved dtypes, layer
    execution and pool sizes (`sizing.Sizing.memory_plan`) and what was assumed: what
    `--dry_run` prints."""
    return {**self.sizing.memory_plan(), **disk_figures(self.args),
            "checkpoint_quantization": self.checkpoint_quantization,
            "assumed": list(self.assumed)}

  def summary(self) -> dict:
    """Everything the plan decided, as plain data (no mesh): the memory plan, the layout, the
    engine configuration, the offload planner's plan and the machine. Two tools that plan the
    same arguments for the same machine give equal summaries."""
    layout = {f.name: getattr(self.layout, f.name) for f in dataclasses.fields(self.layout)
              if f.name != "mesh"}
    offload = self.sizing.offload.plan
    return {"model": self.model, "machine": dataclasses.asdict(self.machine),
            "settings": dataclasses.asdict(self.settings), "memory": self.memory_plan(),
            "layout": layout, "engine": dataclasses.asdict(self.engine_config),
            "offload_plan": None if offload is None else offload.to_dict(),
            "planner_preset": self.planner_preset}


def disk_figures(args: EngineArgs) -> dict:
  """The disk tier's directory and budget, in `memory_report()`'s keys (None and 0: off)."""
  on = args.kv_disk_path is not None
  return {"kv_disk_path": args.kv_disk_path,
          "kv_disk_budget_bytes": int(args.kv_disk_gb * GB) if on else 0}


def open_checkpoint(model: str, args: EngineArgs, machine: sizing.Machine,
                    metadata_only: bool = False) -> checkpoint.Opened:
  """The checkpoint opened as the engine on `machine` reads it: a GGUF file itself where its
  blocks are kept (`sizing.Settings.keep_quantized`), and with `quantization` quantized
  (`quantized_source`). `metadata_only`: for planning
  (`checkpoint.open_metadata`: no conversion of a registry model, and a directory holding only a
  config.json opens)."""
  settings = sizing.resolve(args, machine)
  keep = settings.keep_quantized
  opened = (checkpoint.open_metadata(model, keep_quantized=keep) if metadata_only
            else checkpoint.open_checkpoint(model, keep_quantized=keep))
  try:
    opened.source = quantized_source(opened.source, opened.config, args, settings)
  except BaseException:
    opened.close()
    raise
  return opened


def open_model(model: Transformer, tokenizer: Tokenizer, args: EngineArgs,
               machine: sizing.Machine) -> checkpoint.Opened:
  """An in-memory model (a `Transformer`'s parameters, as a trainer holds them) opened as a
  checkpoint, for the engine on `machine` to place as it places one read from files
  (`checkpoint.params.ArraySource`: arrays already where they go are used as they are)."""
  if not isinstance(model, Transformer):
    raise ValueError(f"model: expected a registry name, a path or a jaxtier.model.Transformer, "
                     f"got {type(model).__name__}")
  if not isinstance(tokenizer, Tokenizer):
    raise ValueError("tokenizer: an in-memory model needs its jaxtier.text.tokenizer.Tokenizer "
                     f"(jaxtier.checkpoint.load_model returns one), got {type(tokenizer).__name__}")
  source = ArraySource(params_from_model(model), args.model)
  return checkpoint.Opened("model", args.model, model.config, tokenizer, quantized_source(
      source, model.config, args, sizing.resolve(args, machine)))


def quantized_source(source, config: ModelConfig, args: EngineArgs, settings: sizing.Settings):
  """`source`, with `quantization`, its float projections presented quantized in the format of
  the path that multiplies them (`checkpoint.quantized.QuantizedSource`: CPU blocks, or the
  portable layouts, whose tables stay bfloat16)."""
  if args.quantization is None:
    return source
  return QuantizedSource(source, block_format(args.quantization, settings.portable),
                         args.quantization_group_size, head=not settings.portable, config=config)


def layout_of(s: sizing.Sizing, num_layers: int, mesh) -> placed.Layout:
  """How a model sized `s` is arranged and placed (`placed.build`, `placed.abstract`): an
  offloaded tail fetched `prefetch_depth` layers ahead, an experts group with the tail's depth
  (one layer ahead without a tail)."""
  depth = s.offload.prefetch_depth or (1 if s.experts.layers else None)
  return placed.Layout.of(num_layers, s.offload.offload_tail_layers, depth,
                          s.layer_execution, mesh, keep_quantized=s.keep_quantized,
                          block_activations=s.block_activations, portable=s.kernels == "portable",
                          expert_layers=s.experts.layers,
                          expert_stream_from_tokens=s.experts.stream_from_tokens,
                          table_dtype=s.table_dtype, platform=s.platform)


def engine_config_of(args: EngineArgs, s: sizing.Sizing) -> EngineConfig:
  """The engine's sizes and policies: the sizing's resolved values and the arguments' policies."""
  return EngineConfig(
      max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
      max_num_batched_tokens=s.max_num_batched_tokens, block_size=s.block_size,
      num_device_blocks=s.num_device_blocks, num_host_blocks=s.num_host_blocks,
      kv_cache_dtype=s.kv_cache_dtype, preemption_mode=args.preemption_mode,
      watermark=args.watermark, victim_policy=args.victim_policy,
      enable_prefix_caching=args.enable_prefix_caching,
      host_prefix_caching=args.host_prefix_caching, trace_path=args.trace_path,
      attention_impl=s.attention_impl, kernels=s.kernels,
      async_scheduling=args.async_scheduling, kv_disk_path=args.kv_disk_path,
      kv_disk_gb=args.kv_disk_gb)


def machine_for(args: EngineArgs, platform: str | None = None,
                hardware_preset: str | None = None
                ) -> tuple[sizing.Machine, str | None, tuple[str, ...]]:
  """(the machine to plan for, the hardware preset standing for it or None, what was assumed).

  This process's machine (`sizing.detect_machine`; `hardware_preset`, where given, still times
  the planner), or for another `platform` that preset, else the platform's
  (`hardware.PLATFORM_PRESETS`): its device memory where `device_memory_gb` is not given, said in
  the assumptions, as is a host memory not given (pinned memory then unbounded)."""
  machine = sizing.detect_machine(args, platform)
  if platform is None or machine.platform == sizing.local_platform():
    return machine, hardware_preset, ()
  preset_name = hardware_preset or hardware.PLATFORM_PRESETS.get(machine.platform)
  assumed = []
  if args.device_memory_gb is None and preset_name is not None:
    memory = hardware.preset(preset_name).device_memory_bytes
    machine = dataclasses.replace(machine, device_memory_bytes=memory)
    assumed.append(f"device_memory_gb={memory / GB:.1f}, the {preset_name} preset's (give "
                   "device_memory_gb for another device)")
  if args.device_memory_gb is None and preset_name is None:
    assumed.append("device memory unknown: the device KV pool takes the CPU default rule (give "
                   "device_memory_gb)")
  if args.host_memory_gb is None:
    assumed.append("host memory unknown: pinned memory is not bounded by it (give "
                   "host_memory_gb)")
  return machine, preset_name, tuple(assumed)


def _weights(config: ModelConfig, source, settings: sizing.Settings, tensor_parallel_size: int
             ) -> tuple[ModelBytes, ModelBytes] | None:
  """(one device's, all devices') weight bytes as the loader holds them where layers keep blocks
  (smaller than their floats; counted from the abstract modules, nothing read); None where they
  are floats."""
  if not settings.keep_quantized:
    return None
  layout = placed.Layout.of(config.num_layers, layer_execution=settings.layer_execution,
                            keep_quantized=True, block_activations=settings.block_activations,
                            portable=settings.portable, table_dtype=settings.table_dtype,
                            platform=settings.platform)
  dtype = checkpoint.resolve_dtype(settings.dtype)
  out = []
  for tp in dict.fromkeys((tensor_parallel_size, 1)):
    layers, other, offloaded = placed.resident_bytes(config, source, dtype, layout, tp)
    floats = ModelBytes.from_config(config, settings.dtype, settings.kv_cache_dtype,
                                    tensor_parallel_size=tp)
    out.append(dataclasses.replace(
        floats, resident_layer_bytes=tuple(layers), other_bytes=other, layer_bytes=offloaded,
        expert_layer_bytes=placed.expert_layer_bytes(config, source, dtype, layout, tp)))
  return out[0], out[-1]


def _timing(config: ModelConfig, settings: sizing.Settings, preset_name: str | None
            ) -> sizing.Timing:
  """The offload planner's (batch, context) -> (link bytes/s, one layer's decode seconds): from
  the preset, else measured here (on a layer of random weights), only when the planner runs."""
  if preset_name is not None:
    return hardware.preset_timing(preset_name, ModelBytes.from_config(
        config, settings.dtype, settings.kv_cache_dtype))
  return lambda batch, context: (measure.link_bytes_per_s(), measure.layer_compute_s(
      config, settings.dtype, batch, 1, context))


def _expert_rates(args: EngineArgs, machine: sizing.Machine, preset_name: str | None
                  ) -> expert_cost.ExpertRates | None:
  """The expert cost model's rates: the preset's; on this machine's accelerator with the
  experts' mode left to the cost model, its measured link and its platform preset's host
  figures; else None (`sizing.size`'s default, the platform preset's)."""
  if preset_name is not None:
    return expert_cost.rates_of(hardware.preset(preset_name))
  if (args.offload_expert_layers and args.expert_offload_mode == "auto"
      and machine.platform != "cpu"):
    return dataclasses.replace(
        expert_cost.rates_of(hardware.preset(hardware.PLATFORM_PRESETS[machine.platform])),
        link_bytes_per_s=measure.link_bytes_per_s())
  return None


def plan_checkpoint(model: str, opened: checkpoint.Opened, args: EngineArgs,
                    machine: sizing.Machine, *, mesh=None, hardware_preset: str | None = None,
                    assumed: tuple[str, ...] = ()) -> Plan:
  """The plan of `args` for the opened checkpoint `opened` on `machine` (see the module
  docstring); `opened` is left open. `hardware_preset`: the offload planner's and the expert
  cost model's figures come from this preset instead of this machine. Raises ValueError for
  arguments the model or the machine cannot run."""
  settings = sizing.resolve(args, machine)
  config = opened.config
  # this process's JAX has started on its own platform; the process that runs a plan for
  # another one has not yet, so jaxtier may still raise the cap there
  cap = pinned_cap.cap_for(args, machine.platform, machine.host_memory_bytes,
                           started=machine.platform == sizing.local_platform())
  weights, whole = _weights(config, opened.source, settings,
                           args.tensor_parallel_size) or (None, None)
  s = sizing.size(args, config, machine, weights=weights, whole_weights=whole,
                  timing=_timing(config, settings, hardware_preset),
                  expert_rates=_expert_rates(args, machine, hardware_preset), settings=settings,
                  cap=cap)
  planned = s.offload.plan is not None
  scheme = getattr(opened.source, "scheme", None)  # `checkpoint.prequantized.Scheme`
  if opened.kind == "config" and prequantized.read_scheme(opened.path) is not None:
    # a config alone gives no packed tensors to count: the plan is the float model's
    assumed = tuple(assumed) + (
        "weights as floats: the config names a quantized checkpoint but its tensors (whose "
        "shapes say the compact bytes) are not in the directory",)
  return Plan(model, args, machine, config, settings, s, layout_of(s, config.num_layers, mesh),
              engine_config_of(args, s), hardware_preset if planned else None, assumed,
              None if scheme is None else scheme.name)


@contextlib.contextmanager
def planned(model: str, args: EngineArgs | None = None, platform: str | None = None, *,
            mesh=None, hardware_preset: str | None = None
            ) -> Iterator[tuple[Plan, checkpoint.Opened]]:
  """`plan`, with the checkpoint's metadata open for the caller while the context lasts (the
  program export builds abstract state from its source); `mesh`: the layout's."""
  args = args if args is not None else EngineArgs(model=model)
  machine, preset_name, assumed = machine_for(args, platform, hardware_preset)
  with open_checkpoint(model, args, machine, metadata_only=True) as opened:
    yield plan_checkpoint(model, opened, args, machine, mesh=mesh, hardware_preset=preset_name,
                          assumed=assumed), opened


def plan(model: str, args: EngineArgs | None = None, platform: str | None = None, *,
         hardware_preset: str | None = None) -> Plan:
  """The plan `jaxtier.LLM(model, **args)` would run, made from the checkpoint's metadata alone
  (see the module docstring). `args` (default `EngineArgs(model=model)`) gives the engine
  arguments; `platform` ("cpu", "gpu", "tpu", "cuda", "rocm"): plan for that platform instead of
  this machine; `hardware_preset`: the offload planner's figures (and for another platform, a
  device memory not given) from this preset (default: the platform's preset for another
  platform, else measured here)."""
  with planned(model, args, platform, hardware_preset=hardware_preset) as (result, _):
    return result
