"""The block allocator and prefix cache on their own."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.engine.block_manager import BlockManager


def _seq(tokens):
    return SimpleNamespace(
        token_ids=list(tokens),
        block_table=[],
        block_hashes=[],
        num_hashed_blocks=0,
        num_computed_tokens=0,
        num_tokens=len(tokens),
    )


def _run(bm, seq):
    hits = bm.find_cached_prefix(seq)
    assert bm.can_admit(hits, seq.num_tokens)
    bm.admit(seq, hits, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)
    return hits


def test_chain_hash_hits_only_on_identical_prefix():
    bm = BlockManager(16, 4, True)
    a = _seq(range(10))
    _run(bm, a)
    bm.release(a)
    assert _run(bm, _seq(range(10))) != []
    b = _seq([0, 1, 2, 3, 99, 5, 6, 7, 8, 9])
    assert len(bm.find_cached_prefix(b)) == 1  # diverges in the second block


def test_hit_is_verified_by_token_ids():
    bm = BlockManager(16, 4, True)
    a = _seq(range(9))
    _run(bm, a)
    bm.release(a)
    block = bm.blocks[bm.cached[next(iter(bm.cached))]]
    block.token_ids = (7, 7, 7, 7)  # as if a different block had the same hash
    assert bm.find_cached_prefix(_seq(range(9))) == []


def test_lru_eviction_and_no_leaks():
    bm = BlockManager(4, 4, True)
    a, b = _seq(range(8)), _seq(range(100, 108))
    _run(bm, a)
    bm.release(a)
    _run(bm, b)  # takes the two never-used blocks first
    bm.release(b)
    assert len(bm.cached) == 4
    c = _seq(range(200, 212))  # needs 3 blocks: evicts a's (freed earliest) and one of b's
    _run(bm, c)
    assert bm.find_cached_prefix(_seq(range(9))) == []
    bm.release(c)
    assert bm.num_free_blocks == 4


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(8, 4, True)
    a, b = _seq(range(9)), _seq(range(9))
    _run(bm, a)
    hits = _run(bm, b)
    assert hits == a.block_table[:2]
    assert bm.blocks[hits[0]].ref_count == 2
    bm.release(a)
    assert bm.blocks[hits[0]].ref_count == 1
    bm.release(b)
    assert bm.num_free_blocks == 8


def test_a_growing_sequence_takes_the_block_after_its_last_when_free():
    """Consecutive blocks (read in place, in one run, by the CPU attention backend) unless the
    next one caches a prefix, which taking it would evict."""
    for caching, grown in ((False, [0, 1]), (True, [0, 3])):
        bm = BlockManager(8, 4, caching)
        a, b, c = _seq(range(4)), _seq(range(100, 104)), _seq(range(200, 204))
        for seq in (a, b, c):
            _run(bm, seq)  # blocks 0, 1, 2
        bm.release(b)  # block 1 is free, behind 3 to 7 in the eviction order
        bm.append(a, 4)
        assert a.block_table == grown
