"""Per-request block tables over a ``BlockPool``, with prefix-cache lookups.

Layout of one request's blocks (``block_size`` = 4 in this picture)::

    all_token_ids:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 __ __
    blocks:         [ block 7 ] | [ block 2 ] | [ block 9 ]
                    cached/hash   cached/hash   partial (no hash yet)
    num_computed_tokens = 10 ───────────────────────────┘

``allocate_slots(request, n)`` grows the table so that ``num_computed_tokens + n`` tokens
fit. Blocks are published to the prefix cache only after the step that computed them
(``cache_computed_blocks``), so a prefix hit never points at K/V that is not written yet.

Block tables for KV transfer between a prefill and a decode worker::

    prefill worker:  running table --finish (hold_kv)--> held --release--> free
    decode worker:   free --reserve--> a WAITING_FOR_REMOTE_KVS request's table --admission--> running
                                          |
                                          +--free (failed hand-off, abort)--> free

A reserved table may start with prefix-cache hits (``reserve(request)``)::

    blocks:  [ hit ][ hit ] | [ fresh ][ fresh ][ fresh (partial) ]
             num_published    the pages that travel (private, written once: ``fresh_block_ids``)

Each table has exactly one holder: ``req_to_blocks`` (a request in the scheduler, whatever
its status: a reserved one is the table of a request WAITING_FOR_REMOTE_KVS; the hand-off's
own state is the decode worker's ``Reservation``) or ``held`` (finished prefill requests
whose prompt pages await transfer). Held blocks are referenced, so they are never handed
out or evicted; a reserved table's fresh blocks are private (unpublished) until admission.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.block_hash import hash_block_tokens, max_cached_blocks, prompt_block_hashes
from engine.block_pool import BlockPool, KVBlock
from engine.request import Request


class KVCacheManager:
    """Owns the mapping request -> blocks (request and held tables). Not thread-safe: the
    engine thread drives it (``fresh_block_ids`` aside, as it says)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}
        self.held: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks (no mutation). Leaves >= 1 token to compute,
        since the last prompt token must run through the model to produce logits."""
        if not self.pool.enable_prefix_caching:
            return [], 0
        max_hit_blocks = max_cached_blocks(request.num_tokens, self.block_size)
        hits: list[KVBlock] = []
        for block_hash in self._extend_hashes(request, max_hit_blocks)[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (and no change) if the pool
        cannot. ``new_computed_blocks`` are prefix hits taken on first admission."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = self.blocks_needed(total_tokens) - len(blocks) - len(new_computed_blocks)
        # Hits that sit unreferenced in the free queue stop being allocatable once touched.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks = blocks + list(new_computed_blocks)
            self._num_published[request.request_id] = len(blocks)
        if num_needed > 0:
            blocks = blocks + self.pool.allocate(num_needed)
        self.req_to_blocks[request.request_id] = blocks
        self._num_published.setdefault(request.request_id, 0)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose K/V are computed (after a step)."""
        if not self.pool.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        # A block is hashed over its tokens, so only blocks whose tokens are all known count
        # (computed slots may run ahead of the tokens: accepted drafts, a stop mid-drafts).
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_computed // self.block_size, len(blocks))
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._extend_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_published[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back blocks beyond those holding the first ``num_tokens`` tokens, tail first
        (lookahead slots of rejected draft tokens). Published blocks are never trimmed."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        keep = max(self.blocks_needed(num_tokens), self._num_published.get(request.request_id, 0))
        if keep < len(blocks):
            self.pool.free(list(reversed(blocks[keep:])))
            del blocks[keep:]

    def free(self, request: Request, unpublish: bool = False) -> None:
        """Release every block of the request, last block first (evicted first).
        ``unpublish``: blocks no other request holds leave the prefix cache too."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)), unpublish=unpublish)

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    # -- held blocks (prefill worker) -------------------------------------------------
    def hold(self, request: Request, num_tokens: int) -> None:
        """Move a finished request's table to ``held``, keeping the blocks of its first
        ``num_tokens`` tokens and freeing the rest (tail first). Blocks it published stay in
        the prefix cache; being referenced, they cannot be evicted while held."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        keep = self.blocks_needed(num_tokens)
        if len(blocks) < keep:
            raise RuntimeError(
                f"{request.request_id!r}: holding {num_tokens} tokens needs {keep} blocks, "
                f"the request has {len(blocks)}"
            )
        self.pool.free(list(reversed(blocks[keep:])))
        self.held[request.request_id] = blocks[:keep]

    def held_block_ids(self, request_id: str) -> list[int]:
        """Block ids held under ``request_id``, in token order; ValueError if none are."""
        blocks = self.held.get(request_id)
        if blocks is None:
            raise ValueError(f"request_id {request_id!r} holds no KV blocks")
        return [block.block_id for block in blocks]

    def release(self, request_id: str) -> bool:
        """Free the blocks held under ``request_id`` (last first). False if none are held."""
        blocks = self.held.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(list(reversed(blocks)))
        return True

    # -- reserved tables (decode worker) ----------------------------------------------
    def reserve(self, request: Request) -> list[int] | None:
        """Take the blocks of ``request``'s prompt as its table, for K/V another worker
        computes: the longest prefix-cache hit first (``prompt_block_hashes``: at least the
        last block is always fresh), then fresh blocks from the free queue (which may evict
        unreferenced cached ones, never a block a table holds). The hits count as computed
        and cached tokens of the request. None, and no change, if there are not enough now.
        The caller checks that the request id is new."""
        hits: list[KVBlock] = []
        if self.pool.enable_prefix_caching:
            for block_hash in prompt_block_hashes(request.prompt_token_ids, self.block_size):
                block = self.pool.lookup(block_hash)
                if block is None:
                    break
                hits.append(block)
        num_needed = self.blocks_needed(request.num_prompt_tokens) - len(hits)
        num_revived = sum(1 for block in hits if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(hits)
        blocks = hits + self.pool.allocate(num_needed)
        self.req_to_blocks[request.request_id] = blocks
        self._num_published[request.request_id] = len(hits)
        request.num_computed_tokens = request.num_cached_tokens = len(hits) * self.block_size
        return [block.block_id for block in blocks]

    def fresh_block_ids(self, request_id: str) -> list[int]:
        """The blocks after a reserved table's prefix-cache hits, where its pages go. Safe
        from another thread while the table is neither freed nor scheduled meanwhile (its
        block list does not change until then)."""
        blocks = self.req_to_blocks.get(request_id, [])
        return [block.block_id for block in blocks[self._num_published.get(request_id, 0):]]

    def holds_transfer(self, request_id: str) -> bool:
        """True if blocks are held under ``request_id`` for a transfer (prefill side)."""
        return request_id in self.held

    def check_integrity(self, reserved_ids: Sequence[str] = ()) -> None:
        """Every block's ref_cnt equals the number of tables holding it (request and held
        tables); the rest are free. The tables of ``reserved_ids`` (requests waiting for
        remote KV) start with published hits and end with private, unpublished blocks."""
        holders: Counter[int] = Counter()
        for blocks in [*self.req_to_blocks.values(), *self.held.values()]:
            holders.update(block.block_id for block in blocks)
        if self.req_to_blocks.keys() & self.held.keys():
            raise RuntimeError("a request id owns more than one kind of block table")
        for request_id in reserved_ids:
            blocks = self.req_to_blocks.get(request_id, [])
            num_hits = self._num_published.get(request_id, 0)
            if any(block.block_hash is not None or holders[block.block_id] != 1 for block in blocks[num_hits:]):
                raise RuntimeError(f"{request_id!r}: a fresh reserved block is published or shared")
            if any(block.block_hash is None for block in blocks[:num_hits]):
                raise RuntimeError(f"{request_id!r}: a reserved prefix hit is not published")
        self.pool.check_integrity(dict(holders))
