"""xgrammar against llguidance on the default model's tokenizer: what chose the grammar engine.

    python -m benchmarks.grammar_engines [--model PATH]

For a ~2 KB JSON schema (7 nested objects with strings, integers, enums and arrays): the
one-off tokenizer preparation, compile time cold (first schema), warm (the same schema again)
and of a second schema, the per-step mask time (median and max over a valid reply's tokens)
and whether importing the library imports torch (the gateway compiles schemas to validate
them and must not import torch). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable

from bench.structured_throughput import schema_and_reply

VOCAB_SIZE = 49152


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _mask_times(fill: Callable[[], None], accept: Callable[[int], bool], token_ids: list[int]) -> dict:
    times = []
    for token_id in token_ids:
        times.append(_timed(fill)[1])
        if not accept(token_id):
            raise RuntimeError(f"the reply's token {token_id} was refused")
    times.sort()
    return {"mask_us_median": times[len(times) // 2] * 1e6, "mask_us_max": times[-1] * 1e6,
            "num_steps": len(times)}


def measure_xgrammar(tokenizer: object, schema: str, other: str, token_ids: list[int]) -> dict:
    import xgrammar as xgr

    info, prep_s = _timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    grammar, cold_s = _timed(lambda: compiler.compile_json_schema(schema))
    _, warm_s = _timed(lambda: compiler.compile_json_schema(schema))
    _, other_s = _timed(lambda: compiler.compile_json_schema(other))
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    steps = _mask_times(lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token, token_ids)
    return {"tokenizer_prep_s": prep_s, "compile_cold_ms": cold_s * 1e3, "compile_warm_ms": warm_s * 1e3,
            "compile_second_schema_ms": other_s * 1e3, **steps}


def measure_llguidance(tokenizer: object, schema: str, other: str, token_ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    lltok, prep_s = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE))

    def compile_(text: str) -> object:
        return llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(text))

    matcher, cold_s = _timed(lambda: compile_(schema))
    _, warm_s = _timed(matcher.deep_copy)  # what a cache of compiled matchers costs per request
    _, other_s = _timed(lambda: compile_(other))
    bitmask = lnp.allocate_token_bitmask(1, VOCAB_SIZE)
    steps = _mask_times(lambda: lnp.fill_next_token_bitmask(matcher, bitmask, 0), matcher.consume_token, token_ids)
    return {"tokenizer_prep_s": prep_s, "compile_cold_ms": cold_s * 1e3, "compile_warm_ms": warm_s * 1e3,
            "compile_second_schema_ms": other_s * 1e3, **steps}


def imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or checkpoint (default: the default model)")
    args = parser.parse_args()
    from engine.models.spec import load_tokenizer
    from splitserve.default_model import default_model_path

    tokenizer = load_tokenizer(str(args.model or default_model_path()))
    schema, reply = schema_and_reply()
    other = schema.replace("field_", "entry_")
    token_ids = tokenizer.encode(json.dumps(reply))
    report = {"schema_bytes": len(schema), "load_1min": open("/proc/loadavg").read().split()[0]}
    for name, fn in [("xgrammar", measure_xgrammar), ("llguidance", measure_llguidance)]:
        report[name] = {**fn(tokenizer, schema, other, token_ids), "imports_torch": imports_torch(name)}
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
