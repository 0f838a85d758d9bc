"""jaxtier's scheduler: pure state transitions over plain Python data, no JAX.

    state = initial_state(SchedulerConfig(num_device_blocks=..., num_host_blocks=..., ...))
    state, plan = step(state, [Arrive(Request("a", prompt_len=12, max_tokens=32))])
    # ... the engine executes `plan` (see `Plan`), then:
    state, plan = step(state, [StepFinished(finished=(("a", "stop"),))])

The plan is the whole contract with the device: block ids to copy and the block table of every
sequence that computes. See `transitions` for the engine loop and `planning` for the policy.
"""

from jaxtier.scheduler import allocator, disk_index, policies, prefix
from jaxtier.scheduler.allocator import BlockPool, blocks_for
from jaxtier.scheduler.metrics import Metrics, metrics
from jaxtier.scheduler.planning import schedule
from jaxtier.scheduler.policies import VICTIM_POLICIES
from jaxtier.scheduler.request import Ended, Request, Seq
from jaxtier.scheduler.scheduler_config import SchedulerConfig
from jaxtier.scheduler.disk_index import disk_lookup
from jaxtier.scheduler.state import (Abort, Arrive, ComputeBatch, DiskIndexed, DiskLoaded, Plan,
                                     Rates, Release, SchedulerState, StepFinished, Stop,
                                     initial_state)
from jaxtier.scheduler.transitions import apply_event, reset_prefix_cache, step

__all__ = [
    "Abort", "Arrive", "BlockPool", "ComputeBatch", "DiskIndexed", "DiskLoaded", "Ended", "Metrics", "Plan", "Rates", "Release",
    "Request",
    "SchedulerConfig", "SchedulerState", "Seq", "StepFinished", "Stop", "VICTIM_POLICIES",
    "apply_event",
    "blocks_for", "disk_lookup", "initial_state", "metrics", "reset_prefix_cache", "schedule", "step",
]
