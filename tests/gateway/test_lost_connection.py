"""A lost connection is told by status code and incarnation, never by error text (issue #22,
item 6), and a worker's internal deadline never reaches the client as its own (item 4).

The reproduction: a decode worker answered ``UNAVAILABLE "KV receive failed: … Connection
reset by peer"`` (its KV channel to a prefill worker broke; the decode worker is fine), and
the gateway, matching "Connection reset" in the text, dropped the healthy worker.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from gateway.legs import LegFailed
from gateway.registry import Registry
from gateway.server import model_limits
from gateway.service import GatewayService
from plumbing import rpc
from plumbing.config import GatewayConfig, ServerConfig
from plumbing.metrics import GatewayMetrics
from plumbing.rpc import INCARNATION_KEY
from splitserve.client import make_request
from splitserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.gateway.test_migration import MODEL, PROMPT, SCRIPT, TOKENIZER, ScriptedDecode

HEALTHY_ERROR = "KV receive failed: recv: Connection reset by peer"


class FailingDecode(ScriptedDecode):
    """Fails every stream with UNAVAILABLE and a connection-like text, as ``answers_as``
    (an incarnation in the trailing metadata; None: no trailer, as a broken connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.answers_as: int | None = None

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):  # noqa: ANN201
        if self.answers_as is not None:
            context.set_trailing_metadata(((INCARNATION_KEY, str(self.answers_as)),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, HEALTHY_ERROR)
        yield decode_pb2.DecodeResponse()


async def _route_once(answers_as: int | str | None) -> tuple[list[int], bool]:
    """A request through a gateway whose first-choice decode worker fails as ``answers_as``
    says ("self": its registered incarnation); the tokens and whether it stayed registered."""
    failing, survivor = FailingDecode(), ScriptedDecode()
    config = GatewayConfig(server=ServerConfig(), model=MODEL)
    registry = Registry("target", 1000, 3)
    servers = [rpc.make_server() for _ in range(3)]
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayService(
        config, registry, TOKENIZER, model_limits(config, TOKENIZER), GatewayMetrics.create(), "target"), servers[0])
    ports = []
    for server, worker in zip(servers, [None, failing, survivor]):
        if worker is not None:
            decode_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
    for i, port in enumerate(ports[1:]):  # the failing one is less busy: tried first
        await registry.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
            role=common_pb2.WORKER_ROLE_DECODE, address=f"127.0.0.1:{port}", model="target", incarnation=port,
            load=common_pb2.WorkerLoad(kv_blocks_total=100, kv_blocks_free=100 - i)), None)
    failing.answers_as = ports[1] if answers_as == "self" else answers_as  # type: ignore[assignment]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(make_request(PROMPT, 4), timeout=30)
    still_there = any(w.address.endswith(f":{ports[1]}") for w in registry.live(common_pb2.WORKER_ROLE_DECODE))
    for server in servers:
        await server.stop(0)
    await registry.stop()
    return list(reply.token_ids), still_there


@pytest.mark.parametrize(("answers_as", "dropped"), [
    ("self", False),  # the registered process answered: alive, whatever its text says
    (12345, True),  # another process at that address answered: the registered one is gone
    (None, True),  # nobody answered (no trailer): the connection was lost
])
def test_a_worker_is_dropped_only_when_the_registered_process_did_not_answer(answers_as: object, dropped: bool) -> None:
    token_ids, still_there = asyncio.run(_route_once(answers_as))  # type: ignore[arg-type]
    assert token_ids == SCRIPT[:4]  # retried on the other worker either way
    assert still_there is not dropped


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="timed out")


def test_a_workers_deadline_is_unavailable_while_the_client_has_time_left() -> None:
    worker = SimpleNamespace(incarnation=1)
    with_time = SimpleNamespace(time_remaining=lambda: 25.0)
    failed = LegFailed.of(worker, _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), with_time)  # type: ignore[arg-type]
    assert failed.code == grpc.StatusCode.UNAVAILABLE  # retried, never shown as the client's own
    out_of_time = SimpleNamespace(time_remaining=lambda: 0.0)
    failed = LegFailed.of(worker, _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), out_of_time)  # type: ignore[arg-type]
    assert failed.code == grpc.StatusCode.DEADLINE_EXCEEDED  # the client's own deadline passed
