"""``splitserve`` command line.

``up`` runs a local cluster (gateway + prefill + decode workers) on the default model;
``gateway`` / ``prefill`` / ``decode`` run one service (compose, Kubernetes); ``http`` the
OpenAI-compatible HTTP front of a gateway;
``generate`` streams a completion or a chat answer through a gateway (or ``--in-process``
on the engine); ``fetch`` fetches the default model into the cache.
Every flag can also be set as ``SPLITSERVE_<FLAG>`` (see ``plumbing.config``).

The default model is SmolLM2-135M-Instruct (GGUF), fetched on first use
(``splitserve.default_model``); the small pair bundled in ``models/`` serves the tests, the
benchmarks and the speculative-decoding demo.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from splitserve import process_env
from splitserve.default_model import FetchError, default_model_path, ensure_default_model

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO_ROOT / "models" / "target"


def default_model() -> str:
    """``SPLITSERVE_MODEL`` if set, else the default model's place in the cache."""
    return os.environ.get("SPLITSERVE_MODEL") or str(default_model_path())


def ensure_model(model: str) -> bool:
    """Fetch the default model if ``model`` is it and the cache lacks it; False on failure."""
    if model != str(default_model_path()):
        return True
    try:
        ensure_default_model()
    except FetchError as exc:
        sys.stderr.write(f"splitserve: {exc}\n")
        return False
    return True


def _in_process_prompt(engine: object, args: argparse.Namespace) -> str | list[int]:
    from engine.chat import ChatTemplate
    from splitserve.client import cli_chat_turns

    turns = cli_chat_turns(args)
    if turns is None:
        return args.prompt
    chat = ChatTemplate.of(engine.tokenizer)  # type: ignore[attr-defined]
    if chat is None:
        raise ValueError(f"--chat: {args.model} has no chat template")
    return chat.render(turns, field="--chat")


def _chat_stops(engine: object, args: argparse.Namespace, params: object) -> object:
    """A chat answer ends at the template's end-of-turn token (as the gateway does it)."""
    from dataclasses import replace

    from engine.chat import ChatTemplate

    chat = ChatTemplate.of(engine.tokenizer) if args.chat is not None else None  # type: ignore[attr-defined]
    if chat is None:
        return params
    return replace(params, stop_token_ids=tuple(chat.end_of_turn_ids))


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
        request_id = engine.add_request(_in_process_prompt(engine, args), _chat_stops(engine, args, params))
    except ValueError as exc:
        sys.stderr.write(f"splitserve: {exc}\n")
        return 2
    if args.chat is None:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    finish_reason = error = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                finish_reason = out.finish_reason
                error = out.error
    sys.stdout.write(f"\n[finish_reason={finish_reason}]\n")
    if error is not None:
        sys.stderr.write(f"splitserve: {error}\n")
        return 1
    return 0


def _run_service(args: argparse.Namespace) -> int:
    import asyncio

    if not ensure_model(args.model):
        return 1

    from plumbing import config as cfg
    from plumbing.logs import configure_logging

    configure_logging(args.command, args.log_level)
    from plumbing.tracing import configure_tracing

    configure_tracing(args.command)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the service listens for it (a reload)
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
    try:
        asyncio.run(coro)
    except ValueError as exc:  # a setting the model cannot take (e.g. an int4 group size), found at load
        sys.stderr.write(f"splitserve {args.command}: {exc}\n")
        return 2
    finally:
        from plumbing.tracing import shutdown

        shutdown()
    return 0


def _run_http(args: argparse.Namespace) -> int:
    """``splitserve http``: the OpenAI-compatible HTTP front of a gateway."""
    import asyncio

    from http_front.config import http_config
    from plumbing.logs import configure_logging

    configure_logging("http", args.log_level)
    from plumbing.tracing import configure_tracing

    configure_tracing("http")
    try:
        config = http_config(args)
    except ValueError as exc:
        sys.stderr.write(f"splitserve http: {exc}\n")
        return 2
    from http_front.server import serve_http

    try:
        asyncio.run(serve_http(config))
    finally:
        from plumbing.tracing import shutdown

        shutdown()
    return 0


def _up(args: argparse.Namespace) -> int:
    from splitserve.cluster import run_cluster

    if not ensure_model(args.model):
        return 1

    return run_cluster(args)


def _generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.chat is None):
        sys.stderr.write("splitserve generate: give a PROMPT or --chat MESSAGE (one of them)\n")
        return 2
    if args.in_process:
        if not ensure_model(args.model):
            return 1
        return _generate_in_process(args)
    from splitserve.client import stream_to_terminal

    return stream_to_terminal(args)


def _fetch(args: argparse.Namespace) -> int:
    """Fetch the default model into the cache (once) and print its path."""
    try:
        path = ensure_default_model(quiet=args.quiet)
    except FetchError as exc:
        sys.stderr.write(f"splitserve fetch: {exc}\n")
        return 1
    sys.stdout.write(f"{path}\n")
    return 0


def _health(args: argparse.Namespace) -> int:
    """Exit 0 when the server at ``--address`` reports SERVING (compose health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.client import ClientAuth

    if args.address is None:
        args.address = f"127.0.0.1:{args.health_port if args.health_port >= 0 else 50051}"
    try:
        auth = ClientAuth() if args.plaintext else ClientAuth.from_args(args)
        with auth.channel(args.address, options=[]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
    except grpc.RpcError as exc:
        sys.stderr.write(f"{args.address}: {exc.code().name}\n")
        return 1
    except ValueError as exc:  # a TLS file that cannot be read
        sys.stderr.write(f"splitserve health: {exc}\n")
        return 2
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
    add_bench_flags(bench, os.environ.get("SPLITSERVE_MODEL") or str(BUNDLED_MODEL))
    bench.set_defaults(func=_bench)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """``splitserve generate``: through a gateway, or ``--in-process``."""
    from plumbing import config as cfg

    gen = sub.add_parser("generate", help="stream a completion of PROMPT (or a --chat answer) through the gateway")
    gen.add_argument("prompt", nargs="?", default=None, help="text to complete (or use --chat)")
    gen.add_argument("--chat", default=None, metavar="MESSAGE",
                     help="a user message: the model's chat template is applied, the answer streamed")
    gen.add_argument("--system", default=None, help="(--chat) a system message before it")
    cfg.add_flag(gen, "--gateway", default="127.0.0.1:50051", help="gateway address (several: comma-separated IP:port, or one DNS name resolving to all; a broken stream resumes on another)")
    add_client_security_flags(gen)
    gen.add_argument("--wait-s", type=float, default=60.0,
                     help="wait this long for the gateway and a decode worker to be up")
    gen.add_argument("--wait-for-up", default=None, metavar="STATUS_FILE",
                     help="first wait, for no fixed time, while `splitserve up --status-file STATUS_FILE` "
                          "starts and is alive")
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
    gen.add_argument("--model", default=default_model(), help="(--in-process) checkpoint directory or .gguf file")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--threads", type=int, default=None, help="(--in-process) torch CPU threads")
    gen.add_argument("--speculative", default="none", choices=["none", "ngram", "draft_model", "ngram_draft"])
    gen.add_argument("--num-speculative-tokens", type=int, default=4)
    gen.add_argument("--draft-model", default=str(BUNDLED_MODEL.parent / "draft"))
    gen.set_defaults(func=_generate)


def add_client_security_flags(p: argparse.ArgumentParser) -> None:
    """TLS toward the server (``--tls-ca`` to verify it) and the API key to send."""
    from plumbing import config as cfg

    cfg.add_tls_flags(p)
    cfg.add_flag(p, "--token", default=None, help="API key sent as 'authorization: Bearer' (prefer the variable)")


def add_up_parser(sub: argparse._SubParsersAction) -> None:
    """``splitserve up``: a local cluster (gateway replicas + workers), its internal secret minted."""
    from plumbing import config as cfg

    up = sub.add_parser("up", help="run gateway + prefill + decode workers on this machine")
    cfg.add_flag(up, "--port", type=int, default=50051, help="gateway port (the first gateway's; the others: free ports)")
    cfg.add_flag(up, "--num-gateways", type=int, default=1,
                 help="gateway replicas; every worker registers with each (each answers any request)")
    cfg.add_flag(up, "--num-prefill", type=int, default=1, help="prefill workers")
    cfg.add_flag(up, "--num-decode", type=int, default=1, help="decode workers")
    cfg.add_flag(up, "--model", default=default_model(), help="checkpoint directory or .gguf file")
    cfg.add_flag(up, "--threads", type=int, default=1, help="torch threads per worker")
    cfg.add_flag(up, "--metrics-port", type=int, default=-1,
                 help="gateway metrics port; workers use the following ports (0: each a free one, "
                      "logged in up.ready; -1 off)")
    cfg.add_flag(up, "--log-level", default="info", help="debug|info|warning|error")
    cfg.add_flag(up, "--local-prefill-max-tokens", type=int, default=32,
                 help="gateway: prompts shorter than this prefill on the decode worker (0: never)")
    cfg.add_flag(up, "--http-port", type=int, default=-1,
                 help="also run the OpenAI-compatible HTTP front on this port (0: a free one; -1: none)")
    cfg.add_flag(up, "--log-dir", default=None, help="write each service's log here (default: inherit stderr)")
    cfg.add_flag(up, "--tls", action="store_true",
                 help="make a throwaway CA and certificate (in --log-dir, else a temporary folder): "
                      "TLS on every port, mTLS between the services")
    cfg.add_flag(up, "--status-file", default=None, help="write up's state here, JSON (for generate --wait-for-up)")
    up.add_argument("service_args", nargs=argparse.REMAINDER,
                    help="after --: extra flags for every worker (e.g. -- --speculative ngram)")
    up.set_defaults(func=_up)


def build_parser() -> argparse.ArgumentParser:
    from plumbing import config as cfg

    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)
    add_bench_parser(sub)

    gw = sub.add_parser("gateway", help="run the gateway")
    cfg.add_gateway_flags(gw, default_model())
    gw.set_defaults(func=_run_service)
    for role in ("prefill", "decode"):
        worker = sub.add_parser(role, help=f"run a {role} worker")
        cfg.add_worker_flags(worker, default_model())
        worker.set_defaults(func=_run_service)

    front = sub.add_parser("http", help="run the OpenAI-compatible HTTP front of a gateway")
    from http_front.config import add_http_flags

    add_http_flags(front)
    front.set_defaults(func=_run_http)

    fetch = sub.add_parser("fetch", help="fetch the default model into the cache (once); print its path")
    fetch.add_argument("--quiet", action="store_true", help="no progress output")
    fetch.set_defaults(func=_fetch)

    hc = sub.add_parser("health", help="check a server's grpc.health.v1 status (exit 0: SERVING)")
    hc.add_argument("--address", default=None, help="host:port (default: 127.0.0.1:--health-port, else :50051)")
    cfg.add_flag(hc, "--health-port", type=int, default=-1,
                 help="without --address, check this port on 127.0.0.1 (a service's probe port)")
    hc.add_argument("--service", default="", help="service name ('' = the whole server)")
    hc.add_argument("--timeout-s", type=float, default=2.0)
    add_client_security_flags(hc)
    hc.add_argument("--plaintext", action="store_true",
                    help="no TLS whatever SPLITSERVE_TLS_* say (the --health-port is plaintext)")
    hc.set_defaults(func=_health)

    add_up_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    process_env.apply()  # before gRPC and torch load (splitserve/process_env.py)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
