"""GlooChannel between two channels in this process: data, order, framing, failure, close."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from plumbing.transport import TransferCancelled, TransportError, TransportKind
from plumbing.transport.gloo import GlooChannel, GlooRendezvous, connect_gloo

Pair = tuple[GlooChannel, GlooChannel]

GUARD_S = 60.0  # result() bound so a bug fails the test instead of hanging it


def roundtrip(pair: Pair, tensor: torch.Tensor) -> torch.Tensor:
    sender, receiver = pair
    out = torch.empty_like(tensor)
    received = receiver.recv(out)
    sender.send(tensor).result(GUARD_S)
    received.result(GUARD_S)
    return out


def test_pair_identity(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    assert (sender.kind, sender.rank, receiver.rank) == (TransportKind.GLOO, 0, 1)
    assert not sender.broken and not receiver.broken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(1,), (7, 3), (2, 2, 5, 16, 2, 32), (1 << 20,)])
def test_roundtrip_is_exact(
    gloo_pair: Callable[..., Pair], dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    tensor = (torch.randn(shape, generator=generator) * 100).to(dtype)
    assert torch.equal(roundtrip(gloo_pair(), tensor), tensor)


def test_zero_size_tensors_pass_and_keep_order(gloo_pair: Callable[..., Pair]) -> None:
    pair = gloo_pair()
    assert roundtrip(pair, torch.empty(0)).shape == (0,)
    assert roundtrip(pair, torch.empty(3, 0, 2, dtype=torch.bfloat16)).shape == (3, 0, 2)
    assert torch.equal(roundtrip(pair, torch.arange(5.0)), torch.arange(5.0))


def test_many_ops_arrive_in_call_order(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    sizes = [(i * 37) % 1000 + 1 for i in range(300)]
    sent = [torch.full((n,), float(i)) for i, n in enumerate(sizes)]
    outs = [torch.empty(n) for n in sizes]
    recv_futures = [receiver.recv(out) for out in outs]  # all posted before any send
    send_futures = [sender.send(t) for t in sent]
    for future in send_futures + recv_futures:
        future.result(GUARD_S)
    for i, out in enumerate(outs):
        assert torch.equal(out, sent[i]), f"op {i}"


def test_both_directions_at_once(gloo_pair: Callable[..., Pair]) -> None:
    left, right = gloo_pair()
    forward = [torch.full((1000,), float(i)) for i in range(50)]
    backward = [torch.full((500,), -float(i)) for i in range(50)]
    got_forward = [torch.empty(1000) for _ in forward]
    got_backward = [torch.empty(500) for _ in backward]
    futures = [right.recv(t) for t in got_forward] + [left.recv(t) for t in got_backward]
    futures += [left.send(t) for t in forward] + [right.send(t) for t in backward]
    for future in futures:
        future.result(GUARD_S)
    assert all(torch.equal(a, b) for a, b in zip(forward, got_forward, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(backward, got_backward, strict=True))


def test_several_pairs_concurrently_in_one_process(gloo_pair: Callable[..., Pair]) -> None:
    pairs = [gloo_pair() for _ in range(4)]
    errors: list[BaseException] = []

    def stream(index: int, pair: Pair) -> None:
        try:
            sender, receiver = pair
            outs = [torch.empty(4096) for _ in range(30)]
            futures = [receiver.recv(out) for out in outs]
            for step in range(30):
                sender.send(torch.full((4096,), float(index * 1000 + step)))
            for step, future in enumerate(futures):
                future.result(GUARD_S)
                assert torch.equal(outs[step], torch.full((4096,), float(index * 1000 + step)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i, p)) for i, p in enumerate(pairs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD_S)
    assert errors == []


def test_sends_from_many_caller_threads_are_all_delivered(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    outs = [torch.empty(256) for _ in range(64)]
    recv_futures = [receiver.recv(out) for out in outs]
    callers = [
        threading.Thread(target=lambda k=k: [sender.send(torch.full((256,), float(k * 16 + j)))
                                             for j in range(16)])
        for k in range(4)
    ]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(GUARD_S)
    for future in recv_futures:
        future.result(GUARD_S)
    # Each caller's own sends stay in its call order; all 64 arrive exactly once.
    firsts = sorted(float(out[0]) for out in outs)
    assert firsts == [float(v) for v in range(64)]
    for k in range(4):
        mine = [float(out[0]) for out in outs if k * 16 <= float(out[0]) < (k + 1) * 16]
        assert mine == sorted(mine)


def test_size_mismatch_breaks_both_sides_cleanly(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    received = receiver.recv(torch.empty(4))
    sent = sender.send(torch.ones(5))
    with pytest.raises(TransportError, match="size mismatch"):
        sent.result(GUARD_S)
    assert isinstance(received.exception(GUARD_S), TransportError)
    assert sender.broken and receiver.broken
    assert "size mismatch" in (sender.failure or "")


def test_cancel_marker_fails_one_recv_and_keeps_channel(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    first, second = receiver.recv(torch.empty(8)), receiver.recv(torch.empty(3))
    sender.send_cancel().result(GUARD_S)
    with pytest.raises(TransferCancelled):
        first.result(GUARD_S)
    sender.send(torch.arange(3.0)).result(GUARD_S)
    second.result(GUARD_S)
    assert not receiver.broken and not sender.broken
    assert torch.equal(roundtrip((sender, receiver), torch.ones(2)), torch.ones(2))


def test_invalid_tensors_raise_value_error_and_do_not_break(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    with pytest.raises(ValueError, match="contiguous"):
        sender.send(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="torch.Tensor"):
        receiver.recv([1.0, 2.0])  # type: ignore[arg-type]
    assert not sender.broken and not receiver.broken
    assert torch.equal(roundtrip((sender, receiver), torch.ones(3)), torch.ones(3))


def test_futures_cannot_be_cancelled(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    pending = receiver.recv(torch.empty(2))
    assert pending.cancel() is False
    sender.send(torch.ones(2)).result(GUARD_S)
    pending.result(GUARD_S)


def test_recv_without_send_times_out_and_breaks(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair(timeout_s=1.0)
    pending = receiver.recv(torch.empty(2))
    queued = receiver.recv(torch.empty(2))
    with pytest.raises(TransportError, match="broken"):
        pending.result(GUARD_S)
    assert isinstance(queued.exception(GUARD_S), TransportError)
    assert receiver.broken
    assert isinstance(receiver.send(torch.ones(1)).exception(GUARD_S), TransportError)


def test_close_fails_pending_futures_and_is_idempotent(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    pending = [receiver.recv(torch.empty(16)) for _ in range(5)]
    receiver.close()
    for future in pending:
        with pytest.raises(TransportError, match="closed"):
            future.result(GUARD_S)
    assert receiver.broken and receiver.failure is None  # closed, not failed
    assert receiver.join(GUARD_S)
    receiver.close()
    later = receiver.recv(torch.empty(1))
    assert later.done() and isinstance(later.exception(), TransportError)


def test_closing_one_side_breaks_the_peer(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    pending = receiver.recv(torch.empty(16))
    sender.close()
    assert isinstance(pending.exception(GUARD_S), TransportError)
    assert receiver.broken


def test_close_with_ops_in_flight_frees_threads_and_peer_before_the_timeout(
    gloo_pair: Callable[..., Pair],
) -> None:
    # With a 600 s op timeout, only an active interrupt gets these done within GUARD_S.
    left, right = gloo_pair(timeout_s=600.0)
    in_flight = right.recv(torch.empty(16))
    peer_in_flight = left.recv(torch.empty(16))  # the other direction, on the peer
    right.close()
    assert isinstance(in_flight.exception(GUARD_S), TransportError)
    assert right.join(GUARD_S)
    assert isinstance(peer_in_flight.exception(GUARD_S), TransportError)
    assert left.broken


def test_rendezvous_is_single_use_and_times_out_without_peer() -> None:
    rendezvous = GlooRendezvous("127.0.0.1", timeout_s=0.5)
    assert rendezvous.port > 0
    with pytest.raises(TransportError, match="rank 0"):
        rendezvous.accept()
    with pytest.raises(TransportError, match="already accepted"):
        rendezvous.accept()


def test_connect_to_nothing_is_a_transport_error() -> None:
    rendezvous = GlooRendezvous("127.0.0.1", timeout_s=0.5)
    port = rendezvous.port
    rendezvous.close()
    del rendezvous
    with pytest.raises(TransportError):
        connect_gloo("127.0.0.1", port, timeout_s=0.5)


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        GlooRendezvous("127.0.0.1", timeout_s=0)


def test_a_send_for_another_tag_never_fills_the_receive_and_breaks_both_sides(
    gloo_pair: Callable[..., Pair]
) -> None:
    """Same size, different transfer: the receiving tensor is never handed over as filled."""
    sender, receiver = gloo_pair()
    target = torch.zeros(6)
    received = receiver.recv(target, tag=11)
    sent = sender.send(torch.ones(6), tag=12)
    with pytest.raises(TransportError, match="tag mismatch"):
        sent.result(GUARD_S)
    with pytest.raises(TransportError, match="tag mismatch"):
        received.result(GUARD_S)
    assert torch.equal(target, torch.zeros(6))  # no DATA was sent after the READY frame's tag
    assert sender.broken and receiver.broken


def test_matching_tags_deliver_and_a_cancel_carries_its_tag(gloo_pair: Callable[..., Pair]) -> None:
    sender, receiver = gloo_pair()
    tag = -(1 << 63)  # any int64
    out = torch.zeros(4)
    got = receiver.recv(out, tag=tag)
    sender.send(torch.arange(4.0), tag=tag).result(GUARD_S)
    got.result(GUARD_S)
    assert torch.equal(out, torch.arange(4.0))
    cancelled = receiver.recv(torch.zeros(2), tag=5)
    sender.send_cancel(tag=5).result(GUARD_S)
    with pytest.raises(TransferCancelled):
        cancelled.result(GUARD_S)
    assert not sender.broken and not receiver.broken
    with pytest.raises(ValueError, match="int64"):
        sender.send(torch.ones(1), tag=1 << 63)
