"""Weights packed in column panels, and x @ w on them: the CPU kernel, with an XLA reference.

A [K, N] weight is stored packed as [ceil(N / P), K, P]: panel p holds columns [P p, P p + P),
row by row, so each panel is one contiguous stream (columns past N are zero, and the product is
sliced back to N). P, `panel_width()`, is the width of the kernel's register tile on this CPU:
64 columns with AVX-512, 16 with AVX2 (64 where the kernels are unavailable; any P works with the
reference). `matmul_cpu.cc` multiplies by a packed weight reading each panel once in
order, with a tile of x's rows summed in registers: at decode's few rows XLA:CPU's matmuls on the
[K, N] layout fall well short of the memory's rate, and the kernel streams the weight at it; at
prefill sizes the two are on par.

A weight can also be packed from GGUF's Q4_1 blocks (`pack_q4_1`): uint8 [ceil(N / P), K / 32,
24 P], for every 32 rows of a panel the blocks' scales d and minimums m (float32, P each) and the
4-bit values q (row by row, a row's byte j holding column j in its low nibble and column j + P / 2
in its high one); w = d q + m. Or from Q8_0 blocks (`pack_q8_0`): int8 [ceil(N / P), K / 32,
36 P], per block the scales d (float32, P) then the 8-bit values row by row; w = d q. Or from
8-bit values with a scale and a minimum per 16 rows (`pack_q8_16`, uint32 [ceil(N / P), K / 32,
12 P]; w = d q + m), which holds exactly every GGUF type whose values fit 8 bits (Q6_K, Q5_K,
Q5_1 and the rest), so a fused kernel whose parts come in different types stays in blocks. Every
function here takes any of these formats (`weight_format` tells them apart by dtype). The
kernel dequantizes each pass of 64 panel rows into its cache and multiplies as for float32
panels; d q is exact in float32, so d q + m rounds once, as GGUF's dequantization does, and
products are bit for bit those of the float32 panels of the dequantized weights
(`dequantize_packed`), from 0.75 (Q4_1), 1.125 (Q8_0) or 1.5 (Q8_16) bytes per weight instead
of 4.

The same blocks can instead multiply with int16 activations (`pack_q4_1(..., activations="int16")`,
`pack_q8_0` and `pack_q8_16` likewise): uint16 (Q4_1), int16 (Q8_0) or int32 (Q8_16) words
holding the blocks in panels of L columns, L = `lanes()` (16 with AVX-512, 8 with AVX2), per
block d (and m) then the values in pairs of K rows (see `matmul_cpu.cc`). The kernel
quantizes x per block of 32 values to int16 (`quantize_activations`) and sums each block's
products exactly in int32; the reference is x's dequantized int16 values times the dequantized
weights. Faster (no float dequantization, a
multiply-add per pair of rows), but no longer bit for bit the dequantized model: x's rounding to
16 bits moves the logits a little.

`packed_matmul` picks the kernel when the program is lowered for CPU and the kernel is built
(`jaxtier.kernels.cpu.library`); elsewhere, or for dtypes other than float32, it is
`reference_matmul`, an einsum that XLA runs with the weight transposed back (correct everywhere,
slower). `norm_packed_matmul` is rms_norm(x) @ w in one kernel call (`rms_norm` the reference norm),
`norm_rope_packed_matmul` that plus a bias and the rotary embedding of the leading heads (a decoder
layer's q/k/v), and `glu_packed_matmul` is (silu(gate) * up) @ w (`silu_glu` the reference gating).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier.common.choices import BLOCK_ACTIVATIONS
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.model.rotary import apply_rotary

DEFAULT_PANEL = 64  # columns per panel where the kernels are unavailable
DEFAULT_LANES = 16  # columns per int16-activation panel where the kernels are unavailable
# The kernels' `format` attribute: float32 panels, GGUF blocks, GGUF blocks with int16 activations.
FORMATS = {"float32": 0, "q4_1": 1, "q8_0": 2, "q4_1_i16": 3, "q8_0_i16": 4, "q8_16": 5,
           "q8_16_i16": 6}
ACTIVATIONS = BLOCK_ACTIVATIONS  # how block formats multiply
QUANT_BLOCK = 32  # K rows per block of every block format
HALF_BLOCK = 16  # K rows per scale and minimum of the "q8_16" format
# A block's bytes per panel column: Q4_1 d and m (4 bytes each) and 32 nibbles; Q8_0 d and 32
# bytes; Q8_16 two (d, m) pairs and 32 bytes.
BYTES_PER_COLUMN = {"q4_1": 24, "q8_0": 36, "q4_1_i16": 24, "q8_0_i16": 36, "q8_16": 48,
                    "q8_16_i16": 48}
_DTYPES = {np.dtype(np.uint8): "q4_1", np.dtype(np.int8): "q8_0", np.dtype(np.uint16): "q4_1_i16",
           np.dtype(np.int16): "q8_0_i16", np.dtype(np.uint32): "q8_16",
           np.dtype(np.int32): "q8_16_i16"}


def panel_width() -> int:
  """Columns per panel that `pack` uses: the CPU kernel's tile width (64 with AVX-512, 16 with
  AVX2), or `DEFAULT_PANEL` without the kernels."""
  return cpu_kernels.panel_width() or DEFAULT_PANEL


def lanes() -> int:
  """Columns per panel of the int16-activation block formats: the kernel's vector lanes (16 with
  AVX-512, 8 with AVX2), or `DEFAULT_LANES` without the kernels."""
  return cpu_kernels.lanes() or DEFAULT_LANES


def panels(n: int, width: int | None = None) -> int:
  """Panels of `width` columns (default `panel_width()`) of a weight with n output columns (the
  last one zero-padded)."""
  return -(-n // (width or panel_width()))


def packs_exactly(*widths: int) -> bool:
  """Whether weights of these output widths pack with no padding (the same bytes packed)."""
  return all(n % panel_width() == 0 for n in widths)


def pack(w_kn, width: int | None = None):
  """[..., K, N] -> [..., ceil(N / P), K, P] with P = `width` (default `panel_width()`), the
  columns past N zero (numpy in, numpy out; jax in, jax out)."""
  width = width or panel_width()
  *lead, k, n = w_kn.shape
  xp = np if isinstance(w_kn, np.ndarray) else jnp
  pad = panels(n, width) * width - n
  if pad:
    w_kn = xp.concatenate([w_kn, xp.zeros((*lead, k, pad), w_kn.dtype)], axis=-1)
  w = xp.swapaxes(w_kn.reshape(*lead, k, panels(n, width), width), -3, -2)
  return np.ascontiguousarray(w) if xp is np else w


def weight_format(w) -> str:
  """The format of a packed weight, told by its dtype: "q4_1" (uint8, `pack_q4_1`), "q8_0"
  (int8, `pack_q8_0`), "q8_16" (uint32, `pack_q8_16`), "q4_1_i16" (uint16), "q8_0_i16" (int16)
  and "q8_16_i16" (int32) (the same with activations="int16"), else "float32" (float panels)."""
  return _DTYPES.get(np.dtype(w.dtype), "float32")


def _per_column(fmt: str, dtype) -> int:
  """Elements of `dtype` per panel column of one block (1 for float panels)."""
  return BYTES_PER_COLUMN[fmt] // np.dtype(dtype).itemsize if fmt in BYTES_PER_COLUMN else 1


def panel_columns(w) -> int:
  """Columns per panel of a packed weight of any format."""
  return w.shape[-1] // _per_column(weight_format(w), w.dtype)


def packed_rows(w) -> int:
  """K, the rows of a packed weight of any format."""
  return w.shape[-2] * (QUANT_BLOCK if weight_format(w) != "float32" else 1)


def parameter_count(w) -> int:
  """Weights (float values) an array holds: 32 per 24 bytes of a Q4_1-packed one, per 36 of a
  Q8_0-packed one and per 48 of a Q8_16-packed one (padding columns included, as in a float
  panel), its size otherwise."""
  fmt = weight_format(w)
  return w.size if fmt == "float32" else w.size // _per_column(fmt, w.dtype) * QUANT_BLOCK


def _blocks_of(w_kn, name: str):
  """(numpy or jax.numpy, w [..., K, N] as float32 blocks [..., K / 32, 32, N])."""
  xp = np if isinstance(w_kn, np.ndarray) else jnp
  *lead, k, n = w_kn.shape
  if k % QUANT_BLOCK:
    raise ValueError(f"{name} needs K to be a multiple of {QUANT_BLOCK}, got {k}")
  return xp, w_kn.astype(xp.float32).reshape(*lead, k // QUANT_BLOCK, QUANT_BLOCK, n)


def quantize_q4_1(w_kn):
  """GGUF's Q4_1 quantization of [..., K, N] in blocks of 32 rows (llama.cpp's reference
  rounding: d = (max - min) / 15, q = floor((w - min) / d + 0.5) clipped to [0, 15], d and min
  stored as float16): (q uint8 [..., K, N], d [..., K / 32, N], m [..., K / 32, N]) with d and m
  float32 holding the float16 values, so that `d q + m` is the dequantized weight. Numpy in,
  numpy out; jax in, jax out."""
  xp, blocks = _blocks_of(w_kn, "Q4_1")
  low, high = blocks.min(axis=-2), blocks.max(axis=-2)
  d = (high - low) / 15
  inv = xp.where(d > 0, 1 / xp.where(d > 0, d, 1), 0)
  q = xp.clip(xp.floor((blocks - low[..., None, :]) * inv[..., None, :] + 0.5), 0, 15)
  as_half = lambda a: a.astype(xp.float16).astype(xp.float32)
  return q.astype(xp.uint8).reshape(w_kn.shape), as_half(d), as_half(low)


def _block_panels(a_kn, width: int, rows: int):
  """[..., K, N] -> [..., ceil(N / P), K / rows, rows, P] (P = width), columns past N zero: a
  weight's blocks of `rows` rows (or, rows=1, their scales) in panel order."""
  xp = np if isinstance(a_kn, np.ndarray) else jnp
  *lead, k, n = a_kn.shape
  p = panels(n, width)
  if p * width != n:
    a_kn = xp.concatenate([a_kn, xp.zeros((*lead, k, p * width - n), a_kn.dtype)], -1)
  return xp.moveaxis(a_kn.reshape(*lead, k // rows, rows, p, width), -2, -4)


def _scale_bytes(a_bn, width: int, dtype):
  """Block scales [..., K / 32, N] -> their float32 bytes in panel order, [..., ceil(N / P),
  K / 32, 4 P] of `dtype` (uint8 or int8)."""
  a = _block_panels(a_bn.astype(np.float32), width, 1)[..., 0, :]
  if isinstance(a, np.ndarray):
    return np.ascontiguousarray(a).view(dtype)
  return jax.lax.bitcast_convert_type(a, dtype).reshape(*a.shape[:-1], 4 * width)


def pack_q4_1(q_kn, d_bn, m_bn, width: int | None = None, activations: str = "float32"):
  """Q4_1 values q [..., K, N] (0-15), scales d and minimums m [..., K / 32, N] (float32) ->
  uint8 [..., ceil(N / P), K / 32, 24 P], P = `width` (default `panel_width()`); columns past N
  are zero (d = m = 0). With activations="int16": uint16 [..., ceil(N / L), K / 32, 12 L], L =
  `width` (default `lanes()`). Numpy in, numpy out; jax in, jax out."""
  xp, width = _pack_args(q_kn, {"d": d_bn, "m": m_bn}, QUANT_BLOCK, width, activations)
  q = _block_panels(q_kn.astype(xp.uint8), width, QUANT_BLOCK)  # [..., p, B, 32, P]
  if activations == "int16":  # rows 2t + j (low nibble) and 16 + 2t + j (high) at [t, c, j]
    half = _row_pairs(q[..., :16, :]) | (_row_pairs(q[..., 16:, :]) << 4)
    nibbles = half.reshape(*q.shape[:-2], 16 * width)
  else:
    half = width // 2
    nibbles = (q[..., :half] | (q[..., half:] << 4)).reshape(*q.shape[:-2], QUANT_BLOCK * half)
  out = xp.concatenate([_scale_bytes(d_bn, width, np.uint8), _scale_bytes(m_bn, width, np.uint8),
                        nibbles], axis=-1)
  out = np.ascontiguousarray(out) if xp is np else out
  return out if activations == "float32" else _as_words(out, np.uint16)


def quantize_q8_0(w_kn):
  """GGUF's Q8_0 quantization of [..., K, N] in blocks of 32 rows (llama.cpp's reference: d =
  max |w| / 127 stored as float16, q = w / d rounded half away from zero): (q int8 [..., K, N],
  d float32 [..., K / 32, N] holding the float16 values), `d q` the dequantized weight."""
  xp, blocks = _blocks_of(w_kn, "Q8_0")
  d = xp.abs(blocks).max(axis=-2) / 127
  inv = xp.where(d > 0, 1 / xp.where(d > 0, d, 1), 0)
  scaled = blocks * inv[..., None, :]
  q = xp.sign(scaled) * xp.floor(xp.abs(scaled) + 0.5)
  return q.astype(xp.int8).reshape(w_kn.shape), d.astype(xp.float16).astype(xp.float32)


def pack_q8_0(q_kn, d_bn, width: int | None = None, activations: str = "float32"):
  """Q8_0 values q [..., K, N] (int8) and scales d [..., K / 32, N] (float32) -> int8 [...,
  ceil(N / P), K / 32, 36 P]: per block of a panel, d (float32, P) then q row by row; columns
  past N are zero. With activations="int16": int16 [..., ceil(N / L), K / 32, 18 L], L = `width`
  (default `lanes()`), the values in pairs of rows. Numpy in, numpy out; jax in, jax out."""
  xp, width = _pack_args(q_kn, {"d": d_bn}, QUANT_BLOCK, width, activations)
  q = _block_panels(q_kn.astype(xp.int8), width, QUANT_BLOCK)  # [..., p, B, 32, P]
  values = (_row_pairs(q) if activations == "int16" else q).reshape(*q.shape[:-2], -1)
  out = xp.concatenate([_scale_bytes(d_bn, width, np.int8), values], axis=-1)
  out = np.ascontiguousarray(out) if xp is np else out
  return out if activations == "float32" else _as_words(out, np.int16)


def quantize_q8_16(w_kn):
  """w [..., K, N] (K a multiple of 32) in the "q8_16" format's terms: per 16 rows d = (max -
  min) / 255 and m = min + 128 d, both stored as float16 (as GGUF stores scales, so d q is exact
  in float32), and q = round((w - m) / d) clipped to [-128, 127] (a float layer quantized so; the
  loader takes a GGUF file's own values instead). Returns (q int8 [..., K, N], d and m float32
  [..., K / 16, N]), `d q + m` the dequantized weight."""
  xp, blocks = _blocks_of(w_kn, "Q8_16")
  *lead, k, n = w_kn.shape
  halves = blocks.reshape(*lead, k // HALF_BLOCK, HALF_BLOCK, n)
  low, high = halves.min(axis=-2), halves.max(axis=-2)
  as_half = lambda a: a.astype(xp.float16).astype(xp.float32)
  d = as_half((high - low) / 255)
  m = as_half(low + 128 * d)
  inv = xp.where(d > 0, 1 / xp.where(d > 0, d, 1), 0)
  q = xp.clip(xp.round((halves - m[..., None, :]) * inv[..., None, :]), -128, 127)
  return q.astype(xp.int8).reshape(w_kn.shape), d, m


def pack_q8_16(q_kn, d_hn, m_hn, width: int | None = None, activations: str = "float32"):
  """8-bit values q [..., K, N] (int8) with a scale d and minimum m per 16 rows [..., K / 16, N]
  (float32; w = d q + m) -> uint32 [..., ceil(N / P), K / 32, 12 P]: per block of 32 rows of a
  panel, the first 16 rows' d and m, the last 16's d and m (float32, P each), then q row by row;
  columns past N are zero. It holds every GGUF type whose values fit 8 bits exactly
  (`jaxtier.checkpoint.gguf_file.block_parts_q8_16`). With activations="int16": int32 [...,
  ceil(N / L), K / 32, 12 L], L = `width` (default `lanes()`), the values in pairs of rows. Numpy
  in, numpy out; jax in, jax out."""
  xp, width = _pack_args(q_kn, {"d": d_hn, "m": m_hn}, HALF_BLOCK, width, activations)
  *lead, k, n = q_kn.shape
  q = _block_panels(q_kn.astype(xp.int8), width, QUANT_BLOCK)  # [..., p, B, 32, P]
  values = (_row_pairs(q) if activations == "int16" else q).reshape(*q.shape[:-2], -1)
  pairs = lambda a: a.reshape(*lead, k // QUANT_BLOCK, 2, n)
  d, m = pairs(d_hn), pairs(m_hn)
  scales = [_scale_bytes(a[..., half, :], width, np.int8) for half in (0, 1) for a in (d, m)]
  out = xp.concatenate([*scales, values], axis=-1)
  out = np.ascontiguousarray(out) if xp is np else out
  return _as_words(out, np.uint32 if activations == "float32" else np.int32)


BLOCK_FORMATS = ("q4_1", "q8_0", "q8_16")  # what `quantize_blocks` and `pack_blocks` take


def quantize_blocks(fmt: str, w_kn):
  """w [..., K, N] quantized to the parts of block format `fmt` (`quantize_q4_1`,
  `quantize_q8_0` or `quantize_q8_16`)."""
  quantize = {"q4_1": quantize_q4_1, "q8_0": quantize_q8_0, "q8_16": quantize_q8_16}
  if fmt not in quantize:
    raise ValueError(f"block format {fmt!r}: expected one of {BLOCK_FORMATS}")
  return quantize[fmt](w_kn)


def pack_blocks(fmt: str, parts, activations: str = "float32"):
  """A weight's block parts ((q, d, m) or (q, d), as `quantize_blocks` or a checkpoint's
  `read_blocks` give them) packed in format `fmt` for `activations` (`pack_q4_1`, `pack_q8_0`,
  `pack_q8_16`)."""
  _check_activations(activations)
  if fmt == "q4_1":
    return pack_q4_1(*parts, activations=activations)
  if fmt == "q8_0":
    return pack_q8_0(*parts, activations=activations)
  if fmt == "q8_16":
    return pack_q8_16(*parts, activations=activations)
  raise ValueError(f"block format {fmt!r}: expected one of {BLOCK_FORMATS}")


def _pack_args(q_kn, scales: dict, rows: int, width: int | None, activations: str):
  """Checks a pack function's q [..., K, N] (K a multiple of 32) and its scales (per `rows`
  rows, [..., K / rows, N]); returns (numpy or jax.numpy, as q is, and the panel width: `width`,
  else `panel_width()`, or `lanes()` for int16 activations)."""
  _check_activations(activations)
  *lead, k, n = q_kn.shape
  if k % QUANT_BLOCK or any(a.shape != (*lead, k // rows, n) for a in scales.values()):
    raise ValueError(f"expected q [..., K, N] with K a multiple of {QUANT_BLOCK} and "
                     f"{', '.join(scales)} [..., K / {rows}, N]; got q {q_kn.shape}, "
                     + ", ".join(f"{name} {a.shape}" for name, a in scales.items()))
  width = width or (panel_width() if activations == "float32" else lanes())
  return (np if isinstance(q_kn, np.ndarray) else jnp), width


def _check_activations(activations: str) -> None:
  if activations not in ACTIVATIONS:
    raise ValueError(f"activations={activations!r}: expected one of {ACTIVATIONS}")


def _row_pairs(q):
  """Block rows [..., 2 T, C] -> [..., T, C, 2]: each column's rows 2t and 2t + 1 side by side."""
  xp = np if isinstance(q, np.ndarray) else jnp
  *lead, rows, c = q.shape
  return xp.swapaxes(q.reshape(*lead, rows // 2, 2, c), -1, -2)


def _as_words(a, dtype):
  """Bytes [..., s n] (uint8 or int8) -> [..., n] of the s-byte `dtype`, the same memory."""
  if isinstance(a, np.ndarray):
    return a.view(np.dtype(dtype))
  size = np.dtype(dtype).itemsize
  return jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // size, size), dtype)


def _as_bytes(w):
  """A block weight held in words [..., n] (the int16-activation formats, Q8_16) -> its bytes
  [..., s n] (uint8 for Q4_1, int8 for Q8_0 and Q8_16)."""
  dtype = np.uint8 if weight_format(w) == "q4_1_i16" else np.int8
  size = np.dtype(w.dtype).itemsize
  if isinstance(w, np.ndarray):
    return np.ascontiguousarray(w).view(dtype)
  return jax.lax.bitcast_convert_type(w, dtype).reshape(*w.shape[:-1], size * w.shape[-1])


def _block_floats(a, width: int):
  """[..., 4 C] bytes (uint8 or int8) -> [..., C] float32, the bytes reinterpreted."""
  if isinstance(a, np.ndarray):
    return np.ascontiguousarray(a).view(np.float32)
  return jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], width, 4), jnp.float32)


def dequantize_packed(w):
  """A `pack_q4_1`, `pack_q8_0` or `pack_q8_16` weight -> float32 panels [..., P, K, C] (d q + m
  or d q, GGUF's float32 values); a float weight as it is. Numpy in, numpy out; jax in, jax out."""
  fmt = weight_format(w)
  if fmt == "float32":
    return w
  xp = np if isinstance(w, np.ndarray) else jnp
  width = panel_columns(w)
  if fmt.startswith("q8_16"):
    b = _as_bytes(w)
    *lead, blocks, _ = b.shape
    scale = lambda i: _block_floats(b[..., 4 * i * width:4 * (i + 1) * width], width)
    rows = lambda a: xp.repeat(xp.stack(a, axis=-2), HALF_BLOCK, axis=-2)  # [..., B, 32, C]
    d, m = rows([scale(0), scale(2)]), rows([scale(1), scale(3)])
    q = b[..., 16 * width:]
    q = (xp.swapaxes(q.reshape(*lead, blocks, 16, width, 2), -1, -2)  # [.., T, 2, C]: unpaired
         if fmt.endswith("_i16") else q).reshape(*lead, blocks, QUANT_BLOCK, width)
    return (d * q.astype(xp.float32) + m).reshape(*lead, blocks * QUANT_BLOCK, width)
  if fmt.endswith("_i16"):
    return _dequantize_pairs(_as_bytes(w), fmt, width, xp)
  *lead, blocks, size = w.shape
  d = _block_floats(w[..., :4 * width], width)
  if fmt == "q8_0":
    q = w[..., 4 * width:].reshape(*lead, blocks, QUANT_BLOCK, width).astype(xp.float32)
    return (d[..., None, :] * q).reshape(*lead, blocks * QUANT_BLOCK, width)
  m = _block_floats(w[..., 4 * width:8 * width], width)
  nibbles = w[..., 8 * width:].reshape(*lead, blocks, QUANT_BLOCK, width // 2)
  q = xp.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(xp.float32)
  out = d[..., None, :] * q + m[..., None, :]
  return out.reshape(*lead, blocks * QUANT_BLOCK, width)


def _dequantize_pairs(b, fmt: str, width: int, xp):
  """`dequantize_packed` of an int16-activation format's bytes b [..., B, 24 L or 36 L]."""
  *lead, blocks, _ = b.shape
  unpair = lambda v: xp.swapaxes(v, -1, -2).reshape(*lead, blocks, -1, width)  # [.., T, L, 2]
  d = _block_floats(b[..., :4 * width], width)[..., None, :]
  if fmt == "q8_0_i16":
    q = unpair(b[..., 4 * width:].reshape(*lead, blocks, 16, width, 2)).astype(xp.float32)
    return (d * q).reshape(*lead, blocks * QUANT_BLOCK, width)
  m = _block_floats(b[..., 4 * width:8 * width], width)[..., None, :]
  nibbles = b[..., 8 * width:].reshape(*lead, blocks, 8, width, 2)
  q = xp.concatenate([unpair(nibbles & 15), unpair(nibbles >> 4)], axis=-2).astype(xp.float32)
  return (d * q + m).reshape(*lead, blocks * QUANT_BLOCK, width)


def quantize_activations(x):
  """x [..., K] (K a multiple of 32) quantized as the int16-activation formats multiply it: per
  block of 32 values d = max |x| / 32767 and q = x * (1 / d) rounded to nearest even (0 where
  the block is all zero). Returns (q [..., K] float32 holding the integers, d [..., K / 32]).
  The kernel's product is sum over blocks of d_x d_w sum(q_x q_w) (+ m_w d_x sum(q_x) for Q4_1),
  the block sums exact."""
  xp = np if isinstance(x, np.ndarray) else jnp
  *lead, k = x.shape
  blocks = x.astype(xp.float32).reshape(*lead, k // QUANT_BLOCK, QUANT_BLOCK)
  d = xp.abs(blocks).max(axis=-1) / xp.float32(32767)
  inv = xp.where(d > 0, xp.float32(1) / xp.where(d > 0, d, xp.float32(1)), xp.float32(0))
  q = xp.round(blocks * inv[..., None])  # round half to even, like the kernel
  return q.reshape(x.shape), d


def packed_columns(w, ids):
  """Columns `ids` (any shape) of a packed weight of any format -> float32 [*ids.shape, K]: the
  embedding rows of a tied table held packed as the LM head. A block format gathers only each
  column's scale(s) and values, not its panels."""
  fmt = weight_format(w)
  width = panel_columns(w)
  panel, column = ids // width, ids % width
  if fmt == "float32":
    return w[panel, :, column]
  b = _as_bytes(w) if w.dtype.itemsize > 1 else w  # a block's bytes [P, B, 24 C, 36 C or 48 C]
  blocks = b.shape[-2]
  blk = jnp.arange(blocks)[:, None]
  p, c = panel[..., None, None], column[..., None, None]
  floats = lambda start: jax.lax.bitcast_convert_type(b[p, blk, start + 4 * c + jnp.arange(4)],
                                                      jnp.float32)  # [..., B]
  d = floats(0)
  rows = jnp.arange(QUANT_BLOCK)
  if fmt.startswith("q8_16"):  # the half's d and m; row i's own row of bytes, or a pair's byte
    high = rows >= HALF_BLOCK
    half = lambda i: jnp.where(high, floats((2 + i) * 4 * width)[..., None],
                               floats(i * 4 * width)[..., None])
    d, m = half(0), half(1)
    at = rows * width + c if fmt == "q8_16" else (rows // 2) * 2 * width + 2 * c + rows % 2
    q = b[p, blk, 16 * width + at].astype(jnp.float32)  # [..., B, 32]
    return (d * q + m).reshape(*ids.shape, blocks * QUANT_BLOCK)
  if fmt.startswith("q8_0"):  # row i: its own row of bytes, or byte i % 2 of pair i // 2
    at = rows * width + c if fmt == "q8_0" else (rows // 2) * 2 * width + 2 * c + rows % 2
    q = b[p, blk, 4 * width + at].astype(jnp.float32)  # [..., B, 32]
    return (d[..., None] * q).reshape(*ids.shape, blocks * QUANT_BLOCK)
  if fmt == "q4_1":  # a row's byte c % (C / 2), the high nibble for the second half of columns
    half = width // 2
    at, high = rows * half + c % half, c >= half
  else:  # rows i and 16 + i share a byte of pair (i % 16) // 2
    low = rows % 16
    at, high = (low // 2) * 2 * width + 2 * c + low % 2, rows >= 16
  byte = b[p, blk, 8 * width + at]
  q = jnp.where(high, byte >> 4, byte & 15).astype(jnp.float32)
  return (d[..., None] * q + floats(4 * width)[..., None]).reshape(*ids.shape,
                                                                   blocks * QUANT_BLOCK)


def reference_matmul(x_mk: jax.Array, w_pkc: jax.Array, n: int | None = None) -> jax.Array:
  """x [..., K] @ packed w (any format) -> [..., n] (n: all the panels' columns if None), by
  XLA. For the int16-activation formats x is first quantized (`quantize_activations`)."""
  if weight_format(w_pkc).endswith("_i16"):
    q, d = quantize_activations(x_mk)
    x_mk = (q.reshape(*d.shape, QUANT_BLOCK) * d[..., None]).reshape(x_mk.shape)
  out = jnp.einsum("...k,pkc->...pc", x_mk, dequantize_packed(w_pkc))
  out = out.reshape(*out.shape[:-2], -1)
  return out if n is None else out[..., :n]


def _format_attr(w) -> np.int64:
  return np.int64(FORMATS[weight_format(w)])


def _columns(w) -> int:
  """All the panels' columns of a packed weight."""
  return w.shape[0] * panel_columns(w)


def _kernel_matmul(x_mk: jax.Array, w_pkc: jax.Array) -> jax.Array:
  lead, k = x_mk.shape[:-1], x_mk.shape[-1]
  out = jax.ffi.ffi_call(cpu_kernels.MATMUL_TARGET,
                         jax.ShapeDtypeStruct((x_mk.size // k, _columns(w_pkc)), jnp.float32))(
                             x_mk.reshape(-1, k), w_pkc, format=_format_attr(w_pkc))
  return out.reshape(*lead, -1)


def _check_packed(x_mk, w_pkc, n):
  fmt = weight_format(w_pkc)
  per_column = _per_column(fmt, w_pkc.dtype)
  if (w_pkc.ndim != 3 or packed_rows(w_pkc) != x_mk.shape[-1]
      or w_pkc.shape[-1] % (2 * per_column)):
    expected = (f"[P, {x_mk.shape[-1] // QUANT_BLOCK}, {per_column} C] ({fmt.upper()}, "
                f"{np.dtype(w_pkc.dtype).name})" if fmt != "float32" else f"[P, {x_mk.shape[-1]}, C]")
    raise ValueError(f"expected a packed weight {expected} for x of shape {x_mk.shape}, got "
                     f"{w_pkc.shape}")
  p, c = w_pkc.shape[0], panel_columns(w_pkc)
  if n is not None and not (p - 1) * c < n <= p * c:
    raise ValueError(f"n={n} does not fit a packed weight of {p} panels of {c} columns")


def _kernel_applies(x, w_pkc, *others) -> bool:
  """Whether the CPU kernel can multiply x by w (with `others`, the call's other arrays): all
  float32 but a Q4_1 or Q8_0 weight, x not empty, the kernels built, and panels of the width they
  were built for (any other width runs the reference)."""
  return (all(a.dtype == jnp.float32 for a in (x, *others))
          and w_pkc.dtype in (jnp.float32, jnp.uint8, jnp.int8, jnp.uint16, jnp.int16, jnp.uint32,
                              jnp.int32)
          and x.size > 0 and cpu_kernels.available()
          and panel_columns(w_pkc) == (cpu_kernels.lanes() if weight_format(w_pkc).endswith("_i16")
                                       else cpu_kernels.panel_width()))


def packed_matmul(x_mk: jax.Array, w_pkc: jax.Array, n: int | None = None) -> jax.Array:
  """x [..., K] @ packed w [P, K, C] -> [..., n]: the CPU kernel where it applies.

  n: the weight's columns before padding (None: all P * C).
  """
  _check_packed(x_mk, w_pkc, n)
  if not _kernel_applies(x_mk, w_pkc):
    out = reference_matmul(x_mk, w_pkc)
  else:
    out = cpu_kernels.cpu_or_reference(x_mk, w_pkc, cpu=_kernel_matmul, default=reference_matmul)
  return out if n is None else out[..., :n]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) * scale over the last axis, computed in float32 and scaled in x's
  dtype: `jaxtier.model.RMSNorm`'s arithmetic."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale * y.astype(x.dtype)


def _kernel_norm_matmul(x_mk, scale_k, w_pkc, *, eps):
  lead, k = x_mk.shape[:-1], x_mk.shape[-1]
  out = jax.ffi.ffi_call(cpu_kernels.NORM_MATMUL_TARGET,
                         jax.ShapeDtypeStruct((x_mk.size // k, _columns(w_pkc)), jnp.float32))(
                             x_mk.reshape(-1, k), scale_k, w_pkc, eps=np.float32(eps),
                             format=_format_attr(w_pkc))
  return out.reshape(*lead, -1)


def _reference_norm_matmul(x_mk, scale_k, w_pkc, *, eps):
  return reference_matmul(rms_norm(x_mk, scale_k, eps), w_pkc)


def norm_packed_matmul(x_mk: jax.Array, scale_k: jax.Array, w_pkc: jax.Array, n: int | None,
                       eps: float) -> jax.Array:
  """rms_norm(x, scale, eps) [..., K] @ packed w [P, K, C] -> [..., n], as one CPU kernel call
  where it applies (the norm's reduction and multiply are two more XLA:CPU ops otherwise, each
  slower at decode than the norm's arithmetic); else `rms_norm` then `reference_matmul`."""
  _check_packed(x_mk, w_pkc, n)
  if scale_k.shape != (x_mk.shape[-1],):
    raise ValueError(f"expected a norm scale of shape ({x_mk.shape[-1]},), got {scale_k.shape}")
  if not _kernel_applies(x_mk, w_pkc, scale_k):
    out = _reference_norm_matmul(x_mk, scale_k, w_pkc, eps=eps)
  else:
    out = cpu_kernels.cpu_or_reference(x_mk, scale_k, w_pkc,
                                       cpu=functools.partial(_kernel_norm_matmul, eps=eps),
                                       default=functools.partial(_reference_norm_matmul, eps=eps))
  return out if n is None else out[..., :n]


def _kernel_norm_rope_matmul(x_mk, scale_k, w_pkc, bias_n, cos_md, sin_md, *, eps, rotary):
  lead, k = x_mk.shape[:-1], x_mk.shape[-1]
  d = cos_md.shape[-1]
  out = jax.ffi.ffi_call(cpu_kernels.NORM_ROPE_MATMUL_TARGET,
                         jax.ShapeDtypeStruct((x_mk.size // k, _columns(w_pkc)), jnp.float32))(
                             x_mk.reshape(-1, k), scale_k, w_pkc, bias_n, cos_md.reshape(-1, d),
                             sin_md.reshape(-1, d), eps=np.float32(eps), rotary_columns=rotary,
                             format=_format_attr(w_pkc))
  return out.reshape(*lead, -1)


def _reference_norm_rope_matmul(x_mk, scale_k, w_pkc, bias_n, cos_md, sin_md, *, eps, rotary):
  y = _reference_norm_matmul(x_mk, scale_k, w_pkc, eps=eps)
  if bias_n.shape[0]:
    y = y + bias_n
  d = cos_md.shape[-1]
  heads = y[..., :rotary].reshape(*y.shape[:-1], rotary // d, d)
  return jnp.concatenate([apply_rotary(heads, cos_md, sin_md).reshape(*y.shape[:-1], rotary),
                          y[..., rotary:]], axis=-1)


def norm_rope_packed_matmul(x_mk: jax.Array, scale_k: jax.Array, w_pkc: jax.Array,
                            n: int | None, eps: float, bias_n: jax.Array | None,
                            cos_md: jax.Array, sin_md: jax.Array, rotary_columns: int
                            ) -> jax.Array:
  """rms_norm(x, scale, eps) [..., K] @ packed w [P, K, C] + bias -> [..., n], with the rotary
  embedding (`jaxtier.model.rotary.apply_rotary`) of the first `rotary_columns` columns in heads of
  d = cos's width: a decoder layer's q/k/v projection, as one CPU kernel call where it applies
  (XLA recomputed cos and sin in each of q's and k's rotary ops, per layer). cos and sin are
  [..., d] with x's leading dims; bias [n] or None."""
  _check_packed(x_mk, w_pkc, n)
  full = _columns(w_pkc)  # the kernel's product spans the padded panels
  width = full if n is None else n
  d = cos_md.shape[-1]
  if scale_k.shape != (x_mk.shape[-1],):
    raise ValueError(f"expected a norm scale of shape ({x_mk.shape[-1]},), got {scale_k.shape}")
  if cos_md.shape != sin_md.shape or cos_md.shape[:-1] != x_mk.shape[:-1] or d % 2:
    raise ValueError(f"expected cos and sin of shape {x_mk.shape[:-1]} + (d,) with d even, got "
                     f"{cos_md.shape} and {sin_md.shape}")
  if not d or rotary_columns % d or not 0 <= rotary_columns <= width:
    raise ValueError(f"rotary_columns={rotary_columns} must be a multiple of the head dim {d} "
                     f"and at most the width {width}")
  if bias_n is not None and bias_n.shape != (width,):
    raise ValueError(f"expected a bias of shape ({width},), got {bias_n.shape}")
  # The bias takes the product's padded width (zeros past n).
  bias = (jnp.zeros((0,), jnp.float32) if bias_n is None
          else jnp.pad(bias_n.astype(jnp.float32), (0, full - width)))
  args = (x_mk, scale_k, w_pkc, bias, cos_md.astype(jnp.float32), sin_md.astype(jnp.float32))
  static = {"eps": eps, "rotary": rotary_columns}
  if not _kernel_applies(x_mk, w_pkc, scale_k):  # bias, cos and sin are float32 by now
    out = _reference_norm_rope_matmul(*args, **static)
  else:
    out = cpu_kernels.cpu_or_reference(
        *args, cpu=functools.partial(_kernel_norm_rope_matmul, **static),
        default=functools.partial(_reference_norm_rope_matmul, **static))
  return out if n is None else out[..., :n]


def silu_glu(gate_up_mf: jax.Array) -> jax.Array:
  """silu(gate) * up for gate_up = [gate | up] along the last axis: a SwiGLU MLP's gating, as
  `jaxtier.model.DecoderLayer.mlp` computes it."""
  half = gate_up_mf.shape[-1] // 2
  return jax.nn.silu(gate_up_mf[..., :half]) * gate_up_mf[..., half:]


def _kernel_glu_matmul(gate_up_mf, w_pkc):
  lead, f = gate_up_mf.shape[:-1], gate_up_mf.shape[-1]
  out = jax.ffi.ffi_call(cpu_kernels.GLU_MATMUL_TARGET,
                         jax.ShapeDtypeStruct((gate_up_mf.size // f, _columns(w_pkc)),
                                              jnp.float32))(
                             gate_up_mf.reshape(-1, f), w_pkc, format=_format_attr(w_pkc))
  return out.reshape(*lead, -1)


def _reference_glu_matmul(gate_up_mf, w_pkc):
  return reference_matmul(silu_glu(gate_up_mf), w_pkc)


def glu_packed_matmul(gate_up_mf: jax.Array, w_pkc: jax.Array, n: int | None = None
                      ) -> jax.Array:
  """silu(gate) * up [..., F] @ packed w [P, F, C] -> [..., n] for gate_up [..., 2F], as one CPU
  kernel call where it applies (XLA:CPU splits the gating, an elementwise op, over two threads and
  at decode sizes waits longer for the second than the math takes); else `silu_glu` then
  `reference_matmul`."""
  if gate_up_mf.shape[-1] % 2:
    raise ValueError(f"gate_up must have an even last dimension, got {gate_up_mf.shape}")
  _check_packed(gate_up_mf[..., :gate_up_mf.shape[-1] // 2], w_pkc, n)
  if not _kernel_applies(gate_up_mf, w_pkc):
    out = _reference_glu_matmul(gate_up_mf, w_pkc)
  else:
    out = cpu_kernels.cpu_or_reference(gate_up_mf, w_pkc, cpu=_kernel_glu_matmul,
                                       default=_reference_glu_matmul)
  return out if n is None else out[..., :n]
