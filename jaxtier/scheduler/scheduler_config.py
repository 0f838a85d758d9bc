"""Scheduler configuration: pool sizes, budgets, and the policies to run, by name.

Sizes are in blocks of `block_size` tokens. `jaxtier.common.kv_bytes.kv_block_bytes` turns a model's
shape into `block_bytes`, the bytes of one block, so that byte budgets and simulators can speak in
bytes.
"""

import dataclasses
import math

from jaxtier.common.checks import (check_block_size, check_bool, check_choice, check_int,
                                   check_step_limits, check_watermark)
from jaxtier.scheduler import policies

PREEMPTION_MODES = ("swap", "recompute")
HOST_FULL_FALLBACKS = ("recompute", "abort_oldest")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
  """How one scheduler runs.

  Fields named as an engine argument (`jaxtier.engine.args.EngineArgs`) have that argument's
  meaning and no default here: EngineArgs is where their defaults and ranges are written, and
  whoever builds a scheduler passes them all. The other fields are the scheduler's own.

  Attributes:
    num_device_blocks: blocks in the device KV pool.
    num_host_blocks: blocks in the host KV pool, allocated once up front (0: no swapping possible).
    block_size: tokens per block.
    max_num_seqs: most requests running (holding device KV) at once.
    max_num_batched_tokens: token budget of one step (decodes plus prefill chunks); at least
      max_num_seqs, so every running decode fits in every step.
    watermark: share of device blocks kept free, in [0, 1) (`watermark_block_count` blocks: the
      share of num_device_blocks, rounded up). Running requests are preempted to stay above it and
      new ones admitted only above it; a request running alone may dip into it.
    preemption_mode: "swap" (KV moves to the host pool) or "recompute" (KV is dropped and the request
      prefills again).
    victim_policy: a name in policies.VICTIM_POLICIES, or a key function Seq -> tuple.
    enable_prefix_caching: full prompt blocks are cached by hash and shared by later requests
      whose prompts start with the same tokens (needs the requests' prompt token ids).
    host_prefix_caching: with prefix caching, blocks evicted from the device are written back to the
      host pool (shared with swapped-out requests, which come first), and host hits are loaded back.
    max_blocks_per_request: KV cap of one request, in blocks (None: the whole device pool). A request
      whose prompt_len + max_tokens - 1 tokens need more is rejected when it arrives.
    host_full: in swap mode, what happens to a victim whose KV does not fit in the host pool:
      "recompute" it, or "abort_oldest" swapped requests (the victim included) until it fits.
    prefetch_swap_in: True: a swap-in is planned one step before the request computes, so the engine
      overlaps the copy with that step's compute; False: it computes in the step that swaps it in.
    block_bytes: bytes of one block (see jaxtier.common.kv_bytes.kv_block_bytes); needed for byte
    budgets, 0 if unknown. link_bytes_per_step: bytes the host link moves per step while the step
    computes (None:
      unlimited); `policies.link_fields` derives the link fields from a measured rate.
    kv_link_share: the high-priority part of link_bytes_per_step that KV swap-ins and host-tier
      prefix loads may use; the rest is the low-priority part for weight prefetch. Swap-outs and
      write-backs are never deferred (their bytes still count against the weights' grant).
      Swap-ins stop once the share is spent, except one that blocks a request
      (`policies.swap_in_blocks`), which goes ahead of the weights; a prefix load that does not fit
      loads the blocks that do and recomputes the rest.
    weight_prefetch_bytes_per_step: the weight bytes the offload plan wants to prefetch each step.
    swap_in_max_wait_steps: steps the swapped queue may go without a swap-in before its head blocks
      (`policies.swap_in_blocks`) and swaps in past the KV share.
    disk_tier: a disk tier sits under the host tier (`jaxtier.scheduler.disk_index`): registered blocks
      it lacks are written through, and an arriving request's next blocks after its device and
      host hits are read from it into host blocks. Needs the host tier.
  """
  num_device_blocks: int
  num_host_blocks: int
  block_size: int
  max_num_seqs: int
  max_num_batched_tokens: int
  watermark: float
  preemption_mode: str
  victim_policy: str | policies.VictimKey
  enable_prefix_caching: bool
  host_prefix_caching: bool
  max_blocks_per_request: int | None = None
  host_full: str = "recompute"
  prefetch_swap_in: bool = True
  block_bytes: int = 0
  link_bytes_per_step: int | None = None
  kv_link_share: float = 0.75
  weight_prefetch_bytes_per_step: int = 0
  swap_in_max_wait_steps: int = 8
  disk_tier: bool = False

  def __post_init__(self):
    check_int("num_device_blocks", self.num_device_blocks, 1)
    check_int("num_host_blocks", self.num_host_blocks, 0)
    check_block_size(self.block_size)
    check_step_limits(self.max_num_seqs, self.max_num_batched_tokens)
    check_watermark(self.watermark)
    if self.watermark_block_count >= self.num_device_blocks:
      raise ValueError(f"watermark={self.watermark!r} keeps {self.watermark_block_count} blocks "
                       f"free: expected fewer than num_device_blocks={self.num_device_blocks}")
    if self.max_blocks_per_request is not None:
      check_int("max_blocks_per_request", self.max_blocks_per_request, 1)
    check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
    check_choice("host_full", self.host_full, HOST_FULL_FALLBACKS)
    policies.resolve_victim_policy(self.victim_policy)
    for name in ("prefetch_swap_in", "enable_prefix_caching", "host_prefix_caching", "disk_tier"):
      check_bool(name, getattr(self, name))
    if self.disk_tier and not self.host_tier:
      raise ValueError("disk_tier=True reads blocks from disk into host blocks: expected "
                       "enable_prefix_caching, host_prefix_caching and num_host_blocks > 0, got "
                       f"{self.enable_prefix_caching}, {self.host_prefix_caching} and "
                       f"{self.num_host_blocks}")
    self._check_link()

  def _check_link(self):
    check_int("block_bytes", self.block_bytes, 0)
    check_int("weight_prefetch_bytes_per_step", self.weight_prefetch_bytes_per_step, 0)
    check_int("swap_in_max_wait_steps", self.swap_in_max_wait_steps, 0)
    if not 0.0 <= self.kv_link_share <= 1.0:
      raise ValueError(f"kv_link_share={self.kv_link_share!r}: expected 0 <= x <= 1")
    if self.link_bytes_per_step is not None:
      check_int("link_bytes_per_step", self.link_bytes_per_step, 1)
      if self.block_bytes == 0:
        raise ValueError(f"link_bytes_per_step={self.link_bytes_per_step!r} with block_bytes=0: "
                         "expected block_bytes > 0 so that swaps can be counted in bytes")

  @property
  def watermark_block_count(self) -> int:
    """The watermark in blocks: the `watermark` share of the device pool, rounded up."""
    return math.ceil(self.watermark * self.num_device_blocks)

  @property
  def host_tier(self) -> bool:
    """Whether evicted prefix-cache blocks go to the host pool."""
    return self.enable_prefix_caching and self.host_prefix_caching and self.num_host_blocks > 0

  @property
  def request_block_cap(self) -> int:
    """The most device blocks one request may hold."""
    if self.max_blocks_per_request is None:
      return self.num_device_blocks
    return min(self.max_blocks_per_request, self.num_device_blocks)
