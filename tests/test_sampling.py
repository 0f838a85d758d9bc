"""The sampler against its definition: greedy is argmax, top-k/top-p restrict support, frequencies
follow the softmax; and sampling parameters are validated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier import sampling
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.sampling import SamplingArrays, SamplingParams, sample

sample_jit = jax.jit(sample)


def arrays(n, temperature=1.0, top_k=-1, top_p=1.0, seed=0, steps=None):
  p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  return SamplingArrays.from_params([p] * n, [seed] * n, steps if steps is not None else range(n))


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.key(0), (4, 50))
  got = sample_jit(logits, arrays(4, temperature=0.0))
  np.testing.assert_array_equal(got, np.argmax(logits, -1))


def test_argmax_takes_the_first_maximum_like_numpy():
  logits = np.round(np.random.default_rng(0).normal(size=(64, 300)), 1)  # many ties
  logits[3] = 0.0
  np.testing.assert_array_equal(jax.jit(sampling.argmax)(logits), np.argmax(logits, -1))


@pytest.mark.parametrize("rows,v", [(1, 1), (3, 15), (5, 16), (2, 17), (33, 1000), (32, 49152)])
def test_argmax_kernel_equals_numpy_and_the_reference(rows, v):
  """The CPU kernel (float32 logits on CPU) against numpy and the XLA reference, at widths below,
  at and past its 16 lanes, with ties and a row of -inf; a row holding a NaN gives v - 1 (the
  reference does for a row of NaNs; with one NaN it follows XLA:CPU's max, which may skip it)."""
  rng = np.random.default_rng(rows + v)
  logits = np.round(rng.normal(size=(rows, v)), 1).astype(np.float32)
  logits[0] = -np.inf
  got = np.asarray(jax.jit(sampling.argmax)(logits))
  np.testing.assert_array_equal(got, np.argmax(logits, -1))
  np.testing.assert_array_equal(got, np.asarray(sampling.argmax_reference(jnp.asarray(logits))))
  if rows > 2:
    logits[1, v // 2] = np.nan
    logits[2] = np.nan
    got = np.asarray(jax.jit(sampling.argmax)(logits))
    assert got[1] == v - 1 and got[2] == v - 1
    np.testing.assert_array_equal(got[3:], np.argmax(logits[3:], -1))


def test_argmax_lowers_to_the_kernel_for_float32_on_cpu_only():
  if not cpu_kernels.available():
    pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
  x = jnp.ones((4, 100))
  assert cpu_kernels.ARGMAX_TARGET in jax.jit(sampling.argmax).lower(x).as_text()
  bf16 = jax.jit(sampling.argmax).lower(x.astype(jnp.bfloat16)).as_text()
  assert cpu_kernels.ARGMAX_TARGET not in bf16


def test_top_k_one_and_tiny_top_p_are_argmax():
  logits = jax.random.normal(jax.random.key(1), (64, 30))
  np.testing.assert_array_equal(sample_jit(logits, arrays(64, top_k=1)), np.argmax(logits, -1))
  np.testing.assert_array_equal(sample_jit(logits, arrays(64, top_p=1e-4)), np.argmax(logits, -1))


def test_frequencies_follow_softmax_and_support_is_restricted():
  n = 4000
  row = jnp.log(jnp.array([0.5, 0.25, 0.15, 0.1]))
  logits = jnp.broadcast_to(row, (n, 4))
  freq = np.bincount(np.asarray(sample_jit(logits, arrays(n))), minlength=4) / n
  np.testing.assert_allclose(freq, [0.5, 0.25, 0.15, 0.1], atol=0.03)
  top2 = np.bincount(np.asarray(sample_jit(logits, arrays(n, top_k=2))), minlength=4) / n
  np.testing.assert_allclose(top2, [2 / 3, 1 / 3, 0, 0], atol=0.03)
  # top_p=0.7: the smallest prefix reaching 0.7 is {0, 1} (0.75), renormalized.
  nucleus = np.bincount(np.asarray(sample_jit(logits, arrays(n, top_p=0.7))), minlength=4) / n
  np.testing.assert_allclose(nucleus, [2 / 3, 1 / 3, 0, 0], atol=0.03)


def _flat_logits(n: int, seed: int = 2) -> jax.Array:
  """n copies of one near-uniform row over 1000 tokens: any two independent draws rarely agree."""
  row = 0.1 * jax.random.normal(jax.random.key(seed), (1000,))
  return jnp.broadcast_to(row, (n, 1000))


def test_same_seed_and_step_reproduce_the_token():
  logits = _flat_logits(64)
  first = np.asarray(sample_jit(logits, arrays(64, seed=5, steps=[3] * 64)))
  again = np.asarray(sample_jit(logits, arrays(64, seed=5, steps=[3] * 64)))
  eager = np.asarray(sample(logits[:1], arrays(1, seed=5, steps=[3])))
  assert len(set(first.tolist())) == 1, "64 rows with one seed and step drew different tokens"
  np.testing.assert_array_equal(again, first)
  assert int(eager[0]) == int(first[0])


def test_different_seeds_or_steps_change_the_token():
  logits = _flat_logits(64)
  p = [SamplingParams()] * 64
  by_seed = np.asarray(sample_jit(logits, SamplingArrays.from_params(p, range(64), [3] * 64)))
  by_step = np.asarray(sample_jit(logits, SamplingArrays.from_params(p, [5] * 64, range(64))))
  # 64 uniform draws from 1000 tokens have about 62 distinct values; a key that ignored the seed or
  # the step would give one.
  assert len(set(by_seed.tolist())) > 48
  assert len(set(by_step.tolist())) > 48


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
  logits = _flat_logits(1)
  alone = [int(sample_jit(logits, arrays(1, seed=seed, steps=[step]))[0])
           for seed, step in ((5, 3), (6, 0))]
  others = jax.random.normal(jax.random.key(9), (4, 1000))
  for seed, step, want in ((5, 3, alone[0]), (6, 0, alone[1])):
    mixed = others.at[2].set(logits[0])
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(),
              SamplingParams(temperature=0.7, top_p=0.9)]
    got = sample_jit(mixed, SamplingArrays.from_params(params, [1, seed, seed, 7],
                                                       [step, 4, step, step]))
    assert int(got[2]) == want
    assert int(got[0]) == int(jnp.argmax(others[0]))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": 2.5}, "top_k"), ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_invalid_sampling_params_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)
