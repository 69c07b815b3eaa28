"""kernels/csrc/greedy_head.cpp: the bfloat16 screen's tokens against the argmax of the float32
panel logits, bit for bit (the same token, the first on ties), on CPUs with AVX512_BF16."""

from __future__ import annotations

import pytest
import torch

from engine.models.greedy_head import GreedyHead, screen_available
from engine.models.linear import Linear, panel_gemm

needs_screen = pytest.mark.skipif(not (panel_gemm() and screen_available()),
                                  reason="the screen needs the AVX-512 library on a CPU with AVX512_BF16")


def _reference(x: torch.Tensor, head: Linear) -> torch.Tensor:
    logits = torch.ops.splitserve.panel_linear(x, head.packed_panels(), head.out_features, None)
    return torch.ops.splitserve.argmax_rows(logits)


@needs_screen
@pytest.mark.parametrize(("vocab", "k", "rows"), [(49152, 576, 64), (1000, 576, 7), (77, 65, 13), (33, 2, 1),
                                                  (4096, 1536, 20), (512, 8192, 3)])
def test_the_tokens_are_the_float32_argmax(vocab: int, k: int, rows: int) -> None:
    # vocab across partial last panels (1000, 77, 33), k odd (65: a half pair) and across the
    # float32 panels' key blocks (1536, 8192: where the sums' rounding weighs in the bound); a hidden state with an outlier channel, as the default
    # model's final one has; two rows of the weight equal, so that their logits tie exactly.
    gen = torch.Generator().manual_seed(vocab + k + rows)
    weight = torch.randn(vocab, k, generator=gen) * 0.05
    weight[vocab // 2] = weight[vocab // 3]
    x = torch.randn(rows, k, generator=gen) * 2
    x[:, k // 3] = 40.0
    head = Linear(weight)
    got = GreedyHead(head).tokens(x)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, _reference(x, head))


@needs_screen
def test_near_ties_and_exact_ties_go_to_the_float32_logits() -> None:
    # Rows of the weight equal to one another or a last bit apart: the screen cannot tell them
    # apart (a bfloat16 logit is the same for both), the float32 logits decide, the first on ties.
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(4096, 576, generator=gen) * 0.05
    weight[100] = weight[3000]
    weight[200] = weight[2000]
    weight[2000, 5] = torch.nextafter(weight[2000, 5], torch.tensor(10.0))
    x = torch.stack([weight[3000] * 10, weight[2000] * 10, weight[2000] * -10 + weight[200] * 0.001])
    head = Linear(weight)
    got = GreedyHead(head).tokens(x)
    assert got is not None and torch.equal(got, _reference(x, head))
    assert got[0].item() == 100


@needs_screen
def test_a_row_that_is_not_finite_declines() -> None:
    weight = torch.randn(300, 64) * 0.05
    for bad in (float("nan"), float("inf")):
        x = torch.randn(3, 64)
        x[1, 7] = bad
        assert GreedyHead(Linear(weight)).tokens(x) is None  # the caller takes the logits


@needs_screen
def test_a_finite_row_whose_logits_overflow_declines() -> None:
    # x and the weight finite, but one token's products are +inf and -inf: its screened logit
    # and its float32 one are NaN (which argmax takes). The screen must see it and decline.
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 64, generator=gen) * 0.05
    weight[5, :2] = torch.tensor([10.0, -10.0])
    x = torch.randn(2, 64, generator=gen)
    x[1, :2] = 3e38
    head = Linear(weight)
    assert _reference(x, head)[1].item() == 5  # the NaN logit
    assert GreedyHead(head).tokens(x) is None


@needs_screen
def test_a_weight_that_is_not_finite_turns_the_screen_off() -> None:
    weight = torch.randn(300, 64) * 0.05
    weight[17, 3] = float("nan")
    assert GreedyHead(Linear(weight)).tokens(torch.randn(2, 64)) is None


@needs_screen
def test_it_serves_float32_heads_on_the_panel_route_only() -> None:
    weight = torch.randn(100, 64)
    assert GreedyHead.for_head(Linear(weight)) is not None
    assert GreedyHead.for_head(Linear(weight, torch.zeros(100))) is None  # a bias: not screened
    assert GreedyHead.for_head(Linear(weight, prepack=False)) is None  # no panels
    assert GreedyHead.for_head(Linear(weight.bfloat16())) is None
    head = Linear(weight)
    assert GreedyHead(head).tokens(torch.randn(int(head.fused_rows), 64)) is None  # oneDNN's rows
