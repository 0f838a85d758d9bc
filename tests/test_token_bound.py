"""`Tokenizer.min_token_count` is a true lower bound on the token count, on random text.

Hypothesis: 150 examples per tokenizer, 1,500 with `JAXTIER_HYPOTHESIS_PROFILE=ci`.
"""

import os

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import models, normalizers, pre_tokenizers, trainers

from conftest import DEFAULT_MODEL, fixture_path
from jaxtier.checkpoint import gguf_file, registry
from jaxtier.text.tokenizer import Tokenizer, byte_level_symbols, load_tokenizer_dir, token_bound

EXAMPLES = 1500 if os.environ.get("JAXTIER_HYPOTHESIS_PROFILE") == "ci" else 150
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, 1234 tokens.",
          "naïve café, Ωmega, 東京, emoji 🙂 and tabs\tand\nnewlines",
          "    indented code()"] * 20


def tiny(name: str = "tiny_llama") -> Tokenizer:
  return load_tokenizer_dir(fixture_path(name))


def variant(**parts) -> Tokenizer:
  """The tiny Llama tokenizer with some pipeline parts replaced."""
  backend = tokenizers.Tokenizer.from_str(tiny().backend.to_str())
  for name, value in parts.items():
    setattr(backend, name, value)
  return Tokenizer(backend, ())


def sentencepiece_like() -> Tokenizer:
  """Llama-2 style: '▁' for spaces (normalizer), character BPE with byte fallback."""
  backend = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
  backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                             normalizers.Replace(" ", "▁")])
  backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]
      + [f"<0x{b:02X}>" for b in range(256)]))
  return Tokenizer(backend, ())


def default_model() -> Tokenizer:
  """The default model's tokenizer, read from its GGUF file (fetched into the cache once)."""
  path = registry.fetch(registry.find_manifest(DEFAULT_MODEL))
  return gguf_file.read_tokenizer(gguf_file.open_gguf(path), path)


TOKENIZERS = {
    "tiny_llama": tiny,
    "tiny_qwen2": lambda: tiny("tiny_qwen2"),
    "nfkc": lambda: variant(normalizer=normalizers.NFKC()),
    "digits": lambda: variant(pre_tokenizer=pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=True)])),
    "sentencepiece_like": sentencepiece_like,
    "default_model": default_model,
}


def longest_pieces(tokenizer: Tokenizer) -> list[str]:
  """The text of the 200 longest vocabulary entries (where the bound is tightest)."""
  vocab = tokenizer.backend.get_vocab()
  return [tokenizer.decode([vocab[t]], skip_special_tokens=False)
          for t in sorted(vocab, key=len)[-200:]]


def texts(tokenizer: Tokenizer) -> st.SearchStrategy[str]:
  """Random text mixed with the tokenizer's longest pieces, added tokens and long runs."""
  added = [t.content for t in tokenizer.backend.get_added_tokens_decoder().values()]
  piece = st.one_of(
      st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
      st.sampled_from(longest_pieces(tokenizer)), st.sampled_from(added or [""]),
      st.builds(lambda c, n: c * n,
                st.sampled_from([" ", "\n", "\t", "a", "0", "é", "🙂", "ﬃ"]), st.integers(1, 64)))
  return st.lists(piece, max_size=30).map("".join)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "default_model"
                                  else n for n in sorted(TOKENIZERS)])
def test_min_token_count_never_exceeds_the_count(name):
  tokenizer = TOKENIZERS[name]()
  assert token_bound(tokenizer.backend) is not None
  for piece in longest_pieces(tokenizer):
    assert tokenizer.min_token_count(piece) <= len(tokenizer.encode(piece)), piece

  @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
  @given(texts(tokenizer))
  def check(text):
    bound = tokenizer.min_token_count(text)
    assert bound <= len(tokenizer.encode(text, add_special_tokens=False)), text
    assert bound <= len(tokenizer.encode(text))

  check()


def test_the_bound_is_useful_on_long_text():
  tokenizer = tiny()
  text = "All work and no play makes Jack a dull boy. " * 1000
  assert len(tokenizer.encode(text)) >= tokenizer.min_token_count(text) >= len(text) // 4


@pytest.mark.parametrize("make", [
    lambda: variant(pre_tokenizer=pre_tokenizers.Whitespace()),  # drops the spaces
    lambda: variant(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed")),
    lambda: variant(normalizer=normalizers.Strip()),
    lambda: Tokenizer(tokenizers.Tokenizer(models.BPE()), ()),  # unknown characters vanish
    lambda: Tokenizer(tokenizers.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True)), ()),
    lambda: Tokenizer(tokenizers.Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                      ()),
])
def test_pipelines_without_a_bound_give_zero(make):
  tokenizer = make()
  assert token_bound(tokenizer.backend) is None
  assert tokenizer.min_token_count("word " * 10_000) == 0


def test_added_tokens_that_strip_spaces_give_no_bound():
  tokenizer = variant()
  tokenizer.backend.add_special_tokens([tokenizers.AddedToken("<mask>", lstrip=True)])
  assert token_bound(tokenizer.backend) is None


def test_byte_level_symbols_are_the_byte_level_alphabet():
  assert sorted(byte_level_symbols()) == sorted(pre_tokenizers.ByteLevel.alphabet())
  assert byte_level_symbols()[ord(" ")] == "Ġ" and byte_level_symbols()[ord("\n")] == "Ċ"


def test_bytes_missing_from_a_byte_level_vocabulary_are_not_counted():
  """BPE drops a byte that has no symbol: text of such bytes only may have no tokens at all."""
  backend = tokenizers.Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer = Tokenizer(backend, ())
  assert token_bound(backend).dropped_bytes == bytes(b for b in range(256) if b not in b"ab")
  assert tokenizer.encode("a\x04b\x04\x04") == [0, 1]
  assert tokenizer.min_token_count("a\x04b\x04\x04") == 1  # 2 bytes counted, "ab" is 2 long
  assert tokenizer.min_token_count("\x04" * 100) == 0 == len(tokenizer.encode("\x04" * 100))
