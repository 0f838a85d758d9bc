"""The offline API on the tiny Llama: batching, ordering, limits and bad input."""

import pytest

import jaxtier
from conftest import fixture_path

GREEDY = jaxtier.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
  return jaxtier.LLM(fixture_path("tiny_llama"), max_num_seqs=2, layer_execution="scan")


def test_batched_generation_equals_one_prompt_at_a_time(llm):
  prompts = ["Hello, world!", "The quick brown fox jumps over", [5, 17, 42]]
  together = llm.generate(prompts, GREEDY)
  alone = [llm.generate(p, GREEDY)[0] for p in prompts]
  assert [o.token_ids for o in together] == [o.token_ids for o in alone]
  assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in together)
  assert together[2].prompt_token_ids == (5, 17, 42)


def test_scan_and_unrolled_generate_the_same_tokens(llm):
  unrolled = jaxtier.LLM(fixture_path("tiny_llama"), layer_execution="unrolled")
  prompts = ["Rotary embeddings rotate", "Caches page blocks"]
  assert ([o.token_ids for o in unrolled.generate(prompts, GREEDY)]
          == [o.token_ids for o in llm.generate(prompts, GREEDY)])


def test_context_window_ends_generation_with_length():
  small = jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=8, layer_execution="scan")
  out = small.generate([1, 2, 3, 4, 5], jaxtier.SamplingParams(max_tokens=50, temperature=0,
                                                               ignore_eos=True))[0]
  assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_chat_applies_the_template(llm):
  conv = [{"role": "user", "content": "hi"}]
  out = llm.chat(conv, GREEDY)[0]
  assert out.prompt == "<|user|>hi</s><|assistant|>"
  assert out.prompt_token_ids == tuple(llm.tokenizer.encode(out.prompt, add_special_tokens=False))


@pytest.mark.parametrize("prompts, error, match", [
    ([""], ValueError, "prompt 0 is empty"),
    ([], ValueError, "prompts is empty"),
    (["ok", []], ValueError, "prompt 1 is empty"),
    ([[1, 2, 999]], ValueError, "prompt 0 has token ids outside \\[0, 300\\): \\[999\\]"),
    ([3.5], TypeError, "prompt 0 must be a string or a list of token ids"),
    (["word " * 300], ValueError, "prompt 0 has .* tokens; the context window max_model_len is 256"),
])
def test_bad_prompts_are_named(llm, prompts, error, match):
  with pytest.raises(error, match=match):
    llm.generate(prompts, GREEDY)


def test_bad_engine_and_request_arguments(llm):
  with pytest.raises(ValueError, match="sampling_params must be one SamplingParams or a list of 2"):
    llm.generate(["a", "b"], [GREEDY])
  with pytest.raises(ValueError, match="max_num_seqs=0: expected an int in \\[1, 4096\\]"):
    jaxtier.LLM(fixture_path("tiny_llama"), max_num_seqs=0)
  with pytest.raises(ValueError, match="max_model_len=100000: expected at most 256"):
    jaxtier.LLM(fixture_path("tiny_llama"), max_model_len=100000)
  with pytest.raises(ValueError, match="layer_execution='fast'"):
    jaxtier.LLM(fixture_path("tiny_llama"), layer_execution="fast")
  with pytest.raises(ValueError, match="message 0 must be a dict with 'role' and 'content'"):
    llm.chat([[{"content": "no role"}]], GREEDY)


def test_int16_activations_without_kept_blocks_are_said_to_do_nothing(caplog):
  """A safetensors checkpoint has no GGUF blocks to keep: asking for int16 activations warns
  (once, at load) instead of passing silently."""
  with caplog.at_level("WARNING"):
    jaxtier.LLM(fixture_path("tiny_llama"), layer_execution="scan", block_activations="int16")
  assert any("block_activations='int16' has no effect" in r.getMessage() for r in caplog.records)
