"""Logit transforms (penalties, logit_bias, masks, min-p) against plain numpy references of their
definitions, alone and mixed per row in one batch, and on the engine: greedy tokens against a
reference loop over full forward passes, preemption, planning ahead, vocabulary checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier.kvcache import ContiguousKVCache
from jaxtier.sampling import (LogitRules, LogitsArrays, SamplingArrays, SamplingParams,
                              bad_words_token_ids, sample, sample_transformed, transform_logits)
from jaxtier.scheduler import Request
from test_engine import assert_all_free, engine_of, peak_blocks, prompts_of, run, tiny  # noqa: F401

V = 40
EOS = (1,)
transform_jit = jax.jit(transform_logits)
sample_transformed_jit = jax.jit(sample_transformed)
sample_jit = jax.jit(sample)


def reference_transform(logits, params: SamplingParams, prompt, output, bad_words_ids=(),
                        eos_ids=EOS) -> np.ndarray:
  """One row's logits after the transforms, written from their definitions (float64, loops)."""
  x = np.array(logits, np.float64)
  for token, bias in (params.logit_bias or {}).items():
    x[token] += bias
  if params.allowed_token_ids is not None:
    for token in range(len(x)):
      if token not in params.allowed_token_ids:
        x[token] = -np.inf
  for word in bad_words_ids:
    prefix = list(word[:-1])
    if len(prefix) <= len(output) and list(output)[len(output) - len(prefix):] == prefix:
      x[word[-1]] = -np.inf
  if len(output) < params.min_tokens:
    for token in list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids)):
      x[token] = -np.inf
  for token in set(prompt) | set(output):
    x[token] = x[token] / params.repetition_penalty if x[token] > 0 else (
        x[token] * params.repetition_penalty)
  for token in set(output):
    count = list(output).count(token)
    x[token] -= params.frequency_penalty * count + params.presence_penalty
  return x


ROW_PARAMS = [
    SamplingParams(temperature=0, repetition_penalty=1.3),
    SamplingParams(temperature=0, repetition_penalty=0.7, frequency_penalty=0.6,
                   presence_penalty=-0.4),
    None,  # a row without transforms in the same batch
    SamplingParams(temperature=0, logit_bias={3: 250.0, 5: -7.5, 9: 0.25}),
    SamplingParams(temperature=0, allowed_token_ids=[2, 4, 6, 30], frequency_penalty=2.0),
    SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[7]),
    SamplingParams(temperature=0, min_tokens=1, ignore_eos=True, stop_token_ids=[8],
                   presence_penalty=1.5),
    SamplingParams(temperature=0, bad_words=["x"], repetition_penalty=1.1),
]
BAD_WORDS = {7: ((11,), (12, 13), (14, 15, 16), (20, 21, 13))}  # row -> token sequences


def batch_rows(seed: int = 0):
  """(logits [b, V], rows for `LogitsArrays.from_rows`, (prompt, output) per row)."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(scale=3.0, size=(len(ROW_PARAMS), V)).astype(np.float32)
  rows, histories = [], []
  for i, params in enumerate(ROW_PARAMS):
    prompt = rng.integers(0, V, size=rng.integers(1, 9)).tolist()
    output = rng.integers(0, V, size=rng.integers(0, 12)).tolist()
    if i == 7:
      output += [12, 20, 14, 15]  # ends with (14, 15): bans 16; neither 13 of its words
    if i in (5, 6):
      output = output[:2] if i == 5 else []  # fewer than its min_tokens
    histories.append((prompt, output))
    if params is None:
      rows.append(None)
      continue
    rules = LogitRules(params, BAD_WORDS.get(i, ()),
                       LogitRules.of(params, lambda text: [], EOS, V).stop_ids)
    rows.append((rules, tuple(prompt + output), len(output)))
  return logits, rows, histories


def test_each_transform_equals_the_numpy_reference_per_row_in_one_batch():
  logits, rows, histories = batch_rows()
  got = np.asarray(transform_jit(logits, LogitsArrays.from_rows(rows)))
  for i, params in enumerate(ROW_PARAMS):
    prompt, output = histories[i]
    want = (logits[i] if params is None else
            reference_transform(logits[i], params, prompt, output, BAD_WORDS.get(i, ())))
    np.testing.assert_array_equal(np.isneginf(got[i]), np.isneginf(want), err_msg=f"row {i}")
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[i][finite], want[finite], rtol=1e-6, atol=1e-5,
                               err_msg=f"row {i}")
  assert np.isneginf(got[7, 16]) and np.isneginf(got[7, 11]) and not np.isneginf(got[7, 13])
  assert np.isneginf(got[5, 7]) and np.isneginf(got[5, 1])  # min_tokens: stop id and EOS
  assert not np.isneginf(got[6, 1]) and np.isneginf(got[6, 8])  # ignore_eos keeps EOS open


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_tokens_are_the_argmax_of_the_reference(seed):
  logits, rows, histories = batch_rows(seed)
  params = [p or SamplingParams(temperature=0) for p in ROW_PARAMS]
  arrays = SamplingArrays.from_params(params, [0] * len(params), [0] * len(params))
  got = np.asarray(sample_transformed_jit(logits, arrays, LogitsArrays.from_rows(rows)))
  for i, p in enumerate(ROW_PARAMS):
    prompt, output = histories[i]
    want = logits[i] if p is None else reference_transform(logits[i], p, prompt, output,
                                                           BAD_WORDS.get(i, ()))
    assert got[i] == np.argmax(want), f"row {i}"


def test_logit_bias_of_minus_100_moves_the_greedy_token():
  logits = np.random.default_rng(3).normal(size=(2, V)).astype(np.float32)
  top = int(np.argmax(logits[0]))
  params = SamplingParams(temperature=0, logit_bias={top: -100})
  rows = [(LogitRules(params), (1, 2), 0), None]
  arrays = SamplingArrays.from_params([params, SamplingParams(temperature=0)], [0, 0], [0, 0])
  got = np.asarray(sample_transformed_jit(logits, arrays, LogitsArrays.from_rows(rows)))
  second = int(np.argsort(-logits[0])[1])
  assert got[0] == second and got[1] == np.argmax(logits[1])


def test_min_p_keeps_tokens_at_least_min_p_of_the_top_after_temperature():
  n = 4000
  probs = np.array([0.5, 0.25, 0.15, 0.1])
  logits = jnp.broadcast_to(jnp.log(probs), (n, 4))
  for temperature, min_p in ((1.0, 0.4), (2.0, 0.6), (0.5, 0.2)):
    scaled = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
    keep = scaled >= min_p * scaled.max()
    want = np.where(keep, scaled, 0) / scaled[keep].sum()
    p = SamplingParams(temperature=temperature, min_p=min_p)
    arrays = SamplingArrays.from_params([p] * n, [0] * n, range(n))
    freq = np.bincount(np.asarray(sample_jit(logits, arrays)), minlength=4) / n
    assert (freq[~keep] == 0).all(), (temperature, min_p, freq)
    np.testing.assert_allclose(freq, want, atol=0.03)


def test_bad_words_encode_with_and_without_a_leading_space_as_vllm_does():
  vocab = {"dog": [5], " dog": [6], "hot dog": [7, 5], " hot dog": [8, 5], "cat": [9, 9],
           " cat": [3]}
  got = bad_words_token_ids(["dog", " hot dog", "cat"], lambda text: vocab[text])
  # with a leading space: " dog" and " hot dog" start with another token and have as many
  # tokens (added); " cat" has fewer tokens than "cat" (not added).
  assert got == ((5,), (6,), (7, 5), (8, 5), (9, 9))
  rules = LogitRules(SamplingParams(bad_words=["dog"]), got)
  assert sorted(rules.masked([])) == [5, 6]
  assert sorted(rules.masked([1, 7])) == [5, 5, 6]
  assert sorted(rules.masked([9])) == [5, 6, 9]


@pytest.mark.parametrize("kwargs, match", [
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
])
def test_invalid_transform_params_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)


def test_logit_bias_is_clamped_and_transforms_are_flagged():
  params = SamplingParams(logit_bias={3: 250, 4: -1000, 5: 0.5})
  assert params.logit_bias == {3: 100.0, 4: -100.0, 5: 0.5} and params.transforms_logits
  assert not SamplingParams(min_p=0.5, temperature=0.3, top_k=3).transforms_logits
  rules = LogitRules.of(SamplingParams(min_tokens=1, stop_token_ids=[2**40, 3, 1]),
                        lambda text: [], EOS, V)
  assert rules.stop_ids == (3, 1)  # ids past the vocabulary are never sampled: not masked


# The engine.

MAX_TOKENS = 10


def full_forward_greedy(model, prompt, params, steps, bad_words_ids=(), eos_ids=EOS):
  """Greedy tokens of one request from full forward passes (no paged cache), each step's last
  logits transformed by `reference_transform`."""
  width = 64
  forward = nnx.jit(lambda m, t, p, k: m(t, p, k))
  c = model.config
  output = []
  for _ in range(steps):
    ids = list(prompt) + output
    tokens = np.zeros((1, width), np.int32)
    pos = np.full((1, width), -1, np.int32)
    tokens[0, :len(ids)], pos[0, :len(ids)] = ids, np.arange(len(ids))
    cache = ContiguousKVCache.create(c.num_layers, 1, width, c.num_kv_heads, c.head_dim)
    logits, _ = forward(model, tokens, pos, cache)
    row = reference_transform(np.asarray(logits[0, len(ids) - 1]), params, prompt, output,
                              bad_words_ids, eos_ids)
    output.append(int(np.argmax(row)))
  return output


ENGINE_PARAMS = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, frequency_penalty=1.0,
                   presence_penalty=0.5, logit_bias={7: 3.0}),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, ignore_eos=True,
                   repetition_penalty=1.2, min_p=0.1, frequency_penalty=0.3),
]


def test_engine_greedy_tokens_equal_full_forward_passes_with_the_reference(tiny):
  model, tokenizer = tiny
  prompts = prompts_of((9, 14, 5, 21), seed=4)
  out = run(engine_of(model, tokenizer), prompts, ENGINE_PARAMS, arrive_every=1)
  for i in (0, 2):
    want = full_forward_greedy(model, prompts[i], ENGINE_PARAMS[i], MAX_TOKENS,
                               eos_ids=tokenizer.eos_token_ids)
    assert list(out[i].token_ids) == want, i
  plain = full_forward_greedy(model, prompts[0], ENGINE_PARAMS[1], MAX_TOKENS)
  assert list(out[0].token_ids) != plain  # the penalty acts on this prompt


def test_logit_bias_allowed_ids_and_min_tokens_act_on_the_engine(tiny):
  model, tokenizer = tiny
  prompt = prompts_of((12,), seed=5)[0]
  greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
  first = run(engine_of(model, tokenizer), [prompt], greedy)[0].token_ids
  cases = [
      SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={first[0]: -100}),
      SamplingParams(max_tokens=6, temperature=0.9, allowed_token_ids=[10, 11, 12]),
      SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[first[0]], min_tokens=3),
      SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[first[0]]),
  ]
  out = run(engine_of(model, tokenizer), [prompt] * len(cases), cases, seeds=[0, 1, 2, 3])
  assert out[0].token_ids[0] != first[0]
  assert set(out[1].token_ids) <= {10, 11, 12} and len(out[1].token_ids) == 6
  assert len(out[2].token_ids) >= 3 and first[0] not in out[2].token_ids[:3]
  assert out[3].token_ids == (first[0],) and out[3].finish_reason == "stop"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_penalties_survive_preemption(tiny, mode):
  """A pool a quarter of the unconstrained peak preempts requests mid-generation; with
  penalties (which read each request's tokens so far) the tokens equal the unconstrained run."""
  model, tokenizer = tiny
  prompts = prompts_of((5, 11, 23, 3, 17, 30), seed=6)
  params = [ENGINE_PARAMS[i % len(ENGINE_PARAMS)] for i in range(len(prompts))]
  seeds = list(range(len(prompts)))
  wide = dict(max_num_seqs=8, max_num_batched_tokens=64)
  free = run(engine_of(model, tokenizer, **wide), prompts, params, seeds, arrive_every=0)
  peak = peak_blocks(model, tokenizer, prompts, params)
  pool = max(math.ceil(peak / 4), max(math.ceil((len(p) + MAX_TOKENS) / 4) for p in prompts))
  engine = engine_of(model, tokenizer, num_device_blocks=pool, preemption_mode=mode, **wide)
  tight = run(engine, prompts, params, seeds, arrive_every=0)
  assert [tight[i].token_ids for i in range(len(prompts))] == [
      free[i].token_ids for i in range(len(prompts))]
  assert engine.stats()["preemptions"][mode] > 0
  assert_all_free(engine)


def test_planning_ahead_keeps_transformed_rows_and_their_tokens(tiny):
  """Transformed rows plan ahead too: their model call is dispatched ahead and their sampling
  waits for the transforms of the tokens just read (`step_inputs.late_transforms`)."""
  model, tokenizer = tiny
  prompts = prompts_of((9, 14, 5, 21), seed=7)
  seeds = [3, 4, 5, 6]

  def drive(async_scheduling, params):
    engine = engine_of(model, tokenizer, async_scheduling=async_scheduling)
    out = run(engine, prompts, params, seeds, arrive_every=0)
    return [out[i].token_ids for i in range(len(prompts))], engine.stats()

  ahead, stats = drive(True, ENGINE_PARAMS)
  plain, plain_stats = drive(False, ENGINE_PARAMS)
  assert ahead == plain and plain_stats["steps_planned_ahead"] == 0
  assert stats["steps_planned_ahead"] > 0


def test_ids_outside_the_vocabulary_are_refused_at_add_request(tiny):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer)
  vocab = model.config.vocab_size
  for params, field in ((SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                        (SamplingParams(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids")):
    with pytest.raises(ValueError, match=f"{field} has token ids outside the vocabulary"):
      engine.add_request("a", [1, 2, 3], params, 0)
  assert not engine.has_unfinished()


def test_the_reference_driver_refuses_transforms(tiny):
  from jaxtier.engine.padded import generate_batch
  model, tokenizer = tiny
  graphdef, state = nnx.split(model)
  request = Request.of(0, [1, 2, 3], SamplingParams(repetition_penalty=1.2), 0)
  with pytest.raises(ValueError, match="logit transforms"):
    generate_batch(graphdef, state, tokenizer, [request], 64, np.float32)
