"""Weights packed from GGUF's Q4_1 and Q8_0 blocks and in the Q8_16 format (8-bit values, a scale
and minimum per 16 rows): the packing against the gguf package's own quantization and
dequantization, the CPU kernel's products against the float32 kernel's on the dequantized weights
(bit for bit) and against float64 numpy, the embedding gathered from a packed table, and the
loader keeping a GGUF file's blocks against loading it dequantized (Q4_1 and Q8_0, the types
those formats hold exactly: Q4_0, Q4_K, Q5_0, and the other types Q8_16 holds: Q6_K, Q5_K, Q5_1,
Q3_K, Q2_K; per layer and kernel where a file mixes types).

Skipped only where no C++ compiler exists; a kernel that fails to build is a failure.
"""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier import checkpoint
import jaxtier
from jaxtier.checkpoint import gguf_file, placed
from jaxtier.kernels.cpu import matmul
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.model import FusedDecoderLayer, Transformer
from jaxtier.model.config import ModelConfig
from jaxtier.model.rotary import rotary_tables
from matmul_reference import Q4_1, Q8_0, gguf_q4_1, gguf_q8_0, q4_1_kernels, unpack
from test_checkpoint import llama_gguf_writer

pytestmark = pytest.mark.usefixtures("built_cpu_kernels")  # built once per session

Q = gguf.GGMLQuantizationType


def q8_16_case(w_kn: np.ndarray):
  """(q, d, m) of w [K, N] in the Q8_16 format (`matmul.quantize_q8_16`), and d q + m."""
  q, d, m = matmul.quantize_q8_16(w_kn)
  rows = lambda a: np.repeat(a, matmul.HALF_BLOCK, axis=-2)
  return (q, d, m), rows(d) * q.astype(np.float32) + rows(m)


def packed_case(rng, k, n, width=None, fmt="q4_1"):
  w = rng.standard_normal((k, n), np.float32)
  if fmt == "q8_16":
    blocks, dequantized = q8_16_case(w)
    return matmul.pack_q8_16(*blocks, width), dequantized
  if fmt == "q8_0":
    blocks, dequantized = gguf_q8_0(w)
    return matmul.pack_q8_0(*blocks, width), dequantized
  blocks, dequantized = gguf_q4_1(w)
  return matmul.pack_q4_1(*blocks, width), dequantized


@pytest.mark.parametrize("n,width", [(64, 64), (100, 64), (40, 16)])
def test_q8_0_packing_round_trips_gguf_blocks(n, width):
  rng = np.random.default_rng(n)
  w = rng.standard_normal((96, n), np.float32) * rng.uniform(0.01, 3, n).astype(np.float32)
  w[:32, 3] = 0  # an all-zero block: d = 0
  (q, d), dequantized = gguf_q8_0(w)
  packed = matmul.pack_q8_0(q, d, width)
  assert packed.dtype == np.int8 and packed.shape == (-(-n // width), 3, 36 * width)
  assert matmul.weight_format(packed) == "q8_0" and matmul.parameter_count(packed) == \
      packed.shape[0] * width * 96
  floats = matmul.dequantize_packed(packed)
  np.testing.assert_array_equal(unpack(floats, n), dequantized)
  for ours, theirs in zip(matmul.quantize_q8_0(w), (q, d)):
    np.testing.assert_array_equal(ours, theirs)
  np.testing.assert_array_equal(np.asarray(matmul.pack_q8_0(jnp.asarray(q), jnp.asarray(d), width)),
                                packed)
  np.testing.assert_array_equal(np.asarray(matmul.dequantize_packed(jnp.asarray(packed))), floats)


@pytest.mark.parametrize("n,width", [(64, 64), (100, 64), (40, 16)])
def test_q8_16_packing_round_trips(n, width):
  """Packed Q8_16 values dequantize to d q + m with each half block's own d and m (columns past
  n zero), numpy and jax alike; the quantizer is within half a step of the weights."""
  rng = np.random.default_rng(n)
  w = rng.standard_normal((96, n), np.float32) * rng.uniform(0.01, 3, n).astype(np.float32)
  w[16:32, 3] = 0.5  # a constant half block: d = 0
  (q, d, m), dequantized = q8_16_case(w)
  assert q.dtype == np.int8 and d.shape == m.shape == (6, n) and d[1, 3] == 0
  assert np.all(np.abs(dequantized - w) <= 0.5 * np.repeat(d, 16, axis=0) + 1e-3 * np.abs(w))
  packed = matmul.pack_q8_16(q, d, m, width)
  assert packed.dtype == np.uint32 and packed.shape == (-(-n // width), 3, 12 * width)
  assert matmul.weight_format(packed) == "q8_16" and matmul.parameter_count(packed) == \
      packed.shape[0] * width * 96 and matmul.packed_rows(packed) == 96
  floats = matmul.dequantize_packed(packed)
  np.testing.assert_array_equal(unpack(floats, n), dequantized)
  assert not floats.reshape(-1, 96, width).transpose(1, 0, 2).reshape(96, -1)[:, n:].any()
  np.testing.assert_array_equal(
      np.asarray(matmul.pack_q8_16(*map(jnp.asarray, (q, d, m)), width)), packed)
  np.testing.assert_array_equal(np.asarray(matmul.dequantize_packed(jnp.asarray(packed))), floats)


@pytest.mark.parametrize("fmt", ["float32", "q4_1", "q8_0", "q8_16"])
def test_packed_columns_are_the_dequantized_columns(fmt):
  """The embedding of a tied table held packed: each id's column, in every format."""
  rng = np.random.default_rng(5)
  if fmt == "float32":
    dequantized = rng.standard_normal((64, 192), np.float32)
    packed = matmul.pack(dequantized)
  else:
    packed, dequantized = packed_case(rng, 64, 192, fmt=fmt)
  ids = rng.integers(0, 192, (3, 7))
  got = np.asarray(jax.jit(matmul.packed_columns)(jnp.asarray(packed), jnp.asarray(ids)))
  np.testing.assert_array_equal(got, dequantized.T[ids])


@pytest.mark.parametrize("n,width", [(64, 64), (100, 64), (48, 16), (40, 16)])
def test_packing_round_trips_gguf_blocks(n, width):
  """Packed from the gguf package's blocks, the weight dequantizes to the package's own float32
  values (columns past n zero); our quantizer gives the package's blocks."""
  rng = np.random.default_rng(n)
  w = rng.standard_normal((96, n), np.float32) * rng.uniform(0.01, 3, n).astype(np.float32)
  w[:32, 3] = 0.5  # a constant block: d = 0
  (q, d, m), dequantized = gguf_q4_1(w)
  packed = matmul.pack_q4_1(q, d, m, width)
  assert packed.dtype == np.uint8 and packed.shape == (-(-n // width), 3, 24 * width)
  floats = matmul.dequantize_packed(packed)
  np.testing.assert_array_equal(unpack(floats, n), dequantized)
  assert not floats.reshape(-1, 96, width).transpose(1, 0, 2).reshape(96, -1)[:, n:].any()
  for ours, theirs in zip(matmul.quantize_q4_1(w), (q, d, m)):
    np.testing.assert_array_equal(ours, theirs)
  # the jax versions give the same bytes and floats
  np.testing.assert_array_equal(np.asarray(matmul.pack_q4_1(*map(jnp.asarray, (q, d, m)), width)),
                                packed)
  np.testing.assert_array_equal(np.asarray(matmul.dequantize_packed(jnp.asarray(packed))), floats)


kernel = jax.jit(matmul.packed_matmul, static_argnums=2)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q8_16"])
@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (2, 96, 128), (3, 96, 192), (4, 576, 64),
                                   (5, 160, 128), (33, 576, 64), (100, 64, 256)])
def test_kernel_equals_the_float_kernel_on_the_dequantized_weights(m, k, n, fmt):
  """Bit for bit: each pass's blocks dequantize to GGUF's float32 values and the tiles multiply
  them in the float32 kernel's order (items of 1-4 rows dequantize in registers, larger ones
  into a buffer); and within float32 rounding of float64 numpy."""
  rng = np.random.default_rng(m * k + n)
  packed, dequantized = packed_case(rng, k, n, fmt=fmt)
  x = rng.standard_normal((m, k), np.float32)
  got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(packed), n))
  floats = np.asarray(kernel(jnp.asarray(x), jnp.asarray(matmul.pack(dequantized)), n))
  np.testing.assert_array_equal(got, floats)
  want = x.astype(np.float64) @ dequantized.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=4e-5 * np.sqrt(k) * np.abs(want).max())
  ref = np.asarray(matmul.reference_matmul(jnp.asarray(x), jnp.asarray(packed), n))
  np.testing.assert_allclose(ref, want, rtol=0, atol=4e-5 * np.sqrt(k) * np.abs(want).max())


def handler_inputs(rng, m: int, k: int, n: int, d: int):
  """Inputs of the fused handlers: x [m, k], a norm scale [k], a bias [n], rotary cos and sin
  [m, d] of positions 0..m-1, and gate_up [m, 2 k]."""
  x = jnp.asarray(rng.standard_normal((m, k), np.float32))
  scale = jnp.asarray(rng.uniform(0.5, 1.5, k).astype(np.float32))
  bias = jnp.asarray(rng.standard_normal(n, np.float32))
  inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), jnp.float32)
  cos, sin = (a[0] for a in rotary_tables(inv_freq, jnp.arange(m)[None]))
  gate_up = jnp.asarray(rng.standard_normal((m, 2 * k), np.float32))
  return x, scale, bias, cos, sin, gate_up


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q8_16"])
def test_fused_handlers_equal_their_float_kernels(fmt):
  """The norm, norm + bias + rotary and gating handlers take block weights with the same products
  as float32 panels of the dequantized weights."""
  rng = np.random.default_rng(0)
  m, k, n, d = 5, 128, 192, 16
  packed, dequantized = packed_case(rng, k, n, fmt=fmt)
  floats = matmul.pack(dequantized)
  x, scale, bias, cos, sin, gate_up = handler_inputs(rng, m, k, n, d)
  calls = [
      lambda w: matmul.norm_packed_matmul(x, scale, w, n, 1e-5),
      lambda w: matmul.norm_rope_packed_matmul(x, scale, w, n, 1e-5, bias, cos, sin, 128),
  ]
  for call in calls:
    np.testing.assert_array_equal(np.asarray(jax.jit(call)(jnp.asarray(packed))),
                                  np.asarray(jax.jit(call)(jnp.asarray(floats))))
  glu = jax.jit(lambda w: matmul.glu_packed_matmul(gate_up, w, n))
  np.testing.assert_array_equal(np.asarray(glu(jnp.asarray(packed))),
                                np.asarray(glu(jnp.asarray(floats))))


def test_bad_q4_1_shapes_are_refused():
  rng = np.random.default_rng(1)
  packed, _ = packed_case(rng, 64, 64)
  with pytest.raises(ValueError, match="Q4_1"):
    matmul.packed_matmul(jnp.zeros((2, 96), jnp.float32), jnp.asarray(packed))
  with pytest.raises(ValueError, match="multiple of 32"):
    matmul.quantize_q4_1(np.zeros((40, 64), np.float32))
  with pytest.raises(ValueError, match="Q8_0"):
    matmul.packed_matmul(jnp.zeros((2, 64), jnp.float32), jnp.asarray(packed.view(np.int8)))
  with pytest.raises(ValueError, match="Q8_16"):
    matmul.packed_matmul(jnp.zeros((2, 96), jnp.float32),
                         jnp.asarray(packed_case(rng, 64, 64, fmt="q8_16")[0]))
  with pytest.raises(ValueError, match="block format 'q5_0'"):
    matmul.pack_blocks("q5_0", ())
  with pytest.raises(ValueError, match=r"d, m \[\.\.\., K / 16, N\]; got q \(64, 8\), d \(2, 8\)"):
    matmul.pack_q8_16(np.zeros((64, 8), np.int8), np.zeros((2, 8)), np.zeros((4, 8)))
  with pytest.raises(ValueError, match="multiple of 32"):
    matmul.pack_q8_0(np.zeros((40, 8), np.int8), np.zeros((1, 8)))


def q4_config(tied: bool = False) -> ModelConfig:
  """A tiny Llama whose widths pack (multiples of 64) and whose inputs are whole blocks."""
  return ModelConfig(architecture="llama", vocab_size=192, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     tie_word_embeddings=tied, max_position_embeddings=64)


def write_q4_1_gguf(path: str, model: Transformer) -> None:
  """`model` as a GGUF file with every layer weight in Q4_1 blocks (q/k rows permuted the way
  llama.cpp's converter does) and the LM head's table (the embedding's, tied) in Q8_0 blocks."""
  c = model.config
  writer = llama_gguf_writer(path, c)
  writer.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, c.vocab_size)])
  writer.add_token_merges(["a b"])
  writer.add_eos_token_id(0)
  names = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
           "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
  layers = model.layers
  for i in range(c.num_layers):
    for name, ours in names.items():
      w = np.asarray(getattr(layers, ours).kernel[...][i]).T  # [out, in]
      if name in ("attn_q", "attn_k"):
        heads = c.num_heads if name == "attn_q" else c.num_kv_heads
        w = w.reshape(heads, 2, -1, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
      blocks = gguf.quants.quantize(np.ascontiguousarray(w), Q4_1)
      writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=Q4_1)
    writer.add_tensor(f"blk.{i}.attn_norm.weight", np.asarray(layers.attn_norm.scale[...][i]))
    writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.asarray(layers.mlp_norm.scale[...][i]))
  table = np.asarray(model.embed.embedding[...])
  if c.tie_word_embeddings:
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(table, Q8_0), raw_dtype=Q8_0)
  else:
    writer.add_tensor("token_embd.weight", table)
    writer.add_tensor("output.weight", gguf.quants.quantize(np.asarray(model.lm_head[...]), Q8_0),
                      raw_dtype=Q8_0)
  writer.add_tensor("output_norm.weight", np.asarray(model.final_norm.scale[...]))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def logits_of(model, c: ModelConfig) -> list[np.ndarray]:
  """A prefill of 3 rows, then 3 decode steps."""
  rng = np.random.default_rng(7)
  ids = jnp.asarray(rng.integers(0, c.vocab_size, (3, 11)), jnp.int32)
  forward = nnx.jit(lambda m, t, p, k: m(t, p, k))
  cache = ContiguousKVCache.create(c.num_layers, 3, 16, c.num_kv_heads, c.head_dim, jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (3, 8))
  logits, cache = forward(model, ids[:, :8], pos, cache)
  out = [np.asarray(logits)]
  for i in range(8, 11):
    logits, cache = forward(model, ids[:, i:i + 1], jnp.full((3, 1), i, jnp.int32), cache)
    out.append(np.asarray(logits))
  return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loader_keeps_a_gguf_files_blocks(tmp_path, tied):
  """Loaded with `keep_quantized`, the unrolled layers hold the file's Q4_1 blocks (uint8, 0.75
  bytes a weight) and the LM head its Q8_0 blocks (int8; tied, the embedding is gathered from
  them), and the model gives bit for bit the logits of the same file dequantized on load; the
  gguf package's Q4_1 quantization of those dequantized weights, packed, gives the same blocks."""
  c = q4_config(tied)
  path = str(tmp_path / "q4.gguf")
  write_q4_1_gguf(path, Transformer(c, rngs=nnx.Rngs(3)))
  layout = placed.Layout.of(c.num_layers, layer_execution="unrolled")
  floats = checkpoint.load(path, layout=layout).model
  read = []
  kept = checkpoint.load(path, layout=placed.Layout.of(c.num_layers, layer_execution="unrolled",
                                                       keep_quantized=True),
                         observe=lambda name, _: read.append(name)).model
  assert kept.packed_head[...].dtype == jnp.int8 and floats.packed_head[...].dtype == jnp.float32
  assert hasattr(kept, "embed") != tied
  assert "lm_head" not in read and "packed_head" in read  # the table read once, as blocks
  kept_layers, float_layers = kept.groups[0].layers, floats.groups[0].layers
  for layer in kept_layers:
    assert all(getattr(layer, name)[...].dtype == jnp.uint8 for name in FusedDecoderLayer.KERNELS)
  for layer in float_layers:
    assert all(getattr(layer, name)[...].dtype == jnp.float32
               for name in FusedDecoderLayer.KERNELS)
  bytes_of = lambda layers: sum(getattr(l, name)[...].nbytes for l in layers
                                for name in FusedDecoderLayer.KERNELS)
  assert bytes_of(kept_layers) * 32 == bytes_of(float_layers) * 6  # 0.75 bytes against 4
  for a, b in zip(logits_of(kept, c), logits_of(floats, c)):
    np.testing.assert_array_equal(a, b)
  # quantizing the dequantized weights again finds the same blocks
  reference = checkpoint.load(path).model  # the stacked scan, float32
  for i, layer in enumerate(kept_layers):
    plain = nnx.merge(*nnx.split(reference.layers))
    one = jax.tree.map(lambda a: a[i], nnx.state(plain))
    graphdef = nnx.graphdef(plain)
    single = nnx.merge(graphdef, one)
    again = q4_1_kernels(single)
    for name in FusedDecoderLayer.KERNELS:
      np.testing.assert_array_equal(again[name], np.asarray(getattr(layer, name)[...]))


def test_block_formats_need_packed_layers_with_whole_blocks():
  c = q4_config()
  model = Transformer(c, rngs=nnx.Rngs(0))
  plain = jax.tree.map(lambda a: a[0], nnx.state(model.layers))
  single = nnx.merge(nnx.graphdef(model.layers), plain)
  with pytest.raises(ValueError, match="kept in blocks must be packed"):
    FusedDecoderLayer(single, packed=False,
                      formats=dict.fromkeys(FusedDecoderLayer.KERNELS, "q4_1"))


# The k-quants' float16 super-block scales: (byte offset, largest value) so that weights stay
# within ~0.03 (w = D s q - M n, with the largest s, q and n of each type).
K_SCALES = {Q.Q4_K: ((0, 0.03 / (63 * 15)), (2, 0.01 / 63)),
            Q.Q5_K: ((0, 0.03 / (63 * 31)), (2, 0.01 / 63)),
            Q.Q6_K: ((208, 0.03 / (127 * 32)),),
            Q.Q3_K: ((108, 0.03 / (32 * 4)),),
            Q.Q2_K: ((80, 0.03 / (15 * 3)), (82, 0.01 / 15))}


def raw_blocks(rng, qtype, n: int, k: int) -> np.ndarray:
  """Random but valid GGUF blocks [n, k / block * bytes] of `qtype`, weights within ~0.03: the
  gguf package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 from floats; the k-quants (which it can
  only dequantize) are random bytes with small float16 super-block scales."""
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  if qtype not in K_SCALES:
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    return gguf.quants.quantize(w, qtype)
  raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
  for at, top in K_SCALES[qtype]:  # a float16 in [top / 2, top]
    raw[..., at:at + 2] = (rng.uniform(top / 2, top, (n, k // block, 1))
                           .astype(np.float16).view(np.uint8))
  return raw.reshape(n, -1)



@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_block_parts_are_the_gguf_dequantization(qtype):
  """Each type the loader keeps, re-expressed as Q4_1's (q, d, m) or Q8_0's (q, d), gives bit for
  bit the weights the gguf package dequantizes."""
  rng = np.random.default_rng(int(qtype))
  n, k = 24, 512
  raw = raw_blocks(rng, qtype, n, k)
  parts = gguf_file.block_parts(qtype, raw, n, k)
  per_row = lambda a: np.repeat(a, 32, axis=-1)  # [n, k / 32] -> [n, k]
  if len(parts) == 3:
    q, d, m = parts
    assert q.dtype == np.uint8 and q.max() <= 15
    got = per_row(d) * q.astype(np.float32) + per_row(m)
  else:
    q, d = parts
    assert q.dtype == np.int8
    got = per_row(d) * q.astype(np.float32)
  np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype))
  with pytest.raises(ValueError, match="Q6_K blocks are not kept"):
    gguf_file.block_parts(Q.Q6_K, raw_blocks(rng, Q.Q6_K, 2, 256), 2, 256)


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K, Q.Q5_1, Q.Q3_K, Q.Q2_K, Q.Q4_K, Q.Q4_0, Q.Q4_1,
                                   Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_q8_16_parts_are_the_gguf_dequantization(qtype):
  """Every type the Q8_16 format holds, as its (q, d, m) with d and m per 16 values: bit for bit
  the weights the gguf package dequantizes, with each value within 8 bits."""
  rng = np.random.default_rng(int(qtype))
  n, k = 24, 512
  raw = raw_blocks(rng, qtype, n, k)
  q, d, m = gguf_file.block_parts_q8_16(qtype, raw, n, k)
  assert q.dtype == np.int8 and d.shape == m.shape == (n, k // 16)
  per_row = lambda a: np.repeat(a, 16, axis=-1)
  np.testing.assert_array_equal(per_row(d) * q.astype(np.float32) + per_row(m),
                                gguf.quants.dequantize(raw, qtype))
  with pytest.raises(ValueError, match="IQ4_NL blocks are not kept"):
    gguf_file.block_parts_q8_16(Q.IQ4_NL, np.zeros((2, 18), np.uint8), 2, 32)


# Per layer, the GGUF type of each weight (the rest F16): layer 0 all Q4_K; layer 1 q/k in Q4_0
# with v in Q6_K, as llama.cpp's Q4_K_M files have them (q/k/v in Q8_16), o in Q4_1, gate Q4_K
# with up Q4_0 (Q4_1), down Q5_0 (Q8_0); layer 2 only types Q8_16 holds, down F16; layer 3 no
# blocks.
MIXED = [dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                        "ffn_down"), Q.Q4_K),
         {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q6_K, "attn_output": Q.Q4_1,
          "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q5_0},
         {"attn_q": Q.Q5_K, "attn_k": Q.Q3_K, "attn_v": Q.Q2_K, "attn_output": Q.Q6_K,
          "ffn_gate": Q.Q5_1, "ffn_up": Q.Q6_K},
         {}]
# Per layer, the format each kernel is held in.
MIXED_KEPT = [dict.fromkeys(FusedDecoderLayer.KERNELS, "q4_1"),
              {"qkv_kernel": "q8_16", "o_kernel": "q4_1", "gate_up_kernel": "q4_1",
               "down_kernel": "q8_0"},
              {"qkv_kernel": "q8_16", "o_kernel": "q8_16", "gate_up_kernel": "q8_16",
               "down_kernel": "float32"},
              dict.fromkeys(FusedDecoderLayer.KERNELS, "float32")]
HEADS = {Q.Q4_K: "q4_1", Q.Q6_K: "q8_16"}  # the LM head's type in the file, and its format


def write_mixed_gguf(path: str, c: ModelConfig, head) -> None:
  """A GGUF file of random weights of the types in MIXED, the LM head in `head`."""
  rng = np.random.default_rng(5)
  writer = llama_gguf_writer(path, c)
  writer.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, c.vocab_size)])
  writer.add_token_merges(["a b"])
  writer.add_eos_token_id(0)
  h, f, d = c.hidden_size, c.intermediate_size, c.head_dim
  shapes = {"attn_q": (c.num_heads * d, h), "attn_k": (c.num_kv_heads * d, h),
            "attn_v": (c.num_kv_heads * d, h), "attn_output": (h, c.num_heads * d),
            "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
  for i, types in enumerate(MIXED):
    for name, (n, k) in shapes.items():
      qtype = types.get(name, Q.F16)
      if qtype == Q.F16:
        writer.add_tensor(f"blk.{i}.{name}.weight",
                          (rng.standard_normal((n, k)) * 0.02).astype(np.float16))
      else:
        writer.add_tensor(f"blk.{i}.{name}.weight", raw_blocks(rng, qtype, n, k), raw_dtype=qtype)
    for norm in ("attn_norm", "ffn_norm"):
      writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, h).astype(np.float32))
  writer.add_tensor("token_embd.weight", rng.standard_normal((c.vocab_size, h)).astype(np.float32))
  writer.add_tensor("output.weight", raw_blocks(rng, head, c.vocab_size, h), raw_dtype=head)
  writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


MIXED_CONFIG = ModelConfig(architecture="llama", vocab_size=192, hidden_size=256,
                           intermediate_size=512, num_layers=len(MIXED), num_heads=4,
                           num_kv_heads=2, head_dim=64, max_position_embeddings=64)


@pytest.fixture(scope="module", params=list(HEADS), ids=lambda t: f"{t.name}_head")
def mixed_gguf(request, tmp_path_factory) -> tuple[str, str]:
  """(the mixed file, its head's format)."""
  path = str(tmp_path_factory.mktemp("mixed") / "mixed.gguf")
  write_mixed_gguf(path, MIXED_CONFIG, request.param)
  return path, HEADS[request.param]


def kernel_formats(layer) -> dict[str, str]:
  return {name: matmul.weight_format(getattr(layer, name)[...])
          for name in FusedDecoderLayer.KERNELS}


def test_loader_keeps_each_layers_kernels_held_in_blocks(mixed_gguf):
  """A file that mixes types per layer (as llama.cpp's Q4_K_M files do): each layer keeps in
  blocks the fused kernels whose parts are all in blocks, in Q4_1 or Q8_0 where one of them holds
  every part, else in Q8_16, and the model gives bit for bit the logits of the file dequantized
  on load. With int16 activations, the kernels take the formats' int16 layouts, and the logits
  stay within the activations' rounding."""
  (path, head), c = mixed_gguf, MIXED_CONFIG
  layout = lambda **kw: placed.Layout.of(c.num_layers, layer_execution="unrolled", **kw)
  floats = checkpoint.load(path, layout=layout()).model
  kept = checkpoint.load(path, layout=layout(keep_quantized=True)).model
  assert [kernel_formats(layer) for layer in kept.groups[0].layers] == MIXED_KEPT
  assert matmul.weight_format(kept.packed_head[...]) == head
  assert floats.packed_head[...].dtype == jnp.float32
  want = logits_of(floats, c)
  for a, b in zip(logits_of(kept, c), want):
    np.testing.assert_array_equal(a, b)
  int16 = checkpoint.load(path, layout=layout(keep_quantized=True,
                                              block_activations="int16")).model
  as_int16 = lambda fmt: fmt + "_i16" if fmt != "float32" else fmt
  assert [kernel_formats(layer) for layer in int16.groups[0].layers] == [
      {name: as_int16(fmt) for name, fmt in kept.items()} for kept in MIXED_KEPT]
  for a, b in zip(logits_of(int16, c), want):
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * np.abs(b).max())


BYTES_PER_WEIGHT = {"q4_1": 24 / 32, "q8_0": 36 / 32, "q8_16": 48 / 32, "float32": 4}


def test_memory_report_counts_the_kept_blocks(mixed_gguf):
  """`memory_report()["weight_bytes_by_format"]` of the mixed file: per 32 weights Q4_1 blocks
  take 24 bytes, Q8_0 36 and Q8_16 48, for the kept kernels (MIXED_KEPT) and the head, and
  everything else is float32."""
  (path, head), c = mixed_gguf, MIXED_CONFIG
  h, f = c.hidden_size, c.intermediate_size
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  weights = {"qkv_kernel": h * (q + 2 * kv), "gate_up_kernel": 2 * h * f, "o_kernel": q * h,
             "down_kernel": f * h}
  want = {fmt: 0.0 for fmt in BYTES_PER_WEIGHT}
  for names in MIXED_KEPT:
    for name, fmt in names.items():
      want[fmt] += weights[name] * BYTES_PER_WEIGHT[fmt]
  want[head] += c.vocab_size * h * BYTES_PER_WEIGHT[head]
  # the embedding table, the norms and the rotary frequencies
  want["float32"] += (c.vocab_size * h + (2 * c.num_layers + 1) * h + c.head_dim // 2) * 4
  report = jaxtier.LLM(path, max_num_seqs=2, block_activations="float32").memory_report()
  by_format = report["weight_bytes_by_format"]
  assert by_format == {fmt: int(n) for fmt, n in want.items() if n}
  assert sum(by_format.values()) == report["device_weight_bytes"] + report["host_weight_bytes"]


def test_offload_planner_sizes_resident_layers_as_held(mixed_gguf):
  """`offload_tail_layers="auto"` plans with the bytes the layers and head are held in (kept
  blocks, resident and offloaded alike): the plan's device and host weight bytes are
  `memory_report()`'s, with nothing offloaded where the float sizing would offload layers.
  (`test_offload_smollm.py` checks a plan that offloads a tail.)"""
  from jaxtier.offload.planner import ModelBytes
  path, _ = mixed_gguf
  kw = dict(max_num_seqs=2, max_model_len=64, offload_tail_layers="auto",
            gpu_memory_utilization=1.0, block_activations="float32")
  room = jaxtier.LLM(path, device_memory_gb=100.0, **kw)
  plan = room.offload.plan
  reserve = plan.kv_reserve_bytes + plan.activation_reserve_bytes
  assert room.offload.offload_tail_layers == 0
  assert plan.device_weight_bytes == room.memory_report()["device_weight_bytes"]
  floats = ModelBytes.from_config(MIXED_CONFIG, "float32").weight_bytes
  assert floats > plan.model.weight_bytes * 2
  between = jaxtier.LLM(path, device_memory_gb=(reserve + floats - 1) / 1e9, **kw)
  assert between.offload.offload_tail_layers == 0  # the float sizing offloaded layers here
  assert between.memory_report()["device_weight_bytes"] == plan.device_weight_bytes
  # One byte short of the kept weights: these layers mix formats, so an offloaded tail is a stack
  # in the one layout that holds them all (8-bit values per 16), and offloading n layers would
  # free their kept bytes but buffer two such layers, more than the four kept layers take.
  with pytest.raises(ValueError, match="Does not fit"):
    jaxtier.LLM(path, device_memory_gb=(reserve + plan.model.weight_bytes - 1) / 1e9, **kw)
