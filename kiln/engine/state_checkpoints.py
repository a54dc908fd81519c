"""Prefix caching for hybrid models: a prefix hit must start from the Gated DeltaNet state at
the end of the prefix, which the KV blocks do not hold. So the state of a sequence is copied
into a checkpoint when a step reaches a block boundary (the last one inside each request's
chunk; every block's end while decoding), keyed by the hash chain of the blocks before it: the
state depends on those tokens only. A prefix hit is cut back to the longest run of cached blocks
whose last block has a checkpoint, and the sequence's slot is filled from it before its first
step. The checkpoints are a fixed pool, evicted least recently used."""

from __future__ import annotations

from collections import OrderedDict

from kiln.config.engine import EngineConfig


class StateCheckpoints:
    def __init__(self, num_entries: int) -> None:
        self.num_entries = num_entries
        self._entries: OrderedDict[int, int] = OrderedDict()  # block hash -> entry, LRU first
        self._free = list(range(num_entries - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, block_hash: int) -> int | None:
        """The entry holding the state after the block with this hash, if any (it becomes the
        most recently used)."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
        return entry

    def reserve(self, block_hash: int) -> int:
        """The entry to write the state after this block into: a free one, or the least
        recently used one's."""
        if self._free:
            entry = self._free.pop()
        else:
            _, entry = self._entries.popitem(last=False)
        self._entries[block_hash] = entry
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._free = list(range(self.num_entries - 1, -1, -1))


def num_state_checkpoints(config: EngineConfig, hybrid: bool) -> int:
    """The pool's size: none without a hybrid model or without prefix caching."""
    if not hybrid or not config.cache.enable_prefix_caching:
        return 0
    return config.cache.state_checkpoints or config.scheduler.max_num_seqs
