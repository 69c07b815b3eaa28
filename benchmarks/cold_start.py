"""Cold start: ``splitserve up`` on the default model until it is ready, beside vLLM's start (#25)::

    python -m benchmarks.cold_start [--rounds 3] [--busy-core] [--skip-vllm] [--vllm-rounds 1] \
        [--vllm-python .venv-vllm/bin/python] [--out bench/results/cold_start.json]

**Ours**, ``--rounds`` times, each a fresh ``splitserve up --port 0 --status-file F --log-dir D``
(gateway + 1 prefill + 1 decode worker) on the default model, fetched first (untimed): the
time from spawning ``up`` to its status file saying ``ready`` (the gateway listens and every
worker registered with it). Then a short greedy ``splitserve generate`` through the gateway
proves it serves, and SIGINT stops it; a round fails if ``up`` exits non-zero or leaves a
process behind. The services' logs and their processes' start times split the time: each
service's process starting, the gateway listening, each worker's ``worker.serving`` line with
its ``engine_load_s`` (model load and engine set-up; the rest of a worker's start is its
interpreter and imports), registration.

``--busy-core`` adds the same rounds while one busy-loop process (``python -c "while True:
pass"``) holds a core: the "other core busy" case of ``make run``.

**vLLM** (``--skip-vllm`` leaves it out), ``--vllm-rounds`` fresh ``vllm serve`` processes on
the same weights (the default GGUF dequantised to a float32 checkpoint with its tokenizer,
``benchmarks.serve_vs_vllm.export_hf``), at its best setting here (``VLLM_CPU_OMP_THREADS_BIND=0-1``):
the time from spawn until ``/health`` answers, which its API server does once the engine
loaded the model, compiled it and sized the KV cache, i.e. ready to serve; then one short
completion. Whether its compile cache (``~/.cache/vllm``) served is read from its log (hit:
it loaded the compiled model; miss: it compiled, as on the first start for a model folder).

The table gives min / median / max seconds to ready per config with the 1-minute load
average at each round; the goal is ours ready within 10 s (median of the quiet rounds).
The JSON goes to ``--out``, the logs beside it (the folder named like ``--out`` without ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from bench.machine import load_average
from splitserve.progress import process_alive, read_status

DEFAULT_OUT = Path("bench/results/cold_start.json")
GOAL_S = 10.0
READY_TIMEOUT_S = 900.0  # a generous bound for a benchmark; ``up`` itself waits while its services progress
PROMPT = "def fibonacci(n):"
GENERATE_TOKENS = 8
VLLM_CACHE = Path.home() / ".cache" / "vllm"
CONFIGS = ("ours", "ours_busy", "vllm")


# -- ours ---------------------------------------------------------------------------------
def wait_ready(proc: subprocess.Popen, status: Path, timeout_s: float = READY_TIMEOUT_S,
               poll_s: float = 0.02) -> dict:
    """Poll the status file until ``state`` is ``ready``; raise if ``up`` failed, exited or ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_status(str(status))
        if state is not None and state.get("state") == "ready":
            return state
        if state is not None and state.get("state") == "failed":
            raise RuntimeError(f"up failed: {state.get('error')}")
        if proc.poll() is not None:
            raise RuntimeError(f"up exited with code {proc.returncode} before it was ready")
        time.sleep(poll_s)
    raise TimeoutError(f"up was not ready within {timeout_s} s")


def log_events(path: Path) -> list[dict]:
    """The JSON log lines of a service's log (other lines, e.g. a library's, are skipped)."""
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def _at(events: list[dict], name: str) -> dict | None:
    return next((e for e in events if e["event"] == name), None)


def _wall(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def phases(log_dir: Path, spawned_at: float, ready_s: float, started: dict[str, float] | None = None) -> dict:
    """Where the time to ready went (seconds after spawning ``up``), from the services' logs and
    their processes' start times (``started``: service name -> seconds after ``up`` started,
    :func:`service_starts`):
    each service's start, the gateway listening, each worker serving (its start-up and imports,
    then ``engine_load_s``), and registration after the last worker served."""
    started = started or {}
    gateway = _at(log_events(log_dir / "gateway.log"), "gateway.listening")
    out: dict = {"gateway_started_s": started.get("gateway"),
                 "gateway_listening_s": None if gateway is None else _wall(gateway) - spawned_at, "workers": {}}
    for path in sorted(log_dir.glob("*.log")):
        serving = _at(log_events(path), "worker.serving")
        if serving is None:
            continue
        worker = {"started_s": started.get(path.stem),
                  "serving_s": _wall(serving) - spawned_at, "engine_load_s": serving.get("engine_load_s")}
        if worker["engine_load_s"] is not None and worker["started_s"] is not None:
            worker["imports_s"] = worker["serving_s"] - worker["started_s"] - worker["engine_load_s"]
        out["workers"][path.stem] = worker
    last = max((w["serving_s"] for w in out["workers"].values()), default=None)
    out["last_worker_serving_s"] = last
    out["registration_s"] = None if last is None else ready_s - last
    return out


def process_start(pid: int) -> float | None:
    """Seconds after boot that ``pid`` started (Linux ``/proc``, to a clock tick); None where unreadable."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def service_starts(up_pid: int, pids: list[int]) -> dict[str, float]:
    """``up``'s services (``python -m splitserve.cli ROLE ...``) by the names of their logs, the
    first of each role (the default 1 + 1): name -> seconds after ``up`` started that it started."""
    starts: dict[str, float] = {}
    up = process_start(up_pid)
    for pid in pids if up is not None else []:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        role = argv[argv.index("splitserve.cli") + 1] if "splitserve.cli" in argv[:-1] else None
        name = "gateway" if role == "gateway" else f"{role}-0"
        at = process_start(pid)
        if role is not None and at is not None and name not in starts:
            starts[name] = at - up
    return starts


def child_pids(pid: int) -> list[int]:
    """The children of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def stop(proc: subprocess.Popen, children: list[int], grace_s: float = 60.0) -> dict:
    """SIGINT to ``up`` (it stops its services), wait; SIGKILL ``up`` and ``children`` past the grace."""
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    deadline = time.monotonic() + 5.0
    while any(process_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in children if process_alive(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"exit_code": code, "stop_s": time.monotonic() - started, "left_behind": left}


def generate(address: str) -> dict:
    """A short greedy completion through the gateway, with ``splitserve generate``."""
    cmd = [sys.executable, "-m", "splitserve.cli", "generate", "--gateway", address, "--temperature", "0",
           "--max-tokens", str(GENERATE_TOKENS), "--wait-s", "60", PROMPT]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    ok = out.returncode == 0 and bool(out.stdout.strip())
    return {"ok": ok, "seconds": time.monotonic() - started, "text": out.stdout.strip(),
            **({} if ok else {"error": f"exit {out.returncode}: {out.stderr.strip()[-500:]}"})}


def ours_round(work: Path, name: str) -> dict:
    """One fresh ``splitserve up``: time to ready, its phases, a generate, a clean stop."""
    status, log_dir = work / f"{name}.status", work / f"{name}-logs"
    status.unlink(missing_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "splitserve.cli", "up", "--port", "0", "--status-file", str(status),
           "--log-dir", str(log_dir)]
    record: dict = {"load_before": load_average()}
    with open(log_dir / "up.log", "wb") as log:
        spawned_at, started = time.time(), time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        children: list[int] = []
        starts: dict[str, float] = {}
        try:
            state = wait_ready(proc, status)
            record["ready_s"] = time.monotonic() - started
            record["load_at_ready"] = load_average()
            children = child_pids(proc.pid)
            starts = service_starts(proc.pid, children)
            record["generate"] = generate(state["gateway"])
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
            record["error"] = str(exc)
        finally:
            children = children or child_pids(proc.pid)
            record["stop"] = stop(proc, children)
    record["phases"] = phases(log_dir, spawned_at, record.get("ready_s", 0.0), starts)
    record["load_after"] = load_average()
    record["ok"] = round_ok(record)
    return record


def round_ok(record: dict) -> bool:
    """Ready, served a completion, and stopped cleanly with nothing left behind."""
    return ("ready_s" in record and record.get("generate", {}).get("ok", False)
            and record["stop"]["exit_code"] == 0 and not record["stop"]["left_behind"])


@contextmanager
def busy_core() -> Iterator[int]:
    """A busy-loop process holding one core while the block runs (killed after)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog.pid
    finally:
        hog.kill()
        hog.wait()


# -- vLLM ---------------------------------------------------------------------------------
def compile_cache_entries(cache: Path = VLLM_CACHE) -> int:
    """Files under vLLM's cache folder (0 when it is missing): its compiled graphs live there."""
    return sum(1 for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else 0


def compile_cache_use(log: str) -> str:
    """What vLLM's log says of its compile cache: ``hit`` (it loaded the compiled model),
    ``miss`` (it compiled and saved it: the cache held nothing for this model and setting), or
    ``unknown``. Its key includes the model's path, so a new checkpoint folder is a miss."""
    if "Directly load AOT compilation" in log or "Directly load the compiled graph" in log:
        return "hit"
    if "saved AOT compiled function" in log:
        return "miss"
    return "unknown"


def vllm_round(python: Path, hf: Path, work: Path, name: str) -> dict:
    """A fresh ``vllm serve``: time from spawn until ``/health`` answers, then one completion."""
    from benchmarks.serve_vs_vllm import free_port, vllm_serve, wait_http

    port = free_port()
    cmd, env = vllm_serve(python, hf, port)
    url = f"http://127.0.0.1:{port}"
    record: dict = {"load_before": load_average(), "cache_entries_before": compile_cache_entries()}
    log_path = work / f"{name}.log"
    with open(log_path, "w") as log:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
        try:
            wait_http(f"{url}/health", proc, READY_TIMEOUT_S, poll_s=0.1)
            record["ready_s"] = time.monotonic() - started
            record["load_at_ready"] = load_average()
            record["generate"] = vllm_complete(url)
        except (RuntimeError, TimeoutError, OSError) as exc:
            record["error"] = str(exc)
        finally:
            proc.terminate()
            try:
                record["exit_code"] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                record["exit_code"] = proc.wait()
    record["cache_entries_after"] = compile_cache_entries()
    record["compile_cache"] = compile_cache_use(log_path.read_text(errors="replace"))
    record["load_after"] = load_average()
    record["ok"] = "ready_s" in record and record.get("generate", {}).get("ok", False)
    return record


def vllm_complete(url: str) -> dict:
    """A short greedy ``/v1/completions`` request."""
    body = json.dumps({"model": "smollm2-f32", "prompt": PROMPT, "max_tokens": GENERATE_TOKENS,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    started = time.monotonic()
    answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
    text = answer["choices"][0]["text"]
    return {"ok": bool(text.strip()), "seconds": time.monotonic() - started, "text": text}


# -- report -------------------------------------------------------------------------------
def spread(values: list[float]) -> dict | None:
    """min / median / max of ``values``; None when there are none."""
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def summary(rounds: dict[str, list[dict]], goal_s: float = GOAL_S) -> tuple[dict, list[str]]:
    """The figures per config and the goal, and the table (markdown) with the load averages."""
    figures: dict = {}
    lines = ["| config | rounds ok | ready s (min / median / max) | load 1m at each round |", "|---|---|---|---|"]
    for config in CONFIGS:
        if config not in rounds:
            continue
        runs = rounds[config]
        ready = spread([r["ready_s"] for r in runs if r.get("ok")])
        loads = [r.get("load_at_ready", r.get("load_before")) for r in runs]
        figures[config] = {"ready_s": ready, "ok": sum(bool(r.get("ok")) for r in runs), "rounds": len(runs),
                           "load_1m": loads}
        text = "failed" if ready is None else f"{ready['min']:.1f} / {ready['median']:.1f} / {ready['max']:.1f}"
        load_text = ", ".join("?" if v is None else f"{v:.2f}" for v in loads)
        cache = [r["compile_cache"] for r in runs if "compile_cache" in r]
        if cache:
            figures[config]["compile_cache"] = cache
        label = f"{config} (compile cache: {', '.join(cache)})" if cache else config
        lines.append(f"| {label} | {figures[config]['ok']}/{len(runs)} | {text} | {load_text} |")
    ours = figures.get("ours", {}).get("ready_s")
    met = None if ours is None else ours["median"] <= goal_s
    figures["goal"] = {"what": f"ours ready within {goal_s:g} s (median)", "goal_s": goal_s,
                       "median_s": None if ours is None else ours["median"], "met": met}
    verdict = "not measured" if met is None else ("met" if met else "MISSED")
    median = "" if ours is None else f": median {ours['median']:.1f} s"
    lines.append(f"goal: ours ready within {goal_s:g} s{median} -- {verdict} "
                 f"(load 1m {', '.join(f'{v:.2f}' for v in figures.get('ours', {}).get('load_1m', []) if v)})")
    return figures, lines


def say(message: str) -> None:
    sys.stderr.write(f"[cold_start] {message}\n")
    sys.stderr.flush()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cold_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="fresh `splitserve up` starts per config")
    p.add_argument("--busy-core", action="store_true", help="also the rounds with one core held by a busy loop")
    p.add_argument("--skip-vllm", action="store_true", help="leave vLLM's start out")
    p.add_argument("--vllm-rounds", type=int, default=1, help="fresh `vllm serve` starts (each about a minute)")
    p.add_argument("--vllm-python", default=None,
                   help="python of vLLM's venv (default: $SPLITSERVE_VLLM_PYTHON, .venv-vllm, /tmp/vllm-venv)")
    p.add_argument("--hf-dir", type=Path, default=Path(".cache/smollm2-f32-hf"),
                   help="vLLM's float32 checkpoint of the default model (written once)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.vllm_rounds < 1:
        p.error("--rounds and --vllm-rounds must be >= 1")
    return args


def run_rounds(args: argparse.Namespace, work: Path) -> dict[str, list[dict]]:
    """Every config's rounds, one after another."""
    rounds: dict[str, list[dict]] = {"ours": []}
    for i in range(args.rounds):
        rounds["ours"].append(ours_round(work, f"ours-{i}"))
        say(f"ours round {i}: {_brief(rounds['ours'][-1])}")
    if args.busy_core:
        rounds["ours_busy"] = []
        with busy_core():
            for i in range(args.rounds):
                rounds["ours_busy"].append(ours_round(work, f"ours-busy-{i}"))
                say(f"ours (busy core) round {i}: {_brief(rounds['ours_busy'][-1])}")
    if not args.skip_vllm:
        rounds["vllm"] = vllm_rounds(args, work)
    return rounds


def vllm_rounds(args: argparse.Namespace, work: Path) -> list[dict]:
    from benchmarks.peers import find_vllm_python
    from benchmarks.serve_vs_vllm import export_hf
    from splitserve.default_model import ensure_default_model

    python = find_vllm_python(args.vllm_python)
    if python is None:
        say("vLLM skipped: no vLLM venv (--vllm-python, $SPLITSERVE_VLLM_PYTHON, .venv-vllm or /tmp/vllm-venv)")
        return [{"ok": False, "error": "no vLLM venv found"}]
    hf = export_hf(ensure_default_model(), args.hf_dir.resolve())
    out = []
    for i in range(args.vllm_rounds):
        out.append(vllm_round(python.absolute(), hf, work, f"vllm-{i}"))
        say(f"vllm round {i}: {_brief(out[-1])} (compile cache: {out[-1].get('compile_cache')})")
    return out


def _brief(record: dict) -> str:
    if not record.get("ok"):
        return f"FAILED {record.get('error') or record.get('generate') or record.get('stop')}"
    return f"ready in {record['ready_s']:.2f} s (load 1m {record.get('load_at_ready')})"


def main(argv: list[str] | None = None) -> int:
    """Runs the rounds, prints the table, writes the JSON; 1 when a round of ours failed."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from bench import report
    from splitserve.default_model import ensure_default_model

    model = ensure_default_model()  # fetched once, untimed
    work = args.out.with_suffix("").resolve()
    work.mkdir(parents=True, exist_ok=True)
    rounds = run_rounds(args, work)
    figures, lines = summary(rounds)
    header = report.header("cold-start", 1, ["python", "-m", "benchmarks.cold_start", *argv])
    report.write_json({**header, "model": str(model), "figures": figures, "rounds": rounds}, args.out)
    sys.stdout.write("\n".join(lines) + "\n")
    say(f"report: {args.out}")
    return 0 if all(r.get("ok") for c in ("ours", "ours_busy") for r in rounds.get(c, [])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
