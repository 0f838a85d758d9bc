"""Paged attention: queries attend to keys and values stored in fixed-size blocks of a shared pool.

Pages hold float32, bfloat16, uint16 (bfloat16 bit patterns, how the cache stores bfloat16 on CPU)
or int8 values with float32 scales per token and kv head. Six implementations, one signature
(`paged.attend` picks one per call, see `paged.attention_path`):
- `paged_attention_reference`: gathers every sequence token by token into a dense [batch, slots]
  array and calls `dense_attention`. Obviously right; a token-granular gather plus a transpose.
- `paged_attention`: the XLA path on CPU, flash-decoding style: a loop over chunks of the block
  tables with an online softmax, up to the last chunk a query can see. Each step gathers whole
  blocks (contiguous block_size x head_dim runs per kv head) of ~128 slots, so no dense copy of
  the context is materialized, and INT8 scales are folded into scores and probabilities instead
  of dequantizing K and V. Rows are sorted by length and run in small groups, each to its own
  longest context. On CPU it runs 2-4x faster than one big gather (and than `dense_attention`) at
  long contexts; on an accelerator its hundreds of small sequential steps run launch-bound.
- `paged_attention_gathered`: the XLA path on accelerators (GPU, TPU): one batched gather of
  every row's table pages (whole blocks, kv-head major, the pool's order) and one masked float32
  softmax, INT8 scales folded in as above. A few large ops instead of a loop: the portable
  reference there, and the path of the layers and shapes the kernels do not serve.
- `paged_attention_gpu` (in `jaxtier.kvcache.paged_attention_gpu`): the Pallas Triton GPU
  kernel, decode steps and prefill rows, power-of-two block sizes; `interpret=True` runs it on
  CPU.
- `paged_attention_tpu`: JAX's Pallas TPU decode kernel
  (`jax.experimental.pallas.ops.tpu.paged_attention`), which reads `k_pages` in this pool's own
  layout; decode steps of float pools only, where `tpu_kernel_fits` (its scales must be
  head_dim-wide, a copy 4x the int8 pool per call, so int8 pools take the gathered path), with
  `cap` but no window. `interpret=True` runs it on CPU in Pallas' TPU interpret mode. JAX's
  `ragged_paged_attention` is not used: it takes one page-major pool with K and V interleaved
  per head ([pages, block_size, 2 * kv_heads, head_dim]) and one scale per tensor, which this
  pool ([kv_heads, pages, ...], K and V apart, a scale per token) becomes only by a copy of the
  whole pool per step.
- `paged_attention_cpu`: on CPU, C++ kernels called through the XLA FFI (`jaxtier.cpu_kernels`;
  one for decode steps, one for prefill rows) that read each table's pages in place: XLA:CPU's
  gathers copy every chunk first, and at long contexts those copies were most of a decode step.

The pool is addressed by flat page ids: the cache stores [kv_heads, layers, blocks, block_size,
head_dim] and views it as [kv_heads, layers * blocks, block_size, head_dim] (a free reshape), so
block `i` of layer `l` is page `l * blocks + i`. That is the kernels' native `k_pages` layout, which
lets every layer read the stacked pool without slicing a per-layer copy out of it.

Key slot `s` of a sequence is token position `s`: it lives in page `pages_bm[b, s // c]` at offset
`s % c`. A query at position `p` attends to slots `0..p`, or with a sliding `window` W to slots
`p - W + 1..p`; scores may be soft-capped (`cap`, Gemma 2). The reference and XLA paths take
`window` and `cap`, the TPU kernel `cap` only; the GPU and CPU kernels have neither, so such a
layer runs an XLA path. Negative positions are padding (output 0).
Page ids below zero mark unused table entries; they are never read for a visible slot.

Shape legend: b batch, t query tokens, n query heads, k kv heads, g = n // k, d head dim, f flat
pages (layers * blocks), c block size (slots per block), m blocks per sequence (table width),
s key slots (m * c, or one chunk's slots in the chunked path), x chunks of the chunked path's
scan, q query rows per kv head in the XLA paths (t * g, t major).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import paged_attention as tpu_paged

from jaxtier import cpu_kernels
from jaxtier.kvcache.attention import dense_attention, in_window
from jaxtier.kvcache.quant import SCALE_DTYPE, decode, dequantize_int8
from jaxtier.softcap import softcap


def check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                       v_scales_kfc) -> None:
  """Raises ValueError, naming the values, unless the arguments fit together."""
  b, t, n, d = q_btnd.shape
  kv, f, c, dk = k_pages_kfcd.shape
  if v_pages_kfcd.shape != k_pages_kfcd.shape or v_pages_kfcd.dtype != k_pages_kfcd.dtype:
    raise ValueError(f"v pages {v_pages_kfcd.shape} {v_pages_kfcd.dtype} must match k pages "
                     f"{k_pages_kfcd.shape} {k_pages_kfcd.dtype}")
  if dk != d or n % kv:
    raise ValueError(f"q {q_btnd.shape=} needs head_dim {dk} and a multiple of {kv} kv heads")
  if pages_bm.ndim != 2 or pages_bm.shape[0] != b or pages_bm.dtype != jnp.int32:
    raise ValueError(f"{pages_bm.shape=} {pages_bm.dtype=} must be int32 [batch={b}, blocks]")
  if pos_bt.shape != (b, t) or pos_bt.dtype != jnp.int32:
    raise ValueError(f"{pos_bt.shape=} {pos_bt.dtype=} must be int32 [{b}, {t}]")
  quantized = k_pages_kfcd.dtype == jnp.int8
  for name, scales in (("k_scales", k_scales_kfc), ("v_scales", v_scales_kfc)):
    if quantized != (scales is not None):
      given = "given" if scales is not None else "missing"
      raise ValueError(f"{name} must be given exactly when pages are int8 "
                       f"(pages {k_pages_kfcd.dtype}, {name} {given})")
    if scales is not None and (scales.shape != (kv, f, c) or scales.dtype != SCALE_DTYPE):
      raise ValueError(f"{name} {scales.shape} {scales.dtype} must be {SCALE_DTYPE} {(kv, f, c)}")


@jax.jit
def paged_attention_reference(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt,
                              k_scales_kfc=None, v_scales_kfc=None, window=None, cap=None
                              ) -> jax.Array:
  """Paged attention by gathering each slot's token into a dense array; output [b, t, n, d]."""
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  c = k_pages_kfcd.shape[2]
  slot_s = jnp.arange(pages_bm.shape[1] * c)
  page_bs = jnp.clip(pages_bm[:, slot_s // c], 0, k_pages_kfcd.shape[1] - 1)
  offset_bs = jnp.broadcast_to(slot_s % c, page_bs.shape)

  def dense_bskd(pages_kfcd, scales_kfc):
    x_bskd = jnp.moveaxis(decode(pages_kfcd[:, page_bs, offset_bs]), 0, 2)
    if scales_kfc is None:
      return x_bskd.astype(q_btnd.dtype)
    return dequantize_int8(x_bskd, jnp.moveaxis(scales_kfc[:, page_bs, offset_bs], 0, 2),
                           q_btnd.dtype)

  return dense_attention(q_btnd, dense_bskd(k_pages_kfcd, k_scales_kfc),
                         dense_bskd(v_pages_kfcd, v_scales_kfc), pos_bt, window, cap)


def _kv_major_queries(q_btnd, kv: int) -> jax.Array:
  """Queries scaled by 1 / sqrt(d), kv-head major: [k, b, q = t * g, d] (t major)."""
  b, t, n, d = q_btnd.shape
  q_btkgd = q_btnd.reshape(b, t, kv, n // kv, d) * jnp.asarray(d ** -0.5, q_btnd.dtype)
  return jnp.transpose(q_btkgd, (2, 0, 1, 3, 4)).reshape(kv, b, t * (n // kv), d)


def _token_major_output(out_kbqd, q_btnd) -> jax.Array:
  """[k, b, t * g, d] -> [b, t, n, d] in the queries' dtype."""
  b, t, n, d = q_btnd.shape
  kv = out_kbqd.shape[0]
  out_btkgd = jnp.transpose(out_kbqd.reshape(kv, b, t, n // kv, d), (1, 2, 0, 3, 4))
  return out_btkgd.reshape(b, t, n, d).astype(q_btnd.dtype)


CHUNK_SLOTS = 128  # key slots per step of the chunked path's scan


def _chunked_tables(pages_bm: jax.Array, block_size: int, chunk_slots: int = CHUNK_SLOTS
                    ) -> tuple[jax.Array, int]:
  """Tables [chunks, b, blocks per chunk] of about `chunk_slots` slots a chunk, padded with page
  0 (masked by slot position)."""
  b, m = pages_bm.shape
  per_chunk = max(1, min(m, chunk_slots // block_size))
  padded = -(-m // per_chunk) * per_chunk
  pages_bm = jnp.pad(pages_bm, ((0, 0), (0, padded - m)))
  return jnp.moveaxis(pages_bm.reshape(b, padded // per_chunk, per_chunk), 1, 0), per_chunk


def _chunk_step(q_kbqd, pos_bt, pages, num_slots: int, window, cap, carry, xs):
  """One online-softmax step over a chunk of s slots of every sequence.

  Everything is kv-head major ([k, b, ...], q rows `q` = t * g per kv head, t major), the order
  the pool's gather yields, so neither dot needs a transposed copy of the gathered keys or
  values. `pages` is (k, v, k_scales, v_scales); carry is (running max, running sum,
  unnormalized output).
  """
  k_kfcd, v_kfcd, k_scales_kfc, v_scales_kfc = pages
  max_kbq, sum_kbq, out_kbqd = carry
  table_bm, first_slot = xs
  b, blocks = table_bm.shape
  kv, s = k_kfcd.shape[0], blocks * k_kfcd.shape[2]
  t = pos_bt.shape[1]

  def gather_kbs(pages_kf):
    return decode(pages_kf[:, table_bm]).reshape((kv, b, s) + pages_kf.shape[3:])

  scores_kbqs = jnp.einsum("kbqd,kbsd->kbqs", q_kbqd, gather_kbs(k_kfcd).astype(q_kbqd.dtype),
                           preferred_element_type=jnp.float32)
  if k_scales_kfc is not None:
    scores_kbqs *= gather_kbs(k_scales_kfc)[:, :, None]
  scores_kbqs = softcap(scores_kbqs, cap)
  slot_s = first_slot + jnp.arange(s)
  visible_bts = in_window(slot_s, pos_bt[:, :, None], window) & (slot_s < num_slots)
  visible_bqs = jnp.repeat(visible_bts, q_kbqd.shape[2] // t, axis=1)  # q = t * g, t major
  scores_kbqs = jnp.where(visible_bqs[None], scores_kbqs, -jnp.inf)
  new_max_kbq = jnp.maximum(max_kbq, scores_kbqs.max(-1))
  shift_kbq = jnp.where(jnp.isfinite(new_max_kbq), new_max_kbq, 0.0)
  probs_kbqs = jnp.exp(scores_kbqs - shift_kbq[..., None])
  rescale_kbq = jnp.exp(max_kbq - shift_kbq)
  weights_kbqs, v_kbsd = probs_kbqs, gather_kbs(v_kfcd)
  if v_scales_kfc is not None:
    weights_kbqs = probs_kbqs * gather_kbs(v_scales_kfc)[:, :, None]
    v_kbsd = v_kbsd.astype(jnp.float32)
  out_kbqd = out_kbqd * rescale_kbq[..., None] + jnp.einsum(
      "kbqs,kbsd->kbqd", weights_kbqs.astype(v_kbsd.dtype), v_kbsd,
      preferred_element_type=jnp.float32)
  return (new_max_kbq, sum_kbq * rescale_kbq + probs_kbqs.sum(-1), out_kbqd), None


ROW_GROUP = 16  # most rows of one group of the chunked path's loop
GROUP_QUERIES = 256  # most query tokens of one group: a chunk step's scores stay in cache


def _row_group(t: int) -> int:
  """Rows per group of the chunked path for t query tokens per row."""
  return max(1, min(ROW_GROUP, GROUP_QUERIES // t))


def _attend_rows(q_kbqd, pos_bt, tables_xbm, pages, num_slots: int, chunk_slots: int,
                 window=None, cap=None):
  """The online-softmax loop over chunks for one group of rows; normalized output [k, b, q, d].

  Only the chunks that hold a slot visible to some query of the group run: up to the last
  position's chunk, and under a sliding window from the chunk of the earliest query's first
  visible slot."""
  step = functools.partial(_chunk_step, q_kbqd, pos_bt, pages, num_slots, window, cap)
  init = _empty_carry(q_kbqd)
  live = jnp.clip((jnp.max(pos_bt) + chunk_slots) // chunk_slots, 0, tables_xbm.shape[0])
  first = 0
  if window is not None:
    earliest = jnp.min(jnp.where(pos_bt >= 0, pos_bt, jnp.iinfo(jnp.int32).max))
    first = jnp.clip((earliest - window + 1) // chunk_slots, 0, live)

  def body(i, carry):
    table_bm = jax.lax.dynamic_index_in_dim(tables_xbm, i, keepdims=False)
    return step(carry, (table_bm, i * chunk_slots))[0]

  _, sum_kbq, out_kbqd = jax.lax.fori_loop(first, live, body, init)
  return _normalized(out_kbqd, sum_kbq)


def _empty_carry(q_kbqd):
  """The online softmax's carry before any slot: (running max, running sum, output)."""
  kv, b, q, d = q_kbqd.shape
  return jnp.full((kv, b, q), -jnp.inf), jnp.zeros((kv, b, q)), jnp.zeros((kv, b, q, d))


def _normalized(out_kbqd, sum_kbq):
  """The output divided by its softmax sum (rows that saw no slot stay 0)."""
  return out_kbqd / jnp.where(sum_kbq > 0, sum_kbq, 1.0)[..., None]


@jax.jit
def paged_attention(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc=None,
                    v_scales_kfc=None, window=None, cap=None) -> jax.Array:
  """Paged attention, the XLA path on CPU: an online-softmax loop over chunks of each table.

  Rows run in groups of `_row_group(t)` (ROW_GROUP rows for decode, fewer for longer rows, so
  one step's scores stay in cache). Each step gathers ~CHUNK_SLOTS slots of a group's sequences
  in the pool's own layout, kv-head major, so no dense copy of the context is materialized and
  neither dot transposes what it gathered; INT8 scales are folded into the scores and
  probabilities. Batches of more than one group are sorted by their last position first, and
  each group's loop stops after the last chunk one of its queries can see: cost follows each
  group's longest sequence, not the batch's, and a table padded to a wider bucket costs nothing
  extra. With a sliding `window`, slots before a query's window are masked and the chunks before
  a group's earliest window are skipped; with `cap`, scores are soft-capped. Output [b, t, n, d].
  """
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  b, t, n, d = q_btnd.shape
  kv, f, c, _ = k_pages_kfcd.shape
  g = n // kv
  q_kbqd = _kv_major_queries(q_btnd, kv)
  pages = (k_pages_kfcd, v_pages_kfcd, k_scales_kfc, v_scales_kfc)
  num_slots = pages_bm.shape[1] * c
  pages_bm = jnp.clip(pages_bm, 0, f - 1)
  group = _row_group(t)
  if b <= group:
    tables_xbm, per_chunk = _chunked_tables(pages_bm, c)
    out_kbqd = _attend_rows(q_kbqd, pos_bt, tables_xbm, pages, num_slots, per_chunk * c, window,
                            cap)
  else:
    groups = -(-b // group)
    rows = groups * group  # padding rows: position -1, sorted last
    pad = lambda x, axis, value=0: jnp.pad(
        x, [(0, rows - b) if i == axis else (0, 0) for i in range(x.ndim)], constant_values=value)
    pos_bt = pad(pos_bt, 0, -1)
    order = jnp.argsort(-jnp.max(pos_bt, axis=1))
    q_gkbqd = jnp.moveaxis(pad(q_kbqd, 1)[:, order].reshape(kv, groups, group, t * g, d), 1, 0)
    pos_gbt = pos_bt[order].reshape(groups, group, t)
    tables_xbm, per_chunk = _chunked_tables(pad(pages_bm, 0)[order], c)
    tables_gxbm = jnp.moveaxis(
        tables_xbm.reshape(tables_xbm.shape[0], groups, group, per_chunk), 1, 0)
    out_gkbqd = jax.lax.map(
        lambda xs: _attend_rows(*xs, pages, num_slots, per_chunk * c, window, cap),
        (q_gkbqd, pos_gbt, tables_gxbm))
    out_kbqd = jnp.zeros((kv, rows, t * g, d), out_gkbqd.dtype).at[:, order].set(
        jnp.moveaxis(out_gkbqd, 0, 1).reshape(kv, rows, t * g, d))[:, :b]
  return _token_major_output(out_kbqd, q_btnd)


GATHER_SLOTS = 4096  # widest table the gathered path attends in one step; wider ones in chunks


@functools.partial(jax.jit, static_argnames=("gather_slots",))
def paged_attention_gathered(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt,
                             k_scales_kfc=None, v_scales_kfc=None, window=None, cap=None,
                             gather_slots: int = GATHER_SLOTS) -> jax.Array:
  """Paged attention, the XLA path on accelerators: one gather and one masked softmax.

  Each row's table pages are gathered at once, whole blocks in the pool's kv-head-major order
  ([k, b, m * c, d]), and every query row attends to all of its row's slots under a mask (slots
  after its position, or before its sliding `window`, are hidden); scores and probabilities are
  float32, soft-capped at `cap` where given, with INT8 scales folded into them instead of
  dequantizing K and V. A handful of large ops whatever the context, where `paged_attention`
  loops over chunks and row groups. Output [b, t, n, d].

  Tables wider than `gather_slots` slots run in key chunks of that many instead (the same
  online softmax as the CPU loop's steps, for all rows at once, up to the last chunk a query
  sees): a few large steps, so the gathered keys and the scores stay bounded at long contexts.
  """
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  kv, f, c, _ = k_pages_kfcd.shape
  s = pages_bm.shape[1] * c
  q_kbqd = _kv_major_queries(q_btnd, kv)
  pages_bm = jnp.clip(pages_bm, 0, f - 1)
  pages = (k_pages_kfcd, v_pages_kfcd, k_scales_kfc, v_scales_kfc)
  if s > gather_slots:
    tables_xbm, per_chunk = _chunked_tables(pages_bm, c, gather_slots)
    return _token_major_output(_attend_rows(q_kbqd, pos_bt, tables_xbm, pages, s,
                                            per_chunk * c, window, cap), q_btnd)

  # the whole table as one chunk: one online-softmax step from the empty carry is the softmax
  (_, sum_kbq, out_kbqd), _ = _chunk_step(q_kbqd, pos_bt, pages, s, window, cap,
                                          _empty_carry(q_kbqd), (pages_bm, 0))
  return _token_major_output(_normalized(out_kbqd, sum_kbq), q_btnd)


TPU_LANES = 128  # head_dim must be a multiple of the TPU's vector lanes
TPU_SUBLANES = 16  # block_size must be a multiple of a bfloat16 tile's rows
TPU_COMPUTE_SLOTS = 512  # most key slots per step of the TPU kernel (pages per compute block)


def tpu_kernel_fits(t: int, head_dim: int, block_size: int, quantized: bool) -> bool:
  """Whether `paged_attention_tpu` serves a call: decode steps (t == 1) of a float pool whose
  head_dim is a multiple of TPU_LANES and block size of TPU_SUBLANES (Mosaic's (16, 128)
  bfloat16 tiles of its page buffers; a bound kept conservative, untried on other shapes)."""
  return (t == 1 and not quantized and head_dim % TPU_LANES == 0
          and block_size % TPU_SUBLANES == 0)


def _largest_divisor_at_most(value: int, limit: int) -> int:
  return max(i for i in range(1, min(value, limit) + 1) if value % i == 0)


@functools.partial(jax.jit, static_argnames=("cap", "interpret"))
def paged_attention_tpu(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc=None,
                        v_scales_kfc=None, cap: float | None = None, *, interpret: bool = False
                        ) -> jax.Array:
  """Decode-step paged attention (t == 1) with JAX's Pallas TPU kernel; output [b, 1, n, d].

  The kernel reads the pool in place (its `k_pages` layout is the pool's) in compute blocks of
  up to TPU_COMPUTE_SLOTS slots (a divisor of the table width), upcasting K and V to bfloat16
  (float32 pools lose precision there; the cache stores bfloat16 on TPU); `cap` soft-caps the
  scores. Raises ValueError for a call `tpu_kernel_fits` rejects, but with interpret=True (Pallas'
  TPU interpret mode on CPU) only for t != 1 and int8 pages.
  """
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  b, t, n, d = q_btnd.shape
  kv, f, c, _ = k_pages_kfcd.shape
  quantized = k_scales_kfc is not None
  if t != 1 or quantized or not (interpret or tpu_kernel_fits(t, d, c, quantized)):
    raise ValueError(f"the TPU kernel serves decode steps of float pools with head_dim a "
                     f"multiple of {TPU_LANES} and block_size of {TPU_SUBLANES}; got {t=} "
                     f"tokens, {d=}, {c=}, pages {k_pages_kfcd.dtype}")
  m = pages_bm.shape[1]
  q_bnd = q_btnd[:, 0] * jnp.asarray(d ** -0.5, q_btnd.dtype)  # the kernel does not scale
  call = functools.partial(
      tpu_paged.paged_attention, q_bnd, decode(k_pages_kfcd), decode(v_pages_kfcd),
      jnp.maximum(pos_bt[:, 0] + 1, 0), jnp.clip(pages_bm, 0, f - 1),
      attn_logits_soft_cap=cap,
      pages_per_compute_block=_largest_divisor_at_most(m, max(1, TPU_COMPUTE_SLOTS // c)))
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      out_bnd = call()
  else:
    out_bnd = call()
  # rows of length 0 (padding) are skipped by the kernel: their output is never written
  return jnp.where(pos_bt[:, 0, None, None] >= 0, out_bnd, 0).astype(q_btnd.dtype)[:, None]


def paged_attention_cpu(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc=None,
                        v_scales_kfc=None) -> jax.Array:
  """Paged attention with the CPU kernels; output [b, t, n, d].

  The kernels (`jaxtier.cpu_kernels`) read each sequence's keys and values in place from the
  pool, so no gathered copy is made: the decode kernel for one query token per row, the prefill
  kernel for more (each row's queries in register tiles against its keys, transposed once per
  row and kv head). Raises RuntimeError where they cannot be built.
  """
  if not cpu_kernels.available():
    raise RuntimeError(f"the CPU attention kernel is unavailable: "
                       f"{cpu_kernels.unavailable_reason()}")
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  b, t, n, d = q_btnd.shape
  f = k_pages_kfcd.shape[1]
  if k_pages_kfcd.dtype == jnp.bfloat16:  # the kernels read bfloat16 as its uint16 bit patterns
    k_pages_kfcd, v_pages_kfcd = (jax.lax.bitcast_convert_type(x, jnp.uint16)
                                  for x in (k_pages_kfcd, v_pages_kfcd))
  q_btnd_scaled = q_btnd.astype(jnp.float32) * jnp.float32(d ** -0.5)
  no_scales = jnp.zeros((1,), SCALE_DTYPE)
  pages = (k_pages_kfcd, v_pages_kfcd, jnp.clip(pages_bm, 0, f - 1))
  scales = (no_scales if k_scales_kfc is None else k_scales_kfc,
            no_scales if v_scales_kfc is None else v_scales_kfc)
  if t == 1:
    out_bnd = jax.ffi.ffi_call(cpu_kernels.ATTENTION_TARGET,
                               jax.ShapeDtypeStruct((b, n, d), jnp.float32),
                               vmap_method="sequential")(
        q_btnd_scaled[:, 0], *pages, pos_bt[:, 0], *scales)
    return out_bnd[:, None].astype(q_btnd.dtype)
  out_btnd = jax.ffi.ffi_call(cpu_kernels.PREFILL_ATTENTION_TARGET,
                              jax.ShapeDtypeStruct((b, t, n, d), jnp.float32),
                              vmap_method="sequential")(q_btnd_scaled, *pages, pos_bt, *scales)
  return out_btnd.astype(q_btnd.dtype)
