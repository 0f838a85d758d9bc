"""The grouped mixture-of-experts MLP (`jaxtier.model.moe.moe_mlp`, ragged_dot over tokens sorted by
expert) against running every expert on every token (`moe_mlp_reference`) and against a numpy loop
over tokens; the routers of Mixtral and Qwen3-MoE."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier.model.moe import (gathered_experts, masked_experts, mixing_weights, moe_mlp,
                               moe_mlp_reference, route)


def _case(seed: int, n: int, h: int = 16, e: int = 6, f: int = 8):
  rng = np.random.default_rng(seed)
  shapes = ((n, h), (h, e), (e, h, f), (e, h, f), (e, f, h))
  return [jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.5) for s in shapes]


def _numpy_moe(x, router, gate, up, down, k, normalize, act):
  x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up, down))
  out = np.zeros_like(x)
  for i, row in enumerate(x):
    logits = row @ router
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    top = np.argsort(-probs, kind="stable")[:k]
    weights = probs[top] / (probs[top].sum() if normalize else 1.0)
    for w, j in zip(weights, top):
      g = row @ gate[j]
      g = g / (1 + np.exp(-g)) if act == "silu" else 0.5 * g * (
          1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
      out[i] += w * ((g * (row @ up[j])) @ down[j])
  return out


@pytest.mark.parametrize("k, normalize, act", [(2, True, "silu"), (1, False, "silu"),
                                               (3, False, "gelu_pytorch_tanh")])
def test_grouped_experts_equal_every_expert_on_every_token(k, normalize, act):
  case = _case(k, n=37)
  grouped = jax.jit(moe_mlp, static_argnums=(5, 6, 7))(*case, k, normalize, act)
  np.testing.assert_allclose(grouped, moe_mlp_reference(*case, k, normalize, act),
                             atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(grouped, _numpy_moe(*case, k, normalize, act), atol=2e-5, rtol=2e-5)


def test_an_expert_no_token_routes_to_and_a_single_token():
  x, router, gate, up, down = _case(7, n=1)
  out = moe_mlp(x, router, gate, up, down, 2, True)
  np.testing.assert_allclose(out, _numpy_moe(x, router, gate, up, down, 2, True, "silu"),
                             atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n, k, act", [(1, 2, "silu"), (3, 2, "silu"), (9, 3, "gelu_pytorch_tanh")])
def test_host_forms_equal_the_numpy_loop(n, k, act):
  """The two forms a host computes offloaded experts in: pairs gathering their expert's weights,
  and every expert masked by the router's mix."""
  x, router, gate, up, down = _case(n + k, n=n)
  weights, experts = route(x @ router, k, True)
  want = _numpy_moe(x, router, gate, up, down, k, True, act)
  np.testing.assert_allclose(gathered_experts(x, weights, experts, gate, up, down, act), want,
                             atol=2e-5, rtol=2e-5)
  mix = mixing_weights(weights, experts, router.shape[1])
  np.testing.assert_allclose(masked_experts(x, mix, gate, up, down, act), want, atol=2e-5,
                             rtol=2e-5)


def test_router_weights():
  logits = jnp.array([[0.0, 1.0, 2.0, 3.0]])
  weights, experts = route(logits, 2, normalize=False)
  probs = np.exp([0.0, 1.0, 2.0, 3.0]) / np.exp([0.0, 1.0, 2.0, 3.0]).sum()
  np.testing.assert_allclose(weights[0], probs[[3, 2]], rtol=1e-6)
  assert experts.tolist() == [[3, 2]]
  weights, _ = route(logits, 2, normalize=True)
  np.testing.assert_allclose(weights[0], probs[[3, 2]] / probs[[3, 2]].sum(), rtol=1e-6)
