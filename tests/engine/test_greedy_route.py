"""The runner's argmax route (``ModelRunner.execute``: plain greedy rows, the tokens alone, through
the bfloat16 screen where the CPU has one) against the logits route and the sampler."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.model_runner import _takes_the_argmax
from engine.request import Request


def test_plain_greedy_tokens_equal_the_sampler_s(ckpt_dir: Callable[..., Path]) -> None:
    # logprobs=0 sends the same request down the logits route (the sampler's argmax) while the
    # plain one takes the argmax route: the same tokens, step for step, in one batch and alone.
    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=256, block_size=16))
    calls = []
    greedy = engine.runner.model.greedy
    engine.runner.model.greedy = lambda *a: calls.append(1) or greedy(*a)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 17, 40, 9)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    logits = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    by_argmax = [o.token_ids for o in engine.generate(prompts, plain)]
    assert calls, "plain greedy rows take the argmax route"
    num_calls = len(calls)
    by_sampler = [o.token_ids for o in engine.generate(prompts, logits)]
    assert len(calls) == num_calls, "a request that wants logprobs takes the logits route"
    assert by_argmax == by_sampler
    assert [engine.generate([p], plain)[0].token_ids for p in prompts] == by_argmax


def test_what_takes_the_argmax() -> None:
    def request(**params: object) -> Request:
        return Request("r", [1, 2, 3], SamplingParams(**params), eos_token_ids=(2,))

    assert _takes_the_argmax(request(temperature=0.0))
    assert not _takes_the_argmax(request(temperature=0.7))
    assert not _takes_the_argmax(request(temperature=0.0, repetition_penalty=1.2))
    assert not _takes_the_argmax(request(temperature=0.0, logprobs=0))
    assert not _takes_the_argmax(request(temperature=0.0, min_tokens=2))  # EOS held back
    assert _takes_the_argmax(request(temperature=0.0, min_tokens=2, ignore_eos=True))
    assert not _takes_the_argmax(request(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=(7,)))
