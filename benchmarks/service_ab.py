"""Two colocated clusters side by side, A and B, that differ in their services' environment or
flags; requests take turns between them, so this machine's drift falls on both alike (#25; not
a test)::

    python -m benchmarks.service_ab --env-b GOMP_SPINCOUNT=300000 [--env-a K=V ...] \
        [--decode-flags-b "--max-num-seqs 32"] [--rounds 8] [--concurrency 16] [--replicas 1] [--out X.json]

Sequential runs of one setting and then the other could not tell 3-5% effects apart here (the
batch-1 step swings 6.3-9 ms from one minute to the next); taking turns within one run can:
docs/measurements.md, "A twenty-first sitting", where it measured ``GOMP_SPINCOUNT``.

Both clusters (HTTP front, gateway, one decode worker on 2 threads) start on the default
model, then the run waits until both decode workers have logged ``engine_thread.prepared``: a
worker still preparing beside the other's requests slows them (and once made a worker's
calibration pick the slow form for its life). The idle cluster costs nothing. Each round, on
each cluster in turn (the order alternating): one request of 256 random prompt tokens and 128
tokens at c=1, its ITL median and the service's CPU per token (every thread's ``schedstat``
but the decode worker's pinned engine threads), then a burst of ``--concurrency`` such
requests, its output tok/s, its last first token (``ttft_max_s``, from the burst's start) and
the service's CPU per token. Per metric: each side's median over the rounds, B/A per round
(its median), and in how many rounds B was lower.

Taking turns cancels the drift, not what sets one cluster apart from another started the same
way: two clusters of the same settings (A/A) kept a c=1 ITL 2% apart over 8 rounds (B lower in
1), and a change that measured 0.92x here measured 1.02x toggled live inside one cluster
(docs/measurements.md, "A twenty-second sitting"). ``--replicas N`` starts N clusters a side,
each round goes through all of them, a side's figure per round is its clusters' mean, and per
metric ``replica_spread`` gives each side's median over the rounds of its slowest cluster
against its fastest: a B/A inside that spread says nothing.
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

from benchmarks.serve_vs_vllm import prepared_count, served_model_name, wait_prepared
from splitserve.cluster import Cluster
from splitserve.default_model import ensure_default_model

INPUT_LEN, OUTPUT_LEN = 256, 128
METRICS = ("itl_ms", "cpu_ms_per_token_c1", "tok_s", "ttft_max_s", "cpu_ms_per_token")
SIDES = ("A", "B")


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``K=V`` strings as a dict; anything else is an error naming it."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--env-a / --env-b take KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def summarize(rounds: dict[str, list[list[dict[str, float]]]]) -> dict[str, dict[str, float]]:
    """Per metric, from each side's rounds (per round, one record per cluster of the side): A's
    and B's medians over the rounds of their clusters' means, B/A per round (its median), the
    rounds in which B was lower, and per side the median over the rounds of its highest
    cluster's value over its lowest's (1 with one cluster a side)."""
    out = {}
    for metric in METRICS:
        a, b = ([statistics.mean(r[metric] for r in records) for records in rounds[side]] for side in SIDES)
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        spread = {side.lower(): statistics.median(max(r[metric] for r in records) / min(r[metric] for r in records)
                                                  for records in rounds[side]) for side in SIDES}
        out[metric] = {"a": statistics.median(a), "b": statistics.median(b),
                       "b_over_a": statistics.median(ratios), "b_lower": sum(r < 1 for r in ratios),
                       "rounds": len(ratios), "replica_spread": spread}
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


def _log_dirs(log_root: Path, replicas: int) -> dict[str, list[Path]]:
    return {side: [log_root / (side if replicas == 1 else f"{side}{i}") for i in range(replicas)] for side in SIDES}


@contextlib.contextmanager
def _clusters(model: str, sides: dict[str, tuple[dict[str, str], list[str]]],
              log_dirs: dict[str, list[Path]]) -> Iterator[dict[str, list[Cluster]]]:
    """Every cluster up, each started with its side's environment and decode flags."""
    with contextlib.ExitStack() as stack:
        clusters: dict[str, list[Cluster]] = {side: [] for side in sides}
        for side, (env, decode_flags) in sides.items():
            for log_dir in log_dirs[side]:
                saved = dict(os.environ)
                os.environ.update(env)  # Cluster hands its processes this process's environment
                try:
                    clusters[side].append(stack.enter_context(Cluster(
                        model, num_prefill=0, num_decode=1, threads=2, metrics_port=0, http_port=0,
                        decode_flags=decode_flags, log_dir=str(log_dir))))
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
        yield clusters


def _measure(cluster: Cluster, url: str, name: str, prompt: list[int], burst: list[list[int]],
             pool: ThreadPoolExecutor) -> dict[str, float]:
    """One cluster's turn in a round: the c=1 request, then the burst."""
    cpu = _service_cpu_ms(cluster)
    times = _stream(url, name, prompt)
    c1_cpu = (_service_cpu_ms(cluster) - cpu) / len(times)
    itl = statistics.median(b - a for a, b in zip(times[1:], times[2:]))
    cpu, start = _service_cpu_ms(cluster), time.perf_counter()
    outs = list(pool.map(lambda p: _stream(url, name, p), burst))
    tokens = sum(len(o) for o in outs)
    return {"itl_ms": 1e3 * itl, "cpu_ms_per_token_c1": c1_cpu, "tok_s": tokens / (time.perf_counter() - start),
            "ttft_max_s": max(o[0] for o in outs) - start, "cpu_ms_per_token": (_service_cpu_ms(cluster) - cpu) / tokens}


def run(args: argparse.Namespace) -> dict:
    model = str(ensure_default_model())
    sides = {"A": (parse_env(args.env_a), args.decode_flags_a.split()),
             "B": (parse_env(args.env_b), args.decode_flags_b.split())}
    log_dirs = _log_dirs(Path(args.log_dir), args.replicas)
    before = {d / "decode-0.log": prepared_count(d / "decode-0.log") for dirs in log_dirs.values() for d in dirs}
    rng = random.Random(args.seed)
    with _clusters(model, sides, log_dirs) as clusters, ThreadPoolExecutor(args.concurrency) as pool:
        urls = {side: [f"http://{c.addresses['http']}" for c in cs] for side, cs in clusters.items()}
        names = {side: [served_model_name(url) for url in side_urls] for side, side_urls in urls.items()}
        wait_prepared(before, args.prepare_timeout_s)
        rounds: dict[str, list[list[dict[str, float]]]] = {side: [] for side in SIDES}
        for r in range(args.rounds):
            prompt = [rng.randrange(100, 40_000) for _ in range(INPUT_LEN)]
            burst = [[rng.randrange(100, 40_000) for _ in range(INPUT_LEN)] for _ in range(args.concurrency)]
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                rounds[side].append([])
                for cluster, url, name in zip(clusters[side], urls[side], names[side], strict=True):
                    rounds[side][-1].append(_measure(cluster, url, name, prompt, burst, pool))
            sys.stdout.write(f"round {r}: " + "  ".join(
                f"{side} itl " + "/".join(f"{x['itl_ms']:.2f}" for x in rounds[side][-1]) + " ms, tok/s "
                + "/".join(f"{x['tok_s']:.1f}" for x in rounds[side][-1]) for side in SIDES) + "\n")
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
    parser.add_argument("--replicas", type=int, default=1, help="clusters a side (module docstring)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prepare-timeout-s", type=float, default=300.0)
    parser.add_argument("--log-dir", default="bench/results/service_ab-logs")
    parser.add_argument("--out", default="bench/results/service_ab.json")
    args = parser.parse_args(argv)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for metric, s in result["summary"].items():
        spread = s["replica_spread"]
        sys.stdout.write(f"{metric}: A {s['a']:.3f}, B {s['b']:.3f}; B/A {s['b_over_a']:.3f}, "
                         f"B lower in {s['b_lower']} of {s['rounds']} rounds; replica spread "
                         f"A {spread['a']:.3f}, B {spread['b']:.3f}\n")


if __name__ == "__main__":
    main()
