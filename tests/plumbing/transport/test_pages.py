"""Chunked, pipelined page transfers over a Gloo pair: chunks land in order and exactly,
staging buffers are reused only after their op succeeded, a failed pack cancels the rest."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plumbing.transport import TransferCancelled
from plumbing.transport.gloo import GlooChannel
from plumbing.transport.pages import StagingPool, chunk_blocks_for, chunk_ranges, send_chunks

Pair = tuple[GlooChannel, GlooChannel]
GUARD_S = 60.0
TAG = 0x5EED


def test_chunk_ranges() -> None:
    assert chunk_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_ranges(10, 0) == [(0, 10)]
    assert chunk_ranges(3, 8) == [(0, 3)]
    assert chunk_blocks_for(4096, 2 << 20) == 512 and chunk_blocks_for(1 << 22, 1 << 20) == 1
    with pytest.raises(ValueError):
        chunk_ranges(-1, 2)


def test_pool_reuses_only_returned_buffers() -> None:
    pool = StagingPool(max_kept_per_shape=1)
    a = pool.take((2, 3), torch.float32)
    b = pool.take((2, 3), torch.float32)
    assert a is not b and pool.num_allocated == 2
    pool.give(a)
    pool.give(b)  # beyond the cap: dropped
    assert pool.take((2, 3), torch.float32) is a
    assert pool.take((3, 2), torch.float32) is not b and pool.num_allocated == 3


def test_chunks_arrive_in_order_and_buffers_are_reused(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    source = torch.randn(2, 2, 11, 4, generator=torch.Generator().manual_seed(3))
    chunks = chunk_ranges(11, 3)
    pool = StagingPool()
    allocated = []
    for _ in range(2):  # the second transfer reuses the first one's staging buffers
        outs = [torch.empty(2, 2, n, 4) for _, n in chunks]
        recvs = [receiver.recv(out, tag=TAG) for out in outs]
        last = send_chunks(sender, chunks, TAG, pool, lambda n: (2, 2, n, 4), torch.float32,
                           lambda start, n, out: out.copy_(source[:, :, start:start + n]))
        last.result(GUARD_S)
        for future in recvs:
            future.result(GUARD_S)
        assert torch.equal(torch.cat(outs, dim=2), source)
        flush = receiver.recv(torch.empty(0))  # its send runs after the last chunk's callbacks
        sender.send(torch.empty(0)).result(GUARD_S)
        flush.result(GUARD_S)
        allocated.append(pool.num_allocated)
    # Without reuse the two transfers would have made 8 buffers; with it, never more than the
    # 4 chunks one transfer can have out at once (how many depends on the threads' timing).
    assert 2 <= allocated[0] <= allocated[1] <= 4
    assert not sender.broken and not receiver.broken


def test_a_failed_pack_cancels_the_chunks_left(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    chunks = chunk_ranges(6, 2)
    outs = [torch.empty(2, 4) for _ in chunks]
    recvs = [receiver.recv(out, tag=TAG) for out in outs]

    def pack(start: int, n: int, out: torch.Tensor) -> None:
        if start == 2:
            raise RuntimeError("pack failed")
        out.fill_(1.0)

    with pytest.raises(RuntimeError, match="pack failed"):
        send_chunks(sender, chunks, TAG, StagingPool(), lambda n: (n, 4), torch.float32, pack)
    recvs[0].result(GUARD_S)
    for future in recvs[1:]:
        with pytest.raises(TransferCancelled):
            future.result(GUARD_S)
    assert not sender.broken and not receiver.broken  # the pair is still in order
    out = torch.empty(3)
    got = receiver.recv(out, tag=1)
    sender.send(torch.arange(3.0), tag=1).result(GUARD_S)
    got.result(GUARD_S)
    assert torch.equal(out, torch.arange(3.0))
