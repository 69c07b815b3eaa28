"""Two ways of serving the same requests, side by side in one run (``bench.tls_overhead``,
``bench.http_vs_grpc``): alternating rounds (the order flips every round, so drift in the
machine's load hits both), one summary per way, their ratios and a Markdown table.

A burst is a callable that serves the whole workload once and returns ``{"seconds",
"ttft_s", "output_tokens", "errors"}`` plus whatever its benchmark compares between the ways.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence

from bench.machine import load_window
from bench.metrics import percentile


def alternate(bursts: dict[str, Callable[[], dict]], rounds: int) -> dict[str, list[dict]]:
    """``rounds`` runs of every burst, the order flipped every round; each run keeps the
    1-minute load average around it (``load``)."""
    runs: dict[str, list[dict]] = {name: [] for name in bursts}
    for round_index in range(rounds):
        for name in (list(bursts) if round_index % 2 == 0 else list(reversed(bursts))):
            with load_window() as load:
                run = bursts[name]()
            run["load"] = load
            runs[name].append(run)
            print(f"round {round_index} {name:9s} {run['output_tokens'] / run['seconds']:8.1f} tok/s  "
                  f"errors {len(run['errors'])}  load {load}", file=sys.stderr)
    return runs


def summary(runs: list[dict]) -> dict:
    """Output tokens/s (median of the rounds, and each round's), TTFT P50/P99 over every
    request of every round, the errors and the loads."""
    ttfts = [t for run in runs for t in run["ttft_s"]]
    rates = [run["output_tokens"] / run["seconds"] for run in runs]
    return {"output_tokens_per_s": statistics.median(rates), "output_tokens_per_s_rounds": rates,
            "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
            "errors": [e for run in runs for e in run["errors"]], "load_average_1m": [run["load"] for run in runs]}


def ratios(results: dict[str, dict], new: str, base: str, extra_ms: Sequence[str] = ()) -> dict:
    """``new`` over ``base``: throughput (medians, and the median of each round's pair, run
    back to back), TTFT P50/P99, and each ``extra_ms`` figure (named without ``_ms``)."""
    a, b = results[new], results[base]
    paired = [x / y for x, y in zip(a["output_tokens_per_s_rounds"], b["output_tokens_per_s_rounds"])]
    out = {"output_tokens_per_s": a["output_tokens_per_s"] / b["output_tokens_per_s"],
           "output_tokens_per_s_same_round_median": statistics.median(paired),
           "ttft_p50": a["ttft_p50_ms"] / b["ttft_p50_ms"], "ttft_p99": a["ttft_p99_ms"] / b["ttft_p99_ms"]}
    out.update({key.removesuffix("_ms"): a[key] / b[key] for key in extra_ms})
    return out


def markdown(results: dict, first: str, names: tuple[str, str], ratio_key: str,
             extra_ms: dict[str, str] | None = None) -> str:
    """The two ways' figures and their ratio row; ``first`` heads the names' column and
    ``extra_ms`` maps more columns' headers to their ``*_ms`` figures."""
    extra = extra_ms or {}
    head = ["output tok/s (median of rounds)", "TTFT P50 ms", "TTFT P99 ms", *extra]
    lines = [f"| {first} | " + " | ".join(head) + " |", "|" + " --- |" * (len(head) + 1)]
    for name in names:
        r = results[name]
        cells = [f"{r['output_tokens_per_s']:.1f}", f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p99_ms']:.1f}",
                 *(f"{r[key]:.2f}" for key in extra.values())]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    q = results[ratio_key]
    cells = [f"{q['output_tokens_per_s']:.3f}× (same-round pairs: {q['output_tokens_per_s_same_round_median']:.3f}×)",
             f"{q['ttft_p50']:.3f}×", f"{q['ttft_p99']:.3f}×",
             *(f"{q[key.removesuffix('_ms')]:.2f}×" for key in extra.values())]
    lines.append(f"| {names[1]} / {names[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
