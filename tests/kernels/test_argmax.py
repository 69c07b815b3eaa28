"""The native greedy-token op (kernels/csrc/argmax.cpp) against torch.argmax."""

from __future__ import annotations

import pytest
import torch

from splitserve_kernels import ops
from splitserve_kernels.native import native_kernels

needs_native = pytest.mark.skipif(not native_kernels().available, reason="native kernels not loaded")


@needs_native
@pytest.mark.parametrize(("rows", "vocab"), [(64, 49152), (1, 49152), (3, 17), (5, 7), (2, 100), (4, 1)])
def test_argmax_rows_is_torchs_argmax(rows: int, vocab: int) -> None:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    assert torch.equal(torch.ops.splitserve.argmax_rows(x), x.argmax(-1))
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))


@needs_native
def test_ties_go_to_the_first_index_and_a_nan_wins_as_in_torch() -> None:
    x = torch.zeros(6, 100)
    x[1, 5] = x[1, 50] = 1.0  # a tie in two vector lanes
    x[2, 99] = 3.0  # in the tail past the last whole vector
    x[3] = -1.0  # all equal: index 0
    x[4, 60] = x[4, 70] = float("nan")  # the first NaN
    x[4, 3] = float("inf")
    x[5] = float("-inf")
    x[5, 97] = -1e30
    want = torch.tensor([0, 5, 99, 0, 60, 97])
    assert torch.equal(x.argmax(-1), want)
    assert torch.equal(torch.ops.splitserve.argmax_rows(x), want)
    strided = torch.randn(3, 80)[:, 5:69]  # rows 80 apart
    assert torch.equal(torch.ops.splitserve.argmax_rows(strided), strided.argmax(-1))


@needs_native
def test_argmax_rows_refuses_what_it_cannot_index() -> None:
    with pytest.raises(ValueError, match="logits must be float32"):
        torch.ops.splitserve.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="vocab must be in"):
        torch.ops.splitserve.argmax_rows(torch.zeros(2, 0))
