"""The CPU attention kernels (decode: one query token per row; prefill: several) against an
independent numpy attention over hand-gathered blocks (the helpers of test_paged_attention.py),
and the choice of attention path.

Skipped only where no C++ compiler exists; a kernel that fails to build is a failure.
"""

import types

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.kvcache import dequantize_int8, paged_attention_cpu, quantize_int8
from jaxtier.kvcache.paged import resolve_attention_impl
from jaxtier.model import sharding
from tests.test_paged_attention import expected, make_case

pytestmark = pytest.mark.usefixtures("built_cpu_kernels")  # built once per session


def test_kernel_builds():
  assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


def run(q, kp, vp, table, pos, *scales):
  return np.asarray(paged_attention_cpu(*map(jnp.asarray, (q, kp, vp, table, pos)), *scales))


def stored(kp, vp, pages: str):
  """float32 pages as the cache stores them ("float32", "int8" or "bfloat16"): (k, v, the int8
  scales or (), and the float32 values the reference attends over)."""
  if pages == "int8":
    (kq, ks), (vq, vs) = quantize_int8(jnp.asarray(kp)), quantize_int8(jnp.asarray(vp))
    k_ref, v_ref = np.asarray(dequantize_int8(kq, ks)), np.asarray(dequantize_int8(vq, vs))
    return kq, vq, (ks, vs), k_ref, v_ref
  if pages == "bfloat16":
    kb, vb = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
    return kb, vb, (), np.asarray(kb, np.float32), np.asarray(vb, np.float32)
  return kp, vp, (), kp, vp


@pytest.mark.parametrize("c", [1, 16, 32])
@pytest.mark.parametrize("g", [1, 3, 8])
@pytest.mark.parametrize("d", [8, 64, 72, 128])
def test_decode_matches_dense(c, g, d):
  """Head dims below, at and past the kernel's 16-lane dot (a remainder loop), and the two
  (64, 128) whose query and output vectors the kernel holds in registers."""
  rng = np.random.default_rng(c * 10 + g + d)
  case = make_case(rng, b=3, t=1, kv=2, g=g, d=d, c=c, lengths=[1, 37, 300])
  np.testing.assert_allclose(run(*case), expected(*case), atol=1e-5, rtol=1e-5)


def test_many_rows_split_over_threads_with_padding_rows():
  """Enough visible slots that helper threads take part; every row lands in its own place."""
  rng = np.random.default_rng(5)
  lengths = rng.integers(1, 400, size=40).tolist()
  q, kp, vp, table, pos = make_case(rng, b=40, t=1, kv=3, g=3, d=64, c=16, lengths=lengths)
  padding = [0, 17, 39]
  pos[padding] = -1
  out = run(q, kp, vp, table, pos)
  np.testing.assert_allclose(out, expected(q, kp, vp, table, pos), atol=1e-5, rtol=1e-5)
  assert np.all(out[padding] == 0)


def test_wide_tables():
  """A table padded far past each sequence (the engine buckets table widths)."""
  rng = np.random.default_rng(7)
  q, kp, vp, table, pos = make_case(rng, b=2, t=1, kv=2, g=2, d=8, c=4, lengths=[3, 9],
                                    num_pages=64)
  wide = np.full((2, 64), -1, np.int32)
  wide[:, :table.shape[1]] = table
  np.testing.assert_allclose(run(q, kp, vp, wide, pos), expected(q, kp, vp, table, pos),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pages", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("lengths", [[256], [257, 3], [1000], [2048, 600, 1]])
def test_long_rows_of_small_batches(lengths, pages):
  """Few rows of up to 2048 slots (more items than threads only through the kv heads) in each
  page type; a padding row beside them stays zero."""
  rng = np.random.default_rng(len(lengths) * 7 + lengths[0])
  q, kp, vp, table, pos = make_case(rng, b=len(lengths) + 1, t=1, kv=3, g=3, d=64, c=16,
                                    lengths=lengths + [5])
  pos[-1] = -1
  k, v, scales, k_ref, v_ref = stored(kp, vp, pages)
  out = run(q, k, v, table, pos, *scales)
  np.testing.assert_allclose(out, expected(q, k_ref, v_ref, table, pos), atol=1e-5, rtol=1e-5)
  assert np.all(out[-1] == 0)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_int8_equals_attention_on_dequantized_values(d):
  rng = np.random.default_rng(1)
  q, kp, vp, table, pos = make_case(rng, b=3, t=1, kv=2, g=3, d=d, c=4, lengths=[5, 30, 13])
  k, v, scales, k_deq, v_deq = stored(kp, vp, "int8")
  out = run(q, k, v, table, pos, *scales)
  np.testing.assert_allclose(out, expected(q, k_deq, v_deq, table, pos), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("stored", ["bfloat16", "uint16"])
def test_bfloat16_pages(stored, d):
  """bfloat16 pages, given as such or as the uint16 bit patterns the CPU cache stores."""
  rng = np.random.default_rng(2)
  q, kp, vp, table, pos = make_case(rng, b=2, t=1, kv=1, g=8, d=d, c=16, lengths=[9, 40])
  kb, vb = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
  want = expected(q, np.asarray(kb, np.float32), np.asarray(vb, np.float32), table, pos)
  if stored == "uint16":
    kb, vb = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (kb, vb))
  np.testing.assert_allclose(run(q, kb, vb, table, pos), want, atol=1e-5, rtol=1e-5)


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(c=st.sampled_from([1, 2, 5, 16]), g=st.sampled_from([1, 2, 3]),
                  lengths=st.lists(st.integers(1, 300), min_size=1, max_size=6),
                  seed=st.integers(0, 2**16))
def test_random_shapes_match_dense(c, g, lengths, seed):
  case = make_case(np.random.default_rng(seed), b=len(lengths), t=1, kv=2, g=g, d=4, c=c,
                   lengths=lengths)
  np.testing.assert_allclose(run(*case), expected(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("c", [1, 5, 16])
@pytest.mark.parametrize("g", [1, 3, 8])
@pytest.mark.parametrize("d", [8, 64, 72, 128])
def test_prefill_matches_dense(c, g, d):
  """Rows of several query tokens over a cached prefix: head dims below, at and past a vector
  of lanes (72: the generic probabilities @ values loop), the tiled ones (64, 128), query
  counts that leave a partial score tile, and padding tokens at a row's start and end."""
  rng = np.random.default_rng(c * 100 + g * 10 + d)
  q, kp, vp, table, pos = make_case(rng, b=3, t=7, kv=2, g=g, d=d, c=c, lengths=[7, 40, 301])
  pos[0, :2] = -1
  pos[2, -1] = -1
  out = run(q, kp, vp, table, pos)
  np.testing.assert_allclose(out, expected(q, kp, vp, table, pos), atol=1e-5, rtol=1e-5)
  assert np.all(out[0, :2] == 0) and np.all(out[2, -1] == 0)


def test_prefill_rows_of_one_prompt_split_over_threads():
  """The engine's prefill shape: one long prompt cut into 64-token rows that share a table
  (each row sees the rows before it), plus an all-padding row; enough work for the helpers."""
  rng = np.random.default_rng(9)
  t, rows, c = 64, 9, 16
  q, kp, vp, table, _ = make_case(rng, b=1, t=t, kv=3, g=3, d=64, c=c, lengths=[t * rows])
  table = np.repeat(table, rows + 1, axis=0)
  pos = np.stack([np.arange(r * t, (r + 1) * t) for r in range(rows)] + [np.full(t, -1)])
  pos = pos.astype(np.int32)
  q = rng.normal(size=(rows + 1, t, 9, 64)).astype(np.float32)
  out = run(q, kp, vp, table, pos)
  np.testing.assert_allclose(out, expected(q, kp, vp, table, pos), atol=1e-5, rtol=1e-5)
  assert np.all(out[-1] == 0)


@pytest.mark.parametrize("d", [16, 64])
def test_prefill_int8_and_bfloat16_pages(d):
  rng = np.random.default_rng(3)
  q, kp, vp, table, pos = make_case(rng, b=2, t=5, kv=2, g=3, d=d, c=4, lengths=[5, 33])
  for pages in ("int8", "bfloat16"):
    k, v, scales, k_ref, v_ref = stored(kp, vp, pages)
    np.testing.assert_allclose(run(q, k, v, table, pos, *scales),
                               expected(q, k_ref, v_ref, table, pos), atol=1e-5, rtol=1e-5)


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(c=st.sampled_from([1, 3, 16]), g=st.sampled_from([1, 3]),
                  t=st.integers(2, 20), lengths=st.lists(st.integers(1, 200), min_size=1,
                                                         max_size=4),
                  seed=st.integers(0, 2**16))
def test_prefill_random_shapes_match_dense(c, g, t, lengths, seed):
  lengths = [max(length, t) for length in lengths]
  case = make_case(np.random.default_rng(seed), b=len(lengths), t=t, kv=2, g=g, d=16, c=c,
                   lengths=lengths)
  np.testing.assert_allclose(run(*case), expected(*case), atol=1e-5, rtol=1e-5)


def test_auto_picks_the_kernel_for_one_cpu_device_only():
  cpu = jax.devices("cpu")[0]
  one = sharding.make_mesh(1, [cpu])
  assert resolve_attention_impl("auto", one) == "cpu"
  assert resolve_attention_impl("xla", one) == "xla"
  split = types.SimpleNamespace(devices=np.array([cpu, cpu]))  # what the kernel sees of a mesh
  assert resolve_attention_impl("auto", split) == "xla"
  with pytest.raises(ValueError, match="one CPU device"):
    resolve_attention_impl("cpu", split)
  with pytest.raises(ValueError, match="needs a GPU"):
    resolve_attention_impl("pallas", one)
