"""Request migration at the gateway, against scripted decode workers on 127.0.0.1:0.

A scripted worker "generates" ``SCRIPT[j]`` at output position j, so a continuation that is
not exactly prompt + tokens sent (with ``num_prior_output_tokens`` and the budgets counted
down) yields the wrong tokens, and is refused outright when its prompt is not a prefix of
the script. A worker "dies" by aborting its stream with UNAVAILABLE "Socket closed" after a
number of tokens, as a killed process's stream ends.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from engine.models.spec import load_tokenizer
from gateway.registry import Registry
from gateway.server import model_limits
from gateway.service import GatewayService
from plumbing import rpc
from plumbing.config import GatewayConfig, ServerConfig
from plumbing.metrics import GatewayMetrics
from splitserve.client import make_request
from splitserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "target")
TOKENIZER = load_tokenizer(MODEL)
PROMPT = TOKENIZER.encode("The numbers, in words:", add_special_tokens=False)
SCRIPT = TOKENIZER.encode(" one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
                          add_special_tokens=False)


class ScriptedDecode(decode_pb2_grpc.DecodeWorkerServicer):
    """Streams SCRIPT from the position the request resumes at; dies after ``die_after``."""

    def __init__(self, die_after: int | None = None) -> None:
        self.die_after = die_after
        self.requests: list[decode_pb2.DecodeRequest] = []

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):  # noqa: ANN201
        self.requests.append(request)
        n = request.num_prior_output_tokens
        prompt = list(request.prompt_token_ids)
        if prompt != PROMPT + SCRIPT[:n]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not prompt + the tokens sent")
        for i in range(request.stopping.max_new_tokens):
            if i == self.die_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            yield decode_pb2.DecodeResponse(tokens=decode_pb2.TokenChunk(token_ids=[SCRIPT[n + i]]))
        yield decode_pb2.DecodeResponse(finished=decode_pb2.DecodeFinished(
            finish_reason=common_pb2.FINISH_REASON_LENGTH))


async def run_gateway(workers: list[ScriptedDecode], request: gateway_pb2.GenerateRequest,
                      max_migrations: int = 2, eos: tuple[int, ...] = ()) -> tuple[list[gateway_pb2.GenerateResponse], grpc.StatusCode | None, GatewayMetrics]:
    """Serve a gateway whose registry holds ``workers`` (each reporting a little more load than
    the one before, so routing tries them in order), stream ``request`` through it; the
    chunks, the error code, the metrics."""
    config = GatewayConfig(server=ServerConfig(), model=MODEL, max_migrations=max_migrations)
    registry = Registry("target", 1000, 3)
    metrics = GatewayMetrics.create()
    limits = replace(model_limits(config, TOKENIZER), eos_token_ids=eos)
    servers = [rpc.make_server() for _ in range(len(workers) + 1)]
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayService(config, registry, TOKENIZER, limits, metrics, "target"), servers[0])
    ports = []
    for server, worker in zip(servers, [None, *workers]):
        if worker is not None:
            decode_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
    for i, port in enumerate(ports[1:]):  # each a little busier than the one before
        await registry.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
            role=common_pb2.WORKER_ROLE_DECODE, address=f"127.0.0.1:{port}", model="target", incarnation=port,
            load=common_pb2.WorkerLoad(kv_blocks_total=100, kv_blocks_free=100 - i)), None)
    chunks, code = [], None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
        try:
            async for chunk in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=30):
                chunks.append(chunk)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
    for server in servers:
        await server.stop(0)
    await registry.stop()
    return chunks, code, metrics


def generate(workers: list[ScriptedDecode], request: gateway_pb2.GenerateRequest, **kw: object):  # noqa: ANN201
    return asyncio.run(run_gateway(workers, request, **kw))  # type: ignore[arg-type]


def tokens(chunks: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_stream_continues_on_a_survivor_exactly_once() -> None:
    dying, survivor = ScriptedDecode(die_after=5), ScriptedDecode()
    request = make_request(PROMPT, 12, temperature=0.8, seed=7)
    request.stopping.min_new_tokens = 8
    chunks, code, metrics = generate([dying, survivor], request)
    assert code is None
    assert tokens(chunks) == SCRIPT[:12]  # every token once, no gap
    assert "".join(c.text for c in chunks) == TOKENIZER.decode(SCRIPT[:12])
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].timings.migrations == 1
    assert metrics.migrations._value.get() == 1  # noqa: SLF001 - the counter's value
    assert len(dying.requests) == 1 and len(survivor.requests) == 1
    cont = survivor.requests[0]
    assert cont.num_prior_output_tokens == 5
    assert cont.stopping.max_new_tokens == 7 and cont.stopping.min_new_tokens == 3
    assert cont.sampling.seed == 7 and cont.sampling.temperature == pytest.approx(0.8)
    assert cont.request_id == dying.requests[0].request_id


def test_a_stop_string_across_the_cut_is_found() -> None:
    """The worker dies right after " four": the held-back text waits for " five"."""
    four = next(i for i in range(len(SCRIPT)) if TOKENIZER.decode(SCRIPT[: i + 1]).endswith("four"))
    chunks, code, _ = generate([ScriptedDecode(die_after=four + 1), ScriptedDecode()],
                               make_request(PROMPT, 12, stop=["four five"]))
    assert code is None
    assert "".join(c.text for c in chunks) == " one two three "
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert chunks[-1].timings.migrations == 1


def test_past_max_migrations_the_stream_ends_unavailable() -> None:
    workers = [ScriptedDecode(die_after=2) for _ in range(3)]
    chunks, code, _ = generate(workers, make_request(PROMPT, 12), max_migrations=2)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert tokens(chunks) == SCRIPT[:6]  # two from each, none twice
    assert [len(w.requests) for w in workers] == [1, 1, 1]  # never back to a dead worker


def test_no_migration_when_disabled() -> None:
    survivor = ScriptedDecode()
    chunks, code, _ = generate([ScriptedDecode(die_after=3), survivor], make_request(PROMPT, 12), max_migrations=0)
    assert code == grpc.StatusCode.UNAVAILABLE and tokens(chunks) == SCRIPT[:3]
    assert not survivor.requests


@pytest.mark.parametrize("case", ["eos", "stop_id", "length"])
def test_a_death_after_the_last_token_finishes_without_migrating(case: str) -> None:
    """The tokens sent already end the request (the worker died before saying so)."""
    request = make_request(PROMPT, 4 if case == "length" else 12)
    eos = (SCRIPT[3],) if case == "eos" else ()
    if case == "stop_id":
        request.stopping.stop_token_ids.append(SCRIPT[3])
    survivor = ScriptedDecode()
    chunks, code, _ = generate([ScriptedDecode(die_after=4), survivor], request, eos=eos)
    assert code is None and tokens(chunks) == SCRIPT[:4]
    want = common_pb2.FINISH_REASON_LENGTH if case == "length" else common_pb2.FINISH_REASON_STOP
    assert chunks[-1].finish_reason == want and chunks[-1].timings.migrations == 0
    assert not survivor.requests


def test_min_new_tokens_keeps_an_eos_going() -> None:
    """An EOS before min_new_tokens does not end the request: it migrates."""
    request = make_request(PROMPT, 8)
    request.stopping.min_new_tokens = 6
    chunks, code, _ = generate([ScriptedDecode(die_after=4), ScriptedDecode()], request, eos=(SCRIPT[3],))
    assert code is None and tokens(chunks) == SCRIPT[:8]
    assert chunks[-1].timings.migrations == 1


def test_max_migrations_flag_env_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from plumbing.config import add_gateway_flags, gateway_config

    def parse(*argv: str) -> GatewayConfig:
        parser = argparse.ArgumentParser()
        add_gateway_flags(parser, MODEL)
        return gateway_config(parser.parse_args(list(argv)))

    assert parse().max_migrations == 2
    assert parse("--max-migrations", "0").max_migrations == 0
    monkeypatch.setenv("SPLITSERVE_MAX_MIGRATIONS", "5")
    assert parse().max_migrations == 5
    with pytest.raises(ValueError, match="max_migrations"):
        GatewayConfig(server=ServerConfig(), model=MODEL, max_migrations=-1)
