"""``splitserve bench``: run the sections, then write report.json, report.md and the plots.

Sections run in this order, each one's deployments started once and stopped when no later
section needs them: **online** (load against the deployment: ``--gateway`` or a
disaggregated deployment of ``--model`` started here), **interference** (disaggregated vs
colocated), **peers** (offline, in-process systems first, then vLLM, then our deployments).
A section that fails is recorded as skipped with the error; the others still run, and the
command exits 1.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from bench import report as report_mod
from bench.cost import cost_figures
from bench.deployment import DeploymentPool, DeploymentSpec, engine_flags
from bench.machine import load_average
from bench.options import BenchConfig
from bench.figures import is_skipped, skipped


def say(message: str) -> None:
    sys.stderr.write(f"[bench] {message}\n")
    sys.stderr.flush()


def deployment_spec(config: BenchConfig, mode: str, model: Path | str, extra: tuple[str, ...] = ()) -> DeploymentSpec:
    """``mode`` on ``config.threads`` cores: disaggregated splits them prefill / decode."""
    prefill = max(1, config.threads // 2)
    return DeploymentSpec(model=str(model), mode=mode, prefill_threads=prefill,
                          decode_threads=max(1, config.threads - prefill), colocated_threads=config.threads,
                          worker_flags=extra)


def online_section(config: BenchConfig, pool: DeploymentPool) -> dict:
    from bench import online

    model = online.ModelInfo.read(config.model)
    if config.gateway:
        address, deployment = config.gateway, {"mode": "external", "gateway": config.gateway}
    else:
        spec = deployment_spec(config, "disaggregated", config.model, config.kv_flags() + config.speculative_flags())
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

    specs = {mode: deployment_spec(config, mode, config.model, config.kv_flags())
             for mode in ("disaggregated", "colocated")}
    if config.profile.interference.colocated_one_thread and config.threads > 1:
        specs["colocated, 1 thread"] = replace(specs["colocated"], colocated_threads=1)
    say("interference: steady decodes + long prompts, disaggregated then colocated")
    return interference.run_interference(config.profile.interference, specs, pool,
                                        online.ModelInfo.read(config.model), config.seed, config.progress,
                                        frozenset(keep))


def peers_section(config: BenchConfig, pool: DeploymentPool) -> dict:
    from bench import peers

    setup = peers.prepare(config.profile.peers, config.model, config.seed)
    flags = config.kv_flags()
    if config.profile.peers.engine_workload:  # the engine's limits, so the deployments match it
        flags = engine_flags(setup.settings)

    def spec(mode: str) -> DeploymentSpec:
        return deployment_spec(config, mode, setup.model_dir, flags)

    return peers.run_peers(config.profile.peers, setup, pool, spec, config.peer_thread_counts,
                           config.vllm_python, config.out_dir, say)


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


def _later_specs(config: BenchConfig) -> tuple[set[DeploymentSpec], set[DeploymentSpec]]:
    """Deployments the interference and the peers sections will ask for (so that one started
    earlier is kept running for them). The peers' engine-workload deployments are never
    shared (another model), so only the bundled-model case appears here."""
    modes = ("disaggregated", "colocated")
    interference = ({deployment_spec(config, m, config.model, config.kv_flags()) for m in modes}
                    if "interference" in config.sections else set())
    peers = set()
    if "peers" in config.sections and not config.profile.peers.engine_workload:
        peers = {deployment_spec(config, m, config.model, config.kv_flags())
                 for m in modes if m in config.profile.peers.systems}
    return interference, peers


def run(config: BenchConfig, argv: list[str]) -> tuple[dict, list[str]]:
    """Every requested section; returns the report and the failures."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    report, failures = _header(config, argv), []
    start = time.perf_counter()
    _make_model(config)
    pool = DeploymentPool(config.out_dir / "logs")
    for_interference, for_peers = _later_specs(config)
    not_requested = skipped("not requested (--sections)")
    try:
        report["online"] = (_guarded("online", lambda: online_section(config, pool), failures)
                            if "online" in config.sections else not_requested)
        report["cost"] = (cost_section(config, report["online"]) if not is_skipped(report["online"])
                          else skipped("the online section did not run"))
        pool.retain(for_interference | for_peers)
        report["interference"] = (
            _guarded("interference", lambda: interference_section(config, pool, for_peers), failures)
            if "interference" in config.sections else not_requested)
        pool.retain(for_peers)
        report["peers"] = (_guarded("peers", lambda: peers_section(config, pool), failures)
                           if "peers" in config.sections else not_requested)
    finally:
        pool.close()
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
