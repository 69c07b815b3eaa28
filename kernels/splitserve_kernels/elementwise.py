"""The elementwise parts of a decoder layer, as torch references of the fused native ops.

Each is what ``transformers`` computes for Llama-family layers (float32 RMSNorm cast back,
rotate-half RoPE, SiLU(gate) * up); the native versions (kernels/csrc/elementwise.cpp) do
the same arithmetic in one pass, so they differ at most by the summation order of the
RMSNorm's mean of squares. Run them through :mod:`splitserve_kernels.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden], x's dtype
    """``weight * (x * rsqrt(mean(x^2) + eps))``, the statistics in float32, cast back first."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor,  # [rows, hidden], updated in place: x += residual
    residual: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # rms_norm(x + residual)
    """The residual add of a layer and the next norm: ``x += residual``, then its RMSNorm."""
    x.add_(residual)
    return rms_norm_ref(x, weight, eps)


def rotary_ref(
    qk: torch.Tensor,  # [tokens, heads, head_dim], rotated in place
    cos: torch.Tensor,  # [tokens, 1, head_dim]
    signed_sin: torch.Tensor,  # [tokens, 1, head_dim], [-sin1, sin2]
) -> None:
    """Rotate-half RoPE, ``x * cos + rotate_half(x) * sin``, in place.

    ``signed_sin = [-sin1, sin2]`` carries rotate_half's sign, so the rotation is a roll by
    half the head: ``x2 * -sin1`` is exactly ``-x2 * sin1`` in IEEE arithmetic, so the values
    are transformers' bit for bit.
    """
    qk.copy_(qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * signed_sin)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2 * inter] -> [rows, inter]
    """``silu(gate) * up`` of a fused gate/up projection (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
