"""``gpu_check.md``: the report's tables (every figure is also in ``gpu_check.json``)."""

from __future__ import annotations


def _num(value: object, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.{digits}f}"
    return "–" if value is None else str(value)


def _table(headers: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    return lines + ["| " + " | ".join(_num(c) for c in row) + " |" for row in rows] + [""]


def _kernels(fig: dict) -> list[str]:
    rows = [[c["name"], c.get("dtype", "float32"), c["max_abs_err"] if "error" not in c else c["error"][:120],
             f"{c['atol']:g} / {c['rtol']:g}" if c["atol"] is not None else "–",
             "yes" if c["passed"] else "**no**"] for c in fig["checks"]]
    return [f"{fig['num_passed']}/{fig['num_checks']} checks passed on {fig['device']}.", "",
            *_table(["check", "dtype", "max abs err", "atol / rtol", "passed"], rows)]


def _parity(fig: dict) -> list[str]:
    rows, lines = [], []
    for name, model in fig.items():
        if not isinstance(model, dict):
            continue
        if "skipped" in model or "error" in model:
            lines.append(f"- {name}: {model.get('skipped') or model.get('error')}")
            continue
        if "float32" not in model:
            continue
        for dtype in ("float32", "bfloat16"):
            r = model[dtype]
            if "error" in r:
                lines.append(f"- {name} {dtype}: {r['error']}")
                continue
            rows.append([name, dtype, r["matches"], r["mean_common_prefix"],
                         ", ".join(f"#{d['prompt']}@{d['position']}" for d in r["divergences"]) or "none"])
    return [*_table(["model", "dtype", "identical", "mean common prefix", "divergences (prompt@token)"], rows), *lines, ""]


def _bandwidth(fig: dict) -> list[str]:
    att = fig["attention"]
    rows = [["copy (read + write)", fig["copy"]["gb_per_s"], "–"],
            ["Triton paged attention (K/V read)", att["triton"]["gb_per_s"], att["triton_vs_copy"]]]
    rows += [[f"SDPA {name}", b.get("gb_per_s", b.get("skipped")), "–"] for name, b in att["sdpa"].items()]
    return [f"Decode attention: {att['num_seqs']} sequences x {att['context']} tokens, {att['heads']} / "
            f"{att['kv_heads']} heads of {att['head_dim']}, {att['dtype']}.", "",
            *_table(["what", "GB/s", "of copy"], rows)]


def _throughput(fig: dict) -> list[str]:
    rows = []
    for batch, r in fig["batches"].items():
        if "skipped" in r or "error" in r:
            rows.append([batch, r.get("skipped") or r["error"][:120], "", "", "", "", ""])
            continue
        rows.append([batch, r["output_tok_per_s"], r.get("decode_tok_per_s"), r.get("mean_decode_step_ms"),
                     r.get("decode_gb_per_s"), r.get("roofline_fraction"), "yes" if r["truncated"] else "no"])
    return [f"Copy bandwidth here: {_num(fig['copy_gb_per_s'])} GB/s.", "",
            *_table(["batch", "output tok/s", "decode tok/s", "decode step ms", "decode GB/s", "of roofline",
                     "truncated"], rows)]


def _handoff(fig: dict) -> list[str]:
    return [fig["note"] + ".", "", *_table(
        ["prompt tokens", "bytes", "transfer ms", "GB/s", "wire GB/s"],
        [[r["prompt_tokens"], r["transfer_bytes"], r["transfer_us"] / 1e3, r.get("gb_per_s"), r.get("wire_gb_per_s")]
         for r in fig["requests"]]), f"Median: {_num(fig['median_gb_per_s'])} GB/s.", ""]


RENDER = {"kernels": _kernels, "parity": _parity, "bandwidth": _bandwidth, "throughput": _throughput,
          "handoff": _handoff}


def _section(name: str, figures: dict) -> list[str]:
    """A step's tables; a figure missing from them costs that section, not the report."""
    try:
        return RENDER[name](figures)
    except (KeyError, TypeError, ValueError) as exc:
        return [f"(not rendered: {type(exc).__name__}: {exc}; the figures are in gpu_check.json)", ""]


def render(doc: dict) -> str:
    build = doc["steps"].get("build", {}).get("figures", {})
    lines = [f"# GPU check ({doc['mode']} run)", "", f"{doc['timestamp']}, commit {doc['git_commit']}, "
             f"{_num(doc['elapsed_s'])} s. Device: {build.get('gpu', {}).get('device', '?')}; torch "
             f"{build.get('torch_version', '?')}, triton {build.get('triton_version', '?')}.", "", "## Goals", "",
             *_table(["goal", "measured", "met"], [[g["goal"], g["measured"] if g["met"] is not None else g.get("why"),
                                                   g["met"]] for g in doc["goals"]])]
    for name, entry in doc["steps"].items():
        lines += [f"## {name}: {entry['status']}", ""]
        if entry["status"] == "ok" and name in RENDER:
            lines += _section(name, entry["figures"])
        elif entry["status"] == "ok":
            lines += [f"- {k}: {v}" for k, v in entry["figures"].items()] + [""]
        else:
            lines += [f"{entry.get('error') or entry.get('reason')}", ""]
    return "\n".join(lines) + "\n"
