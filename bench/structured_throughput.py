"""What constrained decoding costs the engine: throughput with half the requests constrained
against the same load unconstrained, the per-step mask cost, and compile time.

    python -m bench.structured_throughput [--model PATH] [--rounds 3] [--max-tokens 64]
        [--out bench/results/structured_throughput.json]

In-process ``Engine`` on the default model (SmolLM2-135M-Instruct), greedy, EOS ignored:

* batch 1: 4 requests one after another; batch 32: 32 requests at once. In the "mixed" way
  every other request carries a JSON schema (an object holding an array of at least 60 short
  strings: it cannot end before ``--max-tokens``, so both ways keep the batch equally full); "free" is the same prompts without constraints.
  Alternating rounds (``bench/ab.py``), output tokens/s, ratio mixed / free (goals: >= 0.85
  at batch 1, >= 0.9 at batch 32).
* mask: the engine's own counters (``GrammarStats``): mask seconds / masked rows during the
  mixed rounds, in microseconds per constrained row per step.
* compile: the 2 KB schema of ``benchmarks/grammar_engines.py`` on a fresh ``GrammarCompiler``:
  the llguidance tokenizer's preparation (once per process), the first compile (cold), the
  same schema again (warm: a cache hit), and a second schema (cold, tokenizer ready).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.ab import alternate, summary
from bench.report import write_json


def schema_and_reply(num_fields: int = 7) -> tuple[str, dict]:
    """A ~2 KB schema and a reply that satisfies it (properties in schema order)."""
    item = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "count": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["name", "kind"]}
    names = [f"field_{i}" for i in range(num_fields)]
    schema = {"type": "object", "properties": {n: item for n in names}, "required": names}
    reply = {n: {"name": "abc", "count": 3, "kind": "beta", "tags": ["x"]} for n in names}
    return json.dumps(schema), reply


LIST_SCHEMA = json.dumps({"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 60}}, "required": ["items"]})
PROMPTS = ["List some words as JSON:", "Here are animal names:", "Colours, in JSON:", "Write fruit names:"]


def _params(constrained: bool, max_tokens: int) -> Any:
    from engine import SamplingParams
    from engine.constraints import Constraint, ConstraintKind

    constraint = Constraint(ConstraintKind.JSON_SCHEMA, LIST_SCHEMA) if constrained else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, constraint=constraint)


def burst(engine: Any, batch: int, mixed: bool, max_tokens: int, num_sequential: int = 4) -> dict:
    """Serve the workload once: ``batch`` requests at a time (batch 1: ``num_sequential`` one
    after another); every other request constrained when ``mixed``."""
    num = batch if batch > 1 else num_sequential
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num)]
    params = [_params(mixed and i % 2 == 0, max_tokens) for i in range(num)]
    start = time.perf_counter()
    outputs = []
    for first in range(0, num, batch):
        outputs += engine.generate(prompts[first:first + batch], params[first:first + batch])
    seconds = time.perf_counter() - start
    # No streaming here: "ttft_s" (bench/ab.py's summary wants one) is the burst's time.
    return {"seconds": seconds, "ttft_s": [seconds], "output_tokens": sum(len(o.token_ids) for o in outputs),
            "errors": [o.finish_reason for o in outputs if o.finish_reason not in ("stop", "length")]}


def throughput(engine: Any, batch: int, rounds: int, max_tokens: int) -> dict:
    stats = engine.grammars.stats
    rows_before, seconds_before = stats.num_mask_rows, stats.mask_seconds
    runs = alternate({"free": lambda: burst(engine, batch, False, max_tokens),
                      "mixed": lambda: burst(engine, batch, True, max_tokens)}, rounds)
    results = {name: summary(r) for name, r in runs.items()}
    paired = [m / f for m, f in zip(results["mixed"]["output_tokens_per_s_rounds"],
                                    results["free"]["output_tokens_per_s_rounds"])]
    results["mixed/free"] = {
        "output_tokens_per_s": results["mixed"]["output_tokens_per_s"] / results["free"]["output_tokens_per_s"],
        "same_round_median": statistics.median(paired)}
    rows = stats.num_mask_rows - rows_before
    results["mask_us_per_row"] = (stats.mask_seconds - seconds_before) / rows * 1e6 if rows else None
    return results


def compile_times(tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> dict:
    from engine.constraints import Constraint, ConstraintKind
    from engine.grammar import GrammarCompiler

    schema, _ = schema_and_reply()
    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    times = {}
    start = time.perf_counter()
    compiler._tokenizer()  # noqa: SLF001 - timed on its own: once per process
    times["tokenizer_prep_ms"] = (time.perf_counter() - start) * 1e3
    for name, text in [("cold_ms", schema), ("warm_ms", schema), ("second_schema_cold_ms", schema.replace("field_", "f_"))]:
        start = time.perf_counter()
        compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, text))
        times[name] = (time.perf_counter() - start) * 1e3
    return {"schema_bytes": len(schema), **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="bench/results/structured_throughput.json")
    args = parser.parse_args()
    from engine import Engine, EngineConfig
    from splitserve.default_model import ensure_default_model

    engine = Engine(EngineConfig(model=args.model or str(ensure_default_model(quiet=True))))
    report: dict[str, Any] = {"compile": compile_times(engine.tokenizer, engine.spec.vocab_size, engine.eos_token_ids)}
    engine.generate(PROMPTS[0], _params(True, 4))  # warm: tokenizer, compile cache, first steps
    for batch in (1, 32):
        report[f"batch_{batch}"] = throughput(engine, batch, args.rounds, args.max_tokens)
    sys.stdout.write(write_json(report, Path(args.out)).read_text())


if __name__ == "__main__":
    main()
