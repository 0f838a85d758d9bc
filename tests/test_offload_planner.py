"""The offload planner: the article's arithmetic, memory fit, the step simulation, presets, and the
byte budget it hands the scheduler."""

import dataclasses
import math

import pytest
from hypothesis import given, strategies as st

from jaxtier import offload
from jaxtier.model.config import ModelConfig
from jaxtier.offload import planner
from jaxtier.scheduler import SchedulerConfig, policies

ARTICLE = offload.ModelBytes(num_layers=32, layer_bytes=500_000_000)  # 32 layers of 0.5 GB
SMOLLM = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                     intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                     head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)


def article_plan(compute_s: float, **kwargs):
  # 80 GB device, 70 GB of KV: 10 GB for 16 GB of weights, so layers must go to the host.
  kwargs = dict(device_memory_bytes=80_000_000_000, kv_reserve_bytes=70_000_000_000) | kwargs
  return offload.plan(ARTICLE, link_bytes_per_s=22e9, layer_compute_s=compute_s, **kwargs)


def test_article_transfer_time_per_layer():
  assert article_plan(0.040).transfer_layer_s == pytest.approx(0.0227, abs=1e-4)  # ~23 ms


def test_article_40ms_compute_is_hidden_by_one_layer_of_prefetch():
  p = article_plan(0.040)
  assert p.prefetch_depth == 1 and p.hidden and p.fits
  assert p.predicted_step_s == pytest.approx(32 * 0.040)
  assert p.step_time_bound_s == pytest.approx(max(32 * 0.040, p.host_weight_bytes / 22e9))
  assert "transfers hide behind compute" in p.message()


def test_article_10ms_compute_cannot_hide_and_says_offload_fewer():
  p = article_plan(0.010)
  assert p.prefetch_depth == math.ceil(0.0227 / 0.010) == 3
  assert not p.hidden and p.max_hidden_layers < p.offload_tail_layers
  assert p.predicted_step_s > p.compute_step_s
  assert "cannot be hidden" in p.message() and "Offload fewer layers" in p.message()
  assert f"at most {p.max_hidden_layers} can be hidden" in p.message()


def test_offloaded_layers_follow_w_against_m_minus_k_minus_a():
  p = article_plan(0.040)
  # W = 16 GB, M - K - A = 10 GB, d = 1: 16 - 0.5 n + 2 x 0.5 <= 10  ->  n >= 14.
  assert p.resident_budget_bytes == 10_000_000_000 and p.offload_tail_layers == 14
  assert p.device_weight_bytes <= p.resident_budget_bytes
  assert article_plan(0.040, kv_reserve_bytes=60_000_000_000).offload_tail_layers == 0
  assert "nothing to offload" in article_plan(0.040, kv_reserve_bytes=60_000_000_000).message()
  tight = article_plan(0.040, kv_reserve_bytes=79_000_000_000, activation_reserve_bytes=500_000_000)
  assert not tight.fits and "Does not fit" in tight.message()


def test_resident_layer_bytes_shrink_only_what_stays_resident():
  """Layers held resident in fewer bytes (kept GGUF blocks) than the float `layer_bytes` their
  offloaded copies move: uniform resident bytes equal to `layer_bytes` plan exactly as none; a
  quarter of them fit 16 GB of layers in 10 GB with fewer layers offloaded, each offloaded layer
  still moving and buffering its float bytes."""
  model = planner.ModelBytes(num_layers=32, layer_bytes=500_000_000)
  args = dict(device_memory_bytes=10_000_000_000, link_bytes_per_s=22e9, layer_compute_s=0.040)
  same = dataclasses.replace(model, resident_layer_bytes=(500_000_000,) * 32)
  assert planner.plan(same, **args) == dataclasses.replace(planner.plan(model, **args),
                                                           model=same)
  kept = dataclasses.replace(model, resident_layer_bytes=(125_000_000,) * 32)
  assert kept.weight_bytes == 4_000_000_000
  assert planner.plan(kept, **args).offload_tail_layers == 0
  # 6 GB: every n fitting R(32 - n) + 2 x 0.5 GB <= 6 GB, by enumeration: n >= 0 would need 4 GB
  # (no offload: no buffers), so still 0; at 3.5 GB, 0.125 (32 - n) + 1 <= 3.5 -> n >= 12.
  small = planner.plan(kept, **{**args, "device_memory_bytes": 3_500_000_000})
  fits = [n for n in range(1, 33) if 125_000_000 * (32 - n) + 2 * 500_000_000 <= 3_500_000_000]
  assert small.offload_tail_layers == min(fits) == 12 and small.prefetch_depth == 1
  assert small.host_weight_bytes == 12 * 500_000_000
  assert small.device_weight_bytes == 20 * 125_000_000 + 2 * 500_000_000
  mixed = dataclasses.replace(model, resident_layer_bytes=(100_000_000,) * 16 + (200_000_000,) * 16)
  assert mixed.resident_bytes(range(14, 18)) == 2 * 100_000_000 + 2 * 200_000_000
  with pytest.raises(ValueError, match="resident_layer_bytes: 3 entries, expected num_layers=32"):
    dataclasses.replace(model, resident_layer_bytes=(1, 2, 3))
  with pytest.raises(ValueError, match="resident_layer_bytes"):
    dataclasses.replace(model, resident_layer_bytes=(0,) * 32)


def test_fixed_depth_is_used_for_the_memory_fit_and_the_prediction():
  derived, fixed = article_plan(0.010), article_plan(0.010, prefetch_depth=1)
  # 10 GB for the resident weights: d = 3 needs 16 - 0.5 n + 4 x 0.5 <= 10 -> n >= 16; d = 1: 14.
  assert (derived.prefetch_depth, derived.offload_tail_layers) == (3, 16)
  assert (fixed.prefetch_depth, fixed.offload_tail_layers) == (1, 14)
  assert fixed.predicted_step_s > 14 * fixed.transfer_layer_s  # one layer ahead cannot hide 23 ms
  assert article_plan(0.010, offload_tail_layers=2, prefetch_depth=4).prefetch_depth == 2


def test_fixed_offload_only_chooses_depth_and_predicts():
  p = article_plan(0.010, offload_tail_layers=4)
  assert (p.offload_tail_layers, p.prefetch_depth) == (4, 3) and p.hidden


@pytest.mark.parametrize("name", sorted(offload.PRESETS))
def test_presets_plan_the_default_model(name):
  model = offload.ModelBytes.from_config(SMOLLM, "bfloat16")
  decode = offload.plan_on(name, model, batch=1, context=256)
  assert decode.offload_tail_layers == 0 and decode.fits  # 270 MB fits any of them
  forced = offload.plan_on(name, model, batch=1, context=256, offload_tail_layers=10)
  assert forced.host_weight_bytes == 10 * model.layer_bytes
  assert not forced.hidden  # batch-1 decode reads a layer in microseconds: the link cannot keep up
  prefill = offload.plan_on(name, model, batch=64, tokens=2048, context=0, offload_tail_layers=10)
  assert prefill.hidden  # 131k tokens of compute per layer hide its transfer


def test_model_bytes_from_config():
  m = offload.ModelBytes.from_config(SMOLLM, "float32")
  assert m.layer_bytes == SMOLLM.layer_param_count * 4 == 14_160_384
  # tied embeddings: one table; the final norm; 32 float32 rotary frequencies
  assert m.other_bytes == (49152 * 576 + 576) * 4 + 32 * 4
  assert m.kv_bytes_per_token == 2 * 3 * 64 * 4 * 30
  int8 = offload.ModelBytes.from_config(SMOLLM, "bfloat16", kv_cache_dtype="int8")
  assert int8.kv_bytes_per_token == 2 * 3 * (64 * 1 + 4) * 30  # int8 values and a float32 scale
  assert offload.ModelBytes.from_config(SMOLLM, "float16").kv_bytes_per_token == 2 * 3 * 64 * 2 * 30
  with pytest.raises(ValueError, match="dtype='float64'"):
    offload.ModelBytes.from_config(SMOLLM, "float64")
  with pytest.raises(ValueError, match="kv_cache_dtype='float16'"):
    offload.ModelBytes.from_config(SMOLLM, "float32", kv_cache_dtype="float16")


@pytest.mark.parametrize("kwargs, match", [
    (dict(layer_compute_s=0), "layer_compute_s=0: expected a positive number"),
    (dict(link_bytes_per_s=-1.0), "link_bytes_per_s=-1.0"),
    (dict(device_memory_bytes=0), "device_memory_bytes=0: expected an int >= 1"),
    (dict(kv_reserve_bytes=-5), "kv_reserve_bytes=-5"),
    (dict(offload_tail_layers=40), "offload_tail_layers=40: expected at most num_layers=32"),
])
def test_plan_validates_its_inputs(kwargs, match):
  args = dict(device_memory_bytes=10**11, link_bytes_per_s=22e9, layer_compute_s=0.01) | kwargs
  with pytest.raises(ValueError, match=match):
    offload.plan(ARTICLE, **args)


def test_unknown_preset_lists_the_presets():
  with pytest.raises(ValueError, match="hardware='a100' is not a preset; expected one of"):
    offload.preset("a100")


@given(total=st.integers(1, 40), offloaded=st.integers(0, 40), depth=st.integers(1, 4),
       compute=st.floats(1e-4, 1.0), transfer=st.floats(0.0, 1.0), kv=st.floats(0.0, 1.0))
def test_simulated_step_never_beats_the_bound(total, offloaded, depth, compute, transfer, kv):
  offloaded = min(offloaded, total)
  depth = min(depth, offloaded) if offloaded else 0
  step = offload.simulate_step(total, offloaded, depth, compute, transfer, kv)
  assert step >= total * compute * (1 - 1e-9)
  if offloaded:
    assert step >= (kv + offloaded * transfer + compute) * (1 - 1e-9)


def test_kv_swaps_take_the_link_first():
  quiet = article_plan(0.040, offload_tail_layers=14)
  busy = article_plan(0.040, offload_tail_layers=14, kv_swap_bytes_per_step=30_000_000_000)
  assert busy.predicted_step_s > quiet.predicted_step_s
  assert busy.step_time_bound_s == pytest.approx((30e9 + 7e9) / 22e9)  # link-bound now


def test_scheduler_link_fields_leave_the_weights_their_bytes():
  p = article_plan(0.040)
  fields = offload.scheduler_link_fields(p)
  config = SchedulerConfig(num_device_blocks=64, num_host_blocks=64, block_size=16,
                           max_num_seqs=256, max_num_batched_tokens=2048, watermark=0.0,
                           preemption_mode="swap", victim_policy="longest_waiting",
                           enable_prefix_caching=False, host_prefix_caching=True,
                           block_bytes=1 << 20, **fields)
  wanted = p.weight_transfer_bytes_per_step
  granted = policies.weight_prefetch_bytes(config.link_bytes_per_step, config.kv_link_share, 0,
                                           config.weight_prefetch_bytes_per_step)
  assert fields["weight_prefetch_bytes_per_step"] == wanted == granted
  assert policies.kv_link_budget(config.link_bytes_per_step, config.kv_link_share) \
      <= config.link_bytes_per_step - wanted


def test_depth_is_ceil_transfer_over_compute_clipped():
  assert planner.depth_for(0.023, 0.040, 10) == 1
  assert planner.depth_for(0.023, 0.010, 10) == 3
  assert planner.depth_for(1.0, 0.010, 10) == offload.MAX_DEPTH
  assert planner.depth_for(1.0, 0.010, 2) == 2
  assert planner.depth_for(1.0, 0.010, 0) == 0
