"""Quantized engines (weights int8 / int4, KV cache int8) on the small random checkpoints:
bad settings refused at load, logits near the float32 engine's, int8 pages handed from a
prefill engine to a decode engine giving a single engine's tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from engine.model_runner import SeqSlice, make_forward_batch
from tests.conftest import mixed_prompts
from tests.engine.test_engine_disagg import GREEDY, assert_clean, run_split
from tests.engine.test_engine_parity import make_engine


@pytest.mark.parametrize(("kw", "match"), [
    (dict(quantization="int3"), "quantization must be one of"),
    (dict(quantization="int4", quant_group_size=48), "quant_group_size must be one of"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of"),
])
def test_unknown_settings_are_config_errors(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", **kw)  # type: ignore[arg-type]


def test_settings_the_model_cannot_take_fail_at_load(ckpt_dir: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="group size 128 does not divide in_features=64"):
        make_engine(ckpt_dir("llama"), quantization="int4", quant_group_size=128)
    with pytest.raises(ValueError, match="multiple of 16, got 200"):  # gate/up: 2 x 100 rows
        make_engine(ckpt_dir("llama", intermediate_size=100), quantization="int4", quant_group_size=64)
    with pytest.raises(ValueError, match="head_dim to be a multiple of 4"):  # 72 / 4 heads = 18
        make_engine(ckpt_dir("llama", hidden_size=72), kv_cache_dtype="int8")


def _prefill_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """Last-token logits of each prompt, all prefilled in one forward."""
    runner = engine.runner
    slices, rows, block = [], [], 0
    for prompt in prompts:
        num_blocks = -(-len(prompt) // runner.block_size)
        slices.append(SeqSlice(prompt, 0, list(range(block, block + num_blocks))))
        block += num_blocks
        rows.append(sum(len(s.token_ids) for s in slices) - 1)
    batch = make_forward_batch(slices, rows, runner.block_size, runner.device)
    with torch.inference_mode():
        return runner.model.forward(batch, runner.kv_cache)


@pytest.mark.parametrize(("kw", "max_rel_err"), [
    # Random weights (tests/conftest.py INIT_RANGE) quantize worse than trained ones; a broken
    # kernel is off by ~100%. Quality on the real model: bench/quant.py.
    (dict(quantization="int8"), 0.05),
    (dict(quantization="int4", quant_group_size=32), 0.5),
    (dict(kv_cache_dtype="int8"), 0.02),
])
def test_quantized_logits_stay_near_float32(ckpt_dir: Callable[..., Path], kw: dict, max_rel_err: float) -> None:
    path = ckpt_dir("llama")
    prompts = mixed_prompts(4, 512, seed=7, max_len=40)
    want = _prefill_logits(make_engine(path), prompts)
    got = _prefill_logits(make_engine(path, **kw), prompts)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < max_rel_err  # changed by the quantization, and not by much


def test_int8_kv_engine_layout_and_pool() -> None:
    cfg = EngineConfig(model="m", kv_cache_dtype="int8", block_size=16)
    assert cfg.kv_block_bytes(30, 3, 64) * 256 == EngineConfig(model="m").kv_block_bytes(30, 3, 64) * 68


def test_split_int8_kv_matches_single_engine(ckpt_dir: Callable[..., Path]) -> None:
    """Shipped int8 pages carry their scales: the decode engine continues exactly as one
    engine would."""
    path = ckpt_dir("llama")
    prompts = mixed_prompts(8, 512, seed=43, max_len=70) + [list(range(3, 35))]
    expected = [o.token_ids for o in make_engine(path, kv_cache_dtype="int8").generate(prompts, GREEDY)]
    a = make_engine(path, kv_cache_dtype="int8", max_num_batched_tokens=256)
    b = make_engine(path, kv_cache_dtype="int8", max_num_batched_tokens=48)
    assert a.kv_layout.dtype == "int8" and a.runner.kv_cache.shape[-1] == a.spec.head_dim + 4
    outs = run_split(a, b, prompts, GREEDY, local_every=3)
    assert [o.token_ids for o in outs] == expected
    assert_clean(a, b)
