"""Resolving the engine arguments `offload_tail_layers` and `prefetch_depth`, "auto" included.

"auto" runs the planner with measured numbers: the pinned host -> device bandwidth and one layer's
decode-step compute time on this machine, device memory from the device (or the engine's
`device_memory_gb`), the KV reservation and an activation reserve from the engine's limits. When
the device memory is unknown (the CPU backend reports none) `offload_tail_layers="auto"` offloads
nothing. On CPU `prefetch_depth="auto"` is 1: there is no copy engine to overlap with, so a deeper
queue only holds more layer copies (and once the d + 1 copies pass 32 MB of step temporaries, glibc
maps them afresh every step unless `jaxtier.cpu_allocator.retain_freed_memory()` was called). The
planner then fits memory with the depth that will run.
"""

import dataclasses

import jax

from jaxtier.checks import check_offload
from jaxtier.config import ModelConfig
from jaxtier.offload import measure
from jaxtier.offload.planner import ModelBytes, OffloadPlan, plan
from jaxtier.offload.prefetch import check_depth


@dataclasses.dataclass(frozen=True)
class Resolved:
  """The offload an engine runs with, and the plan behind it (None when no planning was needed)."""
  offload_tail_layers: int
  prefetch_depth: int  # 0 when nothing is offloaded
  plan: OffloadPlan | None = None


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
  """The device's memory limit as its allocator reports it, or None (CPU reports nothing)."""
  stats = (device or jax.local_devices()[0]).memory_stats() or {}
  return stats.get("bytes_limit")


def activation_reserve_bytes(config: ModelConfig, batch: int, context: int, itemsize: int) -> int:
  """Estimated peak activations of a prefill of `batch` x `context` tokens with dense attention:
  float32 scores [b, n, t, t], the MLP's two [b, t, f] intermediates and float32 logits [b, v]."""
  scores = batch * config.num_heads * context * context * 4
  mlp = 2 * batch * context * config.intermediate_size * itemsize
  return scores + mlp + batch * config.vocab_size * 4


def resolve(config: ModelConfig, dtype: str, offload_tail_layers, prefetch_depth, *,
            memory_bytes: int | None, kv_reserve_bytes: int, activation_reserve_bytes: int,
            batch: int, context: int, tensor_parallel_size: int = 1,
            resident: tuple[tuple[int, ...], int] | None = None) -> Resolved:
  """Turns the two engine arguments into numbers (see the module docstring), before any weight
  is loaded.

  `resident`: (bytes of each layer, bytes of everything else) as the loader will hold them
  resident (`jaxtier.checkpoint.placed.resident_bytes`), where that is not the float parameters
  (kept GGUF blocks); None: `dtype` floats.

  `batch` and `context` give the decode step whose layer time is measured (on a layer of random
  weights). Under tensor parallelism every figure is per device: `memory_bytes` and
  `kv_reserve_bytes` are one device's, and the model's bytes are its per-device shard.
  """
  check_offload(offload_tail_layers, prefetch_depth, config.num_layers)
  if offload_tail_layers == 0 or (offload_tail_layers == "auto" and memory_bytes is None):
    return Resolved(0, 0)
  cpu = jax.default_backend() == "cpu"
  if offload_tail_layers != "auto" and (prefetch_depth != "auto" or cpu):
    depth = 1 if prefetch_depth == "auto" else prefetch_depth
    return Resolved(offload_tail_layers, check_depth(depth, offload_tail_layers))
  bytes_ = ModelBytes.from_config(config, dtype, tensor_parallel_size=tensor_parallel_size)
  if resident is not None:
    bytes_ = dataclasses.replace(bytes_, resident_layer_bytes=tuple(resident[0]),
                                 other_bytes=resident[1])
  fixed_depth = prefetch_depth if prefetch_depth != "auto" else (1 if cpu else None)
  assumed = bytes_.weight_bytes + kv_reserve_bytes + activation_reserve_bytes
  result = plan(bytes_, device_memory_bytes=memory_bytes or assumed,
                link_bytes_per_s=measure.link_bytes_per_s(),
                layer_compute_s=measure.layer_compute_s(config, dtype, batch, 1, context),
                kv_reserve_bytes=kv_reserve_bytes,
                activation_reserve_bytes=activation_reserve_bytes,
                offload_tail_layers=None if offload_tail_layers == "auto" else offload_tail_layers,
                prefetch_depth=fixed_depth)
  if not result.fits and memory_bytes is not None:
    raise ValueError(f"offload_tail_layers={offload_tail_layers!r}: {result.message()}")
  n = result.offload_tail_layers
  if not n:
    return Resolved(0, 0, result)
  return Resolved(n, result.prefetch_depth, result)
