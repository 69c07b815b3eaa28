"""GGUF block formats (Q8_0, Q4_1) and the native block linear (kernels/csrc/quant_matmul.cpp)
against the torch reference, for every native library this CPU runs (the float32 GEMV and
the greedy argmax too); the native int8-KV
attention and write against their references (kernels/splitserve_kernels/kv_int8.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.models.gguf_weights import dequantize_blocks
from splitserve_kernels import kv_int8, ops
from splitserve_kernels import quant_matmul as qm
from splitserve_kernels.native import native_kernels
from splitserve_kernels.paged_attention_ref import paged_attention_ref

REPO_ROOT = Path(__file__).resolve().parents[2]
QTYPES = ("Q8_0", "Q4_1")
needs_native = pytest.mark.skipif(not native_kernels().available, reason="native kernels not loaded")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    return qm.quantize_q8_0(w) if qtype == "Q8_0" else qm.quantize_q4_1(w)


@pytest.mark.parametrize("qtype", QTYPES)
def test_round_trip_error_is_at_most_half_a_step(qtype: str) -> None:
    w = _weight(8, 96)
    blocks = _quantize(w, qtype)
    assert blocks.shape == (8, 3 * qm.GGUF_BLOCK_BYTES[qtype]) and blocks.dtype == torch.uint8
    d = blocks.view(8, 3, -1)[..., 0:2].contiguous().view(torch.float16).float()  # [8, 3, 1]
    err = (qm.dequantize_gguf(blocks, qtype, 96) - w).abs().view(8, 3, 32)
    assert bool((err <= d * 0.5 + 1e-3 * d + 1e-7).all())  # half a step (float16 d rounds)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_the_gguf_loaders_bit_for_bit(qtype: str) -> None:
    # Random bytes as blocks (finite float16 d and m): the layout is llama.cpp's, as the loader reads it.
    rng = np.random.default_rng(3)
    blocks = torch.from_numpy(rng.integers(0, 256, size=(6, 4 * qm.GGUF_BLOCK_BYTES[qtype]), dtype=np.uint8))
    halves = 1 if qtype == "Q8_0" else 2
    scales = torch.from_numpy(rng.standard_normal((6, 4, halves)).astype(np.float16)).view(torch.uint8)
    blocks.view(6, 4, -1)[..., : 2 * halves] = scales.view(6, 4, 2 * halves)
    want = dequantize_blocks(blocks.numpy(), qtype).view(6, 128)
    assert torch.equal(qm.dequantize_gguf(blocks, qtype, 128), want)


# (N, K): the 135M model's projections, K not a multiple of 32, one block, odd N.
SHAPES = [(960, 576), (576, 1536), (9, 672), (7, 100), (33, 32), (5, 45)]


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 3, 64, 300])
def test_native_matches_the_reference(qtype: str, n: int, k: int, m: int) -> None:
    blocks = _quantize(_weight(n, k), qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    want = qm.gguf_matmul_ref(x, blocks, qtype)
    got = qm.gguf_matmul_native(x, blocks, qtype)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_activations_are_rounded_to_8_bits_per_block() -> None:
    x = torch.zeros(2, 40)
    x[0, :32] = torch.arange(32) - 12.7  # the largest magnitude is the last, 18.3
    x[0, 32:] = torch.tensor([0.5, -0.25, 0, 0, 0, 0, 0, 0])  # the padded last block: d = 0.5 / 127
    got = qm.round_activations_q8(x)
    d = x[0, 31] / 127
    assert torch.equal(got[0, :32], torch.round((torch.arange(32) - 12.7) / d) * d)
    d_last = torch.tensor(0.5) / 127
    assert torch.equal(got[0, 32:34], torch.tensor([127.0, -64.0]) * d_last)  # -63.5 ties to even
    assert got[0, :32].sub(x[0, :32]).abs().max() <= d / 2
    assert torch.equal(got[1], torch.zeros(40))  # an all-zero block stays zero


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 3, 9, 300])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_value_that_is_not_finite_makes_its_row_nan(qtype: str, m: int, bad: float) -> None:
    # Rounded to 8 bits, an infinity or a NaN must not become a finite q_x (a wrong answer):
    # its row's every output is NaN, as the reference's, and the other rows are untouched.
    blocks = _quantize(_weight(40, 100), qtype)
    x = torch.randn(m, 100, generator=torch.Generator().manual_seed(4))
    x[m - 1, 37] = bad
    got = qm.gguf_matmul_native(x, blocks, qtype)
    want = qm.gguf_matmul_ref(x, blocks, qtype)
    assert got[m - 1].isnan().all() and want[m - 1].isnan().all()
    if m > 1:
        rest = want[: m - 1]
        torch.testing.assert_close(got[: m - 1], rest, rtol=1e-5, atol=1e-5 * float(rest.abs().max()))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_rows_do_not_depend_on_the_batch(qtype: str, n: int, k: int) -> None:
    # Batch 1 runs integer dot products, more rows the float kernels over the rounded x: the
    # same values up to rounding order.
    blocks = _quantize(_weight(n, k), qtype)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    together = qm.gguf_matmul_native(x, blocks, qtype)
    for i in range(9):
        alone = qm.gguf_matmul_native(x[i : i + 1], blocks, qtype)
        torch.testing.assert_close(alone[0], together[i], rtol=1e-5, atol=1e-5 * float(together[i].abs().max()))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
def test_native_weights_are_exactly_the_dequantized_ones(qtype: str) -> None:
    # One-hot activations read single weights: the integer part and d, m are exact.
    blocks = _quantize(_weight(37, 70), qtype)
    got = qm.gguf_matmul_native(torch.eye(70), blocks, qtype)
    assert torch.equal(got, qm.dequantize_gguf(blocks, qtype, 70).T)


@needs_native
def test_native_refuses_blocks_that_do_not_match_x() -> None:
    blocks = qm.quantize_q4_1(_weight(4, 64))
    with pytest.raises(ValueError, match="blocks rows need 60 bytes, got 40"):
        torch.ops.splitserve.gguf_linear(torch.zeros(1, 96), blocks, 1)
    with pytest.raises(ValueError, match="kind must be 0"):
        torch.ops.splitserve.gguf_linear(torch.zeros(1, 64), blocks, 7)


_VARIANT_CHECK = """
import torch
from splitserve_kernels import quant_matmul as qm
from splitserve_kernels.native import native_kernels
assert native_kernels().variant == {variant!r}, native_kernels()
g = torch.Generator().manual_seed(0)
for qtype in ("Q8_0", "Q4_1"):
    for n, k, m in ((960, 576, 1), (576, 1536, 5), (7, 100, 64)):
        w = torch.randn(n, k, generator=g) * 0.05
        blocks = qm.quantize_q8_0(w) if qtype == "Q8_0" else qm.quantize_q4_1(w)
        x = torch.randn(m, k, generator=g)
        want = qm.gguf_matmul_ref(x, blocks, qtype)
        torch.testing.assert_close(qm.gguf_matmul_native(x, blocks, qtype), want, rtol=1e-5,
                                   atol=1e-5 * float(want.abs().max()))
        assert torch.equal(qm.gguf_matmul_native(torch.eye(k), blocks, qtype),
                           qm.dequantize_gguf(blocks, qtype, k).T)
logits = torch.randn(5, 49157, generator=g)  # greedy tokens (kernels/csrc/argmax.cpp), a tail past the vectors
logits[1, 49156] = 100.0
assert torch.equal(torch.ops.splitserve.argmax_rows(logits), logits.argmax(-1))
print("ok")
"""


def _variants() -> list[str]:
    return ["avx512", "avx2"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else ["avx2"]


@needs_native
@pytest.mark.parametrize("variant", _variants())
def test_each_isa_variant_matches_the_reference(variant: str) -> None:
    env = {**os.environ, "SPLITSERVE_CPU_ISA": variant, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", _VARIANT_CHECK.format(variant=variant)], env=env,
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# -- the int8 KV cache, natively --------------------------------------------------------


@needs_native
@pytest.mark.parametrize(("q_lens", "seq_lens"), [([1] * 5, [1, 17, 40, 64, 100]), ([9, 1, 30], [9, 50, 45])])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_native_int8_attention_matches_the_dequantized_reference(paged_batch, q_lens, seq_lens, head_dim) -> None:
    batch = paged_batch(q_lens, seq_lens, block_size=16, num_kv_heads=3, queries_per_kv=3, head_dim=head_dim)
    k8, v8 = kv_int8.quantize_kv(batch.k_cache), kv_int8.quantize_kv(batch.v_cache)
    meta = (batch.block_tables, batch.seq_lens, batch.query_start_loc, head_dim**-0.5)
    got = torch.ops.splitserve.paged_attention(batch.query, k8, v8, *meta)
    want = kv_int8.paged_attention_int8_ref(batch.query, k8, v8, *meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.paged_attention(batch.query, k8, v8, *meta), got)  # ops routes here


@needs_native
def test_native_int8_write_is_the_references_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(6, 3, 64, generator=g), torch.randn(6, 3, 64, generator=g)
    key[2] = 0.0  # an all-zero row: scale 0
    slots = torch.tensor([0, 9, 33, -1, 31, 12])
    want = [torch.zeros(4, 16, 3, 68, dtype=torch.int8) for _ in range(2)]
    got = [torch.zeros(4, 16, 3, 68, dtype=torch.int8) for _ in range(2)]
    kv_int8.write_kv_int8_ref(key, value, *want, slots)
    torch.ops.splitserve.write_kv_int8(key, value, *got, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
