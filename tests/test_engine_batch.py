"""Plan columns -> padded step arrays (`jaxtier.engine.batch`), without a model or a device call.

Each expected array is written out by hand from the plan, not computed by the code under test.
"""

import numpy as np
import pytest

from jaxtier.engine import batch
from jaxtier.sampling import SamplingParams
from jaxtier.scheduler import ComputeBatch

TOKENS = {"a": list(range(100, 140)), "b": [7, 8, 9], "c": list(range(200, 221))}
PARAMS = {"a": SamplingParams(temperature=0.5, top_k=5, top_p=0.9), "b": SamplingParams(),
          "c": SamplingParams(temperature=0)}
SEEDS = {"a": 11, "b": 22, "c": 33}


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
  # 4 sequences, 32 tokens a step, a 64-token window: one chunk of 17-32 tokens beside short ones.
  assert batch.step_shapes(4, 32, 64, width=8) == [
      (1, 1, 8), (2, 1, 8), (4, 1, 8), (1, 16, 8), (2, 16, 8), (4, 16, 8), (1, 32, 8),
      (2, 32, 8), (4, 32, 8)]
  # Full-width rows: up to one partial row per sequence plus budget // PREFILL_ROW_TOKENS.
  assert batch.PREFILL_ROW_TOKENS == 64
  assert batch.step_shapes(4, 256, 1024, width=64)[-1] == (8, 64, 64)
  # A 20-token window caps chunks at 19 tokens (bucket 32) whatever the budget.
  assert batch.step_shapes(2, 2048, 20, width=8)[-1] == (2, 32, 8)
  assert batch.table_width(64, 16) == 8 and batch.table_width(1000, 16) == 64


def test_a_fixed_width_pads_every_table_to_it():
  plan = ComputeBatch(("a",), (39,), (40,), ((5, 6, 7),), (True,))
  arrays = batch.build(plan, TOKENS.__getitem__, info, decode=True, width=32)
  assert arrays.shape == (1, 1, 32) and (arrays.tables_bm[0, 3:] == -1).all()
  with pytest.raises(ValueError, match="does not fit width=2"):
    batch.build(plan, TOKENS.__getitem__, info, decode=True, width=2)


def test_rows_pad_to_a_power_of_two_then_to_small_steps():
  from jaxtier.buckets import row_bucket, row_buckets_up_to
  assert [row_bucket(n) for n in (1, 3, 5, 8, 9, 17, 33, 64, 65, 129)] == [
      1, 4, 8, 8, 16, 24, 40, 64, 80, 160]  # past 64 rows, steps of 1/8 of the power of two
  assert row_buckets_up_to(20) == [1, 2, 4, 8, 16, 24]
  assert len(row_buckets_up_to(256)) == 19
  for n in range(1, 300):
    assert n <= row_bucket(n) < n + max(8, n / 4) and row_bucket(n) in row_buckets_up_to(n)
  plan = ComputeBatch(tuple("abc") * 3, (0,) * 9, (3,) * 9, ((1,),) * 9, (True,) * 9)
  tokens = {r: [1, 2, 3] for r in "abc"}
  assert batch.build(plan, tokens.__getitem__, info, decode=False).shape == (16, 16, 8)
