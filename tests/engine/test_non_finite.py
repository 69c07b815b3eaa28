"""Logits that are not finite end their request with an error, never with a token: the argmax
of a NaN row is a valid-looking id. The other requests of the step, and the requests that later
reuse the failed one's pages, are untouched.

The fault is injected by poisoning one token's embedding row with NaN: a prompt holding that
token gets NaN hidden states (and NaN K/V in its pages) from its position on, while attention
keeps every other sequence apart from it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.block_hash import prompt_block_hashes
from engine.request import Request
from engine.spec_decode.proposers import _set_drafts
from splitserve_kernels.kv_int8 import kv_scales

POISON = 7  # the token id whose embedding becomes NaN


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [[t if t != POISON else POISON + 1 for t in torch.randint(10, 200, (n,), generator=gen).tolist()]
            for n in (21, 40, 9)]


def _engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=16))


def _poison(engine: Engine, token: int = POISON) -> None:
    model = engine.runner.model
    model.embed = model.embed.clone()  # its own copy: a head tied to it stays clean
    model.embed[token] = float("nan")


PARAMS = {
    "argmax": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
    "sampled": SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True),
}


@pytest.mark.parametrize(("route", "kv_cache_dtype"), [(r, "auto") for r in sorted(PARAMS)] + [("argmax", "int8")])
def test_a_non_finite_row_fails_its_request_alone(ckpt_dir: Callable[..., Path], route: str,
                                                  kv_cache_dtype: str) -> None:
    params = PARAMS[route]
    prompts = _prompts()
    clean = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=64, block_size=16,
                                kv_cache_dtype=kv_cache_dtype))
    expected = [o.token_ids for o in clean.generate(prompts, params)]

    # 7 blocks: each generate below needs all of them (no prefix caching), so the second one
    # runs in the failed request's pages.
    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=7, block_size=16,
                                 enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype))
    _poison(engine)
    bad = prompts[0][:10] + [POISON] + prompts[0][10:]
    outs = engine.generate([prompts[1], bad, prompts[2]], params)
    assert outs[1].finished and outs[1].finish_reason == "error"
    assert outs[1].token_ids == [] and "not all finite" in (outs[1].error or "")
    assert [outs[0].token_ids, outs[2].token_ids] == expected[1:]
    assert outs[0].finish_reason == outs[2].finish_reason == "length" and outs[0].error is None
    engine.check_integrity()
    assert engine.num_free_blocks == engine.kv.pool.num_blocks
    cache = engine.runner.kv_cache
    assert bool((kv_scales(cache) if cache.dtype == torch.int8 else cache).isnan().any())

    # The failed prompt's pages went back to the pool holding NaNs: whoever gets them next
    # reads only what it wrote.
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    engine.check_integrity()


def test_a_failed_request_withdraws_its_published_blocks(ckpt_dir: Callable[..., Path]) -> None:
    # Prefill in 16-token chunks publishes each full block as it is computed: the third holds
    # the poisoned position's NaN K/V. When the last prompt token's logits come out NaN, none
    # of the three may stay in the prefix cache for a later prompt to reuse.
    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=64, block_size=16,
                                 max_num_batched_tokens=16))
    _poison(engine)
    bad = list(range(20, 60)) + [POISON] + list(range(60, 68))  # 49 tokens, the poison at 40
    hashes = prompt_block_hashes(bad, 16)
    rid = engine.add_request(bad, PARAMS["argmax"])
    published = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        published.append(sum(h in engine.kv.pool.cached for h in hashes))
    assert published == [1, 2, 3, 0]
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "error")]
    engine.check_integrity()


def test_a_failure_in_a_prefill_fails_the_held_request(ckpt_dir: Callable[..., Path]) -> None:
    # A prefill worker's request (hold_kv) that fails holds nothing: no pages to ship.
    engine = _engine(ckpt_dir("llama"))
    _poison(engine)
    rid = engine.add_request([30, 31, POISON, 33], PARAMS["argmax"], hold_kv=True)
    outs = [o for _ in range(4) for o in engine.step() if o.request_id == rid]
    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in outs] == [(True, "error", [])]
    with pytest.raises(ValueError):
        engine.handoff.held_block_ids(rid)
    assert engine.num_free_blocks == engine.kv.pool.num_blocks


def test_drafts_stop_before_a_distribution_that_is_not_finite() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0.7))
    probs = torch.full((4, 10), 0.1)
    probs[2, 3] = float("nan")
    _set_drafts(request, [5, 6, 7, 8], probs)
    assert request.spec_token_ids == [5, 6] and request.draft_probs is not None
    assert torch.equal(request.draft_probs, probs[:2])
    probs[0, 0] = float("inf")
    _set_drafts(request, [5, 6, 7, 8], probs)
    assert request.spec_token_ids == [] and request.draft_probs is None
    _set_drafts(request, [5, 6], None)  # argmax drafts: the target's argmax decides
    assert request.spec_token_ids == [5, 6] and request.draft_probs is None


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_a_failure_mid_generation_keeps_the_tokens_before_it(ckpt_dir: Callable[..., Path],
                                                              speculative: str | None) -> None:
    # Poison a token the request generates: the step that feeds it back gets NaN logits (as a
    # decode, or inside a verification when n-gram drafts hold it). The tokens given before
    # stay as they were; the request ends with an error, never with a token after the fault.
    from engine.spec_decode.config import SpeculativeConfig
    from tests.engine.test_spec_decode import repetitive_prompts

    spec = None if speculative is None else SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    path = ckpt_dir("llama")
    clean = Engine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=16, speculative=spec))
    for prompt in repetitive_prompts(6, seed=4):
        want = clean.generate([prompt], params)[0].token_ids
        fresh = [i for i in range(2, len(want)) if want[i] not in prompt and want[i] not in want[:i]]
        if fresh:
            break
    else:
        pytest.fail("no generated token that is new to its request")
    i = fresh[0]
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=16, speculative=spec))
    _poison(engine, want[i])
    (out,) = engine.generate([prompt], params)
    assert out.finish_reason == "error" and "not all finite" in (out.error or "")
    assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) <= i + 1
    if speculative is None:
        assert out.token_ids == want[: i + 1]  # the poisoned token itself came from finite logits
    engine.check_integrity()
    assert engine.num_free_blocks == 64
