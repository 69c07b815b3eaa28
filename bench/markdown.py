"""``report.md``: the report's tables, rendered from the JSON report (nothing recomputed)."""

from __future__ import annotations

from pathlib import Path

from bench.figures import is_skipped


def _num(value: object, spec: str = ".3g") -> str:
    if value is None:
        return "n/a"
    if is_skipped(value):
        return "skipped"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def _dist(figs: dict, key: str, p: str) -> str:
    value = figs.get(key)
    if value is None or is_skipped(value):
        return "–"
    return format(value[p], ".3g")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _plan(plan: dict) -> str:
    if plan["mode"] == "closed":
        return f"closed, {plan['concurrency']} clients"
    return f"open, {plan['rate_rps']:.3g} req/s"


def deployment_md(d: dict) -> str:
    """One line for a deployment description (``DeploymentSpec.describe()`` or external)."""
    if d.get("mode") == "external":
        return f"the running deployment at `{d['gateway']}`"
    threads = " + ".join(f"{role} worker ({n} thread{'s' if n > 1 else ''})" for role, n in d["threads"].items())
    flags = " ".join(d.get("worker_flags", []))
    line = f"{d['mode']}, model `{Path(d['model']).name}`: gateway + {threads}"
    return line + (f"; worker flags `{flags}`" if flags else "")


def online_md(section: dict) -> str:
    if is_skipped(section):
        return f"Skipped: {section['skipped']}\n"
    slo = section["slo"]
    out = [f"Deployment: {deployment_md(section['deployment'])}. SLOs for goodput: TTFT ≤ {slo['ttft_ms']:g} ms, "
           f"TPOT ≤ {slo['tpot_ms']:g} ms. Sweep: {section['sweep']}.\n\n"]
    rows = []
    for run in section["runs"]:
        f = run["figures"]
        if is_skipped(f):
            rows.append([run["name"], run["workload"], _plan(run["plan"]), "failed: " + f["skipped"]] + [""] * 11)
            continue
        kv = [v for v in f["kv_utilisation"].values() if not is_skipped(v)]
        rows.append([run["name"], run["workload"], _plan(run["plan"]), _num(f["requests_per_s"]),
                     _num(f["output_tokens_per_s"], ".4g"), _num(f["input_tokens_per_s"], ".4g"),
                     _dist(f, "ttft_ms", "p50"), _dist(f, "ttft_ms", "p99"), _dist(f, "tpot_ms", "p50"),
                     _dist(f, "tpot_ms", "p99"), _dist(f, "itl_ms", "p99"), _dist(f, "e2e_ms", "p99"),
                     _num(f["goodput_rps"]), _num(f["slo_attainment"], ".0%"),
                     _dist(f, "kv_transfer_ms", "p50") + " / " + _dist(f, "kv_transfer_kib", "p50"),
                     _num(f["spec_decode_acceptance_rate"], ".2f"),
                     _num(max((v["peak"] for v in kv), default=None), ".2%")])
    out.append(table(["run", "workload", "load", "req/s", "out tok/s", "in tok/s", "TTFT p50 ms",
                      "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms", "E2E p99 ms",
                      "goodput req/s", "SLO met", "KV transfer p50 ms / KiB", "spec accept", "KV peak"], rows))
    loads = [v for r in section["runs"] for v in r.get("load_average_1m", {}).values()]
    if loads:
        out.append(f"\nLoad average (1 min) around the runs: {min(loads):.2f}–{max(loads):.2f}.\n")
    failed = [(r["name"], r["counts"]["num_failed"], r["errors"]) for r in section["runs"] if r["counts"]["num_failed"]]
    for name, n, errs in failed:
        out.append(f"\n{name}: {n} request(s) failed, e.g. {errs[0] if errs else '?'}\n")
    return "".join(out)


def cost_md(section: dict) -> str:
    if is_skipped(section):
        return f"Skipped: {section['skipped']}\n"
    p, f = section["pricing"], section["figures"]
    verdict = ("self-hosting wins above the break-even volume, up to this deployment's capacity"
               if section["self_hosting_can_win"] else
               "the break-even volume exceeds what this deployment can produce: the API is cheaper at any volume")
    return (f"Basis: {section['basis']}. Price assumptions: {p['device_hour_usd']:g} USD per {p['device_kind']}-hour "
            f"× {p['num_devices']}; API {p['api_output_usd_per_m']:g} USD per M output tokens"
            f" (+ {p['api_input_usd_per_m']:g} per M input). Pass your own (`--gpu-hour-price` / `--cpu-hour-price`, "
            f"`--num-devices`, `--api-price-per-m`).\n\n"
            + table(["USD / M output tokens", "USD / M input tokens", "monthly cost USD",
                     "monthly capacity (output tokens)", "break-even (output tokens / month)"],
                    [[_num(f["usd_per_m_output_tokens"], ".4g"), _num(f["usd_per_m_input_tokens"], ".4g"),
                      _num(f["monthly_cost_usd"], ".4g"), _num(f["monthly_capacity_output_tokens"], ".4g"),
                      _num(f["break_even_output_tokens_per_month"], ".4g")]])
            + f"\n{verdict}.\n")


def _load(load: dict | None) -> str:
    return "–" if not load else f"{load['before']:.2f} → {load['after']:.2f}"


def _threads(details: dict) -> str:
    """"2 (of 1, 2)" for a best-of run, "1/1" for a deployment's workers."""
    if "by_threads" in details:
        tried = ", ".join(details["by_threads"])
        return f"{details['threads']} (of {tried})" if len(details["by_threads"]) > 1 else str(details["threads"])
    workers = details.get("deployment", {}).get("threads", {})
    return "/".join(str(n) for n in workers.values()) or "–"


def peers_md(section: dict) -> str:
    if is_skipped(section):
        return f"Skipped: {section['skipped']}\n"
    w = section["workload"]
    out = [f"Workload: {w['name']}; {w['num_requests']} prompts of {w['min_prompt_len']}–{w['max_prompt_len']} "
           f"tokens, {w['output_len']} output tokens each, {w['decoding']}. A system listed with two thread "
           f"counts ran on each, and its better run counts; the deployments' threads are per worker.\n\n"]
    source = section.get("source")
    if source:  # measured by another run (``--peers-json``)
        out.append(f"Measured by `python -m benchmarks.peers` at {source.get('timestamp')} "
                   f"(commit {source.get('git_commit') or 'none'}), read from `{source['path']}`.\n\n")
    rows = []
    for row in section["systems"]:
        f = row["figures"]
        ok = row["status"] == "ok"
        threads = _threads(row["details"])
        rows.append([row["label"], row["status"] + ("" if ok else f": {row['reason']}"), str(threads),
                     str(row["counts"]["num_requests"]),
                     _num(f.get("seconds") if ok else None, ".2f"),
                     _num(f.get("output_tokens_per_s") if ok else None, ".4g"),
                     _num(f.get("ratio_vs_engine") if ok else None, ".2f"),
                     row["greedy_match_vs_engine"] or "–", _load(row["details"].get("load_average_1m"))])
    out.append(table(["system", "status", "threads", "requests", "seconds", "output tok/s", "× engine",
                      "greedy = engine", "load avg before → after"], rows))
    return "".join(out)


def interference_md(section: dict) -> str:
    if is_skipped(section):
        return f"Skipped: {section['skipped']}\n"
    c = section["config"]
    out = [f"{c['decode_clients']} closed-loop decode clients ({c['decode_output']} output tokens each) alone for "
           f"{c['baseline_s']:g} s, then {c['num_long']} long prompts "
           f"({c['long_prompt']['lo']}–{c['long_prompt']['hi']} tokens, {c['long_output']} output tokens) "
           f"at {c['long_rate_rps']:g} req/s (Poisson).\n\n"]
    rows = []
    for mode, entry in section["modes"].items():
        f = entry["figures"]
        threads = ", ".join(f"{k} {v}" for k, v in entry["deployment"]["threads"].items())
        rows.append([f"{mode} ({threads} threads)", _dist(f, "decode_itl_ms_baseline", "p50"),
                     _dist(f, "decode_itl_ms_baseline", "p99"),
                     _dist(f, "decode_itl_ms_under_interference", "p50"),
                     _dist(f, "decode_itl_ms_under_interference", "p90"),
                     _dist(f, "decode_itl_ms_under_interference", "p99"),
                     _dist(f, "long_prompt_ttft_ms", "p50"), _dist(f, "long_prompt_ttft_ms", "p99")])
    out.append(table(["mode", "ITL p50 alone", "ITL p99 alone", "ITL p50 under long prompts",
                      "ITL p90", "ITL p99", "long-prompt TTFT p50", "TTFT p99"], rows))
    ratio = section["figures"]["itl_p99_ratio_disaggregated_vs_colocated"]
    out.append(f"\nITL P99 disaggregated / colocated ({section['colocated_reference']}, the better colocated "
               f"variant): **{_num(ratio, '.2f')}** (all latencies in ms).\n")
    return "".join(out)


def goals_md(rows: list[dict]) -> str:
    body = []
    for row in rows:
        measured = row["figures"]["measured"]
        met = {True: "yes", False: "**no**", None: "not measured"}[row["met"]]
        body.append([row["text"], _num(measured, ".2f") if not is_skipped(measured) else measured["skipped"],
                     f"{row['target']:g}", met])
    return table(["goal", "measured", "target", "met"], body)


def _provenance(report: dict) -> str:
    """The commit of a checkout, else the installed version."""
    if report.get("git_commit"):
        return f"commit `{report['git_commit'][:12]}`"
    return f"splitserve {report.get('splitserve_version') or 'of unknown version'} (installed, no commit)"


def render(report: dict, plots: list[str]) -> str:
    m = report["machine"]
    parts = [
        f"# splitserve bench — profile `{report['profile']}`\n\n",
        f"{report['timestamp']}, {_provenance(report)}, {report['elapsed_s']:.0f} s. "
        f"Machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch_version']}, load average "
        f"{_num(m.get('load_average_1m'), '.2f')} at the start, "
        f"{_num(report.get('load_average_end'), '.2f')} at the end.\n\n",
        "## Goals\n\n", goals_md(report["goals"]),
        "\n## Online load\n\n", online_md(report["online"]),
        "\n## Cost\n\n", cost_md(report["cost"]),
        "\n## Peers (offline, same model and prompts, one run)\n\n", peers_md(report["peers"]),
        "\n## Disaggregation vs colocation under long-prompt interference\n\n", interference_md(report["interference"]),
    ]
    if plots:
        parts.append("\n## Plots\n\n" + "".join(f"![{p}]({p})\n" for p in plots))
    return "".join(parts)
