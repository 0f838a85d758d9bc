"""GGUF blocks multiplied with int16 activations (`activations="int16"`): the packing against the
gguf package's blocks, the activation quantization's bounds, the CPU kernel against float64 sums
of the integer products, rows independent of their batch, and a GGUF file loaded so against the
same file dequantized.

Skipped only where no C++ compiler exists; a kernel that fails to build is a failure.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier import checkpoint
from jaxtier.checkpoint import placed
from jaxtier.kernels.cpu import matmul
from jaxtier.model import FusedDecoderLayer, Transformer
from matmul_reference import gguf_q4_1, gguf_q8_0, q4_1_kernels, unpack
from test_matmul_blocks import handler_inputs, logits_of, q4_config, q8_16_case, write_q4_1_gguf

pytestmark = pytest.mark.usefixtures("built_cpu_kernels")  # built once per session


def blocks_case(rng, k, n, fmt, width=None):
  """(packed weight, q, d, m or None, dequantized [K, N]) from the gguf package's blocks (Q8_16:
  `matmul.quantize_q8_16`'s, d and m per 16 rows)."""
  w = rng.standard_normal((k, n), np.float32) * rng.uniform(0.01, 3, n).astype(np.float32)
  if fmt == "q8_16":
    (q, d, m), dequantized = q8_16_case(w)
    return matmul.pack_q8_16(q, d, m, width, activations="int16"), q, d, m, dequantized
  if fmt == "q8_0":
    (q, d), dequantized = gguf_q8_0(w)
    return matmul.pack_q8_0(q, d, width, activations="int16"), q, d, None, dequantized
  (q, d, m), dequantized = gguf_q4_1(w)
  return matmul.pack_q4_1(q, d, m, width, activations="int16"), q, d, m, dequantized


FORMATS = ["q4_1", "q8_0", "q8_16"]
PACK = {"q4_1": matmul.pack_q4_1, "q8_0": matmul.pack_q8_0, "q8_16": matmul.pack_q8_16}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,width", [(64, 16), (100, 16), (40, 8)])
def test_int16_packing_round_trips_gguf_blocks(fmt, n, width):
  rng = np.random.default_rng(n + width)
  packed, q, d, m, dequantized = blocks_case(rng, 96, n, fmt, width)
  dtype, words = {"q4_1": (np.uint16, 12), "q8_0": (np.int16, 18), "q8_16": (np.int32, 12)}[fmt]
  assert packed.dtype == dtype and packed.shape == (-(-n // width), 3, words * width)
  assert matmul.weight_format(packed) == fmt + "_i16"
  assert matmul.panel_columns(packed) == width and matmul.packed_rows(packed) == 96
  assert matmul.parameter_count(packed) == packed.shape[0] * width * 96
  floats = matmul.dequantize_packed(packed)
  np.testing.assert_array_equal(unpack(floats, n), dequantized)
  blocks = (q, d) if m is None else (q, d, m)
  np.testing.assert_array_equal(
      np.asarray(PACK[fmt](*map(jnp.asarray, blocks), width, activations="int16")), packed)
  np.testing.assert_array_equal(np.asarray(matmul.dequantize_packed(jnp.asarray(packed))), floats)
  ids = rng.integers(0, n, (3, 5))
  got = np.asarray(jax.jit(matmul.packed_columns)(jnp.asarray(packed), jnp.asarray(ids)))
  np.testing.assert_array_equal(got, dequantized.T[ids])


def test_activation_quantization_bounds():
  """Each block's largest value maps to +-32767, every value to within half a step of its own,
  and an all-zero block to zeros."""
  rng = np.random.default_rng(2)
  x = rng.standard_normal((5, 128), np.float32) * rng.uniform(1e-3, 1e3, (5, 1)).astype(np.float32)
  x[1, 32:64] = 0
  q, d = matmul.quantize_activations(x)
  blocks, qb = x.reshape(5, 4, 32), q.reshape(5, 4, 32)
  assert np.array_equal(qb, np.round(qb)) and np.abs(qb).max() <= 32767
  assert d[1, 1] == 0 and not qb[1, 1].any()
  live = d > 0
  assert (np.abs(qb).max(-1)[live] == 32767).all()
  err = np.abs(qb * d[..., None] - blocks)
  assert (err <= d[..., None] * 0.5 * (1 + 1e-5)).all()
  jq, jd = matmul.quantize_activations(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(jq), q)
  np.testing.assert_array_equal(np.asarray(jd), d)


def integer_reference(x, q, d, m):
  """x @ the blocks in float64 from exact integer block sums: sum over groups of rows sharing a
  weight scale (32, or Q8_16's 16, told by d's rows) of d_x d_w sum(q_x q_w) (+ m_w d_x
  sum(q_x)), with x quantized per 32 values as the kernel does; also the sum of the terms'
  magnitudes (the scale of float32 rounding)."""
  qx, dx = matmul.quantize_activations(x)
  rows, k = x.shape
  groups = d.shape[0]
  dx = np.repeat(dx.astype(np.float64), groups * 32 // k, axis=-1)  # per group
  qx = qx.reshape(rows, groups, k // groups).astype(np.int64)
  dots = np.einsum("rbi,bin->rbn", qx, q.astype(np.int64).reshape(groups, k // groups, -1))
  terms = [dots * dx[..., None] * d.astype(np.float64)]
  if m is not None:  # Q4_1's two terms nearly cancel (m is about -8 d)
    terms.append((dx * qx.sum(-1))[..., None] * m.astype(np.float64))
  return sum(t.sum(1) for t in terms), sum(np.abs(t).sum(1) for t in terms)


kernel = jax.jit(matmul.packed_matmul, static_argnums=2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (3, 96, 128), (8, 576, 64), (9, 160, 32),
                                      (33, 64, 80), (100, 1536, 16)])
def test_int16_kernel_equals_exact_block_sums(fmt, rows, k, n):
  """Within float32 rounding of the float64 sums of exact integer block products; every row the
  same bits alone as in its batch (rows fill tiles of different heights); the XLA reference
  within the same bound."""
  rng = np.random.default_rng(rows * k + n)
  packed, q, d, m, _ = blocks_case(rng, k, n, fmt)
  x = rng.standard_normal((rows, k), np.float32)
  x[0, :32] = 0  # an all-zero block
  want, magnitude = integer_reference(x, q, d, m)
  got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(packed), n))
  bound = 1e-6 * (magnitude + np.abs(want)) * np.sqrt(k // 32)
  assert (np.abs(got - want) <= bound).all()
  for r in {0, rows // 2, rows - 1}:
    np.testing.assert_array_equal(np.asarray(kernel(jnp.asarray(x[r:r + 1]),
                                                    jnp.asarray(packed), n))[0], got[r])
  ref = np.asarray(jax.jit(matmul.reference_matmul, static_argnums=2)(
      jnp.asarray(x), jnp.asarray(packed), n))
  assert (np.abs(ref - want) <= 4 * bound + 1e-6 * np.abs(want).max()).all()


def test_int16_nan_and_inf_inputs_give_nan_rows():
  """A NaN or infinity in a row's input makes that row's products NaN, as in the reference and
  the float path, and leaves the other rows alone."""
  rng = np.random.default_rng(4)
  packed, *_ = blocks_case(rng, 64, 32, "q4_1")
  x = rng.standard_normal((3, 64), np.float32)
  x[0, 5], x[2, 40] = np.nan, np.inf
  got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(packed), 32))
  ref = np.asarray(matmul.reference_matmul(jnp.asarray(x), jnp.asarray(packed), 32))
  assert np.isnan(got[[0, 2]]).all() and np.isnan(ref[[0, 2]]).all()
  np.testing.assert_array_equal(got[1], np.asarray(kernel(jnp.asarray(x[1:2]),
                                                          jnp.asarray(packed), 32))[0])
  assert np.isfinite(got[1]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_int16_fused_handlers_equal_their_references(fmt):
  """The norm, norm + bias + rotary and gating handlers quantize the input they make (normed
  rows, silu(gate) * up), as the XLA references do."""
  rng = np.random.default_rng(0)
  m, k, n, d = 5, 128, 192, 16
  packed, *_ = blocks_case(rng, k, n, fmt)
  w = jnp.asarray(packed)
  x, scale, bias, cos, sin, gate_up = handler_inputs(rng, m, k, n, d)
  cases = [
      (lambda w: matmul.norm_packed_matmul(x, scale, w, n, 1e-5),
       lambda w: matmul.reference_matmul(matmul.rms_norm(x, scale, 1e-5), w, n)),
      (lambda w: matmul.norm_rope_packed_matmul(x, scale, w, n, 1e-5, bias, cos, sin, 128),
       lambda w: matmul._reference_norm_rope_matmul(x, scale, w, bias, cos, sin, eps=1e-5,
                                                    rotary=128)[:, :n]),
      (lambda w: matmul.glu_packed_matmul(gate_up, w, n),
       lambda w: matmul.reference_matmul(matmul.silu_glu(gate_up), w, n)),
  ]
  for call, reference in cases:
    got, want = np.asarray(jax.jit(call)(w)), np.asarray(jax.jit(reference)(w))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_loader_keeps_blocks_for_int16_activations(tmp_path):
  """A GGUF file loaded with `block_activations="int16"`: layers in uint16 words and the head in
  int16 words (the same bytes as the float-activation blocks), logits within ~1e-4 of the file
  dequantized (the activations' rounding), and the gguf package's Q4_1 quantization of the
  dequantized weights, packed for int16 activations, gives the same blocks."""
  c = q4_config(tied=True)
  path = str(tmp_path / "q4.gguf")
  write_q4_1_gguf(path, Transformer(c, rngs=nnx.Rngs(3)))
  floats = checkpoint.load(path, layout=placed.Layout.of(c.num_layers,
                                                         layer_execution="unrolled")).model
  exact = checkpoint.load(path, layout=placed.Layout.of(
      c.num_layers, layer_execution="unrolled", keep_quantized=True)).model
  kept = checkpoint.load(path, layout=placed.Layout.of(
      c.num_layers, layer_execution="unrolled", keep_quantized=True,
      block_activations="int16")).model
  assert kept.packed_head[...].dtype == jnp.int16
  for layer, other in zip(kept.groups[0].layers, exact.groups[0].layers):
    for name in FusedDecoderLayer.KERNELS:
      a, b = getattr(layer, name)[...], getattr(other, name)[...]
      assert a.dtype == jnp.uint16 and a.nbytes == b.nbytes
  for a, b in zip(logits_of(kept, c), logits_of(floats, c)):
    assert 0 < np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
  reference = checkpoint.load(path).model  # the stacked scan, float32
  plain = nnx.merge(*nnx.split(reference.layers))
  single = nnx.merge(nnx.graphdef(plain), jax.tree.map(lambda a: a[0], nnx.state(plain)))
  again = q4_1_kernels(single, activations="int16")
  for name in FusedDecoderLayer.KERNELS:
    np.testing.assert_array_equal(again[name],
                                  np.asarray(getattr(kept.groups[0].layers[0], name)[...]))


def test_bad_activations_are_refused():
  with pytest.raises(ValueError, match="activations='int8'"):
    matmul.pack_q4_1(np.zeros((32, 16), np.uint8), np.zeros((1, 16), np.float32),
                     np.zeros((1, 16), np.float32), activations="int8")
