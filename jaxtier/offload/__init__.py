"""Weight offload: tail layers in pinned host memory, prefetched inside a scan, and a planner.

Usable on its own, without the engine:

    model = offload_tail(model, num_offloaded=10, depth=2)   # last 10 layers in pinned_host
    p = plan(ModelBytes.from_config(config, "bfloat16"), device_memory_bytes=..., ...)
    print(p.message())
"""

from jaxtier.offload.hardware import PRESETS, Hardware, layer_seconds, plan_on, preset
from jaxtier.offload.placement import (DEVICE, PINNED_HOST, bytes_by_memory_kind,
                                       bytes_per_device, layer_sharding, memory_kinds,
                                       to_memory_kind, tree_bytes)
from jaxtier.offload.planner import (ModelBytes, OffloadPlan, depth_for, kv_reservation, plan,
                                     scheduler_link_fields, simulate_step)
from jaxtier.offload.prefetch import (MAX_DEPTH, OffloadedLayers, OffloadedStack, offload_tail,
                                      prefetch_scan, prefetch_scan_layers, tail_group)

__all__ = [
    "DEVICE", "Hardware", "MAX_DEPTH", "ModelBytes", "OffloadPlan", "OffloadedLayers",
    "OffloadedStack", "prefetch_scan",
    "PINNED_HOST", "PRESETS", "bytes_by_memory_kind", "bytes_per_device", "depth_for",
    "kv_reservation",
    "layer_seconds", "layer_sharding", "memory_kinds", "offload_tail", "plan", "plan_on",
    "prefetch_scan_layers", "preset", "scheduler_link_fields", "simulate_step", "tail_group",
    "to_memory_kind", "tree_bytes",
]
