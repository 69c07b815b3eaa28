"""Sending bytes to any RPC with a raw generic gRPC call (no client-side serialization), and
the heartbeat probe that times the gateway's heartbeat handling meanwhile."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import grpc

from tests.fuzz.methods import Method
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

CALL_DEADLINE_S = 10.0
# Big enough for the 1 MiB garbage and the 400,000-character prompts; the servers keep 4 MiB.
OPTIONS = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]


@dataclass
class Result:
    family: str
    method: str
    code: str
    details: str
    seconds: float


async def call(channel: grpc.aio.Channel, method: Method, payload: bytes, family: str,
               deadline_s: float = CALL_DEADLINE_S) -> Result:
    """Send ``payload`` as the request of ``method``; read a stream to its end."""
    start = time.monotonic()
    try:
        if method.streaming:
            stream = channel.unary_stream(method.path, request_serializer=None, response_deserializer=None)
            async for _ in stream(payload, timeout=deadline_s):
                pass
        else:
            unary = channel.unary_unary(method.path, request_serializer=None, response_deserializer=None)
            await unary(payload, timeout=deadline_s)
        code, details = "OK", ""
    except grpc.aio.AioRpcError as exc:
        code, details = exc.code().name, exc.details() or ""
    return Result(family, method.name, code, details[:200], time.monotonic() - start)


async def run_all(address: str, cases: list[tuple[Method, bytes, str]], concurrency: int) -> list[Result]:
    """Send every case, ``concurrency`` at a time, in order of submission."""
    semaphore = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        async def one(case: tuple[Method, bytes, str]) -> Result:
            async with semaphore:
                return await call(channel, *case)

        return list(await asyncio.gather(*(one(c) for c in cases)))


@dataclass
class HeartbeatProbe:
    """A thread sending a Heartbeat (an id no worker has) to the gateway every tenth of a
    period and timing the answer: how late the gateway's heartbeat handling runs under the
    fuzz load (a worker's heartbeat would wait as long)."""

    address: str
    period_s: float
    rtts: list[float] = field(default_factory=list)
    late_at: list[float] = field(default_factory=list)  # monotonic times of the answers later than a period
    failures: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="heartbeat-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = gateway_pb2_grpc.WorkerRegistryStub(channel)
            beat = gateway_pb2.HeartbeatRequest(worker_id=random.getrandbits(63) | (1 << 62),
                                                load=common_pb2.WorkerLoad(kv_blocks_total=1, kv_blocks_free=1))
            while not self._stop.wait(self.period_s / 10):
                start = time.monotonic()
                try:
                    stub.Heartbeat(beat, timeout=30)
                    self.rtts.append(time.monotonic() - start)
                    if self.rtts[-1] > self.period_s:
                        self.late_at.append(start)
                except grpc.RpcError:
                    self.failures += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
