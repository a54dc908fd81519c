"""The free KV blocks: which one a sequence takes next, and what that evicts.

Free blocks queue least recently freed first (never-used ones at the front), and a block that
caches a prefix is evicted in that order. Placement matters on the CPU, whose attention kernels
read a sequence's blocks in table order straight from the cache: a run of consecutive block ids
streams from memory, scattered blocks do not (the decode kernel was 18% slower on shuffled than
on ordered blocks). Taking strictly in queue order scatters a server's sequences within a few
rounds (a sequence frees its tail first, and decode growth takes one block at a time,
interleaved across sequences), so within that order the pool places blocks in runs:

- a growing sequence takes the block after its last if taking it evicts nothing (it caches no
  prefix), or if it is among the blocks this allocation takes in queue order anyway (its
  span: the blocks it takes now and those it will grow into), or if it was claimed for it;
- otherwise a run starts at the first block of the queue, moved back over blocks the same
  rule allows (a freed sequence's blocks before its tail are the next ones in the queue), so
  the run is taken upwards;
- the blocks after a growing sequence's last that the same rule allows (its remaining prompt
  and max_tokens, at most CLAIM_LIMIT) are claimed for it, softly: other sequences start their
  runs elsewhere while they can.

So an allocation evicts only blocks among the first of the queue, as many as its span, in
another order: a freed sequence's blocks nearer its head may go before its tail."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator

CLAIM_LIMIT = 16  # blocks claimed ahead of a sequence: its expected growth, at most this
SCAN_LIMIT = 4096  # free blocks looked at for unclaimed ones before taking a claimed one
WALK_LIMIT = 256  # blocks a run's start is looked for behind its first block


class FreeBlocks:
    def __init__(self, num_blocks: int) -> None:
        self.order: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.claimed_by: dict[int, int] = {}  # block id -> the owner it lies ahead of
        self.claims: dict[int, list[int]] = {}  # owner -> its claimed block ids

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def put(self, block_id: int) -> None:
        """Freed now: the newest in the queue."""
        self.order[block_id] = None

    def remove(self, block_id: int) -> None:
        """Taken back by a prefix hit (whoever had claimed it grows elsewhere)."""
        del self.order[block_id]
        self._unclaim(block_id)

    def take(
        self, preferred: int, owner: int, holds_cache: Callable[[int], bool], span: int = 1
    ) -> int:
        """A block for `owner`, whose span is `span` blocks from here: `preferred` (the one
        after its last) where the queue allows it, else a run's start."""
        allowed = _Allowed(self, owner, holds_cache, span)
        block_id = preferred if allowed(preferred) else self._run_start(allowed, span)
        del self.order[block_id]
        self._unclaim(block_id)
        return block_id

    def claim(self, owner: int, after: int, count: int, holds_cache: Callable[[int], bool]) -> None:
        """Claim for `owner`, in place of its earlier claims, the free blocks from `after` on
        (up to `count`) that the queue allows it."""
        self.release_claims(owner)
        count = min(count, CLAIM_LIMIT)
        allowed, mine = _Allowed(self, owner, holds_cache, count), []
        for block_id in range(after, after + count):
            if not allowed(block_id):
                break
            self.claimed_by[block_id] = owner
            mine.append(block_id)
        if mine:
            self.claims[owner] = mine

    def release_claims(self, owner: int) -> None:
        for block_id in self.claims.pop(owner, ()):
            if self.claimed_by.get(block_id) == owner:
                del self.claimed_by[block_id]

    def free_for(self, block_id: int, owner: int) -> bool:
        return block_id in self.order and self.claimed_by.get(block_id, owner) == owner

    def _unclaim(self, block_id: int) -> None:
        owner = self.claimed_by.pop(block_id, None)
        if owner is not None:
            self.claims[owner].remove(block_id)

    def _run_start(self, allowed: _Allowed, span: int) -> int:
        block_id = allowed.first()
        for _ in range(min(span - 1, WALK_LIMIT)):
            if block_id == 0 or not allowed(block_id - 1):
                break
            block_id -= 1
        return block_id


class _Allowed:
    """Which free blocks one allocation may take: one free for its owner that caches nothing,
    or is claimed for it, or is among the first `span` of the queue free for it."""

    def __init__(
        self, pool: FreeBlocks, owner: int, holds_cache: Callable[[int], bool], span: int
    ) -> None:
        self.pool, self.owner, self.holds_cache, self.span = pool, owner, holds_cache, span
        self._front: list[int] | None = None

    def __call__(self, block_id: int) -> bool:
        if not self.pool.free_for(block_id, self.owner):
            return False
        if not self.holds_cache(block_id) or self.pool.claimed_by.get(block_id) == self.owner:
            return True
        return block_id in self.front()

    def front(self) -> list[int]:
        if self._front is None:
            mine = (
                b
                for b in itertools.islice(self.pool.order, SCAN_LIMIT)
                if self.pool.free_for(b, self.owner)
            )
            self._front = list(itertools.islice(mine, self.span))
        return self._front

    def first(self) -> int:
        """The first block of the queue free for the owner; the first at all when every block
        looked at is claimed (claims are soft)."""
        front = self.front()
        return front[0] if front else next(iter(self.pool.order))
