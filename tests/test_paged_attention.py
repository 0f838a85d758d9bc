"""Paged attention against an independent numpy attention over blocks gathered by hand.

Shape legend: b batch, t query tokens, n query heads, k kv heads, d head dim, f flat pages,
c block size, m blocks per sequence, s key slots.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier.attention.pallas_tpu import tpu_kernel_fits
from jaxtier.attention.xla_chunked import _row_group
from jaxtier.kvcache import (dequantize_int8, paged_attention, paged_attention_gathered,
                             paged_attention_reference, paged_attention_tpu, quantize_int8)

IMPLS = {"xla": paged_attention, "xla_gathered": paged_attention_gathered,
         "reference": paged_attention_reference}


def numpy_attention(q_btnd, k_bskd, v_bskd, pos_bt, window=None):
  """Causal GQA softmax attention in float64 numpy, over keys max(0, p - window + 1)..p with a
  sliding window; padding queries give zeros."""
  b, t, n, d = q_btnd.shape
  g = n // k_bskd.shape[2]
  out = np.zeros(q_btnd.shape, np.float64)
  for i in range(b):
    for j in range(t):
      p = pos_bt[i, j]
      if p < 0:
        continue
      lo = 0 if window is None else max(0, p - window + 1)
      k_snd = np.repeat(k_bskd[i, lo:p + 1], g, axis=1).astype(np.float64)
      v_snd = np.repeat(v_bskd[i, lo:p + 1], g, axis=1).astype(np.float64)
      scores_ns = np.einsum("nd,snd->ns", q_btnd[i, j].astype(np.float64), k_snd) / np.sqrt(d)
      w_ns = np.exp(scores_ns - scores_ns.max(axis=1, keepdims=True))
      out[i, j] = np.einsum("ns,snd->nd", w_ns / w_ns.sum(axis=1, keepdims=True), v_snd)
  return out


def gather_dense(pages_kfcd, table_bm):
  """Rebuilds [b, m * c, k, ...] from pages by walking each table entry by hand."""
  c = pages_kfcd.shape[2]
  b, m = table_bm.shape
  out = np.zeros((b, m * c) + pages_kfcd.shape[:1] + pages_kfcd.shape[3:], pages_kfcd.dtype)
  for i in range(b):
    for j in range(m):
      if table_bm[i, j] >= 0:
        out[i, j * c:(j + 1) * c] = np.moveaxis(pages_kfcd[:, table_bm[i, j]], 0, 1)
  return out


def make_case(rng, *, b, t, kv, g, d, c, lengths, num_pages=None):
  """Random pages and tables; sequence i holds `lengths[i]` tokens, the last t of them new queries.

  Table entries past a sequence's blocks are -1; pages are shuffled so order matters.
  """
  m = max(-(-length // c) for length in lengths) + 1
  num_pages = num_pages or b * m + 3
  ids = rng.permutation(num_pages)
  table_bm = np.full((b, m), -1, np.int32)
  for i, length in enumerate(lengths):
    used = -(-length // c)
    table_bm[i, :used] = ids[i * m:i * m + used]
  pos_bt = np.stack([np.arange(length - t, length) for length in lengths]).astype(np.int32)
  k_pages = rng.normal(size=(kv, num_pages, c, d)).astype(np.float32)
  v_pages = rng.normal(size=(kv, num_pages, c, d)).astype(np.float32)
  q_btnd = rng.normal(size=(b, t, kv * g, d)).astype(np.float32)
  return q_btnd, k_pages, v_pages, table_bm, pos_bt


def expected(q_btnd, k_pages, v_pages, table_bm, pos_bt, window=None):
  return numpy_attention(q_btnd, gather_dense(k_pages, table_bm), gather_dense(v_pages, table_bm),
                         pos_bt, window)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("c", [1, 16, 32])
@pytest.mark.parametrize("g", [1, 3, 8])
def test_decode_matches_dense(impl, c, g):
  rng = np.random.default_rng(c * 10 + g)
  case = make_case(rng, b=3, t=1, kv=2, g=g, d=8, c=c, lengths=[1, 37, 300])  # 3 scan chunks
  out = IMPLS[impl](*map(jnp.asarray, case))
  np.testing.assert_allclose(out, expected(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("c", [1, 16, 32])
def test_prefill_chunk_on_cached_prefix(impl, c):
  rng = np.random.default_rng(c)
  case = make_case(rng, b=2, t=5, kv=2, g=3, d=16, c=c, lengths=[23, 170])
  q, kp, vp, table, pos = case
  pos[0, :2] = -1  # a padded chunk: only 3 real tokens in sequence 0
  out = np.asarray(IMPLS[impl](*map(jnp.asarray, (q, kp, vp, table, pos))))
  np.testing.assert_allclose(out, expected(q, kp, vp, table, pos), atol=1e-5, rtol=1e-5)
  assert np.all(out[0, :2] == 0)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_wide_tables_and_all_padding_batches(impl):
  """Tables padded far past every sequence (the engine buckets their width), and a batch with no
  real query at all: the fast path stops at the last visible chunk, or runs none."""
  rng = np.random.default_rng(7)
  q, kp, vp, table, pos = make_case(rng, b=2, t=1, kv=2, g=2, d=8, c=4, lengths=[3, 9],
                                    num_pages=64)
  wide = np.full((2, 64), -1, np.int32)
  wide[:, :table.shape[1]] = table
  out = IMPLS[impl](*map(jnp.asarray, (q, kp, vp, wide, pos)))
  np.testing.assert_allclose(out, expected(q, kp, vp, table, pos), atol=1e-5, rtol=1e-5)
  padding = IMPLS[impl](*map(jnp.asarray, (q, kp, vp, wide, np.full_like(pos, -1))))
  assert np.all(np.asarray(padding) == 0)


@pytest.mark.parametrize("t", [1, 3, 100])
@pytest.mark.parametrize("quantized", [False, True])
def test_batches_past_one_row_group(t, quantized):
  """More rows than one group, not a multiple of it, lengths in no order, padding rows: the fast
  path sorts rows into groups and must return each row's own output in its own place."""
  rng = np.random.default_rng(11 + t)
  b = _row_group(t) * 2 + 5
  lengths = rng.integers(t, 300, size=b).tolist()
  q, kp, vp, table, pos = make_case(rng, b=b, t=t, kv=2, g=3, d=8, c=4, lengths=lengths)
  padding = [3, b // 2 + 1, b - 1]
  pos[padding] = -1  # padding rows anywhere in the batch
  pos[7, :t - 1] = -1  # a padded chunk
  scales = ()
  if quantized:
    (kq, ks), (vq, vs) = quantize_int8(jnp.asarray(kp)), quantize_int8(jnp.asarray(vp))
    scales, kp, vp = (ks, vs), np.asarray(dequantize_int8(kq, ks)), np.asarray(dequantize_int8(vq, vs))
    pages = (kq, vq)
  else:
    pages = (jnp.asarray(kp), jnp.asarray(vp))
  out = np.asarray(paged_attention(jnp.asarray(q), *pages, jnp.asarray(table), jnp.asarray(pos),
                                   *scales))
  np.testing.assert_allclose(out, expected(q, kp, vp, table, pos), atol=1e-5, rtol=1e-5)
  assert np.all(out[padding] == 0)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("t", [1, 5, 100])
@pytest.mark.parametrize("window", [1, 16, 130])
def test_sliding_window_sees_only_the_last_positions(impl, t, window):
  """A window of W: keys p - W + 1..p. Rows past one row group, contexts of several chunks (the
  XLA path skips the chunks before a group's earliest window), a padded chunk, padding rows."""
  rng = np.random.default_rng(window + t)
  b = _row_group(t) + 3
  lengths = rng.integers(t, 400, size=b).tolist()
  q, kp, vp, table, pos = make_case(rng, b=b, t=t, kv=2, g=2, d=8, c=4, lengths=lengths)
  pos[1] = -1
  pos[2, :t // 2] = -1
  out = np.asarray(IMPLS[impl](*map(jnp.asarray, (q, kp, vp, table, pos)), window=window))
  np.testing.assert_allclose(out, expected(q, kp, vp, table, pos, window), atol=1e-5, rtol=1e-5)
  assert np.all(out[1] == 0)
  traced = jax.jit(lambda w: IMPLS[impl](*map(jnp.asarray, (q, kp, vp, table, pos)), window=w))
  np.testing.assert_allclose(np.asarray(traced(jnp.int32(window))), out, atol=1e-6, rtol=1e-6)


def test_detects_wrong_block_order():
  """Moving the partly visible last block changes which slots the mask keeps."""
  rng = np.random.default_rng(0)
  q, kp, vp, table, pos = make_case(rng, b=1, t=1, kv=1, g=1, d=8, c=4, lengths=[10])
  swapped = table.copy()
  swapped[0, [1, 2]] = swapped[0, [2, 1]]
  out = paged_attention(*map(jnp.asarray, (q, kp, vp, swapped, pos)))
  assert np.abs(out - expected(q, kp, vp, table, pos)).max() > 1e-3


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_int8_equals_attention_on_dequantized_values(impl):
  rng = np.random.default_rng(1)
  q, kp, vp, table, pos = make_case(rng, b=3, t=4, kv=2, g=3, d=16, c=4, lengths=[5, 30, 13])
  (kq, ks), (vq, vs) = quantize_int8(jnp.asarray(kp)), quantize_int8(jnp.asarray(vp))
  out = IMPLS[impl](*map(jnp.asarray, (q, kq, vq, table, pos)), ks, vs)
  k_deq, v_deq = np.asarray(dequantize_int8(kq, ks)), np.asarray(dequantize_int8(vq, vs))
  np.testing.assert_allclose(out, expected(q, k_deq, v_deq, table, pos), atol=1e-5, rtol=1e-5)
  assert np.abs(k_deq - kp).max() <= np.abs(kp).max() / 254 + 1e-6  # half an int8 step


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_bfloat16_pages(impl):
  rng = np.random.default_rng(2)
  q, kp, vp, table, pos = make_case(rng, b=2, t=3, kv=1, g=8, d=16, c=16, lengths=[9, 40])
  kb, vb = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
  out = IMPLS[impl](jnp.asarray(q), kb, vb, jnp.asarray(table), jnp.asarray(pos))
  want = expected(q, np.asarray(kb, np.float32), np.asarray(vb, np.float32), table, pos)
  np.testing.assert_allclose(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("quantized", [False, True])
def test_gathered_path_matches_reference(window, cap, quantized):
  """The accelerator's XLA path over ragged rows (padding rows, a padded chunk, tables wider
  than a sequence), GQA, int8 pages, a sliding window and a soft cap, against the reference."""
  rng = np.random.default_rng(12)
  q, kp, vp, table, pos = map(jnp.asarray, make_case(rng, b=5, t=3, kv=2, g=4, d=16, c=4,
                                                     lengths=[3, 40, 17, 9, 26]))
  pos = pos.at[3].set(-1).at[1, :2].set(-1)
  scales = ()
  if quantized:
    (kp, ks), (vp, vs) = quantize_int8(kp), quantize_int8(vp)
    scales = (ks, vs)
  want = paged_attention_reference(q, kp, vp, table, pos, *scales, window=window, cap=cap)
  got = paged_attention_gathered(q, kp, vp, table, pos, *scales, window=window, cap=cap)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got[3]) == 0)


@pytest.mark.parametrize("window, cap", [(None, None), (7, 1.5)])
def test_gathered_path_over_key_chunks_matches_reference(window, cap):
  """A table wider than `gather_slots`: key chunks with an online softmax, same values."""
  rng = np.random.default_rng(14)
  q, kp, vp, table, pos = map(jnp.asarray, make_case(rng, b=4, t=3, kv=2, g=3, d=16, c=4,
                                                     lengths=[3, 40, 17, 26]))
  pos = pos.at[2].set(-1)
  want = paged_attention_reference(q, kp, vp, table, pos, window=window, cap=cap)
  got = paged_attention_gathered(q, kp, vp, table, pos, window=window, cap=cap, gather_slots=8)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  text = paged_attention_gathered.lower(q, kp, vp, table, pos, gather_slots=8).as_text()
  assert "stablehlo.while" in text


def test_gathered_path_is_one_gather_per_pool_without_loops():
  """No loop, and the context gathered once for K and once for V: what an accelerator runs."""
  rng = np.random.default_rng(13)
  args = map(jnp.asarray, make_case(rng, b=4, t=1, kv=2, g=2, d=8, c=4, lengths=[5, 90, 3, 40]))
  text = paged_attention_gathered.lower(*args).as_text()
  assert "stablehlo.while" not in text
  assert text.count("\"stablehlo.gather\"(") == 2


@pytest.mark.parametrize("shape", [dict(d=16, c=4, g=3), dict(d=128, c=16, g=8)])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_tpu_kernel_interpret_matches_reference(shape, cap):
  """JAX's Pallas TPU kernel in Pallas' TPU interpret mode: bfloat16 pages (the kernel computes
  in bfloat16 K and V), GQA, a table wider than the longest sequence, a padding row."""
  rng = np.random.default_rng(3)
  q, kp, vp, table, pos = map(jnp.asarray, make_case(rng, b=3, t=1, kv=2, lengths=[3, 29, 14],
                                                     **shape))
  kp, vp = kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16)
  pos = pos.at[2].set(-1)  # a padding row: the kernel skips it, its output stays 0
  assert tpu_kernel_fits(1, shape["d"], shape["c"], False) == (shape["d"] == 128)
  want = paged_attention_reference(q, kp, vp, table, pos, cap=cap)
  got = paged_attention_tpu(q, kp, vp, table, pos, cap=cap, interpret=True)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got[2]) == 0)


def test_tpu_kernel_serves_float_decode_steps_of_its_shapes():
  assert tpu_kernel_fits(1, 128, 16, False) and tpu_kernel_fits(1, 256, 32, False)
  assert not tpu_kernel_fits(2, 128, 16, False)  # prefill
  assert not tpu_kernel_fits(1, 128, 16, True)  # int8: its scales would be head_dim wide
  assert not tpu_kernel_fits(1, 64, 16, False) and not tpu_kernel_fits(1, 128, 8, False)


@pytest.mark.parametrize("shape", [dict(d=128, c=16), dict(d=64, c=16)])
def test_tpu_kernel_exports_for_tpu_here(shape):
  """On this CPU the kernel lowers for TPU (Mosaic's "tpu_custom_call"), where its shape fits."""
  rng = np.random.default_rng(5)
  q, kp, vp, table, pos = map(jnp.asarray, make_case(rng, b=2, t=1, kv=2, g=4, lengths=[9, 30],
                                                     **shape))
  args = (q.astype(jnp.bfloat16), kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16), table, pos)
  export = jax.export.export(paged_attention_tpu, platforms=["tpu"])
  if shape["d"] != 128:
    with pytest.raises(ValueError, match="TPU kernel serves"):
      export(*args)
    return
  assert "tpu_custom_call" in export(*args).mlir_module()


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(c=st.sampled_from([1, 2, 5, 16]), g=st.sampled_from([1, 2, 3]),
                  t=st.integers(1, 4), lengths=st.lists(st.integers(4, 300), min_size=1, max_size=3),
                  seed=st.integers(0, 2**16))
def test_random_shapes_match_dense(c, g, t, lengths, seed):
  case = make_case(np.random.default_rng(seed), b=len(lengths), t=t, kv=2, g=g, d=4, c=c,
                   lengths=lengths)
  for impl in (paged_attention, paged_attention_gathered):
    np.testing.assert_allclose(impl(*map(jnp.asarray, case)), expected(*case), atol=1e-5,
                               rtol=1e-5)


def test_validation_names_the_problem():
  rng = np.random.default_rng(4)
  q, kp, vp, table, pos = map(jnp.asarray, make_case(rng, b=2, t=1, kv=2, g=2, d=8, c=4,
                                                     lengths=[3, 9]))
  with pytest.raises(ValueError, match="pages_bm.dtype"):
    paged_attention(q, kp, vp, table.astype(jnp.float32), pos)
  with pytest.raises(ValueError, match="head_dim"):
    paged_attention(q[..., :4], kp, vp, table, pos)
  with pytest.raises(ValueError, match="k_scales must be given"):
    paged_attention(q, kp.astype(jnp.int8), vp.astype(jnp.int8), table, pos)
  with pytest.raises(ValueError, match="TPU kernel serves decode steps"):
    paged_attention_tpu(jnp.concatenate([q, q], 1), kp, vp, table,
                        jnp.concatenate([pos, pos], 1), interpret=True)
  (kq, ks), (vq, vs) = quantize_int8(kp), quantize_int8(vp)
  with pytest.raises(ValueError, match="TPU kernel serves decode steps"):
    paged_attention_tpu(q, kq, vq, table, pos, ks, vs, interpret=True)
