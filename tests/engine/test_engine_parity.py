"""Greedy outputs of our engine are token-identical to transformers ``generate``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from tests.conftest import ARCHS, mixed_prompts
from tests.helpers.outputs import Completions

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_engine(path: Path, **kw: object) -> Engine:
    cfg = dict(model=str(path), dtype="float32", block_size=16, num_kv_blocks=512,
               max_num_seqs=32, max_num_batched_tokens=4096, max_model_len=512)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def run_staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Add one request every other step while the engine runs."""
    ids: list[str] = []
    done = Completions()
    pending = list(prompts)
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            ids.append(engine.add_request(pending.pop(0), params))
        done.feed(engine.step())
        step += 1
    assert all(done[i].finished for i in ids)
    return [done[i].token_ids for i in ids]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_transformers(arch: str, ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir(arch)
    prompts = mixed_prompts(16, 512, seed=ARCHS.index(arch))
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = make_engine(path)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    engine.check_integrity()
    assert engine.num_free_blocks == 512


def test_staggered_arrivals_match(ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir("llama")
    prompts = mixed_prompts(16, 512, seed=7)
    engine = make_engine(path)
    assert run_staggered(engine, prompts, GREEDY) == hf_greedy(path, prompts, NEW_TOKENS)
    engine.check_integrity()


def test_chunked_prefill_matches(ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir("qwen3")
    prompts = mixed_prompts(16, 512, seed=11)
    engine = make_engine(path, max_num_batched_tokens=40)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, NEW_TOKENS)
    # Every long prompt was split: more steps than a one-shot prefill would need.
    assert engine.stats.num_steps > NEW_TOKENS + sum(len(p) for p in prompts) // 40 - 1
    engine.check_integrity()


def test_preemption_matches(ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir("qwen2")
    prompts = mixed_prompts(16, 512, seed=13, max_len=120)
    # 24 blocks x 16 tokens cannot hold 16 sequences of up to 132 tokens at once.
    engine = make_engine(path, num_kv_blocks=24, max_num_batched_tokens=256)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, NEW_TOKENS)
    assert engine.stats.num_preemptions > 0
    engine.check_integrity()
    assert engine.num_free_blocks == 24


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE, max_shard_size="100KB"),
        dict(num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
    ],
    ids=["tied-llama3rope-sharded", "mqa-theta1000"],
)
def test_config_variants_match(overrides: dict, ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir("llama", **overrides)
    if "max_shard_size" in overrides:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    prompts = mixed_prompts(16, 512, seed=21)
    engine = make_engine(path)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, NEW_TOKENS)
    engine.check_integrity()


def test_without_native_kernels_the_references_match(ckpt_dir: Callable[..., Path], hf_greedy: Callable,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # As on an install where kernels/csrc did not build: the cache is contiguous (the
    # references' slot write needs it), every op runs its torch reference, tokens still match,
    # and pages packed there unpack into a native (head-major) engine's cache and back.
    from splitserve_kernels import native

    path = ckpt_dir("llama")
    prompts = mixed_prompts(6, 512, seed=31, max_len=60)
    with monkeypatch.context() as patch:
        patch.setattr(native, "_loaded", native.NativeKernels(None, "simulated"))
        engine = make_engine(path)
        assert engine.runner.kv_cache.is_contiguous()
        outs = engine.generate(prompts, GREEDY)
        fallback_pages = engine.runner.pack_kv([1, 2, 3])
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, NEW_TOKENS)
    if not native.native_kernels().available:
        return
    native_engine = make_engine(path)
    assert not native_engine.runner.kv_cache.is_contiguous()  # head-major storage
    native_engine.runner.unpack_kv([7, 8, 9], fallback_pages)
    assert torch.equal(native_engine.runner.pack_kv([7, 8, 9]), fallback_pages)
