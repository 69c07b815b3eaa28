"""The KV channels this decode worker joined, and the rules for joining one.

``OpenKVChannel`` makes this worker dial an address the caller names (a Gloo rendezvous, or
the NCCL bootstrap root inside an ncclUniqueId), so the handshake is guarded:

* the address must be the caller's own: the IP its RPC came from (``context.peer()``), or,
  for a caller on loopback, an address of this machine;
* each join has its own deadline: the handshake's ``timeout_ms`` (the prefill worker's
  KV channel timeout), capped at this worker's ``--kv-channel-timeout-s``; the join ends by then
  even when the rendezvous accepts and never answers (``plumbing.transport.deadline``);
* joins run on daemon threads of their own (``plumbing.blocking``), per peer (the caller's
  address and prefill incarnation): one peer has at most ``MAX_JOINS_PER_PEER`` in progress,
  so a peer that stalls its joins holds only its own slots while other peers' joins run in
  parallel; a flood is refused with RESOURCE_EXHAUSTED, and no join holds up the exit;
* a peer whose join failed (timed out, refused) is refused with UNAVAILABLE for a back-off
  that doubles per failure (``JOIN_BACKOFF_S`` up to ``MAX_JOIN_BACKOFF_S``), then tried again.

Joined channels are keyed by a random channel id and remember the prefill incarnation and
lane that opened them (a pair has several lanes, each carrying one transfer at a time). A new
channel from the same prefill incarnation and lane replaces its older one (the prefill side
reopens a lane only after dropping its channel). Beyond ``MAX_CHANNELS``, idle channels (no
receive posted: a dead incarnation's are idle for good) are closed least recently used first;
a channel with a transfer in flight is never closed to make room: when every channel is
busy, the new one is refused (RESOURCE_EXHAUSTED) and the prefill worker tries again.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from plumbing.blocking import DaemonCalls
from plumbing.identity import mint_id
from plumbing.rpc import ServiceError
from plumbing.transport import KVChannel, TransportError, TransportUnavailable
from splitserve_api.v1 import kv_transfer_pb2

log = structlog.get_logger()
MAX_CHANNELS = 64
MAX_JOINS_RUNNING = 16  # join threads at once, all peers together
MAX_JOINS_QUEUED = 16  # more waiting than this: RESOURCE_EXHAUSTED at once
MAX_JOINS_PER_PEER = 2  # a pair opens its lanes one at a time; one more for a reopen
JOIN_BACKOFF_S, MAX_JOIN_BACKOFF_S = 0.5, 30.0
JOIN_GRACE_S = 1.0  # past its own deadline, how long a join's caller still waits for it
MAX_PEERS_IN_BACKOFF = 1024


@dataclass(eq=False)
class JoinedChannel:
    channel: KVChannel
    prefill_incarnation: int
    lane: int = 0
    last_used: float = field(default_factory=time.monotonic)
    num_receiving: int = 0  # receives posted and not yet completed (guarded by the table's lock)


def is_local_address(host: str) -> bool:
    """True when ``host`` is an IP of this machine (a socket can bind to it)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
        return True
    except (OSError, ValueError):
        return False


def dial_is_callers(host: str, caller: str | None) -> bool:
    """May this worker dial ``host`` (a name or IP) on behalf of a caller at IP ``caller``?
    Blocking (resolves ``host``)."""
    if caller is None:
        return False
    try:
        caller_ip = ipaddress.ip_address(caller)
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return False
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if ip == caller_ip or (caller_ip.is_loopback and (ip.is_loopback or is_local_address(str(ip)))):
            return True
    return False


def join(request: kv_transfer_pb2.KVChannelHandshake, caller: str | None, device: str,
         timeout_s: float) -> KVChannel:
    """Blocking (a daemon thread): check the address the handshake names, then join as rank 1."""
    if request.transport == kv_transfer_pb2.TRANSPORT_KIND_GLOO:
        from plumbing.transport.gloo import connect_gloo

        _check_dial(request.gloo.host, caller, "gloo.host")
        return connect_gloo(request.gloo.host, request.gloo.port, timeout_s=timeout_s)
    if request.transport == kv_transfer_pb2.TRANSPORT_KIND_NCCL:
        from plumbing.transport.nccl import NcclChannel
        from plumbing.transport.nccl_lib import bootstrap_host

        if len(request.nccl_unique_id) != 128:
            raise ValueError(f"nccl_unique_id must be 128 bytes, got {len(request.nccl_unique_id)}")
        _check_dial(bootstrap_host(request.nccl_unique_id) or "", caller, "nccl_unique_id")
        return NcclChannel(request.nccl_unique_id, rank=1, device=torch.device(device), timeout_s=timeout_s)
    raise ValueError(f"transport: unknown transport kind {request.transport}")


def _check_dial(host: str, caller: str | None, field_name: str) -> None:
    if not host or not dial_is_callers(host, caller):
        raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                           f"{field_name}: the rendezvous address must be the caller's own ({caller})")


class Joins:
    """Channel joins, per peer, each bounded by its own deadline, with back-off (event loop)."""

    def __init__(self, device: str, max_timeout_s: float) -> None:
        self._device = device
        self._max_timeout_s = max_timeout_s
        self._calls: DaemonCalls[KVChannel] = DaemonCalls(
            "kv_channel_join", MAX_JOINS_RUNNING, MAX_JOINS_QUEUED, discard=lambda channel: channel.close(),
            max_per_key=MAX_JOINS_PER_PEER)
        self._backoff: OrderedDict[tuple[str | None, int], tuple[int, float]] = OrderedDict()  # failures, until

    async def join(self, request: kv_transfer_pb2.KVChannelHandshake, caller: str | None) -> KVChannel:
        """The channel the handshake describes, joined within its own deadline."""
        peer = (caller, request.prefill_incarnation)
        num_failures, until = self._backoff.get(peer, (0, 0.0))
        wait_s = until - time.monotonic()
        if wait_s > 0:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"a KV channel join from this peer failed; try again in {wait_s:.1f} s")
        timeout_s = min(max(request.timeout_ms, 1) / 1000.0, self._max_timeout_s)
        try:
            channel = await self._calls.run(lambda: join(request, caller, self._device, timeout_s),
                                            key=peer, timeout_s=timeout_s + JOIN_GRACE_S)
        except TransportUnavailable:
            raise
        except (TransportError, TimeoutError) as exc:
            backoff_s = min(JOIN_BACKOFF_S * 2 ** num_failures, MAX_JOIN_BACKOFF_S)
            self._backoff.pop(peer, None)
            self._backoff[peer] = (num_failures + 1, time.monotonic() + backoff_s)
            while len(self._backoff) > MAX_PEERS_IN_BACKOFF:
                self._backoff.popitem(last=False)
            log.info("kv.channel_join_failed", prefill_incarnation=request.prefill_incarnation,
                     backoff_s=backoff_s, error=str(exc) or type(exc).__name__)
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"KV channel join failed within {timeout_s:.1f} s: {exc or 'timed out'}") from None
        self._backoff.pop(peer, None)
        return channel


class ChannelTable:
    """Joined channels by channel id (event-loop owned; the receiver threads only count
    completed receives, under ``_lock``)."""

    def __init__(self) -> None:
        self._joined: OrderedDict[int, JoinedChannel] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, channel: KVChannel, prefill_incarnation: int, lane: int = 0) -> int:
        """Keep ``channel``; return its new random id. Closes the channel it replaces, and
        idle ones beyond ``MAX_CHANNELS``; RESOURCE_EXHAUSTED (closing ``channel``) when
        every channel carries a transfer."""
        for cid, old in list(self._joined.items()):
            if (old.prefill_incarnation, old.lane) == (prefill_incarnation, lane) or old.channel.broken:
                self._close(cid, "replaced" if not old.channel.broken else "broken")
        while len(self._joined) >= MAX_CHANNELS:
            idle = next((cid for cid, joined in self._joined.items() if not self._busy(joined)), None)
            if idle is None:
                channel.close()
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"all {MAX_CHANNELS} KV channels carry a transfer; try again")
            self._close(idle, "least recently used")
        channel_id = mint_id()
        self._joined[channel_id] = JoinedChannel(channel, prefill_incarnation, lane)
        return channel_id

    def get(self, channel_id: int, prefill_incarnation: int) -> KVChannel | None:
        """The open channel ``channel_id`` if ``prefill_incarnation`` opened it, else None."""
        joined = self._joined.get(channel_id)
        if joined is None or joined.prefill_incarnation != prefill_incarnation:
            return None
        if joined.channel.broken:
            self._close(channel_id, "broken")
            return None
        joined.last_used = time.monotonic()
        self._joined.move_to_end(channel_id)
        return joined.channel

    def receiving(self, channel_id: int, num: int) -> None:
        """``num`` receives were posted on ``channel_id`` (+) or completed (-); any thread."""
        with self._lock:
            joined = self._joined.get(channel_id)
            if joined is not None:
                joined.num_receiving += num

    def _busy(self, joined: JoinedChannel) -> bool:
        with self._lock:
            return joined.num_receiving > 0

    def _close(self, channel_id: int, reason: str) -> None:
        joined = self._joined.pop(channel_id)
        joined.channel.close()
        log.info("kv.channel_closed", channel_id=channel_id, reason=reason)

    def __len__(self) -> int:
        return len(self._joined)

    def close(self) -> None:
        for joined in self._joined.values():
            joined.channel.close()
        self._joined.clear()
