"""Incremental decoding against decoding all ids at once, and the windowed stop search against a
search of the whole text."""

import pytest
from hypothesis import given, strategies as st

from conftest import fixture_path
from jaxtier.text.detokenize import REPLACEMENT, IncrementalDecoder, find_stop
from jaxtier.text.tokenizer import load_tokenizer_dir

TOKENIZERS = {name: load_tokenizer_dir(fixture_path(name)) for name in ("tiny_llama", "tiny_qwen2")}
TEXT = "Héllo wörld, ñandú 日本語 ✓ 12345  spaces\nnew line"


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@given(data=st.data())
def test_incremental_text_is_the_decoded_prefix(name, data):
  tokenizer = TOKENIZERS[name]
  vocab = tokenizer.backend.get_vocab_size()
  ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40)
                  | st.just(tokenizer.encode(TEXT, add_special_tokens=False)))
  chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
  decoder, at, deltas = IncrementalDecoder(tokenizer), 0, []
  while at < len(ids):
    step = ids[at:at + chunks[at]]
    at += len(step)
    deltas.append(decoder.push(step))
    full = tokenizer.decode(ids[:at])
    assert "".join(deltas) == decoder.text
    if not full.endswith(REPLACEMENT):  # a finished character: nothing is held back
      assert decoder.text == full
    else:
      assert full.startswith(decoder.text)


@given(text=st.text("abAB", max_size=30), stops=st.lists(st.text("abAB", min_size=1, max_size=3),
                                                         max_size=3),
       cut=st.integers(0, 30))
def test_windowed_stop_search_finds_what_a_full_search_finds(text, stops, cut):
  cut = min(cut, len(text))
  earlier = find_stop(text[:cut], stops, cut)
  hits = [text.find(s) for s in stops if s in text]
  expected = min(hits) if hits else None
  # Searching only where the new characters could end a stop finds the first one, given that the
  # earlier text held none.
  if earlier is None:
    assert find_stop(text, stops, len(text) - cut) == expected
  assert find_stop(text, stops, len(text)) == expected
