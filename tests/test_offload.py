"""Offloaded tail layers on tiny configs: prefetch scan against the resident scan, placement, the
engine arguments, and the transfers of the decode step exported for GPU."""

import collections
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier import offload
import jaxtier
from jaxtier.engine.padded import model_step
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.model import Transformer, scan_layers
from jaxtier.model.config import ModelConfig
from jaxtier.model.rotary import rotary_tables
from jaxtier.sampling import SamplingArrays, SamplingParams
from jaxtier.tools import hlo
from conftest import fixture_path

GREEDY = jaxtier.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def tiny_config(num_layers: int) -> ModelConfig:
  return ModelConfig(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                     num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=64)


@functools.lru_cache(maxsize=None)
def tiny_model(num_layers: int) -> Transformer:
  return Transformer(tiny_config(num_layers), rngs=nnx.Rngs(0))


def _cache(config, batch, length):
  return ContiguousKVCache.create(config.num_layers, batch, length, config.num_kv_heads,
                                  config.head_dim)


@nnx.jit
def forward(model, cache, tokens_bt, pos_bt):
  return model(tokens_bt, pos_bt, cache)


def _inputs(config, batch=2, length=10, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, length)), jnp.int32)
  pos = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length)).copy()
  pos[1, 7:] = -1  # a padded row: no cache writes there
  return tokens, jnp.asarray(pos)


@pytest.mark.parametrize("num, depth, order", [
    (1, 1, "auto"), (2, 2, "auto"), (5, 1, "auto"), (5, 2, "auto"), (5, 4, "auto"), (8, 3, "auto"),
    (9, 2, "auto"), (12, 4, "auto"), (5, 2, "data"), (9, 2, "none"), (12, 3, "none")])
def test_prefetch_scan_equals_scan_layers(num, depth, order):
  config = tiny_config(12)
  graphdef, stacked = nnx.split(tiny_model(12).layers)
  first = 12 - num
  tail = jax.tree.map(lambda a: a[first:], stacked)
  host = offload.to_memory_kind(tail, offload.PINNED_HOST)
  rng = np.random.default_rng(num * 10 + depth)
  x_bth = jnp.asarray(rng.normal(size=(2, 6, config.hidden_size)), jnp.float32)
  pos_bt = jnp.asarray(np.broadcast_to(np.arange(3, 9, dtype=np.int32), (2, 6)))
  cos, sin = rotary_tables(jnp.asarray(config.inv_freq()), pos_bt)
  shardings = [offload.layer_sharding(a.sharding, offload.DEVICE) for a in jax.tree.leaves(host)]

  @jax.jit
  def run(host, tail, x, cache):
    got = offload.prefetch_scan_layers(graphdef, host, x, cos, sin, cache, pos_bt, None, first,
                                       depth, device_shardings=shardings, order=order)
    want = scan_layers(graphdef, tail, x, cos, sin, cache, pos_bt, None, first)
    return got, want

  (x_got, cache_got), (x_want, cache_want) = run(host, tail, x_bth, _cache(config, 2, 16))
  np.testing.assert_allclose(x_got, x_want, atol=1e-6, rtol=0)
  np.testing.assert_allclose(cache_got.k_lbskd, cache_want.k_lbskd, atol=1e-6, rtol=0)
  np.testing.assert_allclose(cache_got.v_lbskd, cache_want.v_lbskd, atol=1e-6, rtol=0)


@pytest.mark.parametrize("num, depth, head", [(4, 1, "scan"), (4, 3, "unrolled"), (12, 2, "scan"),
                                              (7, 4, "unrolled")])
def test_offloaded_model_equals_stacked_model(num, depth, head):
  model = tiny_model(12)
  tokens, pos = _inputs(model.config)
  want = forward(model, _cache(model.config, 2, 16), tokens, pos)[0]
  placed = offload.offload_tail(model, num, depth, head)
  got = forward(placed, _cache(model.config, 2, 16), tokens, pos)[0]
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  by_kind = offload.bytes_by_memory_kind(nnx.state(placed))
  layer_bytes = model.config.layer_param_count * 4
  assert by_kind[offload.PINNED_HOST] == num * layer_bytes
  assert by_kind[offload.DEVICE] == offload.tree_bytes(nnx.state(model)) - num * layer_bytes


def test_offload_tail_rejects_bad_arguments():
  model = tiny_model(12)
  with pytest.raises(ValueError, match=r"offload_tail_layers=13: expected an int in \[0, 12\]"):
    offload.offload_tail(model, 13, 1)
  with pytest.raises(ValueError, match=r"prefetch_depth=5: expected an int in \[1, 4\]"):
    offload.offload_tail(model, 6, 5)
  with pytest.raises(ValueError, match="prefetch_depth=3 is more than the 2 offloaded layer"):
    offload.offload_tail(model, 2, 3)
  with pytest.raises(ValueError, match="order='early'"):
    offload.offload_tail(model, 2, 1, order="early")
  with pytest.raises(ValueError, match="memory_kind='hbm' is not a memory kind"):
    offload.offload_tail(model, 2, 1, memory_kind="hbm")


@pytest.fixture(scope="module")
def tiny_llms():
  kwargs = dict(max_num_seqs=2, layer_execution="scan")
  return (jaxtier.LLM(fixture_path("tiny_llama"), **kwargs),
          jaxtier.LLM(fixture_path("tiny_llama"), offload_tail_layers=2, prefetch_depth=2,
                      **kwargs))


def test_engine_offload_generates_the_same_tokens_and_keeps_the_tail_on_host(tiny_llms):
  resident, offloaded = tiny_llms
  prompts = ["Rotary embeddings rotate", "Caches page blocks", [5, 17, 42]]
  assert ([o.token_ids for o in offloaded.generate(prompts, GREEDY)]
          == [o.token_ids for o in resident.generate(prompts, GREEDY)])
  tail = nnx.state(nnx.merge(offloaded.graphdef, offloaded.state).groups[1])
  assert offload.memory_kinds(tail) == {offload.PINNED_HOST}
  rest = [a for a in jax.tree.leaves(offloaded.state)
          if not any(a is t for t in jax.tree.leaves(tail))]
  assert {a.sharding.memory_kind for a in rest} == {offload.DEVICE}


def test_memory_report_moves_the_tail_bytes_to_host(tiny_llms):
  resident, offloaded = tiny_llms
  before, after = resident.memory_report(), offloaded.memory_report()
  tail_bytes = 2 * resident.config.layer_param_count * 4
  assert before["host_weight_bytes"] == 0 and before["weight_transfer_bytes_per_step"] == 0
  assert after["device_weight_bytes"] == before["device_weight_bytes"] - tail_bytes
  assert after["host_weight_bytes"] == after["weight_transfer_bytes_per_step"] == tail_bytes
  assert after["prefetch_buffer_bytes"] == 3 * tail_bytes // 2
  assert after["device_kv_bytes"] == before["device_kv_bytes"] > 0
  assert (after["offload_tail_layers"], after["prefetch_depth"]) == (2, 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload_tail_layers=4), r"offload_tail_layers=4: expected 'auto' or an int in \[0, 3\]"),
    (dict(offload_tail_layers="all"), "offload_tail_layers='all'"),
    (dict(offload_tail_layers=1, prefetch_depth=0), r"prefetch_depth=0: expected 'auto' or an int"),
    (dict(offload_tail_layers=2, prefetch_depth=3), "prefetch_depth=3 is more than the 2"),
    (dict(offload_tail_layers="auto", device_memory_gb=0.0003, max_model_len=64),
     "Does not fit"),
    (dict(device_memory_gb=-1), "device_memory_gb=-1: expected a number > 0"),
])
def test_bad_offload_engine_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxtier.LLM(fixture_path("tiny_llama"), max_num_seqs=2, **kwargs)


def test_auto_offload_uses_the_planner_only_with_a_device_memory_budget():
  unknown = jaxtier.LLM(fixture_path("tiny_llama"), offload_tail_layers="auto", max_num_seqs=2)
  assert unknown.offload.offload_tail_layers == 0 and unknown.offload.plan is None
  tight = jaxtier.LLM(fixture_path("tiny_llama"), offload_tail_layers="auto", max_num_seqs=2,
                      max_model_len=64, device_memory_gb=0.0005)
  assert tight.offload.offload_tail_layers == tight.offload.plan.offload_tail_layers > 0
  assert tight.offload.prefetch_depth == 1  # CPU: see jaxtier.engine.sizing
  assert tight.memory_report()["host_weight_bytes"] == tight.offload.plan.host_weight_bytes


def test_auto_offload_offloads_nothing_when_weights_and_a_minimal_pool_fit():
  # Tiny model: 365,376 weight bytes, 115,888 activation reserve, 36,864 bytes of KV for one
  # 64-token sequence, 73,728 for max_num_seqs=2 of them. 90% of 600 kB fits the weights with one
  # sequence's pool but not with two whole sequences reserved.
  kwargs = dict(offload_tail_layers="auto", max_num_seqs=2, max_model_len=64)
  fits = jaxtier.LLM(fixture_path("tiny_llama"), device_memory_gb=0.0006, **kwargs)
  assert fits.offload.offload_tail_layers == 0
  assert fits.memory_report()["host_weight_bytes"] == 0
  pool = fits.memory_report()["device_kv_blocks"]
  assert pool * fits.block_bytes <= 0.9 * 600_000 - 365_376 - 115_888 and pool >= 4
  out = fits.generate([[5, 6, 7]], GREEDY)[0]
  assert len(out.token_ids) == GREEDY.max_tokens
  # A pool asked for explicitly is planned as it is: two sequences do not fit beside the weights.
  sized = jaxtier.LLM(fixture_path("tiny_llama"), device_memory_gb=0.0006, num_device_blocks=8,
                      **kwargs)
  assert sized.offload.offload_tail_layers > 0


def _decode_step_args(model, num, depth):
  graphdef, state = nnx.split(offload.offload_tail(model, num, depth))
  c = model.config
  cache = ContiguousKVCache.create(c.num_layers, 2, 32, c.num_kv_heads, c.head_dim)
  sampling = SamplingArrays.from_params([SamplingParams(temperature=0)] * 2, [0, 0], [0, 0])
  return graphdef, state, cache, jnp.ones((2, 1), jnp.int32), jnp.full((2, 1), 5, jnp.int32), \
      jnp.zeros(2, jnp.int32), sampling


def check_decode_step_transfers(model, num: int, depth: int) -> hlo.PlacementReport:
  """Exports the engine's decode step for cuda and checks its host -> device transfers."""
  args = _decode_step_args(model, num, depth)
  report = hlo.placement_report(hlo.exported_text(model_step, *args, platform="cuda"))
  layer_bytes = model.config.layer_param_count * jax.tree.leaves(args[1])[0].dtype.itemsize
  assert report.host_compute == ()
  assert all(t.destination == "device" and t.sources for t in report.transfers)
  assert sum(report.host_arguments.values()) == num * layer_bytes
  assert report.to_device_bytes_per_call() == num * layer_bytes
  for t in report.transfers:  # one layer's slice of one stacked parameter, never the whole stack
    assert t.nbytes * num == report.host_arguments[t.sources[0]]
  in_loop = report.to_device(in_loop=True)
  assert in_loop and {t.layers_ahead for t in in_loop} == {depth}
  per_iteration = sum(t.nbytes for t in in_loop)
  assert per_iteration == (depth + 1) * layer_bytes and len({t.loops for t in in_loop}) == 1
  lead = (num - depth) % (depth + 1)
  assert sum(t.nbytes for t in report.to_device(in_loop=False)) == (depth + lead) * layer_bytes
  return report


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_exported_decode_step_streams_exactly_the_tail_d_layers_ahead(depth):
  check_decode_step_transfers(tiny_model(30), 10, depth)


def test_placement_report_flags_host_compute_and_whole_stack_transfers():
  dev = jax.devices()[0]
  host_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind=offload.PINNED_HOST)
  device_sharding = host_sharding.with_memory_kind(offload.DEVICE)
  stack = jax.device_put(jnp.ones((4, 8, 8)), host_sharding)

  def naive(stack, x):  # moves the whole stack every iteration and reduces on the host
    def body(x, i):
      w = jax.device_put(stack, device_sharding)[i]
      return jnp.tanh(x @ w), None
    return jax.lax.scan(body, x, jnp.arange(4))[0] + stack.sum()

  report = hlo.placement_report(hlo.exported_text(jax.jit(naive), stack, jnp.ones((2, 8))))
  assert [t.nbytes for t in report.to_device(in_loop=True)] == [4 * 8 * 8 * 4]
  assert report.to_device_bytes_per_call() == 4 * stack.nbytes
  assert any(op.startswith("stablehlo.reduce") for op in report.host_compute)


def test_cpu_prefetch_scan_copies_no_weights():
  """XLA copies carry slots whose refill it cannot order after their read; the CPU fetch order
  (see jaxtier.offload.prefetch) must leave no weight-sized copy in the compiled step."""
  model = tiny_model(12)
  for depth in (1, 2, 3):
    args = _decode_step_args(model, 8, depth)
    text = model_step.lower(*args).compile().as_text()
    weight_shapes = {f"f32[{','.join(map(str, a.shape[1:]))}]"
                     for a in jax.tree.leaves(args[1]) if a.ndim == 3}
    copies = collections.Counter(re.findall(r"= (f32\[[\d,]+\])\{[\d,]*\} copy\(", text))
    assert not weight_shapes & set(copies), (depth, copies)


def test_batch_script_offload_flags_give_the_same_outputs(tmp_path):
  script = os.path.join(os.path.dirname(__file__), "..", "scripts", "batch_infer.py")
  src = tmp_path / "in.jsonl"
  src.write_text(json.dumps({"id": 1, "prompt": "Hello"}) + "\n")

  def run(name, *flags):
    proc = subprocess.run([sys.executable, script, f"--model={fixture_path('tiny_llama')}",
                           f"--input={src}", f"--output={tmp_path / name}", "--max_tokens=4",
                           *flags], capture_output=True, text=True, timeout=300)
    return proc, (tmp_path / name).read_text() if proc.returncode == 0 else None

  _, resident = run("a.jsonl")
  proc, offloaded = run("b.jsonl", "--offload_tail_layers=2", "--prefetch_depth=1")
  assert offloaded == resident and '"host_weight_bytes": 166656' in proc.stderr
  proc, _ = run("c.jsonl", "--offload_tail_layers=some")
  assert proc.returncode != 0 and "offload_tail_layers='some': expected 'auto' or an int" in proc.stderr


class GatedBlock(nnx.Module):
  """A research model's layer, unrelated to jaxtier's decoder: a gated residual MLP that also
  counts how often it ran (a second carry leaf)."""

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.up = nnx.Linear(width, 2 * width, rngs=rngs)
    self.down = nnx.Linear(width, width, rngs=rngs)
    self.scale = nnx.Param(jnp.ones((width,)))

  def __call__(self, x, bias):
    a, b = jnp.split(self.up(x), 2, axis=-1)
    return x + self.scale * self.down(jax.nn.silu(a) * b) + bias


def _stacked_blocks(num: int, width: int) -> GatedBlock:
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return GatedBlock(width, nnx.Rngs(key))
  return make(jax.random.split(jax.random.key(1), num))


def _block_fn(layer, carry, j, bias):
  x, count = carry
  return layer(x, bias * (j + 1)), count + 1


@pytest.mark.parametrize("num, depth", [(5, 1), (6, 2), (3, 3)])
def test_a_research_models_own_stack_offloads_through_a_layer_function(num, depth):
  stack = _stacked_blocks(num, 16)
  x = jax.random.normal(jax.random.key(2), (3, 16))
  bias = jnp.float32(0.01)
  graphdef, state = nnx.split(stack)

  def reference(carry):  # the resident loop: layer j is a slice of the resident stack
    for j in range(num):
      layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[j], state))
      carry = _block_fn(layer, carry, j, bias)
    return carry

  want_x, want_count = reference((x, jnp.int32(0)))
  offloaded = offload.OffloadedStack(stack, _block_fn, depth)
  assert offload.memory_kinds(nnx.state(offloaded.layers)) == {offload.PINNED_HOST}
  run = nnx.jit(lambda module, carry, b: module(carry, b))
  got_x, got_count = run(offloaded, (x, jnp.int32(0)), bias)
  np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-5, atol=1e-5)
  assert int(got_count) == num
  assert offload.memory_kinds(nnx.state(offloaded.layers)) == {offload.PINNED_HOST}
  with pytest.raises(ValueError, match="prefetch_depth"):
    offload.OffloadedStack(stack, _block_fn, num + 1)
