"""engine.models.linear: the native panel GEMM and prepacked oneDNN GEMMs against F.linear."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.models import linear
from engine.models.linear import Linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 15, 16, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_matches_f_linear(rows, with_bias, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    layer = Linear(weight, bias)
    limit = linear.panel_rows()  # AVX2: every row count; AVX-512: below 129; no library: none
    panels = rows < limit
    assert layer.panel_rows == limit and layer.packable == (limit < math.inf)
    assert layer.packed is None and layer.panels is None  # packed at the first call that needs it
    calls: dict[str, int] = {"packed": 0, "panels": 0}
    for namespace, name, key in ((torch.ops.mkldnn, "_linear_pointwise", "packed"),
                                 (torch.ops.splitserve, "panel_linear", "panels")):
        real = getattr(namespace, name, None)
        if real is not None:
            monkeypatch.setattr(namespace, name, lambda *a, real=real, key=key: calls.__setitem__(key, 1) or real(*a),
                                raising=False)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    packed = not panels and layer.packable and rows >= linear.MIN_PACKED_ROWS
    assert calls == {"packed": int(packed), "panels": int(panels)}
    assert (layer.packed is not None) == packed and (layer.panels is not None) == panels
    assert layer.weight is weight  # float32 keeps both


@needs_onednn
def test_bfloat16_packed_only_where_onednn_runs_it() -> None:
    # Packed, and only packed, where oneDNN has a bfloat16 path (AVX-512); on an AVX2-only CPU
    # (or ONEDNN_MAX_CPU_ISA=AVX2: tests/engine/test_avx2_mode.py) unpacked, F.linear serving.
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=gen).bfloat16()
    layer = Linear(weight)
    assert layer.packable == linear.onednn_has_bf16()
    for rows in (1, 16):
        x = torch.randn(rows, 32, generator=gen).bfloat16()
        torch.testing.assert_close(layer(x).float(), F.linear(x, weight).float(), atol=0.05, rtol=0.02)
        if layer.packable:  # from the first call on
            assert layer.packed is not None and layer.weight is None
        else:
            assert layer.packed is None and layer.weight is weight


def test_unpacked_where_it_does_not_pay() -> None:
    weight = torch.randn(8, 4, dtype=torch.float16)
    layer = Linear(weight)
    x = torch.randn(5, 4, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, weight))
    assert not layer.packable and layer.packed is None
    unpacked = Linear(torch.randn(8, 4), prepack=False)
    unpacked(torch.randn(5, 4))
    assert not unpacked.packable and unpacked.packed is None
