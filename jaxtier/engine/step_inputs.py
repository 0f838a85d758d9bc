"""Turning a scheduler plan's compute batches into bucketed numpy arrays for one model call.

Pure: no device, no model. The scheduler hands columns (`ComputeBatch`: request ids, [start, end)
ranges, block tables, whether to sample); this module pads them into the shapes the jitted step was
compiled for, so an engine has few programs (`step_shapes` lists every one):
- decode calls: one token per row, rows padded to `buckets.row_bucket` of their number (a power
  of two up to 16, then 24, 32, 48, 64, ...; padding rows compute nothing useful: position -1,
  no table entries, greedy sampling).
- prefill calls: every chunk is cut into pieces of `PREFILL_ROW_TOKENS` tokens, one row each
  (`pack_prefill`), every row is that wide, and rows pad to a power of two up to
  `buckets.prefill_rows_most` (more rows are more calls, `prefill_calls`). So a prefill call is
  a token-count bucket: 32, 64, 128, ... tokens, whatever the mix of chunks, and its programs
  are one per bucket. A step pads at most one partial row per chunk however long the prompts:
  the pieces of one sequence share its block table, and each layer writes every row's keys and
  values before any row attends, so a piece sees the pieces before it in the same call (and in
  the calls before). Short rows also bound the attention a long prompt computes past the causal
  triangle to one row's width.
- table width: one width for every call of an engine, the power of two >= `MIN_WIDTH` that holds a
  max_model_len sequence (`table_width`). The paged attention loop stops at the last chunk any
  query sees, so the unused width costs nothing at run time.

Shape legend: b rows, t tokens per row, m blocks per row (table width).
"""

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jaxtier.common.buckets import pow2_bucket, pow2_buckets_up_to, row_bucket, row_buckets_up_to
from jaxtier.sampling.samplers import LogitRules, LogitsArrays, SamplingArrays, SamplingParams
from jaxtier.sampling.structured import GrammarMatcher
from jaxtier.scheduler import ComputeBatch
from jaxtier.scheduler.allocator import blocks_for

PREFILL_ROW_TOKENS = 32  # every prefill row: chunks are cut into pieces of this many tokens
MIN_WIDTH = 8  # block tables pad to at least this many entries
GREEDY = SamplingParams(temperature=0)


@dataclasses.dataclass(frozen=True)
class SamplingInfo:
  """What sampling one request's next token needs: its parameters, seed and tokens so far."""
  params: SamplingParams
  seed: int
  num_generated: int  # folded into the key with the seed: the same token whatever the batch
  rules: LogitRules | None = None  # its logit transforms, when `params.transforms_logits`
  grammar: GrammarMatcher | None = None  # its grammar's state, when `params.constrained`


@dataclasses.dataclass(frozen=True)
class StepArrays:
  """One model call's inputs; rows past `len(request_ids)` are padding."""
  request_ids: tuple[Hashable, ...]  # [real rows]
  samples: tuple[bool, ...]  # [real rows] the row's range ends its sequence: its token is kept
  tokens_bt: np.ndarray  # int32 [b, t] token ids (0 in padding)
  pos_bt: np.ndarray  # int32 [b, t] positions, -1 for padding (no cache write, output ignored)
  tables_bm: np.ndarray  # int32 [b, m] device block ids, -1 for unused entries
  last_b: np.ndarray  # int32 [b] index in t of each row's last real token (its logits sample)
  sampling: SamplingArrays  # [b] per-row sampling parameters
  logits: LogitsArrays | None = None  # [b] logit transforms; None when no row has any

  @property
  def shape(self) -> tuple[int, int, int]:
    """(rows, tokens, width): the compiled variant this call needs."""
    return self.tokens_bt.shape + (self.tables_bm.shape[1],)

  @property
  def num_tokens(self) -> int:
    return int((self.pos_bt >= 0).sum())


def pack_prefill(batch: ComputeBatch, row_tokens: int = PREFILL_ROW_TOKENS) -> ComputeBatch:
  """Cuts every chunk into consecutive pieces of at most `row_tokens` tokens, one row each, in
  order; a chunk's last piece keeps its `samples` flag, the others sample nothing."""
  columns = ([], [], [], [], [])
  for rid, start, end, table, keep in zip(batch.request_ids, batch.starts, batch.ends,
                                          batch.block_tables, batch.samples):
    for first in range(start, end, row_tokens):
      last = min(first + row_tokens, end)
      for column, value in zip(columns, (rid, first, last, table, keep and last == end)):
        column.append(value)
  return ComputeBatch(*map(tuple, columns))


def prefill_rows_most(max_num_seqs: int, token_budget: int) -> int:
  """The most rows of one prefill call of an engine of `max_num_seqs` and `token_budget`: the
  largest power of two among its decode calls' row buckets, or of the full rows the budget
  holds, whichever is larger. A prefill call's rows pad to powers of two up to it, so where
  max_num_seqs is the larger, its programs and samplers are among the decode calls' row counts
  (one transformed sampler per row count serves both)."""
  decode = max(b for b in row_buckets_up_to(max_num_seqs) if b & (b - 1) == 0)
  return max(decode, pow2_bucket(token_budget // PREFILL_ROW_TOKENS + 1) // 2)


CALL_SLOTS = 32  # what one more prefill call costs, in padded token slots: it reads the weights
#   again (a step's prefill is split into more calls only when that saves more padding than this)


def prefill_calls(batch: ComputeBatch, most_rows: int, row_tokens: int = PREFILL_ROW_TOKENS
                  ) -> list[ComputeBatch]:
  """The model calls of one step's prefill: `pack_prefill`'s rows in the calls that pad least,
  none of more than `most_rows` rows (a power of two, `buckets.prefill_rows_most`).

  One call pads its rows up to a power of two: a 2048-token step in 32-token pieces has 64 full
  rows plus one partial row per chunk, so its rows often land just past a bucket (65 rows pad to
  128), and one 416-token prompt is 13 rows padded to 16. Split, the leading calls each take a
  whole bucket of rows (the largest that fits, then the largest that fits the rest, ...: 13
  rows are 8 + 4 + 1) and the later calls the chunks' end pieces (from the last call back), so
  every piece in a later call comes after its sequence's pieces in the earlier ones, whose keys
  and values those calls have written by then, and a chunk still samples from its last piece.
  The number of calls is the one with the fewest padded slots, counting `CALL_SLOTS` for each
  call past the first.
  """
  packed = pack_prefill(batch, row_tokens)
  n = len(packed)
  lengths = [end - start for start, end in zip(packed.starts, packed.ends)]
  sizes, rest = [], n
  while rest:
    sizes.append(min(most_rows, 1 << (rest.bit_length() - 1)))
    rest -= sizes[-1]
  best, best_cost = None, pow2_bucket(n) * row_tokens if n <= most_rows else float("inf")
  for k in range(1, len(sizes)):  # k calls of whole buckets, then one call of the rest
    if n - sum(sizes[:k]) > most_rows:
      continue
    calls = _split(packed.request_ids, lengths, sizes[:k])
    cost = (sum(pow2_bucket(len(rows)) for rows in calls) * row_tokens
            + (len(calls) - 1) * CALL_SLOTS)
    if cost < best_cost:
      best, best_cost = calls, cost
  if best is None:
    return [packed]
  return [_select(packed, rows) for rows in best]


def _split(request_ids: Sequence[Hashable], lengths: Sequence[int], leading: Sequence[int]
           ) -> list[list[int]]:
  """Row indices of len(leading) + 1 calls: leading[i] rows in call i, the rest in the last.
  The later calls take the chunks' end pieces, shortest first, from the last call back."""
  pieces: dict = {}  # chunk (request id) -> its rows, in order
  for i, rid in enumerate(request_ids):
    pieces.setdefault(rid, []).append(i)
  sizes = list(leading[1:]) + [len(lengths) - sum(leading)]
  later = []
  for size in reversed(sizes):
    taken = []
    while len(taken) < size:
      rid = min(pieces, key=lambda r: (lengths[pieces[r][-1]], pieces[r][-1]))
      taken.append(pieces[rid].pop())
      if not pieces[rid]:
        del pieces[rid]
    later.append(sorted(taken))
  return [sorted(i for rows in pieces.values() for i in rows)] + later[::-1]


def _select(batch: ComputeBatch, rows: list[int]) -> ComputeBatch:
  pick = lambda column: tuple(column[i] for i in rows)
  return ComputeBatch(pick(batch.request_ids), pick(batch.starts), pick(batch.ends),
                      pick(batch.block_tables), pick(batch.samples))


def table_width(max_model_len: int, block_size: int) -> int:
  """The block-table width of every call: a power of two >= MIN_WIDTH holding max_model_len."""
  return pow2_bucket(blocks_for(max_model_len, block_size), MIN_WIDTH)


def step_shapes(max_num_seqs: int, token_budget: int, width: int,
                max_model_len: int | None = None) -> list[tuple[int, int, int]]:
  """Every (rows, tokens, width) that `build` produces for the calls of `prefill_calls` and of
  decode batches of this configuration: decode calls of every `row_bucket` up to max_num_seqs
  rows of one token; prefill calls of a power of two of `PREFILL_ROW_TOKENS`-token rows, at
  most `prefill_rows_most` and at most the pieces of one step (max_num_seqs chunks of
  token_budget tokens in all: each chunk adds a partial row at most; with `max_model_len`, no
  chunk holds more than max_model_len - 1 tokens)."""
  shapes = [(b, 1, width) for b in row_buckets_up_to(max_num_seqs)]
  pieces = min(max_num_seqs + token_budget // PREFILL_ROW_TOKENS, token_budget)
  if max_model_len is not None:
    pieces = min(pieces, max_num_seqs * -(-(max_model_len - 1) // PREFILL_ROW_TOKENS))
  rows = min(prefill_rows_most(max_num_seqs, token_budget), pow2_bucket(pieces))
  return shapes + [(b, PREFILL_ROW_TOKENS, width) for b in pow2_buckets_up_to(rows)]


def build(batch: ComputeBatch, token_ids: Callable[[Hashable], Sequence[int]],
          sampling: Callable[[Hashable], SamplingInfo], *, decode: bool,
          width: int | None = None) -> StepArrays:
  """The padded arrays of one compute batch.

  Args:
    batch: sequences computing ranges [start, end) of their token lists.
    token_ids: a request's tokens so far (prompt, then generated): the inputs of its range.
    sampling: a request's sampling parameters, seed and generated count.
    decode: one token per row (rows pad to 1 token) instead of prefill chunks.
    width: the table width (`table_width`); None: the power of two >= MIN_WIDTH of the longest
      table.
  """
  n = len(batch)
  if n == 0:
    raise ValueError("batch is empty: expected at least one sequence")
  lengths = [end - start for start, end in zip(batch.starts, batch.ends)]
  if min(lengths) < 1 or (decode and max(lengths) != 1):
    raise ValueError(f"ranges {list(zip(batch.starts, batch.ends))} must hold at least one token"
                     + (" and exactly one in a decode batch" if decode else ""))
  # Prefill rows are PREFILL_ROW_TOKENS wide (a longer range, not cut by `pack_prefill`, pads to
  # a power of two), their count a power of two.
  b = row_bucket(n) if decode else pow2_bucket(n)
  t = 1 if decode else pow2_bucket(max(lengths), PREFILL_ROW_TOKENS)
  longest_table = max(len(table) for table in batch.block_tables)
  m = pow2_bucket(longest_table, MIN_WIDTH) if width is None else width
  if longest_table > m:
    raise ValueError(f"a block table of {longest_table} blocks does not fit width={m}")
  tokens = np.zeros((b, t), np.int32)
  pos = np.full((b, t), -1, np.int32)
  tables = np.full((b, m), -1, np.int32)
  last = np.zeros(b, np.int32)
  params, seeds, steps = [GREEDY] * b, [0] * b, [0] * b
  transforms: list = [None] * b
  for i, (rid, start, end, table) in enumerate(zip(batch.request_ids, batch.starts, batch.ends,
                                                   batch.block_tables)):
    ids = token_ids(rid)
    if end > len(ids):
      raise ValueError(f"request {rid!r} computes up to position {end} but has {len(ids)} tokens")
    tokens[i, :end - start] = ids[start:end]
    pos[i, :end - start] = np.arange(start, end)
    tables[i, :len(table)] = table
    last[i] = end - start - 1
    info = sampling(rid)
    params[i], seeds[i], steps[i] = info.params, info.seed, info.num_generated
    if batch.samples[i]:  # the row's tokens so far: ids[:end]
      transforms[i] = row_transforms(info, ids[:end])
  return StepArrays(tuple(batch.request_ids), tuple(batch.samples), tokens, pos, tables, last,
                    SamplingArrays.from_params(params, seeds, steps),
                    LogitsArrays.from_rows(transforms) if any(transforms) else None)


def row_transforms(info: SamplingInfo, ids: Sequence[int]) -> tuple | None:
  """A sampling row's logit transforms as `LogitsArrays.from_rows` takes them: (its rules, its
  tokens so far `ids`, how many of them are output, its grammar's mask now), or None without."""
  if info.rules is None and info.grammar is None:
    return None
  return (info.rules, ids, info.num_generated,
          None if info.grammar is None else info.grammar.mask())


def late_transforms(arrays: StepArrays, rows: Sequence[bool],
                    token_ids: Callable[[Hashable], Sequence[int]],
                    sampling: Callable[[Hashable], SamplingInfo]) -> LogitsArrays | None:
  """The logit transforms of a call built before its rows' last tokens were known (its model call
  dispatched ahead, `Engine._plan_ahead`), computed now that they are: for each row i where
  `rows[i]` (its request is live and samples), from its tokens and grammar state as they are now."""
  out: list = [None] * arrays.tokens_bt.shape[0]
  for i, request_id in enumerate(arrays.request_ids):
    if rows[i]:
      out[i] = row_transforms(sampling(request_id), token_ids(request_id))
  return LogitsArrays.from_rows(out) if any(out) else None
