"""A huge text prompt must not freeze the gateway (issue #10, item 4).

The reproduction was a 3.9 MB prompt tokenized on the event loop: a concurrent stream
stalled for seconds and the workers were dropped for missed heartbeats. Now a prompt over the
byte cap is refused before the tokenizer sees it, and tokenizing runs on the tokenizer thread:
here a tokenization that does not finish until the test lets it cannot hold up a heartbeat.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from gateway.registry import Registry
from gateway.service import GatewayService
from gateway.validation import Limits
from plumbing import rpc
from plumbing.config import GatewayConfig, ServerConfig
from plumbing.metrics import GatewayMetrics
from splitserve.client import make_request
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

LIMITS = Limits(vocab_size=100, max_model_len=64, max_stop_strings=8, max_stop_string_bytes=256, bytes_per_token=4)


class GatedTokenizer:
    """Encodes only once ``release`` is set; records the threads it ran on."""

    chat_template = None

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(30)
        return [5] * min(len(text), 10)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


async def _serve(tokenizer: GatedTokenizer) -> tuple[grpc.aio.Server, Registry, str]:
    config = GatewayConfig(server=ServerConfig(), model="m", startup_grace_s=0.0)
    registry = Registry("m", heartbeat_period_ms=500, heartbeat_miss_count=3)
    service = GatewayService(config, registry, tokenizer, LIMITS, GatewayMetrics.create(), "m")
    server = rpc.make_server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(service, server)
    gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, registry, f"127.0.0.1:{port}"


def test_a_prompt_over_the_byte_cap_is_refused_before_tokenizing() -> None:
    async def run() -> None:
        tokenizer = GatedTokenizer()
        server, _, address = await _serve(tokenizer)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            huge = "word " * (LIMITS.max_prompt_bytes // 5 + 1)  # 64 tokens x 4 bytes = 256 bytes
            try:
                await stub.GenerateUnary(make_request(huge, 4), timeout=10)
                raise AssertionError("accepted")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "prompt.text" in exc.details() and "256" in exc.details()
            chat = make_request("x", 4)
            chat.chat.messages.add(role=gateway_pb2.CHAT_ROLE_USER, content=huge)
            try:
                await stub.GenerateUnary(chat, timeout=10)
                raise AssertionError("accepted")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt.chat.messages" in exc.details()
        assert tokenizer.threads == []  # never tokenized
        await server.stop(None)

    asyncio.run(run())


def test_heartbeats_are_answered_while_a_prompt_is_being_tokenized() -> None:
    async def run() -> None:
        tokenizer = GatedTokenizer()
        server, registry, address = await _serve(tokenizer)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = asyncio.ensure_future(stub.GenerateUnary(make_request("a" * 200, 4), timeout=30))
            assert await asyncio.get_running_loop().run_in_executor(None, tokenizer.entered.wait, 10)
            registry_stub = gateway_pb2_grpc.WorkerRegistryStub(channel)
            load = common_pb2.WorkerLoad(kv_blocks_total=8, kv_blocks_free=8)
            joined = await registry_stub.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                role=common_pb2.WORKER_ROLE_PREFILL, address="127.0.0.1:1", model="m", load=load,
                incarnation=3), timeout=10)
            beat = await registry_stub.Heartbeat(gateway_pb2.HeartbeatRequest(
                worker_id=joined.worker_id, incarnation=3, load=load), timeout=10)
            assert beat.known and not request.done()  # answered while the tokenizer is still busy
            tokenizer.release.set()
            try:
                await request
                raise AssertionError("no decode worker, yet it succeeded")
            except grpc.aio.AioRpcError as exc:  # tokenized, validated, then no worker to route to
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert tokenizer.threads and all(t.startswith("tokenizer") for t in tokenizer.threads)
        await server.stop(None)

    asyncio.run(run())
