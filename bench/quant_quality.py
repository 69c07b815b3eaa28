"""Quality of a quantized engine against the float32 one (``bench.quant``): perplexity on
held-out text and greedy agreement over 128 tokens.

Held-out text: the Python Language Reference as the interpreter ships it
(``pydoc_data.topics``, every topic in sorted order, concatenated), which no prompt of this
project's tests or benchmarks uses. It is cut into windows of ``window`` tokens scored
independently (no context carried across windows): each window is one prefill whose logits
are kept at every position, so the K/V it attends to went through the cache, int8 included.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine import Engine, SamplingParams
from engine.model_runner import SeqSlice, make_forward_batch

# Questions for greedy agreement, used nowhere else.
AGREEMENT_QUESTIONS = [
    "Explain how a hash map handles collisions.",
    "Write a short poem about the sea at night.",
    "What are the main causes of inflation?",
    "Give three tips for writing clear emails.",
]


def heldout_token_ids(engine: Engine, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of the held-out text (module docstring)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(text[: num_tokens * 8])
    if len(ids) < num_tokens:
        raise ValueError(f"the held-out text has only {len(ids)} tokens, {num_tokens} wanted")
    return ids[:num_tokens]


@torch.inference_mode()
def window_nll(engine: Engine, token_ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of ``token_ids[1:]`` given the earlier tokens, one
    prefill in the engine's (idle) KV pool; and how many tokens were scored."""
    runner = engine.runner
    inputs = token_ids[:-1]
    num_blocks = -(-len(inputs) // runner.block_size)
    if num_blocks > runner.num_kv_blocks or engine.has_unfinished_requests():
        raise ValueError("window_nll needs an idle engine whose pool holds one window")
    piece = SeqSlice(inputs, 0, list(range(num_blocks)))
    batch = make_forward_batch([piece], list(range(len(inputs))), runner.block_size, runner.device)
    logits = runner.model.forward(batch, runner.kv_cache)  # [len(inputs), vocab] float32
    targets = torch.tensor(token_ids[1:], device=logits.device)
    return float(F.cross_entropy(logits, targets, reduction="sum")), len(inputs)


def perplexity(engine: Engine, token_ids: list[int], window: int) -> float:
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        nll, n = window_nll(engine, token_ids[start : start + window + 1])
        total, count = total + nll, count + n
    return math.exp(total / count)


def greedy_outputs(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Per prompt, how many leading tokens equal the reference's; and the position-wise
    share of equal tokens."""
    prefixes, equal, total = [], 0, 0
    for ref, got in zip(reference, other, strict=True):
        n = 0
        while n < min(len(ref), len(got)) and ref[n] == got[n]:
            n += 1
        prefixes.append(n)
        equal += sum(a == b for a, b in zip(ref, got))
        total += len(ref)
    return {"identical_prefix_tokens": prefixes, "identical_prefix_share": sum(prefixes) / total,
            "positionwise_share": equal / total, "all_identical": sum(prefixes) == total}
