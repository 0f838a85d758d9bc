"""Weights packed in column panels, and x @ w on them: the CPU kernel, with an XLA reference.

A [K, N] weight is stored packed as [ceil(N / P), K, P]: panel p holds columns [P p, P p + P),
row by row, so each panel is one contiguous stream (columns past N are zero, and the product is
sliced back to N). P, `panel_width()`, is the width of the kernel's register tile on this CPU:
64 columns with AVX-512, 16 with AVX2 (64 where the kernels are unavailable; any P works with the
reference). `jaxtier/matmul_cpu.cc` multiplies by a packed weight reading each panel once in
order, with a tile of x's rows summed in registers; at 1-32 rows (decode) a step's projections
and LM head run 1.1-2.5x faster than XLA:CPU's matmuls on the [K, N] layout, and on par with them
at prefill sizes (WORKSPACE.md, "Packed weights").

`packed_matmul` picks the kernel when the program is lowered for CPU and the kernel is built
(`jaxtier.cpu_kernels`); elsewhere, or for dtypes other than float32, it is `reference_matmul`,
an einsum that XLA runs with the weight transposed back (correct everywhere, slower).
`norm_packed_matmul` is rms_norm(x) @ w in one kernel call (`rms_norm` the reference norm),
`norm_rope_packed_matmul` that plus a bias and the rotary embedding of the leading heads (a
decoder layer's q/k/v), and `glu_packed_matmul` is (silu(gate) * up) @ w (`silu_glu` the reference
gating).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier import cpu_kernels
from jaxtier.rotary import apply_rotary

DEFAULT_PANEL = 64  # columns per panel where the kernels are unavailable


def panel_width() -> int:
  """Columns per panel that `pack` uses: the CPU kernel's tile width (64 with AVX-512, 16 with
  AVX2), or `DEFAULT_PANEL` without the kernels."""
  return cpu_kernels.panel_width() or DEFAULT_PANEL


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


def unpack(w_pkc, n: int):
  """[..., P, K, C] -> [..., K, n]: the inverse of `pack` for a weight of n columns."""
  *lead, p, k, c = w_pkc.shape
  xp = np if isinstance(w_pkc, np.ndarray) else jnp
  return xp.swapaxes(w_pkc, -3, -2).reshape(*lead, k, p * c)[..., :n]


def reference_matmul(x_mk: jax.Array, w_pkc: jax.Array, n: int | None = None) -> jax.Array:
  """x [..., K] @ packed w -> [..., n] (n: all the panels' columns if None), by XLA."""
  out = jnp.einsum("...k,pkc->...pc", x_mk, w_pkc)
  out = out.reshape(*out.shape[:-2], -1)
  return out if n is None else out[..., :n]


def _kernel_matmul(x_mk: jax.Array, w_pkc: jax.Array) -> jax.Array:
  lead, k = x_mk.shape[:-1], x_mk.shape[-1]
  p, _, c = w_pkc.shape
  out = jax.ffi.ffi_call(cpu_kernels.MATMUL_TARGET,
                         jax.ShapeDtypeStruct((x_mk.size // k, p * c), jnp.float32))(
                             x_mk.reshape(-1, k), w_pkc)
  return out.reshape(*lead, p * c)


def _check_packed(x_mk, w_pkc, n):
  if w_pkc.ndim != 3 or w_pkc.shape[1] != x_mk.shape[-1]:
    raise ValueError(f"expected a packed weight [P, {x_mk.shape[-1]}, C] for x of shape "
                     f"{x_mk.shape}, got {w_pkc.shape}")
  p, _, c = w_pkc.shape
  if n is not None and not (p - 1) * c < n <= p * c:
    raise ValueError(f"n={n} does not fit a packed weight of {p} panels of {c} columns")


def _kernel_applies(x, w_pkc, *others) -> bool:
  """Whether the CPU kernel can multiply x by w (with `others`, the call's other arrays): all
  float32, x not empty, the kernels built, and panels of the width they were built for (any
  other width runs the reference)."""
  return (all(a.dtype == jnp.float32 for a in (x, w_pkc, *others)) and x.size > 0
          and cpu_kernels.available() and w_pkc.shape[-1] == cpu_kernels.panel_width())


def packed_matmul(x_mk: jax.Array, w_pkc: jax.Array, n: int | None = None) -> jax.Array:
  """x [..., K] @ packed w [P, K, C] -> [..., n]: the CPU kernel where it applies.

  n: the weight's columns before padding (None: all P * C).
  """
  _check_packed(x_mk, w_pkc, n)
  if not _kernel_applies(x_mk, w_pkc):
    out = reference_matmul(x_mk, w_pkc)
  else:
    out = jax.lax.platform_dependent(x_mk, w_pkc, cpu=_kernel_matmul, default=reference_matmul)
  return out if n is None else out[..., :n]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) * scale over the last axis, computed in float32 and scaled in x's
  dtype: `jaxtier.model.RMSNorm`'s arithmetic."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale * y.astype(x.dtype)


def _kernel_norm_matmul(x_mk, scale_k, w_pkc, *, eps):
  lead, k = x_mk.shape[:-1], x_mk.shape[-1]
  p, _, c = w_pkc.shape
  out = jax.ffi.ffi_call(cpu_kernels.NORM_MATMUL_TARGET,
                         jax.ShapeDtypeStruct((x_mk.size // k, p * c), jnp.float32))(
                             x_mk.reshape(-1, k), scale_k, w_pkc, eps=np.float32(eps))
  return out.reshape(*lead, p * c)


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
    out = jax.lax.platform_dependent(x_mk, scale_k, w_pkc,
                                     cpu=functools.partial(_kernel_norm_matmul, eps=eps),
                                     default=functools.partial(_reference_norm_matmul, eps=eps))
  return out if n is None else out[..., :n]


def _kernel_norm_rope_matmul(x_mk, scale_k, w_pkc, bias_n, cos_md, sin_md, *, eps, rotary):
  lead, k = x_mk.shape[:-1], x_mk.shape[-1]
  p, _, c = w_pkc.shape
  d = cos_md.shape[-1]
  out = jax.ffi.ffi_call(cpu_kernels.NORM_ROPE_MATMUL_TARGET,
                         jax.ShapeDtypeStruct((x_mk.size // k, p * c), jnp.float32))(
                             x_mk.reshape(-1, k), scale_k, w_pkc, bias_n, cos_md.reshape(-1, d),
                             sin_md.reshape(-1, d), eps=np.float32(eps), rotary_columns=rotary)
  return out.reshape(*lead, p * c)


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
  embedding (`jaxtier.rotary.apply_rotary`) of the first `rotary_columns` columns in heads of
  d = cos's width: a decoder layer's q/k/v projection, as one CPU kernel call where it applies
  (XLA recomputed cos and sin in each of q's and k's rotary ops, per layer). cos and sin are
  [..., d] with x's leading dims; bias [n] or None."""
  _check_packed(x_mk, w_pkc, n)
  full = w_pkc.shape[0] * w_pkc.shape[2]  # the kernel's product spans the padded panels
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
    out = jax.lax.platform_dependent(
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
  p, _, c = w_pkc.shape
  out = jax.ffi.ffi_call(cpu_kernels.GLU_MATMUL_TARGET,
                         jax.ShapeDtypeStruct((gate_up_mf.size // f, p * c), jnp.float32))(
                             gate_up_mf.reshape(-1, f), w_pkc)
  return out.reshape(*lead, p * c)


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
    out = jax.lax.platform_dependent(gate_up_mf, w_pkc, cpu=_kernel_glu_matmul,
                                     default=_reference_glu_matmul)
  return out if n is None else out[..., :n]
