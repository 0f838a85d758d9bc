"""Prefix caching: full KV blocks named by a chained hash, shared by reference, kept when unused.

A block's hash covers its token ids and the hash of the block before it (vLLM's scheme), so equal
hashes mean equal tokens at equal positions after equal prefixes, hence equal KV. Hashes are
SHA-256 (truncated to 128 bits): a prompt crafted to collide with another user's block would need a
SHA-256 collision. Only full blocks of the prompt are hashed; generated tokens are not (a chat's
next turn re-tokenizes the reply, which rarely gives the same ids at the same block boundaries).

Each pool has a `TierIndex`. On the device, a registered block is owned by the index: requests hold
references to it, and a block no request references stays cached, evictable in least-recently-used
order. Blocks a request computes are registered when the step that wrote them has finished, so a
block is never read before its KV exists. On the host, cached blocks are never referenced: a hit
copies the block to a new device block (a swap-in), and the host copy stays cached.

Everything here is immutable; the maps are persistent hash tries (`rpds`), so an update costs time
in the blocks it touches, not in the size of the index.
"""

import array
import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

from rpds import HashTrieMap

BlockHash = bytes
CACHED = ("<prefix cache>",)  # the allocator owner of every registered block
_EMPTY = HashTrieMap()


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[BlockHash, ...]:
  """Returns the chained hash of every full block of `token_ids`, in order."""
  hashes, parent = [], b""
  for start in range(0, len(token_ids) - block_size + 1, block_size):
    tokens = array.array("I", token_ids[start:start + block_size]).tobytes()
    parent = hashlib.sha256(parent + tokens).digest()[:16]
    hashes.append(parent)
  return tuple(hashes)


@dataclasses.dataclass(frozen=True)
class TierIndex:
  """The cached blocks of one pool.

  Attributes:
    by_hash: block hash -> block id.
    hashes: block id -> block hash, for every cached block.
    refs: block id -> live references, for referenced cached blocks (absent: none).
    lru: tick -> block id for the unreferenced cached blocks; the lowest tick is evicted first.
    ticks: block id -> its tick in `lru`.
    head: no tick below it is in `lru`.
    next_tick: the tick the next unreferenced block gets.
  """
  by_hash: HashTrieMap = _EMPTY
  hashes: HashTrieMap = _EMPTY
  refs: HashTrieMap = _EMPTY
  lru: HashTrieMap = _EMPTY
  ticks: HashTrieMap = _EMPTY
  head: int = 0
  next_tick: int = 0

  @property
  def num_cached(self) -> int:
    return len(self.hashes)

  @property
  def num_evictable(self) -> int:
    return len(self.lru)

  def refcount(self, block: int) -> int:
    return self.refs.get(block, 0)


EMPTY_INDEX = TierIndex()


def num_hits(index: TierIndex, hashes: Sequence[BlockHash], start: int = 0) -> int:
  """Returns how many of `hashes[start:]`, from the first on, are cached in `index`."""
  count = 0
  for block_hash in hashes[start:]:
    if block_hash not in index.by_hash:
      break
    count += 1
  return count


def hit_blocks(index: TierIndex, hashes: Sequence[BlockHash]) -> tuple[int, ...]:
  """Returns the block ids of `hashes` (all cached)."""
  return tuple(index.by_hash[block_hash] for block_hash in hashes)


def acquire(index: TierIndex, blocks: Iterable[int]) -> TierIndex:
  """Adds one reference to each cached block; an unreferenced one leaves the LRU queue."""
  refs, lru, ticks = index.refs, index.lru, index.ticks
  for block in blocks:
    count = refs.get(block, 0)
    if count == 0:
      lru, ticks = lru.remove(ticks[block]), ticks.remove(block)
    refs = refs.insert(block, count + 1)
  return dataclasses.replace(index, refs=refs, lru=lru, ticks=ticks)


def release(index: TierIndex, blocks: Sequence[int]) -> tuple[TierIndex, tuple[int, ...]]:
  """Drops one reference from each cached block among `blocks` (a request's table, in token order).

  Blocks that lose their last reference join the LRU queue tail-first, so a prompt's last blocks
  (the least shared) are evicted before its first ones. Returns the index and the blocks of
  `blocks` that are not cached, which the caller frees.
  """
  refs, lru, ticks, tick = index.refs, index.lru, index.ticks, index.next_tick
  private = []
  for block in reversed(blocks):
    if block not in index.hashes:
      private.append(block)
      continue
    count = refs[block] - 1
    if count:
      refs = refs.insert(block, count)
    else:
      refs = refs.remove(block)
      lru, ticks = lru.insert(tick, block), ticks.insert(block, tick)
      tick += 1
  private.reverse()
  return (dataclasses.replace(index, refs=refs, lru=lru, ticks=ticks, next_tick=tick),
          tuple(private))


def freeable(index: TierIndex, blocks: Sequence[int]) -> int:
  """How many of `blocks` (one request's) become free or evictable when it lets go of them."""
  hashes, refs = index.hashes, index.refs
  return sum(1 for block in blocks if block not in hashes or refs[block] == 1)


def register(index: TierIndex, block: int, block_hash: BlockHash, referenced: bool
             ) -> tuple[TierIndex, bool]:
  """Caches `block` under `block_hash` unless that hash is cached already.

  `referenced`: the block is held by the request that computed it (device tier); otherwise it is
  unreferenced and goes to the back of the LRU queue (host tier). Returns the index and whether the
  block was registered (when not, it stays its owner's private block).
  """
  if block_hash in index.by_hash:
    return index, False
  by_hash, hashes = index.by_hash.insert(block_hash, block), index.hashes.insert(block, block_hash)
  if referenced:
    return dataclasses.replace(index, by_hash=by_hash, hashes=hashes,
                               refs=index.refs.insert(block, 1)), True
  tick = index.next_tick
  return dataclasses.replace(index, by_hash=by_hash, hashes=hashes, lru=index.lru.insert(tick, block),
                             ticks=index.ticks.insert(block, tick), next_tick=tick + 1), True


def touch(index: TierIndex, blocks: Iterable[int]) -> TierIndex:
  """Moves unreferenced cached blocks to the back of the LRU queue (they were just used)."""
  lru, ticks, tick = index.lru, index.ticks, index.next_tick
  for block in blocks:
    old = ticks.get(block)
    if old is None:
      continue
    lru = lru.remove(old).insert(tick, block)
    ticks = ticks.insert(block, tick)
    tick += 1
  return dataclasses.replace(index, lru=lru, ticks=ticks, next_tick=tick)


def evict(index: TierIndex, count: int, keep: frozenset[int] = frozenset()
          ) -> tuple[TierIndex, tuple[tuple[int, BlockHash], ...]]:
  """Removes the `count` least recently used unreferenced blocks, skipping those in `keep`.

  Returns the index and the (block, hash) pairs removed, oldest first; fewer than `count` when the
  queue runs out.
  """
  if count <= 0:
    return index, ()
  lru, ticks, by_hash, hashes = index.lru, index.ticks, index.by_hash, index.hashes
  head, tick, end = index.head, index.head, index.next_tick
  removed = []
  while len(removed) < count and tick < end:
    block = lru.get(tick)
    if block is not None and block not in keep:
      block_hash = hashes[block]
      lru, ticks = lru.remove(tick), ticks.remove(block)
      by_hash, hashes = by_hash.remove(block_hash), hashes.remove(block)
      removed.append((block, block_hash))
    if tick == head and tick not in lru:
      head += 1
    tick += 1
  return (dataclasses.replace(index, by_hash=by_hash, hashes=hashes, lru=lru, ticks=ticks,
                              head=head), tuple(removed))


def drop_unreferenced(index: TierIndex) -> tuple[TierIndex, tuple[int, ...]]:
  """Removes every unreferenced cached block; returns the index and their ids (to free)."""
  index, removed = evict(index, index.num_evictable)
  return index, tuple(block for block, _ in removed)
