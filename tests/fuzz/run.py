"""One fuzz run against a gateway + 1 prefill + 1 decode worker + the HTTP front (real
processes on 127.0.0.1): structured, wire-level and raw-bytes families against every RPC of
every service, the HTTP family against the OpenAI front, floods, then the registry's own RPCs
(last, since they add bogus workers). Meanwhile a probe times the gateway's heartbeat
handling. At the end: statuses per family and method, undocumented ones, the HTTP family's
verdicts, crashes, and the workers' pools after a drain."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from tests.chaos.procs import ChaosCluster
from tests.chaos.run import drain
from tests.fuzz import cases as fuzz_cases
from tests.fuzz.http_cases import Target, http_cases
from tests.fuzz.http_send import HttpResult, send_all, summarize_http
from tests.fuzz.methods import BY_NAME, GATEWAY, Method
from tests.fuzz.profile import FuzzProfile
from tests.fuzz.send import HeartbeatProbe, Result, run_all
from splitserve.client import make_request

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = str(REPO / "models" / "target")
# For a model without one, so the HTTP family's chat requests get past the gateway.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def with_chat_template(model: str, into: str) -> str:
    """``model``, or a copy of it under ``into`` (same name) with ``CHAT_TEMPLATE`` when its
    tokenizer has no chat template (a directory checkpoint only)."""
    config_path = Path(model) / "tokenizer_config.json"
    if not config_path.is_file() or "chat_template" in json.loads(config_path.read_text()):
        return model
    copy = Path(into) / Path(model).name
    shutil.copytree(model, copy)
    config = json.loads(config_path.read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return str(copy)


def _flood_cases(profile: FuzzProfile, seed: int, vocab_size: int) -> dict[str, list[fuzz_cases.Case]]:
    rng = random.Random(f"{seed}:flood")
    generate = GATEWAY[0]
    valid = [(generate, make_request([rng.randrange(vocab_size) for _ in range(rng.randint(1, 60))],
                                     rng.randint(1, 6)).SerializeToString(), "flood:requests")
             for _ in range(profile.flood_requests)]
    huge = [(generate, make_request("word " * 780_000, 4).SerializeToString(), "flood:huge_prompts")
            for _ in range(profile.flood_huge_prompts)]
    junk = [(generate, rng.randbytes(rng.randint(0, 4096)), "flood:garbage") for _ in range(profile.flood_garbage)]
    return {"flood:requests": valid, "flood:huge_prompts": huge, "flood:garbage": junk}


async def _families(cluster: ChaosCluster, profile: FuzzProfile, seed: int, target: Target,
                    results: list[Result], http_results: list[HttpResult], phases: dict[str, float]) -> None:
    """Every family; ``phases``: when each part began (monotonic), to place late heartbeats."""
    phases["grpc"] = time.monotonic()
    decode, prefill = cluster.addresses["decode-0"], cluster.addresses["prefill-0"]
    targets = {"gateway": cluster.addresses["gateway"], "gateway-internal": cluster.addresses["gateway-internal"],
               "decode": decode, "prefill": prefill}
    structured = fuzz_cases.structured(profile, seed, target.vocab_size, decode)
    bases: dict[str, list[bytes]] = defaultdict(list)
    for method, payload, _ in structured:
        bases[method.path].append(payload)
    await _send_families(cluster, targets, results, [
        (structured, profile.concurrency), (fuzz_cases.wire(profile, seed, bases), profile.concurrency)])
    # HTTP before the floods fill max_in_flight and the registry's cases add bogus workers.
    cases = http_cases(profile.http, seed, target, profile.http_near_cap)
    phases["http"] = time.monotonic()
    http_results += await send_all(cluster.addresses["http"], cases, profile.concurrency)
    cluster.check_crashes()
    phases["floods_and_registry"] = time.monotonic()
    families = [(c, len(c)) for c in _flood_cases(profile, seed, target.vocab_size).values()]
    await _send_families(cluster, targets, results,
                         [*families, (fuzz_cases.registry(profile, seed), profile.concurrency)])


async def _send_families(cluster: ChaosCluster, targets: dict[str, str], results: list[Result],
                         families: list[tuple[list[fuzz_cases.Case], int]]) -> None:
    """Each family in turn, ``concurrency`` cases at a time, target by target."""
    for family, concurrency in families:
        by_target: dict[str, list[fuzz_cases.Case]] = defaultdict(list)
        for case in family:
            by_target[case[0].target].append(case)
        for target, target_cases in by_target.items():
            results += await run_all(targets[target], target_cases, max(1, concurrency))
        cluster.check_crashes()


def _phase_at(phases: dict[str, float], at: float) -> str:
    """The part of the run under way at ``at`` (monotonic)."""
    begun = [name for name, start in phases.items() if start <= at]
    return max(begun, key=phases.__getitem__) if begun else "start"


def summarize(profile: FuzzProfile, seed: int, results: list[Result], probe: HeartbeatProbe, loads: dict,
              cluster: ChaosCluster, load_start: tuple[float, ...], seconds: float,
              http_results: list[HttpResult], phases: dict[str, float]) -> dict:
    by_family: dict[str, Counter] = defaultdict(Counter)
    by_method: dict[str, Counter] = defaultdict(Counter)
    undocumented = []
    for r in results:
        by_family[r.family][r.code] += 1
        by_method[r.method][r.code] += 1
        method: Method = BY_NAME[r.method]
        if r.code not in method.documented:
            undocumented.append(r)
    leaked = sum(v.get("total", 0) - v.get("free", 0) + v.get("in_transfer", 0) for v in loads.values())
    period_s = profile.heartbeat_period_ms / 1000
    rtts = sorted(probe.rtts)
    heartbeat = {"period_ms": profile.heartbeat_period_ms, "beats": len(rtts), "failures": probe.failures,
                 "rtt_p50_ms": round(rtts[len(rtts) // 2] * 1000, 1) if rtts else None,
                 "rtt_max_ms": round(rtts[-1] * 1000, 1) if rtts else None,
                 "late": sum(1 for r in rtts if r > period_s),
                 "late_during": [_phase_at(phases, at) for at in probe.late_at]}
    checks = {"no_undocumented_status": not undocumented, "no_crash": not cluster.crashes,
              "no_leaked_blocks": leaked == 0 and all("unreachable" not in v for v in loads.values()),
              "heartbeat_never_late": heartbeat["late"] == 0 and probe.failures == 0 and bool(rtts)}
    http = summarize_http(http_results)
    checks.update({f"http_no_{problem}": count == 0 for problem, count in http["problems"].items()})
    return {
        "profile": profile.name, "seed": seed, "seconds": round(seconds, 1), "cases": len(results),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "statuses": dict(Counter(r.code for r in results)),
        "by_family": {k: dict(v) for k, v in sorted(by_family.items())},
        "by_method": {k: dict(v) for k, v in sorted(by_method.items())},
        "undocumented": len(undocumented),
        "undocumented_examples": dict(Counter(f"{r.method} {r.family} {r.code}: {r.details[:90]}"
                                              for r in undocumented).most_common(15)),
        "slowest_s": round(max((r.seconds for r in results), default=0.0), 2),
        "crashes": [vars(c) for c in cluster.crashes], "leaked_blocks": leaked, "final_loads": loads,
        "heartbeat": heartbeat, "http": http, "checks": checks, "passed": all(checks.values()),
    }


def run_fuzz(profile: FuzzProfile, seed: int, model: str = DEFAULT_MODEL, log_dir: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="fuzz-model-") as tmp:
        return _run(profile, seed, with_chat_template(model, tmp), log_dir)


def _run(profile: FuzzProfile, seed: int, model: str, log_dir: str | None) -> dict:
    from engine.models.spec import load_model_spec

    load_start = os.getloadavg()
    t0 = time.monotonic()
    target = Target(Path(model).name, load_model_spec(model).vocab_size)
    cluster = ChaosCluster(model, num_prefill=1, num_decode=1, log_dir=log_dir, http_port=0, gateway_flags=[
        "--max-in-flight", str(profile.max_in_flight), "--heartbeat-period-ms", str(profile.heartbeat_period_ms)])
    results: list[Result] = []
    http_results: list[HttpResult] = []
    phases: dict[str, float] = {}
    probe = HeartbeatProbe("", profile.heartbeat_period_ms / 1000)

    async def main() -> dict:
        try:
            await _families(cluster, profile, seed, target, results, http_results, phases)
        finally:
            probe.stop()
        loads = await drain(cluster, 30.0)
        await cluster.close_channels()
        return loads

    try:  # a cluster that fails to start is stopped too (its started processes would outlive us)
        cluster.start()
        probe.address = cluster.addresses["gateway-internal"]
        probe.start()
        loads = asyncio.run(main())
        cluster.check_crashes()
    finally:
        cluster.stop()
    return summarize(profile, seed, results, probe, loads, cluster, load_start, time.monotonic() - t0, http_results,
                     phases)
