"""Mixture-of-experts MLP: a router picks k experts per token, each a gated MLP, and their outputs
are summed with the router's weights.

`moe_mlp` is the grouped form every platform runs: the (token, expert) pairs are sorted by expert
and each expert multiplies only its own tokens (`jax.lax.ragged_dot`), so the work follows the k
experts a token uses, not all of them. `moe_mlp_reference` runs every expert on every token and
masks: obviously right, the test's reference.

Shape legend: n tokens, h hidden size, e experts, k experts per token, f expert width, p = n * k
(token, expert) pairs.
"""

import jax
import jax.numpy as jnp


def route(logits_ne: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
  """(weights [n, k] float32, experts [n, k] int32): softmax over all experts in float32, the top
  k kept, renormalized to sum to 1 when `normalize` (Mixtral always; Qwen3-MoE by
  `norm_topk_prob`)."""
  probs_ne = jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1)
  weights_nk, experts_nk = jax.lax.top_k(probs_ne, k)
  if normalize:
    weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
  return weights_nk, experts_nk.astype(jnp.int32)


def _act(x, act: str):
  return jax.nn.silu(x) if act == "silu" else jax.nn.gelu(x, approximate=True)


def moe_mlp(x_nh: jax.Array, router_he: jax.Array, gate_ehf: jax.Array, up_ehf: jax.Array,
            down_efh: jax.Array, k: int, normalize: bool, act: str = "silu") -> jax.Array:
  """sum over a token's k routed experts of weight * down(act(gate(x)) * up(x)); [n, h]."""
  weights_nk, experts_nk = route(x_nh @ router_he, k, normalize)
  return grouped_experts(x_nh, weights_nk, experts_nk, gate_ehf, up_ehf, down_efh, act)


def grouped_experts(x_nh, weights_nk, experts_nk, gate_ehf, up_ehf, down_efh,
                    act: str = "silu") -> jax.Array:
  """The routed experts' weighted sum [n, h] as a grouped matmul: the (token, expert) pairs
  sorted by expert, each expert multiplying only its own tokens (`jax.lax.ragged_dot`)."""
  n, h = x_nh.shape
  e = gate_ehf.shape[0]
  k = experts_nk.shape[1]
  expert_p = experts_nk.reshape(-1)
  order_p = jnp.argsort(expert_p, stable=True)
  token_p = order_p // k
  sizes_e = jnp.bincount(expert_p, length=e).astype(jnp.int32)
  x_ph = x_nh[token_p]
  hidden_pf = (_act(jax.lax.ragged_dot(x_ph, gate_ehf, sizes_e), act)
               * jax.lax.ragged_dot(x_ph, up_ehf, sizes_e))
  out_ph = jax.lax.ragged_dot(hidden_pf, down_efh, sizes_e)
  weight_p = weights_nk.reshape(-1)[order_p].astype(out_ph.dtype)
  return jnp.zeros((n, h), out_ph.dtype).at[token_p].add(out_ph * weight_p[:, None])


def gathered_experts(x_nh, weights_nk, experts_nk, gate_ehf, up_ehf, down_efh,
                     act: str = "silu") -> jax.Array:
  """`grouped_experts` by gathering each (token, expert) pair's weights: reads k experts per
  token, so it suits a few tokens (n * k at most the expert count). The form a host computes
  offloaded experts in (`jaxtier.offload.experts`): it needs no constant arrays, which a
  computation placed on the host cannot mix with its host-memory operands."""
  n, h = x_nh.shape
  k = experts_nk.shape[1]
  expert_p = experts_nk.reshape(-1)
  x_ph = jnp.broadcast_to(x_nh[:, None, :], (n, k, h)).reshape(n * k, h)
  hidden_pf = (_act(jnp.einsum("ph,phf->pf", x_ph, gate_ehf[expert_p]), act)
               * jnp.einsum("ph,phf->pf", x_ph, up_ehf[expert_p]))
  out_ph = jnp.einsum("pf,pfh->ph", hidden_pf, down_efh[expert_p])
  return jnp.einsum("nkh,nk->nh", out_ph.reshape(n, k, h), weights_nk.astype(out_ph.dtype))


def masked_experts(x_nh, mix_ne, gate_ehf, up_ehf, down_efh, act: str = "silu") -> jax.Array:
  """Every expert on every token, summed with `mix_ne` (a token's router weight for each of its
  experts, 0 for the others; `mixing_weights`): reads each expert once, so it suits many tokens,
  at e / k times the routed FLOPs. The host's form for larger batches (see `gathered_experts`)."""
  hidden_nef = (_act(jnp.einsum("nh,ehf->nef", x_nh, gate_ehf), act)
                * jnp.einsum("nh,ehf->nef", x_nh, up_ehf))
  return jnp.einsum("ne,neh->nh", mix_ne.astype(hidden_nef.dtype),
                    jnp.einsum("nef,efh->neh", hidden_nef, down_efh))


def mixing_weights(weights_nk, experts_nk, num_experts: int) -> jax.Array:
  """[n, e] float32: each token's router weight on each expert (0 where not routed)."""
  return jnp.sum(jax.nn.one_hot(experts_nk, num_experts) * weights_nk[..., None], axis=1)


def moe_mlp_reference(x_nh, router_he, gate_ehf, up_ehf, down_efh, k: int, normalize: bool,
                      act: str = "silu") -> jax.Array:
  """`moe_mlp` by running every expert on every token and keeping the routed ones."""
  weights_nk, experts_nk = route(x_nh @ router_he, k, normalize)
  mix_ne = mixing_weights(weights_nk, experts_nk, router_he.shape[1])
  return masked_experts(x_nh, mix_ne, gate_ehf, up_ehf, down_efh, act)
