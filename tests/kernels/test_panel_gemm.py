"""kernels/csrc/panel_gemm.cpp: pack_panels + panel_linear against the float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
