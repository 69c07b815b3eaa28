"""engine.models.gguf_weights.dequantize_blocks against the gguf package's numpy reference:
bit for bit, on random blocks of each type (every nibble and int8 value, scales of both signs,
subnormal, zero and large)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.models.gguf_weights import BLOCK_BYTES, dequantize_blocks


def random_blocks(qtype: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, blocks_per_row, BLOCK_BYTES[qtype]), dtype=np.uint8)
    num_scales = 2 if qtype == "Q4_1" else 1
    scales = rng.standard_normal((rows, blocks_per_row, num_scales)).astype(np.float16)
    scales.flat[:4] = [0.0, 6.0e-8, -6.5e4, 1.0]  # zero, subnormal, large, one
    data[..., : 2 * num_scales] = scales.view(np.uint8).reshape(rows, blocks_per_row, 2 * num_scales)
    return data.reshape(rows, blocks_per_row * BLOCK_BYTES[qtype])


@pytest.mark.parametrize("qtype", sorted(BLOCK_BYTES))
def test_matches_the_reference_bit_for_bit(qtype: str) -> None:
    data = random_blocks(qtype, rows=7, blocks_per_row=5, seed=len(qtype))
    expected = quants.dequantize(data, GGMLQuantizationType[qtype]).reshape(-1)
    got = dequantize_blocks(data, qtype)
    assert got.dtype == torch.float32 and got.shape == (7 * 5 * 32,)
    assert np.array_equal(got.numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))
