"""Engine arguments: every bad value is rejected before a model loads, naming the valid range; the
scripts keep compiled programs on disk."""

import os
import subprocess
import sys

import pytest

import jaxtier
from jaxtier.engine import args as engine_args
from jaxtier.engine import sizing
from jaxtier.engine.args import EngineArgs


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), r"block_size=0: expected an int in \[1, 1024\]"),
    (dict(num_device_blocks=1), r"num_device_blocks=1: expected an int >= 2"),
    (dict(num_device_blocks=8, kv_cache_memory_gb=1.0), "at most one of the two"),
    (dict(num_host_blocks=-1), r"num_host_blocks=-1: expected an int >= 0"),
    (dict(swap_space_gb=-2.0), r"swap_space_gb=-2.0: expected a number >= 0"),
    (dict(kv_cache_dtype="fp8"), r"kv_cache_dtype='fp8': expected one of \('auto', 'float32'"),
    (dict(preemption_mode="drop"), r"preemption_mode='drop': expected one of \('swap', "),
    (dict(watermark=1.0), r"watermark=1.0: expected a number in \[0, 1\)"),
    (dict(victim_policy="random"), r"victim_policy='random': expected one of"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4),
     r"max_num_batched_tokens=4: expected an int >= 8"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization=0: expected a number in \(0, 1\]"),
    (dict(prefetch_depth=5), r"prefetch_depth=5: expected 'auto' or an int in \[1, 4\]"),
    (dict(offload_tail_layers=-1), r"offload_tail_layers=-1: expected 'auto' or an int >= 0"),
    (dict(max_model_len=1), r"max_model_len=1: expected an int >= 2"),
    (dict(attention_impl="flash"), r"attention_impl='flash': expected one of \('auto', 'xla'"),
    (dict(attention_impl="cpu", tensor_parallel_size=3), r"attention_impl='cpu' runs on one device"),
    (dict(block_activations="int8"), r"block_activations='int8': expected one of \('auto', "
                                     r"'float32', 'int16'\)"),
])
def test_bad_engine_arguments_are_named_with_their_range(kwargs, match):
  with pytest.raises(ValueError, match=match):
    EngineArgs(**kwargs)
  with pytest.raises(ValueError, match=match):  # before the model (which does not exist) loads
    jaxtier.LLM("no/such/model", **kwargs)


def test_unknown_engine_argument_is_a_type_error():
  with pytest.raises(TypeError, match="max_batch"):
    EngineArgs(max_batch=4)


def test_pool_too_small_for_one_sequence_is_an_error_at_start_up():
  from conftest import fixture_path
  with pytest.raises(ValueError, match=r"holds 3 blocks .* max_model_len=64 tokens needs 4"):
    jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=64, num_device_blocks=3)


def test_scripts_keep_compiled_programs_in_the_model_cache(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAXTIER_CACHE_DIR"] = str(tmp_path)
  code = ("from jaxtier.engine import flags as engine_flags; engine_flags.enable_compilation_cache(); import jax; "
          "print(jax.config.jax_compilation_cache_dir)")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout.strip()
  assert out == os.path.join(str(tmp_path), "xla")


def test_cpu_default_pools_fit_short_requests_and_one_full_sequence():
  block = 737_280  # the default model's float32 block of 16 tokens
  cap = int(engine_args.CPU_DEFAULT_KV_GB * engine_args.GB // block)
  # 64 requests of 2048 tokens pass the cap, and one 8192-token sequence needs more than it.
  assert sizing.cpu_default_pool_blocks(64, 8192, 16, block) == (512, 128)
  assert sizing.cpu_default_pool_blocks(64, 2048, 16, block) == (cap, cap // 4)
  # Few short requests: room for each, within the cap.
  assert sizing.cpu_default_pool_blocks(4, 256, 16, block) == (64, 16)
  assert sizing.cpu_default_pool_blocks(1, 100, 16, 4608) == (7, 1)
