"""Helpers for the end-to-end tests: real worker processes on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from splitserve.client import make_request
from plumbing.rpc import channel_options
from splitserve_api.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "target")


@dataclass
class Streamed:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # where the request asked for them
    text: str = ""
    chunks: int = 0
    finish_reason: int = 0
    timings: common_pb2.PhaseTimings | None = None
    error: grpc.StatusCode | None = None
    details: str = ""
    request_id: int = 0


def stream(address: str, request: gateway_pb2.GenerateRequest, timeout: float = 60.0,
           started: threading.Event | None = None) -> Streamed:
    """Run one Generate stream to its end; ``started`` is set on its first chunk."""
    out = Streamed()
    with grpc.insecure_channel(address) as channel:  # a plain client: gRPC's default limits
        try:
            for chunk in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=timeout):
                assert out.finish_reason == 0, "a chunk arrived after the final one"
                out.token_ids += list(chunk.token_ids)
                out.logprobs += [lp.logprob for lp in chunk.logprobs]
                out.text += chunk.text
                out.chunks += 1
                out.request_id = chunk.request_id
                if started is not None:
                    started.set()
                if chunk.finish_reason:
                    out.finish_reason = chunk.finish_reason
                    out.timings = chunk.timings
        except grpc.RpcError as exc:
            out.error, out.details = exc.code(), exc.details()
    return out


def stream_many(address: str, requests: list[gateway_pb2.GenerateRequest], timeout: float = 120.0) -> list[Streamed]:
    with cf.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: stream(address, r, timeout), requests))


def worker_stats(gateway: str) -> dict[str, common_pb2.WorkerLoad]:
    """GetStats of every registered worker, by address."""
    with grpc.insecure_channel(gateway, options=channel_options()) as channel:
        info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=5)
    stats = {}
    for w in info.workers:
        with grpc.insecure_channel(w.address, options=channel_options()) as channel:
            stub = (decode_pb2_grpc.DecodeWorkerStub(channel) if w.role == common_pb2.WORKER_ROLE_DECODE
                    else prefill_pb2_grpc.PrefillWorkerStub(channel))
            try:
                stats[w.address] = stub.GetStats(common_pb2.GetStatsRequest(), timeout=5)
            except grpc.RpcError as exc:  # a worker killed by the test, not yet dropped
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
    return stats


def idle(load: common_pb2.WorkerLoad) -> bool:
    return (load.kv_blocks_free == load.kv_blocks_total and load.kv_blocks_in_transfer == 0
            and load.num_running == 0 and load.num_waiting == 0)


def wait_all_free(gateway: str, within_s: float = 2.0) -> dict[str, common_pb2.WorkerLoad]:
    """Poll until every worker's pool is fully free; return the last stats either way."""
    deadline = time.monotonic() + within_s
    while True:
        stats = worker_stats(gateway)
        if all(idle(s) for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def code_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:  # noqa: ANN001
    """Token prompts of the given lengths cut from this repository's Python source."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "engine").glob("*.py")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts, pos = [], 0
    for n in lengths:
        prompts.append(ids[pos : pos + n])
        pos += n * 3 + 17
    return prompts


def greedy_requests(prompts: list[list[int]], max_tokens: list[int]) -> list[gateway_pb2.GenerateRequest]:
    return [make_request(p, m) for p, m in zip(prompts, max_tokens)]
