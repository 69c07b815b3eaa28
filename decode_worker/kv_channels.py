"""The KV channels this decode worker joined, and the rules for joining one.

``OpenKVChannel`` makes this worker dial an address the caller names (a Gloo rendezvous, or
the NCCL bootstrap root inside an ncclUniqueId), so the handshake is guarded:

* the address must be the caller's own: the IP its RPC came from (``context.peer()``), or,
  for a caller on loopback, an address of this machine;
* the wait is capped at this worker's ``--transfer-timeout-s``, whatever the caller asks;
* joins run on a few daemon threads of their own (``plumbing.blocking``): a flood of
  handshakes is refused with RESOURCE_EXHAUSTED instead of queueing behind each other or
  occupying the threads anything else needs, and never holds up the process's exit.

Joined channels are keyed by a random channel id and remember the prefill incarnation and
lane that opened them (a pair has several lanes, each carrying one transfer at a time). A new
channel from the same prefill incarnation and lane replaces its older one (the prefill side
reopens a lane only after dropping its channel); channels of dead incarnations are evicted
least recently used first beyond ``MAX_CHANNELS``.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from plumbing.identity import mint_id
from plumbing.rpc import ServiceError
from plumbing.transport import KVChannel
from splitserve.v1 import kv_transfer_pb2

log = structlog.get_logger()
MAX_CHANNELS = 64


@dataclass(eq=False)
class JoinedChannel:
    channel: KVChannel
    prefill_incarnation: int
    lane: int = 0
    last_used: float = field(default_factory=time.monotonic)


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


class ChannelTable:
    """Joined channels by channel id (event-loop owned)."""

    def __init__(self) -> None:
        self._joined: OrderedDict[int, JoinedChannel] = OrderedDict()

    def add(self, channel: KVChannel, prefill_incarnation: int, lane: int = 0) -> int:
        """Keep ``channel``; return its new random id. Closes the channel it replaces."""
        for cid, old in list(self._joined.items()):
            if (old.prefill_incarnation, old.lane) == (prefill_incarnation, lane) or old.channel.broken:
                self._close(cid, "replaced" if not old.channel.broken else "broken")
        while len(self._joined) >= MAX_CHANNELS:
            self._close(next(iter(self._joined)), "least recently used")
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
