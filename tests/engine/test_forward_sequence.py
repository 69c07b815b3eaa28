"""The lean single-sequence forward (``LlamaModel.forward_sequence``) against the batched one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from engine.model_runner import SeqSlice, make_forward_batch

BLOCK = 16


def _runner(path: Path) -> object:
    return Engine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=BLOCK)).runner


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_forward_sequence_matches_forward(arch: str, ckpt_dir: Callable[..., Path]) -> None:
    """Same logits (to float rounding) and the same K/V in the same slots, for a prompt
    from position 0, then 1-, 2- and 5-token steps, across block boundaries."""
    batched, lean = _runner(ckpt_dir(arch)), _runner(ckpt_dir(arch))
    block_ids = [9, 3, 40, 17, 5]  # not in order: slots come from the table
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, batched.spec.vocab_size, (70,), generator=gen).tolist()
    start = 0
    with torch.inference_mode():
        for end in (29, 30, 32, 37, 44):  # 29 from scratch, then 1, 2, 5, 7 tokens
            piece = SeqSlice(tokens[start:end], start, block_ids)
            batch = make_forward_batch([piece], [end - start - 1], BLOCK, torch.device("cpu"))
            want = batched.model.forward(batch, batched.kv_cache)[0]
            got = lean.model.forward_sequence(tokens[start:end], start, block_ids, lean.kv_cache)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            start = end
    written = [b * BLOCK + o for b in block_ids for o in range(BLOCK)][:44]
    flat = (-1, batched.spec.num_kv_heads, batched.spec.head_dim)
    for layer in range(batched.spec.num_layers):
        for kv in range(2):
            want_kv = batched.kv_cache[layer, kv].reshape(flat)[written]
            got_kv = lean.kv_cache[layer, kv].reshape(flat)[written]
            torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)
    assert int(lean.kv_cache[:, :, 0].abs().sum()) == 0  # nothing outside the table


def test_forward_sequence_rejects_a_sequence_past_its_blocks(ckpt_dir: Callable[..., Path]) -> None:
    runner = _runner(ckpt_dir("llama"))
    with pytest.raises(ValueError, match="block_size"):
        runner.model.forward_sequence([5, 6], BLOCK - 1, [1], runner.kv_cache)
    with pytest.raises(ValueError, match="len\\(token_ids\\)"):
        runner.model.forward_sequence([], 0, [1], runner.kv_cache)
