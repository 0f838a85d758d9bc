"""Compact weights for the portable path: int8 or 4-bit values with a scale (and a minimum) per
group of input rows, dequantized inside the matmul.

A projection's kernel [K, N] (`in`, `out`) is held as up to four arrays, `WeightFormat` says
which:

- `values` [K, N], int8 or uint4 (XLA's 4-bit type: half a byte per value on GPU and TPU); on
  CPU, whose runtime holds a byte per uint4 value and whose compiled programs cannot take such
  buffers, 4-bit values are packed two to a byte ("u4x2": uint8 [K / 2, N], row 2i in the low
  nibble and row 2i + 1 in the high one, `pack_nibbles`: a run of packed rows is a run of rows,
  so a tensor-parallel shard of a row-parallel kernel unpacks on its own device),
- `values` [K, N] float8_e4m3fn: FP8 weights (per-channel scales),
- `scales` [K / g, N], one per g input rows of each output column (g = K: per output channel),
- `mins` [K / g, N] or absent: w = scales * values + mins, per group (absent: w = scales * values),
- `perm` [K] int32 or absent: the input rows in the order the groups hold them, where a
  checkpoint's groups are not runs of consecutive rows (GPTQ's act-order, `g_idx`): row j of
  `values` is input row perm[j] of the weight, and the product is x[..., perm] @ w.

This one layout holds exactly what the other formats hold:

- `quantization="int8"`: symmetric, one float32 scale per output channel (`quantize_int8`), so
  the scale applies after the dot: (x @ values) * scales.
- `quantization="int4"`: asymmetric uint4 with a float16 scale and minimum per g rows, g = 32,
  64 or 128 (`quantize_int4`). Asymmetric because the same layout then holds GGUF's Q4_1 and
  Q4_0 blocks exactly, and for one shared layout a minimum costs 2 bytes per group.
- A GGUF file's blocks, without loss (float32 scales as gguf-py computes them): Q4_0, Q4_1 and
  Q4_K as uint4 with a scale and minimum per 32 rows ("q4_1"), Q8_0 and Q5_0 as int8 with a scale
  per 32 rows ("q8_0"), every other type that fits 8 bits (and layers of mixed types) as int8
  with a scale and minimum per 16 rows ("q8_16"). Dequantized, they are bit for bit gguf-py's
  float32 values: the product d q is exact in float32 and d q + m rounds once, as gguf-py does.
- A checkpoint quantized before it was downloaded (`jaxtier.checkpoint.prequantized`: GPTQ, AWQ,
  compressed-tensors): its 4- or 8-bit values with a float32 scale per group and, with zero
  points z, a float32 minimum -scale z (exact: scale (q - z) = scale q + (-scale z), each product
  exact in float32), in its own group size; FP8 weights as float8_e4m3fn values with a scale per
  output channel (or one per tensor, repeated).

`qmatmul` is the matmul: x @ dequantize(...) written so XLA fuses the conversion into the dot
(on a GPU the weight is read as int8 / uint4 and converted in registers; nothing float of the
weight's size is written); with per-channel scales the scale multiplies the product instead.
`dequantize` is the reference. Counting: `array_bytes` counts a 4-bit value as half a byte, as
XLA's compiled programs and accelerator buffers hold them.

Shape legend: K input rows, N output columns, G groups (K / g).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier.common.choices import QUANTIZATION_GROUP_SIZES, QUANTIZATIONS, check_quantization
from jaxtier.kernels.cpu import matmul

INT4_GROUP_SIZES = QUANTIZATION_GROUP_SIZES
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARTS = ("values", "scales", "mins", "perm")
VALUE_TYPES = ("int8", "uint4", "u4x2", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class WeightFormat:
  """How one projection's kernel is held: `values` "int8", "uint4" (or "u4x2", packed for CPU)
  or "float8_e4m3fn"; `group` input rows per scale (None: one scale per output column); `mins`
  whether each group has a minimum; `scale_dtype` the scales' (and minimums') dtype; `perm`
  whether the rows are held permuted (`perm` part: act-order groups)."""
  values: str
  group: int | None
  mins: bool
  scale_dtype: str
  perm: bool = False

  def __post_init__(self):
    if self.values not in VALUE_TYPES:
      raise ValueError(f"values {self.values!r}: expected one of {VALUE_TYPES}")

  @property
  def values_dtype(self):
    return jnp.dtype({"int8": jnp.int8, "uint4": jnp.uint4, "u4x2": jnp.uint8,
                      "float8_e4m3fn": jnp.float8_e4m3fn}[self.values])

  def on(self, platform: str) -> "WeightFormat":
    """This format as `platform` holds it: 4-bit values packed two to a byte on CPU."""
    if self.values == "uint4" and platform == "cpu":
      return dataclasses.replace(self, values="u4x2")
    return self

  def groups(self, k: int) -> int:
    if self.group is None:
      return 1
    if k % self.group:
      raise ValueError(f"a kernel of {k} input rows does not split into groups of {self.group}")
    return k // self.group

  def shapes(self, k: int, n: int) -> dict[str, jax.ShapeDtypeStruct]:
    """{part: shape and dtype} of a [k, n] kernel in this format."""
    g = self.groups(k)
    rows = k // 2 if self.values == "u4x2" else k
    out = {"values": jax.ShapeDtypeStruct((rows, n), self.values_dtype),
           "scales": jax.ShapeDtypeStruct((g, n), jnp.dtype(self.scale_dtype))}
    if self.mins:
      out["mins"] = jax.ShapeDtypeStruct((g, n), jnp.dtype(self.scale_dtype))
    if self.perm:
      out["perm"] = jax.ShapeDtypeStruct((k,), jnp.int32)
    return out

  def nbytes(self, k: int, n: int) -> int:
    """Bytes of a [k, n] kernel in this format (`array_bytes` of its parts)."""
    return sum(array_bytes(s) for s in self.shapes(k, n).values())


# A GGUF block format (`TensorSource.quantization`) -> the layout that holds it exactly.
BLOCK_LAYOUTS = {
    "q4_1": WeightFormat("uint4", 32, True, "float32"),
    "q8_0": WeightFormat("int8", 32, False, "float32"),
    "q8_16": WeightFormat("int8", 16, True, "float32"),
}


def quantized_format(quantization: str, group_size: int = 32) -> WeightFormat:
  """The layout of `quantization` ("int8", "fp8": per output channel; "int4": per `group_size`
  rows)."""
  check_quantization(quantization, group_size, optional=False)
  if quantization == "int8":
    return WeightFormat("int8", None, False, "float32")
  if quantization == "fp8":
    return WeightFormat("float8_e4m3fn", None, False, "float32")
  return WeightFormat("uint4", group_size, True, "float16")


def array_bytes(a) -> int:
  """Bytes of an array (or `jax.ShapeDtypeStruct`): 4-bit types at half a byte per value."""
  dtype = jnp.dtype(a.dtype)
  if dtype in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)):
    return -(-int(np.prod(a.shape, dtype=np.int64)) // 2)
  return int(np.prod(a.shape, dtype=np.int64)) * dtype.itemsize


def quantize_int8(w_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """w [..., K, N] (numpy) as int8 values [..., K, N] and float32 scales [..., 1, N]: symmetric,
  max |w| of each column to 127."""
  w = np.asarray(w_kn, np.float32)
  scale = np.abs(w).max(axis=-2, keepdims=True) / 127.0
  scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
  q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
  return q, scale


def quantize_int4(w_kn: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """w [..., K, N] (numpy) as 4-bit values 0-15 [..., K, N] (uint8), float16 scales and minimums
  [..., K / group, N]: each group's range [min, max] in 15 steps, the scale and minimum rounded
  to float16 before the values are chosen against them."""
  w = np.asarray(w_kn, np.float32)
  *lead, k, n = w.shape
  if k % group:
    raise ValueError(f"a kernel of {k} input rows does not split into groups of {group}")
  w = w.reshape(*lead, k // group, group, n)
  lo, hi = w.min(axis=-2), w.max(axis=-2)
  scale = ((hi - lo) / 15.0).astype(np.float16)
  low = lo.astype(np.float16)
  s32 = scale.astype(np.float32)
  safe = np.where(s32 > 0, s32, 1.0)
  q = np.clip(np.rint((w - low.astype(np.float32)[..., None, :]) / safe[..., None, :]), 0, 15)
  return q.astype(np.uint8).reshape(*lead, k, n), scale, low


def quantize(w_kn: np.ndarray, fmt: WeightFormat) -> tuple[np.ndarray, ...]:
  """w [..., K, N] (numpy) in the parts of `fmt` (values, scales[, mins]) as numpy arrays in
  `fmt`'s dtypes. Formats with float32 scales of 32 or 16 rows (the block layouts) quantize as
  `jaxtier.kernels.cpu.matmul.quantize_blocks` does the CPU kernels' blocks."""
  if fmt.values == "int8" and fmt.group is None:
    return quantize_int8(w_kn)
  if fmt.values == "float8_e4m3fn" and fmt.group is None:
    return quantize_fp8(w_kn)
  if fmt.values != "int8" and fmt.scale_dtype == "float16":
    return tuple(cast_parts(quantize_int4(w_kn, fmt.group), fmt).values())
  name = {v: k for k, v in BLOCK_LAYOUTS.items()}.get(fmt)
  if name is None:
    raise ValueError(f"no quantizer for {fmt}")
  parts = [np.asarray(p) for p in matmul.quantize_blocks(name, w_kn)]
  return tuple(cast_parts(parts, fmt).values())


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8(w_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """w [..., K, N] (numpy) as float8_e4m3fn values [..., K, N] and float32 scales [..., 1, N]:
  each column's max |w| to 448 (what llm-compressor's FP8 per-channel scheme and vLLM's
  on-load FP8 do), the values rounded to nearest."""
  w = np.asarray(w_kn, np.float32)
  scale = np.abs(w).max(axis=-2, keepdims=True) / np.float32(FP8_MAX)
  scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
  q = np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return q, scale


def pack_nibbles(q_kn: np.ndarray) -> np.ndarray:
  """4-bit values [..., K, N] (0-15) two to a byte: uint8 [..., K / 2, N], packed row i holding
  row 2i in its low nibbles and row 2i + 1 in its high ones."""
  q = np.asarray(q_kn).astype(np.uint8)
  return q[..., 0::2, :] | (q[..., 1::2, :] << 4)


def unpack_nibbles(p):
  """Inverse of `pack_nibbles` (jax): uint8 [..., K / 2, N] -> uint8 [..., K, N]."""
  *lead, half, n = p.shape
  return jnp.stack([p & 15, p >> 4], axis=-2).reshape(*lead, 2 * half, n)


def cast_parts(parts, fmt: WeightFormat) -> dict[str, np.ndarray]:
  """Block parts (q, d[, m][, perm]; d and m per group, as `TensorSource.read_blocks` gives
  them; perm where `fmt.perm`) as {part: array} in `fmt`'s dtypes; a format with minimums gets
  zeros where the parts have none."""
  q, d, *rest = parts
  perm = rest.pop() if fmt.perm else None
  if fmt.mins and not rest:
    rest = [np.zeros_like(d)]
  q = pack_nibbles(q) if fmt.values == "u4x2" else np.asarray(q).astype(fmt.values_dtype)
  out = {"values": q, "scales": np.asarray(d).astype(fmt.scale_dtype)}
  if fmt.mins:
    out["mins"] = np.asarray(rest[0]).astype(fmt.scale_dtype)
  if fmt.perm:
    out["perm"] = np.asarray(perm).astype(np.int32)
  return out


def dequantize(values, scales, mins=None, dtype=jnp.float32) -> jax.Array:
  """The weight [..., K, N] the parts hold, in `dtype`: scales * values (+ mins) per group,
  computed in float32. uint8 values of half the rows of the scales' groups are 4-bit values
  packed two to a byte (`pack_nibbles`)."""
  if values.dtype == jnp.uint8:
    values = unpack_nibbles(values)
  *lead, k, n = values.shape
  g = scales.shape[-2]
  w = values.astype(jnp.float32).reshape(*lead, g, k // g, n)
  w = w * scales.astype(jnp.float32)[..., :, None, :]
  if mins is not None:
    w = w + mins.astype(jnp.float32)[..., :, None, :]
  return w.reshape(*lead, k, n).astype(dtype)


def columns(values, scales, mins, index, dtype=jnp.float32) -> jax.Array:
  """Columns `index` (any shape of ints) of the weight [K, N] the parts hold, as rows
  [*index.shape, K] in `dtype`: the embedding lookup of a vocabulary table held [hidden, vocab]
  for the LM head's `qmatmul`."""
  flat = jnp.reshape(index, (-1,))
  take = lambda a: jnp.take(a, flat, axis=-1)
  w = dequantize(take(values), take(scales), None if mins is None else take(mins), dtype)
  return jnp.reshape(w.T, (*jnp.shape(index), w.shape[0]))


def qmatmul(x, values, scales, mins=None, perm=None) -> jax.Array:
  """x [..., K] @ the weight the parts hold [K, N], in x's dtype. One scale per column and no
  minimum: (x @ values) * scales, the conversion of the values feeding the dot alone; else
  x @ `dequantize(...)`, which XLA fuses into the dot on accelerators. `perm`: the rows are held
  permuted, so x's columns are taken in that order first."""
  if perm is not None:
    x = jnp.take(x, perm, axis=-1)
  if scales.shape[-2] == 1 and mins is None:
    return (x @ values.astype(x.dtype)) * scales[0].astype(x.dtype)
  return x @ dequantize(values, scales, mins, x.dtype)
