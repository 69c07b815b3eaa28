"""``splitserve`` command line.

Until the gateway and workers exist, ``splitserve generate`` runs the in-process engine on
the bundled default model and streams the completion to the terminal.
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


def _generate(args: argparse.Namespace) -> int:
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


def _bench(args: argparse.Namespace) -> int:
    from splitserve.benchmark.main import run_from_args

    return run_from_args(args)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``splitserve bench``: load generator, peers and report (``splitserve/benchmark/``)."""
    from splitserve.benchmark.options import add_bench_flags

    bench = sub.add_parser("bench", help="benchmark a deployment and its peers; write a report")
    add_bench_flags(bench, default_model())
    bench.set_defaults(func=_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion of PROMPT")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=default_model(), help="local checkpoint directory")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    gen.add_argument("--speculative", default="none", choices=["none", "ngram", "draft_model"])
    gen.add_argument("--num-speculative-tokens", type=int, default=4)
    gen.add_argument("--draft-model", default=str(DEFAULT_MODEL.parent / "draft"))
    gen.set_defaults(func=_generate)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
