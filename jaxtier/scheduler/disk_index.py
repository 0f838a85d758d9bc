"""The disk tier under the host tier, as the scheduler sees it: an index of block hashes.

The files are the engine's (`jaxtier.kvcache.disk`); the scheduler holds only the set of hashes
the disk holds (`SchedulerState.disk_index`, kept current by `DiskIndexed` events), so every
decision about the disk is a pure function of the state:

- Writes (write-through): a device block registered in the prefix index whose hash the disk lacks
  is listed in the next plan's `disk_writes`; the engine copies it out before anything can
  overwrite it and a writer thread stores it. A block enters `disk_index` only when its file is
  written (`DiskIndexed`), so nothing is read before it exists.
- Reads: when a request arrives, the engine first looks up the files of the blocks after its
  device and host hits that the index lacks (`after_hits`; files another process wrote since
  this one started), then `disk_lookup` names the blocks after its device and host hits that the
  disk holds (in order, stopping at the first it lacks), when reading them is cheaper
  than recomputing them. The engine holds the request in the queue (`Arrive.held`) while a reader
  thread reads and checks those files into pinned host memory, then sends `DiskLoaded` with the
  blocks that passed: the scheduler books host blocks for them in the host index (evicting its
  least recently used, never a swapped request's), and the next plan's `disk_fills` puts them
  there. From then on they are host-tier hits: loaded to the device inside the link budget, or
  recomputed, by the host tier's rules. A block that failed its checks is simply not in
  `DiskLoaded`: the request recomputes it.
"""

import dataclasses

from jaxtier.scheduler import allocator
from jaxtier.scheduler import prefix
from jaxtier.scheduler.request import Request
from jaxtier.scheduler.state import DiskIndexed, DiskLoaded, Rates, SchedulerState


def disk_lookup(state: SchedulerState, request: Request) -> tuple[prefix.BlockHash, ...]:
  """The hashes of `request`'s prompt blocks to read from disk on arrival: those after its
  device and host hits that the disk index holds, from the first on, short of the prompt's last
  token (whose logits the first step needs); none where reading them would be slower than
  recomputing them (`disk_pays`)."""
  config = state.config
  if not state.disk_index:
    return ()
  found = []
  for block_hash in after_hits(state, request):
    if block_hash not in state.disk_index:
      break
    found.append(block_hash)
  if not found or not disk_pays(state.rates, len(found), config.block_bytes, config.block_size):
    return ()
  return tuple(found)


def after_hits(state: SchedulerState, request: Request) -> tuple[prefix.BlockHash, ...]:
  """The hashes of `request`'s prompt blocks after its device and host hits, short of the
  prompt's last token: the ones the disk tier could hold (none without the disk tier)."""
  config = state.config
  if not config.disk_tier or request.skip_prefix_cache or not request.prompt_token_ids:
    return ()
  hashes = prefix.block_hashes(request.prompt_token_ids, config.block_size)
  usable = hashes[:(request.prompt_len - 1) // config.block_size]
  start = prefix.num_hits(state.device_cache, usable)
  start += prefix.num_hits(state.host_cache, usable, start)
  return usable[start:]


def disk_pays(rates: Rates | None, num_blocks: int, block_bytes: int, block_size: int) -> bool:
  """Whether reading `num_blocks` blocks from disk and loading them to the device is faster than
  recomputing them; True until the rates are measured."""
  if rates is None or rates.disk_bytes_per_s is None or not block_bytes:
    return True
  read = num_blocks * block_bytes / rates.disk_bytes_per_s
  load = rates.swap_latency_s + num_blocks * block_bytes / rates.link_bytes_per_s
  return read + load < num_blocks * block_size / rates.prefill_tokens_per_s


def indexed(state: SchedulerState, event: DiskIndexed) -> SchedulerState:
  """The state with the disk index changed by `event`."""
  index = state.disk_index
  if event.reset:
    index = type(index)()
  for block_hash in event.removed:
    index = index.discard(block_hash)
  for block_hash in event.added:
    index = index.insert(block_hash)
  return dataclasses.replace(state, disk_index=index)


def loaded(state: SchedulerState, event: DiskLoaded) -> SchedulerState:
  """Books host blocks for the blocks read from disk: free ones first, then the host index's
  least recently used; as many as there is room for (the rest are recomputed). Blocks the host
  index has meanwhile are skipped. An ended request's blocks are booked all the same: they are
  as good a cache entry as any."""
  config = state.config
  if not config.disk_tier or not event.hashes:
    return state
  host_cache = state.host_cache
  wanted = [h for h in dict.fromkeys(event.hashes) if h not in host_cache.by_hash]
  room = state.host.num_free + host_cache.num_evictable
  wanted = wanted[:room]
  if not wanted:
    return state
  host_cache, evicted = prefix.evict(host_cache, len(wanted) - state.host.num_free)
  host, (granted,) = allocator.update(state.host, tuple(b for b, _ in evicted),
                                      [(prefix.CACHED, len(wanted))])
  for block, block_hash in zip(granted, wanted):
    host_cache, _ = prefix.register(host_cache, block, block_hash, referenced=False)
  counters = dataclasses.replace(
      state.counters, disk_loaded_blocks=state.counters.disk_loaded_blocks + len(wanted),
      host_cache_evictions=state.counters.host_cache_evictions + len(evicted))
  return dataclasses.replace(state, host=host, host_cache=host_cache, counters=counters,
                             disk_fills=state.disk_fills + tuple(zip(wanted, granted)))


def written_through(state: SchedulerState, registered: list[tuple[int, prefix.BlockHash]]
                    ) -> SchedulerState:
  """The state with the newly registered device blocks the disk lacks queued for the next plan's
  `disk_writes`."""
  if not state.config.disk_tier or not registered:
    return state
  new = tuple((block, h) for block, h in registered if h not in state.disk_index)
  return dataclasses.replace(state, disk_writes=state.disk_writes + new) if new else state
