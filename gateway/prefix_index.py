"""The gateway's view of one worker's prefix cache, learnt from its KV events.

A worker's heartbeats carry ``KVEvents`` (``gateway.proto``): the block hashes its prefix
cache published and evicted. The hashes are the engine's (``engine/block_hash.py``), so
the gateway hashes a prompt's token ids the same way and counts how many of its leading
blocks the worker holds: exactly the hit the worker's scheduler will find, as long as every
event arrived and nothing changed in between. It is advice for routing only; the worker's
own cache decides what hits.

One ``PrefixIndex`` per registered worker (a restarted worker registers again and starts
from an empty one); owned by the event loop, like the registry.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_hash import BlockHash, prompt_block_hashes
from splitserve_api.v1 import gateway_pb2


class PrefixIndex:
    """The block hashes one worker reported as cached."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size  # 0: the worker's layout is unknown, nothing is indexed
        self.capacity = capacity  # the worker's kv_blocks_total: its cache holds no more hashes
        self.last_seq = 0
        self._hashes: set[BlockHash] = set()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._hashes

    def check(self, events: gateway_pb2.KVEvents, field: str) -> None:
        """ValueError naming ``field`` if applying ``events`` would leave more hashes than
        the worker has blocks (no true cache can), or the worker has no block size."""
        if self.block_size < 1:
            raise ValueError(f"{field}: the worker registered no kv_layout.block_size, so its blocks cannot be indexed")
        base = set() if events.reset else self._hashes
        num_after = len(base) + sum(1 for h in set(events.stored) if h not in base) \
            - sum(1 for h in set(events.removed) if h in base)
        if num_after > self.capacity:
            raise ValueError(f"{field}: {num_after} cached block hashes claimed, the pool has {self.capacity} blocks")

    def apply(self, events: gateway_pb2.KVEvents) -> bool:
        """Apply a checked batch; False (and no change) for a late one (seq not above the
        last applied)."""
        if events.seq <= self.last_seq:
            return False
        self.last_seq = events.seq
        if events.reset:
            self._hashes = set()
        self._hashes.difference_update(events.removed)
        self._hashes.update(events.stored)
        return True

    def num_hit_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a prompt (its ``prompt_block_hashes``) are cached here."""
        for i, block_hash in enumerate(hashes):
            if block_hash not in self._hashes:
                return i
        return len(hashes)


def prompt_hashes(token_ids: Sequence[int], block_size: int,
                  cache: dict[tuple[int, int], list[BlockHash]]) -> list[BlockHash]:
    """A prompt's block hashes for ``block_size``, computed once per size and length
    (``cache``; a migrated request's prompt grows by the tokens it sent)."""
    key = (block_size, len(token_ids))
    hashes = cache.get(key)
    if hashes is None:
        hashes = cache[key] = prompt_block_hashes(token_ids, block_size)
    return hashes
