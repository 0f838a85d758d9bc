"""Scheduling policies: pure functions of sequences, chosen by name in the scheduler config.

A victim policy is a key function over running sequences: the sequence with the smallest key is
swapped out (or recomputed) first. Priority comes before any policy: victims are taken from the least
urgent priority class (the largest `priority` value) first. Every key ends in the arrival order, so
choices never depend on anything but the sequences themselves.
"""

import math
import types
from collections.abc import Callable, Sequence

from jaxtier.scheduler.request import Seq

VictimKey = Callable[[Seq], tuple]


def longest_waiting(seq: Seq) -> tuple:
  """Victim key: the request that arrived first goes first."""
  return (seq.request.arrival_time, seq.order)


def closest_to_finish(seq: Seq) -> tuple:
  """Victim key: the request with the fewest tokens left before max_tokens goes first (the newest on
  ties)."""
  return (seq.request.max_tokens - seq.num_generated, -seq.order)


def shortest_predicted_remaining(seq: Seq) -> tuple:
  """Victim key: the request with the shortest predicted remaining output goes first (the newest on
  ties)."""
  return (max(seq.request.predicted_output - seq.num_generated, 0), -seq.order)


VICTIM_POLICIES: types.MappingProxyType[str, VictimKey] = types.MappingProxyType({
    "longest_waiting": longest_waiting,
    "closest_to_finish": closest_to_finish,
    "shortest_predicted_remaining": shortest_predicted_remaining,
})


def resolve_victim_policy(policy: str | VictimKey) -> VictimKey:
  """Returns the key function for a policy name in VICTIM_POLICIES, or `policy` itself if callable."""
  if callable(policy):
    return policy
  if policy not in VICTIM_POLICIES:
    raise ValueError(f"victim_policy={policy!r}: expected one of {sorted(VICTIM_POLICIES)} or a "
                     "key function Seq -> tuple")
  return VICTIM_POLICIES[policy]


def choose_victim(running: Sequence[Seq], policy: VictimKey) -> int:
  """Returns the index in `running` of the sequence to preempt first."""
  if not running:
    raise ValueError("running is empty: expected at least one sequence to choose a victim from")
  return min(range(len(running)), key=lambda i: (-running[i].request.priority, policy(running[i])))


def queue_key(seq: Seq) -> tuple[int, int]:
  """Order of the waiting and swapped queues: by priority, then oldest first."""
  return (seq.request.priority, seq.order)


def age_key(seq: Seq) -> tuple[float, int]:
  """Order in which swapped requests are aborted when the host pool is full: oldest first."""
  return (seq.request.arrival_time, seq.order)


def kv_link_budget(link_bytes_per_step: int | None, kv_link_share: float) -> float:
  """Returns the bytes per step KV swaps may spend (their high-priority part of the link budget)."""
  if link_bytes_per_step is None:
    return math.inf
  return link_bytes_per_step * kv_link_share


def weight_prefetch_bytes(link_bytes_per_step: int | None, kv_link_share: float,
                          kv_bytes_spent: int, weight_bytes_wanted: int) -> int:
  """Returns the bytes of weight prefetch a step may spend after its KV swaps.

  Weight prefetch is the low-priority part of the link budget: it is capped at its own share and gets
  only what KV swaps left of the whole step's budget.
  """
  if link_bytes_per_step is None:
    return weight_bytes_wanted
  own_share = link_bytes_per_step - math.floor(link_bytes_per_step * kv_link_share)
  left = max(link_bytes_per_step - kv_bytes_spent, 0)
  return min(weight_bytes_wanted, own_share, left)


def link_fields(h2d_bytes_per_s: float | None, step_s: float | None,
                weight_bytes_per_step: int = 0) -> dict[str, int | float | None]:
  """The link fields of a `SchedulerConfig` for a host link of `h2d_bytes_per_s` (host -> device
  bytes per second) under steps whose compute takes `step_s` seconds.

  The rule (one link, one budget): a step's host -> device copies are hidden while they take no
  longer than its compute, so the link moves `link_bytes_per_step = floor(h2d_bytes_per_s *
  step_s)` bytes per step (at least 1). The offloaded tail's weights must arrive every step, so
  they come off the top: KV swap-ins and host-tier prefix loads may spend the rest,
  `kv_link_share = max(0, (link_bytes_per_step - weight_bytes_per_step) / link_bytes_per_step)`
  of it (`kv_link_budget`). With no rate or no step time the budget is unlimited
  (`link_bytes_per_step` None, the whole link for KV).
  """
  if not h2d_bytes_per_s or not step_s or h2d_bytes_per_s <= 0 or step_s <= 0:
    return {"link_bytes_per_step": None, "kv_link_share": 1.0,
            "weight_prefetch_bytes_per_step": weight_bytes_per_step}
  link = max(1, math.floor(h2d_bytes_per_s * step_s))
  return {"link_bytes_per_step": link,
          "kv_link_share": max(0.0, (link - weight_bytes_per_step) / link),
          "weight_prefetch_bytes_per_step": weight_bytes_per_step}


def swap_in_blocks(queue_position: int, num_running: int, waited_steps: int,
                   max_wait_steps: int) -> bool:
  """Whether a swap-in blocks a request, and so may go ahead of weight prefetch: past the step's
  KV link budget, the weights' grant shrinking by what it takes (the step is expected to stall).

  Only the head of the swapped queue (`queue_position` 0, by priority then arrival) ever blocks,
  and only when either
    - nothing else can run: no request runs this step (`num_running` 0; admission waits while
      any request is swapped, so without it the step computes nothing), or
    - the swapped queue has gone `max_wait_steps` steps or more without a swap-in
      (`waited_steps`), so a busy batch cannot hold it back for ever.
  Any other swap-in waits for a step whose budget has room for it.
  """
  return queue_position == 0 and (num_running == 0 or waited_steps >= max_wait_steps)
