"""The default model with 10 of its 30 layers offloaded: the same greedy tokens and logits as the
resident model at prefetch depths 1-3, the memory report, the exported decode step's transfers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier import checkpoint, offload
import jaxtier
from jaxtier.engine.padded import generate_batch
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.scheduler import Request
from conftest import DEFAULT_MODEL
from test_offload import check_decode_step_transfers

pytestmark = pytest.mark.slow
OFFLOADED = 10
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th"]
GREEDY = jaxtier.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
  return checkpoint.load_model(DEFAULT_MODEL)


@nnx.jit
def logits_of(model, tokens_bt):
  b, t = tokens_bt.shape
  c = model.config
  cache = ContiguousKVCache.create(c.num_layers, b, t, c.num_kv_heads, c.head_dim)
  return model(tokens_bt, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), cache)[0]


def greedy(model, tokenizer) -> list[tuple[int, ...]]:
  graphdef, state = nnx.split(model)
  requests = [Request.of(i, tokenizer.encode(p), GREEDY, 0) for i, p in enumerate(PROMPTS)]
  return [c.token_ids for c in generate_batch(graphdef, state, tokenizer, requests, 256,
                                              jnp.float32)]


@pytest.fixture(scope="module")
def resident(loaded):
  model, tokenizer = loaded
  ids = jnp.asarray(tokenizer.encode(PROMPTS[0]))[None]
  return greedy(model, tokenizer), np.asarray(logits_of(model, ids)), ids


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_offloaded_greedy_tokens_and_logits_equal_resident(loaded, resident, depth):
  model, tokenizer = loaded
  tokens, logits, ids = resident
  placed = offload.offload_tail(model, OFFLOADED, depth)
  assert greedy(placed, tokenizer) == tokens
  got = np.asarray(logits_of(placed, ids))
  np.testing.assert_allclose(got, logits, atol=1e-5 * np.abs(logits).max(), rtol=0)


def test_memory_report_and_placement_after_generate(smollm_llm):
  llm = jaxtier.LLM(DEFAULT_MODEL, max_model_len=2048, layer_execution="scan",
                    offload_tail_layers=OFFLOADED, prefetch_depth=2)
  c = llm.config
  # Scanned layers keep the file's Q4_1 blocks as 4-bit values (two a byte) with a float32 scale
  # and minimum per 32 (0.75 bytes a weight), their two norms float32; on the device the tied
  # table (the packed LM head in its Q8_0 blocks, 1.125 bytes a weight), the final norm, the
  # rotary table and 20 layers. Float32 layers would be 141,603,840 bytes on the host.
  projections = c.layer_param_count - 2 * c.hidden_size
  layer_bytes = projections * 3 // 4 + 2 * c.hidden_size * 4
  after = llm.memory_report()
  resident = c.vocab_size * c.hidden_size * 9 // 8 + (c.hidden_size + c.head_dim // 2) * 4
  assert after["device_weight_bytes"] == resident + (c.num_layers - OFFLOADED) * layer_bytes
  assert after["host_weight_bytes"] == after["weight_transfer_bytes_per_step"] \
      == OFFLOADED * layer_bytes == 26_588_160
  llm.generate(PROMPTS[0], jaxtier.SamplingParams(max_tokens=2, temperature=0))
  kinds = [a.sharding.memory_kind for a in jax.tree.leaves(llm.state)]
  assert kinds.count(offload.PINNED_HOST) == 23  # the tail's stacked tensors: 7 x 3 and 2 norms
  assert llm.memory_report() == after


def test_auto_offload_plans_the_resident_layers_as_held():
  """With 0.2 GB of device memory, `offload_tail_layers="auto"` sizes the resident layers and
  head in the GGUF blocks the engine keeps (112 MB in all, not 538 MB of float32) and offloads
  float32 layers from the tail until the rest and two prefetch buffers fit: the plan's device
  and host weight bytes are what the loaded model holds."""
  llm = jaxtier.LLM(DEFAULT_MODEL, max_model_len=1024, max_num_seqs=4, device_memory_gb=0.2,
                    offload_tail_layers="auto", gpu_memory_utilization=1.0)
  plan, report = llm.offload.plan, llm.memory_report()
  assert plan.model.weight_bytes < 120e6  # blocks: float32 would be ~540 MB
  assert 0 < llm.offload.offload_tail_layers < llm.config.num_layers
  assert plan.device_weight_bytes <= plan.resident_budget_bytes
  assert plan.device_weight_bytes - plan.prefetch_buffer_bytes == report["device_weight_bytes"]
  assert plan.host_weight_bytes == report["host_weight_bytes"]
  out = llm.generate(PROMPTS[0], jaxtier.SamplingParams(max_tokens=4, temperature=0))[0]
  assert len(out.token_ids) == 4


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_exported_decode_step_streams_exactly_the_offloaded_bytes(loaded, depth):
  report = check_decode_step_transfers(loaded[0], OFFLOADED, depth)
  assert report.to_device_bytes_per_call() == 141_603_840


def test_dry_run_plans_what_the_default_model_holds(smollm_llm):
  """The plan before loading (kept GGUF blocks counted from the file's tensor types) equals what
  the loaded engine holds, with and without an offloaded tail."""
  from jaxtier.llm import dry_run  # pylint: disable=import-outside-toplevel
  runtime = {"kv_swap_bytes_per_step", "kv_swap_bytes_max_step", "weight_bytes_by_format"}
  plan, report = dry_run(DEFAULT_MODEL, max_model_len=2048), smollm_llm.memory_report()
  shared = set(plan) & set(report) - runtime
  assert set(report) - runtime <= shared
  assert {k: plan[k] for k in shared} == {k: report[k] for k in shared}
  kwargs = dict(max_model_len=256, max_num_seqs=2, offload_tail_layers=10)
  plan = dry_run(DEFAULT_MODEL, **kwargs)
  report = jaxtier.LLM(DEFAULT_MODEL, **kwargs).memory_report()
  assert {k: plan[k] for k in shared} == {k: report[k] for k in shared}


def test_offloaded_tail_keeps_the_files_blocks_as_the_engine_runs_it(smollm_llm):
  """`LLM(offload_tail_layers=10)` on CPU: the tail is held per layer in the resident layers'
  block formats in pinned host memory (the file's Q4_1 blocks, 0.2-0.4 of the device's bytes;
  float32 layers were 1.27 of them), and its greedy tokens are the resident engine's."""
  llm = jaxtier.LLM(DEFAULT_MODEL, max_model_len=2048, offload_tail_layers=OFFLOADED)
  report = llm.memory_report()
  assert 0.2 <= report["host_weight_bytes"] / report["device_weight_bytes"] <= 0.4
  host = [a for a in jax.tree.leaves(llm.state) if a.sharding.memory_kind == offload.PINNED_HOST]
  assert {str(a.dtype) for a in host} - {"float32"}  # blocks, not floats
  assert sum(a.size * a.dtype.itemsize for a in host) == report["host_weight_bytes"]
  got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
  assert got == [o.outputs[0].token_ids for o in smollm_llm.generate(PROMPTS, GREEDY)]
