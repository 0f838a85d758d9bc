"""The article's example for `scripts/plan_offload.py`: 32 layers of 0.5 GB over a 22 GB/s link.

    python scripts/plan_offload.py --config=configs/offload_plan_article.py
    python scripts/plan_offload.py --config=configs/offload_plan_article.py --layer_compute_ms=10

With 40 ms of compute per layer one layer of prefetch hides each 23 ms transfer; with 10 ms it
cannot, and the planner says how many layers could be offloaded without slowing the step.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.num_layers = 32
  config.layer_gb = 0.5
  config.device_memory_gb = 80.0
  config.kv_reserve_gb = 70.0
  config.link_gbps = 22.0
  config.layer_compute_ms = 40.0
  return config
