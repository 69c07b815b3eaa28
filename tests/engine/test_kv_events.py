"""KV events: the block pool records exactly what its cache map gains and loses; the log
coalesces, bounds and re-sends them; the shared hash function gives the engine's hashes."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_block_tokens, max_cached_blocks, prompt_block_hashes
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEventLog
from engine.request import Request
from engine.sampling_params import SamplingParams

H = [bytes([i]) * 16 for i in range(10)]  # stand-in hashes


def drain(log: KVEventLog) -> tuple[bool, set[bytes], set[bytes]]:
    """Everything pending, acknowledged: (reset, stored, removed)."""
    batch = log.take(1 << 20)
    assert batch is not None
    log.ack(batch)
    assert not log.has_pending()
    return batch.reset, set(batch.stored), set(batch.removed)


def test_prompt_block_hashes_are_the_engines_request_hashes() -> None:
    tokens = list(range(100, 150))  # 50 tokens: 3 full blocks of 16, the last one may hit only if 49+ tokens
    kv = KVCacheManager(num_blocks=8, block_size=16)
    request = Request("r", tokens, SamplingParams(max_tokens=2))
    kv.get_computed_blocks(request)  # computes the hashes a hit can cover
    assert prompt_block_hashes(tokens, 16) == request.block_hashes == [
        hash_block_tokens(None, tokens[:16]),
        hash_block_tokens(hash_block_tokens(None, tokens[:16]), tokens[16:32]),
        request.block_hashes[2],
    ]
    assert [max_cached_blocks(n, 16) for n in (1, 16, 17, 32, 33)] == [0, 0, 1, 1, 2]
    assert prompt_block_hashes(tokens[:33], 16) == request.block_hashes[:2]
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes(tokens, 0)


def test_the_pool_records_each_publish_and_eviction_and_nothing_else() -> None:
    pool = BlockPool(3)
    assert drain(pool.events) == (True, set(), set())  # the first batch starts from scratch
    a, b = pool.allocate(2)
    pool.cache(a, H[0])
    pool.cache(b, H[1])
    pool.cache(b, H[2])  # already has a hash: write-once, no event
    (c,) = pool.allocate(1)
    pool.cache(c, H[0])  # an identical block is published: c stays private, no event
    assert drain(pool.events) == (False, {H[0], H[1]}, set())
    pool.free([b, a, c])  # free queue: b, a, c (b evicted first)
    pool.allocate(1)  # evicts b
    pool.allocate(1)  # evicts a
    assert drain(pool.events) == (False, set(), {H[1], H[0]})
    pool.allocate(1)  # c was never published: no event
    assert not pool.events.has_pending() and pool.events.cached_hashes() == set()
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_changes_coalesce_to_each_hashs_state_now() -> None:
    log = KVEventLog(max_pending=100)
    drain(log)
    log.stored(H[0])
    log.removed(H[0])
    log.stored(H[1])
    log.removed(H[2])
    log.stored(H[2])
    batch = log.take(10)
    assert batch.items == ((H[0], False), (H[1], True), (H[2], True))
    assert batch.stored == [H[1], H[2]] and batch.removed == [H[0]] and not batch.reset


def test_an_unacknowledged_batch_is_taken_again_and_an_ack_keeps_newer_changes() -> None:
    log = KVEventLog(max_pending=100)
    drain(log)
    for h in H[:3]:
        log.stored(h)
    first = log.take(2)  # bounded, oldest first
    assert first.items == ((H[0], True), (H[1], True))
    again = log.take(2)  # the first beat failed: the same changes, a higher seq
    assert again.items == first.items and again.seq == first.seq + 1
    log.removed(H[1])  # changed after it was taken
    log.ack(again)
    assert log.take(10).items == ((H[1], False), (H[2], True))


def test_a_resync_resends_the_whole_cache_and_ignores_acks_from_before() -> None:
    log = KVEventLog(max_pending=100)
    drain(log)
    for h in H[:3]:
        log.stored(h)
    log.removed(H[1])
    stale = log.take(10)
    log.resync()  # a new registration
    log.ack(stale)  # answered after the resync: acknowledges nothing
    batch = log.take(1)
    assert batch.reset and batch.items == ((H[0], True),)
    log.ack(batch)
    rest = log.take(10)
    assert not rest.reset and rest.items == ((H[2], True),)


def test_too_many_pending_changes_turn_into_a_resync() -> None:
    log = KVEventLog(max_pending=4)
    drain(log)
    log.stored(H[0])
    log.stored(H[1])
    for h in H[2:5]:  # the gateway stopped listening: 5 pending hashes
        log.stored(h)
        log.removed(h)
    assert log.num_overflows == 1  # at H[4]'s store: pending became the cache, H[4] then left it
    assert drain(log) == (True, {H[0], H[1]}, {H[4]})
    with pytest.raises(ValueError, match="max_pending"):
        KVEventLog(0)
    with pytest.raises(ValueError, match="max_events"):
        log.take(0)
