"""`schedule(state) -> (state, plan)`: decide the next step, then book its blocks.

One step is decided in four phases over block counts, then booked in one allocator update per pool:
  1. Running requests: every decode computes one token; prefills take chunks of the token budget that
     fit above the watermark. If no running request could compute anything, the first one in running
     order gets a chunk anyway, so a step never stalls.
  2. Preemption: while the step would leave fewer than `watermark_block_count` device blocks free
     and more than one request runs, the victim policy picks a running request to swap out (or
     recompute).
  3. Swap-in: only in a step that preempted nothing, swapped requests come back in queue order while
     they fit above the watermark (or fit at all, when nothing runs) and the KV link share allows;
     only a swap-in that blocks a request (`policies.swap_in_blocks`) may pass the share.
  4. Admission: only when nothing is left swapped, waiting requests start in queue order while their
     first chunk fits above the watermark (or fits at all, when nothing runs). The first that does not
     fit stops admission, so a long request is not starved by shorter ones behind it. Held requests
     (`SchedulerState.held`: their grammar is compiling) are passed over, keeping their place.

With prefix caching, unreferenced cached device blocks count as free (booking evicts them when the
pool runs short), and an admitted request starts after its longest cached prefix: device hits are
shared at once; host hits are loaded into new device blocks like a swap-in (planned one step before
the request computes when swap-ins are prefetched), unless the measured rates say recomputing them
is cheaper, or the KV link share has no room for them (the hits that fit are loaded, the rest
recomputed). A hit never covers the prompt's last token, whose logits the first step needs.
"""

from jaxtier.scheduler import allocator
from jaxtier.scheduler import booking
from jaxtier.scheduler import policies
from jaxtier.scheduler import prefix
from jaxtier.scheduler.booking import Choice, Decision, Preemption
from jaxtier.scheduler.request import Seq
from jaxtier.scheduler.scheduler_config import PREEMPTION_MODES, SchedulerConfig
from jaxtier.scheduler.state import Plan, Rates, SchedulerState

_NOTHING = Choice((), (), ())


def schedule(state: SchedulerState) -> tuple[SchedulerState, Plan]:
  """Plans the next step and returns the state as it will be once the plan is executed.

  Raises:
    ValueError: a plan is still in flight (send its StepFinished first).
  """
  if state.in_flight is not None:
    raise ValueError(f"plan {state.in_flight.step} is in flight: expected its StepFinished before "
                     "the next schedule")
  return booking.book(state, decide(state))


def decide(state: SchedulerState) -> Decision:
  """Decides the next step in block counts; `booking.book` turns it into block ids."""
  config = state.config
  free = state.device.num_free + state.device_cache.num_evictable
  tokens, growth = _running_tokens(state.running, free, config)
  preemption = _preempt(config, state, free, tokens, growth)
  swap_in = admit = _NOTHING
  if not (preemption.swap_out or preemption.recompute or preemption.victim_aborted):
    budget = config.max_num_batched_tokens - sum(preemption.kept_tokens)
    num_running = len(preemption.kept)
    swap_in, free, budget, spent = _swap_in(config, preemption.swapped, num_running,
                                            preemption.free, budget, state.swap_wait_steps)
    if len(swap_in.seqs) == len(preemption.swapped):
      admit = _admit(config, state, num_running + len(swap_in.seqs), free, budget, spent)
  return Decision(preemption, swap_in, admit)


def _running_tokens(running: tuple[Seq, ...], free: int, config: SchedulerConfig
                    ) -> tuple[list[int], list[int]]:
  """Returns the tokens each running request computes this step and the blocks it grows by."""
  block_size = config.block_size
  tokens = [0] * len(running)
  growth = [0] * len(running)
  # The hot loop of a step: Seq.is_decoding and _growth, inlined for one token.
  for i, seq in enumerate(running):
    computed = seq.num_computed
    if seq.num_generated and computed + 1 == seq.request.prompt_len + seq.num_generated:
      tokens[i] = 1
      if computed >= len(seq.blocks) * block_size:
        growth[i] = 1
  budget = config.max_num_batched_tokens - sum(tokens)
  room = free - config.watermark_block_count - sum(growth)
  if budget and len(running) > sum(tokens):
    for i, seq in enumerate(running):
      if tokens[i] or budget == 0:
        continue
      fits = (len(seq.blocks) + max(room, 0)) * block_size - seq.num_computed
      tokens[i] = min(seq.num_uncomputed, budget, fits)
      growth[i] = _growth(seq, tokens[i], block_size)
      room -= growth[i]
      budget -= tokens[i]
  if running and not any(tokens):
    seq = running[0]
    fits = (len(seq.blocks) + free) * block_size - seq.num_computed
    tokens[0] = min(seq.num_uncomputed, config.max_num_batched_tokens, max(fits, 1))
    growth[0] = _growth(seq, tokens[0], block_size)
  return tokens, growth


def _growth(seq: Seq, num_tokens: int, block_size: int) -> int:
  return max(allocator.blocks_for(seq.num_computed + num_tokens, block_size) - len(seq.blocks), 0)


def _preempt(config: SchedulerConfig, state: SchedulerState, free: int, tokens: list[int],
             growth: list[int]) -> Preemption:
  """Preempts running requests until the step stays above the watermark or one request is left."""
  free -= sum(growth)
  if free >= config.watermark_block_count or len(state.running) <= 1:
    return Preemption(state.running, tuple(tokens), tuple(growth), (), (), (), (), state.swapped,
                      free)
  victim_key = policies.resolve_victim_policy(config.victim_policy)
  kept = list(zip(state.running, tokens, growth))
  host_free = state.host.num_free + state.host_cache.num_evictable  # swapped requests come first
  swapped = state.swapped
  fates = {fate: [] for fate in PREEMPTION_MODES + ("abort",)}
  host_aborted = []
  while free < config.watermark_block_count and len(kept) > 1:
    victim, _, victim_growth = kept.pop(policies.choose_victim([k[0] for k in kept], victim_key))
    free += victim_growth + prefix.freeable(state.device_cache, victim.blocks)
    fate, host_free, swapped, aborted = _evict(config, victim, host_free, swapped)
    fates[fate].append(victim)
    host_aborted.extend(seq for seq in aborted if seq is not victim)
  assert free >= 0, "a request running alone always fits: its KV is capped at the device pool"
  return Preemption(tuple(k[0] for k in kept), tuple(k[1] for k in kept),
                    tuple(k[2] for k in kept), tuple(fates["swap"]), tuple(fates["recompute"]),
                    tuple(fates["abort"]), tuple(host_aborted), swapped, free)


def _evict(config: SchedulerConfig, victim: Seq, host_free: int, swapped: tuple[Seq, ...]
           ) -> tuple[str, int, tuple[Seq, ...], tuple[Seq, ...]]:
  """Decides what happens to a victim: "swap", "recompute" or "abort" (host full).

  Returns the fate, the host blocks left free, the swapped requests left, and the requests aborted
  to make room (the victim among them when its fate is "abort").
  """
  need = len(victim.blocks)
  if config.preemption_mode == "recompute":
    return "recompute", host_free, swapped, ()
  if need <= host_free:
    return "swap", host_free - need, swapped, ()
  if config.host_full == "recompute":
    return "recompute", host_free, swapped, ()
  aborted = []
  for candidate in sorted(swapped + (victim,), key=policies.age_key):
    aborted.append(candidate)
    if candidate is victim:
      return "abort", host_free, _without(swapped, aborted), tuple(aborted)
    host_free += len(candidate.blocks)
    if need <= host_free:
      return "swap", host_free - need, _without(swapped, aborted), tuple(aborted)
  raise AssertionError("unreachable: the victim is among the candidates")


def _without(seqs: tuple[Seq, ...], removed: list[Seq]) -> tuple[Seq, ...]:
  removed_ids = {seq.request_id for seq in removed}
  return tuple(seq for seq in seqs if seq.request_id not in removed_ids)


def _fits(free: int, blocks: int, config: SchedulerConfig, num_running: int) -> bool:
  """Whether `blocks` more device blocks fit above the watermark, or at all when nothing runs."""
  if num_running == 0:
    return blocks <= free
  return free - blocks >= config.watermark_block_count


def _swap_in(config: SchedulerConfig, swapped: tuple[Seq, ...], num_running: int, free: int,
             budget: int, waited_steps: int = 0) -> tuple[Choice, int, int, int]:
  """Brings swapped requests back in queue order while blocks and the KV link share allow; one
  that blocks a request (`policies.swap_in_blocks`) goes past the share.

  Returns the choice, the device blocks and tokens left, and the link bytes spent.
  """
  link_budget = policies.kv_link_budget(config.link_bytes_per_step, config.kv_link_share)
  block_size = config.block_size
  spent = 0
  seqs, tokens, blocks = [], [], []
  for seq in swapped:
    if num_running + len(seqs) >= config.max_num_seqs:
      break
    num_tokens = 0 if config.prefetch_swap_in else min(seq.num_uncomputed, budget)
    book = len(seq.blocks) + _growth(seq, num_tokens, block_size)
    # A prefetched request computes next step: keep room for that step's first block too.
    reserve = _growth(seq, 1, block_size) if config.prefetch_swap_in else 0
    cost = len(seq.blocks) * config.block_bytes
    if not _fits(free, book + reserve, config, num_running + len(seqs)):
      break
    if spent + cost > link_budget and not (spent == 0 and policies.swap_in_blocks(
        len(seqs), num_running, waited_steps, config.swap_in_max_wait_steps)):
      break
    seqs.append(seq)
    tokens.append(num_tokens)
    blocks.append(book)
    free -= book + reserve
    budget -= num_tokens
    spent += cost
  return Choice(tuple(seqs), tuple(tokens), tuple(blocks)), free, budget, spent


def _admit(config: SchedulerConfig, state: SchedulerState, num_running: int, free: int,
           budget: int, spent: int) -> Choice:
  """Starts waiting requests in queue order while their first chunk fits (after their hits)."""
  block_size = config.block_size
  link_budget = policies.kv_link_budget(config.link_bytes_per_step, config.kv_link_share)
  device_cache, host_cache = state.device_cache, state.host_cache
  pinned: set[int] = set()  # unreferenced cached blocks that requests admitted here will share
  seqs, tokens, blocks, device_hits, host_hits, passed = [], [], [], [], [], []
  for seq in state.waiting:
    if num_running + len(seqs) >= config.max_num_seqs or budget == 0:
      break
    if seq.request.request_id in state.held:
      continue
    on_device = on_host = skipped = 0
    shared: tuple[int, ...] = ()
    if seq.hashes and not seq.request.skip_prefix_cache:
      usable = seq.hashes[:(seq.seq_len - 1) // block_size]
      on_device = prefix.num_hits(device_cache, usable)
      shared = tuple(b for b in prefix.hit_blocks(device_cache, usable[:on_device])
                     if not device_cache.refcount(b) and b not in pinned)
      if config.host_tier:
        found = prefix.num_hits(host_cache, usable, on_device)
        on_host = _loadable(found, link_budget - spent, config.block_bytes)
        if on_host and not _load_pays(state.rates, on_host, config):
          on_host = 0
        skipped = found - on_host
    computed = (on_device + on_host) * block_size
    load = on_host and config.prefetch_swap_in  # copy this step, compute from the next
    num_tokens = 0 if load else min(seq.seq_len - computed, budget)
    book = allocator.blocks_for(computed + num_tokens, block_size) - on_device
    reserve = 1 if load else 0  # room for the next step's first computed block
    if not _fits(free, book + reserve + len(shared), config, num_running + len(seqs)):
      break
    seqs.append(seq)
    tokens.append(num_tokens)
    blocks.append(book)
    device_hits.append(on_device)
    host_hits.append(on_host)
    passed.append(skipped)
    pinned.update(shared)
    free -= book + reserve + len(shared)
    budget -= num_tokens
    spent += on_host * config.block_bytes
  return Choice(tuple(seqs), tuple(tokens), tuple(blocks), tuple(device_hits), tuple(host_hits),
                tuple(passed))


def _loadable(hits: int, room: float, block_bytes: int) -> int:
  """How many of `hits` host-tier blocks fit in `room` bytes of the KV link share."""
  if hits == 0 or room == float("inf") or block_bytes == 0:
    return hits
  return max(0, min(hits, int(room // block_bytes)))


def _load_pays(rates: Rates | None, num_blocks: int, config: SchedulerConfig) -> bool:
  """Whether loading `num_blocks` host-tier blocks is faster than recomputing them."""
  if rates is None:
    return True
  load = rates.swap_latency_s + num_blocks * config.block_bytes / rates.link_bytes_per_s
  return load < num_blocks * config.block_size / rates.prefill_tokens_per_s
