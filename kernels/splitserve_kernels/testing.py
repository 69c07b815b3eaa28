"""Seeded random inputs for checking the kernels against their references.

Shared by the kernel tests (tests/kernels) and the GPU check (``python -m bench.gpu``), so
both run the same cases: the tests on CPU under ``TRITON_INTERPRET=1``, the GPU check on
CUDA. Everything is drawn on the CPU from a seeded generator (the same values on every
machine) and moved with :meth:`PagedBatch.to` / ``tensor.to`` where a device is wanted.
Importing this module imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class PagedBatch:
    """A ragged batch laid out in a paged cache, plus the same context kept dense."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, 0-padded
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor]
    q_lens: list[int]

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )

    def to(self, device: torch.device | str) -> PagedBatch:
        """The same batch with every tensor on ``device``."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device)
            elif f.name in ("dense_k", "dense_v"):
                value = [t.to(device) for t in value]
            moved[f.name] = value
        return PagedBatch(**moved)


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random K/V/Q; every sequence gets distinct, shuffled blocks (block 0 included)."""
    assert len(q_lens) == len(seq_lens) and all(
        0 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True)
    )
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages_per_seq) + spare_blocks
    max_blocks = max(pages_per_seq) + 1  # one column of pure padding
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for s, n in enumerate(pages_per_seq):
        pages = order[used : used + n]
        used += n
        block_tables[s, :n] = pages.int()
        dense_k.append(k_cache[pages].reshape(-1, num_kv_heads, head_dim)[: seq_lens[s]].clone())
        dense_v.append(v_cache[pages].reshape(-1, num_kv_heads, head_dim)[: seq_lens[s]].clone())
    num_heads = num_kv_heads * queries_per_kv
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return PagedBatch(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        dense_k=dense_k,
        dense_v=dense_v,
        q_lens=list(q_lens),
    )


def make_write_kv_case(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key, value, k_cache, v_cache, slots)`` for ``write_kv``: random caches, half of
    their slots written in random order, every third token skipped (slot -1)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = num_blocks * block_size // 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # every third token is skipped
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return key, value, k_cache, v_cache, slots


def make_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> torch.Tensor:  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    """A random engine-layout KV cache (the pack / unpack kernels' input)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)
