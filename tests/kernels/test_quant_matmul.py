"""Weight-only int8/int4 matmuls: quantizing round trips, the CPU path (torch's packed
kernels on bfloat16 activations) and the Triton kernels (interpreted) against the torch
references, over shapes that include the 135M default model's projections."""

import pytest
import torch

from splitserve_kernels import quant_matmul as qm
from splitserve_kernels.quant_matmul_triton import int4_matmul_triton, int8_matmul_triton

# SmolLM2-135M: qkv, o, gate/up, down (hidden 576, 9 + 2 * 3 heads of 64, intermediate 1536).
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def test_int8_round_trip_error_is_at_most_half_a_step() -> None:
    w = _weight(64, 96)
    q, scales = qm.quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (qm.dequantize_int8(q, scales) - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_error_is_at_most_half_a_step(group_size: int) -> None:
    w = _weight(48, 256)
    packed, scales, zeros = qm.quantize_int4(w, group_size)
    assert packed.shape == (48, 128) and scales.shape == zeros.shape == (48, 256 // group_size)
    q = qm.unpack_int4(packed)
    assert int(q.max()) == 15 and int(q.min()) == 0
    assert torch.equal(qm.pack_int4(q), packed)
    err = (qm.dequantize_int4(packed, scales, zeros, group_size) - w).abs().view(48, -1, group_size)
    assert bool((err <= scales[..., None] / 2 + 1e-6).all())


def test_int4_group_size_must_divide_k() -> None:
    with pytest.raises(ValueError, match="divide in_features=96"):
        qm.quantize_int4(_weight(16, 96), 64)


def test_int4_cpu_shape_checks_name_the_problem() -> None:
    with pytest.raises(ValueError, match="group size"):
        qm.check_int4_cpu_shape(64, 96, 48)
    with pytest.raises(ValueError, match="does not divide in_features=96"):
        qm.check_int4_cpu_shape(64, 96, 64)
    with pytest.raises(ValueError, match="out_features to be a multiple of 16, got 40"):
        qm.check_int4_cpu_shape(40, 64, 32)


def _assert_close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """The packed kernels round their output to bfloat16 (8 bits of mantissa)."""
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize(("n", "k"), SMOLLM2_SHAPES + [(48, 64)])
@pytest.mark.parametrize("m", [1, 7, qm.INT8_GEMM_MIN_ROWS + 3])  # packed kernel, then bf16 GEMM
def test_int8_cpu_matches_reference(n: int, k: int, m: int) -> None:
    w, x = _weight(n, k), _x(m, k)
    q, scales = qm.quantize_int8(w)
    got = qm.int8_matmul_cpu(x, q, scales.to(torch.bfloat16), scales)
    want = qm.int8_matmul_ref(x.bfloat16().float(), q, scales.bfloat16().float())
    assert got.dtype == torch.float32 and got.shape == (m, n)
    _assert_close_bf16(got, want)


# 576 is no multiple of 128: the 135M model takes groups of 32 or 64 only.
INT4_CASES = [(n, k, 32) for n, k in SMOLLM2_SHAPES] + [(3072, 576, 64), (576, 1536, 128), (48, 64, 32)]


@pytest.mark.parametrize(("n", "k", "group_size"), INT4_CASES)
def test_int4_cpu_matches_reference(n: int, k: int, group_size: int) -> None:
    w, x = _weight(n, k), _x(3, k)
    packed, scales, zeros = qm.quantize_int4(w, group_size)
    cpu_packed, scales_and_zeros = qm.int4_cpu_pack(packed, scales, zeros)
    got = qm.int4_matmul_cpu(x, cpu_packed, scales_and_zeros, group_size)
    want = qm.int4_matmul_ref(x.bfloat16().float(), packed, scales.bfloat16().float(),
                              zeros.bfloat16().float(), group_size)
    _assert_close_bf16(got, want)


@pytest.mark.parametrize(("n", "k", "m"), [(48, 64, 1), (96, 128, 17), (960, 576, 1)])
def test_int8_triton_matches_reference(n: int, k: int, m: int) -> None:
    w, x = _weight(n, k), _x(m, k)
    q, scales = qm.quantize_int8(w)
    torch.testing.assert_close(int8_matmul_triton(x, q, scales), qm.int8_matmul_ref(x, q, scales),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "k", "m", "group_size"),
                         [(48, 64, 1, 32), (96, 128, 17, 64), (576, 576, 1, 32), (40, 256, 3, 128)])
def test_int4_triton_matches_reference(n: int, k: int, m: int, group_size: int) -> None:
    w, x = _weight(n, k), _x(m, k)
    packed, scales, zeros = qm.quantize_int4(w, group_size)
    got = int4_matmul_triton(x, packed, scales, zeros, group_size)
    torch.testing.assert_close(got, qm.int4_matmul_ref(x, packed, scales, zeros, group_size),
                               rtol=1e-5, atol=1e-5)


def test_triton_launchers_reject_bad_shapes() -> None:
    q, scales = qm.quantize_int8(_weight(48, 64))
    with pytest.raises(ValueError, match="x must be"):
        int8_matmul_triton(_x(2, 32), q, scales)
    packed, s, z = qm.quantize_int4(_weight(48, 64), 32)
    with pytest.raises(ValueError, match="group_size 64 must divide|scales and zeros"):
        int4_matmul_triton(_x(2, 64), packed, s, z, 64)
