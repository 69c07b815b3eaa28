"""Two colocated clusters side by side, A and B, that differ in their services' environment or
flags; requests take turns between them, so this machine's drift falls on both alike (#25; not
a test)::

    python -m benchmarks.service_ab --env-b GOMP_SPINCOUNT=300000 [--env-a K=V ...] \
        [--decode-flags-b "--max-num-seqs 32"] [--rounds 8] [--concurrency 16] [--out X.json]

Sequential runs of one setting and then the other could not tell 3-5% effects apart here (the
batch-1 step swings 6.3-9 ms from one minute to the next); taking turns within one run can:
docs/architecture.md, "A twenty-first sitting", where it measured ``GOMP_SPINCOUNT``.

Both clusters (HTTP front, gateway, one decode worker on 2 threads) start on the default
model, then the run waits until both decode workers have logged ``engine_thread.prepared``: a
worker still preparing beside the other's requests slows them (and once made a worker's
calibration pick the slow form for its life). The idle cluster costs nothing. Each round, on
each cluster in turn (the order alternating): one request of 256 random prompt tokens and 128
tokens at c=1, its ITL median and the service's CPU per token (every thread's ``schedstat``
but the decode worker's pinned engine threads), then a burst of ``--concurrency`` such
requests, its output tok/s and the service's CPU per token. Per metric: each side's median
over the rounds, B/A per round (its median), and in how many rounds B was lower.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.serve_vs_vllm import served_model_name
from splitserve.cluster import Cluster
from splitserve.default_model import ensure_default_model

INPUT_LEN, OUTPUT_LEN = 256, 128
METRICS = ("itl_ms", "cpu_ms_per_token_c1", "tok_s", "cpu_ms_per_token")
PREPARED = "engine_thread.prepared"


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``K=V`` strings as a dict; anything else is an error naming it."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--env-a / --env-b take KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def summarize(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per metric: A's and B's medians over the rounds, B/A per round (its median), and the
    rounds in which B was lower."""
    out = {}
    for metric in METRICS:
        a = [r[metric] for r in rounds["A"]]
        b = [r[metric] for r in rounds["B"]]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        out[metric] = {"a": statistics.median(a), "b": statistics.median(b),
                       "b_over_a": statistics.median(ratios), "b_lower": sum(r < 1 for r in ratios),
                       "rounds": len(ratios)}
    return out


def _stream(url: str, model: str, prompt: list[int]) -> list[float]:
    """One streamed completion; the time each token's event arrived."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return times


def _service_cpu_ms(cluster: Cluster) -> float:
    """CPU time of every thread of the cluster's processes but the decode worker's pinned ones."""
    total = 0.0
    for name, proc in cluster.procs.items():
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            with contextlib.suppress(OSError):
                if name.startswith("decode") and len(os.sched_getaffinity(int(tid))) == 1:
                    continue
                total += int(Path(f"/proc/{proc.pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e6
    return total


def _prepared(log_dir: Path) -> int:
    with contextlib.suppress(OSError):
        return (log_dir / "decode-0.log").read_text(errors="replace").count(PREPARED)
    return 0


@contextlib.contextmanager
def _clusters(model: str, sides: dict[str, tuple[dict[str, str], list[str]]], log_root: Path) -> Iterator[dict]:
    """Both clusters up, each started with its side's environment and decode flags."""
    with contextlib.ExitStack() as stack:
        clusters = {}
        for side, (env, decode_flags) in sides.items():
            saved = dict(os.environ)
            os.environ.update(env)  # Cluster hands its processes this process's environment
            try:
                clusters[side] = stack.enter_context(Cluster(
                    model, num_prefill=0, num_decode=1, threads=2, metrics_port=0, http_port=0,
                    decode_flags=decode_flags, log_dir=str(log_root / side)))
            finally:
                os.environ.clear()
                os.environ.update(saved)
        yield clusters


def run(args: argparse.Namespace) -> dict:
    model = str(ensure_default_model())
    sides = {"A": (parse_env(args.env_a), args.decode_flags_a.split()),
             "B": (parse_env(args.env_b), args.decode_flags_b.split())}
    log_root = Path(args.log_dir)
    before = {side: _prepared(log_root / side) for side in sides}
    rng = random.Random(args.seed)
    with _clusters(model, sides, log_root) as clusters, ThreadPoolExecutor(args.concurrency) as pool:
        urls = {side: f"http://{c.addresses['http']}" for side, c in clusters.items()}
        names = {side: served_model_name(url) for side, url in urls.items()}
        deadline = time.monotonic() + args.prepare_timeout_s
        while any(_prepared(log_root / side) <= before[side] for side in sides):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a decode worker did not log {PREPARED} within {args.prepare_timeout_s} s")
            time.sleep(1.0)
        rounds: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for r in range(args.rounds):
            prompt = [rng.randrange(100, 40_000) for _ in range(INPUT_LEN)]
            burst = [[rng.randrange(100, 40_000) for _ in range(INPUT_LEN)] for _ in range(args.concurrency)]
            for side in ("AB" if r % 2 == 0 else "BA"):
                cluster, url, name = clusters[side], urls[side], names[side]
                cpu = _service_cpu_ms(cluster)
                times = _stream(url, name, prompt)
                c1_cpu = (_service_cpu_ms(cluster) - cpu) / len(times)
                itl = statistics.median(b - a for a, b in zip(times[1:], times[2:]))
                cpu, start = _service_cpu_ms(cluster), time.perf_counter()
                outs = list(pool.map(lambda p, u=url, n=name: _stream(u, n, p), burst))
                tokens = sum(len(o) for o in outs)
                rounds[side].append({"itl_ms": 1e3 * itl, "cpu_ms_per_token_c1": c1_cpu,
                                     "tok_s": tokens / (time.perf_counter() - start),
                                     "cpu_ms_per_token": (_service_cpu_ms(cluster) - cpu) / tokens})
            sys.stdout.write(f"round {r}: " + "  ".join(
                f"{side} itl {rounds[side][-1]['itl_ms']:.2f} ms, tok/s {rounds[side][-1]['tok_s']:.1f}"
                for side in "AB") + "\n")
    return {"sides": {side: {"env": env, "decode_flags": flags} for side, (env, flags) in sides.items()},
            "rounds": rounds, "summary": summarize(rounds)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-a", nargs="*", default=[], help="KEY=VALUE for A's services")
    parser.add_argument("--env-b", nargs="*", default=[], help="KEY=VALUE for B's services")
    parser.add_argument("--decode-flags-a", default="", help="extra flags of A's decode worker")
    parser.add_argument("--decode-flags-b", default="", help="extra flags of B's decode worker")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prepare-timeout-s", type=float, default=300.0)
    parser.add_argument("--log-dir", default="bench/results/service_ab-logs")
    parser.add_argument("--out", default="bench/results/service_ab.json")
    args = parser.parse_args(argv)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for metric, s in result["summary"].items():
        sys.stdout.write(f"{metric}: A {s['a']:.3f}, B {s['b']:.3f}; B/A {s['b_over_a']:.3f}, "
                         f"B lower in {s['b_lower']} of {s['rounds']} rounds\n")


if __name__ == "__main__":
    main()
