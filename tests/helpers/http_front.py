"""The HTTP front in this process (uvicorn on 127.0.0.1:0, its own thread and loop) in front of
a fake gateway (a real ``grpc.aio`` server with the services' limits: ``plumbing.rpc.make_server``)
that records what reaches it, and a blocking HTTP client for the tests."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn

from http_front.app import Front, Gateway
from http_front.config import HttpConfig
from http_front.metrics import FrontMetrics
from http_front.server import _bind, gateway_channel
from plumbing.rpc import make_server
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

MODEL = "m"


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Serves model ``m``: every Generate answers "a", "b" and stops for length."""

    def __init__(self, model: str = MODEL) -> None:
        self.model = model
        self.requests: list[gateway_pb2.GenerateRequest] = []

    async def GetInfo(self, request: gateway_pb2.GetInfoRequest, context: object) -> gateway_pb2.GetInfoResponse:
        return gateway_pb2.GetInfoResponse(model=self.model, max_model_len=64)

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: object):  # noqa: ANN201
        self.requests.append(request)
        yield gateway_pb2.GenerateResponse(token_ids=[7], text="a")
        yield gateway_pb2.GenerateResponse(token_ids=[8], text="b", num_prompt_tokens=3,
                                           finish_reason=common_pb2.FINISH_REASON_LENGTH)


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> dict:
        return json.loads(self.body)

    def error(self) -> dict:
        """The OpenAI error object (asserting the body is one)."""
        error = self.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        return error


@dataclass
class RunningFront:
    address: str
    gateway: FakeGateway

    def post(self, path: str, body: bytes | Iterable[bytes], headers: dict[str, str] | None = None) -> Reply:
        """POST ``body`` (an iterable: sent chunked, with no content-length)."""
        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            chunked = not isinstance(body, bytes)
            conn.request("POST", path, body=body, headers={"content-type": "application/json", **(headers or {})},
                         encode_chunked=chunked)
            response = conn.getresponse()
            return Reply(response.status, response.read(), dict(response.getheaders()))
        finally:
            conn.close()

    def post_json(self, path: str, body: object) -> Reply:
        return self.post(path, json.dumps(body).encode())

    def get(self, path: str, method: str = "GET") -> Reply:
        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            return Reply(response.status, response.read(), dict(response.getheaders()))
        finally:
            conn.close()


@contextmanager
def running_front(model: str = MODEL, **config: object) -> Iterator[RunningFront]:
    """The front (``HttpConfig(**config)``) before a ``FakeGateway`` serving ``model``, until
    the block ends."""
    fake = FakeGateway(model)
    ready: list[str] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        server = make_server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        cfg = HttpConfig(gateway=f"127.0.0.1:{port}", port=0, **config)  # type: ignore[arg-type]
        channel = gateway_channel(cfg)
        front = Front(Gateway(channel, (), 30.0), FrontMetrics.create(), cfg.default_max_tokens, cfg.max_body_bytes)
        sock = _bind("127.0.0.1", 0)
        http = uvicorn.Server(uvicorn.Config(front.app(), log_config=None, access_log=False, lifespan="off"))
        serving = asyncio.ensure_future(http.serve(sockets=[sock]))
        ready.append(f"127.0.0.1:{sock.getsockname()[1]}")
        started.set()
        await stop.wait()
        http.should_exit = True
        await serving
        await channel.close()
        await server.stop(0)

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    try:
        assert started.wait(30), "the front did not start"
        yield RunningFront(ready[0], fake)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
