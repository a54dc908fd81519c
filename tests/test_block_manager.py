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


def _no_growth(seq):
    """A sequence at its max_tokens: no blocks claimed ahead, so it takes strictly in LRU order
    (free_blocks.py)."""
    seq.params, seq.num_output_tokens = SimpleNamespace(max_tokens=0), 0
    return seq


def test_lru_eviction_and_no_leaks():
    bm = BlockManager(4, 4, True)
    a, b = _no_growth(_seq(range(8))), _no_growth(_seq(range(100, 108)))
    _run(bm, a)
    bm.release(a)
    _run(bm, b)  # takes the two never-used blocks first
    bm.release(b)
    assert len(bm.cached) == 4
    c = _no_growth(_seq(range(200, 212)))  # 3 blocks: evicts a's (freed earliest), one of b's
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
        for seq in (_no_growth(a), b, c):  # a grows by exactly the 4 tokens appended
            _run(bm, seq)  # blocks 0, 1, 2
        bm.release(b)  # block 1 is free, behind 3 to 7 in the eviction order
        a.params.max_tokens = 4
        bm.append(a, 4)
        assert a.block_table == grown


def _rounds(bm, scheduler_config, rounds: int, streams: int, prompt: int, out: int):
    """Rounds of distinct prompts through the real scheduler, no model (each scheduled token
    counts as computed): the mean blocks per run of consecutive ids, in table order, of each
    round's scheduled sequences."""
    import itertools
    import random

    from kiln.engine.scheduler import Scheduler
    from kiln.engine.sequence import Sequence
    from kiln.outputs import RequestMetrics
    from kiln.sampling_params import SamplingParams

    scheduler, rng, ids, per_round = Scheduler(scheduler_config, bm), random.Random(0), 0, []
    for r in range(rounds):
        for i in range(streams):
            tokens = [rng.randrange(3, 49000) for _ in range(prompt)]
            seq = Sequence(ids, f"{r}-{i}", 0, tokens, prompt, SamplingParams(max_tokens=out),
                           None, RequestMetrics(arrival_time=0.0))  # fmt: skip
            scheduler.add(seq)
            ids += 1
        seen = []
        while scheduler.running or scheduler.waiting:
            batch = scheduler.schedule()
            for seq, n in zip(batch.seqs, batch.num_tokens):
                t = seq.block_table
                seen.append(len(t) / (1 + sum(b != a + 1 for a, b in itertools.pairwise(t))))
                seq.num_computed_tokens += n
                bm.register_computed_blocks(seq)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(rng.randrange(3, 49000))
                    if seq.num_output_tokens >= out:
                        scheduler.finish(seq)
        per_round.append(sum(seen) / len(seen))
    return per_round


def test_sequences_stay_on_runs_of_blocks_over_many_rounds():
    """A server's sequences keep their blocks in long runs round after round, prefix caching
    on (every freed block caches something). Strict LRU fell from 5.5 to 1.1-1.9 blocks a run
    by the fourth round of this load (tail-first frees taken back in descending order, decode
    growth interleaved across sequences); this pool keeps 5.2-18.4. The CPU kernels stream a
    run from memory."""
    from kiln.config.engine import SchedulerConfig

    bm = BlockManager(1500, 16, True)
    config = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512)
    runs = _rounds(bm, config, rounds=8, streams=32, prompt=256, out=64)
    assert min(runs) > 4, runs
    assert bm.num_free_blocks == 1500 and not bm.free.claimed_by and not bm.free.claims


def test_a_run_taken_from_a_sequence_freed_tail_first_evicts_what_lru_would():
    """The oldest free block is a freed sequence's last; a new sequence takes the blocks LRU
    evicts next (that sequence's last ones) in ascending order, not in the descending order
    they were freed in. Blocks it will grow into are claimed after its run, so the run starts
    that many earlier: those are evicted now, the claimed ones when it grows."""
    for growth, taken, claimed, a_hits in ((0, [3, 4, 5], [], 3), (4, [2, 3, 4], [5], 2)):
        bm = BlockManager(16, 4, True)
        a = _seq(range(24))  # blocks 0-5
        _run(bm, a)
        _run(bm, _seq(range(100, 140)))  # blocks 6-15: the pool is full
        bm.release(a)  # freed 5, 4, ..., 0: 5 is the oldest
        b = _seq(range(200, 212))  # 3 blocks now: LRU would evict 5, 4 and 3
        b.params, b.num_output_tokens = SimpleNamespace(max_tokens=growth), 0
        _run(bm, b)
        assert b.block_table == taken
        assert sorted(bm.free.claimed_by) == claimed
        assert len(bm.find_cached_prefix(_seq(range(25)))) == a_hits  # a's head survives


def test_claimed_blocks_are_left_to_their_sequence():
    """The blocks after a growing sequence's last are claimed for it: another sequence starts
    its run elsewhere, and the first one grows in place."""
    bm = BlockManager(16, 4, False)
    a = _seq(range(4))
    a.params, a.num_output_tokens = SimpleNamespace(max_tokens=8), 0
    _run(bm, a)  # block 0, blocks 1-2 claimed for its 8 more tokens
    assert sorted(bm.free.claimed_by) == [1, 2]
    b = _seq(range(100, 104))
    _run(bm, b)
    assert b.block_table == [3]
    bm.append(a, 8)
    assert a.block_table == [0, 1, 2]
    bm.release(a)
    bm.release(b)
    assert not bm.free.claimed_by and not bm.free.claims


def test_claims_are_soft_when_only_claimed_blocks_are_free():
    """A claim never costs another sequence its admission: with every free block claimed, a
    new sequence takes claimed ones."""
    bm = BlockManager(4, 4, False)
    a = _seq(range(4))
    a.params, a.num_output_tokens = SimpleNamespace(max_tokens=100), 0
    _run(bm, a)  # block 0; blocks 1-3 claimed for its growth
    assert sorted(bm.free.claimed_by) == [1, 2, 3]
    b = _seq(range(100, 108))
    assert bm.can_admit([], 8)
    _run(bm, b)
    assert sorted(b.block_table) == b.block_table and len(b.block_table) == 2
    assert set(b.block_table) <= {1, 2, 3} and not set(b.block_table) & set(bm.free.claimed_by)
    bm.release(a)
    bm.release(b)
    assert bm.num_free_blocks == 4 and not bm.free.claimed_by and not bm.free.claims


def test_a_prefix_hit_on_a_claimed_block_ends_the_claim():
    """A cached free block claimed for a growing sequence can still be hit by a prefix: the
    claim then goes (the hit sequence holds the block, the claimant grows elsewhere)."""

    def seq(tokens, max_tokens):
        s = _seq(tokens)
        s.params, s.num_output_tokens = SimpleNamespace(max_tokens=max_tokens), 0
        return s

    bm = BlockManager(4, 4, True)
    filler, old, keeper = seq(range(300, 304), 0), seq(range(8), 0), seq(range(400, 404), 0)
    for s in (filler, old, keeper):
        _run(bm, s)  # blocks 0, 1-2, 3; nothing claimed
    bm.release(filler)
    bm.release(old)  # 1 and 2 cache old's prefix
    a = seq(range(100, 104), 8)
    _run(bm, a)
    assert a.block_table == [0] and sorted(bm.free.claimed_by) == [1, 2]
    bm.release(keeper)
    hit = seq(range(9), 0)
    assert _run(bm, hit) == [1, 2]
    assert not bm.free.claimed_by and not bm.free.claims.get(id(a))
    for s in (a, hit):
        bm.release(s)
    assert bm.num_free_blocks == 4 and not bm.free.claimed_by and not bm.free.claims
