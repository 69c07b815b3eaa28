"""Block pool and per-request tables: exact block ids, LRU eviction order, integrity."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, token_ids, SamplingParams(max_tokens=4))


def test_free_queue_is_o1_linked_list() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 4, 2]
    with pytest.raises(ValueError):
        q.remove(blocks[0])


def test_hash_chains_parent() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert len(a) == 16


def test_allocate_and_free_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.check_integrity()
    kv.free(r)
    # Freed tail first: block 2 is evicted before block 0.
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    kv.check_integrity()


def test_allocate_fails_without_change_when_full() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.block_ids("a") == [] and kv.num_free_blocks == 2
    kv.check_integrity()


def test_prefix_cache_hit_after_compute_and_eviction_lru() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)  # blocks 0, 1 are full -> published; block 2 partial
    assert len(kv.pool.cached) == 2
    b = make_request("b", list(range(8)) + [99, 98, 97])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    # Cached blocks survive in the free queue until evicted; 4, 5 were never used.
    assert kv.pool.free_queue.block_ids() == [4, 5, 2, 3, 1, 0]
    c = make_request("c", [7] * 20)
    assert kv.allocate_slots(c, 20)  # needs 5 blocks: evicts 2, 3, then cached 1
    assert kv.block_ids("c") == [4, 5, 2, 3, 1]
    assert len(kv.pool.cached) == 1  # block 0 (first prefix block) is the last evicted
    kv.free(c)
    kv.check_integrity()


def test_full_prompt_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    b = make_request("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4  # the last block is recomputed so the last token yields logits
    kv.free(a)
    kv.check_integrity()


def test_integrity_detects_leak_and_double_free() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.check_integrity({})  # held blocks not declared: a leak
    pool.check_integrity({0: 1, 1: 1})
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)


def test_revived_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    kv.free(a)  # both blocks cached, free (ref 0); block 2 plain free
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # b needs 4 blocks: 2 hits + 2 new, but only block 2 is free once hits are revived.
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.num_free_blocks == 3
    kv.check_integrity()


def test_hold_keeps_prompt_blocks_and_frees_the_rest_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(6)))
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    for t in (50, 51, 52, 53):  # 4 output tokens: 10 tokens, 3 blocks
        a.append_output_token(t)
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)  # blocks 0, 1 full -> published
    kv.hold(a, a.num_prompt_tokens)
    assert kv.held_block_ids("a") == [0, 1] and "a" not in kv.req_to_blocks
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2]
    kv.check_integrity()
    b = make_request("b", list(range(4)) + [9, 9])  # shares held block 0
    hits, _ = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0] and kv.allocate_slots(b, 2, hits)
    assert kv.pool.blocks[0].ref_cnt == 2
    kv.check_integrity()
    assert kv.release("a") and not kv.release("a")
    assert kv.pool.blocks[0].ref_cnt == 1 and kv.pool.free_queue.block_ids()[-1] == 1
    kv.free(b)
    kv.check_integrity()
    with pytest.raises(ValueError, match="request_id"):
        kv.held_block_ids("a")


def test_reserve_takes_the_head_and_admission_publishes() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]  # 1 and 0 cached
    assert kv.reserve(make_request("big", [7] * 25)) is None  # 7 blocks: not now, and no change
    assert kv.num_free_blocks == 6 and not kv.req_to_blocks
    r = make_request("r", [7] * 20)
    assert kv.reserve(r) == [2, 3, 4, 5, 1]  # no hit; evicts cached block 1, keeps 0
    assert kv.fresh_block_ids("r") == [2, 3, 4, 5, 1] and r.num_computed_tokens == r.num_cached_tokens == 0
    assert list(kv.pool.cached.values()) == [kv.pool.blocks[0]]
    kv.check_integrity(["r"])
    kv.free(r)
    assert kv.pool.free_queue.block_ids() == [0, 1, 5, 4, 3, 2]
    r = make_request("r", list(range(9)))
    assert kv.reserve(r) == [0, 1, 5]  # block 0 is a hit (tokens 0-3), then the head of the queue
    assert kv.fresh_block_ids("r") == [1, 5] and r.num_computed_tokens == r.num_cached_tokens == 4
    kv.check_integrity(["r"])
    r.num_computed_tokens = 9  # the received prompt
    kv.cache_computed_blocks(r)  # block 1 is full: published after the hit
    assert kv.block_ids("r") == [0, 1, 5]
    c = make_request("c", list(range(8)) + [7])
    hits, num_hit = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    kv.check_integrity()
    kv.free(r)
    kv.check_integrity()
