"""Quantization on the default model (SmolLM2-135M-Instruct, float32 compute), side by side
with float32 in one run, once per native kernel variant (not a test).

    python -m bench.quant [--threads 1] [--rounds 3] [--ppl-tokens 2048] [--isa auto,avx2] \
        [--out bench/results/quant.json]

Engines: ``fp32`` (float32 on the file's Q8_0 / Q4_1 tensors as they are stored, the
default: engine/models/linear.py); ``fp32-dense`` (the same float32 numbers dequantized at
load, 4 bytes a weight, as a float checkpoint's weights are: the same bits, so its ratios
show what reading the blocks saves); ``int8`` and ``int4-g32`` / ``int4-g64`` weights (``--quantization``,
``--quant-group-size``); ``kv-int8`` (``--kv-cache-dtype int8``, float32 weights). On CPU
int8 is Q8_0 and int4-g32 is Q4_1, the default model's own Q4_1 tensors kept as the file
stores them (engine/quant/linear.py).

* per ``--isa`` value, a child process with ``SPLITSERVE_CPU_ISA`` set to it (the native
  library is chosen once per process): ``auto`` is the machine's best variant;
* quality (bench/quant_quality.py): perplexity on held-out text as a ratio to fp32, and
  greedy agreement with fp32 over 128 tokens on four chat prompts;
* speed: batch-1 decode ms/token and tok/s (one chat prompt, 64 tokens) and batch-64 output
  tokens/s (64 random-token prompts of 48-80 tokens, 32 tokens each, ``generate`` timed
  whole, prefill included: each round draws new prompts, which every engine gets, so no
  engine's prefix cache holds them). The engines take turns round by round, the fastest
  round counts, the load average is recorded around each;
* bytes: weights resident in the model (every tensor once), KV bytes per token, bytes one
  hand-off ships for a 256-token prompt (``pack_kv``'s buffer, scales included), and the
  most sequences of 2048 tokens a 512 MiB KV pool holds;
* load: seconds to build each engine (weights read, converted, packed).

Goals (issue #15; batch-1 and KV speed from issue #25): perplexity ratio int8 <= 1.01, int4
<= 1.10, KV int8 <= 1.01; batch-1 tok/s int8 >= 2.0x and int4 >= 2.5x fp32's; batch-64
tokens/s >= 0.9x fp32 for quantized weights, >= 1.0x for the int8 KV cache; hand-off bytes
with int8 KV <= 0.55x fp32.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import report as report_mod
from bench.machine import load_window
from bench.quant_quality import AGREEMENT_QUESTIONS, agreement, greedy_outputs, heldout_token_ids, perplexity
from engine import Engine, EngineConfig, SamplingParams
from engine.chat import ChatTemplate
from splitserve.default_model import ensure_default_model

CONFIGS: dict[str, dict] = {
    "fp32": {},
    "fp32-dense": {"keep_gguf_blocks": False},
    "int8": {"quantization": "int8"},
    "int4-g32": {"quantization": "int4", "quant_group_size": 32},
    "int4-g64": {"quantization": "int4", "quant_group_size": 64},
    "kv-int8": {"kv_cache_dtype": "int8"},
}
BATCH64_CONFIGS = ("fp32", "fp32-dense", "int8", "int4-g32", "kv-int8")
KV_BUDGET_BYTES = 512 * 1024 * 1024
SEQ_TOKENS = 2048
GOALS = [  # (figure, comparison, bound)
    ("ppl_ratio.int8", "<=", 1.01), ("ppl_ratio.int4-g32", "<=", 1.10), ("ppl_ratio.kv-int8", "<=", 1.01),
    ("batch1_tok_s_ratio.int8", ">=", 2.0), ("batch1_tok_s_ratio.int4-g32", ">=", 2.5),
    ("batch64_tok_s_ratio.int8", ">=", 0.9), ("batch64_tok_s_ratio.int4-g32", ">=", 0.9),
    ("batch64_tok_s_ratio.kv-int8", ">=", 1.0),
    ("handoff_bytes_ratio.kv-int8", "<=", 0.55),
]


def _engine(model: Path, threads: int, **kw: object) -> Engine:
    return Engine(EngineConfig(model=str(model), num_threads=threads, max_model_len=2048,
                               num_kv_blocks=512, max_num_seqs=64, **kw))  # type: ignore[arg-type]


def weight_bytes(engine: Engine) -> int:
    """Bytes of every tensor the model holds (each storage once; linears report their own)."""
    model, seen, total = engine.runner.model, set(), 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for t in (model.embed, model.final_norm):
        add(t)
    for layer in model.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                add(value)
            elif value is not None:  # a linear: its own tensors
                for t in vars(value).values():
                    if isinstance(t, torch.Tensor):
                        add(t)
    for t in vars(model.lm_head).values():
        if isinstance(t, torch.Tensor):
            add(t)
    return total


def _decode_ms_per_token(engine: Engine, prompt: list[int], num_tokens: int) -> float:
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    return 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def _batch_tok_s(engine: Engine, prompts: list[list[int]], num_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def speed(engines: dict[str, Engine], chat_prompt: list[int], rounds: int) -> dict:
    """Engines take turns each round; the best round counts (module docstring)."""
    rng = random.Random(0)
    vocab = engines["fp32"].spec.vocab_size
    ms: dict[str, list[float]] = {name: [] for name in engines}
    tok_s: dict[str, list[float]] = {name: [] for name in BATCH64_CONFIGS if name in engines}
    loads = []
    for r in range(rounds):
        # New prompts each round: the same ones again would hit each engine's prefix cache
        # and leave the prefill out (measured: fp32 131.7 then 272.6 tok/s on a repeat).
        batch = [[rng.randrange(3, vocab) for _ in range(rng.randrange(48, 81))] for _ in range(64)]
        with load_window() as load:
            for name, engine in engines.items():
                ms[name].append(_decode_ms_per_token(engine, chat_prompt, 64))
            for name in tok_s:
                tok_s[name].append(_batch_tok_s(engines[name], batch, 32))
        loads.append(load)
        sys.stderr.write(f"[quant bench] speed round {r + 1}/{rounds}: load {load}\n")
    best_ms = {k: min(v) for k, v in ms.items()}
    best_tok_s = {k: max(v) for k, v in tok_s.items()}
    return {"batch1_ms_per_token": best_ms, "batch1_ms_per_token_rounds": ms,
            "batch1_tok_s_ratio": {k: best_ms["fp32"] / v for k, v in best_ms.items()},
            "batch64_output_tok_s": best_tok_s, "batch64_output_tok_s_rounds": tok_s,
            "batch1_ms_ratio": {k: v / best_ms["fp32"] for k, v in best_ms.items()},
            "batch64_tok_s_ratio": {k: v / best_tok_s["fp32"] for k, v in best_tok_s.items()},
            **({"batch1_tok_s_ratio_to_dense": {k: best_ms["fp32-dense"] / v for k, v in best_ms.items()},
                "batch64_tok_s_ratio_to_dense": {k: v / best_tok_s["fp32-dense"] for k, v in best_tok_s.items()}}
               if "fp32-dense" in best_ms else {}),
            "load_average_1m_per_round": loads}


def kv_bytes(engines: dict[str, Engine], model: Path) -> dict:
    handoff, per_token, max_seqs = {}, {}, {}
    for name in (n for n in ("fp32", "kv-int8") if n in engines):  # what --configs ran
        engine = engines[name]
        layout = engine.kv_layout
        per_token[name] = layout.bytes_per_block // layout.block_size
        packed = engine.handoff.pack_kv(list(range(256 // layout.block_size)))  # a 256-token prompt's pages
        handoff[name] = packed.numel() * packed.element_size()
        cfg = EngineConfig(model=str(model), kv_cache_bytes=KV_BUDGET_BYTES, **CONFIGS[name])
        spec = engine.spec
        num_blocks = cfg.resolve_num_kv_blocks(spec.num_layers, spec.num_kv_heads, spec.head_dim)
        max_seqs[name] = num_blocks // (SEQ_TOKENS // layout.block_size)
    return {"kv_bytes_per_token": per_token, "handoff_bytes_256_tokens": handoff,
            "handoff_bytes_ratio": {k: v / handoff["fp32"] for k, v in handoff.items()},
            f"max_seqs_{SEQ_TOKENS}_tokens_in_512MiB": max_seqs}


def quality(build: Callable[[str], Engine], names: list[str], ppl_tokens: int, window: int) -> dict:
    """Engine by engine (``build(name)``; one alive at a time: the machine's memory is shared)."""
    ppl, greedy, text, prompts = {}, {}, None, None
    for name in names:
        engine = build(name)
        if text is None:
            chat = ChatTemplate.of(engine.tokenizer)
            assert chat is not None
            text = heldout_token_ids(engine, ppl_tokens)
            prompts = [chat.render([("user", q)]) for q in AGREEMENT_QUESTIONS]
        ppl[name] = perplexity(engine, text, window)
        greedy[name] = greedy_outputs(engine, prompts, 128)
        del engine
        gc.collect()
    return {"heldout_tokens": len(text or []), "window": window, "perplexity": ppl,
            "ppl_ratio": {k: v / ppl["fp32"] for k, v in ppl.items()},
            "greedy_agreement_128": {k: agreement(greedy["fp32"], v) for k, v in greedy.items() if k != "fp32"}}


def goals(report: dict) -> list[dict]:
    out = []
    for figure, op, bound in GOALS:
        group, name = figure.split(".", 1)
        section = next((s for s in ("quality", "speed", "bytes") if group in report.get(s, {})), None)
        if section is None or name not in report[section][group]:  # quality or this config not run
            continue
        value = report[section][group][name]
        met = value <= bound if op == "<=" else value >= bound
        out.append({"figure": figure, "value": round(value, 4), "goal": f"{op} {bound}", "met": met})
    return out


def run(model: Path, args: argparse.Namespace) -> dict:
    from splitserve_kernels.native import native_kernels

    names = args.configs.split(",")
    report: dict = {**report_mod.header("quant", args.threads), "model": model.name, "threads": args.threads,
                    "native_variant": native_kernels().variant}
    if not args.skip_quality:
        sys.stderr.write("[quant bench] quality\n")
        with load_window() as load:
            report["quality"] = quality(lambda name: _engine(model, args.threads, **CONFIGS[name]), names,
                                        args.ppl_tokens, args.window)
        report["quality"]["load_average_1m"] = load
    engines, load_s = {}, {}
    for name in names:
        start = time.perf_counter()
        engines[name] = _engine(model, args.threads, **CONFIGS[name])
        load_s[name] = time.perf_counter() - start
    chat = ChatTemplate.of(engines["fp32"].tokenizer)
    assert chat is not None
    report["engine_load_s"] = load_s
    report["weight_bytes"] = {name: weight_bytes(e) for name, e in engines.items()}
    report["bytes"] = kv_bytes(engines, model)
    sys.stderr.write("[quant bench] speed\n")
    report["speed"] = speed(engines, chat.render([("user", AGREEMENT_QUESTIONS[0])]), args.rounds)
    report["goals"] = goals(report)
    return report


def run_isa(isa: str, argv: list[str], quality: bool) -> dict:
    """One child process with ``SPLITSERVE_CPU_ISA=isa``; its report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "quant.json"
        cmd = [sys.executable, "-m", "bench.quant", *argv, "--isa", isa, "--out", str(out), "--child"]
        if not quality:
            cmd.append("--skip-quality")
        subprocess.run(cmd, check=True, env={**os.environ, "SPLITSERVE_CPU_ISA": isa}, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def summarize(report: dict) -> dict:
    summary = {k: report[k] for k in ("native_variant", "engine_load_s", "weight_bytes", "goals")}
    if "quality" in report:
        summary["quality"] = {k: v for k, v in report["quality"].items() if k != "greedy_agreement_128"}
        summary["agreement"] = {k: v["identical_prefix_share"]
                                for k, v in report["quality"]["greedy_agreement_128"].items()}
    summary["speed"] = {k: v for k, v in report["speed"].items() if not k.endswith("_rounds")}
    summary["bytes"] = report["bytes"]
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every engine")
    parser.add_argument("--rounds", type=int, default=3, help="speed rounds (engines alternate)")
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="held-out tokens scored")
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--isa", default="auto,avx2",
                        help="native kernel variants (SPLITSERVE_CPU_ISA), one child process each")
    parser.add_argument("--quality-isa", default="auto", help="the variants whose run also scores quality")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="engines to run (fp32 always among them; fewer need less memory)")
    parser.add_argument("--skip-quality", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("bench/results/quant.json"))
    args = parser.parse_args(argv)
    model = ensure_default_model()
    if args.child:
        with load_window() as load:
            report = run(model, args)
        report["load_average_1m"] = load
        report_mod.write_json(report, args.out)
        return
    common = ["--threads", str(args.threads), "--rounds", str(args.rounds), "--ppl-tokens", str(args.ppl_tokens),
              "--window", str(args.window), "--configs", args.configs]
    with load_window() as load:
        by_isa = {isa: run_isa(isa, common, isa in args.quality_isa.split(",")) for isa in args.isa.split(",")}
    report = {**report_mod.header("quant", args.threads), "model": model.name, "isa": by_isa, "load_average_1m": load}
    report_mod.write_json(report, args.out)
    print(json.dumps({isa: summarize(r) for isa, r in by_isa.items()} | {"load_average_1m": load}, indent=1))


if __name__ == "__main__":
    main()
