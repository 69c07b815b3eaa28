"""Triton dequant-matmuls for the GPU: ``y = x @ dequant(W).T`` with W in the int8 or int4
format of quant_matmul.py (whose torch references they must equal).

One program per ``BLOCK_M x BLOCK_N`` tile of y; K is walked ``BLOCK_K`` at a time. Each
K step loads the quantized tile of W, dequantizes it in registers (int8: to float, the
per-channel scale applied once at the end; int4: nibble, group scale and zero) and
accumulates ``x_tile @ w_tile`` in float32. The weight never exists dequantized in memory.
"""

from __future__ import annotations

import torch

from splitserve_kernels._triton_compat import require_triton, tl, triton


@triton.jit
def _int8_matmul_kernel(
    x_ptr, w_ptr, scales_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision="ieee")
    scales = tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    acc = acc * scales[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_matmul_kernel(
    x_ptr, packed_ptr, scales_ptr, zeros_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_pn, stride_sn, stride_ym,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        wk_mask = n_mask[None, :] & k_mask[:, None]  # [BLOCK_K, BLOCK_N]
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        byte = tl.load(packed_ptr + offs_n[None, :].to(tl.int64) * stride_pn + offs_k[:, None] // 2,
                       mask=wk_mask, other=0).to(tl.int32)
        q = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF
        s_offs = offs_n[None, :].to(tl.int64) * stride_sn + offs_k[:, None] // GROUP_SIZE
        s = tl.load(scales_ptr + s_offs, mask=wk_mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + s_offs, mask=wk_mask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - 8.0) * s + z
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 64, 32


def _check_x(x: torch.Tensor, in_features: int) -> None:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [M, K={in_features}], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x must have a unit stride along K")


def int8_matmul_triton(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] int8, rows contiguous
    scales: torch.Tensor,  # [N] float32
) -> torch.Tensor:  # [M, N], x's dtype
    """Triton version of :func:`splitserve_kernels.quant_matmul.int8_matmul_ref`."""
    require_triton()
    n, k = qweight.shape
    _check_x(x, k)
    if qweight.dtype != torch.int8 or qweight.stride(1) != 1 or scales.shape != (n,):
        raise ValueError("qweight must be [N, K] int8 with unit stride along K, scales [N]")
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _int8_matmul_kernel[grid](
        x, qweight, scales.contiguous(), y, x.shape[0], n, k, x.stride(0), qweight.stride(0), y.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return y


def int4_matmul_triton(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # [N, K // 2] uint8
    scales: torch.Tensor,  # [N, K // group_size]
    zeros: torch.Tensor,  # [N, K // group_size]
    group_size: int,
) -> torch.Tensor:  # [M, N], x's dtype
    """Triton version of :func:`splitserve_kernels.quant_matmul.int4_matmul_ref`."""
    require_triton()
    n, k = packed.shape[0], packed.shape[1] * 2
    _check_x(x, k)
    if k % group_size or scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"group_size {group_size} must divide K={k}; scales and zeros [N, K // group_size]")
    if packed.dtype != torch.uint8 or packed.stride(1) != 1:
        raise ValueError("packed must be [N, K // 2] uint8 with unit stride")
    scales, zeros = scales.contiguous(), zeros.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _int4_matmul_kernel[grid](
        x, packed, scales, zeros, y, x.shape[0], n, k,
        x.stride(0), packed.stride(0), scales.stride(0), y.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return y
