"""What a silent KV rendezvous peer costs other requests (issue #22, item 4).

A hostile caller of ``OpenKVChannel`` names a rendezvous of its own that accepts the TCP
connection and never answers, and keeps as many joins stalled as the decode worker lets it,
from several incarnations at once. Meanwhile a burst of requests, every one prefilled
remotely (``--local-prefill-max-tokens 0``), runs right after the prefill worker was
restarted, so its lanes to the decode worker must be joined again while the stall is on.
Rounds alternate between no attacker and the attacker; the figure is the extra TTFT at P99
(and P50) of the attacked rounds over the quiet ones, with the errors of each.

    python -m bench.silent_peer --rounds 2 --requests 24 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import grpc

from bench.metrics import percentile
from bench.workload import LengthDist, RequestSpec, synthetic
from splitserve.client import make_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, kv_transfer_pb2

MODEL = Path(__file__).resolve().parents[1] / "models" / "target"


class SilentListener:
    """Accepts every TCP connection on 127.0.0.1 and never answers."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.server.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.server.close()
        for conn in self.accepted:
            conn.close()


async def _attack(decode_address: str, layout: common_pb2.KVLayout, port: int, stop: asyncio.Event,
                  num_incarnations: int, joins_each: int) -> dict[str, int]:
    """Keep ``joins_each`` stalled joins per attacker incarnation until ``stop``."""
    outcomes: dict[str, int] = {}

    async def one(stub: decode_pb2_grpc.DecodeWorkerStub, incarnation: int) -> None:
        handshake = kv_transfer_pb2.KVChannelHandshake(
            transport=kv_transfer_pb2.TRANSPORT_KIND_GLOO, kv_layout=layout, timeout_ms=60_000,
            prefill_incarnation=incarnation, gloo=kv_transfer_pb2.GlooRendezvous(host="127.0.0.1", port=port))
        while not stop.is_set():
            outcomes["started"] = outcomes.get("started", 0) + 1  # a join that stalls ends after the burst
            try:
                await stub.OpenKVChannel(handshake, timeout=90)
                name = "OK"
            except grpc.aio.AioRpcError as exc:
                name = exc.code().name
            outcomes[name] = outcomes.get(name, 0) + 1
            await asyncio.sleep(0.05)

    async with grpc.aio.insecure_channel(decode_address) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        tasks = [asyncio.ensure_future(one(stub, secrets.randbits(63) + 1))
                 for _ in range(num_incarnations) for _ in range(joins_each)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


async def _burst(gateway: str, requests: list[RequestSpec], concurrency: int) -> tuple[list[float], list[str]]:
    """TTFT of each request (closed loop of ``concurrency`` clients) and the errors."""
    ttfts: list[float] = []
    errors: list[str] = []
    pending = iter(requests)
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def client() -> None:
            for spec in pending:
                start = time.perf_counter()
                try:
                    async for chunk in stub.Generate(make_request(list(spec.prompt_token_ids), spec.max_new_tokens,
                                                                  ignore_eos=True), timeout=120):
                        if chunk.token_ids:
                            ttfts.append(time.perf_counter() - start)
                            break
                except grpc.aio.AioRpcError as exc:
                    errors.append(exc.code().name)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts, errors


async def _round(cluster: Cluster, requests: list[RequestSpec], args: argparse.Namespace, attacked: bool) -> dict:
    await asyncio.to_thread(_restart_prefill, cluster)  # its lanes must be joined again
    async with grpc.aio.insecure_channel(cluster.addresses["gateway"]) as channel:
        info = await gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=30)
    layout = next(w.kv_layout for w in info.workers if w.role == common_pb2.WORKER_ROLE_DECODE)
    listener, stop = SilentListener(), asyncio.Event()
    attack = asyncio.ensure_future(_attack(cluster.addresses["decode-0"], layout, listener.port, stop,
                                           args.attackers, args.joins_each)) if attacked else None
    if attack is not None:
        await asyncio.sleep(1.0)  # the stall is on before the burst
    ttfts, errors = await _burst(cluster.addresses["gateway"], requests, args.concurrency)
    stop.set()
    outcomes = await attack if attack is not None else {}
    listener.close()
    return {"attacked": attacked, "ttft_s": ttfts, "errors": errors, "attacker_outcomes": outcomes}


def _restart_prefill(cluster: Cluster) -> None:
    cluster.kill("prefill-0", signal.SIGTERM)
    cluster.restart("prefill-0")
    cluster._wait_registered(120)  # noqa: SLF001 - the cluster's own wait
    time.sleep(1.0)  # the gateway's registry settles (the old incarnation replaced)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind (alternating)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--attackers", type=int, default=3, help="attacker incarnations")
    parser.add_argument("--joins-each", type=int, default=2, help="joins each keeps stalled")
    parser.add_argument("--kv-channel-timeout-s", type=float, default=10.0)
    parser.add_argument("--out", default="", help="write the JSON summary here too")
    args = parser.parse_args()
    requests = synthetic(args.requests, 7, 1000, LengthDist(40, 120), LengthDist(4, 4))
    flags = ["--kv-channel-timeout-s", str(args.kv_channel_timeout_s)]
    rounds = []
    with Cluster(str(MODEL), gateway_flags=["--local-prefill-max-tokens", "0"], worker_flags=flags) as cluster:
        for i in range(2 * args.rounds):
            rounds.append(asyncio.run(_round(cluster, requests, args, attacked=i % 2 == 1)))
    summary = _summary(rounds)
    summary["loadavg"] = os.getloadavg()
    print(json.dumps(summary, indent=2))  # noqa: T201 - the benchmark's report
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))


def _summary(rounds: list[dict]) -> dict:
    out: dict[str, object] = {}
    for attacked in (False, True):
        ttfts = [t for r in rounds if r["attacked"] is attacked for t in r["ttft_s"]]
        name = "attacked" if attacked else "quiet"
        out[name] = {"requests": len(ttfts), "ttft_p50_s": round(percentile(ttfts, 50), 4),
                     "ttft_p99_s": round(percentile(ttfts, 99), 4),
                     "errors": [e for r in rounds if r["attacked"] is attacked for e in r["errors"]],
                     "attacker_outcomes": [r["attacker_outcomes"] for r in rounds if r["attacked"] is attacked]}
    quiet, attacked_ = out["quiet"], out["attacked"]
    out["extra_ttft_p99_s"] = round(attacked_["ttft_p99_s"] - quiet["ttft_p99_s"], 4)  # type: ignore[index]
    out["extra_ttft_p50_s"] = round(attacked_["ttft_p50_s"] - quiet["ttft_p50_s"], 4)  # type: ignore[index]
    return out


if __name__ == "__main__":
    main()
