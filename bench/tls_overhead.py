"""What TLS costs: the same cluster plaintext and secured, side by side in one run (not a test).

    python -m bench.tls_overhead [--num-requests 48] [--concurrency 8] [--rounds 3]
                                 [--output-len 32] [--out bench/results/tls_overhead.json]

Two deployments of ``splitserve up``'s processes (gateway + 1 prefill + 1 decode worker, one
torch thread each, the bundled model), started together and measured in alternating rounds
(the order flips every round, so drift in the machine's load hits both):

* ``plaintext``: the local default;
* ``tls``: TLS on every port, mTLS between the services (one throwaway CA,
  ``splitserve/certs.py``), an API key on every request.

Prompts of 20–200 random tokens, ``--local-prefill-max-tokens 16``: almost every request is
prefilled remotely, so the internal control plane (Decode stream, Prefill,
AnnounceTransfer, all over mTLS) is on every request's path. The KV pages themselves
travel on Gloo in both (it cannot be encrypted; ``deploy/kubernetes/README.md``).

Figures: output tokens/s over each round's closed-loop burst (median of the rounds), TTFT
P50/P99 over every request of every round, the time to a first reply on a fresh connection
(TCP + TLS handshake + one ``GetInfo``), the 1-minute load average around each round, and a
check that both deployments return the same greedy tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import grpc

from bench import ab, report
from bench.metrics import percentile
from bench.workload import LengthDist, RequestSpec, synthetic
from plumbing.tls import TlsConfig, TlsStore
from splitserve.certs import write_bundle
from splitserve.client import ClientAuth, make_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "target"
API_KEY = "bench-tls-overhead-key"


def _aio_channel(address: str, auth: ClientAuth) -> grpc.aio.Channel:
    from plumbing.rpc import channel_options

    if auth.tls is None:
        return grpc.aio.insecure_channel(address, options=channel_options())
    return grpc.aio.secure_channel(address, TlsStore(auth.tls).channel_credentials(), options=channel_options())


async def _one(stub: gateway_pb2_grpc.GatewayStub, spec: RequestSpec, auth: ClientAuth) -> tuple[float, list[int]]:
    """TTFT (seconds) and the tokens of one greedy stream."""
    start, ttft, tokens = time.perf_counter(), None, []
    async for chunk in stub.Generate(make_request(list(spec.prompt_token_ids), spec.max_new_tokens,
                                                  ignore_eos=True), timeout=300, metadata=auth.metadata()):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        tokens += chunk.token_ids
    return ttft or 0.0, tokens


async def _burst(address: str, auth: ClientAuth, requests: list[RequestSpec], concurrency: int) -> dict:
    """A closed loop of ``concurrency`` clients on one channel: seconds, TTFTs, tokens."""
    async with _aio_channel(address, auth) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await stub.GetInfo(gateway_pb2.GetInfoRequest(), timeout=30, metadata=auth.metadata())  # connected
        pending = iter(enumerate(requests))
        results: dict[int, tuple[float | None, list[int]]] = {}
        errors: list[str] = []

        async def client() -> None:
            for index, spec in pending:
                try:
                    results[index] = await _one(stub, spec, auth)
                except grpc.aio.AioRpcError as exc:  # counted and reported, never hidden
                    errors.append(f"{exc.code().name}: {exc.details()}")
                    results[index] = (None, [])

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    ordered = [results[i] for i in range(len(requests))]
    return {"seconds": seconds, "ttft_s": [t for t, _ in ordered if t is not None],
            "tokens": [ids for _, ids in ordered], "output_tokens": sum(len(ids) for _, ids in ordered),
            "errors": errors}


async def _fresh_connections(address: str, auth: ClientAuth, count: int) -> list[float]:
    """Seconds from a new channel to its first reply (TCP + TLS handshake + one GetInfo)."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        async with _aio_channel(address, auth) as channel:
            await gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=30,
                                                                metadata=auth.metadata())
        times.append(time.perf_counter() - start)
    return times


def measure(args: argparse.Namespace, clusters: dict[str, tuple[str, ClientAuth]],
            requests: list[RequestSpec]) -> dict:
    for address, auth in clusters.values():  # warm-up (first-use costs in every process), not counted
        asyncio.run(_burst(address, auth, requests[: args.concurrency], args.concurrency))
    runs = ab.alternate({name: (lambda a=address, c=auth: asyncio.run(_burst(a, c, requests, args.concurrency)))
                         for name, (address, auth) in clusters.items()}, args.rounds)
    results = {}
    for name in clusters:
        connects = asyncio.run(_fresh_connections(*clusters[name], args.connections))
        results[name] = {**ab.summary(runs[name]), "fresh_connection_p50_ms": percentile(connects, 50) * 1e3}
    same = all(x == y for a, b in zip(runs["plaintext"], runs["tls"]) for x, y in zip(a["tokens"], b["tokens"])
               if x and y)  # requests that failed in either are not compared (and are reported)
    results["tls_vs_plaintext"] = {**ab.ratios(results, "tls", "plaintext", ["fresh_connection_p50_ms"]),
                                   "same_greedy_tokens": same}
    return results


def markdown(results: dict) -> str:
    return ab.markdown(results, "deployment", ("plaintext", "tls"), "tls_vs_plaintext",
                       {"fresh connection P50 ms": "fresh_connection_p50_ms"})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--connections", type=int, default=20, help="fresh connections timed per deployment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "tls_overhead.json"))
    args = parser.parse_args(argv)
    requests = synthetic(args.num_requests, args.seed, vocab_size=4096, prompt=LengthDist(20, 200),
                         output=LengthDist(args.output_len, args.output_len))
    # Heartbeats tolerate a starved machine (the cores may be shared): a worker dropped for a
    # late beat would measure the registry, not TLS.
    flags = ["--local-prefill-max-tokens", "16", "--heartbeat-miss-count", "20"]
    logs = str(Path(args.out).with_suffix("")) + "-logs"  # the services' logs, kept beside the report
    with tempfile.TemporaryDirectory(prefix="tls-overhead-") as tmp:
        bundle = write_bundle(Path(tmp) / "tls")
        with Cluster(str(MODEL), gateway_flags=flags, log_dir=logs + "/plaintext") as plain, \
                Cluster(str(MODEL), gateway_flags=flags, tls=bundle, api_keys=[API_KEY], log_dir=logs + "/tls") as secured:
            client_tls = TlsConfig(ca_file=str(bundle.ca))  # public port: verify the gateway, no client cert
            clusters = {"plaintext": (plain.addresses["gateway"], ClientAuth()),
                        "tls": (secured.addresses["gateway"], ClientAuth(tls=client_tls, token=API_KEY))}
            results = measure(args, clusters, requests)
    out = {**report.header("tls_overhead", num_threads=1),
           "workload": {"num_requests": args.num_requests, "concurrency": args.concurrency, "rounds": args.rounds,
                        "prompt_tokens": "uniform 20-200", "output_tokens": args.output_len,
                        "local_prefill_max_tokens": 16, "heartbeat_miss_count": 20,
                        "model": str(MODEL.relative_to(ROOT))},
           "results": results}
    report.write_json(out, Path(args.out))
    print(markdown(results))
    return out


if __name__ == "__main__":
    main()
