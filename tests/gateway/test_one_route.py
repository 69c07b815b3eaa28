"""One route per fact (issue #23): the first token reaches the client from the Decode stream
only, exactly once; the Prefill answer carries the prefill's timings and nothing else; the
final chunk holds them even when the answer comes after the decode stream finished; a prefill
that fails before the first token is retried, after it the request migrates.

Scripted workers on 127.0.0.1:0, all in the test's event loop, so the order of events is the
test's: ``RemoteDecode`` streams a reservation, then (once the scripted prefill "announced")
``FirstToken(SCRIPT[n])``, then the rest of ``SCRIPT`` as ``ScriptedDecode`` does; the
scripted prefill answers (or fails) when the test opens its gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
from google.protobuf import descriptor_pb2

from gateway.registry import Registry
from gateway.server import model_limits
from gateway.service import GatewayService
from plumbing import rpc
from plumbing.config import GatewayConfig, ServerConfig
from plumbing.metrics import GatewayMetrics
from splitserve.client import make_request
from splitserve_api.v1 import (
    common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, kv_transfer_pb2, prefill_pb2,
    prefill_pb2_grpc,
)
from tests.gateway.test_migration import MODEL, PROMPT, SCRIPT, TOKENIZER, ScriptedDecode, tokens

PREFILL_TIMINGS = common_pb2.PhaseTimings(prefill_us=4321, transfer_us=555, transfer_bytes=8192,
                                          transfer_wire_us=444, num_cached_prompt_tokens=16)


def _message(module: object, name: str) -> descriptor_pb2.DescriptorProto:
    file = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)  # type: ignore[attr-defined]
    return next(m for m in file.message_type if m.name == name)


def test_the_prefill_answer_carries_timings_only_and_the_header_no_timings() -> None:
    answer = _message(prefill_pb2, "PrefillResponse")
    assert [(f.name, f.number) for f in answer.field] == [("timings", 3)]
    assert list(answer.reserved_name) == ["first_token_id", "first_logprob"]
    assert [(r.start, r.end) for r in answer.reserved_range] == [(1, 2), (2, 3)]  # numbers 1 and 2, never reused
    header = _message(kv_transfer_pb2, "TransferHeader")
    assert "timings" not in {f.name for f in header.field} and "first_token_id" in {f.name for f in header.field}
    assert list(header.reserved_name) == ["timings"] and [(r.start, r.end) for r in header.reserved_range] == [(9, 10)]


class RemoteDecode(ScriptedDecode):
    """A remote prefill as the decode worker streams it: Reservation, then (once announced)
    FirstToken, then TokenChunks; ``hold_after_first`` parks the stream after the first token
    until cancelled (the pages never land). A local prefill is ``ScriptedDecode``'s."""

    def __init__(self, hold_after_first: bool = False) -> None:
        super().__init__()
        self.announced = asyncio.Event()
        self.finished = asyncio.Event()
        self.hold_after_first = hold_after_first

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):  # noqa: ANN201
        if request.prefill_mode == decode_pb2.PREFILL_MODE_LOCAL:
            async for msg in super().Decode(request, context):
                yield msg
            return
        self.requests.append(request)
        n = request.num_prior_output_tokens
        yield decode_pb2.DecodeResponse(reserved=decode_pb2.Reservation(
            transfer_id=7, num_blocks=1, transfer_secret=b"s" * 16, incarnation=1))
        await self.announced.wait()
        yield decode_pb2.DecodeResponse(first_token=decode_pb2.FirstToken(
            token_id=SCRIPT[n], logprob=common_pb2.TokenLogprob(token_id=SCRIPT[n], logprob=-0.25)))
        if self.hold_after_first:
            await asyncio.Event().wait()
        for i in range(1, request.stopping.max_new_tokens):
            yield decode_pb2.DecodeResponse(tokens=decode_pb2.TokenChunk(
                token_ids=[SCRIPT[n + i]], logprobs=[common_pb2.TokenLogprob(token_id=SCRIPT[n + i], logprob=-1.0)]))
        yield decode_pb2.DecodeResponse(finished=decode_pb2.DecodeFinished(
            finish_reason=common_pb2.FINISH_REASON_LENGTH, timings=common_pb2.PhaseTimings(transfer_us=600)))
        self.finished.set()


class ScriptedPrefill(prefill_pb2_grpc.PrefillWorkerServicer):
    """Announces to ``decode`` at once, then answers with PREFILL_TIMINGS (or fails with
    UNAVAILABLE) when ``gate`` opens."""

    def __init__(self, decode: RemoteDecode, fail: bool = False) -> None:
        self.decode = decode
        self.gate = asyncio.Event()
        self.fail = fail
        self.answered = False

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):  # noqa: ANN201
        self.decode.announced.set()
        await self.gate.wait()
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker failed")
        self.answered = True
        return prefill_pb2.PrefillResponse(timings=PREFILL_TIMINGS)


async def _run(decodes: list[ScriptedDecode], prefill_of: Callable[[RemoteDecode], ScriptedPrefill],
               on_chunk: Callable[[ScriptedPrefill, list[gateway_pb2.GenerateResponse]], None],
               num_tokens: int = 4, local_prefill_max_tokens: int = 0, prefill_queued_tokens: int = 0,
               registry: Registry | None = None,
               before: Callable[[Registry, GatewayService, list[str]], Awaitable[None]] | None = None,
               ) -> tuple[list[gateway_pb2.GenerateResponse], grpc.StatusCode | None]:
    """A gateway with ``decodes`` (tried in order) and one scripted prefill worker for the
    first of them, reporting ``prefill_queued_tokens``; ``on_chunk`` sees each chunk as the
    client gets it; ``before(registry, service, decode addresses)`` runs once every worker
    registered, before the request."""
    assert isinstance(decodes[0], RemoteDecode)
    prefill = prefill_of(decodes[0])
    config = GatewayConfig(server=ServerConfig(), model=MODEL, local_prefill_max_tokens=local_prefill_max_tokens)
    registry = registry or Registry("target", 1000, 3)
    servers = [rpc.make_server() for _ in range(len(decodes) + 2)]
    service = GatewayService(config, registry, TOKENIZER, model_limits(config, TOKENIZER), GatewayMetrics.create(),
                             "target")
    gateway_pb2_grpc.add_GatewayServicer_to_server(service, servers[0])
    prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, servers[1])
    for server, worker in zip(servers[2:], decodes):
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
    ports = [server.add_insecure_port("127.0.0.1:0") for server in servers]
    for server in servers:
        await server.start()
    await registry.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
        role=common_pb2.WORKER_ROLE_PREFILL, address=f"127.0.0.1:{ports[1]}", model="target", incarnation=ports[1],
        load=common_pb2.WorkerLoad(kv_blocks_total=100, kv_blocks_free=100,
                                   num_queued_prefill_tokens=prefill_queued_tokens)), None)
    for i, port in enumerate(ports[2:]):  # each a little busier than the one before
        await registry.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
            role=common_pb2.WORKER_ROLE_DECODE, address=f"127.0.0.1:{port}", model="target", incarnation=port,
            load=common_pb2.WorkerLoad(kv_blocks_total=100, kv_blocks_free=100 - i)), None)
    if before is not None:
        await before(registry, service, [f"127.0.0.1:{port}" for port in ports[2:]])
    chunks: list[gateway_pb2.GenerateResponse] = []
    code = None
    request = make_request(PROMPT, num_tokens)
    request.sampling.logprobs = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
        try:
            async for chunk in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=30):
                chunks.append(chunk)
                on_chunk(prefill, chunks)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
    for server in servers:
        await server.stop(0)
    await registry.stop()
    return chunks, code


def _answer_after_decode_finished(delay_s: float = 0.05) -> Callable[[ScriptedPrefill, list], None]:
    """The decode stream runs to its finish; ``delay_s`` later the prefill answers."""
    def on_chunk(prefill: ScriptedPrefill, chunks: list[gateway_pb2.GenerateResponse]) -> None:
        if len(chunks) == 1:
            asyncio.get_running_loop().create_task(_open_after(prefill.decode.finished, prefill.gate, delay_s))

    return on_chunk


async def _open_after(event: asyncio.Event, gate: asyncio.Event, delay_s: float) -> None:
    await event.wait()
    await asyncio.sleep(delay_s)
    gate.set()


# 2.5 s: later than the 2 s grace the gateway once waited; there is no timer now, only the deadline.
@pytest.mark.parametrize("delay_s", [0.05, 2.5])
def test_first_token_once_from_the_decode_stream_and_final_timings_from_a_late_prefill_answer(delay_s: float) -> None:
    decode = RemoteDecode()
    chunks, code = asyncio.run(_run([decode], ScriptedPrefill, _answer_after_decode_finished(delay_s)))
    assert code is None
    assert [list(c.token_ids) for c in chunks[:-1]] == [[t] for t in SCRIPT[:4]]  # the first token once
    assert [lp.logprob for c in chunks for lp in c.logprobs] == [-0.25, -1.0, -1.0, -1.0]
    final = chunks[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and not final.token_ids
    t = final.timings
    assert (t.prefill_us, t.transfer_bytes, t.transfer_wire_us, t.num_cached_prompt_tokens) == (4321, 8192, 444, 16)
    assert t.transfer_us == 600  # the later of the two sides' transfer ends
    assert t.queue_us > 0 and t.migrations == 0
    assert len(decode.requests) == 1


def test_a_prefill_answer_before_the_first_token_changes_nothing() -> None:
    def prefill_first(decode: RemoteDecode) -> ScriptedPrefill:
        prefill = ScriptedPrefill(decode)
        prefill.gate.set()
        return prefill

    decode = RemoteDecode()
    chunks, code = asyncio.run(_run([decode], prefill_first, lambda p, c: None))
    assert code is None and tokens(chunks) == SCRIPT[:4] and len(chunks) == 5
    assert chunks[-1].timings.prefill_us == 4321 and chunks[-1].timings.transfer_bytes == 8192


def test_a_prefill_failing_before_the_first_token_is_retried_without_it() -> None:
    def failing(decode: RemoteDecode) -> ScriptedPrefill:
        decode.announced.set = lambda: None  # type: ignore[method-assign] # no first token on this attempt
        prefill = ScriptedPrefill(decode, fail=True)
        prefill.gate.set()
        return prefill

    first, survivor = RemoteDecode(), ScriptedDecode()
    chunks, code = asyncio.run(_run([first, survivor], failing, lambda p, c: None))
    assert code is None and tokens(chunks) == SCRIPT[:4]
    assert chunks[-1].timings.migrations == 0  # a retry, not a migration
    retry = (first.requests + survivor.requests)[-1]
    assert retry.prefill_mode == decode_pb2.PREFILL_MODE_LOCAL and retry.num_prior_output_tokens == 0


def test_a_decode_worker_whose_channel_closed_during_admission_is_a_lost_leg_and_its_room_goes_back() -> None:
    # A decode worker dropped while a request waits at the prefill gate has nothing routed to
    # it yet, so the registry closes its channel at once; the request, admitted, then calls
    # Decode on a closed channel (grpc raises UsageError there, before any RPC).
    first, survivor = RemoteDecode(), RemoteDecode()
    gateway: list[GatewayService] = []

    def prefill_for_survivor(_: RemoteDecode) -> ScriptedPrefill:
        prefill = ScriptedPrefill(survivor)
        prefill.gate.set()
        return prefill

    async def close_first(registry: Registry, service: GatewayService, addresses: list[str]) -> None:
        gateway.append(service)
        await next(w for w in registry.workers.values() if w.address == addresses[0]).channel.close()

    chunks, code = asyncio.run(_run([first, survivor], prefill_for_survivor, lambda p, c: None, before=close_first))
    assert code is None and tokens(chunks) == SCRIPT[:4]
    assert first.requests == [] and len(survivor.requests) == 1  # retried on the survivor
    assert chunks[-1].timings.migrations == 0
    assert gateway[0].admission.passing_tokens == 0  # the first attempt's ticket was returned


def test_a_prefill_worker_whose_channel_closed_during_admission_is_a_lost_leg_retried_locally() -> None:
    first, survivor = RemoteDecode(), ScriptedDecode()
    gateway: list[GatewayService] = []

    async def close_prefill(registry: Registry, service: GatewayService, addresses: list[str]) -> None:
        gateway.append(service)
        prefill = next(w for w in registry.workers.values() if w.role == common_pb2.WORKER_ROLE_PREFILL)
        await prefill.channel.close()

    chunks, code = asyncio.run(_run([first, survivor], ScriptedPrefill, lambda p, c: None, before=close_prefill))
    assert code is None and tokens(chunks) == SCRIPT[:4]
    retry = (first.requests + survivor.requests)[-1]
    assert retry.prefill_mode == decode_pb2.PREFILL_MODE_LOCAL and retry.num_prior_output_tokens == 0
    assert gateway[0].admission.passing_tokens == 0


def test_a_prefill_failing_after_the_first_token_migrates_with_it_counted() -> None:
    def fail_after_first(prefill: ScriptedPrefill, chunks: list[gateway_pb2.GenerateResponse]) -> None:
        if len(chunks) == 1:  # the client has the first token; the pages never land
            prefill.gate.set()

    first, survivor = RemoteDecode(hold_after_first=True), ScriptedDecode()
    chunks, code = asyncio.run(_run([first, survivor], lambda d: ScriptedPrefill(d, fail=True), fail_after_first))
    assert code is None
    assert tokens(chunks) == SCRIPT[:4]  # no token twice, none lost
    assert chunks[-1].timings.migrations == 1 and chunks[-1].timings.prefill_us == 0  # that prefill never answered
    continuation = (first.requests + survivor.requests)[-1]
    assert continuation.num_prior_output_tokens == 1 and list(continuation.prompt_token_ids) == PROMPT + SCRIPT[:1]
    assert continuation.stopping.max_new_tokens == 3


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_a_short_request_waits_for_the_prefill_answer_before_its_final_chunk(num_tokens: int) -> None:
    decode = RemoteDecode()
    chunks, code = asyncio.run(_run([decode], ScriptedPrefill, _answer_after_decode_finished(), num_tokens))
    assert code is None and tokens(chunks) == SCRIPT[:num_tokens]
    assert chunks[-1].timings.prefill_us == 4321


@pytest.mark.parametrize("prefill_queued_tokens, mode", [
    (1023, decode_pb2.PREFILL_MODE_REMOTE),  # below local_prefill_spill_tokens (1024): the pool keeps up
    (1024, decode_pb2.PREFILL_MODE_LOCAL),  # backed up: the decode worker's empty queue is shorter
])
def test_a_backed_up_prefill_pool_spills_the_prompt_to_the_decode_worker(prefill_queued_tokens: int,
                                                                       mode: int) -> None:
    decode, registry = RemoteDecode(), Registry("target", 1000, 3)
    chunks, code = asyncio.run(_run([decode], ScriptedPrefill, _answer_after_decode_finished(),
                                    local_prefill_max_tokens=1, prefill_queued_tokens=prefill_queued_tokens,
                                    registry=registry))
    assert code is None and tokens(chunks) == SCRIPT[:4]
    assert [r.prefill_mode for r in decode.requests] == [mode]
    decode_entry = next(w for w in registry.workers.values() if w.role == common_pb2.WORKER_ROLE_DECODE)
    assert decode_entry.num_routed_prefill_tokens == 0  # a local prompt leaves the queue at its first token
