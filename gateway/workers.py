"""One registered worker as this gateway sees it: its address and RPC channel, what it last
reported, what this gateway routed to it since, and its prefix index.

Its own module so that the registry (which owns the entries) and the router (which reads
them) both import it without importing each other."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.prefix_index import PrefixIndex
from plumbing.channels import PeerChannel
from splitserve_api.v1 import common_pb2, gateway_pb2


@dataclass
class WorkerEntry:
    worker_id: int
    role: int
    address: str
    channel: PeerChannel  # TLS, the shared secret, certificate rotation (plumbing/channels.py)
    stub_type: type  # DecodeWorkerStub | PrefillWorkerStub
    load: common_pb2.WorkerLoad
    incarnation: int
    state: int = common_pb2.WORKER_STATE_SERVING
    last_beat: float = field(default_factory=time.monotonic)
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(0, 0))  # its prefix cache, from KV events
    # Routed by this gateway and not finished yet (decayed by heartbeats' real numbers).
    num_routed: int = 0
    num_routed_prefill_tokens: int = 0
    quantization: str = "none"  # as registered (GetInfo)
    batch_invariant: bool = False  # as registered (GetInfo)
    kv_layout: common_pb2.KVLayout | None = None  # as registered (GetInfo)

    @property
    def stub(self) -> object:
        """The worker's stub on the channel for the current credentials."""
        return self.channel.stub(self.stub_type)

    def kv_pressure(self) -> float:
        total = max(self.load.kv_blocks_total, 1)
        used = total - self.load.kv_blocks_free
        return used / total + self.num_routed / 64.0

    def to_proto(self, now: float) -> gateway_pb2.WorkerInfo:
        return gateway_pb2.WorkerInfo(
            worker_id=self.worker_id, role=self.role, address=self.address, state=self.state,
            load=self.load, heartbeat_age_ms=int((now - self.last_beat) * 1000),
            quantization=self.quantization, kv_layout=self.kv_layout, batch_invariant=self.batch_invariant,
        )
