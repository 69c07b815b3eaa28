"""What the OpenAI-compatible HTTP front costs: the same requests over HTTP/SSE (through
``splitserve http``) and straight over gRPC, side by side in one run (not a test).

    python -m bench.http_vs_grpc [--num-requests 48] [--concurrency 8] [--rounds 3]
                                 [--output-len 32] [--out bench/results/http_vs_grpc.json]

One cluster (gateway + 1 prefill + 1 decode worker, one torch thread each, the bundled
model) with its HTTP front; the rounds alternate between the two ways in (the order flips
every round, so drift in the machine's load hits both). Each client keeps one connection
(gRPC: one channel for all; HTTP: one keep-alive connection per client, ``bench/sse_client.py``).
Prompts of 20-200 random token ids, greedy, ``ignore_eos``. Figures: output tokens/s per
round's closed-loop burst (median of the rounds, and the median of same-round ratios), TTFT
(the first chunk: a gRPC message, an SSE event) P50/P99 over every request of every round,
the 1-minute load average, and whether both ways returned the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import grpc

from bench import ab, report
from bench.sse_client import SSEConnection
from bench.workload import LengthDist, RequestSpec, synthetic
from plumbing.rpc import channel_options
from splitserve.client import make_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "target"
Result = tuple[float | None, str, int]  # TTFT (s), text, chunks; TTFT None: failed


async def _grpc_burst(address: str, requests: list[RequestSpec], concurrency: int) -> dict:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await stub.GetInfo(gateway_pb2.GetInfoRequest(), timeout=30)  # connected

        async def one(spec: RequestSpec) -> Result:
            start, ttft, text, chunks = time.perf_counter(), None, "", 0
            async for chunk in stub.Generate(make_request(list(spec.prompt_token_ids), spec.max_new_tokens,
                                                          ignore_eos=True), timeout=300):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text, chunks = text + chunk.text, chunks + 1
            return ttft, text, chunks

        return await _closed_loop(requests, concurrency, lambda: _Session(one))


async def _http_burst(address: str, model: str, requests: list[RequestSpec], concurrency: int) -> dict:
    host, port = address.rsplit(":", 1)

    def session() -> _Session:
        connection = SSEConnection(host, int(port))

        async def one(spec: RequestSpec) -> Result:
            start, ttft, text, chunks = time.perf_counter(), None, "", 0
            body = {"model": model, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_new_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            async for at, data in connection.post_sse("/v1/completions", body):
                ttft = ttft if ttft is not None else at - start
                text, chunks = text + data["choices"][0]["text"], chunks + 1
            return ttft, text, chunks

        return _Session(one, connection)

    return await _closed_loop(requests, concurrency, session)


class _Session:
    """One client's way in: a request function and the connection it holds (if its own)."""

    def __init__(self, one, connection: SSEConnection | None = None) -> None:  # noqa: ANN001
        self.one, self.connection = one, connection


async def _closed_loop(requests: list[RequestSpec], concurrency: int, session) -> dict:  # noqa: ANN001
    pending = iter(enumerate(requests))
    results: dict[int, Result] = {}
    errors: list[str] = []

    async def client() -> None:
        s = session()
        if s.connection is not None:
            await s.connection.__aenter__()
        try:
            for index, spec in pending:
                try:
                    results[index] = await s.one(spec)
                except (grpc.aio.AioRpcError, RuntimeError, OSError) as exc:  # counted, never hidden
                    errors.append(f"{type(exc).__name__}: {exc}")
                    results[index] = (None, "", 0)
        finally:
            if s.connection is not None:
                await s.connection.__aexit__()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    ordered = [results[i] for i in range(len(requests))]
    return {"seconds": seconds, "ttft_s": [t for t, _, _ in ordered if t is not None],
            "texts": [text for _, text, _ in ordered], "errors": errors,
            "output_tokens": sum(spec.max_new_tokens for spec, r in zip(requests, ordered) if r[0] is not None)}


def measure(gateway: str, http: str, model: str, requests: list[RequestSpec], concurrency: int,
            rounds: int) -> dict:
    bursts = {"grpc": lambda: asyncio.run(_grpc_burst(gateway, requests, concurrency)),
              "http_sse": lambda: asyncio.run(_http_burst(http, model, requests, concurrency))}
    for burst in bursts.values():  # warm-up with the whole workload (first-use costs of each shape), not counted
        burst()
    runs = ab.alternate(bursts, rounds)
    results = {name: ab.summary(runs[name]) for name in bursts}
    results["http_vs_grpc"] = {
        **ab.ratios(results, "http_sse", "grpc"),
        "same_text": all(a == b for g, h in zip(runs["grpc"], runs["http_sse"])
                         for a, b in zip(g["texts"], h["texts"]) if a and b),
    }
    return results


def markdown(results: dict) -> str:
    return ab.markdown(results, "way in", ("grpc", "http_sse"), "http_vs_grpc")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "http_vs_grpc.json"))
    args = parser.parse_args(argv)
    requests = synthetic(args.num_requests, args.seed, vocab_size=4096, prompt=LengthDist(20, 200),
                         output=LengthDist(args.output_len, args.output_len))
    flags = ["--local-prefill-max-tokens", "16", "--heartbeat-miss-count", "20"]  # a starved machine's beats
    logs = str(Path(args.out).with_suffix("")) + "-logs"
    with Cluster(str(MODEL), gateway_flags=flags, http_port=0, log_dir=logs) as cluster:
        results = measure(cluster.addresses["gateway"], cluster.addresses["http"], MODEL.name, requests,
                          args.concurrency, args.rounds)
    out = {**report.header("http_vs_grpc", num_threads=1),
           "workload": {"num_requests": args.num_requests, "concurrency": args.concurrency, "rounds": args.rounds,
                        "prompt_tokens": "uniform 20-200", "output_tokens": args.output_len,
                        "local_prefill_max_tokens": 16, "model": str(MODEL.relative_to(ROOT))},
           "results": results}
    report.write_json(out, Path(args.out))
    print(markdown(results))
    return out


if __name__ == "__main__":
    main()
