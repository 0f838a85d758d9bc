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


def test_split_prefill_groups_by_token_bucket():
  plan = ComputeBatch(("a", "b", "c"), (0, 0, 0), (40, 3, 21), ((1, 2, 3), (4,), (5, 6)),
                      (True, True, True))
  groups = batch.split_prefill(plan)
  assert [g.request_ids for g in groups] == [("b",), ("c",), ("a",)]  # buckets 16, 32, 64
  assert groups[2].ends == (40,) and groups[2].block_tables == ((1, 2, 3),)
  same = ComputeBatch(("b", "c"), (0, 5), (3, 21), ((4,), (5, 6)), (True, True))
  assert [g.request_ids for g in batch.split_prefill(same)] == [("b", "c")]  # 3 and 16 tokens


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
  # 4 sequences, 32 tokens a step, a 64-token window: chunks of 17-32 tokens fit one per step.
  assert batch.step_shapes(4, 32, 64, width=8) == [
      (1, 1, 8), (2, 1, 8), (4, 1, 8), (1, 16, 8), (2, 16, 8), (4, 16, 8), (1, 32, 8)]
  # A 20-token window caps chunks at 19 tokens (bucket 32) whatever the budget.
  assert batch.step_shapes(2, 2048, 20, width=8)[-1] == (2, 32, 8)
  assert batch.table_width(64, 16) == 8 and batch.table_width(1000, 16) == 64


def test_a_fixed_width_pads_every_table_to_it():
  plan = ComputeBatch(("a",), (39,), (40,), ((5, 6, 7),), (True,))
  arrays = batch.build(plan, TOKENS.__getitem__, info, decode=True, width=32)
  assert arrays.shape == (1, 1, 32) and (arrays.tables_bm[0, 3:] == -1).all()
  with pytest.raises(ValueError, match="does not fit width=2"):
    batch.build(plan, TOKENS.__getitem__, info, decode=True, width=2)
