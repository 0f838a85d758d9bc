"""Paged attention as a Pallas GPU (Triton) kernel, for decode steps and ragged prefill chunks.

Same semantics, pool layout and shape legend as `jaxtier.attention` (see its module
docstring): key slot `s` of row `b` lives in page `pages_bm[b, s // c]` at offset `s % c` of the
flat pool [k, f, c, d]; a query at position `p` sees slots `0..p`; negative positions are padding
(output 0); negative page ids mark unused table entries and are clamped (never read for a
visible slot). Sliding windows and soft-capping are not implemented here: such layers run the
gathered XLA path (`paged_attention.paged_attention_gathered`).

One kernel family serves decode (t == 1) and prefill chunks (t > 1), and a batch may be ragged
(a decode row padded with -1 positions next to prefill chunks that start mid-sequence).

Grid: (row b, kv head, block of query tokens, split). A program owns the `block_t` query tokens of its
block times the g query heads of its kv head: `rows` = block_t * gp query rows, token major,
where gp is g rounded up to a power of two (3 -> 4; Triton's blocks must be powers of two, and
the padded heads are masked on load and store, never padded in HBM). It reads its positions,
and loops over steps of `pages_per_step` pages (a power-of-two number of slots, >= 16) only up
to the step holding its largest position: a block whose positions are all negative runs no step
and writes zeros. Each step gathers the step's page ids from the row's table, loads those pages'
keys and values in place from the pool (pointer arithmetic; nothing is copied into a dense
array), and updates an online softmax in float32.

Decode calls have few programs (batch 1 with 3 kv heads: 3), too few to keep a GPU's memory
busy, so a decode call also splits each row's steps into up to `num_splits` parts, a fourth grid
axis: each part writes its unnormalized float32 output with its running maximum and sum, and a
small XLA step outside the kernel combines them (flash-decoding). Prefill calls have programs
enough and are not split.

head_dim: the kernel works on `dp` = head_dim rounded up to a power of two (at least 16 on the
dot path) with masked loads and stores, so head_dim 12, 80 or 96 runs on the unpadded pool.

Products, and why two forms: Triton's `tl.dot` needs at least 16 rows. A decode program has only
gp rows (4 for the default model's 3 query heads per kv head), and padding them to 16 would
compute 4x the work in wasted rows. So where `rows` < 16 the scores are an elementwise product
broadcast to [rows, slots, dp] summed over dp, and the output a [rows, slots, dp] product summed
over slots: plain vector arithmetic that Triton allows for any power-of-two shape, and for decode
(memory bound) as fast as the tensor cores would be. Where `rows` >= 16 (prefill, t * gp >= 16)
both products are `plgpu.dot` with float32 accumulation.

Dtypes: pages float32, bfloat16, uint16 (bfloat16 bit patterns, bitcast to bfloat16 inside the
kernel after the load, so no pool-sized conversion runs) or int8 with float32 scales per slot and
kv head. Pages are cast to the query dtype before a dot (as the reference casts its gathered
keys and values), so bfloat16 pages with float32 queries work. INT8 scales are folded into the
scores (k) and into the probabilities (v), as the XLA path does, instead of dequantizing pages.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxtier.attention.reference import check_paged_inputs

MIN_DOT_ROWS = 16  # Triton's tl.dot needs at least 16 rows (and 16 along each other dim)
PREFILL_ROWS = 64  # target query rows (tokens x padded heads) of one prefill program
DOT_SLOTS = 64  # target key slots per step on the dot path
VECTOR_ELEMENTS = 8192  # most elements of one [rows, slots, dp] product on the vector path
MIN_SLOTS = 16  # fewest key slots per step
MAX_SLOTS = 128  # most key slots per step
TARGET_PROGRAMS = 256  # decode programs to aim for (about two per SM of an H100) by splitting
MASKED_SCORE = -1e30  # initial running maximum: finite, so a row with nothing visible stays 0
TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call a Pallas Triton kernel lowers to


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _floor_pow2(x: int) -> int:
  return 1 << max(0, x.bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static block sizes of one call.

  block_t: query tokens per program; gp: query heads per kv head rounded up to a power of two;
  dp: head_dim rounded up to a power of two (>= 16 on the dot path); pages_per_step: pages of one
  inner step (slots per step = pages_per_step * c, a power of two); use_dot: whether the
  products use `plgpu.dot` (rows >= 16) or elementwise products and sums.
  """
  block_t: int
  gp: int
  dp: int
  pages_per_step: int
  use_dot: bool
  num_warps: int

  @property
  def rows(self) -> int:
    return self.block_t * self.gp


def plan(t: int, g: int, c: int, d: int) -> Plan:
  """Block sizes for t query tokens per row, g query heads per kv head, block size c (a power of
  two), head_dim d."""
  if c & (c - 1):
    raise ValueError(f"block size {c} must be a power of two for the Triton kernel")
  gp = _next_pow2(g)
  block_t = 1 if t == 1 else min(_next_pow2(t), max(1, PREFILL_ROWS // gp))
  rows = block_t * gp
  use_dot = rows >= MIN_DOT_ROWS
  dp = max(MIN_DOT_ROWS, _next_pow2(d)) if use_dot else _next_pow2(d)
  if use_dot:
    slots = DOT_SLOTS
  else:
    slots = min(MAX_SLOTS, max(MIN_SLOTS, _floor_pow2(VECTOR_ELEMENTS // (rows * dp))))
  slots = max(slots, c)
  return Plan(block_t=block_t, gp=gp, dp=dp, pages_per_step=slots // c, use_dot=use_dot,
              num_warps=4)


def supports(head_dim: int, block_size: int) -> bool:
  """Whether the kernel serves this shape: any head_dim, power-of-two block sizes."""
  return head_dim > 0 and block_size > 0 and not block_size & (block_size - 1)


def _kernel(q_ref, k_ref, v_ref, k_scales_ref, v_scales_ref, table_ref, pos_ref, o_ref,
            *stats_refs, p: Plan, t: int, g: int, d: int, num_slots: int, num_steps: int,
            splits: int):
  """One (row, kv head, query block, split) program.

  Refs: q_ref [block_t, gp, dp] (of q [b, t, k, g, d]), k_ref / v_ref [f, c, dp] (one kv head's
  pool), scales [f, c] or None, table_ref [steps * pages_per_step] (clamped page ids), pos_ref
  [block_t]. Unsplit, o_ref [block_t, gp, dp] gets the normalized output; split, the program runs
  only its share of the steps and writes its unnormalized float32 output to o_ref and its running
  maximum and sum to stats_refs ([block_t, gp] each), combined by `_combine_splits`.
  """
  c = k_ref.shape[1]
  s = p.pages_per_step * c  # slots per step
  rows = p.rows
  first_token = pl.program_id(2) * p.block_t
  token_t = first_token + jnp.arange(p.block_t)
  token_ok_t = token_t < t
  head_ok_g = jnp.arange(p.gp) < g
  dim_ok_d = jnp.arange(p.dp) < d
  q_mask = token_ok_t[:, None, None] & head_ok_g[None, :, None] & dim_ok_d[None, None, :]
  pos_t = plgpu.load(pos_ref, mask=token_ok_t, other=-1)
  q_td = plgpu.load(q_ref, mask=q_mask, other=0).reshape(rows, p.dp)
  pos_r = jnp.broadcast_to(pos_t[:, None], (p.block_t, p.gp)).reshape(rows)
  compute_dtype = q_ref.dtype
  page_shape = (p.pages_per_step, c, p.dp)
  page_mask = None if d == p.dp else jnp.broadcast_to(dim_ok_d[None, None, :], page_shape)
  offset_pcd = jnp.broadcast_to(jnp.arange(c)[None, :, None], page_shape)
  dim_pcd = jnp.broadcast_to(jnp.arange(p.dp)[None, None, :], page_shape)

  def load_slots(ref, ids):
    """The [slots, dp] keys or values of pages `ids`: a gather of whole pages (all-array indices,
    so the head-dim padding can be masked)."""
    index = (jnp.broadcast_to(ids[:, None, None], page_shape), offset_pcd, dim_pcd)
    x = plgpu.load(ref.at[index], mask=page_mask, other=None if page_mask is None else 0)
    if x.dtype == jnp.uint16:  # bfloat16 bit patterns
      x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.reshape(s, p.dp)

  def step(j, carry):
    max_r, sum_r, acc_rd = carry
    ids = table_ref[pl.ds(j * p.pages_per_step, p.pages_per_step)]
    k_sd = load_slots(k_ref, ids)
    if p.use_dot:
      scores_rs = plgpu.dot(q_td, k_sd.astype(compute_dtype), trans_b=True)
    else:
      scores_rs = jnp.sum(q_td.astype(jnp.float32)[:, None, :] * k_sd.astype(jnp.float32)[None],
                          axis=2)
    if k_scales_ref is not None:
      scores_rs = scores_rs * k_scales_ref[ids].reshape(1, s)
    slot_s = j * s + jnp.arange(s)
    visible_rs = (slot_s[None, :] <= pos_r[:, None]) & (slot_s < num_slots)[None, :]
    scores_rs = jnp.where(visible_rs, scores_rs, -jnp.inf)
    new_max_r = jnp.maximum(max_r, jnp.max(scores_rs, axis=1))
    probs_rs = jnp.exp(scores_rs - new_max_r[:, None])
    rescale_r = jnp.exp(max_r - new_max_r)
    sum_r = sum_r * rescale_r + jnp.sum(probs_rs, axis=1)
    weights_rs = probs_rs
    if v_scales_ref is not None:
      weights_rs = probs_rs * v_scales_ref[ids].reshape(1, s)
    v_sd = load_slots(v_ref, ids)
    if p.use_dot:
      out_rd = plgpu.dot(weights_rs.astype(compute_dtype), v_sd.astype(compute_dtype))
    else:
      out_rd = jnp.sum(weights_rs[:, :, None] * v_sd.astype(jnp.float32)[None], axis=1)
    return new_max_r, sum_r, acc_rd * rescale_r[:, None] + out_rd

  live = jnp.clip((jnp.max(pos_t) + s) // s, 0, num_steps)  # steps up to the last position's
  per_split = -(-num_steps // splits)
  first = pl.program_id(3) * per_split
  init = (jnp.full((rows,), MASKED_SCORE, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, p.dp), jnp.float32))
  max_r, sum_r, acc_rd = jax.lax.fori_loop(first, jnp.minimum(first + per_split, live), step,
                                           init)
  if splits > 1:
    max_ref, sum_ref = stats_refs
    row_mask = token_ok_t[:, None] & head_ok_g[None, :]
    plgpu.store(max_ref, max_r.reshape(p.block_t, p.gp), mask=row_mask)
    plgpu.store(sum_ref, sum_r.reshape(p.block_t, p.gp), mask=row_mask)
  else:
    acc_rd = acc_rd / jnp.where(sum_r > 0, sum_r, 1.0)[:, None]
  plgpu.store(o_ref, acc_rd.reshape(p.block_t, p.gp, p.dp).astype(o_ref.dtype), mask=q_mask)


def num_splits(t: int, programs: int, num_steps: int) -> int:
  """How many parts a decode call splits each row's steps into, so that about TARGET_PROGRAMS
  programs run (batch 1 with 3 kv heads would otherwise run 3); prefill calls are not split."""
  if t > 1:
    return 1
  return max(1, min(num_steps, TARGET_PROGRAMS // programs))


def _combine_splits(out_xbtkgd, max_xbtkg, sum_xbtkg) -> jax.Array:
  """The normalized output [b, t, k, g, d] from each split's unnormalized output, maximum and
  sum (a split that ran no step has maximum MASKED_SCORE and sum 0, so it weighs nothing)."""
  new_max_btkg = jnp.max(max_xbtkg, axis=0)
  rescale_xbtkg = jnp.exp(max_xbtkg - new_max_btkg)
  sum_btkg = jnp.sum(sum_xbtkg * rescale_xbtkg, axis=0)
  out_btkgd = jnp.sum(out_xbtkgd * rescale_xbtkg[..., None], axis=0)
  return out_btkgd / jnp.where(sum_btkg > 0, sum_btkg, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_attention_gpu(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc=None,
                        v_scales_kfc=None, *, interpret: bool = False) -> jax.Array:
  """Paged attention with the Pallas Triton kernel (no window, no cap); output [b, t, n, d].

  `interpret=True` runs the same kernel on the CPU through Pallas interpret mode. Queries are
  scaled by head_dim ** -0.5 here; q is viewed as [b, t, k, g, d] (a free reshape) and the
  output written in that layout, so neither is transposed. The only array made in HBM besides
  the output is each table clamped and padded to whole steps (page 0; masked by position).
  """
  check_paged_inputs(q_btnd, k_pages_kfcd, v_pages_kfcd, pages_bm, pos_bt, k_scales_kfc,
                     v_scales_kfc)
  b, t, n, d = q_btnd.shape
  kv, f, c, _ = k_pages_kfcd.shape
  g = n // kv
  m = pages_bm.shape[1]
  p = plan(t, g, c, d)
  num_steps = -(-m // p.pages_per_step)
  table_bm = jnp.pad(jnp.clip(pages_bm, 0, f - 1), ((0, 0), (0, num_steps * p.pages_per_step - m)))
  q_btkgd = (q_btnd * jnp.asarray(d ** -0.5, q_btnd.dtype)).reshape(b, t, kv, g, d)
  t_blocks = -(-t // p.block_t)
  splits = num_splits(t, b * kv * t_blocks, num_steps)
  kernel = functools.partial(_kernel, p=p, t=t, g=g, d=d, num_slots=m * c, num_steps=num_steps,
                             splits=splits)
  q_spec = pl.BlockSpec((None, p.block_t, None, p.gp, p.dp),
                        lambda bi, hi, ti, xi: (bi, ti, hi, 0, 0))
  page_spec = pl.BlockSpec((None, f, c, p.dp), lambda bi, hi, ti, xi: (hi, 0, 0, 0))
  scale_spec = pl.BlockSpec((None, f, c), lambda bi, hi, ti, xi: (hi, 0, 0))
  if splits == 1:
    out_specs = q_spec
    out_shape = jax.ShapeDtypeStruct(q_btkgd.shape, q_btnd.dtype)
  else:
    out_specs = [
        pl.BlockSpec((None, None, p.block_t, None, p.gp, p.dp),
                     lambda bi, hi, ti, xi: (xi, bi, ti, hi, 0, 0)),
        *[pl.BlockSpec((None, None, p.block_t, None, p.gp),
                       lambda bi, hi, ti, xi: (xi, bi, ti, hi, 0))] * 2]
    out_shape = [jax.ShapeDtypeStruct((splits,) + q_btkgd.shape, jnp.float32),
                 *[jax.ShapeDtypeStruct((splits,) + q_btkgd.shape[:-1], jnp.float32)] * 2]
  out = pl.pallas_call(
      kernel,
      grid=(b, kv, t_blocks, splits),
      in_specs=[
          q_spec, page_spec, page_spec,
          None if k_scales_kfc is None else scale_spec,
          None if v_scales_kfc is None else scale_spec,
          pl.BlockSpec((None, table_bm.shape[1]), lambda bi, hi, ti, xi: (bi, 0)),
          pl.BlockSpec((None, p.block_t), lambda bi, hi, ti, xi: (bi, ti)),
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=2),
      interpret=interpret,
      name=f"paged_attention_t{p.block_t}_g{p.gp}_d{p.dp}_s{p.pages_per_step * c}_x{splits}",
  )(q_btkgd, k_pages_kfcd, v_pages_kfcd, k_scales_kfc, v_scales_kfc, table_bm, pos_bt)
  out_btkgd = out if splits == 1 else _combine_splits(*out)
  return out_btkgd.reshape(b, t, n, d).astype(q_btnd.dtype)
