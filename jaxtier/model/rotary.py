"""Rotary position embeddings (the Hugging Face `rotate_half` convention): the cos and sin tables
of a call's positions, and their application to a tensor of heads.

Shape legend: b batch, t tokens, n heads, d head dim.
"""

import jax
import jax.numpy as jnp


def rotary_tables(inv_freq_d2: jax.Array, pos_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin tables [b, t, d] for the given positions (float32); for inverse frequencies
  [r, d / 2] (a model whose layers rotate differently), tables [r, b, t, d]."""
  pos = pos_bt[..., None].astype(jnp.float32)
  if inv_freq_d2.ndim == 2:
    angles_btd2 = pos[None] * inv_freq_d2[:, None, None, :]
  else:
    angles_btd2 = pos * inv_freq_d2
  angles_btd = jnp.concatenate([angles_btd2, angles_btd2], axis=-1)
  return jnp.cos(angles_btd), jnp.sin(angles_btd)


def apply_rotary(x_btnd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
  """Rotates the two halves of each head: x * cos + [-x2, x1] * sin for x's halves x1, x2 (any
  leading dims; cos and sin have x's without the heads axis)."""
  half = x_btnd.shape[-1] // 2
  rotated = jnp.concatenate([-x_btnd[..., half:], x_btnd[..., :half]], axis=-1)
  cos, sin = cos_btd[..., None, :].astype(x_btnd.dtype), sin_btd[..., None, :].astype(x_btnd.dtype)
  return x_btnd * cos + rotated * sin
