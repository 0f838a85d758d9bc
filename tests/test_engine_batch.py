"""Plan columns -> padded step arrays (`jaxtier.engine.step_inputs`), without a model or a device
call.

Each expected array is written out by hand from the plan, not computed by the code under test.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxtier.common.buckets import pow2_buckets_up_to, row_bucket, row_buckets_up_to
from jaxtier.engine import step_inputs as batch
from jaxtier.sampling import SamplingParams
from jaxtier.scheduler import ComputeBatch

TOKENS = {"a": list(range(100, 140)), "b": [7, 8, 9], "c": list(range(200, 221))}
PARAMS = {"a": SamplingParams(temperature=0.5, top_k=5, top_p=0.9), "b": SamplingParams(),
          "c": SamplingParams(temperature=0)}
SEEDS = {"a": 11, "b": 22, "c": 33}


def info_any(request_id):
  return batch.SamplingInfo(SamplingParams(), 0, 0)


def info(request_id):
  return batch.SamplingInfo(PARAMS[request_id], SEEDS[request_id],
                            num_generated={"a": 4, "b": 0, "c": 2}[request_id])


def test_decode_batch_pads_rows_and_tables():
  plan = ComputeBatch(("a", "c"), (39, 20), (40, 21), ((5, 6, 7), (9, 3)), (True, True))
  arrays = batch.build(plan, TOKENS.__getitem__, info, decode=True)
  assert arrays.shape == (2, 1, 8)
  np.testing.assert_array_equal(arrays.tokens_bt, [[139], [220]])
  np.testing.assert_array_equal(arrays.pos_bt, [[39], [20]])
  np.testing.assert_array_equal(arrays.tables_bm, [[5, 6, 7, -1, -1, -1, -1, -1],
                                                   [9, 3, -1, -1, -1, -1, -1, -1]])
  np.testing.assert_array_equal(arrays.last_b, [0, 0])
  s = arrays.sampling
  np.testing.assert_allclose(s.temperature_b, [0.5, 0.0])
  np.testing.assert_array_equal(s.top_k_b, [5, -1])
  np.testing.assert_allclose(s.top_p_b, [0.9, 1.0])
  np.testing.assert_array_equal(s.seed_b, [11, 33])
  np.testing.assert_array_equal(s.step_b, [4, 2])
  assert arrays.request_ids == ("a", "c") and arrays.num_tokens == 2


def test_three_rows_pad_to_four_with_inert_padding():
  plan = ComputeBatch(("a", "b", "c"), (39, 2, 20), (40, 3, 21), ((1, 2, 3), (4,), (5, 6)),
                      (True, True, True))
  arrays = batch.build(plan, TOKENS.__getitem__, info, decode=True)
  assert arrays.shape == (4, 1, 8)
  assert arrays.pos_bt[3, 0] == -1 and (arrays.tables_bm[3] == -1).all()
  assert arrays.tokens_bt[3, 0] == 0 and arrays.sampling.temperature_b[3] == 0
  assert arrays.num_tokens == 3


def test_prefill_chunks_pad_tokens_and_mark_the_last_position():
  plan = ComputeBatch(("a", "b"), (16, 0), (40, 3), (tuple(range(10)), (4,)), (False, True))
  arrays = batch.build(plan, TOKENS.__getitem__, info, decode=False)
  assert arrays.shape == (2, 32, 16)  # 24 tokens -> 32; 10 blocks -> 16
  np.testing.assert_array_equal(arrays.tokens_bt[0, :24], range(116, 140))
  np.testing.assert_array_equal(arrays.pos_bt[0, :24], range(16, 40))
  assert (arrays.pos_bt[0, 24:] == -1).all() and (arrays.tokens_bt[0, 24:] == 0).all()
  np.testing.assert_array_equal(arrays.tokens_bt[1, :3], [7, 8, 9])
  np.testing.assert_array_equal(arrays.pos_bt[1, :4], [0, 1, 2, -1])
  np.testing.assert_array_equal(arrays.last_b, [23, 2])
  assert arrays.samples == (False, True)


def test_pack_prefill_cuts_chunks_into_rows_in_order():
  plan = ComputeBatch(("a", "b"), (0, 10), (150, 20), ((1, 2, 3), (4, 5)), (True, False))
  rows = batch.pack_prefill(plan, row_tokens=64)
  assert rows.request_ids == ("a", "a", "a", "b")
  assert list(zip(rows.starts, rows.ends)) == [(0, 64), (64, 128), (128, 150), (10, 20)]
  assert rows.block_tables == ((1, 2, 3),) * 3 + ((4, 5),)
  assert rows.samples == (False, False, True, False)  # only a chunk's last piece samples
  tokens = {"a": list(range(100, 250)), "b": list(range(30))}
  arrays = batch.build(rows, tokens.__getitem__, info, decode=False)
  assert arrays.shape == (4, 64, 8)
  np.testing.assert_array_equal(arrays.pos_bt[1], range(64, 128))
  np.testing.assert_array_equal(arrays.tokens_bt[2, :22], range(228, 250))
  assert (arrays.pos_bt[2, 22:] == -1).all()
  np.testing.assert_array_equal(arrays.last_b, [63, 63, 21, 9])


def chunks_of(lengths, start: int = 0) -> ComputeBatch:
  """One sampling chunk per length, of request ids 0, 1, ..., from `start` (one table block)."""
  n = len(lengths)
  return ComputeBatch(tuple(range(n)), (start,) * n, tuple(start + x for x in lengths),
                      ((1,),) * n, (True,) * n)


def pieces_of(rows: ComputeBatch) -> list[tuple]:
  return list(zip(rows.request_ids, rows.starts, rows.ends, rows.samples))


# The most rows of a prefill call of the default engine (64 sequences, 2048 tokens a step).
MOST_ROWS = batch.prefill_rows_most(64, 2048)


def test_prefill_calls_split_rows_that_land_just_past_a_bucket():
  # A 2048-token step: four 508-token prompts (16 pieces each, the last of 28 tokens) and the
  # first 16 tokens of a fifth: 65 rows, which one call would pad to 128.
  chunks = [(f"p{i}", 0, 508, True) for i in range(4)] + [("q", 0, 16, False)]
  plan = ComputeBatch(tuple(c[0] for c in chunks), tuple(c[1] for c in chunks),
                      tuple(c[2] for c in chunks), ((1, 2),) * 5, tuple(c[3] for c in chunks))
  assert MOST_ROWS == 64
  # Split whether the engine's calls could hold all 65 rows or not.
  for most_rows in (MOST_ROWS, 128):
    first, second = batch.prefill_calls(plan, most_rows)
    assert len(first) == 64  # a whole bucket
    # The shortest end piece moves: the fifth prompt's only piece.
    assert pieces_of(second) == [("q", 0, 16, False)]
    assert (sorted(pieces_of(first) + pieces_of(second))
            == sorted(pieces_of(batch.pack_prefill(plan))))
    # One call: 128 x 32 slots. Split: 64 x 32 and 1 x 32.
    assert [batch.build(c, lambda r: list(range(600)), info_any, decode=False).shape[:2]
            for c in (first, second)] == [(64, 32), (1, 32)]


def test_prefill_calls_take_chunk_ends_in_order_and_keep_sampling_on_the_last_piece():
  # 10 rows of 8-token pieces (bucket 16): 8 stay and 2 end pieces move, the shortest first: the
  # 3-token prompt (its only piece), then the 4-token tail of the 12-token chunk.
  plan = ComputeBatch(("a", "b", "c", "d"), (0, 0, 0, 0), (30, 21, 12, 3), ((1,),) * 4,
                      (True, False, True, True))
  first, second = batch.prefill_calls(plan, 16, row_tokens=8)
  assert pieces_of(second) == [("c", 8, 12, True), ("d", 0, 3, True)]
  assert pieces_of(first) == [("a", 0, 8, False), ("a", 8, 16, False), ("a", 16, 24, False),
                              ("a", 24, 30, True), ("b", 0, 8, False), ("b", 8, 16, False),
                              ("b", 16, 21, False), ("c", 0, 8, False)]


@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=12),
       row_tokens=st.sampled_from([8, 16, 32]), most_rows=st.sampled_from([1, 2, 4, 16, 64]))
def test_prefill_calls_keep_every_piece_once_and_each_sequence_in_order(lengths, row_tokens,
                                                                        most_rows):
  plan = ComputeBatch(tuple(range(len(lengths))), (0,) * len(lengths), tuple(lengths),
                      ((1,),) * len(lengths), (True,) * len(lengths))
  split = batch.prefill_calls(plan, most_rows, row_tokens=row_tokens)
  calls = [pieces_of(c) for c in split]
  packed = pieces_of(batch.pack_prefill(plan, row_tokens))
  assert sorted(sum(calls, [])) == sorted(packed)
  for call in calls[:-1]:  # every call but the last is a whole bucket
    assert len(call) in pow2_buckets_up_to(most_rows)
  seen = {}  # sequence -> the end of its pieces in the calls so far
  for call in calls:
    for rid, start, end, _ in call:  # each sequence's pieces come in order, across calls too
      assert seen.get(rid, 0) == start
      seen[rid] = end
  # The rows each call is built with (every row `row_tokens` wide): never more than most_rows.
  tokens = lambda request_id: list(range(200))
  rows = [batch.build(c, tokens, info_any, decode=False).shape[0] for c in split]
  assert max(rows) <= most_rows
  # Splitting never pads more than one call would, counting each extra call's weight read.
  if len(packed) <= most_rows:
    one = batch.build(batch.pack_prefill(plan, row_tokens), tokens, info_any,
                      decode=False).shape[0]
    assert sum(rows) * row_tokens + (len(calls) - 1) * batch.CALL_SLOTS <= one * row_tokens
  else:  # too many rows for one call
    assert len(calls) > 1


def test_prefill_calls_stay_one_call_when_the_rows_fill_a_bucket_or_a_split_saves_too_little():
  full = ComputeBatch(("a",), (0,), (2048,), ((1,),), (True,))  # 64 full rows
  assert batch.prefill_calls(full, MOST_ROWS) == [batch.pack_prefill(full)]
  # 9 chunks of 20 tokens (rows of 32 slots): 9 rows pad to 16 (512 slots); 8 + 1 rows are
  # 256 + 32 slots plus one more call's weight read (32), 320 in all: this one splits...
  nine = ComputeBatch(tuple("abcdefghi"), (0,) * 9, (20,) * 9, ((1,),) * 9, (True,) * 9)
  assert [len(c) for c in batch.prefill_calls(nine, MOST_ROWS)] == [8, 1]
  # ...but 3 rows of 16 tokens pad to 4 rows (128 slots); 2 + 1 would be 64 + 32 + 32...
  three = ComputeBatch(tuple("abc"), (0,) * 3, (16,) * 3, ((1,),) * 3, (True,) * 3)
  assert batch.prefill_calls(three, MOST_ROWS) == [batch.pack_prefill(three)]
  # ...unless an engine's calls hold at most 2 rows.
  assert [len(c) for c in batch.prefill_calls(three, 2)] == [2, 1]


def test_prefill_calls_split_a_long_prompt_into_whole_buckets():
  # One 416-token prompt: 13 full rows, which one call pads to 16 (512 slots). In calls of
  # 8, 4 and 1 rows nothing is padded (416 slots plus two calls' weight reads).
  plan = ComputeBatch(("a",), (0,), (416,), ((1,),), (True,))
  calls = batch.prefill_calls(plan, MOST_ROWS)
  assert [len(c) for c in calls] == [8, 4, 1]
  assert pieces_of(calls[0])[0] == ("a", 0, 32, False)
  assert pieces_of(calls[1]) == [("a", 256 + 32 * i, 288 + 32 * i, False) for i in range(4)]
  assert pieces_of(calls[2]) == [("a", 384, 416, True)]  # it samples from its last piece
  # 22 rows (one call: 32): 16 + 4 + 2.
  assert [len(c) for c in batch.prefill_calls(chunks_of([32] * 22), MOST_ROWS)] == [16, 4, 2]
  # 14 rows (one call: 16): 8 + 4 + 2 would save two rows (64 slots), no more than the two
  # extra calls' weight reads.
  assert [len(c) for c in batch.prefill_calls(chunks_of([32] * 14), MOST_ROWS)] == [14]
  # A prompt longer than one call's rows: calls of at most `most_rows` rows.
  long = ComputeBatch(("a",), (0,), (300,), ((1,),), (True,))  # 10 rows
  assert [len(c) for c in batch.prefill_calls(long, 4)] == [4, 4, 2]


def test_bad_columns_are_named():
  with pytest.raises(ValueError, match="batch is empty"):
    batch.build(ComputeBatch((), (), (), (), ()), TOKENS.__getitem__, info, decode=True)
  with pytest.raises(ValueError, match="exactly one in a decode batch"):
    batch.build(ComputeBatch(("a",), (0,), (2,), ((1,),), (True,)), TOKENS.__getitem__, info,
                decode=True)
  with pytest.raises(ValueError, match="computes up to position 9 but has 3 tokens"):
    batch.build(ComputeBatch(("b",), (0,), (9,), ((1,),), (True,)), TOKENS.__getitem__, info,
                decode=False)


def test_step_shapes_lists_decode_rows_and_prefill_buckets_the_budget_allows():
  # 4 sequences, 32 tokens a step: every prefill row is 32 tokens, 1, 2 or 4 of them.
  assert batch.PREFILL_ROW_TOKENS == 32
  assert batch.step_shapes(4, 32, width=8) == [
      (1, 1, 8), (2, 1, 8), (4, 1, 8), (1, 32, 8), (2, 32, 8), (4, 32, 8)]
  # A 256-token budget holds 8 full rows: a call of 8 rows, more pieces in more calls.
  assert batch.prefill_rows_most(4, 256) == 8
  assert batch.step_shapes(4, 256, width=64)[-1] == (8, 32, 64)
  # A 16-token budget: two chunks at most, one row each.
  assert batch.step_shapes(2, 16, width=8)[-1] == (2, 32, 8)
  # The default engine: 9 decode row buckets and 7 prefill calls of 32 to 2048 tokens.
  shapes = batch.step_shapes(64, 2048, width=128)
  assert [b for b, t, _ in shapes if t == 1] == [1, 2, 4, 8, 16, 24, 32, 48, 64]
  assert [(b, t) for b, t, _ in shapes if t > 1] == [(b, 32) for b in (1, 2, 4, 8, 16, 32, 64)]
  assert batch.table_width(64, 16) == 8 and batch.table_width(1000, 16) == 64


@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=8),
       budget=st.sampled_from([16, 32, 100, 256, 512]), max_num_seqs=st.integers(1, 8))
def test_every_call_a_plan_builds_has_a_listed_shape(lengths, budget, max_num_seqs):
  """What the engine builds for a step's prefill (at most max_num_seqs chunks, `budget` tokens
  in all) and for its decode rows is among `step_shapes`."""
  lengths = lengths[:max_num_seqs]
  while sum(lengths) > budget:  # trim the chunks to the budget, as the scheduler does
    lengths[lengths.index(max(lengths))] -= 1
  lengths = [n for n in lengths if n > 0] or [1]
  shapes = set(batch.step_shapes(max_num_seqs, budget, width=8))
  tokens = lambda request_id: list(range(300))
  for call in batch.prefill_calls(chunks_of(lengths), batch.prefill_rows_most(max_num_seqs,
                                                                              budget)):
    assert batch.build(call, tokens, info_any, decode=False, width=8).shape in shapes
  for rows in range(1, max_num_seqs + 1):
    decode = chunks_of([1] * rows, start=5)
    assert batch.build(decode, tokens, info_any, decode=True, width=8).shape in shapes


def test_a_fixed_width_pads_every_table_to_it():
  plan = ComputeBatch(("a",), (39,), (40,), ((5, 6, 7),), (True,))
  arrays = batch.build(plan, TOKENS.__getitem__, info, decode=True, width=32)
  assert arrays.shape == (1, 1, 32) and (arrays.tables_bm[0, 3:] == -1).all()
  with pytest.raises(ValueError, match="does not fit width=2"):
    batch.build(plan, TOKENS.__getitem__, info, decode=True, width=2)


def test_decode_rows_pad_to_a_power_of_two_then_to_one_and_a_half_times_one():
  assert [row_bucket(n) for n in (1, 3, 5, 8, 9, 17, 33, 64, 65, 129)] == [
      1, 4, 8, 8, 16, 24, 48, 64, 96, 192]  # past 16 rows, powers of two and 1.5 times them
  assert row_buckets_up_to(20) == [1, 2, 4, 8, 16, 24]
  assert row_buckets_up_to(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
  assert len(row_buckets_up_to(256)) == 13
  for n in range(1, 300):  # padding: under a third of the call past 16 rows
    assert n <= row_bucket(n) < max(n + 8, 1.5 * n) and row_bucket(n) in row_buckets_up_to(n)
  tokens = lambda request_id: [1, 2, 3]
  for rows, decode_rows, prefill_rows in ((9, 16, 16), (17, 24, 32), (33, 48, 64)):
    decode = chunks_of([1] * rows, start=2)
    assert batch.build(decode, tokens, info_any, decode=True).shape == (decode_rows, 1, 8)
    # Prefill rows are PREFILL_ROW_TOKENS wide and pad to a power of two.
    prefill = chunks_of([3] * rows)
    assert batch.build(prefill, tokens, info_any, decode=False).shape == (prefill_rows, 32, 8)
