"""Soft capping (Gemma 2): values squashed smoothly into (-cap, cap), for attention scores and
logits alike."""

import jax
import jax.numpy as jnp


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """cap * tanh(x / cap), or x where cap is None."""
  if cap is None:
    return x
  return jnp.tanh(x / cap) * cap
