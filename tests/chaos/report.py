"""The chaos run's figures, and the zeros it must show.

Zeros (``checks``): no leaked block after the drain, no OK reply that differs from its golden
reply, no hang (a call still open past its deadline, or DEADLINE_EXCEEDED under a 60 s
deadline for work of a second), no UNKNOWN/INTERNAL, no crash, every fault fired, and every
restarted (or resumed) process back in routing within 2 s of being ready.

A request *hit by a decode death* is one that migrated (OK with ``migrations`` >= 1) or that
failed after tokens had reached it while a killed decode worker was down; the share of those
that completed OK is the migration figure. Its cost: the client-side stall of a migrated
stream (its longest gap between token chunks), TTFT and output throughput of the faulted
phase, each beside the no-fault phase of the same run.
"""

from __future__ import annotations

import statistics
from collections import Counter

from tests.chaos.faults import FaultRecord
from tests.chaos.load import Outcome
from tests.chaos.procs import Crash
from tests.chaos.profile import ChaosProfile
from tests.chaos.workload import Golden

BACK_IN_ROUTING_MAX_S = 2.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def phase_cost(outcomes: list[Outcome]) -> dict:
    """TTFT, each stream's longest gap between token chunks, output throughput of one phase
    (OK requests; tokens of every request)."""
    if not outcomes:
        return {}
    ttfts = [o.ttft_s for o in outcomes if o.code == "OK" and o.ttft_s is not None]
    gaps = [o.max_gap_s for o in outcomes if o.code == "OK" and len(o.token_ids) > 1]
    seconds = max(o.end for o in outcomes) - min(o.start for o in outcomes)
    tokens = sum(len(o.token_ids) for o in outcomes)
    return {"requests": len(outcomes), "ttft_p50_ms": _ms(_pct(ttfts, 0.5)), "ttft_p99_ms": _ms(_pct(ttfts, 0.99)),
            "longest_gap_p50_ms": _ms(_pct(gaps, 0.5)), "longest_gap_p99_ms": _ms(_pct(gaps, 0.99)),
            "output_tokens": tokens, "seconds": round(seconds, 2), "output_tok_per_s": round(tokens / seconds, 1)}


def _decode_down(records: list[FaultRecord], start: float, end: float) -> bool:
    return any(r.fault.kind == "kill" and r.fault.role == "decode" and r.at <= end and start <= r.until
               for r in records)


def migration_figures(chaos: list[Outcome], records: list[FaultRecord]) -> dict:
    migrated = [o for o in chaos if o.code == "OK" and o.migrations]
    failed = [o for o in chaos if o.code != "OK" and o.token_ids and _decode_down(records, o.start, o.end)]
    hit = len(migrated) + len(failed)
    stalls = [o.max_gap_s for o in migrated]
    return {"hit_by_decode_death": hit, "completed_ok": len(migrated), "failed_mid_stream": len(failed),
            "share_ok": round(len(migrated) / hit, 4) if hit else None,
            "migrations": sum(o.migrations for o in migrated),
            "stall_p50_ms": _ms(_pct(stalls, 0.5)), "stall_p99_ms": _ms(_pct(stalls, 0.99)),
            "failed_examples": [(o.code, o.details[:160]) for o in failed[:5]]}


def gateway_figures(profile: ChaosProfile, outcomes: list[Outcome], records: list[FaultRecord]) -> dict:
    """Gateway replicas and what their faults cost: requests that failed while one was down,
    and streams that resumed on another (the share of every request that failed too)."""
    down = [r for r in records if r.fault.role == "gateway"]
    failed = [o for o in outcomes if o.code != "OK"]
    while_down = [o for o in failed if any(r.at <= o.end and o.start <= (r.until or o.end) for r in down)]
    return {"replicas": profile.num_gateways, "resuming_clients": profile.resume, "faults": len(down),
            "resumed_ok": sum(1 for o in outcomes if o.code == "OK" and o.resumes),
            "failed_while_a_gateway_was_down": len(while_down),
            "failed_share": round(len(failed) / len(outcomes), 5) if outcomes else None}


def mismatches(outcomes: list[Outcome], golden: dict[int, Golden]) -> list[dict]:
    bad = []
    for o in outcomes:
        if o.code != "OK":
            continue
        want = golden[o.spec.index]
        logprobs_ok = o.spec.logprobs is None or o.num_logprobs == len(o.token_ids)
        if not want.matches(o.token_ids, o.text, o.finish_reason) or not logprobs_ok:
            bad.append({"request_id": o.request_id, "index": o.spec.index, "kind": o.spec.kind, "phase": o.phase, "migrations": o.migrations,
                        "got": o.token_ids[:40], "want": list(want.token_ids[:40]),
                        "got_text": o.text[:80], "want_text": want.text[:80]})
    return bad


def fault_figures(records: list[FaultRecord], planned: int) -> dict:
    back = [r.back_in_routing_s for r in records if r.back_in_routing_s is not None]
    return {"planned": planned, "fired": len(records), "phase_caught": sum(r.caught for r in records),
            "phase_not_caught": [f"{r.fault.name} {r.target}" for r in records if not r.caught],
            "by_type": dict(Counter(r.fault.name for r in records)),
            "down_s_p50": round(statistics.median([r.until - r.at for r in records]), 2) if records else None,
            "errors": [f"{r.fault.name} {r.target}: {r.error}" for r in records if r.error],
            "back_in_routing_max_s": round(max(back), 3) if back else None,
            "back_in_routing_p50_s": round(statistics.median(back), 3) if back else None,
            "not_back_in_2s": [f"{r.fault.name} {r.target}: {r.back_in_routing_s}" for r in records
                               if r.back_in_routing_s is None or r.back_in_routing_s > BACK_IN_ROUTING_MAX_S]}


def summarize(profile: ChaosProfile, seed: int, model: str, outcomes: list[Outcome], records: list[FaultRecord],
              golden: dict[int, Golden], loads: dict, crashes: list[Crash], exit_codes: dict,
              load_start: tuple[float, ...], load_end: tuple[float, ...], seconds: float) -> dict:
    by_phase = {p: [o for o in outcomes if o.phase == p] for p in ("warmup", "baseline", "migration", "chaos")}
    faulted = by_phase["migration"] + by_phase["chaos"]
    bad = mismatches(outcomes, golden)
    leaked = sum(v.get("total", 0) - v.get("free", 0) + v.get("in_transfer", 0) for v in loads.values())
    unreachable = [n for n, v in loads.items() if "unreachable" in v]
    hangs = [o for o in outcomes if o.hung or o.code == "DEADLINE_EXCEEDED"]
    statuses = dict(Counter(o.code for o in outcomes))
    chaos_records = [r for r in records if r.phase == "chaos"]
    faults = fault_figures(records, profile.num_faults + profile.migration_kills)
    cost = {p: phase_cost(by_phase[p]) for p in ("baseline", "migration", "chaos") if by_phase[p]}
    base = cost["baseline"]
    for figures in cost.values():
        figures["ttft_p50_vs_baseline"] = _ratio(figures["ttft_p50_ms"], base["ttft_p50_ms"])
        figures["output_tok_per_s_vs_baseline"] = _ratio(figures["output_tok_per_s"], base["output_tok_per_s"])
    checks = {
        "no_leaked_blocks": leaked == 0 and not unreachable,
        "no_mismatch": not bad,
        "no_hang": not hangs,
        "no_unknown_internal": not (statuses.get("UNKNOWN", 0) + statuses.get("INTERNAL", 0)),
        "no_crash": not crashes,
        "every_fault_fired": len(chaos_records) == profile.num_faults and not faults["errors"],
        "back_in_routing_within_2s": not faults["not_back_in_2s"],
    }
    return {
        "profile": profile.name, "seed": seed, "model": model, "seconds": round(seconds, 1),
        "load_average": {"start": load_start, "end": load_end},
        "requests": {p: len(v) for p, v in by_phase.items()},
        "statuses": statuses, "statuses_by_phase": {p: dict(Counter(o.code for o in v)) for p, v in by_phase.items()},
        "hangs": len(hangs), "leaked_blocks": leaked, "final_loads": loads,
        "crashes": [vars(c) for c in crashes], "exit_codes": exit_codes,
        "mismatches": len(bad), "mismatch_examples": bad[:5],
        "faults": faults, "migration": migration_figures(faulted, records), "cost": cost,
        "gateways": gateway_figures(profile, outcomes, records),
        "errors_by_detail": dict(Counter(f"{o.code}: {o.details[:100]}" for o in outcomes if o.code != "OK").most_common(12)),
        "checks": checks, "passed": all(checks.values()),
    }


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or not baseline else round(value / baseline, 3)
