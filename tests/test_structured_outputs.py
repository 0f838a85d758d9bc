"""Structured outputs: the parameters and their checks, the grammar mask in the sampler, and the
engine with random weights, where only the constraint makes an output valid."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier.sampling import (LogitsArrays, SamplingArrays, SamplingParams, grammar_allowed,
                              sample_transformed)
from jaxtier.sampling.structured import GrammarMatcher, StructuredOutputsParams, grammar_tokenizer
from test_engine import assert_all_free, engine_of, prompts_of, run, tiny  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "ok"],
    "additionalProperties": False,
}
CHOICES = ("alpha", "beta", "gamma delta")
REGEX = r"[0-9]{3}-[a-z]{2,4}"


def check_schema(text: str) -> None:
  """Asserts `text` is a JSON object SCHEMA accepts (strict: no other keys)."""
  value = json.loads(text)
  assert isinstance(value, dict) and set(value) == set(SCHEMA["required"]), text
  assert isinstance(value["name"], str) and len(value["name"]) <= 6, text
  assert type(value["age"]) is int and 0 <= value["age"] <= 99, text
  assert value["kind"] in ("cat", "dog"), text
  assert type(value["ok"]) is bool, text


def sampled(constraint, max_tokens=60, **kwargs) -> SamplingParams:
  return SamplingParams(max_tokens=max_tokens, temperature=0.8, structured_outputs=constraint,
                        **kwargs)


# Parameters.

@pytest.mark.parametrize("value, field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "abc"}, "structured_outputs.choice"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"jsonschema": {}}, "structured_outputs"),
    ("json", "structured_outputs"),
])
def test_malformed_constraints_are_value_errors_naming_the_field(value, field):
  with pytest.raises(ValueError, match=re.escape(field)) as info:
    SamplingParams(structured_outputs=value)
  assert info.value.field == "structured_outputs"


@pytest.mark.parametrize("value, field", [
    ({"json": {"type": "frobnicate"}}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
])
def test_invalid_grammars_are_refused_before_they_are_queued(tiny, value, field):
  """llguidance validates a constraint when a request arrives (as vLLM does), not when the
  parameters are made; the engine is left with nothing live."""
  params = SamplingParams(structured_outputs=value)
  with pytest.raises(ValueError, match=re.escape(field)) as info:
    params.structured_outputs.llguidance_grammar()
  assert info.value.field == field
  e = engine(tiny)
  with pytest.raises(ValueError, match=re.escape(field)):
    e.add_request("r", [5, 6, 7], sampled(value), seed=0)
  assert not e.has_unfinished()
  assert_all_free(e)


def test_constraints_are_parsed_from_mappings():
  params = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)})
  assert params.structured_outputs == StructuredOutputsParams(json=SCHEMA)
  assert params.constrained and not params.transforms_logits
  assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == (
      "a", "b")
  assert not SamplingParams().constrained


# The mask in the sampler.

def test_grammar_bitmask_unpacks_bit_t_of_word_t_over_32():
  rng = np.random.default_rng(0)
  v = 70
  mask_bw = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
  want = np.unpackbits(mask_bw.view(np.uint8), axis=1, bitorder="little")[:, :v].astype(bool)
  np.testing.assert_array_equal(np.asarray(grammar_allowed(jnp.asarray(mask_bw), v)), want)
  # a mask narrower than the logits allows nothing past it
  assert not np.asarray(grammar_allowed(jnp.asarray(mask_bw[:, :1]), v))[:, 32:].any()


def test_sampler_draws_only_allowed_tokens_and_leaves_free_rows_alone():
  v, b = 96, 4
  logits = jax.random.normal(jax.random.key(1), (b, v)) * 3
  allowed = np.zeros((b, v), bool)
  allowed[0, [5, 40, 77]] = True
  allowed[2, [90]] = True
  words = np.packbits(allowed, axis=1, bitorder="little").view(np.int32)
  rows = [(None, [1], 0, words[0]), None, (None, [1], 0, words[2]), None]
  t = LogitsArrays.from_rows(rows)
  assert t.grammar_bw.shape == (b, 3) and (t.grammar_bw[1] == -1).all()
  free = SamplingParams(temperature=0.8)
  fn = jax.jit(sample_transformed)
  for step in range(20):
    s = SamplingArrays.from_params([free] * b, [7] * b, [step] * b)
    got = np.asarray(fn(logits, s, t))
    assert got[0] in (5, 40, 77) and got[2] == 90
    plain = np.asarray(jax.jit(sample_transformed)(
        logits, s, LogitsArrays.from_rows([(None, [1], 0)] * b)))
    assert got[1] == plain[1] and got[3] == plain[3]


# The engine.

def engine(tiny, **overrides):
  model, tokenizer = tiny
  return engine_of(model, tokenizer, **{"max_model_len": 128, "num_device_blocks": 256,
                                        "num_host_blocks": 64, **overrides})


def test_json_schema_outputs_parse_and_match_the_schema(tiny):
  e = engine(tiny, max_num_seqs=8)
  prompts = prompts_of([5, 9, 3, 12, 7, 4, 10, 6])
  out = run(e, prompts, sampled({"json": SCHEMA}), seeds=list(range(len(prompts))))
  for i in range(len(prompts)):
    assert out[i].finish_reason == "stop", out[i]
    check_schema(out[i].text)
  assert_all_free(e)
  assert not e._grammars


def test_json_object_choice_regex_and_lark_grammar(tiny):
  e = engine(tiny, max_num_seqs=8)
  grammar = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
  constraints = [{"json_object": True}, {"choice": list(CHOICES)}, {"regex": REGEX},
                 {"grammar": grammar}] * 2
  prompts = prompts_of([4, 8, 6, 3, 9, 5, 7, 2], seed=3)
  out = run(e, prompts, [sampled(c) for c in constraints], seeds=list(range(8)))
  for i, c in enumerate(constraints):
    text = out[i].text
    if "json_object" in c:  # unbounded: random weights need not close it within max_tokens
      assert text.startswith("{")
      if out[i].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
      continue
    assert out[i].finish_reason == "stop", (c, out[i])
    if "choice" in c:
      assert text in CHOICES
    elif "regex" in c:
      assert re.fullmatch(REGEX, text), text
    else:
      assert re.fullmatch(r"\([a-c](,[a-c])*\)", text), text
  assert_all_free(e)


def test_free_requests_get_the_same_tokens_beside_constrained_ones(tiny):
  free = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
  prompts = prompts_of([5, 9, 3, 12])
  alone = run(engine(tiny), prompts[:2], free, seeds=[1, 2])
  mixed_params = [free, sampled({"json": SCHEMA}), free, sampled({"choice": list(CHOICES)})]
  mixed = run(engine(tiny), [prompts[0], prompts[2], prompts[1], prompts[3]], mixed_params,
              seeds=[1, 5, 2, 6])
  assert mixed[0].token_ids == alone[0].token_ids
  assert mixed[2].token_ids == alone[1].token_ids
  check_schema(mixed[1].text)
  assert mixed[3].text in CHOICES


def test_constrained_rows_plan_ahead_with_the_same_tokens(tiny):
  """With async_scheduling a constrained batch's model call is dispatched before its tokens are
  read, its masks computed beside it: the tokens are those of stepping without it."""
  prompts = prompts_of([5, 9, 3, 12])
  params = [sampled({"json": SCHEMA}), sampled({"regex": REGEX}),
            SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True),
            sampled({"choice": list(CHOICES)})]
  outs, planned = [], []
  for ahead in (True, False):
    e = engine(tiny, async_scheduling=ahead)
    out = run(e, prompts, params, seeds=[1, 2, 3, 4], arrive_every=0)
    outs.append([out[i].token_ids for i in range(4)])
    planned.append(e.stats()["steps_planned_ahead"])
    check_schema(out[0].text)
    assert re.fullmatch(REGEX, out[1].text) and out[3].text in CHOICES
    assert_all_free(e)
  assert outs[0] == outs[1]
  assert planned[0] > 10 and planned[1] == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_constrained_outputs_stay_valid_under_preemption(tiny, mode):
  # 4 requests of up to ~80 tokens each in 40 blocks of 4: some are preempted while generating
  e = engine(tiny, num_device_blocks=40, num_host_blocks=64, preemption_mode=mode,
             max_num_seqs=4)
  prompts = prompts_of([20, 24, 18, 22], seed=5)
  params = [sampled({"json": SCHEMA}), sampled({"json": SCHEMA}), sampled({"json": SCHEMA}),
            sampled({"regex": REGEX})]
  out = run(e, prompts, params, seeds=[1, 2, 3, 4])
  stats = e.stats()
  assert stats["preemptions"][mode] > 0, stats
  for i in range(3):
    check_schema(out[i].text)
  assert re.fullmatch(REGEX, out[3].text)
  assert_all_free(e)
  assert not e._grammars


def test_recompute_does_not_feed_generated_tokens_to_the_grammar_again(tiny):
  # A json request's tokens are the same preempted by recompute as run alone in a big pool.
  params = sampled({"json": SCHEMA}, max_tokens=60)
  prompts = prompts_of([20, 24, 18, 22], seed=5)
  big = run(engine(tiny), prompts, params, seeds=[1, 2, 3, 4])
  small = engine(tiny, num_device_blocks=40, preemption_mode="recompute")
  tight = run(small, prompts, params, seeds=[1, 2, 3, 4])
  assert small.stats()["preemptions"]["recompute"] > 0
  for i in range(4):
    assert tight[i].token_ids == big[i].token_ids
    check_schema(tight[i].text)


def test_abort_and_prefix_hits_leave_no_matcher_or_block(tiny):
  e = engine(tiny, max_num_seqs=4)
  prompt = prompts_of([16], seed=9)[0]
  # the same prompt twice: the second hits the prefix cache and still follows its grammar
  out = run(e, [prompt, prompt, prompt], [sampled({"regex": REGEX})] * 2
            + [sampled({"json": SCHEMA})], seeds=[1, 2, 3], aborts={2: 2})
  assert out[1].num_cached_tokens > 0
  assert re.fullmatch(REGEX, out[0].text) and re.fullmatch(REGEX, out[1].text)
  assert out[2].finish_reason == "abort"
  assert not e._grammars
  assert_all_free(e)


def test_a_grammar_that_allows_nothing_ends_the_request_without_a_crash(tiny):
  e = engine(tiny)
  finished = e.grammars.finished

  def broken():  # "<s>" is not allowed: each compiled matcher is in error before it samples
    out = finished()
    for _, matcher, _ in out:
      matcher._matcher.consume_token(0)
    return out

  e.grammars.finished = broken
  e.add_request("r", [5, 6, 7], sampled({"regex": "x+"}), seed=0)
  done = None
  while e.has_unfinished():
    for update in e.step():
      done = update.completion or done
  assert done.finish_reason == "abort" and done.token_ids == ()
  assert "structured_outputs.regex: the grammar failed after 0 tokens" in done.error
  assert_all_free(e)


def test_the_default_tokenizer_shape_masks_quickly(tiny):
  """The fixture's tokenizer builds an llguidance tokenizer; a mask is one bit per logit."""
  model, tokenizer = tiny
  matcher = GrammarMatcher(grammar_tokenizer(tokenizer, model.config.vocab_size),
                           StructuredOutputsParams(choice=("alpha", "beta")))
  mask = matcher.mask()
  assert mask.shape == ((model.config.vocab_size + 31) // 32,)
  bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
  allowed = [tokenizer.decode([t]) for t in np.flatnonzero(bits)]
  assert allowed and all("alpha".startswith(a) or "beta".startswith(a) for a in allowed)


# The offline API.

@pytest.fixture(scope="module")
def chat_llm():
  import jaxtier
  from conftest import fixture_path
  return jaxtier.LLM(fixture_path("tiny_llama_chat"), max_model_len=128, max_num_seqs=4,
                     layer_execution="scan")


def test_llm_generate_and_chat_follow_structured_outputs(chat_llm):
  params = [sampled({"json": SCHEMA}, seed=s) for s in range(3)]
  for out in chat_llm.chat([[{"role": "user", "content": f"pet {i}"}] for i in range(3)], params):
    assert out.outputs[0].finish_reason == "stop"
    check_schema(out.outputs[0].text)
  mixed = chat_llm.generate(["a b c", "d e f"], [sampled({"choice": list(CHOICES)}, seed=1),
                                                 SamplingParams(max_tokens=5, seed=2)])
  assert mixed[0].outputs[0].text in CHOICES
  assert len(mixed[1].outputs[0].token_ids) <= 5


def test_the_padded_driver_refuses_structured_outputs(chat_llm):
  ids = chat_llm.prompt_token_ids("a b c")
  with pytest.raises(ValueError, match="structured_outputs"):
    chat_llm.run_batch([chat_llm.make_request(ids, sampled({"regex": "a+"}))])
