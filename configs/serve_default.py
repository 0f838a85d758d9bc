"""Default server: the default model on localhost:8000, batches of up to 16 requests.

Use with `python scripts/serve.py --config=configs/serve_default.py`; any flag given on the command
line wins over the value here.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m-instruct"
  config.host = "127.0.0.1"
  config.port = 8000
  config.dtype = "float32"
  config.max_num_seqs = 16
  config.offload_tail_layers = "0"
  config.prefetch_depth = "auto"
  return config
