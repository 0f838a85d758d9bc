"""Log-probabilities (`SamplingParams.logprobs`, `prompt_logprobs`) against an independent
reference: one full forward pass of the model over prompt + generated tokens on a contiguous
cache, then numpy's log_softmax.

Shape legend: t tokens, v vocab.
"""

import numpy as np
import pytest
from flax import nnx

import jaxtier
from conftest import fixture_path
from test_engine import engine_of
from jaxtier import checkpoint
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.sampling import SamplingParams
from jaxtier.sampling.logprobs import Logprob

MAX_LEN = 64
TOL = 1e-4
ENGINE = dict(max_model_len=MAX_LEN, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
              num_device_blocks=64, num_host_blocks=32)


@pytest.fixture(scope="module")
def tiny():
  loaded = checkpoint.load(fixture_path("tiny_llama"), "float32")
  return loaded.model, loaded.tokenizer


@pytest.fixture(scope="module")
def llm():
  return jaxtier.LLM(fixture_path("tiny_llama"), **ENGINE)


@nnx.jit
def _forward(model, cache, tokens_bt, pos_bt):
  return model(tokens_bt, pos_bt, cache)[0]


def reference(model, ids) -> np.ndarray:
  """log_softmax [t, v] (float64) of the logits at every position of `ids`, one full pass."""
  c, n = model.config, len(ids)
  t = 1 << (n - 1).bit_length()  # padded positions (-1) write nothing and are dropped
  tokens = np.zeros((1, t), np.int32)
  pos = np.full((1, t), -1, np.int32)
  tokens[0, :n], pos[0, :n] = ids, np.arange(n)
  cache = ContiguousKVCache.create(c.num_layers, 1, t, c.num_kv_heads, c.head_dim, np.float32)
  logits_tv = np.asarray(_forward(model, cache, tokens, pos)[0, :n], np.float64)
  shifted_tv = logits_tv - logits_tv.max(-1, keepdims=True)
  return shifted_tv - np.log(np.exp(shifted_tv).sum(-1, keepdims=True))


def prompts_of(lengths, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 300, size=n).tolist() for n in lengths]


def check_entry(entry: dict, token: int, ref_v: np.ndarray, k: int, tokenizer):
  """One position's dict against the reference distribution at that position."""
  assert token in entry and all(isinstance(v, Logprob) for v in entry.values())
  top = np.argsort(-ref_v, kind="stable")[:k]
  assert set(entry) == set(top.tolist()) | {token}
  np.testing.assert_allclose(entry[token].logprob, ref_v[token], atol=TOL)
  if token not in top:
    assert entry[token].rank == int((ref_v >= ref_v[token]).sum()) > k
  for rank, token_id in enumerate(top.tolist(), 1):
    assert entry[token_id].rank == rank
    np.testing.assert_allclose(entry[token_id].logprob, ref_v[token_id], atol=TOL)
  for token_id, value in entry.items():
    assert value.decoded_token == tokenizer.decode([token_id], skip_special_tokens=False)


def check_prompt_logprobs(prompt_logprobs, prompt, ref_tv, k, tokenizer):
  assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
  for j in range(1, len(prompt)):
    check_entry(prompt_logprobs[j], prompt[j], ref_tv[j - 1], k, tokenizer)


def test_greedy_logprobs_equal_the_full_forward_reference(llm, tiny):
  model, tokenizer = tiny
  prompts = prompts_of((5, 12, 3, 20))
  params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
  for prompt, out in zip(prompts, llm.generate(prompts, params)):
    generated = out.outputs[0].token_ids
    logprobs = out.outputs[0].logprobs
    assert out.prompt_logprobs is None and len(logprobs) == len(generated) == 8
    ref_tv = reference(model, prompt + list(generated))
    for g, (token, entry) in enumerate(zip(generated, logprobs)):
      check_entry(entry, token, ref_tv[len(prompt) + g - 1], 5, tokenizer)
      assert entry[token].rank == 1 and len(entry) == 5  # greedy: the sampled token is the top one


@pytest.mark.parametrize("mode", ["chunked", "recompute"])
def test_prompt_logprobs_equal_the_reference_once_per_position(tiny, mode):
  model, tokenizer = tiny
  if mode == "chunked":  # a 16-token budget prefills the 45-token prompt over several steps
    engine_args = dict(ENGINE, max_num_batched_tokens=16)
    prompts = prompts_of((1, 2, 9, 45), seed=1)
  else:  # a pool of 12 blocks (48 tokens) for four requests of 27-40 tokens: some are recomputed
    engine_args = dict(ENGINE, max_model_len=48, num_device_blocks=12, max_num_batched_tokens=16,
                       preemption_mode="recompute")
    prompts = prompts_of((30, 22, 17, 26), seed=2)
  llm = jaxtier.LLM(fixture_path("tiny_llama"), **engine_args)
  params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=3,
                          logprobs=2)
  outs = llm.generate(prompts, params)
  for prompt, out in zip(prompts, outs):
    generated = list(out.outputs[0].token_ids)
    ref_tv = reference(model, prompt + generated)
    check_prompt_logprobs(out.prompt_logprobs, prompt, ref_tv, 3, tokenizer)
    assert len(out.outputs[0].logprobs) == len(generated)
    for g, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
      check_entry(entry, token, ref_tv[len(prompt) + g - 1], 2, tokenizer)
  if mode == "recompute":
    assert llm.stats()["preemptions"]["recompute"] > 0


def test_requesting_logprobs_does_not_change_sampled_tokens(llm, tiny):
  model, tokenizer = tiny
  prompts = prompts_of((6, 14, 25), seed=3)
  plain = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=7 + i,
                          ignore_eos=True) for i in range(3)]
  asking = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=7 + i,
                           ignore_eos=True, logprobs=3, prompt_logprobs=1) for i in range(3)]
  without = llm.generate(prompts, plain)
  with_lp = llm.generate(prompts, asking)
  assert [o.token_ids for o in with_lp] == [o.token_ids for o in without]
  for prompt, out in zip(prompts, with_lp):
    generated = list(out.token_ids)
    ref_tv = reference(model, prompt + generated)
    for g, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
      check_entry(entry, token, ref_tv[len(prompt) + g - 1], 3, tokenizer)  # raw logits' values
    check_prompt_logprobs(out.prompt_logprobs, prompt, ref_tv, 1, tokenizer)


def test_requests_with_and_without_logprobs_share_a_batch(llm, tiny):
  model, tokenizer = tiny
  prompts = prompts_of((7, 19, 4, 11), seed=4)
  greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
  params = [greedy, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
            greedy, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                   prompt_logprobs=2)]
  mixed = llm.generate(prompts, params)
  alone = llm.generate(prompts, greedy)
  assert [o.token_ids for o in mixed] == [o.token_ids for o in alone]
  for i in (0, 2):
    assert mixed[i].outputs[0].logprobs is None and mixed[i].prompt_logprobs is None
  assert mixed[3].outputs[0].logprobs is None
  entries = mixed[1].outputs[0].logprobs
  ref_tv = reference(model, prompts[1] + list(mixed[1].token_ids))
  for g, (token, entry) in enumerate(zip(mixed[1].token_ids, entries)):
    assert list(entry) == [token] and entry[token].rank == 1  # logprobs=0: the sampled token only
    np.testing.assert_allclose(entry[token].logprob, ref_tv[len(prompts[1]) + g - 1, token],
                               atol=TOL)
  ref_tv = reference(model, prompts[3] + list(mixed[3].token_ids))
  check_prompt_logprobs(mixed[3].prompt_logprobs, prompts[3], ref_tv, 2, tokenizer)


def test_updates_carry_each_tokens_entry_and_the_prompt_entries_first(tiny):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, **ENGINE)
  prompts = prompts_of((9, 21), seed=5)
  engine.add_request("lp", prompts[0], SamplingParams(max_tokens=5, temperature=0, logprobs=4,
                                                      prompt_logprobs=2, ignore_eos=True), 0)
  engine.add_request("plain", prompts[1], SamplingParams(max_tokens=5, temperature=0,
                                                         ignore_eos=True), 0)
  updates = {"lp": [], "plain": []}
  while engine.has_unfinished():
    for update in engine.step():
      updates[update.request_id].append(update)
  assert all(u.new_logprobs is None and u.prompt_logprobs is None for u in updates["plain"])
  first, *rest = updates["lp"]
  assert len(first.prompt_logprobs) == 9 and all(u.prompt_logprobs is None for u in rest)
  streamed = [e for u in updates["lp"] for e in u.new_logprobs]
  assert all(len(u.new_logprobs) == len(u.new_token_ids) for u in updates["lp"])
  completion = updates["lp"][-1].completion
  assert streamed == list(completion.logprobs) and len(streamed) == 5
  assert completion.prompt_logprobs == first.prompt_logprobs
  assert updates["plain"][-1].completion.logprobs is None
  # Plain sampling: the log-probabilities come out of the model call's own program.
  assert {v[0] for v in engine.runner.variants()} <= {"step", "swap"}


def test_only_rows_with_logit_transforms_run_logprob_programs_of_their_own(tiny):
  """With plain sampling the model call's program computes the log-probabilities (sampled and
  prompt); a call with a logit-transformed row samples and scores that row in programs of its
  own, compiled when first needed. Either way the values are the raw model's."""
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, **ENGINE)
  prompts = prompts_of((9, 21), seed=6)
  plain = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3,
                         prompt_logprobs=2)
  engine.add_request("plain", prompts[0], plain, 0)
  while engine.has_unfinished():
    engine.step()
  kinds = {v[0] for v in engine.runner.variants()}
  assert kinds <= {"step", "swap"}
  biased = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3,
                          prompt_logprobs=2, logit_bias={prompts[1][0]: 5.0})
  engine.add_request("biased", prompts[1], biased, 0)
  updates = []
  while engine.has_unfinished():
    updates += engine.step()
  kinds = {v[0] for v in engine.runner.variants()}
  assert {"sample_transformed", "logprobs", "processed_logprobs"} <= kinds
  assert "prompt_logprobs" not in kinds  # prompt log-probabilities stay in the model call
  completion = updates[-1].completion
  generated = list(completion.token_ids)
  ref_tv = reference(model, prompts[1] + generated)
  check_prompt_logprobs(completion.prompt_logprobs, prompts[1], ref_tv, 2, tokenizer)
  assert len(completion.logprobs) == len(generated) == 5
  bias_v = np.zeros(ref_tv.shape[1])
  bias_v[prompts[1][0]] = 5.0
  for g, (token, entry) in enumerate(zip(generated, completion.logprobs)):
    ref_v = ref_tv[len(prompts[1]) + g - 1]
    assert token == int(np.argmax(ref_v + bias_v))  # greedy under the bias
    check_entry(entry, token, ref_v, 3, tokenizer)  # the raw model's values


def test_no_logprob_programs_run_when_no_request_asks(tiny):
  model, tokenizer = tiny
  engine = engine_of(model, tokenizer, **ENGINE)
  for i, prompt in enumerate(prompts_of((5, 18))):
    engine.add_request(i, prompt, SamplingParams(max_tokens=4, temperature=0), 0)
  while engine.has_unfinished():
    assert all(u.new_logprobs is None and u.prompt_logprobs is None for u in engine.step())
  assert {v[0] for v in engine.runner.variants()} <= {"step", "swap"}


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_bad_logprob_counts_are_rejected(name, value):
  with pytest.raises(ValueError, match=rf"{name} must be None or an integer in \[0, 20\], got"):
    SamplingParams(**{name: value})


def test_edge_counts_are_accepted():
  assert SamplingParams(logprobs=0, prompt_logprobs=20).prompt_logprobs == 20
  assert SamplingParams(logprobs=20).logprobs == 20
