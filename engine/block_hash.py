"""Chained block hashes: the prefix cache's keys, computed the same way wherever they are
needed (the engine's block pool, and the gateway's per-worker prefix index for KV-aware
routing). Pure Python (``hashlib``, ``array``): importing this module never imports torch.

A block's hash covers its parent's hash and its ``block_size`` token ids, so equal hashes
mean equal prefixes up to and including that block::

    tokens:  t0 .. t15 | t16 .. t31 | t32 .. t40 (partial: no hash)
    hashes:  h0 = H(ROOT || t0..t15)   h1 = H(h0 || t16..t31)

``H`` is BLAKE2b with a 16-byte digest over the parent hash followed by the token ids as
little-endian signed 64-bit integers; the root parent is 16 zero bytes. The byte order is
fixed, so a gateway and a worker on different machines compute the same hashes.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes
BLOCK_HASH_BYTES = 16
ROOT_HASH: BlockHash = b"\x00" * BLOCK_HASH_BYTES


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained 128-bit hash of a full block: H(parent hash || token ids)."""
    h = hashlib.blake2b(parent_hash or ROOT_HASH, digest_size=BLOCK_HASH_BYTES)
    ids = array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    h.update(ids.tobytes())
    return h.digest()


def max_cached_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a prompt a prefix-cache hit can cover: the last
    prompt token always runs through the model (its logits give the first output token),
    so a hit leaves at least one token to compute."""
    return max(0, (num_prompt_tokens - 1) // block_size)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hashes of the blocks of ``token_ids`` that a prefix-cache hit can cover
    (``max_cached_blocks`` of them), in order."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(max_cached_blocks(len(token_ids), block_size)):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
