"""kernels/csrc/panel_gemm.cpp: pack_panels + panel_linear against the float64 reference, and
block panels (pack_block_panels) against the float32 panels of the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve_kernels import quant_matmul as qm
from splitserve_kernels.native import native_kernels

needs_native = pytest.mark.skipif(not native_kernels().available, reason="native kernels not loaded")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 24, 50, 131])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (100, 600), (17, 33), (1, 3), (40, 4096)])
def test_matches_reference(rows, n, k) -> None:
    # Row counts across the row blocks (6 / 12 rows) and, for k = 1536 and 4096, across the
    # blocks of x rows; n a partial last panel (100, 17, 1, 40); k across the key blocks (600,
    # 4096) and below one vector (3); x a strided view; with and without bias.
    gen = torch.Generator().manual_seed(rows * 7919 + n * k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 5, generator=gen)[:, 2 : 2 + k]
    panels = torch.ops.splitserve.pack_panels(weight)
    for b in (None, bias):
        got = torch.ops.splitserve.panel_linear(x, panels, n, b)
        assert got.shape == (rows, n) and got.is_contiguous()
        torch.testing.assert_close(got, _reference(x, weight, b), atol=2e-6 * k**0.5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize(("rows", "n", "k"), [(37, 200, 700), (300, 600, 700)])
def test_a_row_gets_the_same_bits_in_any_batch(rows, n, k) -> None:
    # The kernel sums each output in an order that depends on nothing but K: a request's
    # logits do not change with the batch it shares a step with, nor with the thread count,
    # nor with which thread took which chunk of panels. 300 rows of K = 700 are four blocks
    # of x rows, each cut into chunks of panels.
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    panels = torch.ops.splitserve.pack_panels(weight)
    full = torch.ops.splitserve.panel_linear(x, panels, n, None)
    for i in (0, 5, 6, rows - 1):
        assert torch.equal(torch.ops.splitserve.panel_linear(x[i : i + 1], panels, n, None)[0], full[i])
    assert torch.equal(torch.ops.splitserve.panel_linear(x[3:20], panels, n, None), full[3:20])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(torch.ops.splitserve.panel_linear(x, panels, n, None), full)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_empty_rows_and_zero_k() -> None:
    panels = torch.ops.splitserve.pack_panels(torch.randn(9, 4))
    assert torch.ops.splitserve.panel_linear(torch.zeros(0, 4), panels, 9, None).shape == (0, 9)
    bias = torch.arange(3, dtype=torch.float32)
    empty = torch.ops.splitserve.pack_panels(torch.zeros(3, 0))
    assert torch.equal(torch.ops.splitserve.panel_linear(torch.zeros(2, 0), empty, 3, bias), bias.expand(2, 3))
    assert torch.equal(torch.ops.splitserve.panel_linear(torch.zeros(2, 0), empty, 3, None), torch.zeros(2, 3))


@needs_native
def test_refuses_mismatched_operands() -> None:
    panels = torch.ops.splitserve.pack_panels(torch.zeros(20, 8))
    with pytest.raises(ValueError, match="x has K = 9, panels have 8"):
        torch.ops.splitserve.panel_linear(torch.zeros(1, 9), panels, 20, None)
    with pytest.raises(ValueError, match="out_features 40 does not fit"):
        torch.ops.splitserve.panel_linear(torch.zeros(1, 8), panels, 40, None)
    with pytest.raises(ValueError, match="bias must be contiguous float32"):
        torch.ops.splitserve.panel_linear(torch.zeros(1, 8), panels, 20, torch.zeros(3))
    with pytest.raises(ValueError, match="panels must be contiguous float32"):
        torch.ops.splitserve.panel_linear(torch.zeros(1, 8), torch.zeros(2, 8, 3), 20, None)
    with pytest.raises(ValueError, match="x must be float32"):
        torch.ops.splitserve.panel_linear(torch.zeros(1, 8, dtype=torch.float64), panels, 20, None)
    with pytest.raises(ValueError, match="weight must be float32"):
        torch.ops.splitserve.pack_panels(torch.zeros(4, 4, dtype=torch.float16))


def _block_panels(weight: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in ``qtype`` GGUF blocks: (its float32 values, its block panels)."""
    blocks = qm.quantize_q8_0(weight) if qtype == "Q8_0" else qm.quantize_q4_1(weight)
    dense = qm.dequantize_gguf(blocks, qtype, weight.shape[1])
    return dense, torch.ops.splitserve.pack_block_panels(*qm.gguf_block_parts(blocks, qtype))


@needs_native
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 2, 6, 12, 13, 16, 64, 131, 300])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (100, 1536), (17, 32), (64, 4096)])
def test_block_panels_give_the_float_panels_bits(qtype, rows, n, k) -> None:
    # The same numbers (w = fma(d, q, m) rounds as d * q + m does, d * q being exact) summed
    # in the same order: equal bits, with and without bias. Rows of one row block (turned into
    # floats in registers) and of several (through the block buffer); n a partial last panel
    # (100, 17); k one group (32), several key blocks (1536, 4096); 300 rows are blocks of x rows.
    gen = torch.Generator().manual_seed(rows * 31 + n + k)
    dense, blocks = _block_panels(torch.randn(n, k, generator=gen), qtype)
    floats = torch.ops.splitserve.pack_panels(dense)
    assert blocks.dtype == torch.uint8 and blocks.numel() * 3 < floats.numel() * 4  # 1.25 bytes a weight
    x = torch.randn(rows, k + 3, generator=gen)[:, 1 : 1 + k]
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        want = torch.ops.splitserve.panel_linear(x, floats, n, b)
        got = torch.ops.splitserve.panel_linear(x, blocks, n, b)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    torch.testing.assert_close(got, _reference(x, dense, bias), atol=2e-6 * k**0.5 * 8, rtol=1e-5)


def test_q8_0_parts_leave_d_times_q_as_it_is() -> None:
    # Q8_0 has no m; gguf_block_parts gives -0, and d * q + -0 is d * q, bit for bit, the sign
    # of a zero included (a negative scale times q = 0 is -0).
    weight = torch.linspace(-1, 1, 64).view(1, 64)
    weight[0, ::5] = 0.0
    blocks = qm.quantize_q8_0(weight)
    d, m, q = qm.gguf_block_parts(blocks, "Q8_0")
    assert torch.equal(m.view(torch.int32), torch.full_like(m, -0.0).view(torch.int32))
    d = -d
    product = q.float().view(1, 2, 32) * d[..., None]
    assert (product == 0).any() and product[product == 0].signbit().any()
    summed = d[..., None] * q.float().view(1, 2, 32) + m[..., None]
    assert torch.equal(summed.view(torch.int32), product.view(torch.int32))


@needs_native
def test_block_panels_follow_scales_that_are_not_finite() -> None:
    # A scale that is not finite (a corrupt file) gives the float32 route's NaN / infinity.
    weight = torch.randn(32, 64)
    d, m, q = qm.gguf_block_parts(qm.quantize_q8_0(weight), "Q8_0")
    d[1, 0], d[2, 1], q[1, 0] = float("inf"), float("nan"), 1
    dense = d.repeat_interleave(32, dim=1) * q.float() + m.repeat_interleave(32, dim=1)
    x = torch.ones(3, 64)
    want = torch.ops.splitserve.panel_linear(x, torch.ops.splitserve.pack_panels(dense), 32, None)
    got = torch.ops.splitserve.panel_linear(x, torch.ops.splitserve.pack_block_panels(d, m, q), 32, None)
    assert got[:, 1].isnan().all() and got[:, 2].isnan().all() and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got).view(torch.int32), torch.nan_to_num(want).view(torch.int32))


@needs_native
def test_block_panels_refuse_mismatched_operands() -> None:
    d, m, q = torch.ones(8, 2), torch.zeros(8, 2), torch.zeros(8, 64, dtype=torch.int8)
    panels = torch.ops.splitserve.pack_block_panels(d, m, q)
    with pytest.raises(ValueError, match="x has K = 32, block panels have 64"):
        torch.ops.splitserve.panel_linear(torch.zeros(1, 32), panels, 8, None)
    with pytest.raises(ValueError, match="block panels must be contiguous uint8"):
        torch.ops.splitserve.panel_linear(torch.zeros(1, 64), panels[:, :, :7], 8, None)
    with pytest.raises(ValueError, match="q must be int8 \\[N, K\\] with K a multiple of 32"):
        torch.ops.splitserve.pack_block_panels(d, m, torch.zeros(8, 40, dtype=torch.int8))
    with pytest.raises(ValueError, match="d and m must be float32 \\[8, 2\\]"):
        torch.ops.splitserve.pack_block_panels(d, torch.zeros(8, 3), q)
