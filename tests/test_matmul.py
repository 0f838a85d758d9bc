"""Packed weights (`jaxtier.kernels.cpu.matmul`) and the CPU matmul kernel against float64 numpy,
and the packed fused layers against the stacked scan of unpacked layers.

Skipped only where no C++ compiler exists; a kernel that fails to build is a failure.
"""

import dataclasses
import threading

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier import checkpoint
from jaxtier.kernels.cpu import library as cpu_kernels, matmul
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.model import FusedDecoderLayer, GroupedTransformer, Transformer, packs_by_default
from jaxtier.model.config import ModelConfig
from jaxtier.model.rotary import rotary_tables
from conftest import fixture_path
from matmul_reference import unpack

pytestmark = pytest.mark.usefixtures("built_cpu_kernels")  # built once per session

kernel = jax.jit(matmul.packed_matmul, static_argnums=2)


def case(rng, m, k, n):
  return rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)


def expected(x, w):
  return x.astype(np.float64) @ w.astype(np.float64)


def check(x, w, got):
  want = expected(x, w)
  assert got.shape == want.shape
  # float32 sums of k products: the error grows like sqrt(k) ulps of the terms' size
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(x.shape[1]) * 4)


def test_kernel_builds():
  assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


def test_panel_width_is_the_kernels():
  """The default packing is the width the kernel was built for: 64 columns with AVX-512, 16
  without (`jaxtier/kernels/cpu/matmul_cpu.cc`)."""
  avx512 = "avx512f" in cpu_kernels._cpu_signature().split()
  assert matmul.panel_width() == cpu_kernels.panel_width() == (64 if avx512 else 16)
  assert matmul.pack(np.ones((3, 64), np.float32)).shape[-1] == matmul.panel_width()


@pytest.mark.parametrize("width", [16, 64])
@pytest.mark.parametrize("n", [64, 96, 960, 1])
def test_pack_round_trips_and_pads_with_zeros(n, width):
  w = np.arange(5 * n, dtype=np.float32).reshape(5, n)
  packed = matmul.pack(w, width)
  assert packed.shape == (-(-n // width), 5, width) == (matmul.panels(n, width), 5, width)
  assert np.array_equal(unpack(packed, n), w)
  assert np.array_equal(np.asarray(unpack(matmul.pack(jnp.asarray(w), width), n)), w)
  assert not unpack(packed, packed.shape[0] * width)[:, n:].any()
  # panel p, row k holds columns width p .. width (p + 1) - 1 of row k
  assert packed[0, 3, 0] == w[3, 0]
  if n > width + 5:
    assert packed[1, 2, 5] == w[2, width + 5]


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 13, 32, 96, 97, 200])
@pytest.mark.parametrize("k,n", [(576, 960), (48, 96), (37, 64), (1536, 576)])
def test_kernel_matches_numpy(m, k, n):
  """Row counts below, at and past the 6-row register tile and the 96-row work item; odd K;
  widths that pad the last panel."""
  rng = np.random.default_rng(m * 7 + k + n)
  x, w = case(rng, m, k, n)
  check(x, w, np.asarray(kernel(jnp.asarray(x), jnp.asarray(matmul.pack(w)), n)))


@hypothesis.given(m=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 300),
                  seed=st.integers(0, 2**16))
@hypothesis.settings(deadline=None, max_examples=25)
def test_kernel_matches_numpy_property(m, k, n, seed):
  x, w = case(np.random.default_rng(seed), m, k, n)
  check(x, w, np.asarray(kernel(jnp.asarray(x), jnp.asarray(matmul.pack(w)), n)))


norm_kernel = jax.jit(matmul.norm_packed_matmul, static_argnums=(3, 4))


@pytest.mark.parametrize("m", [1, 5, 8, 32, 97])
@pytest.mark.parametrize("k,n", [(576, 960), (37, 64)])
def test_norm_kernel_matches_numpy(m, k, n):
  """rms_norm(x) @ w in one call against float64 numpy's norm then product, and against the XLA
  reference (`rms_norm`, then the product); rows of very different scales, so a norm taken over
  the wrong row or length shows."""
  rng = np.random.default_rng(m + k)
  x, w = case(rng, m, k, n)
  x *= np.exp(rng.uniform(-3, 3, (m, 1))).astype(np.float32)
  scale = rng.standard_normal(k).astype(np.float32)
  got = np.asarray(norm_kernel(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(matmul.pack(w)),
                               n, 1e-5))
  x64 = x.astype(np.float64)
  want = (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * scale) @ w
  atol = 1e-5 * np.sqrt(k) * 4 * np.abs(scale).max()
  np.testing.assert_allclose(got, want, rtol=0, atol=atol)
  ref = np.asarray(matmul.rms_norm(jnp.asarray(x), jnp.asarray(scale), 1e-5) @ jnp.asarray(w))
  np.testing.assert_allclose(got, ref, rtol=0, atol=atol)


rope_kernel = jax.jit(matmul.norm_rope_packed_matmul, static_argnums=(3, 4, 8))


def rotated_numpy(y, cos, sin, columns):
  """The rotary embedding of y's first `columns` columns in heads of cos's width, in float64."""
  y = y.astype(np.float64).copy()
  d = cos.shape[-1]
  for head in range(0, columns, d):
    a, b = y[:, head:head + d // 2].copy(), y[:, head + d // 2:head + d].copy()
    y[:, head:head + d // 2] = a * cos[:, :d // 2] - b * sin[:, :d // 2]
    y[:, head + d // 2:head + d] = b * cos[:, d // 2:] + a * sin[:, d // 2:]
  return y


@pytest.mark.parametrize("m", [1, 5, 32, 97])
@pytest.mark.parametrize("k,n,d,rotary,bias", [(576, 960, 64, 768, False), (48, 96, 12, 72, True),
                                               (64, 80, 8, 0, True), (64, 80, 8, 80, False)])
def test_norm_rope_kernel_matches_numpy(m, k, n, d, rotary, bias):
  """rms_norm(x) @ w + bias with the rotary embedding of the leading heads (the q/k/v projection)
  against float64 numpy and the XLA reference, at positions up to 4,000 (the angles' cos and sin
  as the model computes them), with and without a bias (added before the rotation)."""
  rng = np.random.default_rng(m + k + rotary)
  x, w = case(rng, m, k, n)
  scale = rng.standard_normal(k).astype(np.float32)
  b = rng.standard_normal(n).astype(np.float32) if bias else None
  pos = jnp.asarray(rng.integers(0, 4000, (m, 1)), jnp.int32)
  inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), jnp.float32)
  cos, sin = (a[:, 0] for a in rotary_tables(inv_freq, pos))
  args = (jnp.asarray(x), jnp.asarray(scale), jnp.asarray(matmul.pack(w)), n, 1e-5,
          None if b is None else jnp.asarray(b), cos, sin, rotary)
  got = np.asarray(rope_kernel(*args))
  x64 = x.astype(np.float64)
  y = (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * scale) @ w
  want = rotated_numpy(y + (0 if b is None else b), np.asarray(cos), np.asarray(sin), rotary)
  atol = 1e-5 * np.sqrt(k) * 4 * np.abs(scale).max()
  np.testing.assert_allclose(got, want, rtol=0, atol=atol)
  full = args[2].shape[0] * args[2].shape[2]  # the padded panels' width
  ref = np.asarray(matmul._reference_norm_rope_matmul(
      *args[:3], jnp.zeros((0,)) if b is None else jnp.pad(args[5], (0, full - n)), cos, sin,
      eps=1e-5, rotary=rotary))
  np.testing.assert_allclose(got, ref[:, :n], rtol=0, atol=atol)
  assert cpu_kernels.NORM_ROPE_MATMUL_TARGET in rope_kernel.lower(*args).as_text()


def test_norm_rope_kernel_refuses_bad_arguments():
  x, g, w = jnp.ones((3, 64)), jnp.ones((64,)), matmul.pack(jnp.ones((64, 128)))
  cos = jnp.ones((3, 16))
  for bad, match in [((x, g, w, None, 1e-5, None, cos, jnp.ones((3, 8)), 32), "cos and sin"),
                     ((x, g, w, None, 1e-5, None, cos, cos, 24), "rotary_columns"),
                     ((x, g, w, None, 1e-5, None, cos, cos, 144), "rotary_columns"),
                     ((x, g, w, None, 1e-5, jnp.ones((5,)), cos, cos, 32), "bias")]:
    with pytest.raises(ValueError, match=match):
      matmul.norm_rope_packed_matmul(*bad)


glu_kernel = jax.jit(matmul.glu_packed_matmul, static_argnums=2)


@pytest.mark.parametrize("m", [1, 5, 8, 32, 97])
@pytest.mark.parametrize("k,n", [(1536, 576), (37, 64)])
def test_glu_kernel_matches_numpy(m, k, n):
  """(silu(gate) * up) @ w in one call against float64 numpy and the XLA reference
  (`silu_glu`, then the product); gate values out to +-100, where exp(-gate) over- and underflows
  float32, so a wrong clamp of the kernel's exp shows."""
  rng = np.random.default_rng(m + k)
  gate_up = rng.standard_normal((m, 2 * k)).astype(np.float32) * 3
  gate_up[:, :k:7] *= 30
  w = rng.standard_normal((k, n)).astype(np.float32)
  got = np.asarray(glu_kernel(jnp.asarray(gate_up), jnp.asarray(matmul.pack(w)), n))
  g, u = gate_up[:, :k].astype(np.float64), gate_up[:, k:].astype(np.float64)
  want = (g / (1 + np.exp(-g)) * u) @ w
  atol = 1e-5 * np.abs(want).max()  # float32 sums of k products, relative to their size
  np.testing.assert_allclose(got, want, rtol=0, atol=atol)
  ref = np.asarray(matmul.silu_glu(jnp.asarray(gate_up)) @ jnp.asarray(w))
  np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
  assert cpu_kernels.GLU_MATMUL_TARGET in glu_kernel.lower(
      jnp.asarray(gate_up), jnp.asarray(matmul.pack(w)), n).as_text()
  with pytest.raises(ValueError, match="even"):
    matmul.glu_packed_matmul(jnp.ones((2, 5)), jnp.asarray(matmul.pack(w)))


def test_norm_kernel_lowers_for_float32_on_cpu_only():
  x, g, w = jnp.ones((3, 64)), jnp.ones((64,)), matmul.pack(jnp.ones((64, 128)))
  assert cpu_kernels.NORM_MATMUL_TARGET in norm_kernel.lower(x, g, w, None, 1e-6).as_text()
  bf16 = [a.astype(jnp.bfloat16) for a in (x, g, w)]
  assert cpu_kernels.NORM_MATMUL_TARGET not in norm_kernel.lower(*bf16, None, 1e-6).as_text()
  with pytest.raises(ValueError, match="norm scale"):
    matmul.norm_packed_matmul(x, jnp.ones((65,)), w, None, 1e-6)


def test_concurrent_calls_each_get_their_own_product():
  """Kernel calls from several threads at once share the kernels' crew of helper threads
  (`jaxtier/kernels/cpu/cpu_crew.h`): a call offered while another runs takes its place, and the
  earlier caller finishes its own items. Every product must still be its own, exactly as alone."""
  rng = np.random.default_rng(5)
  cases = [case(rng, m, 576, 960) for m in (1, 3, 8, 17)]
  packed = [(jnp.asarray(x), jnp.asarray(matmul.pack(w))) for x, w in cases]
  alone = [np.asarray(kernel(x, w, 960)) for x, w in packed]
  results = {}

  def run(i):
    x, w = packed[i % len(packed)]
    results[i] = [np.asarray(kernel(x, w, 960)) for _ in range(20)]

  threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(results) == list(range(8))
  for i, outs in results.items():
    for out in outs:
      np.testing.assert_array_equal(out, alone[i % len(packed)])


@pytest.mark.parametrize("width", [16, 64])
def test_other_panel_widths_take_the_reference(width):
  """A weight packed for another CPU's width is multiplied by the reference, not the kernel."""
  x, w = case(np.random.default_rng(width), 5, 40, 70)
  packed = jnp.asarray(matmul.pack(w, width))
  check(x, w, np.asarray(kernel(jnp.asarray(x), packed, 70)))
  lowered = kernel.lower(jnp.asarray(x), packed, 70).as_text()
  assert (cpu_kernels.MATMUL_TARGET in lowered) == (width == matmul.panel_width())


def test_leading_dims_and_the_reference_path():
  rng = np.random.default_rng(1)
  x, w = case(rng, 6, 48, 100)
  x3 = jnp.asarray(x.reshape(2, 3, 48))
  packed = jnp.asarray(matmul.pack(w))
  got = np.asarray(kernel(x3, packed, 100))
  assert got.shape == (2, 3, 100)
  check(x, w, got.reshape(6, 100))
  check(x, w, np.asarray(matmul.reference_matmul(jnp.asarray(x), packed, 100)))


def test_cpu_lowering_calls_the_kernel_and_bfloat16_does_not():
  x, w = jnp.ones((3, 64)), matmul.pack(jnp.ones((64, 128)))
  assert cpu_kernels.MATMUL_TARGET in kernel.lower(x, w, None).as_text()
  bf16 = kernel.lower(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), None).as_text()
  assert cpu_kernels.MATMUL_TARGET not in bf16
  got = kernel(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), None)
  assert got.dtype == jnp.bfloat16 and np.all(np.asarray(got, np.float32) == 64)


def test_bad_shapes_are_refused():
  with pytest.raises(ValueError, match="packed weight"):
    matmul.packed_matmul(jnp.ones((2, 64)), jnp.ones((64, 128)))
  with pytest.raises(ValueError, match="packed weight"):
    matmul.packed_matmul(jnp.ones((2, 32)), jnp.ones((2, 64, 64)))
  with pytest.raises(ValueError, match="n=200"):
    matmul.packed_matmul(jnp.ones((2, 64)), jnp.ones((2, 64, 64)), 200)


def test_float32_layers_pack_by_default_on_cpu():
  assert packs_by_default(jnp.float32)
  assert not packs_by_default(jnp.bfloat16)


def panel_config(tied: bool, bias: bool) -> ModelConfig:
  """A tiny model whose every projection and vocabulary is a multiple of 64 wide (so it packs)."""
  return ModelConfig(architecture="qwen2" if bias else "llama", vocab_size=192, hidden_size=64,
                     intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=16, attention_bias=bias, tie_word_embeddings=tied,
                     max_position_embeddings=64)


@pytest.fixture(scope="module", params=[(True, False), (False, True)], ids=["tied", "untied-bias"])
def tiny(request):
  model = Transformer(panel_config(*request.param), rngs=nnx.Rngs(0))
  if request.param[1]:  # nonzero q/k/v biases, so that a lost bias shows
    for proj in ("q_proj", "k_proj", "v_proj"):
      bias = getattr(model.layers, proj).bias
      bias[...] = jax.random.normal(jax.random.key(1), bias[...].shape) * 0.1
  return model


@nnx.jit
def forward(model, cache, tokens_bt, pos_bt):
  return model(tokens_bt, pos_bt, cache)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_packed_layers_equal_the_stacked_scan(tiny, batch):
  """A prefill then decode steps of `batch` rows (the kernel's decode shapes): the packed fused
  layers and LM head (and, tied, the embedding gathered from it) give the logits of the unpacked
  stacked model."""
  c = tiny.config
  packed = GroupedTransformer(tiny, [(c.num_layers, "unrolled")])
  layers = packed.groups[0].layers
  assert all(type(l) is FusedDecoderLayer and l.packed for l in layers)
  width = matmul.panel_width()
  assert layers[0].qkv_kernel[...].shape == (128 // width, c.hidden_size, width)  # [P, in, C]
  assert packed.packed_head[...].shape == (192 // width, c.hidden_size, width)
  assert hasattr(packed, "embed") != c.tie_word_embeddings  # a tied table is held once
  rng = np.random.default_rng(batch)
  ids = jnp.asarray(rng.integers(0, c.vocab_size, (batch, 12)), jnp.int32)
  got, want = [], []
  for model, out in ((packed, got), (tiny, want)):
    cache = ContiguousKVCache.create(c.num_layers, batch, 16, c.num_kv_heads, c.head_dim,
                                     jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (batch, 8))
    logits, cache = forward(model, cache, ids[:, :8], pos)
    out.append(np.asarray(logits))
    for i in range(8, 12):
      logits, cache = forward(model, cache, ids[:, i:i + 1], jnp.full((batch, 1), i, jnp.int32))
      out.append(np.asarray(logits))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


def test_widths_off_the_panel_keep_the_in_out_layout():
  """Projections (here o and down, of the hidden width) and a vocabulary that would need padding
  are not packed by default."""
  off = matmul.panel_width() + 8
  c = dataclasses.replace(panel_config(True, False), hidden_size=off, vocab_size=3 * off)
  grouped = GroupedTransformer(Transformer(c, rngs=nnx.Rngs(0)), [(c.num_layers, "unrolled")])
  layer = grouped.groups[0].layers[0]
  assert not layer.packed
  assert layer.o_kernel[...].shape == (c.num_heads * c.head_dim, c.hidden_size)
  assert grouped.packed_head is None and hasattr(grouped, "embed")


def test_the_fixtures_pack_where_their_widths_fit():
  """The tiny fixtures' projections (48-96 wide) pack with 16-column panels, not with 64."""
  model, _ = checkpoint.load_model(fixture_path("tiny_llama"))
  grouped = GroupedTransformer(model, [(model.config.num_layers, "unrolled")])
  assert grouped.groups[0].layers[0].packed == (matmul.panel_width() == 16)
  assert grouped.packed_head is None  # a vocabulary of 300


def test_unfused_and_bfloat16_models_are_not_packed(tiny):
  c = tiny.config
  assert GroupedTransformer(tiny, [(c.num_layers, "unrolled")], fused=False).packed_head is None
  bf16 = Transformer(panel_config(True, False), jnp.bfloat16, rngs=nnx.Rngs(0))
  grouped = GroupedTransformer(bf16, [(c.num_layers, "unrolled")])
  assert grouped.packed_head is None and not grouped.groups[0].layers[0].packed
