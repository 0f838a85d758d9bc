"""Batched generation on a contiguous KV cache: one prefill, then one jitted decode step per token.

The reference driver the engine is tested against (`LLM.run_batch`). Shapes are padded to buckets
(batch to a power of two, prompt length to a power of two >= 16, cache length to a power of two
>= 128) so a handful of compiled variants serve every request mix. Rows that finish early keep running as padding (negative
positions: no cache writes) until the whole batch is done. Each decode step is dispatched before the
previous step's tokens are read on the host, so host work (stop checks, detokenizing) overlaps
device work; a row that finished is found one step late and its extra token is dropped.

For serving, `on_step` reports each row's new tokens after every model step (with the row's
`Completion` on the step it finishes), and `aborted` lets the caller stop a row between steps.
"""

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtier.common.buckets import pow2_bucket
from jaxtier.engine.outputs import Completion
from jaxtier.kvcache import ContiguousKVCache
from jaxtier.sampling.samplers import SamplingArrays, SamplingParams, sample
from jaxtier.scheduler import Request
from jaxtier.text.detokenize import RequestProgress
from jaxtier.text.tokenizer import Tokenizer


def completion(progress: RequestProgress) -> Completion:
  """The final result of a request's progress."""
  return Completion(tuple(progress.generated), progress.text(), progress.finish_reason)


@dataclasses.dataclass(frozen=True)
class StepUpdate:
  """What one model step added to one row that was still running."""
  index: int  # the row's position in the batch's request list
  new_token_ids: tuple[int, ...]
  completion: Completion | None  # set on the step the row finishes, else None


def _step(graphdef: nnx.GraphDef, state: nnx.State, cache, tokens_bt: jax.Array, pos_bt: jax.Array,
          last_b: jax.Array, sampling: SamplingArrays):
  """Runs the model on new tokens and samples one token per row from position `last_b`."""
  model = nnx.merge(graphdef, state)
  h_bth, cache = model.hidden_states(tokens_bt, pos_bt, cache)
  h_bh = jnp.take_along_axis(h_bth, last_b[:, None, None], axis=1)[:, 0]
  return sample(model.logits(h_bh), sampling), cache


model_step = jax.jit(_step, static_argnames=("graphdef",), donate_argnames=("cache",))
model_step.__doc__ = "`_step` jitted with the graphdef as a static argument (for lowering and export)."


@functools.lru_cache(maxsize=16)
def step_fn(graphdef: nnx.GraphDef):
  """`model_step` with the graph closed over: `(state, cache, tokens, pos, last, sampling)`.

  A static graphdef argument is hashed on every call, which for a model of hundreds of variables
  costs milliseconds per decode step; the closure is hashed once, when it is made.
  """
  return jax.jit(functools.partial(_step, graphdef), donate_argnames=("cache",))


def generate_batch(graphdef: nnx.GraphDef, state: nnx.State, tokenizer: Tokenizer,
                   requests: Sequence[Request], max_model_len: int, cache_dtype,
                   on_token: Callable[[int], None] | None = None,
                   on_step: Callable[[list[StepUpdate]], None] | None = None,
                   aborted: Callable[[int], bool] | None = None) -> list[Completion]:
  """Generates for a batch of requests together; returns one Completion per request.

  Args:
    on_token: called with the step number after each model step's tokens are read.
    on_step: called after each model step (the prefill included) with one `StepUpdate` per row
      that was running before the step.
    aborted: called with a row's index for every running row before each step; True ends the row
      with finish_reason "abort" (no further tokens, no further work on the device).

  Raises ValueError for a request with logit transforms (`SamplingParams.transforms_logits`) or
  `structured_outputs`: this reference applies temperature, top-k, top-p and min-p only.
  """
  transformed = [i for i, r in enumerate(requests) if r.params.transforms_logits]
  if transformed:
    raise ValueError(f"requests {transformed[:5]} have logit transforms (penalties, logit_bias, "
                     "allowed_token_ids, bad_words, min_tokens), which only the engine applies")
  constrained = [i for i, r in enumerate(requests) if r.params.constrained]
  if constrained:
    raise ValueError(f"requests {constrained[:5]} have structured_outputs, which only the engine "
                     "applies")
  config = nnx.merge(graphdef, state).config
  rows = [RequestProgress(r.prompt_token_ids, r.params, tokenizer,
                          min(r.max_tokens, max_model_len - r.prompt_len)) for r in requests]
  n = len(rows)
  b = pow2_bucket(n)
  lens = np.array([r.prompt_len for r in requests] + [1] * (b - n))
  t = pow2_bucket(int(lens.max()), 16)
  total = max(len(row.prompt_ids) + row.limit for row in rows)
  cache = ContiguousKVCache.create(config.num_layers, b, pow2_bucket(max(total, t), 128),
                                   config.num_kv_heads, config.head_dim, cache_dtype)
  tokens = np.zeros((b, t), np.int32)
  pos = np.full((b, t), -1, np.int32)
  for i, r in enumerate(requests):
    tokens[i, :r.prompt_len] = r.prompt_token_ids
    pos[i, :r.prompt_len] = np.arange(r.prompt_len)
  params = [r.params for r in requests] + [SamplingParams(temperature=0)] * (b - n)
  seeds = [r.seed for r in requests] + [0] * (b - n)
  run = step_fn(graphdef)
  pending, cache = run(state, cache, tokens, pos, np.maximum(lens - 1, 0),
                       SamplingArrays.from_params(params, seeds, [0] * b))
  step = 0
  while True:
    step += 1
    if aborted is not None:
      for i, row in enumerate(rows):
        if row.finish_reason is None and aborted(i):
          row.finish_reason = "abort"
    active = np.array([row.finish_reason is None for row in rows] + [False] * (b - n))
    in_flight = None
    if active.any():  # dispatch the next step before reading this one, to overlap host and device
      dec_pos = np.where(active, lens + step - 1, -1).astype(np.int32)[:, None]
      in_flight, cache = run(state, cache, pending.reshape(b, 1), dec_pos, np.zeros(b, np.int32),
                             SamplingArrays.from_params(params, seeds, [step] * b))
    tokens_b = np.asarray(pending)
    updates = []
    for i, row in enumerate(rows):
      if row.finish_reason is None:
        row.append(int(tokens_b[i]))
        if on_step is not None:
          updates.append(StepUpdate(i, (int(tokens_b[i]),),
                                    None if row.finish_reason is None else completion(row)))
    if on_token is not None:
      on_token(step)
    if on_step is not None:
      on_step(updates)
    if in_flight is None or all(row.finish_reason is not None for row in rows):
      break
    pending = in_flight
  return [completion(row) for row in rows]
