"""Batch inference with the last 10 of the default model's 30 layers in pinned host memory.

Use with
  python scripts/batch_infer.py --config=configs/offload_batch_smollm.py --input=... --output=...
any flag given on the command line wins over the value here. The default model fits any device: this
runs the offload machinery for real (on CPU it checks placement and output equality, not speed).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m-instruct"
  config.dtype = "float32"
  config.max_num_seqs = 16
  config.max_tokens = 64
  config.temperature = 0.0
  config.offload_tail_layers = 10
  config.prefetch_depth = "auto"
  return config
