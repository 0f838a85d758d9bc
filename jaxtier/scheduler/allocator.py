"""Block pools: which KV blocks are free and who owns each, as immutable values.

A pool holds integer block ids in [0, num_blocks), never arrays: the engine maps ids to slots of its
device or host KV arrays. Blocks are handed out first-in first-out, so a block freed in one step is
reused as late as possible.

The free queue and the owner table are stored in pieces so that an update costs time in proportion to
the blocks it touches, not to the size of the pool: one scheduler step over a pool of 100k blocks must
stay far below a millisecond, and copying a 100k-entry tuple alone takes about one.
"""

import dataclasses
import itertools
from collections.abc import Hashable, Iterable, Sequence

_CHUNK = 256

Owner = Hashable


@dataclasses.dataclass(frozen=True)
class BlockPool:
  """A fixed set of blocks, each free or owned by exactly one owner (a request id)."""
  num_blocks: int
  num_free: int
  free_segments: tuple[Sequence[int], ...]  # [segments][ids] allocation order: front first
  owner_chunks: tuple[tuple[Owner | None, ...], ...]  # [ceil(num_blocks / 256)][256], None = free

  @property
  def num_used(self) -> int:
    return self.num_blocks - self.num_free

  def owner(self, block: int) -> Owner | None:
    """Returns who owns `block`, or None when it is free."""
    return self.owner_chunks[block // _CHUNK][block % _CHUNK]

  def free_blocks(self) -> tuple[int, ...]:
    """Returns the free block ids in the order they will be handed out."""
    return tuple(itertools.chain.from_iterable(self.free_segments))


def new_pool(num_blocks: int) -> BlockPool:
  """Returns a pool of `num_blocks` blocks, all free, handed out in increasing id order."""
  if not isinstance(num_blocks, int) or num_blocks < 0:
    raise ValueError(f"num_blocks={num_blocks!r}: expected an int >= 0")
  chunks = tuple((None,) * min(_CHUNK, num_blocks - start) for start in range(0, num_blocks, _CHUNK))
  segments = (range(num_blocks),) if num_blocks else ()
  return BlockPool(num_blocks, num_blocks, segments, chunks)


def blocks_for(num_tokens: int, block_size: int) -> int:
  """Returns how many blocks of `block_size` tokens hold `num_tokens` tokens."""
  return -(-num_tokens // block_size)


def update(pool: BlockPool, release: Iterable[int] = (),
           allocate: Sequence[tuple[Owner, int]] = ()) -> tuple[BlockPool, tuple[tuple[int, ...], ...]]:
  """Frees the `release` blocks, then hands out blocks to each (owner, count) of `allocate`.

  Released blocks join the back of the free queue and allocations take from its front, so a block
  released here is handed out again in the same update only when the older free blocks run out.

  Returns:
    The new pool and, for each entry of `allocate`, the tuple of block ids it received.
  """
  release = tuple(release)
  for block in release:
    if not 0 <= block < pool.num_blocks or pool.owner(block) is None:
      raise ValueError(f"release contains block {block!r}: expected a block owned by someone in "
                       f"[0, {pool.num_blocks})")
  if len(set(release)) != len(release):
    raise ValueError(f"release={release!r}: expected each block at most once")
  wanted = sum(count for _, count in allocate)
  for owner, count in allocate:
    if owner is None or not isinstance(count, int) or count < 0:
      raise ValueError(f"allocate entry ({owner!r}, {count!r}): expected (owner, count >= 0), "
                       "owner not None")
  if wanted > pool.num_free + len(release):
    raise ValueError(f"allocate asks for {wanted} blocks: only {pool.num_free + len(release)} are "
                     "free after the release")
  segments = _append(pool.free_segments, release)
  taken, segments = _take(segments, wanted)
  granted = _split(taken, [count for _, count in allocate])
  assignments = [(block, None) for block in release]
  for (owner, _), blocks in zip(allocate, granted):
    assignments.extend((block, owner) for block in blocks)
  chunks = _set_owners(pool.owner_chunks, assignments)
  num_free = pool.num_free + len(release) - wanted
  return BlockPool(pool.num_blocks, num_free, segments, chunks), granted


def reassign(pool: BlockPool, blocks: Iterable[int], owner: Owner) -> BlockPool:
  """Returns `pool` with the owned `blocks` handed to `owner` (none of them is freed)."""
  if owner is None:
    raise ValueError("owner=None: expected an owner (free blocks with `update`)")
  assignments = []
  for block in blocks:
    if not 0 <= block < pool.num_blocks or pool.owner(block) is None:
      raise ValueError(f"block {block!r}: expected a block owned by someone in [0, {pool.num_blocks})")
    assignments.append((block, owner))
  return dataclasses.replace(pool, owner_chunks=_set_owners(pool.owner_chunks, assignments))


def _append(segments: tuple[Sequence[int], ...], blocks: tuple[int, ...]
            ) -> tuple[Sequence[int], ...]:
  if not blocks:
    return segments
  if segments and isinstance(segments[-1], tuple) and len(segments[-1]) < _CHUNK:
    return segments[:-1] + (segments[-1] + blocks,)
  return segments + (blocks,)


def _take(segments: tuple[Sequence[int], ...], count: int
          ) -> tuple[tuple[int, ...], tuple[Sequence[int], ...]]:
  taken: list[int] = []
  for i, segment in enumerate(segments):
    want = count - len(taken)
    if want == 0:
      return tuple(taken), segments[i:]
    if len(segment) > want:
      taken.extend(segment[:want])
      return tuple(taken), (segment[want:],) + segments[i + 1:]
    taken.extend(segment)
  return tuple(taken), ()


def _split(blocks: tuple[int, ...], counts: list[int]) -> tuple[tuple[int, ...], ...]:
  bounds = list(itertools.accumulate(counts, initial=0))
  return tuple(blocks[start:stop] for start, stop in zip(bounds, bounds[1:]))


def _set_owners(chunks: tuple[tuple[Owner | None, ...], ...],
                assignments: list[tuple[int, Owner | None]]) -> tuple[tuple[Owner | None, ...], ...]:
  if not assignments:
    return chunks
  rows: dict[int, list[Owner | None]] = {}
  for block, owner in assignments:
    index = block // _CHUNK
    if index not in rows:
      rows[index] = list(chunks[index])
    rows[index][block % _CHUNK] = owner
  new_chunks = list(chunks)
  for index, row in rows.items():
    new_chunks[index] = tuple(row)
  return tuple(new_chunks)
