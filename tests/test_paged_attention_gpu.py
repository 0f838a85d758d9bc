"""The Pallas Triton paged attention kernel: interpret-mode numerics against the reference, and its
lowering for CUDA (on this CPU machine) to the Triton custom call.

Batches are ragged: a prefill chunk starting mid-sequence, a decode row padded with -1 positions,
an all-padding row, and a short chunk; tables are random permutations of the pool's pages with -1
for entries past a row's last page, so the page indirection is really exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxtier.attention.page_format import quantize_int8
from jaxtier.attention.pallas_gpu import TRITON_CALL, num_splits, paged_attention_gpu, plan
from jaxtier.attention.reference import paged_attention_reference

BLOCKS = 4  # table width m


def _positions(t: int, c: int) -> np.ndarray:
  """[4, t] positions: a chunk ending at the table's last slot, a decode row padded with -1, an
  all-padding row, and a short chunk from slot 0 (padded with -1 when t > 3)."""
  last = BLOCKS * c - 1
  pos_bt = np.full((4, t), -1, np.int32)
  pos_bt[0] = np.arange(last - t + 1, last + 1)
  pos_bt[1, 0] = c + 2
  short = min(t, 3)
  pos_bt[3, :short] = np.arange(short)
  return pos_bt


def _case(seed: int, t: int, g: int, kv: int, c: int, d: int, page_dtype, q_dtype):
  """Arguments (q, k, v, pages, pos, k_scales, v_scales) of one ragged batch."""
  rng = np.random.default_rng(seed)
  pos_bt = _positions(t, c)
  b = pos_bt.shape[0]
  f = b * BLOCKS + 3
  pages_bm = rng.permutation(f)[:b * BLOCKS].reshape(b, BLOCKS).astype(np.int32)
  last_block_b = np.maximum(pos_bt.max(axis=1), 0) // c
  pages_bm[np.arange(BLOCKS)[None, :] > last_block_b[:, None]] = -1  # unused entries
  k_kfcd, v_kfcd = (rng.standard_normal((kv, f, c, d), np.float32) for _ in range(2))
  scales = (None, None)
  if page_dtype == jnp.int8:
    (k_kfcd, k_scales), (v_kfcd, v_scales) = quantize_int8(k_kfcd), quantize_int8(v_kfcd)
    scales = (k_scales, v_scales)
  elif page_dtype == jnp.uint16:
    k_kfcd, v_kfcd = (jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16)
                      for x in (k_kfcd, v_kfcd))
  else:
    k_kfcd, v_kfcd = (jnp.asarray(x, page_dtype) for x in (k_kfcd, v_kfcd))
  q_btnd = jnp.asarray(rng.standard_normal((b, t, kv * g, d)), q_dtype)
  return (q_btnd, jnp.asarray(k_kfcd), jnp.asarray(v_kfcd), jnp.asarray(pages_bm),
          jnp.asarray(pos_bt), *scales)


def _check(args, tol: float) -> None:
  want = np.asarray(paged_attention_reference(*args), np.float32)
  got = np.asarray(paged_attention_gpu(*args, interpret=True), np.float32)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
  pos_bt = np.asarray(args[4])
  assert not got[pos_bt < 0].any(), "padding queries must give exact zeros"


@pytest.mark.parametrize("c,g,d", [(16, 3, 64), (32, 1, 12), (64, 4, 12), (8, 8, 64)])
def test_decode_float32(c, g, d):
  _check(_case(0, 1, g, 2, c, d, jnp.float32, jnp.float32), 1e-5)


@pytest.mark.parametrize("t,c,g,d", [(7, 16, 3, 12), (16, 32, 1, 64), (5, 64, 4, 64),
                                     (3, 16, 1, 12)])
def test_prefill_float32(t, c, g, d):
  _check(_case(1, t, g, 2, c, d, jnp.float32, jnp.float32), 1e-5)


@pytest.mark.parametrize("t,page_dtype,q_dtype,tol", [
    (6, jnp.bfloat16, jnp.bfloat16, 1e-2),
    (1, jnp.bfloat16, jnp.float32, 1e-2),  # bfloat16 pages under float32 queries
    (6, jnp.bfloat16, jnp.float32, 1e-2),
    (6, jnp.uint16, jnp.bfloat16, 1e-2),  # bfloat16 bit patterns
    (1, jnp.int8, jnp.float32, 1e-5),
    (6, jnp.int8, jnp.float32, 1e-5),
])
def test_page_dtypes(t, page_dtype, q_dtype, tol):
  _check(_case(2, t, 3, 3, 16, 64, page_dtype, q_dtype), tol)


def test_plan_pads_heads_to_a_power_of_two_not_sixteen():
  decode = plan(1, 3, 16, 64)
  assert (decode.gp, decode.rows, decode.use_dot) == (4, 4, False)
  prefill = plan(512, 3, 16, 64)
  assert prefill.use_dot and prefill.rows >= 16 and prefill.gp == 4
  for p, c in ((decode, 16), (prefill, 16), (plan(1, 1, 64, 12), 64), (plan(2, 3, 8, 80), 8)):
    slots = p.pages_per_step * c
    assert slots >= 16 and not slots & (slots - 1) and not p.dp & (p.dp - 1)


def test_decode_splits_rows_and_prefill_does_not():
  assert num_splits(1, 3, 256) > 1 and num_splits(1, 3, 2) == 2 and num_splits(7, 3, 256) == 1
  # the decode cases above run split: 4 rows x 2 kv heads over 2 or more steps
  assert num_splits(1, 8, 2) == 2


def test_rejects_mismatched_inputs():
  q, k, v, pages, pos, *_ = _case(0, 1, 3, 2, 16, 12, jnp.float32, jnp.float32)
  with pytest.raises(ValueError, match="pos_bt"):
    paged_attention_gpu(q, k, v, pages, pos[:, :0], interpret=True)


def _triton_calls(t: int, g: int, d: int, page_dtype, q_dtype) -> int:
  """How many Triton custom calls the CUDA export of one call holds."""
  shape = jax.ShapeDtypeStruct
  b, kv, f, c, m = 4, 3, 64, 16, 8
  args = [shape((b, t, kv * g, d), q_dtype), shape((kv, f, c, d), page_dtype),
          shape((kv, f, c, d), page_dtype), shape((b, m), jnp.int32), shape((b, t), jnp.int32)]
  if page_dtype == jnp.int8:
    args += [shape((kv, f, c), jnp.float32)] * 2
  exported = export.export(jax.jit(paged_attention_gpu), platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
  return exported.mlir_module().count(TRITON_CALL)


@pytest.mark.parametrize("t,g,d,page_dtype,q_dtype", [
    (1, 3, 64, jnp.bfloat16, jnp.bfloat16),
    (1, 3, 12, jnp.bfloat16, jnp.float32),
    (1, 1, 80, jnp.int8, jnp.float32),
    (37, 3, 64, jnp.bfloat16, jnp.bfloat16),
    (37, 3, 12, jnp.float32, jnp.float32),
    (512, 3, 64, jnp.uint16, jnp.bfloat16),
    (64, 4, 128, jnp.int8, jnp.bfloat16),
])
def test_lowers_for_cuda_to_triton(t, g, d, page_dtype, q_dtype):
  assert _triton_calls(t, g, d, page_dtype, q_dtype) >= 1


# Through the engine: the kernel in interpret mode gives the reference paths' greedy tokens.

def _greedy(llm, prompts, max_tokens):
  import jaxtier  # pylint: disable=import-outside-toplevel
  params = jaxtier.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
  return [list(o.token_ids) for o in llm.generate(prompts, params)]


def test_tiny_head_dim_12_engine_runs_the_kernel_with_the_xla_paths_tokens():
  """The tiny Llama (head_dim 12, 2 query heads per kv head): prompts long enough to prefill in
  several chunks and swap under a small pool, through the kernel and through the CPU's XLA loop."""
  import jaxtier  # pylint: disable=import-outside-toplevel
  from conftest import fixture_path  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 300, n).tolist() for n in (5, 40, 17, 1)]
  kwargs = dict(kernels="portable", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
                num_device_blocks=12, preemption_mode="swap")
  kernel = jaxtier.LLM(fixture_path("tiny_llama"), attention_impl="pallas_interpret", **kwargs)
  assert kernel.engine.cache.config.attention_impl == "pallas_interpret"
  reference = jaxtier.LLM(fixture_path("tiny_llama"), attention_impl="xla", **kwargs)
  assert _greedy(kernel, prompts, 24) == _greedy(reference, prompts, 24)


@pytest.mark.slow
def test_default_model_through_the_kernel_gives_hugging_faces_greedy_tokens():
  """The default model (3 query heads per kv head, head_dim 64) in interpret mode, a 58-token
  prompt prefilled in chunks beside a short one, against Hugging Face's greedy tokens."""
  import json  # pylint: disable=import-outside-toplevel
  import jaxtier  # pylint: disable=import-outside-toplevel
  from conftest import DEFAULT_MODEL, fixture_path  # pylint: disable=import-outside-toplevel
  with open(fixture_path("smollm2_hf.json"), encoding="utf-8") as f:
    all_cases = json.load(f)["cases"]
  cases = [all_cases[i] for i in (0, 7)]
  llm = jaxtier.LLM(DEFAULT_MODEL, kernels="portable", attention_impl="pallas_interpret",
                    max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
  assert _greedy(llm, [c["ids"] for c in cases], len(cases[0]["greedy"])) == [
      c["greedy"] for c in cases]
