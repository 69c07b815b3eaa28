"""``splitserve`` command line.

``up`` runs a local cluster (gateway + prefill + decode workers) on the bundled model;
``gateway`` / ``prefill`` / ``decode`` run one service (compose, Kubernetes);
``generate`` streams a completion through a gateway (or ``--in-process`` on the engine).
Every flag can also be set as ``SPLITSERVE_<FLAG>`` (see ``plumbing.config``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "target"


def default_model() -> str:
    """``SPLITSERVE_MODEL`` if set, else the bundled model of this checkout."""
    return os.environ.get("SPLITSERVE_MODEL") or str(DEFAULT_MODEL)


def _generate_in_process(args: argparse.Namespace) -> int:
    from engine import Engine, EngineConfig, SamplingParams
    from engine.spec_decode.config import SpeculativeConfig

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
        )
        speculative = None
        if args.speculative != "none":
            speculative = SpeculativeConfig(
                method=args.speculative,
                num_speculative_tokens=args.num_speculative_tokens,
                draft_model=args.draft_model,
            )
        engine = Engine(
            EngineConfig(
                model=args.model, dtype=args.dtype, num_threads=args.threads, speculative=speculative
            )
        )
        request_id = engine.add_request(args.prompt, params)
    except ValueError as exc:
        sys.stderr.write(f"splitserve: {exc}\n")
        return 2
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    finish_reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                finish_reason = out.finish_reason
    sys.stdout.write(f"\n[finish_reason={finish_reason}]\n")
    return 0


def _run_service(args: argparse.Namespace) -> int:
    import asyncio

    from plumbing import config as cfg
    from plumbing.logs import configure_logging

    configure_logging(args.command, args.log_level)
    try:
        if args.command == "gateway":
            from gateway.server import serve_gateway

            coro = serve_gateway(cfg.gateway_config(args))
        elif args.command == "prefill":
            from prefill_worker.server import serve_prefill

            coro = serve_prefill(cfg.worker_config(args))
        else:
            from decode_worker.server import serve_decode

            coro = serve_decode(cfg.worker_config(args))
    except ValueError as exc:
        sys.stderr.write(f"splitserve {args.command}: {exc}\n")
        return 2
    asyncio.run(coro)
    return 0


def _up(args: argparse.Namespace) -> int:
    from splitserve.cluster import run_cluster

    return run_cluster(args)


def _generate(args: argparse.Namespace) -> int:
    if args.in_process:
        return _generate_in_process(args)
    from splitserve.client import stream_to_terminal

    return stream_to_terminal(args)


def _health(args: argparse.Namespace) -> int:
    """Exit 0 when the server at ``--address`` reports SERVING (compose health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(args.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
    except grpc.RpcError as exc:
        sys.stderr.write(f"{args.address}: {exc.code().name}\n")
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    sys.stderr.write(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}\n")
    return 0 if serving else 1


def _bench(args: argparse.Namespace) -> int:
    from bench.main import run_from_args

    return run_from_args(args)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``splitserve bench``: load generator, peers and report (the ``bench`` package)."""
    from bench.options import add_bench_flags

    bench = sub.add_parser("bench", help="benchmark a deployment and its peers; write a report")
    add_bench_flags(bench, default_model())
    bench.set_defaults(func=_bench)


def build_parser() -> argparse.ArgumentParser:
    from plumbing import config as cfg

    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion of PROMPT through the gateway")
    gen.add_argument("prompt")
    cfg.add_flag(gen, "--gateway", default="127.0.0.1:50051", help="gateway address")
    gen.add_argument("--wait-s", type=float, default=60.0,
                     help="wait this long for the gateway and a decode worker to be up")
    gen.add_argument("--timeout-s", type=float, default=120.0, help="request deadline")
    gen.add_argument("--min-prefill-workers", type=int, default=0,
                     help="also wait until this many prefill workers have registered")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--in-process", action="store_true", help="run the engine here, no services")
    gen.add_argument("--model", default=default_model(), help="(--in-process) checkpoint directory")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--threads", type=int, default=None, help="(--in-process) torch CPU threads")
    gen.add_argument("--speculative", default="none", choices=["none", "ngram", "draft_model", "ngram_draft"])
    gen.add_argument("--num-speculative-tokens", type=int, default=4)
    gen.add_argument("--draft-model", default=str(DEFAULT_MODEL.parent / "draft"))
    gen.set_defaults(func=_generate)
    add_bench_parser(sub)

    gw = sub.add_parser("gateway", help="run the gateway")
    cfg.add_gateway_flags(gw, default_model())
    gw.set_defaults(func=_run_service)
    for role in ("prefill", "decode"):
        worker = sub.add_parser(role, help=f"run a {role} worker")
        cfg.add_worker_flags(worker, default_model())
        worker.set_defaults(func=_run_service)

    hc = sub.add_parser("health", help="check a server's grpc.health.v1 status (exit 0: SERVING)")
    hc.add_argument("--address", default="127.0.0.1:50051")
    hc.add_argument("--service", default="", help="service name ('' = the whole server)")
    hc.add_argument("--timeout-s", type=float, default=2.0)
    hc.set_defaults(func=_health)

    up = sub.add_parser("up", help="run gateway + prefill + decode workers on this machine")
    cfg.add_flag(up, "--port", type=int, default=50051, help="gateway port")
    cfg.add_flag(up, "--num-prefill", type=int, default=1, help="prefill workers")
    cfg.add_flag(up, "--num-decode", type=int, default=1, help="decode workers")
    cfg.add_flag(up, "--model", default=default_model(), help="checkpoint directory")
    cfg.add_flag(up, "--threads", type=int, default=1, help="torch threads per worker")
    cfg.add_flag(up, "--metrics-port", type=int, default=-1,
                 help="gateway metrics port; workers use the following ports (-1 off)")
    cfg.add_flag(up, "--log-level", default="info", help="debug|info|warning|error")
    cfg.add_flag(up, "--local-prefill-max-tokens", type=int, default=32,
                 help="gateway: prompts shorter than this prefill on the decode worker (0: never)")
    cfg.add_flag(up, "--log-dir", default=None, help="write each service's log here (default: inherit stderr)")
    up.add_argument("service_args", nargs=argparse.REMAINDER,
                    help="after --: extra flags for every worker (e.g. -- --speculative ngram)")
    up.set_defaults(func=_up)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
