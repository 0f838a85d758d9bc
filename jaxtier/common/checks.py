"""Argument checks shared by every layer: ints, numbers, choices, and the offload arguments.

One set of validators, so that a bad value reads the same wherever it is caught
(`name=value: expected ...`): the engine's arguments, the scheduler's configuration and requests,
the offload planner and the prefetching scan all raise through these. A leaf module (standard
library only, no JAX): `jaxtier.engine.args` and `jaxtier.scheduler` import it and must load
without JAX, and `jaxtier.offload`, a lower layer than the engine arguments, takes the offload
arguments' bounds from here rather than from `engine_args`.
"""

import numbers
from typing import Any

# The deepest prefetch queue of the offloaded layers (`jaxtier.offload.prefetch.MAX_DEPTH`).
MAX_PREFETCH_DEPTH = 4
MAX_BLOCK_SIZE = 1024  # tokens per KV block
MAX_NUM_SEQS = 4096  # requests running at once


def is_int(value) -> bool:
  """True for an integer (Python's or numpy's) that is not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
  """True for a real number (Python's or numpy's) that is not a bool and not NaN."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def check_int(name: str, value, low: int | None = None, high: int | None = None,
              optional: bool = False) -> None:
  """Raises ValueError naming `name` unless `value` is an int in [low, high] (None if optional).

  A bound left None is not checked; with neither, any int passes ("expected an int").
  """
  if optional and value is None:
    return
  if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
    if low is None and high is None:
      expected = ""
    elif high is None:
      expected = f" >= {low}"
    elif low is None:
      expected = f" <= {high}"
    else:
      expected = f" in [{low}, {high}]"
    raise ValueError(f"{name}={value!r}: expected an int{expected}"
                     + (" or None" if optional else ""))


def check_positive(name: str, value, optional: bool = True, zero: bool = False) -> None:
  """Raises ValueError unless `value` is a number > 0 (>= 0 with `zero`), or None if optional."""
  if optional and value is None:
    return
  if not is_number(value) or value < 0 or (value == 0 and not zero):
    raise ValueError(f"{name}={value!r}: expected a number {'>= 0' if zero else '> 0'}"
                     + (" or None" if optional else ""))


def check_choice(name: str, value, choices) -> None:
  """Raises ValueError naming `name` and the choices unless `value` is one of them."""
  if value not in choices:
    raise ValueError(f"{name}={value!r}: expected one of {tuple(choices)}")


def check_bool(name: str, value) -> None:
  """Raises ValueError naming `name` unless `value` is True or False."""
  if not isinstance(value, bool):
    raise ValueError(f"{name}={value!r}: expected True or False")


# The checks of the engine arguments that the inner configs hold too (`EngineArgs`, the
# scheduler's `SchedulerConfig`, the paged cache's `PagedCacheConfig`): each config built on its
# own checks them with these, as the arguments are.


def check_block_size(block_size) -> None:
  check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)


def check_step_limits(max_num_seqs, max_num_batched_tokens, optional: bool = False) -> None:
  """Most requests running at once, and the tokens of one step (at least one per request; None
  where `optional`: the default)."""
  check_int("max_num_seqs", max_num_seqs, 1, MAX_NUM_SEQS)
  check_int("max_num_batched_tokens", max_num_batched_tokens, max_num_seqs, optional=optional)


def check_watermark(watermark) -> None:
  """The share of device KV blocks kept free: a number in [0, 1)."""
  if not is_number(watermark) or not 0 <= watermark < 1:
    raise ValueError(f"watermark={watermark!r}: expected a number in [0, 1)")


def int_or_auto(name: str, value: Any, low: int, high: int | None = None) -> int | str:
  """`value` (an int, "auto", or digits as flags give them) as an int in range, or "auto"."""
  if value == "auto":
    return value
  if isinstance(value, str):
    try:
      value = int(value)
    except ValueError:
      pass
  if not is_int(value) or value < low or (high is not None and value > high):
    expected = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name}={value!r}: expected 'auto' or an int {expected}")
  return value


def check_offload(offload_tail_layers, prefetch_depth, num_layers: int | None = None) -> None:
  """The one validation of the offload arguments; with `num_layers`, also their upper bounds."""
  int_or_auto("offload_tail_layers", offload_tail_layers, 0, num_layers)
  int_or_auto("prefetch_depth", prefetch_depth, 1, MAX_PREFETCH_DEPTH)
  if num_layers is not None and is_int(offload_tail_layers) and is_int(prefetch_depth) \
      and offload_tail_layers:
    check_prefetch_depth(prefetch_depth, offload_tail_layers)


def check_prefetch_depth(depth, offloaded: int) -> int:
  """`depth` if it is an int in [1, min(MAX_PREFETCH_DEPTH, offloaded)], else ValueError."""
  check_int("prefetch_depth", depth, 1, MAX_PREFETCH_DEPTH)
  if depth > offloaded:
    raise ValueError(f"prefetch_depth={depth} is more than the {offloaded} offloaded layer(s); "
                     f"expected prefetch_depth <= {offloaded}")
  return depth


def check_prompt_ids(ids, vocab_size: int, max_model_len: int, label: str) -> tuple[int, ...]:
  """A prompt's token ids as a tuple, or ValueError naming `label` ("prompt 3", "request 'a''s
  prompt"): the one check of a tokenized prompt, whether `jaxtier.LLM` checks a whole batch before
  it runs any of it or the engine checks a request as it arrives. The prompt must be non-empty,
  in the vocabulary, and leave room for one generated token in max_model_len."""
  ids = tuple(int(t) for t in ids)
  if not ids:
    raise ValueError(f"{label} is empty: an empty prompt leaves nothing to continue")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"{label} has token ids outside [0, {vocab_size}): {bad[:5]}")
  if len(ids) >= max_model_len:
    raise ValueError(f"{label} has {len(ids)} tokens; the context window max_model_len is "
                     f"{max_model_len} and at least one token must be generated")
  return ids
