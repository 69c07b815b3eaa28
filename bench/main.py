"""``splitserve bench``: run the sections, then write report.json, report.md and the plots.

Sections run in this order, each one's deployments started once and stopped when no later
section needs them: **online** (load against the deployment: ``--gateway`` or a
disaggregated deployment of ``--model`` started here), **interference** (disaggregated vs
colocated). A section that fails is recorded as skipped with the error; the others still run,
and the command exits 1. The **peers** section (other systems on the same model and prompts)
is not measured here: ``python -m benchmarks.peers`` (in the repository, not installed)
writes it to a file that ``--peers-json`` reads (``bench.peers_file``).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace

from bench import report as report_mod
from bench.cost import cost_figures
from bench.deployment import DeploymentPool, DeploymentSpec, deployment_spec
from bench.machine import load_average
from bench.options import BenchConfig
from bench.figures import is_skipped, skipped


def say(message: str) -> None:
    sys.stderr.write(f"[bench] {message}\n")
    sys.stderr.flush()


def online_section(config: BenchConfig, pool: DeploymentPool) -> dict:
    from bench import online

    model = online.ModelInfo.read(config.model)
    if config.gateway:
        address, deployment = config.gateway, {"mode": "external", "gateway": config.gateway}
    else:
        spec = deployment_spec(config.threads, "disaggregated", config.model, config.kv_flags() + config.speculative_flags())
        say(f"online: starting {spec.mode} deployment of {config.model.name}")
        address, deployment = pool.address(spec), spec.describe()
    if config.custom_online is None:
        section = online.run_online(address, config.profile.online, model, config.slo, config.seed, config.progress)
    else:
        section = online.run_custom(address, config.custom_online, config.profile.online.shapes, model,
                                    config.slo, config.seed, config.progress)
    return {"deployment": deployment, **section}


def cost_section(config: BenchConfig, online: dict) -> dict:
    runs = [r for r in online.get("runs", []) if not is_skipped(r["figures"])]
    if not runs:
        return skipped("no online run completed")
    best = max(runs, key=lambda r: r["figures"]["output_tokens_per_s"])
    figs = cost_figures(config.pricing, best["figures"]["output_tokens_per_s"], best["figures"]["input_tokens_per_s"])
    return {"pricing": vars(config.pricing),
            "basis": f"online run '{best['name']}' (the highest output tokens/s measured)",
            "figures": figs.to_dict(), "self_hosting_can_win": figs.self_hosting_can_win}


def interference_section(config: BenchConfig, pool: DeploymentPool, keep: set[DeploymentSpec]) -> dict:
    from bench import interference, online

    specs = {mode: deployment_spec(config.threads, mode, config.model, config.kv_flags())
             for mode in ("disaggregated", "colocated")}
    if config.profile.interference.colocated_one_thread and config.threads > 1:
        specs["colocated, 1 thread"] = replace(specs["colocated"], colocated_threads=1)
    say("interference: steady decodes + long prompts, disaggregated then colocated")
    return interference.run_interference(config.profile.interference, specs, pool,
                                        online.ModelInfo.read(config.model), config.seed, config.progress,
                                        frozenset(keep))


def _guarded(name: str, run: Callable[[], dict], failures: list[str]) -> dict:
    say(f"{name}: start")
    start = time.perf_counter()
    try:
        result = run()
    except Exception as exc:  # one failed section must not lose the others
        failures.append(f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        say(f"{name}: FAILED: {type(exc).__name__}: {exc}")
        return skipped(f"failed: {type(exc).__name__}: {exc}")
    say(f"{name}: done in {time.perf_counter() - start:.0f} s")
    return {**result, "elapsed_s": time.perf_counter() - start}


def _header(config: BenchConfig, argv: list[str]) -> dict:
    header = report_mod.header("splitserve-bench", config.threads, ["splitserve", "bench", *argv])
    random_model = asdict(config.random_model) if config.random_model is not None else None
    return {"schema": report_mod.SCHEMA, **header, "profile": config.profile.name,
            "config": {"model": str(config.model), "random_model": random_model, "threads": config.threads,
                       "seed": config.seed, "speculative": config.speculative, "sections": list(config.sections),
                       "slo": {"ttft_ms": config.slo.ttft_s * 1000, "tpot_ms": config.slo.tpot_s * 1000}}}


def _make_model(config: BenchConfig) -> None:
    """The profile's seeded random model, when it has one and no ``--model`` was given."""
    if config.random_model is not None:
        from bench.workload import ensure_model

        say(f"model: seeded random Llama in {config.model}")
        ensure_model(config.model, config.random_model, config.seed)


def _later_specs(config: BenchConfig) -> set[DeploymentSpec]:
    """Deployments the interference section will ask for (so that one started earlier is kept
    running for it)."""
    if "interference" not in config.sections:
        return set()
    return {deployment_spec(config.threads, m, config.model, config.kv_flags()) for m in ("disaggregated", "colocated")}


def run(config: BenchConfig, argv: list[str]) -> tuple[dict, list[str]]:
    """Every requested section; returns the report and the failures."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    report, failures = _header(config, argv), []
    start = time.perf_counter()
    _make_model(config)
    pool = DeploymentPool(config.out_dir / "logs")
    for_interference = _later_specs(config)
    not_requested = skipped("not requested (--sections)")
    try:
        report["online"] = (_guarded("online", lambda: online_section(config, pool), failures)
                            if "online" in config.sections else not_requested)
        report["cost"] = (cost_section(config, report["online"]) if not is_skipped(report["online"])
                          else skipped("the online section did not run"))
        pool.retain(for_interference)
        report["interference"] = (
            _guarded("interference", lambda: interference_section(config, pool, set()), failures)
            if "interference" in config.sections else not_requested)
    finally:
        pool.close()
    report["peers"] = config.peers if config.peers is not None else skipped(
        "no --peers-json: `python -m benchmarks.peers` (in the repository, not installed) measures the peers")
    report["goals"] = report_mod.goals(report)
    report["elapsed_s"] = time.perf_counter() - start
    report["load_average_end"] = load_average()
    report["failures"] = failures
    return report, failures


def main(config: BenchConfig, argv: list[str]) -> int:
    report, failures = run(config, argv)
    report_mod.write_bench_report(report, config.out_dir)
    for row in report["goals"]:
        measured = row["figures"]["measured"]
        value = measured["skipped"] if is_skipped(measured) else f"{measured:.3f}"
        say(f"goal {row['goal']}: {value} (target {row['target']}, met: {row['met']})")
    problems = report_mod.figure_problems(report)
    for problem in problems:
        say(f"figure problem: {problem}")
    say(f"report: {config.out_dir / 'report.md'}")
    return 1 if failures or problems else 0


def run_from_args(args: object) -> int:
    """The ``splitserve bench`` subcommand (flags from ``options.add_bench_flags``)."""
    from bench.options import build_config

    try:
        config = build_config(args)
    except ValueError as exc:
        sys.stderr.write(f"splitserve bench: {exc}\n")
        return 2
    return main(config, sys.argv[2:])
