"""Paged KV memory: a pool of fixed-size blocks, per-request block tables, prefix caching.

Vocabulary
----------
* block: ``block_size`` token slots of K/V in every layer; ``block_id`` indexes the cache.
* ref_cnt: how many running requests hold the block. 0 means the block sits in the free
  queue (it may still carry a hash, i.e. be *cached*, and be revived by a prefix hit).
* block hash: set once, when every slot of the block holds computed K/V. It chains the
  parent's hash with the block's token ids, so equal hashes mean equal prefixes.

Free queue order (LRU eviction)
-------------------------------
::

    head (evicted first)                                   tail (evicted last)
    [ never-used / evicted ... least recently freed ... most recently freed ]

A request's blocks are freed tail-first (last block first), so the end of a prompt is
evicted before its shared beginning. ``popleft`` takes the head; a prefix hit removes a
block from the middle in O(1) (doubly linked list).

Every change of the cache map (a hash published, a published block evicted) is recorded in
``events`` (``engine/kv_events.py``), which a worker ships to the gateway's prefix index.

Ownership invariant (``check_integrity``): every block is either in the free queue with
ref_cnt 0, or outside it with ref_cnt equal to the number of request tables holding it;
a hash maps to exactly one block and that block carries that hash.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_hash import BlockHash, hash_block_tokens
from engine.kv_events import KVEventLog

__all__ = ["BlockHash", "BlockPool", "FreeBlockQueue", "KVBlock", "hash_block_tokens"]


class KVBlock:
    """One block's bookkeeping. Mutated only by ``BlockPool``."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "plain"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next evicted) to tail. O(n): tests and checks only."""
        ids: list[int] = []
        node = self._head.next
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next
        return ids


class BlockPool:
    """Owns every ``KVBlock``: allocation, reference counts, the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events = KVEventLog(max_pending=2 * num_blocks + 1024)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached-but-unreferenced included)."""
        return self.free_queue.num_free_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` from the head of the free queue (evicting cached ones)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving them from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock], unpublish: bool = False) -> None:
        """Drop one reference on each block, in the given order (first freed = first evicted).
        ``unpublish``: a block left with no holder leaves the prefix cache at once."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if unpublish:
                    self._evict(block)
                self.free_queue.append(block)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a full, computed block under its hash (write-once)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already published; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.events.stored(block_hash)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.events.removed(block.block_hash)
            block.block_hash = None

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise ``RuntimeError`` if the pool's bookkeeping is inconsistent.

        ``expected_refs`` maps block id -> number of holders known to the caller; blocks
        absent from it must be free.
        """
        free_ids = self.free_queue.block_ids()
        if len(free_ids) != self.free_queue.num_free_blocks or len(set(free_ids)) != len(free_ids):
            raise RuntimeError("free queue is corrupt (count mismatch or duplicate block)")
        free_set = set(free_ids)
        expected = expected_refs or {}
        for block in self.blocks:
            want = expected.get(block.block_id, 0)
            if block.ref_cnt != want:
                raise RuntimeError(f"{block!r}: ref_cnt {block.ref_cnt}, holders {want}")
            if (block.block_id in free_set) != (want == 0):
                raise RuntimeError(f"{block!r}: free-queue membership disagrees with refs")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"{block!r}: cache map and block hash disagree")
        if self.events.cached_hashes() != self.cached.keys():
            raise RuntimeError("the KV event log's view of the cache map disagrees with the map")
