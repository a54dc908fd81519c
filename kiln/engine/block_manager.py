"""Paged KV-cache blocks: allocation, reference counts and the prefix cache.

Full blocks are hashed by chain (hash of the parent block's hash and this block's token ids).
A cached block stays reusable after its last user frees it, until the allocator needs it:
free blocks are evicted least-recently-freed first (and placed in runs of consecutive ids,
free_blocks.py). Every hit is verified by token ids."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.engine.free_blocks import CLAIM_LIMIT, FreeBlocks
from kiln.engine.sequence import Sequence
from kiln.engine.state_checkpoints import StateCheckpoints
from kiln.engine.state_slots import StateSlots


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
        state_slots: StateSlots | None = None, checkpoints: StateCheckpoints | None = None,
    ) -> None:  # fmt: skip
        """`state_slots`: a hybrid model's, taken and given back with a sequence's blocks;
        `checkpoints`: its states at block ends, without which a prefix hit cannot be used."""
        self.state_slots, self.checkpoints = state_slots, checkpoints
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeBlocks(num_blocks)
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hash_chain(self, seq: Sequence, num_blocks: int) -> list[int]:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))))
        return hashes[:num_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding this sequence's longest cached prefix. At least one token is left
        to compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits = []
        for i, h in enumerate(self._hash_chain(seq, (seq.num_tokens - 1) // bs)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break
            hits.append(block_id)
        if self.checkpoints is not None:  # a hit needs the state after its last block
            while hits and self.checkpoints.lookup(seq.block_hashes[len(hits) - 1]) is None:
                hits.pop()
        return hits

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Whether `num_tokens` (cached prefix included) fit, given the prefix hits."""
        if self.state_slots is not None and not self.state_slots.num_free:
            return False
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(num_tokens) - len(hits) <= len(self.free) - reused_free

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free.remove(block_id)
            block.ref_count += 1
        if self.state_slots is not None:
            seq.state_slot = self.state_slots.take()
        if self.checkpoints is not None and hits:
            seq.restore_entry = self.checkpoints.lookup(seq.block_hashes[len(hits) - 1])
        seq.block_table = list(hits)
        seq.num_hashed_blocks = len(hits)
        seq.draft_computed = 0  # a draft model's KV of prefix hits is not kept: it catches up
        seq.num_computed_tokens = len(hits) * self.block_size
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += seq.num_computed_tokens
        self._grow(seq, num_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = seq.num_computed_tokens + num_new_tokens
        return self.blocks_needed(total) - len(seq.block_table) <= len(self.free)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)

    def plan_checkpoint(self, seq: Sequence, num_tokens: int) -> None:
        """Before a step of `num_tokens`: where it saves the sequence's state, if anywhere (the
        last block end it reaches, unless that state is saved already)."""
        seq.checkpoint_at = seq.checkpoint_entry = -1
        if self.checkpoints is None:
            return
        first, bs = seq.num_computed_tokens, self.block_size
        boundary = (first + num_tokens) // bs * bs
        if boundary <= first:
            return
        block_hash = self._hash_chain(seq, boundary // bs)[-1]
        if self.checkpoints.lookup(block_hash) is None:
            seq.checkpoint_at = boundary - first
            seq.checkpoint_entry = self.checkpoints.reserve(block_hash)

    def checkpoint_in_accepted(self, seq: Sequence, kept: int) -> tuple[int, int] | None:
        """After a verification step whose last `kept` computed tokens include accepted drafts
        (a step plans its checkpoint within its known token only): the last block end they
        reach past that token, as (tokens of the step before it, the entry its state goes
        to), unless that state is saved already."""
        if self.checkpoints is None:
            return None
        first, bs = seq.num_computed_tokens - kept, self.block_size
        boundary = seq.num_computed_tokens // bs * bs
        if boundary <= first + 1:
            return None
        block_hash = self._hash_chain(seq, boundary // bs)[-1]
        if self.checkpoints.lookup(block_hash) is not None:
            return None
        return boundary - first, self.checkpoints.reserve(block_hash)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for `num_tokens`, each after the last where it can be (free_blocks.py), and
        a claim on the blocks after those for the tokens still to come."""
        target = self.blocks_needed(num_tokens)
        needed = target - len(seq.block_table)
        if needed <= 0:
            return
        later = max(0, self._expected_blocks(seq, target) - target)
        for i in range(needed):
            after = seq.block_table[-1] + 1 if seq.block_table else -1
            seq.block_table.append(self._take_free_block(id(seq), after, needed - i + later))
        self.free.claim(id(seq), seq.block_table[-1] + 1, later, self._holds_cache)

    def _expected_blocks(self, seq: Sequence, target: int) -> int:
        """The blocks the sequence holds if it runs to its max_tokens (unknown: a claim's
        worth more than `target`)."""
        max_tokens = getattr(getattr(seq, "params", None), "max_tokens", None)
        if max_tokens is None:
            return target + CLAIM_LIMIT
        return self.blocks_needed(seq.num_tokens - seq.num_output_tokens + max_tokens)

    def _holds_cache(self, block_id: int) -> bool:
        return self.blocks[block_id].block_hash is not None

    def _take_free_block(self, owner: int, preferred: int, span: int) -> int:
        block_id = self.free.take(preferred, owner, self._holds_cache, span)
        block = self.blocks[block_id]
        if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
            del self.cached[block.block_hash]  # evict
        block.block_hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Make the sequence's newly completed full blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # verified drafts are computed before they are appended to token_ids
        known = min(seq.num_computed_tokens, seq.num_tokens)
        full = min(known // bs, len(seq.block_table))
        if full <= seq.num_hashed_blocks:
            return
        hashes = self._hash_chain(seq, full)
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.cached[hashes[i]] = block.block_id
        seq.num_hashed_blocks = full

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's computed tokens: those only rejected drafts
        wrote into. Their slots are free again; nothing hashed them."""
        keep = max(self.blocks_needed(seq.num_computed_tokens), seq.num_hashed_blocks)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free.put(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (and the hit statistics)."""
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        self.stats = PrefixCacheStats()
        if self.checkpoints is not None:
            self.checkpoints.clear()

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks are queued for eviction before the
        head, which later requests are likelier to share."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free.put(block_id)
        self.free.release_claims(id(seq))
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = seq.draft_computed = 0
        if self.state_slots is not None and seq.state_slot >= 0:
            self.state_slots.give_back(seq.state_slot)
            seq.state_slot = -1
        seq.restore_entry = -1
