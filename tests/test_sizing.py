"""The sizing step as a pure function, for machines this one is not: no weights, no devices.

Each case checks what the plan must satisfy, computed here from the model's shapes: everything on
a device fits `gpu_memory_utilization` of its memory and one more block would not, the pinned
memory stays within its share of the host, and the offload planner runs only when asked.
"""


import pytest

from jaxtier.engine import sizing
from jaxtier.engine.args import EngineArgs
from jaxtier.model.config import ModelConfig

GB = 1e9
SMOLLM = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                     intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                     head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)
LLAMA_8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, max_position_embeddings=8192)
LLAMA_70B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=8192,
                        intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                        head_dim=128, max_position_embeddings=8192)

CPU_2CORE = sizing.Machine("cpu", 1, None, 24 * 2**30, cpu_kernels=True, integer_dots=True)
H100 = sizing.Machine("gpu", 1, 80 * 10**9, 256 * 10**9)
H200 = sizing.Machine("gpu", 1, 141 * 10**9, 128 * 10**9)
H100_X8 = sizing.Machine("gpu", 8, 80 * 10**9, 2048 * 10**9)


def layer_params(config: ModelConfig) -> int:
  c = config
  attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
  return attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size


def params(config: ModelConfig) -> int:
  """Parameter count, from the shapes (untied embeddings count twice)."""
  c = config
  tables = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
  return c.num_layers * layer_params(c) + tables + c.hidden_size


def kv_block(config: ModelConfig, itemsize: int, block_size: int = 16) -> int:
  return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize * block_size


def never(batch, context):
  raise AssertionError("the planner ran without being asked to")


def test_two_core_cpu_runs_the_default_model_with_small_default_pools():
  s = sizing.size(EngineArgs(), SMOLLM, CPU_2CORE, timing=never)
  block = kv_block(SMOLLM, 4)
  assert s.block_bytes == block == 737_280
  assert (s.layer_execution, s.keep_quantized, s.block_activations) == ("unrolled", True, "int16")
  assert s.max_model_len == 8192 and s.max_num_batched_tokens == 2048
  # 64 requests of 2048 tokens would pass 256 MB; one 8192-token sequence is the floor.
  assert s.num_device_blocks == 8192 // 16 and s.num_host_blocks == s.num_device_blocks // 4
  assert (s.offload.offload_tail_layers, s.offload.prefetch_depth) == (0, 0)
  no_dots = sizing.Machine("cpu", 1, None, None, cpu_kernels=False)
  assert sizing.size(EngineArgs(), SMOLLM, no_dots).block_activations == "float32"


@pytest.mark.parametrize("machine, config, tp", [(H100, LLAMA_8B, 1), (H200, LLAMA_8B, 1),
                                                 (H100_X8, LLAMA_70B, 8)])
def test_default_device_pool_fills_what_the_weights_leave(machine, config, tp):
  args = EngineArgs(model="m", dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=256)
  s = sizing.size(args, config, machine, timing=never)
  # a GGUF file's blocks would be kept (stacked layers hold them compact), tensor parallel too
  assert s.layer_execution == "scan" and s.keep_quantized
  per_device_block = kv_block(config, 2) // tp
  assert s.block_bytes == kv_block(config, 2)
  # Per device: its shard of the weights (norms and tables replicated) within 1% of the shapes'.
  c = config
  replicated = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + \
      (2 * c.num_layers + 1) * c.hidden_size
  sharded = params(config) - replicated
  assert s.device_weight_bytes_per_device == pytest.approx(2 * (sharded / tp + replicated),
                                                           rel=0.01)
  assert s.device_weight_bytes == pytest.approx(2 * params(config), rel=0.01)
  budget = 0.9 * machine.device_memory_bytes - s.device_weight_bytes_per_device - \
      s.activation_reserve_bytes
  assert s.num_device_blocks * per_device_block <= budget < (s.num_device_blocks + 1) * \
      per_device_block
  assert s.device_kv_bytes / tp + s.device_weight_bytes_per_device <= \
      0.9 * machine.device_memory_bytes
  # The host pool: one swap-out of every device block where the host can pin it, else half
  # the host's RAM.
  pinned = s.num_host_blocks * s.block_bytes
  assert pinned <= sizing.HOST_PIN_FRACTION * machine.host_memory_bytes
  if s.device_kv_bytes <= sizing.HOST_PIN_FRACTION * machine.host_memory_bytes:
    assert s.num_host_blocks == s.num_device_blocks
  else:
    assert pinned > sizing.HOST_PIN_FRACTION * machine.host_memory_bytes - s.block_bytes


def test_h200_with_a_128gb_host_pins_at_most_half_of_it():
  s = sizing.size(EngineArgs(model="m", dtype="bfloat16"), SMOLLM, H200, timing=never)
  # The device pool alone (~126 GB of KV) is more than the host could pin.
  assert s.device_kv_bytes > 100 * GB
  assert s.host_kv_bytes <= 64 * GB < s.host_kv_bytes + s.block_bytes


def test_a_host_pool_larger_than_the_host_is_an_error_before_anything_is_allocated():
  args = EngineArgs(model="m", dtype="bfloat16", swap_space_gb=200)
  with pytest.raises(ValueError, match=r"host has 128\.000 GB: lower num_host_blocks / "):
    sizing.size(args, LLAMA_8B, H200, timing=never)
  asked = sizing.size(EngineArgs(model="m", dtype="bfloat16", swap_space_gb=100), LLAMA_8B, H200)
  assert asked.host_kv_bytes == pytest.approx(100 * GB, abs=asked.block_bytes)


def test_auto_offload_plans_a_tail_on_a_small_gpu_and_measures_once():
  calls = []
  def timing(batch, context):
    calls.append((batch, context))
    return 25e9, 1e-4  # 25 GB/s, 0.1 ms a layer: the transfers cannot hide
  args = EngineArgs(model="m", dtype="bfloat16", offload_tail_layers="auto", max_num_seqs=24,
                    max_model_len=4096, device_memory_gb=12)
  s = sizing.size(args, LLAMA_8B, H100, timing=timing)
  assert calls == [(32, 4096)]
  n, layer = s.offload.offload_tail_layers, s.offload.plan.model.layer_bytes
  assert 0 < n < LLAMA_8B.num_layers and 1 <= s.offload.prefetch_depth <= 4
  assert s.host_weight_bytes == n * layer
  # The resident weights, the prefetch buffers, one max_model_len sequence's KV and the
  # activations fit 90% of 12 GB; one layer fewer offloaded would not.
  one_sequence = 4096 // 16 * s.block_bytes
  used = s.device_weight_bytes + (s.offload.prefetch_depth + 1) * layer + one_sequence + \
      s.activation_reserve_bytes
  assert used <= 0.9 * 12 * GB < used + layer
  # The default pool then takes what is left.
  assert s.num_device_blocks * s.block_bytes <= \
      0.9 * 12 * GB - s.device_weight_bytes - s.activation_reserve_bytes


def test_unknown_device_memory_offloads_nothing_and_fixed_offload_needs_no_planner():
  auto = EngineArgs(offload_tail_layers="auto")
  assert sizing.size(auto, SMOLLM, CPU_2CORE, timing=never).offload == sizing.Offload(0, 0)
  fixed = sizing.size(EngineArgs(offload_tail_layers=10), SMOLLM, CPU_2CORE, timing=never)
  assert fixed.offload == sizing.Offload(10, 1)  # CPU: no copy engine to overlap with
  assert fixed.host_weight_bytes == 10 * layer_params(SMOLLM) * 4
  # every parameter, and the rotary frequencies (float32)
  assert fixed.device_weight_bytes + fixed.host_weight_bytes == \
      (params(SMOLLM) + SMOLLM.head_dim // 2) * 4


@pytest.mark.parametrize("kwargs, config, match", [
    (dict(max_model_len=9000), SMOLLM, "max_model_len=9000: expected at most 8192"),
    (dict(offload_tail_layers=31), SMOLLM, r"expected 'auto' or an int in \[0, 30\]"),
    (dict(offload_tail_layers=2, prefetch_depth=3), SMOLLM, "prefetch_depth=3 is more than"),
    (dict(tensor_parallel_size=2), SMOLLM, "tensor_parallel_size=2 does not divide"),
    (dict(num_device_blocks=10), SMOLLM, "one sequence of max_model_len=8192 tokens needs 512"),
])
def test_arguments_this_model_cannot_run(kwargs, config, match):
  with pytest.raises(ValueError, match=match):
    sizing.size(EngineArgs(**kwargs), config, CPU_2CORE, timing=never)


def test_a_quantization_the_cpu_layers_would_not_hold_is_refused():
  """Unrolled layers keep quantized blocks only where the CPU kernels pack them (float32, kernels
  built): otherwise the weights would stay floats and the quantization be lost without a word."""
  for args, machine in ((EngineArgs(model="m", quantization="int8", dtype="bfloat16"), CPU_2CORE),
                        (EngineArgs(model="m", quantization="int4"),
                         sizing.Machine("cpu", 1, None, 24 * 2**30))):
    with pytest.raises(ValueError, match="quantization=.*float32 with the kernels built"):
      sizing.size(args, SMOLLM, machine, timing=never)
  portable = EngineArgs(model="m", quantization="int8", dtype="bfloat16", kernels="portable")
  assert sizing.size(portable, SMOLLM, CPU_2CORE, timing=never).layer_execution == "scan"
