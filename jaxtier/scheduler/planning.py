"""`schedule(state) -> (state, plan)`: decide the next step, then book its blocks.

One step is decided in four phases over block counts, then booked in one allocator update per pool:
  1. Running requests: every decode computes one token; prefills take chunks of the token budget that
     fit above the watermark. If no running request could compute anything, the first one in running
     order gets a chunk anyway, so a step never stalls.
  2. Preemption: while the step would leave fewer than `watermark` device blocks free and more than
     one request runs, the victim policy picks a running request to swap out (or recompute).
  3. Swap-in: only in a step that preempted nothing, swapped requests come back in queue order while
     they fit above the watermark (or fit at all, when nothing runs) and the KV link share allows.
  4. Admission: only when nothing is left swapped, waiting requests start in queue order while their
     first chunk fits above the watermark (or fits at all, when nothing runs). The first that does not
     fit stops admission, so a long request is not starved by shorter ones behind it.
"""

from jaxtier.scheduler import allocator
from jaxtier.scheduler import booking
from jaxtier.scheduler import policies
from jaxtier.scheduler.booking import Choice, Decision, Preemption
from jaxtier.scheduler.config import SchedulerConfig
from jaxtier.scheduler.request import Seq
from jaxtier.scheduler.state import Plan, SchedulerState

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
  tokens, growth = _running_tokens(state.running, state.device.num_free, config)
  preemption = _preempt(config, state, tokens, growth)
  swap_in = admit = _NOTHING
  if not (preemption.swap_out or preemption.recompute or preemption.victim_aborted):
    budget = config.max_tokens_per_step - sum(preemption.kept_tokens)
    num_running = len(preemption.kept)
    swap_in, free, budget = _swap_in(config, preemption.swapped, num_running, preemption.free,
                                     budget)
    if len(swap_in.seqs) == len(preemption.swapped):
      admit = _admit(config, state.waiting, num_running + len(swap_in.seqs), free, budget)
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
  budget = config.max_tokens_per_step - sum(tokens)
  room = free - config.watermark - sum(growth)
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
    tokens[0] = min(seq.num_uncomputed, config.max_tokens_per_step, max(fits, 1))
    growth[0] = _growth(seq, tokens[0], block_size)
  return tokens, growth


def _growth(seq: Seq, num_tokens: int, block_size: int) -> int:
  return max(allocator.blocks_for(seq.num_computed + num_tokens, block_size) - len(seq.blocks), 0)


def _preempt(config: SchedulerConfig, state: SchedulerState, tokens: list[int], growth: list[int]
             ) -> Preemption:
  """Preempts running requests until the step stays above the watermark or one request is left."""
  free = state.device.num_free - sum(growth)
  if free >= config.watermark or len(state.running) <= 1:
    return Preemption(state.running, tuple(tokens), tuple(growth), (), (), (), (), state.swapped,
                      free)
  victim_key = policies.resolve_victim_policy(config.victim_policy)
  kept = list(zip(state.running, tokens, growth))
  host_free = state.host.num_free
  swapped = state.swapped
  fates = {"swap": [], "recompute": [], "abort": []}
  host_aborted = []
  while free < config.watermark and len(kept) > 1:
    victim, _, victim_growth = kept.pop(policies.choose_victim([k[0] for k in kept], victim_key))
    free += victim_growth + len(victim.blocks)
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
  return free - blocks >= config.watermark


def _swap_in(config: SchedulerConfig, swapped: tuple[Seq, ...], num_running: int, free: int,
             budget: int) -> tuple[Choice, int, int]:
  """Brings swapped requests back in queue order while blocks and the KV link share allow.

  Returns the choice, and the device blocks and tokens left.
  """
  link_budget = policies.kv_link_budget(config.link_bytes_per_step, config.kv_link_share)
  block_size = config.block_size
  spent = 0
  seqs, tokens, blocks = [], [], []
  for seq in swapped:
    if num_running + len(seqs) >= config.max_running:
      break
    num_tokens = 0 if config.prefetch_swap_in else min(seq.num_uncomputed, budget)
    book = len(seq.blocks) + _growth(seq, num_tokens, block_size)
    # A prefetched request computes next step: keep room for that step's first block too.
    reserve = _growth(seq, 1, block_size) if config.prefetch_swap_in else 0
    cost = len(seq.blocks) * config.block_bytes
    if not _fits(free, book + reserve, config, num_running + len(seqs)):
      break
    if spent and spent + cost > link_budget:
      break
    seqs.append(seq)
    tokens.append(num_tokens)
    blocks.append(book)
    free -= book + reserve
    budget -= num_tokens
    spent += cost
  return Choice(tuple(seqs), tuple(tokens), tuple(blocks)), free, budget


def _admit(config: SchedulerConfig, waiting: tuple[Seq, ...], num_running: int, free: int,
           budget: int) -> Choice:
  """Starts waiting requests in queue order while their first chunk fits."""
  seqs, tokens, blocks = [], [], []
  for seq in waiting:
    if num_running + len(seqs) >= config.max_running or budget == 0:
      break
    num_tokens = min(seq.num_uncomputed, budget)
    book = allocator.blocks_for(num_tokens, config.block_size)
    if not _fits(free, book, config, num_running + len(seqs)):
      break
    seqs.append(seq)
    tokens.append(num_tokens)
    blocks.append(book)
    free -= book
    budget -= num_tokens
  return Choice(tuple(seqs), tuple(tokens), tuple(blocks))
