"""Linear layers whose weight is quantized once at load: ``--quantization int8`` or ``int4``
(grouped along the input, ``--quant-group-size``). Formats and kernels: kernels/splitserve_kernels/quant_matmul.py.

On CPU with the native kernels (kernels/csrc/quant_matmul.cpp), weights are llama.cpp's
blocks of 32 (:class:`GGUFLinear`): int8 is Q8_0, int4 with group size 32 is Q4_1, and a
GGUF file's tensors already in that type are kept as the file stores them
(:func:`kept_gguf_types`: the loader hands them over as :class:`BlockWeight`, never
dequantized and requantized, so the model computes with the file's exact weights). Other
group sizes run PyTorch's packed int4 kernel; on CUDA the Triton kernels
(kernels/splitserve_kernels/quant_matmul_triton.py, int8 per output channel); without native kernels the
torch references.

What is quantized (``LlamaModel``): every projection of every layer (qkv, o, gate/up,
down). The LM head is int8 in both modes (int4 costs it the most quality for the least
speed: it is one matrix): Q8_0 on CPU (a GGUF file's Q8_0 embedding kept), per output
channel elsewhere. The token embeddings stay in the model's dtype (a lookup reads a few
rows, not the matrix).

Each layer object is called like a linear, ``layer(x [rows, in]) -> [rows, out]``, the same
interface as the dense one, so the forward does not know which it runs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve_kernels import quant_matmul as qm
from splitserve_kernels._triton_compat import HAS_TRITON
from splitserve_kernels.native import native_kernels

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
    """``F.linear`` with its weight held: the unquantized layer (GGUF blocks dequantized)."""

    def __init__(self, weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None = None) -> None:
        weight = as_dense(weight)
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
            from splitserve_kernels.quant_matmul_triton import int8_matmul_triton

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
            from splitserve_kernels.quant_matmul_triton import int4_matmul_triton

            y = int4_matmul_triton(x.contiguous(), self.packed, self.scales, self.zeros, self.group_size)
        else:
            y = qm.int4_matmul_ref(x, self.packed, self.scales, self.zeros, self.group_size)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class BlockWeight:
    """A weight ``[out_features, in_features]`` kept in GGUF blocks (kernels/splitserve_kernels/quant_matmul.py):
    what the loader hands over for a tensor of a type in :func:`kept_gguf_types`."""

    qtype: str  # "Q8_0" | "Q4_1"
    blocks: torch.Tensor  # [out_features, row bytes] uint8
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.in_features

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        """The weight in float32, computed once per object (a tied embedding and LM head
        share the tensor)."""
        return self._dense

    @functools.cached_property
    def _dense(self) -> torch.Tensor:
        return qm.dequantize_gguf(self.blocks, self.qtype, self.in_features)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``d, m, q`` with ``w = d * q + m`` per block of 32 (quant_matmul.gguf_block_parts)."""
        return qm.gguf_block_parts(self.blocks, self.qtype)

    def to(self, device: torch.device) -> BlockWeight:
        return BlockWeight(self.qtype, self.blocks.to(device), self.in_features)

    def contiguous(self) -> BlockWeight:
        return BlockWeight(self.qtype, self.blocks.contiguous(), self.in_features)


def cat_rows(weights: list[torch.Tensor | BlockWeight]) -> torch.Tensor | BlockWeight:
    """Stack weights along out_features (fused qkv, gate/up); blocks stay blocks where all
    share one type, else every part is dequantized."""
    first = weights[0]
    if isinstance(first, BlockWeight) and all(
        isinstance(w, BlockWeight) and w.qtype == first.qtype and w.in_features == first.in_features for w in weights
    ):
        return BlockWeight(first.qtype, torch.cat([w.blocks for w in weights]), first.in_features)  # type: ignore[union-attr]
    return torch.cat([as_dense(w) for w in weights])


def as_dense(weight: torch.Tensor | BlockWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(weight, BlockWeight):
        return weight.dequantize().to(dtype or torch.float32)
    return weight


def native_blocks(device: torch.device) -> bool:
    """True where the block kernels serve: CPU, native library loaded."""
    return device.type == "cpu" and native_kernels().available


def kept_gguf_types(quant: WeightQuant | None, device: torch.device, dtype: torch.dtype,
                    float_blocks: bool = True) -> frozenset[str]:
    """The GGUF tensor types the loader keeps as blocks for this quantization. Unquantized
    float32 keeps Q8_0 and Q4_1 too, unless ``float_blocks`` is False: its layers compute
    with them as block panels, the same bits as their float32 weights
    (engine/models/linear.py), and dequantize them where those do not serve."""
    if not native_blocks(device):
        return frozenset()
    if quant is None:
        return frozenset(("Q8_0", "Q4_1")) if dtype == torch.float32 and float_blocks else frozenset()
    if quant.method == "int4" and quant.group_size == qm.GGUF_BLOCK:
        return frozenset(("Q8_0", "Q4_1"))
    return frozenset(("Q8_0",))  # the LM head, and int8 projections


class GGUFLinear:
    """A weight in GGUF blocks (Q8_0, Q4_1): the native kernel, else the torch reference
    on the weight dequantized once."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.qtype, self.blocks = weight.qtype, weight.blocks
        self.native = native_blocks(weight.blocks.device)
        self._dense = None if self.native else weight.dequantize()
        self.nbytes = self.blocks.numel()
        # ``decoder_layers`` (engine/models/llama.py) runs the native kernel at every row count.
        self.fused_rows = math.inf if self.native else 0

    def fused_weight(self, rows: int) -> torch.Tensor:
        """The weight as ``decoder_layers`` takes it at any row count: the blocks, each row Q8_0's
        or Q4_1's bytes."""
        return self.blocks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self._dense is not None:
            y = F.linear(qm.round_activations_q8(x), self._dense).to(x.dtype)
        else:
            y = qm.gguf_matmul_native(x, self.blocks, self.qtype)
        return y if self.bias is None else y + self.bias


def _block_linear(weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None, qtype: str) -> GGUFLinear:
    """``weight`` in ``qtype`` blocks: kept where it already is, else quantized from floats."""
    if isinstance(weight, BlockWeight) and weight.qtype == qtype:
        return GGUFLinear(weight, bias)
    dense = as_dense(weight)
    quantize = qm.quantize_q8_0 if qtype == "Q8_0" else qm.quantize_q4_1
    return GGUFLinear(BlockWeight(qtype, quantize(dense), dense.shape[1]), bias)


LinearLayer = Callable[[torch.Tensor], torch.Tensor]


def linear_factory(
    quant: WeightQuant | None, dense: Callable[..., LinearLayer] = DenseLinear
) -> Callable[[torch.Tensor | BlockWeight, torch.Tensor | None], LinearLayer]:
    """What builds a layer's projections: ``dense`` unquantized, else the quantized kind.
    A weight the kernel cannot take is a ``ValueError`` naming the shape, at load."""
    if quant is None:
        return lambda weight, bias=None: dense(weight, bias)

    def build(weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None = None) -> LinearLayer:
        device = weight.blocks.device if isinstance(weight, BlockWeight) else weight.device
        if native_blocks(device) and (quant.method == "int8" or quant.group_size == qm.GGUF_BLOCK):
            return _block_linear(weight, bias, "Q8_0" if quant.method == "int8" else "Q4_1")
        if quant.method == "int8":
            return Int8Linear(as_dense(weight), bias)
        return Int4Linear(as_dense(weight), bias, quant.group_size)

    return build


def lm_head_linear(
    weight: torch.Tensor | BlockWeight, quant: WeightQuant | None, dense: Callable[..., LinearLayer] = DenseLinear
) -> LinearLayer:
    """The LM head: int8 whenever weights are quantized (module docstring); a weight the
    loader kept in its file's blocks stays in them."""
    if quant is None:
        return dense(weight, None)
    if isinstance(weight, BlockWeight):  # kept from the file (kept_gguf_types): as it is
        return GGUFLinear(weight, None)
    return _block_linear(weight, None, "Q8_0") if native_blocks(weight.device) else Int8Linear(weight, None)
