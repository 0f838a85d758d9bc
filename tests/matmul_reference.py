"""References the packed-weight tests compare `jaxtier.kernels.cpu.matmul` against: the inverse of
`pack`, the gguf package's own Q4_1 and Q8_0 quantization, and a float layer's fused kernels
quantized by it (the blocks a GGUF file of that layer holds)."""

import gguf
import jax.numpy as jnp
import numpy as np

from jaxtier.kernels.cpu import matmul

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def unpack(w_pkc, n: int):
  """[..., P, K, C] -> [..., K, n]: the inverse of `matmul.pack` for a weight of n columns (numpy
  in, numpy out; jax in, jax out)."""
  *lead, p, k, c = w_pkc.shape
  xp = np if isinstance(w_pkc, np.ndarray) else jnp
  return xp.swapaxes(w_pkc, -3, -2).reshape(*lead, k, p * c)[..., :n]


def gguf_q4_1(w_kn: np.ndarray):
  """(q, d, m) of w [K, N] as the gguf package quantizes it (blocks along K), and its
  dequantization [K, N]."""
  blocks = gguf.quants.quantize(np.ascontiguousarray(w_kn.T), Q4_1)  # [N, K / 32 * 20]
  n, k = w_kn.shape[1], w_kn.shape[0]
  raw = blocks.reshape(n, k // 32, 20)
  d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32).T
  m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32).T
  q = np.concatenate([raw[..., 4:] & 15, raw[..., 4:] >> 4], axis=-1).reshape(n, k).T
  return (q, d, m), gguf.quants.dequantize(blocks, Q4_1).T


def gguf_q8_0(w_kn: np.ndarray):
  """(q, d) of w [K, N] as the gguf package quantizes it to Q8_0, and its dequantization."""
  blocks = gguf.quants.quantize(np.ascontiguousarray(w_kn.T), Q8_0)
  n, k = w_kn.shape[1], w_kn.shape[0]
  raw = blocks.reshape(n, k // 32, 34)
  d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32).T
  q = raw[..., 2:].copy().view(np.int8).reshape(n, k).T
  return (q, d), gguf.quants.dequantize(blocks, Q8_0).T


def fused_kernels(layer) -> dict[str, np.ndarray]:
  """A float `DecoderLayer`'s kernels [in, out] as `FusedDecoderLayer` holds them before packing:
  q/k/v and gate/up concatenated along the output axis."""
  kernel = lambda name: np.asarray(getattr(layer, name).kernel[...])
  return {"qkv_kernel": np.concatenate([kernel(p) for p in ("q_proj", "k_proj", "v_proj")], 1),
          "gate_up_kernel": np.concatenate([kernel("gate_proj"), kernel("up_proj")], 1),
          "o_kernel": kernel("o_proj"), "down_kernel": kernel("down_proj")}


def q4_1_kernels(layer, activations: str = "float32") -> dict[str, np.ndarray]:
  """`fused_kernels(layer)`, each quantized to Q4_1 by the gguf package and packed for
  `activations` (`matmul.pack_q4_1`)."""
  return {name: matmul.pack_q4_1(*gguf_q4_1(w)[0], activations=activations)
          for name, w in fused_kernels(layer).items()}
