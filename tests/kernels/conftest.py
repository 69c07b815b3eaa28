"""Kernel tests run the Triton kernels on CPU tensors under Triton's interpreter.

Triton 3.x reads ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``) in ``triton.jit``,
i.e. whenever a jit function is *defined*: Triton's own library functions (``tl.zeros``,
``tl.sum``, ...) when ``triton`` is imported, our kernels when ``kernels.*`` is imported.
So it must be set before anything imports triton in this process. It is set here; when a
test module collected earlier has already imported triton without it, collection stops
with an error saying so (set ``TRITON_INTERPRET=1`` in tests/conftest.py or the shell).
test_paged_attention.py::test_kernel_is_interpreted checks that it took effect.
"""

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

os.environ["TRITON_INTERPRET"] = "1"


def _triton_imported_without_interpreter() -> bool:
    standard = sys.modules.get("triton.language.standard")
    return standard is not None and type(standard.zeros).__name__ != "InterpretedFunction"


if _triton_imported_without_interpreter():
    raise RuntimeError(
        "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, so the "
        "kernels cannot run on CPU; set TRITON_INTERPRET=1 earlier (tests/conftest.py or the shell)"
    )

import pytest  # noqa: E402
import torch  # noqa: E402


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


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return make_paged_batch
