"""A request migrated mid-stream (the gateway's continuation after a decode worker died):
prompt + the tokens already sent, ``max_tokens`` and ``min_tokens`` counted down, and
``num_prior_draws`` = the tokens already sent. In-process and across a split, the
continuation equals the rest of the undisturbed run, seeded sampling included."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from engine import SamplingParams
from tests.conftest import mixed_prompts
from tests.engine.test_engine_disagg import assert_clean, drain, run_split
from tests.engine.test_engine_parity import make_engine

PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=21, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=22, max_tokens=20, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.3, seed=23, max_tokens=20, min_tokens=9),
    SamplingParams(temperature=0.9, seed=24, max_tokens=20, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=20, ignore_eos=True),  # greedy
]
CUTS = (1, 7, 13)


def continuation(params: SamplingParams, num_sent: int) -> SamplingParams:
    """What the gateway forwards after ``num_sent`` tokens: the budgets counted down."""
    return replace(params, max_tokens=params.max_tokens - num_sent, min_tokens=max(0, params.min_tokens - num_sent))


def test_continuation_equals_the_rest_of_the_run(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompts = mixed_prompts(len(PARAMS), 512, seed=61, min_len=5, max_len=90)
    full = make_engine(path).generate(prompts, PARAMS)
    for cut in CUTS:
        engine = make_engine(path)
        cont = [continuation(p, cut) for p in PARAMS]
        for i, (prompt, params) in enumerate(zip(prompts, cont)):
            engine.add_request(prompt + full[i].token_ids[:cut], params, f"m{i}", num_prior_draws=cut)
        outs = drain(engine)
        for i, want in enumerate(full):
            got = outs[f"m{i}"]
            assert got.token_ids == want.token_ids[cut:], (cut, i)
            if PARAMS[i].logprobs is not None:
                assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(got.logprobs, want.logprobs[cut:]))
        assert_clean(engine)


def test_split_continuation_equals_the_rest_of_the_run(ckpt_dir: Callable[..., Path]) -> None:
    """The continuation prefilled on one engine, its pages admitted on another."""
    path = ckpt_dir("llama")
    prompts = mixed_prompts(len(PARAMS), 512, seed=62, min_len=5, max_len=90)
    full = make_engine(path).generate(prompts, PARAMS)
    cut = 7
    cont = [continuation(p, cut) for p in PARAMS]
    a, b = make_engine(path), make_engine(path, max_num_batched_tokens=64)
    outs = run_split(a, b, [p + f.token_ids[:cut] for p, f in zip(prompts, full)], cont,
                     num_prior_draws=cut)
    assert [o.token_ids for o in outs] == [f.token_ids[cut:] for f in full]
    assert_clean(a, b)


def test_without_skipping_the_draws_seeded_continuations_differ(ckpt_dir: Callable[..., Path]) -> None:
    """The test above has power: a continuation that does not skip the sent tokens' draws
    starts the random stream over."""
    path = ckpt_dir("llama")
    prompts = mixed_prompts(4, 512, seed=63, min_len=5, max_len=90)
    full = make_engine(path).generate(prompts, PARAMS[:4])
    engine = make_engine(path)
    for i, (prompt, params) in enumerate(zip(prompts, PARAMS[:4])):
        engine.add_request(prompt + full[i].token_ids[:7], continuation(params, 7), f"m{i}")
    outs = drain(engine)
    assert [outs[f"m{i}"].token_ids for i in range(4)] != [f.token_ids[7:] for f in full]


@pytest.mark.parametrize("bad", [-1, 5, 1.5, True])
def test_num_prior_draws_out_of_range(bad: object, ckpt_dir: Callable[..., Path]) -> None:
    engine = make_engine(ckpt_dir("llama"))
    with pytest.raises(ValueError, match="num_prior_draws"):
        engine.add_request([1, 2, 3, 4, 5], SamplingParams(seed=1), "x", num_prior_draws=bad)  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()
    assert_clean(engine)
