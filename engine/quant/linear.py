"""Linear layers whose weight is quantized once at load: ``--quantization int8`` (per output
channel) or ``int4`` (grouped along the input, ``--quant-group-size``). Formats and kernels:
kernels/quant_matmul.py (CPU: PyTorch's packed kernels; CUDA: kernels/quant_matmul_triton.py).

What is quantized (``LlamaModel``): every projection of every layer (qkv, o, gate/up,
down). The LM head is quantized to int8 per channel in both modes (int4 costs it the most
quality for the least speed: it is one matrix), and the token embeddings stay in the
model's dtype (a lookup reads a few rows, not the matrix).

Each layer object is called like a linear, ``layer(x [rows, in]) -> [rows, out]``, the same
interface as the dense one, so the forward does not know which it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import quant_matmul as qm
from kernels._triton_compat import HAS_TRITON

QUANTIZATIONS = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class WeightQuant:
    """How to quantize the weights at load."""

    method: str  # "int8" | "int4"
    group_size: int = 32  # int4 only

    def __post_init__(self) -> None:
        if self.method not in ("int8", "int4"):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.method!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"quant_group_size must be one of {GROUP_SIZES}, got {self.group_size}")


def _use_triton(device: torch.device) -> bool:
    return HAS_TRITON and device.type == "cuda"


class DenseLinear:
    """``F.linear`` with its weight held: the unquantized layer."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        return F.linear(x, self.weight, self.bias)


class Int8Linear:
    """Per-output-channel int8 weight; ``bias`` stays in the activations' dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.device = weight.device
        self.qweight, self.scales = qm.quantize_int8(weight)  # [N, K] int8, [N] float32
        self.bias = bias
        # CPU: the packed kernel takes its scales in the activations' (bfloat16) dtype.
        self.scales_bf16 = self.scales.to(torch.bfloat16)
        self.nbytes = self.qweight.numel() + self.scales.numel() * 6

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.device.type == "cpu":
            y = qm.int8_matmul_cpu(x.contiguous(), self.qweight, self.scales_bf16, self.scales)
        elif _use_triton(self.device):
            from kernels.quant_matmul_triton import int8_matmul_triton

            y = int8_matmul_triton(x.contiguous(), self.qweight, self.scales)
        else:
            y = qm.int8_matmul_ref(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias


class Int4Linear:
    """Grouped int4 weight; on CPU held only in torch's packing, elsewhere in ours."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> None:
        self.device = weight.device
        self.group_size = group_size
        self.bias = bias
        out_features, in_features = weight.shape
        if self.device.type == "cpu":
            qm.check_int4_cpu_shape(out_features, in_features, group_size)
        packed, scales, zeros = qm.quantize_int4(weight, group_size)
        if self.device.type == "cpu":
            self.cpu_packed, self.scales_and_zeros = qm.int4_cpu_pack(packed, scales, zeros)
            tensors = (self.cpu_packed, self.scales_and_zeros)
        else:
            self.packed, self.scales, self.zeros = packed, scales, zeros
            tensors = (packed, scales, zeros)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.device.type == "cpu":
            y = qm.int4_matmul_cpu(x.contiguous(), self.cpu_packed, self.scales_and_zeros, self.group_size)
        elif _use_triton(self.device):
            from kernels.quant_matmul_triton import int4_matmul_triton

            y = int4_matmul_triton(x.contiguous(), self.packed, self.scales, self.zeros, self.group_size)
        else:
            y = qm.int4_matmul_ref(x, self.packed, self.scales, self.zeros, self.group_size)
        return y if self.bias is None else y + self.bias


LinearLayer = Callable[[torch.Tensor], torch.Tensor]


def linear_factory(
    quant: WeightQuant | None, dense: Callable[..., LinearLayer] = DenseLinear
) -> Callable[[torch.Tensor, torch.Tensor | None], LinearLayer]:
    """What builds a layer's projections: ``dense`` unquantized, else the quantized kind.
    A weight the kernel cannot take is a ``ValueError`` naming the shape, at load."""
    if quant is None:
        return lambda weight, bias=None: dense(weight, bias)
    if quant.method == "int8":
        return lambda weight, bias=None: Int8Linear(weight, bias)
    return lambda weight, bias=None: Int4Linear(weight, bias, quant.group_size)


def lm_head_linear(
    weight: torch.Tensor, quant: WeightQuant | None, dense: Callable[..., LinearLayer] = DenseLinear
) -> LinearLayer:
    """The LM head: int8 per channel whenever weights are quantized (module docstring)."""
    return dense(weight, None) if quant is None else Int8Linear(weight, None)
