"""The host link as the engine sees it: its measured rates, the scheduler's link budget, and each
step's overlap of link traffic with compute.

One link, one budget. The engine measures the link once per process and platform at start-up
(`measured_rates`: a few MB each way, host -> device and device -> host) and derives the
scheduler's link fields from the host -> device rate (`scheduler.policies.link_fields`): a step
moves `h2d_bytes_per_s * step_s` bytes while it computes, the offloaded tail's weights come off
the top, and KV swap-ins and host-tier prefix loads share the rest. `step_s`
(`budget_step_seconds`) is, in order:
  1. the offload planner's predicted compute seconds of one step, where the engine has a planned
     offloaded tail (`Tail.compute_step_s`);
  2. else the median wall seconds of the last `STEP_WINDOW` compute-only steps (decode calls with
     no KV copy of any kind), measured by the engine as it runs (its `LinkBudget`);
  3. else none: the budget is unlimited until the first such step is measured.

The budget applies off CPU only (`budget_applies`): on a CPU host and device are one memory, a
"swap" is a memory copy that no weight stream competes with, and a budget there would only make
the schedule depend on how long steps happened to take. The rates are still measured and the
overlap figures still counted there.

Overlap figures (`step_link`): each step's bytes per tier (`TIERS`), the link seconds they take
(one copy after another: measured seconds per block of the swap programs, `SwapTimer`, where
that direction has been timed, else bytes over the measured rate; weight prefetch always at the
measured host -> device rate), and the step's compute seconds, which are modeled, not measured:
the budget's `step_s`, or where there is none yet the step's own wall seconds. The part of the
link seconds within the compute seconds is hidden; the rest is a stall.
"""

import dataclasses
import statistics
from collections.abc import Sequence

import jax
from absl import logging

from jaxtier import scheduler
from jaxtier.offload import measure

TIERS = ("swap_in", "swap_out", "prefix_load", "prefix_writeback", "weight_prefetch")
H2D_TIERS = ("swap_in", "prefix_load", "weight_prefetch")  # host -> device; the rest go back
STEP_WINDOW = 16  # compute-only steps whose median sets the budget's step seconds
RELINK_TOLERANCE = 0.125  # relative change of link_bytes_per_step that updates the scheduler
MEASURE_BYTES = 4 << 20
MEASURE_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class LinkRates:
  """The host link's measured bandwidth in bytes per second, each way (None: not measured)."""
  h2d_bytes_per_s: float | None
  d2h_bytes_per_s: float | None


_MEASURED: dict[str, LinkRates] = {}  # by platform and device kind: one measurement per process


def measured_rates() -> LinkRates:
  """The link's rates on this process's first local device, measured on the first call for its
  platform (`MEASURE_BYTES` each way, the median of `MEASURE_REPEATS` copies) and cached. A
  platform that cannot copy to pinned host memory gives LinkRates(None, None)."""
  device = jax.local_devices()[0]
  key = f"{device.platform}:{device.device_kind}"
  if key not in _MEASURED:
    try:
      _MEASURED[key] = LinkRates(measure.link_bytes_per_s(MEASURE_BYTES, MEASURE_REPEATS, device),
                                 measure.d2h_bytes_per_s(MEASURE_BYTES, MEASURE_REPEATS, device))
    except Exception as error:  # pylint: disable=broad-except  (no pinned host memory: no budget)
      logging.warning("could not measure the host link (%s): its budget is unlimited", error)
      _MEASURED[key] = LinkRates(None, None)
  return _MEASURED[key]


def budget_applies(platform: str) -> bool:
  """Whether an engine on `platform` schedules under a link budget (see the module docstring):
  everywhere but on a CPU."""
  return platform != "cpu"


@dataclasses.dataclass(frozen=True)
class Tail:
  """The offloaded tail as the link sees it.

  Attributes:
    weight_bytes_per_step: weight bytes streamed from pinned host memory every step.
    compute_step_s: the offload planner's predicted compute seconds of one step (None: no plan).
  """
  weight_bytes_per_step: int = 0
  compute_step_s: float | None = None


NO_TAIL = Tail()


def budget_step_seconds(tail: Tail, compute_only_s: Sequence[float]) -> float | None:
  """The step seconds the link budget assumes (see the module docstring): the tail's planned
  compute step, else the median of the measured compute-only steps, else None."""
  if tail.compute_step_s:
    return tail.compute_step_s
  if compute_only_s:
    return statistics.median(compute_only_s)
  return None


def relink(state: scheduler.SchedulerState, fields: dict) -> scheduler.SchedulerState:
  """`state` with its config's link fields replaced by `fields` when they changed enough: a
  budget appearing or going, or `link_bytes_per_step` moving by more than RELINK_TOLERANCE of
  its value (steps' times jitter; the scheduler need not follow every one)."""
  config = state.config
  old, new = config.link_bytes_per_step, fields["link_bytes_per_step"]
  same = (old == new or (old is not None and new is not None
                         and abs(new - old) <= RELINK_TOLERANCE * old))
  if same and config.weight_prefetch_bytes_per_step == fields["weight_prefetch_bytes_per_step"]:
    return state
  return dataclasses.replace(state, config=dataclasses.replace(config, **fields))


def is_compute_only(plan: scheduler.Plan) -> bool:
  """Whether `plan` only decodes: no prefill and no KV copy (its wall time is compute)."""
  return bool(len(plan.decode) and not len(plan.prefill) and not plan.swap_out
              and not plan.swap_in and not plan.prefetch and not plan.writeback)


def step_bytes(plan: scheduler.Plan, block_bytes: int, weight_bytes: int) -> dict[str, int]:
  """The bytes `plan` moves over the link, by tier (`TIERS`)."""
  copied_in = len(plan.swap_in) + len(plan.prefetch)
  return {"swap_in": (copied_in - plan.cache_loads) * block_bytes,
          "swap_out": len(plan.swap_out) * block_bytes,
          "prefix_load": plan.cache_loads * block_bytes,
          "prefix_writeback": len(plan.writeback) * block_bytes,
          "weight_prefetch": weight_bytes}


@dataclasses.dataclass(frozen=True)
class StepLink:
  """One step's link traffic and its overlap with compute.

  Attributes:
    bytes: bytes moved, by tier (`TIERS`).
    link_s: seconds the link takes for them (copies one after another).
    compute_s: the step's compute seconds (modeled: see the module docstring).
    hidden_s: min(link_s, compute_s), the link time the compute hides.
    stall_s: max(0, link_s - compute_s), the link time beyond it.
  """
  bytes: dict[str, int]
  link_s: float
  compute_s: float
  hidden_s: float
  stall_s: float


def step_link(moved: dict[str, int], block_bytes: int, rates: LinkRates, compute_s: float,
              block_seconds: dict[str, float | None]) -> StepLink:
  """The overlap of one step that moves `moved` (`step_bytes`) under `compute_s` seconds of
  compute. `block_seconds`: measured seconds per block of the swap programs by direction
  ("in", "out"; None where that direction is not timed yet); a tier with neither a timing nor a
  rate adds no seconds."""
  link_s = 0.0
  for tier, nbytes in moved.items():
    if not nbytes:
      continue
    h2d = tier in H2D_TIERS
    per_block = None if tier == "weight_prefetch" else block_seconds.get("in" if h2d else "out")
    rate = rates.h2d_bytes_per_s if h2d else rates.d2h_bytes_per_s
    if per_block is not None and block_bytes:
      link_s += nbytes / block_bytes * per_block
    elif rate:
      link_s += nbytes / rate
  compute_s = max(compute_s, 0.0)
  return StepLink(dict(moved), link_s, compute_s, min(link_s, compute_s),
                  max(0.0, link_s - compute_s))


@dataclasses.dataclass(frozen=True)
class LinkBudget:
  """What an engine's link budget follows: the measured rates, its offloaded tail, whether a
  budget applies (`budget_applies`), and the wall seconds of its last `STEP_WINDOW` compute-only
  steps (`observed`).

  Attributes:
    rates: the link's measured rates.
    tail: the offloaded tail's weight bytes per step and planned compute seconds.
    applies: whether the scheduler runs under the budget (else it is unlimited).
    compute_only_s: the wall seconds of the last compute-only steps, oldest first.
  """
  rates: LinkRates
  tail: Tail
  applies: bool
  compute_only_s: tuple[float, ...] = ()

  @classmethod
  def measured(cls, platform: str, tail: Tail) -> "LinkBudget":
    """The budget of an engine on `platform` with `tail`, at the link's measured rates
    (`measured_rates`), before any step."""
    return cls(measured_rates(), tail, budget_applies(platform))

  @property
  def step_seconds(self) -> float | None:
    """The step seconds the budget assumes (`budget_step_seconds`)."""
    return budget_step_seconds(self.tail, self.compute_only_s)

  def fields(self) -> dict:
    """The scheduler's link fields for the measured host -> device rate and `step_seconds`
    (`scheduler.policies.link_fields`); unlimited where no budget applies."""
    return scheduler.policies.link_fields(self.rates.h2d_bytes_per_s if self.applies else None,
                                          self.step_seconds, self.tail.weight_bytes_per_step)

  def observed(self, plan: scheduler.Plan, seconds: float) -> "LinkBudget":
    """This budget after a step of `plan` that took `seconds`: counted in the window when it is
    compute-only (`is_compute_only`)."""
    if not is_compute_only(plan):
      return self
    window = (self.compute_only_s + (seconds,))[-STEP_WINDOW:]
    return dataclasses.replace(self, compute_only_s=window)

  def overlap(self, plan: scheduler.Plan, seconds: float, block_bytes: int,
              swap_seconds: dict[str, float], swap_blocks: dict[str, int]) -> StepLink:
    """`plan`'s link traffic and its overlap with the step's modeled compute (`step_seconds`,
    else the step's wall `seconds`), at the swap programs' measured seconds per block where they
    have been timed (`swap_seconds` over `swap_blocks`, by direction), else at the rates."""
    per_block = {d: swap_seconds[d] / swap_blocks[d] if swap_blocks[d] else None
                 for d in ("in", "out")}
    compute_s = self.step_seconds
    return step_link(step_bytes(plan, block_bytes, self.tail.weight_bytes_per_step), block_bytes,
                     self.rates, seconds if compute_s is None else compute_s, per_block)

  def settings(self, config: scheduler.SchedulerConfig) -> dict:
    """The measured rates and the budget a scheduler of `config` runs under, as `Engine.stats()`
    names them."""
    budget = scheduler.policies.kv_link_budget(config.link_bytes_per_step, config.kv_link_share)
    return {
        "link_h2d_bytes_per_s": self.rates.h2d_bytes_per_s,
        "link_d2h_bytes_per_s": self.rates.d2h_bytes_per_s,
        "link_step_seconds": self.step_seconds,
        "link_budget_bytes_per_step": config.link_bytes_per_step,
        "kv_link_budget_bytes_per_step": None if budget == float("inf") else int(budget),
        "weight_prefetch_bytes_per_step": config.weight_prefetch_bytes_per_step,
    }
