"""The fused elementwise ops (kernels/csrc/elementwise.cpp) against their torch references."""

from __future__ import annotations

import pytest
import torch

from splitserve_kernels import elementwise, native, ops
from splitserve_kernels.native import native_kernels

needs_native = pytest.mark.skipif(
    not native_kernels().available, reason=f"native kernels not built: {native_kernels().reason}"
)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@needs_native
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 512), (300, 64), (3, 100)])
def test_rms_norm_matches_reference(rows, hidden) -> None:
    x, weight = randn(rows, hidden), randn(hidden, seed=1)
    out = torch.ops.splitserve.rms_norm(x, weight, 1e-6)
    # Only the order of summing the squares differs.
    torch.testing.assert_close(out, elementwise.rms_norm_ref(x, weight, 1e-6), atol=1e-6, rtol=1e-6)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_half_precision(dtype) -> None:
    x, weight = randn(5, 256, dtype=dtype), randn(256, seed=1, dtype=dtype)
    out = torch.ops.splitserve.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, elementwise.rms_norm_ref(x, weight, 1e-5), atol=2e-2, rtol=2e-2)


@needs_native
def test_add_rms_norm_updates_the_residual_stream_in_place() -> None:
    wide = randn(6, 96)
    x, residual, weight = wide[:, :64], randn(6, 64, seed=2), randn(64, seed=3)  # strided rows
    want_x = x + residual
    want = elementwise.rms_norm_ref(want_x, weight, 1e-6)
    out = ops.add_rms_norm_(x, residual, weight, 1e-6)
    assert torch.equal(x, want_x) and torch.equal(wide[:, :64], want_x)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 4500])  # 4500 x 64: more rows than one task takes (threads)
def test_add_rms_norm_adds_a_strided_residual_in_the_norms_pass(dtype, rows) -> None:
    # The add runs inside the norm's row loop now: x must come out exactly x + residual (as
    # ATen's add_), for a residual whose rows are a view into wider ones (an MLP output slice).
    x = randn(rows, 64).to(dtype)
    residual = randn(rows, 80, seed=2).to(dtype)[:, 8:72]
    weight = randn(64, seed=3).to(dtype)
    want_x = x + residual
    want = elementwise.rms_norm_ref(want_x, weight, 1e-5)
    out = ops.add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(x, want_x)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("heads,head_dim", [(12, 64), (3, 32), (2, 24)])
def test_rotary_in_place_is_the_reference_bit_for_bit(heads, head_dim) -> None:
    # q and k heads as a view into a wider qkv row, as the layer has them.
    tokens = 9
    qkv = randn(tokens, (heads + 2) * head_dim)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, sin = randn(tokens, 1, head_dim, seed=4), randn(tokens, 1, head_dim, seed=5)
    want = qk.clone()
    elementwise.rotary_ref(want, cos, sin)
    untouched = qkv[:, heads * head_dim :].clone()
    torch.ops.splitserve.rotary_(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


@needs_native
@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1408), (5, 40)])
def test_silu_mul_matches_reference(rows, inter) -> None:
    gate_up = randn(rows, 2 * inter) * 4
    out = torch.ops.splitserve.silu_mul(gate_up)
    torch.testing.assert_close(out, elementwise.silu_mul_ref(gate_up), atol=1e-6, rtol=1e-6)


@needs_native
def test_bad_arguments_raise_value_error() -> None:
    x, weight = randn(4, 8), randn(8)
    with pytest.raises(ValueError, match="weight"):
        torch.ops.splitserve.rms_norm(x, randn(9), 1e-6)
    with pytest.raises(ValueError, match="unit stride"):
        torch.ops.splitserve.rms_norm(x.t(), randn(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        torch.ops.splitserve.add_rms_norm_(x, randn(4, 9), weight, 1e-6)
    with pytest.raises(ValueError, match="cos and sin"):
        torch.ops.splitserve.rotary_(randn(4, 2, 8), randn(3, 8), randn(4, 8))
    with pytest.raises(ValueError, match="gate_up"):
        torch.ops.splitserve.silu_mul(randn(4, 7))


@needs_native
def test_operators_pass_torch_library_opcheck() -> None:
    x, weight = randn(5, 32), randn(32, seed=1)
    torch.library.opcheck(torch.ops.splitserve.rms_norm, (x, weight, 1e-6))
    torch.library.opcheck(torch.ops.splitserve.add_rms_norm_, (x.clone(), randn(5, 32, seed=2), weight, 1e-6))
    torch.library.opcheck(torch.ops.splitserve.rotary_, (randn(5, 2, 32), randn(5, 1, 32), randn(5, 1, 32)))
    torch.library.opcheck(torch.ops.splitserve.silu_mul, (randn(5, 64),))


def test_ops_fall_back_to_the_references(monkeypatch) -> None:
    # Without the native library (or for inputs it does not take) the references run.
    monkeypatch.setattr(native, "_loaded", native.NativeKernels(None, "simulated"))
    x, residual, weight = randn(3, 16), randn(3, 16, seed=1), randn(16, seed=2)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), elementwise.rms_norm_ref(x, weight, 1e-6))
    want = elementwise.rms_norm_ref(x + residual, weight, 1e-6)
    assert torch.equal(ops.add_rms_norm_(x, residual, weight, 1e-6), want)
    qk, cos, sin = randn(3, 2, 16), randn(3, 1, 16, seed=3), randn(3, 1, 16, seed=4)
    want_qk = qk.clone()
    elementwise.rotary_ref(want_qk, cos, sin)
    ops.rotary_(qk, cos, sin)
    assert torch.equal(qk, want_qk)
    gate_up = randn(3, 32)
    assert torch.equal(ops.silu_mul(gate_up), elementwise.silu_mul_ref(gate_up))
