"""Sizing: from the engine arguments, the model's config and the machine to the resolved engine.

`size` is pure: no arrays, no weights, no device queries. It takes `EngineArgs`, the model's
`ModelConfig`, a `Machine` (what the devices and the host hold, measured by `detect_machine` or
given for another machine) and, when the planner must run, the measured link rate and layer time;
it returns a `Sizing`: dtype, layer execution, the blocks of both KV pools, the offloaded layers and
prefetch depth, the step budgets. `resolve` decides, before any model is read, what the loader must
know to open the checkpoint (`Settings`: dtypes, kernels, layer execution, kept blocks). Every
default the arguments leave open is decided here, once; `jaxtier.engine.build.plan` turns a
`Sizing` into the engine's layout and configuration, for `jaxtier.LLM`, the dry run, the export
and the planner script alike.

The KV pools (vLLM's names and meaning):
- device pool: `num_device_blocks`, or `kv_cache_memory_gb`; default: the device memory left after
  the resident weights and an activation reserve (times `gpu_memory_utilization`), or where the
  backend reports no memory (CPU), `cpu_default_pool_blocks`.
- host pool (pinned host memory for swapped-out and host-cached prefix blocks): `num_host_blocks`,
  or `swap_space_gb`; default: as many blocks as the device pool, so every running request can be
  swapped out once, but at most `HOST_PIN_FRACTION` of the host's memory less the offloaded
  weights (which are pinned too); on CPU with the default device pool, `CPU_DEFAULT_HOST_FRACTION`
  of it (both pools are the same RAM there). A pool asked for that does not fit the host is an
  error here, before anything is allocated.

Offload (`offload_tail_layers`, `prefetch_depth`): "auto" runs the planner
(`jaxtier.offload.planner`) against the pool the engine will allocate: the explicit pool when one
is given, else the smallest that can run (one max_model_len sequence), since the default pool takes
whatever memory the weights leave. With no known device memory, "auto" offloads nothing. On CPU
`prefetch_depth="auto"` is 1: there is no copy engine to overlap with, so a deeper queue only holds
more layer copies.

Expert offload (`offload_expert_layers`, `expert_offload_mode`): the routed experts of the last N
mixture-of-experts layers (-1: all) live in pinned host memory; layers of the offloaded tail among
them move whole, so the experts group is the N - offload_tail_layers layers before the tail. A call
of n tokens streams them from `expert_stream_from_tokens` tokens on and computes them on the host
below (`jaxtier.offload.experts`): "auto" takes the switch point from the cost model
(`jaxtier.offload.expert_cost`) at the link and host rates (measured link and the platform's preset
host figures, or the preset's for another platform); on CPU, where host and device are one memory,
"auto" computes on the host exactly where the host's gathered form applies (n * k at most the
expert count: only routed experts are read) and streams above it, where the host's form would run
every expert. Tensor parallelism streams (host compute runs on one device).
"""

import dataclasses
from typing import Callable

from jaxtier.common.buckets import pow2_bucket
from jaxtier.common.checks import check_offload
from jaxtier.common.choices import DTYPE_BYTES, PLATFORM_ALIASES, PLATFORMS
from jaxtier.common.kv_bytes import kv_block_bytes
from jaxtier.engine import pinned_cap
from jaxtier.engine.pinned_cap import PinnedCap, host_memory, host_memory_bytes
from jaxtier.engine.args import (CPU_DEFAULT_HOST_FRACTION, CPU_DEFAULT_KV_GB,
                                 CPU_DEFAULT_REQUEST_TOKENS, GB, HOST_PIN_FRACTION, EngineArgs)
from jaxtier.model import sharding
from jaxtier.model.config import ModelConfig
from jaxtier.offload import expert_cost
from jaxtier.offload.planner import ModelBytes, OffloadPlan, plan
from jaxtier.scheduler.allocator import blocks_for


# (batch, context) -> (link bytes/s, seconds of one layer's decode step): measured on demand.
Timing = Callable[[int, int], tuple[float, float]]


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the engine may use. `device_memory_bytes` is one device's (None: the backend reports
  none, as on CPU); `host_memory_bytes` the host's RAM (None: unknown, no bound).
  `cpu_kernels`: the C++ kernels are built (CPU only); `integer_dots`: they multiply int16 in
  vector instructions."""
  platform: str
  num_devices: int = 1
  device_memory_bytes: int | None = None
  host_memory_bytes: int | None = None
  cpu_kernels: bool = False
  integer_dots: bool = False

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(f"platform={self.platform!r}: expected one of {PLATFORMS}")


@dataclasses.dataclass(frozen=True)
class Settings:
  """The engine arguments' platform-dependent choices resolved for a machine, before any model is
  read (`resolve`): what the loader must know to open the checkpoint and lay the model out."""
  platform: str  # `Machine.platform`
  dtype: str  # the parameters' and activations' ("float32" or "bfloat16")
  kv_cache_dtype: str
  kernels: str  # "auto" or "portable"
  layer_execution: str  # "scan" or "unrolled"
  keep_quantized: bool  # layers may keep a GGUF file's blocks (or `quantization`'s)
  block_activations: str  # how kept blocks multiply: "float32" or "int16"
  table_dtype: str | None  # the embedding and LM head's dtype where not `dtype`

  @property
  def portable(self) -> bool:
    return self.kernels == "portable"


def resolve(args: EngineArgs, machine: Machine) -> Settings:
  """The `Settings` `args` resolve to on `machine` (`resolved_kernels`, `execution`,
  `model_dtype`, `kv_cache_dtype`, `table_dtype`)."""
  layer_execution, keep, activations = execution(args, machine)
  return Settings(machine.platform, model_dtype(args, machine), kv_cache_dtype(args, machine),
                  resolved_kernels(args, machine), layer_execution, keep, activations,
                  table_dtype(args, machine))


@dataclasses.dataclass(frozen=True)
class Offload:
  """The offload an engine runs with, and the planner's plan behind it (None where no planning
  was needed)."""
  offload_tail_layers: int
  prefetch_depth: int  # 0 when nothing is offloaded
  plan: OffloadPlan | None = None


@dataclasses.dataclass(frozen=True)
class ExpertOffload:
  """The layers whose experts (only) are in pinned host memory, and how they run.

  `layers`: the experts group's size (the offloaded layers outside the tail); `first`: its first
  layer; `stream_from_tokens`: calls of at least this many tokens stream the experts, smaller ones
  compute them on the host (None: always on the host); `report`: the cost model's choice per
  batch size and layer (`expert_cost.report`), None where no experts are offloaded."""
  layers: int = 0
  first: int = 0
  stream_from_tokens: int | None = None
  report: dict | None = None


@dataclasses.dataclass(frozen=True)
class Sizing:
  """The resolved engine: every "auto" and every default of `EngineArgs` decided.

  `block_bytes` is one block over all devices (each device holds 1 / tensor_parallel_size). The
  weight bytes are counted from the `weights` `size` was given (per device) and, under tensor
  parallelism, from the model's shapes (the totals).
  """
  dtype: str
  kv_cache_dtype: str
  kernels: str  # "auto" or "portable"
  attention_impl: str  # "auto" resolved to "xla" under kernels="portable" on a CPU
  layer_execution: str  # "scan" or "unrolled"
  keep_quantized: bool  # layers may keep a GGUF file's blocks (or `quantization`'s)
  block_activations: str  # "float32" or "int16"
  tensor_parallel_size: int
  max_model_len: int
  max_num_seqs: int
  max_num_batched_tokens: int
  block_size: int
  block_bytes: int
  num_device_blocks: int
  num_host_blocks: int
  offload: Offload
  experts: ExpertOffload
  device_weight_bytes: int  # over all devices (a replicated tensor counts once)
  host_weight_bytes: int
  device_weight_bytes_per_device: int
  host_weight_bytes_per_device: int
  activation_reserve_bytes: int
  host_expert_bytes: int = 0  # of host_weight_bytes, the experts group's (over all devices)
  table_dtype: str | None = None  # the embedding and LM head's dtype where not `dtype`
  platform: str | None = None  # the machine's ("cpu", "gpu", "tpu")
  pinned_cap: PinnedCap | None = None  # the cap the pinned bytes keep within (`size`'s)

  @property
  def device_kv_bytes(self) -> int:
    return self.num_device_blocks * self.block_bytes

  @property
  def host_kv_bytes(self) -> int:
    return self.num_host_blocks * self.block_bytes

  @property
  def pinned_bytes(self) -> int:
    """Pinned host memory the plan takes at most: the host KV pool and the offloaded weights."""
    return self.host_kv_bytes + self.host_weight_bytes

  def memory_plan(self) -> dict:
    """The plan in `jaxtier.LLM.memory_report()`'s keys (the figures it measures once loaded;
    the KV swap traffic, which only running measures, is 0 here), with the resolved dtypes,
    layer execution and pool sizes: what `--dry_run` prints."""
    n, depth, tp = self.offload.offload_tail_layers, self.offload.prefetch_depth, \
        self.tensor_parallel_size
    host = self.host_weight_bytes
    return {
        "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype, "kernels": self.kernels,
        "attention_impl": self.attention_impl, "layer_execution": self.layer_execution, "max_model_len": self.max_model_len,
        "max_num_seqs": self.max_num_seqs, "block_size": self.block_size,
        "device_weight_bytes": self.device_weight_bytes, "host_weight_bytes": host,
        "device_kv_bytes": self.device_kv_bytes, "host_kv_bytes": self.host_kv_bytes,
        "kv_block_bytes": self.block_bytes, "device_kv_blocks": self.num_device_blocks,
        "host_kv_blocks": self.num_host_blocks, "weight_transfer_bytes_per_step": host,
        "kv_swap_bytes_per_step": 0, "kv_swap_bytes_max_step": 0,
        "prefetch_buffer_bytes": (depth + 1) * ((host - self.host_expert_bytes) // n) if n else 0,
        "offload_tail_layers": n, "prefetch_depth": depth, "tensor_parallel_size": tp,
        "offload_expert_layers": self.experts.layers, "host_expert_bytes": self.host_expert_bytes,
        "expert_offload": self.experts.report,
        "device_weight_bytes_per_device": self.device_weight_bytes_per_device,
        "host_weight_bytes_per_device": self.host_weight_bytes_per_device,
        "device_kv_bytes_per_device": self.device_kv_bytes // tp,
        **pinned_figures(self.pinned_bytes, self.pinned_cap)}


def pinned_figures(pinned_bytes: int, cap: PinnedCap | None) -> dict:
  """The pinned bytes and the cap they keep within, in `memory_report()`'s keys."""
  return {"pinned_bytes": pinned_bytes, "pinned_cap_bytes": None if cap is None else cap.bytes,
          "pinned_cap_setting": None if cap is None else cap.setting}


def resolved_kernels(args: EngineArgs, machine: Machine) -> str:
  """`kernels`, with "auto" "portable" off CPU: the CPU kernels run on a CPU only, so an
  accelerator runs what "portable" names (scanned layers, XLA attention, float weights)."""
  return args.kernels if machine.platform == "cpu" else "portable"


def execution(args: EngineArgs, machine: Machine) -> tuple[str, bool, str]:
  """(layer_execution, keep_quantized, block_activations): how layers run and whether resident
  layers keep a GGUF file's blocks, which the loader must know before it opens the checkpoint.

  `kernels="portable"` runs scanned layers, as an accelerator does. With `weight_format="auto"`
  on one device, blocks are kept (a GGUF file's, or those `quantization` makes): unrolled layers
  pack them for the CPU kernels, scanned and offloaded layers hold them in `jaxtier.model.quant`'s
  layouts. `block_activations` "auto" is int16 where the kernels multiply int16 in vector
  instructions; where no unrolled layer keeps blocks it is "float32" (it has no effect there)."""
  portable = resolved_kernels(args, machine) == "portable"
  layer_execution = args.layer_execution
  if layer_execution == "auto":
    layer_execution = "unrolled" if machine.platform == "cpu" and not portable else "scan"
  # under tensor parallelism only stacked layers keep blocks (unrolled ones are not fused, so
  # the CPU kernels' blocks are not packed there)
  keep = args.weight_format == "auto" and (args.tensor_parallel_size == 1
                                           or layer_execution == "scan")
  activations = args.block_activations
  if not keep or layer_execution != "unrolled":
    activations = "float32"
  elif activations == "auto":
    activations = "int16" if machine.integer_dots else "float32"
  return layer_execution, keep, activations


def table_dtype(args: EngineArgs, machine: Machine) -> str | None:
  """The embedding and LM head tables' dtype where it is not the model's: bfloat16 for a float32
  model quantized on the portable path (the CPU kernels keep the head in int8 blocks)."""
  if (args.quantization is not None and resolved_kernels(args, machine) == "portable"
      and model_dtype(args, machine) == "float32"):
    return "bfloat16"
  return None


def model_dtype(args: EngineArgs, machine: Machine) -> str:
  """The parameter and activation dtype: `dtype`, with "auto" float32 on CPU and bfloat16 on an
  accelerator."""
  if args.dtype != "auto":
    return args.dtype
  return "float32" if machine.platform == "cpu" else "bfloat16"


def kv_cache_dtype(args: EngineArgs, machine: Machine) -> str:
  """The KV cache dtype: `kv_cache_dtype`, with "auto" the model dtype."""
  return model_dtype(args, machine) if args.kv_cache_dtype == "auto" else args.kv_cache_dtype


def activation_reserve_bytes(config: ModelConfig, batch: int, context: int, itemsize: int) -> int:
  """Estimated peak activations of a prefill of `batch` x `context` tokens with dense attention:
  float32 scores [b, n, t, t], the MLP's two [b, t, f] intermediates and float32 logits [b, v]."""
  scores = batch * config.num_heads * context * context * 4
  mlp = 2 * batch * context * config.intermediate_size * itemsize
  return scores + mlp + batch * config.vocab_size * 4


def cpu_default_pool_blocks(max_num_seqs: int, max_model_len: int, block_size: int,
                            block_bytes: int) -> tuple[int, int]:
  """The (device, host) KV pools in blocks where the backend reports no memory (CPU).

  The device pool holds `max_num_seqs` requests of min(max_model_len,
  `CPU_DEFAULT_REQUEST_TOKENS`) tokens, capped at `CPU_DEFAULT_KV_GB` GB, but never less than one
  max_model_len sequence (the engine's minimum); the host pool is `CPU_DEFAULT_HOST_FRACTION` of
  it. Sized for the short requests a CPU serves: room for max_num_seqs full-length sequences of
  an 8192-token window would take gigabytes per tier, more than a small model's weights.
  """
  request = blocks_for(min(max_model_len, CPU_DEFAULT_REQUEST_TOKENS), block_size)
  cap = int(CPU_DEFAULT_KV_GB * GB // block_bytes)
  device = max(min(max_num_seqs * request, cap), blocks_for(max_model_len, block_size))
  return device, int(device * CPU_DEFAULT_HOST_FRACTION)


def _check_model(args: EngineArgs, config: ModelConfig) -> None:
  """The checks that need the model's config."""
  limit = config.max_position_embeddings
  if args.max_model_len is not None and args.max_model_len > limit:
    raise ValueError(f"max_model_len={args.max_model_len}: expected at most {limit}, the "
                     "context window of this model")
  check_offload(args.offload_tail_layers, args.prefetch_depth, config.num_layers)
  sharding.check_tensor_parallel(config, args.tensor_parallel_size)
  if args.offload_expert_layers and not config.num_experts:
    raise ValueError(f"offload_expert_layers={args.offload_expert_layers}: this model has no "
                     "mixture-of-experts layers")
  if args.offload_expert_layers > config.num_layers:
    raise ValueError(f"offload_expert_layers={args.offload_expert_layers}: expected -1 (all) or "
                     f"at most {config.num_layers}, the model's mixture-of-experts layers")
  if args.expert_offload_mode == "host" and args.tensor_parallel_size > 1:
    raise ValueError("expert_offload_mode='host' computes experts on one device's host; with "
                     f"tensor_parallel_size={args.tensor_parallel_size} use 'stream' or 'auto'")


def _expert_layers_wanted(args: EngineArgs, config: ModelConfig) -> int:
  """`offload_expert_layers` as a count of layers (-1: all of them)."""
  return config.num_layers if args.offload_expert_layers == -1 else args.offload_expert_layers


def _experts(args: EngineArgs, config: ModelConfig, machine: Machine, dtype: str,
             tail: int, rates: "expert_cost.ExpertRates | None",
             held_layer_bytes: int | None = None) -> ExpertOffload:
  """The experts group and its stream/host switch (see the module docstring);
  `held_layer_bytes`: a layer's expert stack as the loader holds it (compact experts), where
  known."""
  layers = max(_expert_layers_wanted(args, config) - tail, 0)
  if not layers:
    return ExpertOffload()
  first = config.num_layers - tail - layers
  shape = dataclasses.replace(expert_cost.ExpertShape.of(config, dtype),
                              held_layer_bytes=held_layer_bytes)
  forced = args.expert_offload_mode
  if forced == "auto" and args.tensor_parallel_size > 1:
    forced = "stream"  # host compute runs on one device
  if rates is None:
    rates = expert_cost.rates_of(_platform_hardware(machine.platform))
  report = expert_cost.report(shape, rates, range(first, first + layers), forced)
  stream_from = expert_cost.stream_from_tokens(shape, rates, forced)
  if forced == "auto" and machine.platform == "cpu":
    stream_from = shape.num_experts // shape.experts_per_tok + 1
    report = _with_switch(report, stream_from, "cpu: host and device are one memory; on the "
                          "host while a call's tokens route to at most every expert once")
  return ExpertOffload(layers, first, stream_from, report)


def _platform_hardware(platform: str):
  """The hardware preset standing for `platform` (`hardware.PLATFORM_PRESETS`; CPU: the GPU's)."""
  from jaxtier.offload import hardware  # pylint: disable=import-outside-toplevel
  return hardware.preset(hardware.PLATFORM_PRESETS.get(platform, hardware.PLATFORM_PRESETS["gpu"]))


def _with_switch(report: dict, stream_from: int | None, rule: str) -> dict:
  """`report` with its switch point and per-batch modes set by a rule instead of the rates."""
  mode = lambda tokens: "stream" if stream_from is not None and tokens >= stream_from else "host"
  by_batch = {b: dict(row, mode=mode(int(b))) for b, row in report["by_batch"].items()}
  layers = {layer: dict(row, stream_from_tokens=stream_from) if isinstance(row, dict) else row
            for layer, row in report.get("layers", {}).items()}
  return dict(report, stream_from_tokens=stream_from, by_batch=by_batch, layers=layers, rule=rule)


def _offload(args: EngineArgs, config: ModelConfig, machine: Machine, weights: ModelBytes,
             memory: int | None, kv_reserve: int, activations: int, max_model_len: int,
             timing: Timing | None) -> Offload:
  """`offload_tail_layers` and `prefetch_depth` as numbers (see the module docstring)."""
  n, depth = args.offload_tail_layers, args.prefetch_depth
  if n == 0 or (n == "auto" and memory is None):
    return Offload(0, 0)
  cpu = machine.platform == "cpu"
  if n != "auto" and (depth != "auto" or cpu):
    depth = 1 if depth == "auto" else depth
    return Offload(n, depth)
  if timing is None:
    raise ValueError(f"offload_tail_layers={n!r}, prefetch_depth={depth!r}: planning needs the "
                     "measured link rate and layer time (`timing`)")
  # The decode step whose layer time is measured: a full batch over the whole window.
  link, layer_s = timing(pow2_bucket(args.max_num_seqs), max_model_len)
  fixed_depth = depth if depth != "auto" else (1 if cpu else None)
  assumed = weights.weight_bytes + kv_reserve + activations  # no memory given: all of it fits
  result = plan(weights, device_memory_bytes=memory or assumed,
                link_bytes_per_s=link, layer_compute_s=layer_s, kv_reserve_bytes=kv_reserve,
                activation_reserve_bytes=activations,
                offload_tail_layers=None if n == "auto" else n, prefetch_depth=fixed_depth)
  if not result.fits and memory is not None:
    raise ValueError(f"offload_tail_layers={n!r}: {result.message()}")
  if not result.offload_tail_layers:
    return Offload(0, 0, result)
  return Offload(result.offload_tail_layers, result.prefetch_depth, result)


def size(args: EngineArgs, config: ModelConfig, machine: Machine, *,
         weights: ModelBytes | None = None, whole_weights: ModelBytes | None = None,
         timing: Timing | None = None,
         expert_rates: "expert_cost.ExpertRates | None" = None,
         settings: Settings | None = None, cap: PinnedCap | None = None) -> Sizing:
  """The engine `args` resolve to for a model of `config` on `machine` (see the module docstring).

  `weights`: one device's weight bytes as the loader will hold them (`ModelBytes`; resident
  layers that keep GGUF blocks are smaller than their floats, see
  `jaxtier.checkpoint.placed.resident_bytes`); default: floats of the resolved dtype.
  `whole_weights`: the same over all devices, where tensor parallel (default: floats).
  `timing(batch,
  context)`: the measured link rate and decode-layer time, called only when the planner runs.
  `expert_rates`: the link and host rates the expert cost model runs at (default: the platform's
  hardware preset). `settings`: `resolve(args, machine)`, where already made. `cap`: the most
  pinned host memory the platform's client gives out (`jaxtier.engine.pinned_cap`; None: no cap),
  which the host pool and the offloaded weights keep within. Raises ValueError for arguments this
  model or machine cannot run.
  """
  _check_model(args, config)
  settings = settings or resolve(args, machine)
  if (args.quantization is not None and settings.layer_execution == "unrolled"
      and (settings.dtype != "float32" or not machine.cpu_kernels)):
    # unrolled layers keep blocks only where the CPU kernels pack them: the weights would stay
    # floats, the quantization silently lost
    raise ValueError(f"quantization={args.quantization!r}: the CPU kernels' unrolled layers hold "
                     f"quantized blocks only in float32 with the kernels built (dtype="
                     f"{settings.dtype!r}, kernels built: {machine.cpu_kernels}); use "
                     "dtype='float32', or kernels='portable' for compact weights in any dtype")
  tp = args.tensor_parallel_size
  max_model_len = args.max_model_len or config.max_position_embeddings
  dtype, kv_dtype = settings.dtype, settings.kv_cache_dtype
  block_bytes = kv_block_bytes(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype,
                               args.block_size)
  if weights is None:
    weights = ModelBytes.from_config(config, dtype, kv_dtype, tensor_parallel_size=tp)
  whole = whole_weights or (weights if tp == 1 else ModelBytes.from_config(config, dtype,
                                                                           kv_dtype))
  wanted = _expert_layers_wanted(args, config)
  if wanted:  # those layers keep only their dense part on the device (the planner sees it too)
    weights = weights.without_experts(range(config.num_layers - wanted, config.num_layers))
    whole = whole.without_experts(range(config.num_layers - wanted, config.num_layers))
  reserve = activation_reserve_bytes(config, 1, min(args.token_budget, max_model_len),
                                     DTYPE_BYTES[dtype])
  memory = (int(args.device_memory_gb * GB) if args.device_memory_gb is not None
            else machine.device_memory_bytes)
  usable = None if memory is None else int(memory * args.gpu_memory_utilization)
  explicit = (args.num_device_blocks * block_bytes if args.num_device_blocks is not None
              else None if args.kv_cache_memory_gb is None else int(args.kv_cache_memory_gb * GB))
  minimal = blocks_for(max_model_len, args.block_size) * block_bytes
  offload = _offload(args, config, machine, weights, usable,
                     (minimal if explicit is None else explicit) // tp, reserve, max_model_len,
                     timing)
  n = offload.offload_tail_layers
  experts = _experts(args, config, machine, dtype, n, expert_rates,
                     whole.expert_layer_bytes if whole_weights is not None else None)
  resident = weights.resident_bytes(range(config.num_layers - n)) + weights.other_bytes
  host_weights = n * weights.layer_bytes + experts.layers * weights.expert_layer_bytes
  host = None  # the host pool's default: the device pool's size, unless the CPU rule sets it
  if explicit is not None:
    device = explicit // block_bytes
  elif memory is not None:
    # Per device: each holds its shard of the weights and 1 / tp of every block's kv heads.
    free = memory * args.gpu_memory_utilization - resident - reserve
    device = int(free // (block_bytes // tp))
  else:
    device, host = cpu_default_pool_blocks(args.max_num_seqs, max_model_len, args.block_size,
                                           block_bytes)
  needed = blocks_for(max_model_len, args.block_size)
  if device < needed:
    raise ValueError(
        f"the device KV pool holds {max(device, 0)} blocks of {args.block_size} tokens "
        f"({max(device, 0) * block_bytes / GB:.3f} GB) but one sequence of max_model_len="
        f"{max_model_len} tokens needs {needed}: raise num_device_blocks / "
        "kv_cache_memory_gb (or device memory), or lower max_model_len")
  host = _host_blocks(args, machine, device, host, block_bytes, host_weights * tp, cap)
  if cap is not None and host_weights * tp > cap.bytes:
    raise ValueError(f"the offloaded weights need {host_weights * tp / GB:.3f} GB of pinned host "
                     f"memory; XLA pins at most {cap.bytes / GB:.3f} GB ({cap.setting}): offload "
                     f"fewer layers, or set {pinned_cap.ENV} higher before JAX starts")
  return Sizing(
      dtype=dtype, kv_cache_dtype=kv_dtype, kernels=settings.kernels,
      attention_impl=("xla" if settings.portable and args.attention_impl == "auto"
                      and machine.platform == "cpu" else args.attention_impl),
      layer_execution=settings.layer_execution,
      keep_quantized=settings.keep_quantized, block_activations=settings.block_activations,
      tensor_parallel_size=tp,
      max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
      max_num_batched_tokens=args.token_budget, block_size=args.block_size,
      block_bytes=block_bytes, num_device_blocks=device, num_host_blocks=host, offload=offload,
      experts=experts,
      device_weight_bytes=whole.resident_bytes(range(config.num_layers - n)) + whole.other_bytes,
      host_weight_bytes=n * whole.layer_bytes + experts.layers * whole.expert_layer_bytes,
      device_weight_bytes_per_device=resident,
      host_weight_bytes_per_device=host_weights, activation_reserve_bytes=reserve,
      host_expert_bytes=experts.layers * whole.expert_layer_bytes,
      table_dtype=settings.table_dtype, platform=machine.platform, pinned_cap=cap)


def _host_blocks(args: EngineArgs, machine: Machine, device: int, default: int | None,
                 block_bytes: int, pinned_weights: int, cap: PinnedCap | None) -> int:
  """The host pool in blocks: as asked (checked against the host's memory), or the default."""
  if args.num_host_blocks is not None:
    host = args.num_host_blocks
  elif args.swap_space_gb is not None:
    host = int(args.swap_space_gb * GB // block_bytes)
  else:
    host = device if default is None else default
    rooms = [] if cap is None else [cap.bytes]
    if machine.host_memory_bytes is not None:
      rooms.append(int(HOST_PIN_FRACTION * machine.host_memory_bytes))
    if rooms:
      host = max(min(host, (min(rooms) - pinned_weights) // block_bytes), 0)
    return host
  total = host * block_bytes + pinned_weights
  need = (f"the host KV pool of {host} blocks ({host * block_bytes / GB:.3f} GB) and "
          f"{pinned_weights / GB:.3f} GB of offloaded weights need {total / GB:.3f} GB of pinned "
          "host memory")
  if machine.host_memory_bytes is not None and total > machine.host_memory_bytes:
    raise ValueError(f"{need}; the host has {machine.host_memory_bytes / GB:.3f} GB: lower "
                     "num_host_blocks / swap_space_gb")
  if cap is not None and total > cap.bytes:
    raise ValueError(f"{need}; XLA pins at most {cap.bytes / GB:.3f} GB ({cap.setting}): lower "
                     f"num_host_blocks / swap_space_gb, or set {pinned_cap.ENV} higher before "
                     "JAX starts")
  return host


def platform_name(platform: str) -> str:
  """`Machine.platform` of a JAX platform name ("cuda" and "rocm" are "gpu")."""
  platform = PLATFORM_ALIASES.get(platform, platform)
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r}: expected one of "
                     f"{PLATFORMS + tuple(PLATFORM_ALIASES)}")
  return platform


def local_platform() -> str:
  """`Machine.platform` of this process's first local device."""
  import jax  # pylint: disable=import-outside-toplevel
  platform = jax.local_devices()[0].platform
  return platform if platform in PLATFORMS else "gpu"  # "cuda" / "rocm" plugins


def detect_machine(args: EngineArgs, platform: str | None = None) -> Machine:
  """This process's machine, as `size` takes it: the platform and devices JAX sees, the first
  device's memory limit (None on CPU, whose backend reports none), the host's RAM, and on CPU
  whether the C++ kernels are built (building them on first use) and multiply int16 in vector
  instructions. `args.host_memory_gb` replaces the measured host RAM.

  `platform` ("cpu", "gpu", "tpu", "cuda", "rocm"): plan for that platform instead, as a program
  exported for it runs there (`jax.export`). Where it is not this process's platform, nothing
  of this machine is measured: `tensor_parallel_size` devices of unknown memory (or
  `args.device_memory_gb`, which `size` reads) and a host of `args.host_memory_gb` (None:
  unbounded)."""
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.local_devices()
  local = local_platform()
  given = None if args.host_memory_gb is None else int(args.host_memory_gb * GB)
  if platform is not None and platform_name(platform) != local:
    return Machine(platform_name(platform), args.tensor_parallel_size, None, given)
  platform = local
  stats = devices[0].memory_stats() or {}
  host = host_memory(args)
  kernels = dots = False
  if platform == "cpu" and args.kernels != "portable":  # portable never builds the kernels
    # pylint: disable-next=import-outside-toplevel
    from jaxtier.kernels.cpu import library as cpu_kernels
    kernels = cpu_kernels.available()
    dots = kernels and cpu_kernels.integer_dots()
  return Machine(platform, len(devices), stats.get("bytes_limit"), host, kernels, dots)
