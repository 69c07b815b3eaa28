"""PNG plots, drawn from the JSON report alone (so they can be redrawn from a saved report):
latency CDFs of the online runs, throughput and goodput against the offered request rate,
the peers' bars, the interference ITL CDFs and KV utilisation over time."""

from __future__ import annotations

from pathlib import Path

from bench.figures import is_skipped


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def request_latencies(rows: list[dict]) -> dict[str, list[float]]:
    """TTFT, TPOT, ITL and E2E (ms) of the completed requests in a run's ``requests`` rows."""
    out: dict[str, list[float]] = {"TTFT": [], "TPOT": [], "ITL": [], "E2E": []}
    for row in rows:
        times = row["chunk_times_s"]
        if row["error"] is not None or not times:
            continue
        out["TTFT"].append(1000 * times[0])
        out["E2E"].append(1000 * (row["end_s"] - row["send_s"]))
        if row["num_output_tokens"] >= 2:
            out["TPOT"].append(1000 * (times[-1] - times[0]) / (row["num_output_tokens"] - 1))
        out["ITL"].extend(1000 * (b - a) for a, b in zip(times, times[1:]))
    return out


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.plot(xs, ys, label=label, drawstyle="steps-post")


def latency_cdfs(report: dict, path: Path) -> bool:
    online = report.get("online")
    if not isinstance(online, dict) or is_skipped(online):
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for run in online["runs"]:
        lat = request_latencies(run["requests"])
        for ax, key in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E")):
            _cdf(ax, lat[key], run["name"])
    for ax, key in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{key} (ms)")
        ax.set_ylabel("fraction of requests" if key != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Online latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def throughput_vs_rate(report: dict, path: Path) -> bool:
    online = report.get("online")
    if not isinstance(online, dict) or is_skipped(online):
        return False
    points = [(r["plan"]["rate_rps"], r["figures"]) for r in online["runs"]
              if r["plan"]["mode"] == "open" and not is_skipped(r["figures"])]
    if not points:
        return False
    points.sort(key=lambda p: p[0])
    rates = [p[0] for p in points]
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(rates, [f["output_tokens_per_s"] for _, f in points], marker="o")
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("output tokens/s")
    right.plot(rates, [f["requests_per_s"] for _, f in points], marker="o", label="throughput")
    right.plot(rates, [f["goodput_rps"] for _, f in points], marker="s", label="goodput (both SLOs)")
    right.plot(rates, rates, linestyle=":", color="grey", label="offered")
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("req/s")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("Throughput and goodput against request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def peer_bars(report: dict, path: Path) -> bool:
    peers = report.get("peers")
    if not isinstance(peers, dict) or is_skipped(peers):
        return False
    rows = [r for r in peers["systems"] if r["status"] == "ok"]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    values = [r["figures"]["output_tokens_per_s"] for r in rows]
    bars = ax.barh([r["label"] for r in rows], values)
    for bar, row in zip(bars, rows):
        ratio = row["figures"].get("ratio_vs_engine")
        note = f" {ratio:.2f}× engine" if isinstance(ratio, float) else ""
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {bar.get_width():.0f}{note}",
                va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s")
    ax.set_xlim(0, max(values) * 1.35)
    ax.set_title("Peers, offline, same model and prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def interference_cdf(report: dict, path: Path) -> bool:
    section = report.get("interference")
    if not isinstance(section, dict) or is_skipped(section):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, entry in section["modes"].items():
        window = entry["figures"]["interference_window_s"]
        rows = [r for r in entry["requests"] if r["kind"] == "decode"]
        starts = [r["send_s"] for r in entry["requests"] if r["kind"] == "long"]
        lo = min(starts) if starts else 0.0
        gaps = []
        for row in rows:
            absolute = [row["send_s"] + t for t in row["chunk_times_s"]]
            gaps += [1000 * (b - a) for a, b in zip(absolute, absolute[1:]) if lo <= b <= lo + window]
        _cdf(ax, gaps, mode)
    ax.set_xscale("log")
    ax.set_xlabel("decode inter-token latency under long prompts (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def kv_utilisation(report: dict, path: Path) -> bool:
    """One small panel per online run: every worker's used KV fraction over the run."""
    online = report.get("online")
    if not isinstance(online, dict) or is_skipped(online):
        return False
    runs = [r for r in online["runs"] if r["kv_timeline"]]
    if not runs:
        return False
    plt = _pyplot()
    ncols = 2
    nrows = -(-len(runs) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(11, 2.4 * nrows), sharey=True, squeeze=False)
    for ax, run in zip(axes.flat, runs):
        for worker in sorted({s["worker"] for s in run["kv_timeline"]}):
            pts = [(s["t_s"], 100 * s["kv_used_fraction"]) for s in run["kv_timeline"] if s["worker"] == worker]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=worker, linewidth=1)
        ax.set_title(f"{run['name']} ({run['workload']})", fontsize=9)
        ax.set_ylabel("KV in use (%)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(runs):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the run's first request", fontsize=8)
    fig.suptitle("KV-cache utilisation over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


PLOTS = (
    ("latency_cdfs.png", latency_cdfs),
    ("throughput_goodput_vs_rate.png", throughput_vs_rate),
    ("peers.png", peer_bars),
    ("interference_itl_cdf.png", interference_cdf),
    ("kv_utilisation.png", kv_utilisation),
)


def write_plots(report: dict, out_dir: Path) -> list[str]:
    """Draw every plot the report has data for; return the file names written."""
    written = []
    for name, draw in PLOTS:
        if draw(report, out_dir / name):
            written.append(name)
    return written
