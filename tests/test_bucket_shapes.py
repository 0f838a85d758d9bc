"""Programs at every shape the buckets produce, against one-piece references.

Past 16 rows a decode call's rows are not powers of two (`buckets.row_bucket`: 24, 48, 96, ...),
so no program may assume that its rows are a power of two or divide one. Prompt log-probabilities
(what echo scores over HTTP too), computed in the model call's program of a prefill call, and the
sampler with the sampled tokens' log-probabilities, computed in every call's program, are run at
bucket shapes and compared with log_softmax of the whole logits in numpy; every program the
warm-up compiles for max_num_seqs 1..64 is built with `jax.eval_shape` (traced, not compiled); and
a batch of 24 or 40 prompts asking for log-probabilities (prompt and sampled, decoded at 24 and 48
rows) gets what each prompt gets alone.

Shape legend: b rows, t tokens per row, n positions, h hidden size, v vocab.
"""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxtier
from conftest import fixture_path
from jaxtier import checkpoint
from jaxtier.common.buckets import row_bucket
from jaxtier.engine import step_inputs as batch, runner
from jaxtier.engine.args import EngineArgs
from jaxtier.engine.engine import warmup_programs
from jaxtier.sampling import SamplingArrays, SamplingParams
from jaxtier.sampling.logprobs import MAX_LOGPROBS
from jaxtier.sampling.samplers import processed_logprobs, sample
from jaxtier.server import AsyncEngine, create_app

MAX_NUM_SEQS = 64  # the default: warm-up shapes are checked for every count up to it
TOL = 1e-5
ENGINE_ARGS = dict(max_model_len=64, max_num_seqs=40, layer_execution="scan")
PREFILL_SHAPES = sorted({(b, t) for b, t, _ in batch.step_shapes(MAX_NUM_SEQS, 2048, 128)
                         if t > 1})
_HYPOTHESIS = settings(
    max_examples=40 if os.environ.get("JAXTIER_HYPOTHESIS_PROFILE") == "ci" else 8,
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                          HealthCheck.too_slow], derandomize=True)


@pytest.fixture(scope="module")
def tiny():
  graphdef, state = nnx.split(checkpoint.load(fixture_path("tiny_llama"), "float32").model)
  return graphdef, state


@pytest.fixture(scope="module")
def llm():
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)


def log_softmax(logits_nv: np.ndarray) -> np.ndarray:
  shifted = np.asarray(logits_nv, np.float64)
  shifted = shifted - shifted.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def check_top(top, ref_nv: np.ndarray, tokens_n: np.ndarray, k: int) -> None:
  """`TopLogprobs` over n positions (any leading shape) against the reference log_softmax."""
  n = len(tokens_n)
  token_lp, rank = np.asarray(top.token_lp).reshape(n), np.asarray(top.token_rank).reshape(n)
  top_lp = np.asarray(top.top_lp_k).reshape(n, k)
  top_ids = np.asarray(top.top_ids_k).reshape(n, k)
  at_token = ref_nv[np.arange(n), tokens_n]
  np.testing.assert_allclose(token_lp, at_token, atol=TOL)
  np.testing.assert_array_equal(rank, (ref_nv >= at_token[:, None]).sum(-1))
  np.testing.assert_array_equal(top_ids, np.argsort(-ref_nv, axis=-1, kind="stable")[:, :k])
  np.testing.assert_allclose(top_lp, np.take_along_axis(ref_nv, top_ids, -1), atol=TOL)


@given(positions=st.integers(1, 1 << 20), most=st.integers(1, 1024))
def test_prompt_chunks_hold_every_position_in_the_fewest_even_chunks(positions, most):
  chunks, size = runner.prompt_chunks(positions, most)
  assert 0 < size <= most and chunks == -(-positions // most)
  assert 0 <= chunks * size - positions < chunks


def test_prompt_chunks_of_every_bucket_shape_pad_less_than_a_chunk_count():
  for b, t in PREFILL_SHAPES:
    chunks, size = runner.prompt_chunks(b * t)
    assert size <= runner.PROMPT_LOGITS_CHUNK and chunks * size - b * t < chunks
  assert runner.prompt_chunks(24 * 16) == (2, 192)  # the shape that could not be reshaped


@_HYPOTHESIS
@given(shape=st.sampled_from(PREFILL_SHAPES), most=st.sampled_from([runner.PROMPT_LOGITS_CHUNK,
                                                                    100, 7]),
       seed=st.integers(0, 3))
def test_prompt_logprobs_at_bucket_shapes_equal_one_piece_log_softmax(tiny, shape, most, seed):
  graphdef, state = tiny
  model = nnx.merge(graphdef, state)
  b, t = shape
  h, v = model.config.hidden_size, model.config.vocab_size
  rng = np.random.default_rng(seed)
  h_bth = rng.normal(size=(b, t, h)).astype(np.float32)
  targets_bt = rng.integers(0, v, size=(b, t)).astype(np.int32)
  k = 3
  prompt = jax.jit(functools.partial(runner._prompt_logprobs, graphdef, k=k, most=most))
  top = prompt(state, h_bth, targets_bt)
  assert top.token_lp.shape == (b, t) and top.top_ids_k.shape == (b, t, k)
  ref_nv = log_softmax(model.logits(h_bth.reshape(b * t, h)))  # every position in one piece
  check_top(top, ref_nv, targets_bt.reshape(-1), k)


_sample = jax.jit(sample, static_argnames="portable")  # the sampler of every model call
_processed = jax.jit(processed_logprobs)


@_HYPOTHESIS
@given(rows=st.integers(1, MAX_NUM_SEQS), seed=st.integers(0, 3), portable=st.booleans())
def test_sampling_and_its_logprobs_at_row_buckets_equal_numpy(rows, seed, portable):
  b, v = row_bucket(rows), 300
  rng = np.random.default_rng(seed)
  logits_bv = rng.normal(size=(b, v)).astype(np.float32) * 4
  greedy = SamplingArrays.from_params([SamplingParams(temperature=0)] * b, [0] * b, [0] * b)
  tokens_b = np.asarray(_sample(logits_bv, greedy, portable=portable))
  np.testing.assert_array_equal(tokens_b, logits_bv.argmax(-1))
  top = runner._sample_logprobs(logits_bv, tokens_b, k=runner.LOGPROB_K)
  check_top(top, log_softmax(logits_bv), tokens_b, runner.LOGPROB_K)
  np.testing.assert_array_equal(_processed(logits_bv, tokens_b, greedy), 0)  # argmax alone
  # Drawn at temperature 0.5 without a cut: the processed log-probability is that of the
  # logits / 0.5.
  warm = SamplingArrays.from_params([SamplingParams(temperature=0.5)] * b, [seed] * b,
                                    list(range(b)))
  drawn_b = np.asarray(_sample(logits_bv, warm, portable=portable))
  assert ((0 <= drawn_b) & (drawn_b < v)).all()
  np.testing.assert_allclose(_processed(logits_bv, drawn_b, warm),
                             log_softmax(logits_bv / 0.5)[np.arange(b), drawn_b], atol=TOL)


def test_every_warmup_program_of_max_num_seqs_1_to_64_builds(llm):
  """The warm-up's own list and arguments (`warmup_programs`, `Runner.trace_programs`), for the
  configuration each max_num_seqs gets (its default token budget), traced without compiling."""
  engine = llm.engine
  programs = {}
  for n in range(1, MAX_NUM_SEQS + 1):
    config = dataclasses.replace(engine.config, max_num_seqs=n,
                                 max_num_batched_tokens=EngineArgs(max_num_seqs=n).token_budget)
    programs.update(dict.fromkeys(warmup_programs(config, engine.vocab_size)))
  keys = list(programs)
  traced = engine.runner.trace_programs(engine.cache, keys)
  assert list(traced) == keys
  steps = {key[1:3]: out for key, out in traced.items() if key[0] == "step"}
  assert {24, 48} <= {b for b, t in steps if t == 1}  # decode rows that are no power of two
  assert {shape for shape in steps if shape[1] > 1} == set(PREFILL_SHAPES)
  v = engine.vocab_size
  for (b, t), (out, cache) in steps.items():  # (StepOut, cache)
    assert jax.tree.structure(cache) == jax.tree.structure(engine.cache)
    assert out.tokens_b.shape == (b,) and out.logits_bv.shape == (b, v)
    assert out.processed_b.shape == (b,) and out.sampled.token_lp.shape == (b,)
    assert out.sampled.top_ids_k.shape == (b, MAX_LOGPROBS)
    if t == 1:
      assert out.prompt is None  # a decode call scores no prompt
    else:
      assert out.prompt.token_lp.shape == (b, t)
      assert out.prompt.top_ids_k.shape == (b, t, MAX_LOGPROBS)
  for key, out in traced.items():
    if key[0] == "sample_transformed":
      assert out.shape == (key[1],)


def prompts_of(count: int, seed: int) -> list[list[int]]:
  """`count` prompts of 2-16 tokens: one prefill row each, then `count` decode rows."""
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 300, size=rng.integers(2, 17)).tolist() for _ in range(count)]


def assert_same_entries(batched, alone) -> None:
  assert len(batched) == len(alone) and batched[0] is None and alone[0] is None
  for got, want in zip(batched[1:], alone[1:]):
    assert list(got) == list(want)
    for token, value in got.items():
      assert value.rank == want[token].rank and value.decoded_token == want[token].decoded_token
      np.testing.assert_allclose(value.logprob, want[token].logprob, atol=TOL)


@pytest.mark.parametrize("count", [24, 40])
def test_a_batch_of_prompts_gets_the_logprobs_each_gets_alone(llm, count):
  prompts = prompts_of(count, seed=count)
  params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1,
                          logprobs=1)
  batched = llm.generate(prompts, params)
  ran = {v[1:3] for v in llm.engine.runner.variants() if v[0] == "step"}
  assert (row_bucket(count), 1) in ran  # 24 or 48 decode rows
  for prompt, out in zip(prompts, batched):
    alone = llm.generate(prompt, params)[0]
    assert out.token_ids == alone.token_ids
    assert_same_entries(out.prompt_logprobs, alone.prompt_logprobs)
    assert_same_entries((None,) + tuple(out.outputs[0].logprobs),
                        (None,) + tuple(alone.outputs[0].logprobs))


def test_echo_scores_24_prompts_over_http(llm):
  served = jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE_ARGS)
  engine = AsyncEngine(served, warmup=False)
  try:
    prompts = prompts_of(24, seed=7)
    response = TestClient(create_app(engine, "tiny")).post("/v1/completions", json={
        "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert response.status_code == 200, response.text
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    for choice, prompt in zip(response.json()["choices"], prompts):
      alone = llm.generate(prompt, params)[0].prompt_logprobs
      token_logprobs = choice["logprobs"]["token_logprobs"]
      assert token_logprobs[0] is None and len(token_logprobs) == len(prompt)
      np.testing.assert_allclose(token_logprobs[1:], [e[t].logprob for e, t in
                                                      zip(alone[1:], prompt[1:])], atol=TOL)
  finally:
    engine.close()
