"""KV-cache utilisation over time: poll every worker's ``GetStats`` while a run is going.

The worker list comes from the gateway's ``GetInfo`` once, at the start. Each sample is one
worker's :class:`KvSample`; utilisation is ``(total - free) / total`` (cached but evictable
blocks count as free, as the worker reports them). A worker that does not answer a poll is
skipped for that poll.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import grpc


@dataclass(frozen=True)
class KvSample:
    t_s: float  # perf_counter time of the reply
    worker: str  # "prefill-0", "decode-1", ... (role and order in GetInfo)
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_in_transfer: int
    num_running: int
    num_waiting: int

    @property
    def kv_used_fraction(self) -> float:
        return (self.kv_blocks_total - self.kv_blocks_free) / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def to_dict(self, t0: float) -> dict:
        return {**asdict(self), "t_s": self.t_s - t0, "kv_used_fraction": self.kv_used_fraction}


async def _workers(gateway: str) -> list[tuple[str, str, object]]:
    """(name, address, GetStats callable) for every registered worker."""
    from plumbing.rpc import channel_options
    from splitserve_api.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc

    async with grpc.aio.insecure_channel(gateway, options=channel_options()) as channel:
        info = await gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=5.0)
    workers, counts = [], {"prefill": 0, "decode": 0}
    for w in info.workers:
        role = "decode" if w.role == common_pb2.WORKER_ROLE_DECODE else "prefill"
        stub_cls = decode_pb2_grpc.DecodeWorkerStub if role == "decode" else prefill_pb2_grpc.PrefillWorkerStub
        workers.append((f"{role}-{counts[role]}", w.address, stub_cls))
        counts[role] += 1
    return workers


class KvMonitor:
    """Samples every ``interval_s`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, gateway: str, interval_s: float = 0.1) -> None:
        self.gateway = gateway
        self.interval_s = interval_s
        self.samples: list[KvSample] = []
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        workers = await _workers(self.gateway)
        self._task = asyncio.ensure_future(self._poll(workers))

    async def stop(self) -> list[KvSample]:
        self._stopping.set()
        if self._task is not None:
            await self._task
        return self.samples

    async def _poll(self, workers: list[tuple[str, str, object]]) -> None:
        from plumbing.rpc import channel_options
        from splitserve_api.v1 import common_pb2

        channels = [grpc.aio.insecure_channel(addr, options=channel_options()) for _, addr, _ in workers]
        stubs = [stub_cls(ch) for (_, _, stub_cls), ch in zip(workers, channels)]
        try:
            while not self._stopping.is_set():
                replies = await asyncio.gather(
                    *(stub.GetStats(common_pb2.GetStatsRequest(), timeout=2.0) for stub in stubs),
                    return_exceptions=True)
                now = time.perf_counter()
                for (name, _, _), load in zip(workers, replies):
                    if not isinstance(load, BaseException):
                        self.samples.append(KvSample(now, name, load.kv_blocks_total, load.kv_blocks_free,
                                                     load.kv_blocks_in_transfer, load.num_running,
                                                     load.num_waiting))
                try:
                    await asyncio.wait_for(self._stopping.wait(), self.interval_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            for channel in channels:
                await channel.close()
