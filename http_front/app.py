"""The Starlette application: the OpenAI routes, each a client of the gateway's ``Generate``.

One HTTP request is ``n`` gateway streams (``http_front/calls.py``). Its body is read and
checked first (``body.py``, ``schema.py``), its ``x-request-id`` honoured or minted and sent
on, its ``Authorization`` passed on as the gateway's API key. The gateway validates, routes, applies stop strings and
retries; nothing of that is repeated here. While a request runs, the handler also listens
for the client's disconnect and cancels every stream when it comes, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from http_front import responses as out
from http_front import structured
from http_front.body import decode, read_body
from http_front.calls import Calls
from http_front.errors import ApiError, ErrorResponse, Guard, bad_field, from_rpc, http_exception, server_error
from http_front.metrics import FrontMetrics
from http_front.schema import Parsed, parse
from plumbing import tracing
from plumbing.identity import mint_id
from plumbing.resume import ResumePolicy
from plumbing.rpc import REQUEST_ID_KEY, check_request_id
from splitserve_api.v1 import gateway_pb2, gateway_pb2_grpc

log = structlog.get_logger()
# gRPC metadata takes printable ASCII, at most 16 KiB in all (8 KiB before calls may fail).
MAX_AUTHORIZATION_CHARS = 4096
_PRINTABLE = frozenset(map(chr, range(0x20, 0x7F)))


@dataclass
class Gateway:
    """What the front knows of its gateway: the channel, the stub, the served model."""

    channel: grpc.aio.Channel
    metadata: tuple[tuple[str, str], ...]  # sent on every call (the front's own API key)
    timeout_s: float
    model: str = ""
    max_model_len: int = 0
    resume: ResumePolicy = ResumePolicy()  # continuing a stream whose gateway died

    @property
    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(self.channel)

    async def refresh(self, metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        """Ask the gateway for its model (with the client's API key when given); ApiError
        carrying the gateway's status when it cannot answer."""
        try:
            info = await self.stub.GetInfo(gateway_pb2.GetInfoRequest(), timeout=10,
                                           metadata=self.metadata if metadata is None else metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc.code(), exc.details() or "") from None
        self.model, self.max_model_len = info.model, info.max_model_len


def error_response(error: ApiError, request_id: str | None = None) -> JSONResponse:
    return ErrorResponse(error, {REQUEST_ID_KEY: request_id} if request_id else None)


class Front:
    """The routes (event-loop owned)."""

    def __init__(self, gateway: Gateway, metrics: FrontMetrics, default_max_tokens: int, max_body_bytes: int) -> None:
        self.gateway = gateway
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes

    def app(self) -> Guard:
        """The routes; every refusal an OpenAI error body, and a bug a logged 500 (``errors.Guard``)."""
        return Guard(Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], exception_handlers={HTTPException: http_exception, Exception: server_error}))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            await self.gateway.refresh(self._auth(request))
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [
            {"id": self.gateway.model, "object": "model", "created": 0, "owned_by": "splitserve",
             "max_model_len": self.gateway.max_model_len}]})

    async def health(self, request: Request) -> Response:
        """200 while the gateway reports SERVING, else 503."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.gateway.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5, metadata=self.gateway.metadata)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        return Response(status_code=200 if serving else 503)

    async def prometheus(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    # -- one generation request -----------------------------------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            request_id = check_request_id(request.headers.get(REQUEST_ID_KEY)) or str(mint_id())
        except ValueError as exc:
            return self._done(endpoint, error_response(bad_field(REQUEST_ID_KEY, str(exc))))
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            parsed = await self._parse(request, chat)
        except ApiError as exc:
            return self._done(endpoint, error_response(exc, request_id))
        except ClientDisconnect:
            return self._done(endpoint, Response(status_code=499))
        with tracing.http_span(f"POST {request.url.path}", request.headers):
            return await self._run(request, parsed, endpoint, request_id)

    async def _run(self, request: Request, parsed: Parsed, endpoint: str, request_id: str) -> Response:
        """Open the gateway streams (inside the request's span: they carry its traceparent)
        and answer; a stream's calls are the ``SSEResponse``'s to cancel."""
        calls = Calls(self.gateway.stub, parsed.requests, self._metadata(request, request_id),
                      self.gateway.timeout_s, self.gateway.resume)
        self.metrics.in_flight.inc()
        response: Response | None = None
        try:
            error = await _until_disconnect(request.receive, calls.first())
            response = (await self._answer(request, parsed, calls, request_id) if error is None
                        else error_response(error, request_id))
            return self._done(endpoint, response)
        except ClientDisconnected:
            return self._done(endpoint, Response(status_code=499))
        finally:
            if not isinstance(response, SSEResponse):  # else the stream owns the calls
                calls.cancel()
                self.metrics.in_flight.dec()

    async def _answer(self, request: Request, parsed: Parsed, calls: Calls, request_id: str) -> Response:
        rid = out.response_id(parsed.chat)
        headers = {REQUEST_ID_KEY: request_id}
        if parsed.stream:
            events = structured.tool_call_events(self._sse(parsed, calls, rid), parsed.tools)
            return SSEResponse(events, calls, self.metrics, headers)
        choices = [out.Choice(i) for i in range(len(parsed.requests))]
        error = await _until_disconnect(request.receive, _collect(calls, choices))
        if error is not None:
            return error_response(error, request_id)
        body = out.whole(parsed.chat, rid, parsed.model, choices, parsed.logprobs is not None)
        return JSONResponse(structured.attach_tool_calls(body, parsed.tools), headers=headers)

    async def _parse(self, request: Request, chat: bool) -> Parsed:
        """The headers and the body (read up to ``max_body_bytes``, decoded and checked),
        before anything else is done for the request."""
        self._auth(request)
        body = await decode(await read_body(request.scope, request.receive, self.max_body_bytes))
        parsed = parse(body, chat, self.default_max_tokens)
        if not self.gateway.model:
            await self.gateway.refresh(self._auth(request))
        if parsed.model != self.gateway.model:
            raise ApiError(404, f"the model `{parsed.model}` does not exist (served: {self.gateway.model})",
                           "not_found_error", "model", "model_not_found")
        return parsed

    def _metadata(self, request: Request, request_id: str) -> tuple[tuple[str, str], ...]:
        return ((REQUEST_ID_KEY, request_id), *self._auth(request))

    def _auth(self, request: Request) -> tuple[tuple[str, str], ...]:
        """The client's ``Authorization`` (its API key is the gateway's to check), else the
        front's own ``--token``; ApiError 400 for a value gRPC metadata cannot carry."""
        authorization = request.headers.get("authorization")
        if not authorization:
            return self.gateway.metadata
        if len(authorization) > MAX_AUTHORIZATION_CHARS or not _PRINTABLE.issuperset(authorization):
            raise bad_field("authorization", f"must be at most {MAX_AUTHORIZATION_CHARS} printable ASCII characters")
        return (("authorization", authorization),)

    def _done(self, endpoint: str, response: Response) -> Response:
        if not isinstance(response, SSEResponse):  # a stream counts itself when it ends
            self.metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
            log.info("http.done", endpoint=endpoint, status=response.status_code)
        return response

    async def _sse(self, parsed: Parsed, calls: Calls, rid: str) -> AsyncIterator[dict[str, Any]]:
        """The stream's data events: a chunk per gateway chunk, usage last if asked."""
        choices = [out.Choice(i) for i in range(len(parsed.requests))]
        logprobs = parsed.logprobs is not None
        async for event in calls.events():
            if event.error is not None:
                yield event.error.body()
                return
            assert event.chunk is not None
            choice = choices[event.index]
            first = parsed.chat and choice.num_tokens == 0 and not choice.text and not choice.logprobs
            choice.add(event.chunk)
            yield out.chunk(parsed.chat, rid, parsed.model, event.index, event.chunk, choice.finish_reason,
                            logprobs, first)
        if parsed.include_usage:
            yield out.usage_chunk(parsed.chat, rid, parsed.model, choices)


async def _collect(calls: Calls, choices: list[out.Choice]) -> ApiError | None:
    async for event in calls.events():
        if event.error is not None:
            return event.error
        assert event.chunk is not None
        choices[event.index].add(event.chunk)
    return None


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was complete."""


async def _until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
    """``work``'s result, or ClientDisconnected when the client disconnects first (after the
    body was read, ``receive`` returns only ``http.disconnect``)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            log.info("http.client_disconnected")
            raise ClientDisconnected
        return task.result()
    finally:
        task.cancel()
        watch.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(Response):
    """``text/event-stream``: ``data: {json}`` events, then ``data: [DONE]``. A disconnect
    (seen by ``receive``, or as a failed ``send``) cancels the gateway streams at once."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], calls: Calls, metrics: FrontMetrics,
                 headers: dict[str, str]) -> None:
        super().__init__(status_code=200, headers={**headers, "cache-control": "no-cache"},
                         media_type="text/event-stream")
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self.events = events
        self.calls = calls
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = "chat" if scope["path"].endswith("chat/completions") else "completions"
        status = "200"
        try:
            await _until_disconnect(receive, self._pump(send))
        except (ClientDisconnected, OSError):
            status = "499"
            log.info("http.stream_cancelled")
        finally:
            self.calls.cancel()
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint=endpoint, status=status).inc()
            log.info("http.done", endpoint=endpoint, status=int(status), stream=True)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for data in self.events:
            await send({"type": "http.response.body", "body": _event(data), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

