"""The KV rendezvous cannot be held hostage (issue #22, item 4): a peer whose rendezvous accepts
the TCP connection and never answers stalls only its own joins, each ends at its own
deadline (torch's TCPStore client alone would wait forever), the peer backs off, and another
peer's join goes on meanwhile. And a channel carrying a transfer is never evicted (item 6)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from bench.silent_peer import SilentListener
from decode_worker import kv_channels
from decode_worker.kv_channels import MAX_CHANNELS, MAX_JOINS_PER_PEER, ChannelTable
from plumbing.rpc import ServiceError
from plumbing.transport.gloo import GlooRendezvous
from tests.decode_worker.test_channel_guard import _handshake, _inbox

SILENT, HONEST = 666, 7  # prefill incarnations: the stalling peer and a well-behaved one


def test_a_silent_rendezvous_stalls_only_its_own_peer_which_then_backs_off() -> None:
    async def run() -> None:
        inbox = _inbox(max_timeout_s=8.0)
        listener = SilentListener()
        stalled_request = _handshake("127.0.0.1", 60_000, SILENT)
        stalled_request.gloo.port = listener.port
        stalled = [asyncio.ensure_future(inbox.open_channel(stalled_request, caller="127.0.0.1"))
                   for _ in range(MAX_JOINS_PER_PEER)]
        await asyncio.sleep(0.2)
        with pytest.raises(ServiceError) as info:  # that peer's slots are taken: refused at once
            await inbox.open_channel(stalled_request, caller="127.0.0.1")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Another peer joins while the silent one stalls (the old fixed pool of 2 was full).
        rendezvous = GlooRendezvous("127.0.0.1", timeout_s=20)
        honest_request = _handshake("127.0.0.1", 20_000, HONEST)
        honest_request.gloo.port = rendezvous.port
        accepting = asyncio.ensure_future(asyncio.to_thread(rendezvous.accept))
        accept = await asyncio.wait_for(inbox.open_channel(honest_request, caller="127.0.0.1"), 30)
        assert accept.channel_id and not any(task.done() for task in stalled)
        (await accepting).close()
        # The silent peer's joins end at their own deadline (8 s, not the 60 s asked), as
        # UNAVAILABLE: a retryable failure, never DEADLINE_EXCEEDED.
        for task in stalled:
            with pytest.raises(ServiceError) as info:
                await asyncio.wait_for(task, 30)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "try again" in await _refusal(inbox, stalled_request)  # backing off, no thread spent
        for _ in range(500):
            if inbox.joins._calls.num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert inbox.joins._calls.num_running == 0  # every join thread ended
        listener.close()
        inbox.close()

    asyncio.run(run())


async def _refusal(inbox: object, request: object) -> str:
    with pytest.raises(ServiceError) as info:
        await inbox.open_channel(request, caller="127.0.0.1")  # type: ignore[attr-defined]
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    return info.value.message


def test_back_off_doubles_per_failure_and_a_success_clears_it(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        inbox = _inbox(max_timeout_s=2.0)
        outcomes = ["fail", "fail", "ok"]
        clock = [1000.0]
        monkeypatch.setattr(kv_channels.time, "monotonic", lambda: clock[0])

        def fake_join(request: object, caller: object, device: object, timeout_s: float) -> object:
            if outcomes.pop(0) == "fail":
                raise kv_channels.TransportError("the rendezvous did not answer")
            return SimpleNamespace(kind=SimpleNamespace(value="gloo"), broken=False, close=lambda: None)

        monkeypatch.setattr(kv_channels, "join", fake_join)
        request = _handshake("127.0.0.1", 1000, SILENT)
        for backoff_s in (kv_channels.JOIN_BACKOFF_S, 2 * kv_channels.JOIN_BACKOFF_S):
            with pytest.raises(ServiceError):
                await inbox.open_channel(request, caller="127.0.0.1")
            assert f"{backoff_s:.1f} s" in await _refusal(inbox, request)
            clock[0] += backoff_s
        assert (await inbox.open_channel(request, caller="127.0.0.1")).channel_id
        assert not inbox.joins._backoff
        inbox.close()

    asyncio.run(run())


def _fake_channel(closed: list[int], i: int) -> SimpleNamespace:
    return SimpleNamespace(broken=False, close=lambda: closed.append(i))


def test_eviction_closes_only_idle_channels_and_never_one_with_a_transfer_in_flight() -> None:
    table, closed = ChannelTable(), []
    ids = [table.add(_fake_channel(closed, i), prefill_incarnation=100 + i) for i in range(MAX_CHANNELS)]
    table.receiving(ids[0], 3)  # the least recently used one carries a transfer
    table.add(_fake_channel(closed, 999), prefill_incarnation=999)
    assert closed == [1] and len(table) == MAX_CHANNELS  # the oldest idle one went, not channel 0
    for cid in [*ids[2:], *(cid for cid in table._joined if cid not in ids)]:
        table.receiving(cid, 1)  # now every channel carries one
    with pytest.raises(ServiceError) as info:  # every channel busy: the new one is refused
        table.add(_fake_channel(closed, 1000), prefill_incarnation=1000)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and closed == [1, 1000]
    table.receiving(ids[0], -3)  # channel 0's transfer ended: now it may go
    table.add(_fake_channel(closed, 1001), prefill_incarnation=1001)
    assert closed == [1, 1000, 0]
