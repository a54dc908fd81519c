"""The free KV blocks: the order the prefix cache evicts them in, and which one a sequence
takes next.

Eviction is least recently freed first. Placement matters on the CPU, whose attention kernels
read a sequence's blocks in table order straight from the cache: a run of consecutive block
ids streams from memory, scattered blocks do not (the decode kernel was 14% slower on shuffled
than on ordered blocks, benchmarks/decode_kernel_ab.py). Strict LRU scatters a server's
sequences within a few rounds (freed tail first, taken one at a time, interleaved across
sequences), so the pool bends the order three ways, none of which costs a cache hit that LRU
would have kept for long:

- a growing sequence takes the block after its last when that block is free and holds nothing,
  or is among the older three quarters of the free queue (by when it was freed), or was freed
  just before the block behind it;
- otherwise it starts a run at the oldest free block, moved back to the start of its free run;
- the blocks just after a growing sequence's last are claimed for it (softly: only where
  another block would do), so that neighbours do not start their runs there."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

CLAIM_LIMIT = 16  # blocks claimed ahead of a sequence: its expected growth, at most this
SCAN_LIMIT = 4096  # free blocks looked at for an unclaimed one before taking the oldest
WALK_LIMIT = 256  # blocks a run's start is looked for behind the oldest free block


class FreeBlocks:
    def __init__(self, num_blocks: int) -> None:
        self.order: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.freed_at = [0] * num_blocks  # the clock when each block was last freed
        self.clock = 0
        self.claimed_by: dict[int, int] = {}  # block id -> the owner it lies ahead of
        self.claims: dict[int, list[int]] = {}  # owner -> its claimed block ids

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def put(self, block_id: int) -> None:
        """Freed now: the newest in the eviction order."""
        self.clock += 1
        self.freed_at[block_id] = self.clock
        self.order[block_id] = None

    def remove(self, block_id: int) -> None:
        """Taken back by a prefix hit."""
        del self.order[block_id]

    def take(
        self, preferred: int, owner: int, holds_cache: Callable[[int], bool], span: int = 1
    ) -> int:
        """A block for `owner`, who will take `span` blocks in a row from here: `preferred`
        (the one after its last) where that evicts nothing worth keeping, else a run that
        ends at the oldest free block no other owner has claimed (`_run_start`)."""
        if self._takeable(preferred, owner, holds_cache):
            block_id = preferred
        else:
            oldest = self._oldest_unclaimed(owner)
            block_id = self._run_start(oldest, owner, holds_cache, span)
        del self.order[block_id]
        self._unclaim(block_id)
        return block_id

    def claim(self, owner: int, after: int, count: int) -> None:
        """Claim up to `count` free blocks from `after` on for `owner`, in place of its
        earlier claims."""
        self.release_claims(owner)
        mine = []
        for block_id in range(after, after + min(count, CLAIM_LIMIT)):
            if block_id not in self.order or block_id in self.claimed_by:
                break
            self.claimed_by[block_id] = owner
            mine.append(block_id)
        if mine:
            self.claims[owner] = mine

    def release_claims(self, owner: int) -> None:
        for block_id in self.claims.pop(owner, ()):
            if self.claimed_by.get(block_id) == owner:
                del self.claimed_by[block_id]

    def _unclaim(self, block_id: int) -> None:
        owner = self.claimed_by.pop(block_id, None)
        if owner is not None:
            self.claims[owner].remove(block_id)

    def _free_for(self, block_id: int, owner: int) -> bool:
        return block_id in self.order and self.claimed_by.get(block_id, owner) == owner

    def _takeable(self, block_id: int, owner: int, holds_cache: Callable[[int], bool]) -> bool:
        """Free for `owner`, and taking it evicts nothing LRU would keep for long: it caches
        nothing, or is not among the newest quarter of the free queue, or was freed just
        before the block behind it (its sequence's next block towards the tail, older)."""
        if not self._free_for(block_id, owner):
            return False
        if not holds_cache(block_id) or self._not_recent(block_id):
            return True
        return block_id > 0 and self.freed_at[block_id] + 1 == self.freed_at[block_id - 1]

    def _not_recent(self, block_id: int) -> bool:
        """Among the older three quarters of the free queue, by when it was freed."""
        oldest = self.freed_at[next(iter(self.order))]
        return 4 * (self.freed_at[block_id] - oldest) <= 3 * (self.clock - oldest)

    def _oldest_unclaimed(self, owner: int) -> int:
        for i, block_id in enumerate(self.order):
            if i == SCAN_LIMIT:
                break
            if self.claimed_by.get(block_id, owner) == owner:
                return block_id
        return next(iter(self.order))  # every block looked at is claimed: claims are soft

    def _run_start(
        self, block_id: int, owner: int, holds_cache: Callable[[int], bool], span: int
    ) -> int:
        """Up to `span - 1` blocks back from `block_id`, over blocks that cache nothing or were
        freed right after the block behind them: a sequence frees its tail first, so its
        blocks before the oldest are the next ones LRU evicts, and a run taken from there
        upwards evicts what LRU would, in ascending order."""
        for _ in range(min(span - 1, WALK_LIMIT)):
            prev = block_id - 1
            if prev < 0 or not self._free_for(prev, owner):
                break
            chained = holds_cache(block_id) and self.freed_at[prev] == self.freed_at[block_id] + 1
            if holds_cache(prev) and not chained:
                break
            block_id = prev
        return block_id
