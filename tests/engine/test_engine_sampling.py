"""Sampling through the engine: seeds independent of the batch, logprobs, penalties."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from engine import SamplingParams
from tests.conftest import mixed_prompts
from tests.engine.test_engine_parity import make_engine

SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=4242, max_tokens=16, ignore_eos=True)


def test_seeded_request_same_alone_and_in_batch_of_32(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompt = list(range(10, 70))
    alone = make_engine(path).generate([prompt], SEEDED)[0].token_ids
    others = mixed_prompts(31, 512, seed=5, max_len=120)
    params = [
        SamplingParams(temperature=1.0, max_tokens=16, seed=i) if i % 3 == 0
        else SamplingParams(temperature=1.2, min_p=0.05, max_tokens=16) if i % 3 == 1
        else SamplingParams(temperature=0.0, max_tokens=16)
        for i in range(31)
    ]
    prompts = others[:17] + [prompt] + others[17:]
    params = params[:17] + [SEEDED] + params[17:]
    engine = make_engine(path, max_num_batched_tokens=512)  # chunked: the row moves around
    outs = engine.generate(prompts, params)
    assert outs[17].token_ids == alone
    engine.check_integrity()


def test_different_seeds_differ(ckpt_dir: Callable[..., Path]) -> None:
    engine = make_engine(ckpt_dir("llama"))
    prompt = list(range(10, 40))
    a, b = engine.generate([prompt, prompt], [SEEDED, SamplingParams(**{**SEEDED.__dict__, "seed": 1})])
    assert a.token_ids != b.token_ids


def test_logprobs_match_the_model_distribution(ckpt_dir: Callable[..., Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = ckpt_dir("llama")
    prompt = list(range(10, 50))
    engine = make_engine(path)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, token in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], ref[i, token].item(), abs_tol=1e-4)
        top = ref[i].topk(3)
        assert list(out.top_logprobs[i]) == top.indices.tolist()
        assert list(out.top_logprobs[i])[0] == token  # greedy picks the top-1
    engine.check_integrity()


def test_repetition_penalty_greedy_matches_transformers(ckpt_dir: Callable[..., Path]) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = ckpt_dir("llama")
    prompt = list(range(10, 30)) * 3
    engine = make_engine(path)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True))[0]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=10, repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt):].tolist()
    assert out.token_ids == ref
    engine.check_integrity()


def test_min_tokens_suppresses_eos(ckpt_dir: Callable[..., Path]) -> None:
    engine = make_engine(ckpt_dir("llama"))
    prompt = list(range(10, 30))
    greedy = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    stop = greedy[0]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, stop_token_ids=(stop,)))[0]
    assert stop not in out.token_ids[:3] and len(out.token_ids) >= 3
    engine.check_integrity()
