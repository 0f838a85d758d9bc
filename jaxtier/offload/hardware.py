"""Accelerator presets for the offload planner, and the roofline it uses for their compute time.

Numbers are datasheet peaks except the host link, which is what a pinned host-to-device copy
achieves (PCIe 4.0 x16: ~32 GB/s in theory, ~22 GB/s measured, the article's figure). They are
starting points: `scripts/bench_offload_gpu.sh` measures the real link on the machine at hand.
GB = 1e9 bytes; device memory is what `nvidia-smi` reports as total.

The host's memory bandwidth and matmul FLOP/s (`host_bytes_per_s`, `host_flops`) price experts
computed where they live in host memory (`jaxtier.offload.expert_cost`); they are assumed, not
datasheet figures, and conservative: a sustained rate, not a peak. `scripts/validate_gpu.py`'s
`experts` section times both ways on a GPU and reports the measured crossover beside the model's.
"""

import dataclasses
import types

from jaxtier.offload.planner import ModelBytes, OffloadPlan, plan

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator and its host link.

  Attributes:
    name: preset name.
    device_memory_bytes: device memory.
    link_bytes_per_s: achieved pinned host -> device bandwidth.
    hbm_bytes_per_s: device memory bandwidth (datasheet peak).
    peak_flops: dense bf16 matmul peak, FLOP/s.
    note: where the numbers come from.
    host_bytes_per_s: the host's sustained memory bandwidth, bytes/s, for experts computed on the
      host (`jaxtier.offload.expert_cost`). Assumed.
    host_flops: the host's sustained bf16 matmul FLOP/s for host-computed experts. Assumed.
  """
  name: str
  device_memory_bytes: int
  link_bytes_per_s: float
  hbm_bytes_per_s: float
  peak_flops: float
  note: str = ""
  host_bytes_per_s: float = 200e9
  host_flops: float = 1e12

  def __post_init__(self):
    for field in ("device_memory_bytes", "link_bytes_per_s", "hbm_bytes_per_s", "peak_flops",
                  "host_bytes_per_s", "host_flops"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field}={value!r}: expected a positive number")


_H100 = dict(device_memory_bytes=81559 * MIB, hbm_bytes_per_s=3.35e12, peak_flops=989e12)
# The x86 host of a PCIe card: 8-channel DDR5-4800 is ~307 GB/s per socket, ~200 GB/s sustained;
# AMX / AVX-512 bf16 reaches 1-2 TFLOP/s on a socket, 1 TFLOP/s assumed (conservative).
_X86_HOST = dict(host_bytes_per_s=200e9, host_flops=1e12)
_X86_NOTE = "; x86 host: 8-channel DDR5 ~200 GB/s sustained, bf16 AMX/AVX-512 ~1 TFLOP/s (assumed)"
PRESETS: types.MappingProxyType[str, Hardware] = types.MappingProxyType({
    "h100-80gb-pcie4": Hardware(
        "h100-80gb-pcie4", link_bytes_per_s=22e9, **_H100, **_X86_HOST,
        note="H100 SXM5 80GB (HBM3 3.35 TB/s, 989 TFLOP/s bf16) on a PCIe 4.0 x16 host link: "
             "32 GB/s theoretical, 22 GB/s achieved (the article's measurement)" + _X86_NOTE),
    "h100-80gb-pcie5": Hardware(
        "h100-80gb-pcie5", link_bytes_per_s=50e9, **_H100, **_X86_HOST,
        note="H100 SXM5 80GB on a PCIe 5.0 x16 host link: 64 GB/s theoretical, ~50 GB/s "
             "achieved (assumed ~78% as on PCIe 4)" + _X86_NOTE),
    "h100-pcie": Hardware(
        "h100-pcie", device_memory_bytes=81559 * MIB, link_bytes_per_s=50e9,
        hbm_bytes_per_s=2.0e12, peak_flops=756e12, **_X86_HOST,
        note="H100 PCIe 80GB card (HBM2e 2.0 TB/s, 756 TFLOP/s bf16) on a PCIe 5.0 x16 host "
             "link: 64 GB/s theoretical, ~50 GB/s achieved (assumed)" + _X86_NOTE),
    "h200-141gb": Hardware(
        "h200-141gb", device_memory_bytes=143771 * MIB, link_bytes_per_s=50e9,
        hbm_bytes_per_s=4.8e12, peak_flops=989e12, **_X86_HOST,
        note="H200 141GB (HBM3e 4.8 TB/s, 989 TFLOP/s bf16) on a PCIe 5.0 x16 host link, ~50 GB/s "
             "achieved (assumed)" + _X86_NOTE),
    "gh200": Hardware(
        "gh200", device_memory_bytes=97871 * MIB, link_bytes_per_s=375e9, hbm_bytes_per_s=4.0e12,
        peak_flops=989e12, host_bytes_per_s=400e9, host_flops=3e12,
        note="GH200 96GB HBM3 (4 TB/s, 989 TFLOP/s bf16); host memory over NVLink-C2C: 450 GB/s "
             "per direction theoretical, ~375 GB/s achieved (assumed; measure it); Grace host: "
             "LPDDR5X ~500 GB/s peak, ~400 GB/s sustained, 72 Neoverse V2 cores ~3 TFLOP/s bf16 "
             "(assumed)"),
})


# The preset that plans a platform other than this machine's (a dry run for a GPU on a laptop):
# no TPU preset exists yet, so the H100's stands in for it.
PLATFORM_PRESETS = types.MappingProxyType({"gpu": "h100-80gb-pcie4", "tpu": "h100-80gb-pcie4"})


def preset(name: str) -> Hardware:
  """The preset called `name`; ValueError listing the presets otherwise."""
  if name not in PRESETS:
    raise ValueError(f"hardware={name!r} is not a preset; expected one of {sorted(PRESETS)}")
  return PRESETS[name]


def preset_timing(name: str, model: ModelBytes):
  """The offload planner's timing (`jaxtier.engine.sizing.Timing`: (batch, context) -> (link
  bytes/s, one layer's decode seconds)) from the preset called `name` instead of a measurement:
  for planning a machine other than this one."""
  hardware = preset(name)
  return lambda batch, context: (hardware.link_bytes_per_s,
                                 layer_seconds(model, hardware, batch, 1, context))


def layer_seconds(model: ModelBytes, hardware: Hardware, batch: int, tokens: int,
                  context: int) -> float:
  """Roofline time of one layer: `batch` sequences, each `tokens` new tokens after `context` cached.

  max(FLOPs / peak, bytes / HBM bandwidth); bytes are the layer's weights plus the KV it reads.
  """
  for name, value, minimum in (("batch", batch, 1), ("tokens", tokens, 1), ("context", context, 0)):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
  seen = context + tokens
  flops = batch * tokens * (model.layer_flops_per_token + 4 * model.attention_width * seen)
  kv_bytes = batch * seen * model.kv_bytes_per_token // model.num_layers
  return max(flops / hardware.peak_flops, (model.layer_bytes + kv_bytes) / hardware.hbm_bytes_per_s)


def plan_on(hardware: Hardware | str, model: ModelBytes, *, batch: int, tokens: int = 1,
            context: int, kv_reserve_bytes: int = 0, **plan_args) -> OffloadPlan:
  """`plan` with device memory and link from `hardware` and t_c from its roofline for a step of
  `batch` x `tokens` new tokens after `context` cached ones; other `plan` arguments pass through."""
  hw = preset(hardware) if isinstance(hardware, str) else hardware
  return plan(model, device_memory_bytes=hw.device_memory_bytes,
              link_bytes_per_s=hw.link_bytes_per_s,
              layer_compute_s=layer_seconds(model, hw, batch, tokens, context),
              kv_reserve_bytes=kv_reserve_bytes, **plan_args)
