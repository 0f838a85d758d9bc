"""A contiguous KV cache: one [max_len] slot row per sequence and layer.

It is the simplest cache the model runs on and the reference the paged cache is compared with.

Every cache type offers `update_and_attend(layer, q, k, v, positions, meta) -> (cache, out)`: write
the new keys and values of one layer, then attend over everything the sequence has cached. The model
calls it inside its scan over layers with a traced `layer` index, so a cache holds all layers in one
stacked array and writes only the new tokens (a scatter, in place under donation).
Positions below zero mark padding tokens: they are not written and their output is ignored.

Shape legend: l layers, b batch, s max_len slots, t new tokens, n query heads, k kv heads, d head dim.
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxtier.attention.dense import dense_attention


@flax.struct.dataclass(frozen=True)
class ContiguousKVCache:
  """K and V of every layer, one row of `max_len` slots per sequence: slot i holds position i.

  A pytree (a `flax.struct` dataclass): pass it into and out of jitted functions, donating it so
  the writes happen in place. Its memory is layers x batch x max_len whatever the sequences'
  lengths; `PagedKVCache` holds only the blocks sequences use.
  """
  k_lbskd: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
  v_lbskd: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]

  @classmethod
  def create(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> "ContiguousKVCache":
    """A zeroed cache for `batch` sequences of up to `max_len` tokens each.

    Args:
      num_layers, kv_heads, head_dim: the model's (`ModelConfig.num_layers`, `num_kv_heads`,
        `head_dim`).
      batch: sequences decoded together; row b of the model's inputs is sequence b.
      max_len: slots per sequence, the longest prompt plus generated tokens it can hold.
      dtype: storage dtype of keys and values (new ones are cast to it when written).
    """
    shape = (num_layers, batch, max_len, kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  @property
  def max_len(self) -> int:
    return self.k_lbskd.shape[2]

  def update_and_attend(self, layer: jax.Array, q_btnd: jax.Array, k_btkd: jax.Array,
                        v_btkd: jax.Array, pos_bt: jax.Array, meta: Any = None,
                        window: jax.Array | int | None = None, cap: float | None = None
                        ) -> tuple["ContiguousKVCache", jax.Array]:
    """Writes one layer's new keys and values into their slots, then attends over the cache.

    The model calls this from each decoder layer (the cache contract of `jaxtier.kvcache`).

    Args:
      layer: index of the layer (may be traced, as inside the model's `lax.scan`).
      q_btnd: queries [b, t, n, d] of the new tokens (rotary embedding applied).
      k_btkd, v_btkd: their keys and values [b, t, k, d].
      pos_bt: each new token's position [b, t], its slot; below zero marks padding, which is
        not written (and whose output is meaningless).
      meta: unused (the paged cache's block tables travel here).
      window: the layer's sliding window (may be traced), or None: full causal attention.
      cap: the scores' soft cap, or None.

    Returns:
      (the cache with the new tokens written, attention output [b, t, n, d]): each query
      attends causally to its sequence's slots up to its own position (the last `window` of
      them under a window).
    """
    del meta
    b, t = pos_bt.shape
    slot_bt = jnp.where(pos_bt >= 0, pos_bt, self.max_len)  # padding lands out of range: dropped
    batch_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    k_all = self.k_lbskd.at[layer, batch_bt, slot_bt].set(
        k_btkd.astype(self.k_lbskd.dtype), mode="drop")
    v_all = self.v_lbskd.at[layer, batch_bt, slot_bt].set(
        v_btkd.astype(self.v_lbskd.dtype), mode="drop")
    out_btnd = dense_attention(q_btnd, k_all[layer], v_all[layer], pos_bt, window, cap)
    return ContiguousKVCache(k_all, v_all), out_btnd
