"""The formats' own dequantization, ported to numpy line by line: what the pre-quantized loader
(`jaxtier.checkpoint.prequantized`) is checked against. Each returns the float32 weight in
PyTorch's layout [out, in], computed as the library computes it but in float32 (the library
computes in the scales' dtype, float16 or bfloat16: its result is this one rounded once to that
dtype, since (q - z) is exact there). Deliberately written as the libraries write it (shifts per
field, explicit index arrays), not as the loader does.

- GPTQ: GPTQModel's `TorchQuantLinear.dequantize_weight` (AutoGPTQ's torch fallback without the
  mask): qweight fields along the input rows, qzeros along the output columns, (zeros + 1) & mask
  in the "gptq" checkpoint format,
  w = scales[g_idx] * (q - zeros[g_idx]).
- AWQ: AutoAWQ's `dequantize_gemm` (`awq/utils/packing_utils.py`): `unpack_awq` then
  `reverse_awq_order` (AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]), w = (q - z) * s per group.
- compressed-tensors: `unpack_from_int32` (values minus 2^(bits-1)), zero points packed along
  dim 0, and `_dequantize`: (x_q - zero_point) * scale per group; float-quantized FP8:
  x_q * scale.
"""

import numpy as np

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits: int, v2: bool = False) -> np.ndarray:
  """AutoGPTQ / GPTQModel: [out, in] float32."""
  wf = np.arange(0, 32, bits, dtype=np.int64)[None, :]  # the shift of each field
  mask = (1 << bits) - 1
  qz = qzeros.astype(np.int64) & 0xFFFFFFFF
  zeros = (qz[:, :, None] >> wf[None, :, :]) & mask  # [G, N / per, per]
  zeros = zeros.reshape(qzeros.shape[0], -1)
  if not v2:
    zeros = (zeros + 1) & mask  # GPTQModel: the stored zero minus one, within the field
  qw = qweight.astype(np.int64) & 0xFFFFFFFF
  weight = (qw[:, None, :] >> wf[0][None, :, None]) & mask  # [K / per, per, N]
  weight = weight.reshape(-1, qweight.shape[1])  # [K, N]
  s = scales.astype(np.float32)
  w = s[g_idx] * (weight - zeros[g_idx]).astype(np.float32)
  return w.T


def awq_dequantize(qweight, qzeros, scales, group: int) -> np.ndarray:
  """AutoAWQ `dequantize_gemm`: [out, in] float32."""
  shifts = np.arange(0, 32, 4, dtype=np.int64)
  def unpack(q):
    q = q.astype(np.int64) & 0xFFFFFFFF
    out = (q[:, :, None] >> shifts[None, None, :]).reshape(q.shape[0], -1) & 0xF
    # reverse_awq_order
    reverse = np.arange(out.shape[1]).reshape(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(-1)
    return out[:, reverse]
  iweight, izeros = unpack(qweight), unpack(qzeros)
  izeros = np.repeat(izeros, group, axis=0)
  s = np.repeat(scales.astype(np.float32), group, axis=0)
  w = (iweight - izeros).astype(np.float32) * s
  return w.T


def ct_unpack(packed, bits: int, shape, packed_dim: int = 1) -> np.ndarray:
  """compressed-tensors `unpack_from_int32`: int32 words -> values (int64) of `shape`."""
  value = packed.astype(np.int64) & 0xFFFFFFFF
  if packed_dim == 0:
    value = value.T
  rows, words = value.shape
  cols = int(shape[packed_dim])
  elem = np.arange(words * 32 // bits)
  start = elem * bits
  word, offset = start // 32, start % 32
  out = (value[:, word] >> offset[None, :]) & ((1 << bits) - 1)
  out = out[:, :cols] - (1 << (bits - 1))
  return out.T if packed_dim == 0 else out


def ct_dequantize(tensors: dict, prefix: str) -> np.ndarray:
  """compressed-tensors, one module's tensors (`prefix`.weight_packed, ...): [out, in] float32."""
  scale = tensors[prefix + ".weight_scale"].astype(np.float32)
  if prefix + ".weight_packed" in tensors:
    shape = [int(v) for v in tensors[prefix + ".weight_shape"]]
    packed = tensors[prefix + ".weight_packed"]
    bits = 32 * packed.shape[1] // shape[1]
    x_q = ct_unpack(packed, bits, shape)
  else:
    x_q = tensors[prefix + ".weight"]
    bits = 8
  zp = tensors.get(prefix + ".weight_zero_point")
  if zp is not None and zp.dtype == np.int32 and zp.shape[0] != x_q.shape[0]:
    zp = ct_unpack(zp, bits, (x_q.shape[0], scale.shape[-1]), packed_dim=0)
  out, k = x_q.shape
  if scale.size == 1:
    scale = np.full((out, 1), scale.reshape(-1)[0], np.float32)
  group = k // scale.shape[-1]
  columns = np.arange(k) // group
  g_idx = tensors.get(prefix + ".weight_g_idx")
  if g_idx is not None:
    columns = g_idx.astype(np.int64)
  v = x_q.astype(np.float32)
  if zp is not None:
    v = v - zp.astype(np.float32)[:, columns]
  return v * scale[:, columns]


_DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64,
           "I8": np.int8, "U8": np.uint8}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a safetensors file, from its header (bfloat16 and float8 by ml_dtypes)."""
  import json, struct  # pylint: disable=import-outside-toplevel,multiple-imports
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  dtypes = {**_DTYPES, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    data = f.read()
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    start, stop = info["data_offsets"]
    out[name] = np.frombuffer(data[start:stop], dtypes[info["dtype"]]).reshape(info["shape"])
  return out
