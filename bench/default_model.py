"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF, float32 compute) on this machine
(not a test).

    python -m bench.default_model [--threads 1] [--repeats 2] [--max-tokens 128] \
        [--out bench/results/default_model.json]

Side by side in one run, greedy, chat-templated prompts:

* ``in-process``: ``Engine`` with ``--threads`` torch threads. Batch 1: each chat prompt
  alone, TTFT (add_request -> first token: prefill + sample) and decode tokens/s (first to
  last token). Batch 8: all chat prompts at once, output tokens/s.
* ``disaggregated``: ``splitserve up``'s processes, gateway + 1 prefill + 1 decode worker,
  one thread each, every prompt prefilled on the prefill worker and its KV pages sent over
  Gloo. Batch 1 (one request at a time) and batch 8 (all at once), measured at the client;
  TTFT also as the gateway timed it. Outputs are checked against the in-process engine's.
* ``n-gram`` speculation at batch 1 (k = ``--k``; lookup trusting any recurring suffix, and
  only suffixes of 3+ tokens): on the chat prompts and on code-editing prompts (a function
  and an instruction to change it, so the answer copies much of the prompt). The engines with and without speculation take turns prompt by prompt, each
  measurement ``--repeats`` times, fastest counts; greedy outputs must be identical.
* ``draft floor``: one batch-1 decode step against its vocabulary projection alone (a
  [49152 x 576] matmul): any draft model that shares the target's tokenizer pays at least
  that per drafted token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench import report as report_mod
from bench.machine import load_window
from engine import Engine, EngineConfig, SamplingParams
from engine.chat import ChatTemplate
from engine.spec_decode.config import SpeculativeConfig
from splitserve.default_model import ensure_default_model

CHAT = [
    "What is the capital of France?",
    "Give me three tips for writing clear emails.",
    "Explain what a hash map is in two sentences.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What are the benefits of unit tests?",
    "How do I reverse a list in Python?",
    "Summarise the water cycle.",
]
_CODE = '''def total_price(items, tax):
    result = 0
    for item in items:
        result = result + item["price"] * item["qty"]
    result = result * (1 + tax)
    return result
'''
EDITS = [
    f"Rename the variable `result` to `total` in this function and show the whole function:\n\n{_CODE}",
    f"Add type hints to this function and show the whole function:\n\n{_CODE}",
    f"Add a docstring to this function and show the whole function:\n\n{_CODE}",
    f"Rewrite this function so that the tax is applied per item. Show the code:\n\n{_CODE}",
]


def _engine(model: Path, threads: int, spec: SpeculativeConfig | None = None) -> Engine:
    return Engine(EngineConfig(model=str(model), num_threads=threads, max_model_len=2048,
                               num_kv_blocks=512, speculative=spec))


def _alone(engine: Engine, prompt: list[int], params: SamplingParams) -> dict:
    """One request alone: TTFT, decode seconds (first to last token), tokens."""
    start = time.perf_counter()
    engine.add_request(prompt, params)
    first = last = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first = first if first is not None else now
            last, tokens = now, out.token_ids
    assert first is not None and last is not None
    return {"ttft_s": first - start, "decode_s": last - first, "tokens": tokens}


def in_process(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    alone = [_alone(engine, p, params) for p in prompts]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    batch_s = time.perf_counter() - start
    decoded = sum(len(a["tokens"]) - 1 for a in alone)
    return {
        "batch1_ttft_ms_median": 1000 * sorted(a["ttft_s"] for a in alone)[len(alone) // 2],
        "batch1_decode_tok_s": decoded / sum(a["decode_s"] for a in alone),
        f"batch{len(prompts)}_output_tok_s": sum(len(o.token_ids) for o in outs) / batch_s,
        "outputs": [o.token_ids for o in outs],
    }


async def _stream(stub: object, question: str, max_tokens: int) -> dict:
    from splitserve.client import make_chat_request

    start = time.perf_counter()
    stamps, tokens, timings = [], [], None
    request = make_chat_request([("user", question)], max_tokens)
    async for chunk in stub.Generate(request, timeout=600):  # type: ignore[attr-defined]
        if chunk.token_ids:
            stamps.append(time.perf_counter())
            tokens += list(chunk.token_ids)
        if chunk.finish_reason:
            timings = chunk.timings
    assert timings is not None
    return {"tokens": tokens, "ttft_s": stamps[0] - start, "decode_s": stamps[-1] - stamps[0],
            "gateway_ttft_ms": timings.first_token_us / 1000, "transfer_bytes": timings.transfer_bytes}


async def _deployment_load(address: str, prompts: list[str], max_tokens: int) -> dict:
    import grpc

    from splitserve_api.v1 import gateway_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await _stream(stub, prompts[0], 4)  # warm-up: channel, KV channel handshake
        alone = [await _stream(stub, p, max_tokens) for p in prompts]
        start = time.perf_counter()
        together = await asyncio.gather(*[_stream(stub, p, max_tokens) for p in prompts])
        batch_s = time.perf_counter() - start
    decoded = sum(len(a["tokens"]) - 1 for a in alone)
    return {
        "batch1_ttft_ms_median": 1000 * sorted(a["ttft_s"] for a in alone)[len(alone) // 2],
        "batch1_gateway_ttft_ms_median": sorted(a["gateway_ttft_ms"] for a in alone)[len(alone) // 2],
        "batch1_decode_tok_s": decoded / sum(a["decode_s"] for a in alone),
        f"batch{len(prompts)}_output_tok_s": sum(len(t["tokens"]) for t in together) / batch_s,
        "kv_bytes_per_request": sum(a["transfer_bytes"] for a in alone) / len(alone),
        "outputs": [t["tokens"] for t in together],
    }


def disaggregated(model: Path, prompts: list[str], max_tokens: int) -> dict:
    """Chat requests (the gateway applies the template) through a local split deployment."""
    from splitserve.cluster import Cluster

    with tempfile.TemporaryDirectory() as logs, \
            Cluster(str(model), num_prefill=1, num_decode=1, threads=1, log_dir=logs, log_level="warning",
                    gateway_flags=["--local-prefill-max-tokens", "0", "--max-model-len", "2048"],
                    worker_flags=["--max-model-len", "2048", "--num-kv-blocks", "512"]) as cluster:
        return asyncio.run(_deployment_load(cluster.addresses["gateway"], prompts, max_tokens))


def ngram_batch1(engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams,
                 repeats: int) -> dict:
    """Engines take turns per prompt; each (engine, prompt)'s fastest decode counts; the
    first engine is the baseline of the speed-ups."""
    before = {name: replace(e.spec_stats) for name, e in engines.items()}
    best = {name: [math.inf] * len(prompts) for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [[] for _ in prompts] for name in engines}
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            for name, engine in engines.items():
                run = _alone(engine, prompt, params)
                best[name][i] = min(best[name][i], run["decode_s"])
                outputs[name][i] = run["tokens"]
    base = next(iter(engines))
    if any(outputs[name] != outputs[base] for name in engines):
        raise RuntimeError("speculation changed greedy output")
    decoded = sum(len(t) - 1 for t in outputs[base])
    result: dict = {"decode_tokens": decoded}
    for name, engine in engines.items():
        stats = engine.spec_stats
        drafts = stats.num_draft_tokens - before[name].num_draft_tokens
        accepted = stats.num_accepted_tokens - before[name].num_accepted_tokens
        steps = stats.num_drafts - before[name].num_drafts
        result[name] = {"decode_tok_s": decoded / sum(best[name]),
                        "acceptance_rate": accepted / drafts if drafts else None,
                        "tokens_per_verify_step": 1 + accepted / steps if steps else None}
        result[name]["speedup"] = result[name]["decode_tok_s"] / result[base]["decode_tok_s"]
    return result


def draft_floor(engine: Engine, prompt: list[int], repeats: int = 50) -> dict:
    """Mean batch-1 decode step vs the [vocab x hidden] logits matmul alone."""
    run = _alone(engine, prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    step_ms = 1000 * run["decode_s"] / (len(run["tokens"]) - 1)
    lm_head = engine.runner.model.lm_head
    embed = engine.runner.model.embed  # [vocab, hidden]
    hidden = torch.randn(1, embed.shape[1], dtype=embed.dtype)
    start = time.perf_counter()
    for _ in range(repeats):
        lm_head(hidden)
    head_ms = 1000 * (time.perf_counter() - start) / repeats
    return {"decode_step_ms": step_ms, "lm_head_ms": head_ms, "lm_head_share": head_ms / step_ms}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the in-process engines")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="n-gram draft tokens per step")
    parser.add_argument("--skip-disaggregated", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/default_model.json"))
    args = parser.parse_args(argv)
    model = ensure_default_model()
    with load_window() as load:
        report = run(model, args)
    report["load_average_1m"] = load
    report_mod.write_json(report, args.out)
    summary = {k: ({kk: vv for kk, vv in v.items() if kk != "outputs"} if isinstance(v, dict) else v)
               for k, v in report.items()}
    print(json.dumps(summary, indent=1))


def run(model: Path, args: argparse.Namespace) -> dict:
    """Every measurement of the module docstring, in order; the report."""
    plain = _engine(model, args.threads)
    chat = ChatTemplate.of(plain.tokenizer)
    assert chat is not None
    chats = [chat.render([("user", q)]) for q in CHAT]
    edits = [chat.render([("user", q)]) for q in EDITS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=chat.end_of_turn_ids)
    report: dict = {**report_mod.header("default_model", args.threads), "model": model.name,
                    "threads": args.threads, "max_tokens": args.max_tokens}
    sys.stderr.write("[default model bench] in-process\n")
    report["in_process"] = in_process(plain, chats, params)
    if not args.skip_disaggregated:
        sys.stderr.write("[default model bench] disaggregated\n")
        report["disaggregated"] = disaggregated(model, CHAT, args.max_tokens)
        report["disaggregated"]["greedy_match"] = report["disaggregated"]["outputs"] == report["in_process"]["outputs"]
    engines = {"none": plain}
    for ngram_min in (1, 3):  # 1: any recurring token drafts; 3: only a 3-token match does
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k, ngram_min=ngram_min)
        engines[f"ngram_min{ngram_min}"] = _engine(model, args.threads, spec)
    for name, prompts in (("chat", chats), ("code_edit", edits)):
        sys.stderr.write(f"[default model bench] n-gram, {name} prompts\n")
        report[f"ngram_{name}"] = ngram_batch1(engines, prompts, params, args.repeats)
    report["draft_floor"] = draft_floor(plain, chats[0])
    return report


if __name__ == "__main__":
    main()
