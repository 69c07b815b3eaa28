"""The issue's goals, read off a run's steps. Each is ``{"id", "goal", "measured", "met"}``;
``met`` is None (with ``"why"``) when its step did not produce the figure, or in a dry run
for the speed goals (a CPU says nothing about an H200)."""

from __future__ import annotations

from bench.gpu.options import STEPS

ALL_STEPS = STEPS
ATTENTION_GOAL = 0.7  # the Triton paged attention's K/V bandwidth / copy bandwidth
DECODE_GOAL = 0.5  # the 8B-shaped decode at batch 64: achieved bandwidth / copy bandwidth
DECODE_GOAL_BATCH = "64"
# bfloat16 divergences count as drift when, at the first differing position, transformers'
# own logits of its token and of ours differ by at most this share of that row's spread.
BF16_TIE_SHARE = 0.02


def _figures(steps: dict, name: str) -> dict | None:
    entry = steps.get(name, {})
    return entry.get("figures") if entry.get("status") == "ok" else None


def _unmet(goal_id: str, text: str, why: str) -> dict:
    return {"id": goal_id, "goal": text, "measured": None, "met": None, "why": why}


def _kernels(steps: dict) -> dict:
    text = "every Triton kernel equals its torch reference (within the kernel tests' tolerances)"
    fig = _figures(steps, "kernels")
    if fig is None:
        return _unmet("kernels_equal_references", text, "the kernels step did not finish")
    return {"id": "kernels_equal_references", "goal": text, "measured": f"{fig['num_passed']}/{fig['num_checks']}",
            "met": fig["all_passed"]}


def _parity_models(fig: dict) -> dict[str, dict]:
    return {name: v for name, v in fig.items() if isinstance(v, dict) and ("float32" in v or "error" in v)}


def _parity(steps: dict) -> list[dict]:
    text32 = "greedy tokens identical to transformers in float32 (every model)"
    text16 = f"bfloat16 divergences are near-ties (logit gap <= {BF16_TIE_SHARE:.0%} of the row's spread)"
    fig = _figures(steps, "parity")
    if fig is None:
        return [_unmet("greedy_float32_identical", text32, "the parity step did not finish"),
                _unmet("greedy_bfloat16_drift", text16, "the parity step did not finish")]
    models = _parity_models(fig)
    runs = {dtype: {name: m.get(dtype, m) for name, m in models.items()} for dtype in ("float32", "bfloat16")}
    broken = {dtype: [name for name, r in by_model.items() if "error" in r] for dtype, by_model in runs.items()}
    out = []
    if broken["float32"] or not models:
        out.append(_unmet("greedy_float32_identical", text32, f"float32 parity did not run on {broken['float32']}"))
    else:
        out.append({"id": "greedy_float32_identical", "goal": text32,
                    "measured": {n: r["matches"] for n, r in runs["float32"].items()},
                    "met": all(r["identical"] for r in runs["float32"].values())})
    if broken["bfloat16"] or not models:
        out.append(_unmet("greedy_bfloat16_drift", text16, f"bfloat16 parity did not run on {broken['bfloat16']}"))
    else:
        gaps = [d.get("margin_of_spread") for r in runs["bfloat16"].values() for d in r["divergences"]]
        out.append({"id": "greedy_bfloat16_drift", "goal": text16,
                    "measured": {"matches": {n: r["matches"] for n, r in runs["bfloat16"].items()}, "gaps": gaps},
                    "met": all(g is not None and abs(g) <= BF16_TIE_SHARE for g in gaps)})
    return out


def _speed(steps: dict, dry_run: bool) -> list[dict]:
    text_att = f"Triton paged attention >= {ATTENTION_GOAL:.0%} of the measured copy bandwidth"
    text_dec = f"8B-shaped decode at batch {DECODE_GOAL_BATCH} >= {DECODE_GOAL:.0%} of the bandwidth roofline"
    if dry_run:
        why = "not assessed in a dry run (CPU, interpreted kernels)"
        return [_unmet("paged_attention_bandwidth", text_att, why), _unmet("decode_roofline_batch64", text_dec, why)]
    out = []
    bw = _figures(steps, "bandwidth")
    if bw is None:
        out.append(_unmet("paged_attention_bandwidth", text_att, "the bandwidth step did not finish"))
    else:
        ratio = bw["attention"]["triton_vs_copy"]
        out.append({"id": "paged_attention_bandwidth", "goal": text_att, "measured": ratio, "met": ratio >= ATTENTION_GOAL})
    tp = _figures(steps, "throughput")
    batch = (tp or {}).get("batches", {}).get(DECODE_GOAL_BATCH, {})
    if "roofline_fraction" not in batch:
        out.append(_unmet("decode_roofline_batch64", text_dec, f"no decode figures at batch {DECODE_GOAL_BATCH}"))
    else:
        fraction = batch["roofline_fraction"]
        out.append({"id": "decode_roofline_batch64", "goal": text_dec, "measured": fraction, "met": fraction >= DECODE_GOAL})
    return out


def evaluate(steps: dict, dry_run: bool) -> list[dict]:
    return [_kernels(steps), *_parity(steps), *_speed(steps, dry_run)]
