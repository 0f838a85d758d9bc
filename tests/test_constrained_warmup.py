"""The engine's warm-up compiles the transformed sampler at the widths of rows constrained by a
grammar alone, so a request with `structured_outputs` after `Engine.warmup()` compiles nothing.
The log-probabilities of a transformed row are programs of their own, compiled on first need."""

from jaxtier.engine.engine import warmup_programs
from jaxtier.engine.step_inputs import step_shapes, table_width
from jaxtier.sampling import LogitsArrays, SamplingParams
from jaxtier.sampling.structured import GrammarMatcher, StructuredOutputsParams, grammar_tokenizer
from test_engine import engine_of, prompts_of, run, tiny  # noqa: F401

CHOICES = ["alpha", "beta", "gamma delta"]


def test_grammar_widths_are_those_a_grammar_only_batch_builds(tiny):
  model, tokenizer = tiny
  vocab = max(model.config.vocab_size, tokenizer.vocab_size)
  matcher = GrammarMatcher(grammar_tokenizer(tokenizer, model.config.vocab_size),
                           StructuredOutputsParams(choice=tuple(CHOICES)))
  rows = [(None, [5, 6, 7], 1, matcher.mask()), None, (None, list(range(3, 200)), 90,
                                                        matcher.mask())]
  assert LogitsArrays.from_rows(rows).widths == LogitsArrays.grammar_widths(vocab)
  assert LogitsArrays.grammar_widths(vocab)[3] == -(-vocab // 32)


def test_warmup_programs_hold_the_constrained_sampler_of_every_row_bucket(tiny):
  model, tokenizer = tiny
  config = engine_of(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=128).config
  keys = warmup_programs(config, 300)
  widths = LogitsArrays.grammar_widths(300)
  shapes = step_shapes(8, 128, table_width(config.max_model_len, config.block_size))
  rows = {b for b, _, _ in shapes}
  assert {k[1:] for k in keys if k[0] == "step"} == set(shapes)
  assert {k for k in keys if k[0] == "sample_transformed"} == {
      ("sample_transformed", b) + widths for b in rows}
  # A transformed row's log-probabilities are compiled on need, not warmed up.
  assert not {k for k in keys if k[0] in ("logprobs", "processed_logprobs")}
  for i, key in enumerate(keys):  # each after a model call of its rows, whose logits it takes
    if key[0] == "sample_transformed":
      assert any(k[0] == "step" and k[1] == key[1] for k in keys[:i])


def test_constrained_requests_compile_nothing_after_warmup(tiny):
  model, tokenizer = tiny
  # small, so the cold warm-up stays short: rows 1 and 2, decode and prefill (32-token rows)
  engine = engine_of(model, tokenizer, max_model_len=32, max_num_seqs=2,
                     max_num_batched_tokens=16, num_device_blocks=32, num_host_blocks=0)
  report = engine.warmup()
  runner = engine.runner
  compiled = runner.compile_seconds
  constrained = lambda **kw: SamplingParams(max_tokens=8, temperature=0.8,
                                            structured_outputs={"choice": CHOICES}, **kw)
  schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
  # one row alone, then two rows, then a json schema beside a free request
  out = run(engine, prompts_of([5]), constrained(), seeds=[1])
  assert out[0].text in CHOICES
  pair = run(engine, prompts_of([4, 7], seed=1), [constrained(), constrained()], seeds=[2, 3])
  assert pair[0].text in CHOICES and pair[1].text in CHOICES
  free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
  json_params = SamplingParams(max_tokens=12, temperature=0,
                               structured_outputs={"json": schema})
  run(engine, prompts_of([6, 3], seed=2), [json_params, free], seeds=[4, 5])
  warmed = set(warmup_programs(engine.config, 300))
  assert runner.compile_seconds == compiled, sorted(set(runner.variants()) - warmed, key=str)
  ran = {key[:2] for key in runner.variants() if key[0] == "sample_transformed"}
  assert {("sample_transformed", 1), ("sample_transformed", 2)} <= ran
  assert report["programs"] == len(warmed)
  # A constrained row asking for log-probabilities compiles its scoring programs on first need
  # (and only those), then nothing more; the sampled tokens are those it gets without.
  lp_params = [constrained(), constrained(logprobs=1)]
  out = run(engine, prompts_of([4, 7], seed=1), lp_params, seeds=[2, 3])
  assert [out[i].text for i in (0, 1)] == [pair[i].text for i in (0, 1)]
  assert out[0].logprobs is None and len(out[1].logprobs) == len(out[1].token_ids)
  extra = set(runner.variants()) - warmed
  assert {key[0] for key in extra} == {"logprobs", "processed_logprobs"}, extra
  compiled = runner.compile_seconds
  run(engine, prompts_of([4, 7], seed=1), lp_params, seeds=[2, 3])
  assert runner.compile_seconds == compiled
