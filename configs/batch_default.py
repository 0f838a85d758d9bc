"""Default batch-inference run: greedy decoding of up to 64 tokens on the default model.

Use with `python scripts/batch_infer.py --config=configs/batch_default.py --input=... --output=...`;
any flag given on the command line wins over the value here.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m-instruct"
  config.dtype = "float32"
  config.max_num_seqs = 16
  config.max_tokens = 64
  config.temperature = 0.0
  config.top_p = 1.0
  config.top_k = -1
  return config
