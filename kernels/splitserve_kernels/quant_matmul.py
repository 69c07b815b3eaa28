"""Weight-only quantized matmuls, ``y = x @ dequant(W).T``: formats, torch references, and
the CPU path on PyTorch's packed kernels (the Triton kernels: quant_matmul_triton.py).

Formats (``W`` is ``[N = out_features, K = in_features]``)::

    int8, per output channel (symmetric):
        qweight  [N, K] int8 in [-127, 127]       W[n, k] ~ qweight[n, k] * scales[n]
        scales   [N] float32

    int4, grouped along K (asymmetric, the convention of torch's int4 kernels):
        packed   [N, K // 2] uint8, byte j of a row holds q[2j] (low nibble) and
                 q[2j + 1] (high nibble), q in [0, 15]
        scales   [N, K // group_size] float32
        zeros    [N, K // group_size] float32     W[n, k] ~ (q[n, k] - 8) * scales[n, g] + zeros[n, g]
                                                   with g = k // group_size

The CPU path runs ``torch.ops.aten._weight_int8pack_mm`` (few rows; from
``INT8_GEMM_MIN_ROWS`` rows on a bfloat16 GEMM, below) and
``_weight_int4pack_mm_for_cpu`` (its own packing, ``_convert_weight_to_int4pack_for_cpu``).
Both are fast only with bfloat16 activations (measured on this project's 2-core Sapphire
Rapids host, the 135M model's shapes at one row: 3-25x faster than with float32
activations, which take a scalar path), so float32 activations are rounded to bfloat16 for
the product and the result cast back; accumulation is in float32 inside the kernels.
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
INT4_CPU_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: N must be a multiple of this


# -- quantizing (at load) -------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (qweight [N, K] int8, scales [N] float32): each row's largest
    magnitude maps to 127, values round to nearest."""
    w = weight.to(torch.float32)
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scales


def quantize_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (packed [N, K // 2] uint8, scales, zeros [N, K // group_size]
    float32): each group of ``group_size`` weights of a row maps its [min, max] onto the
    16 levels (min -> 0, max -> 15), values round to nearest. ``ValueError`` when
    ``group_size`` does not divide K or is odd."""
    n, k = weight.shape
    if group_size < 2 or group_size % 2 or k % group_size:
        raise ValueError(f"group size {group_size} must be even and divide in_features={k}")
    w = weight.to(torch.float32).view(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).view(n, k)
    zeros = low + 8.0 * scales  # so that (q - 8) * scale + zero = low + q * scale
    return pack_int4(q), scales, zeros


# -- references --------------------------------------------------------------------------


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # [N, K] float32
    return qweight.to(torch.float32) * scales.to(torch.float32)[:, None]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:  # [N, K // 2] uint8 -> [N, K] uint8 in [0, 15]
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).view(packed.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:  # [N, K] integers in [0, 15] -> [N, K // 2] uint8
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:  # [N, K] float32
    q = unpack_int4(packed).to(torch.float32)
    n, k = q.shape
    grouped = q.view(n, k // group_size, group_size) - 8.0
    w = grouped * scales.to(torch.float32)[..., None] + zeros.to(torch.float32)[..., None]
    return w.view(n, k)


def int8_matmul_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
) -> torch.Tensor:  # [M, N], x's dtype
    """Torch reference: dequantize to float32, multiply in float32."""
    return (x.to(torch.float32) @ dequantize_int8(qweight, scales).T).to(x.dtype)


def int4_matmul_ref(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # [N, K // 2] uint8
    scales: torch.Tensor,  # [N, K // group_size]
    zeros: torch.Tensor,  # [N, K // group_size]
    group_size: int,
) -> torch.Tensor:  # [M, N], x's dtype
    """Torch reference: dequantize to float32, multiply in float32."""
    w = dequantize_int4(packed, scales, zeros, group_size)
    return (x.to(torch.float32) @ w.T).to(x.dtype)


# -- CPU: PyTorch's packed kernels ---------------------------------------------------------


def check_int4_cpu_shape(out_features: int, in_features: int, group_size: int) -> None:
    """``ValueError`` when torch's CPU int4 kernel cannot take this weight."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 on CPU needs a group size in {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide in_features={in_features}")
    if out_features % INT4_CPU_N_MULTIPLE:
        raise ValueError(
            f"int4 on CPU needs out_features to be a multiple of {INT4_CPU_N_MULTIPLE}, got {out_features}"
        )


def int4_cpu_pack(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 format -> (torch's CPU int4 packing [N, K // 2] uint8, scales_and_zeros
    [K // group_size, N, 2] bfloat16), what :func:`int4_matmul_cpu` takes."""
    q = unpack_int4(packed).to(torch.int32)
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = torch.stack((scales.T, zeros.T), dim=-1).to(torch.bfloat16).contiguous()
    return cpu_packed, scales_and_zeros


# From this many rows on, int8 x bfloat16 runs as a bfloat16 GEMM (oneDNN; AMX where the CPU
# has it) on the int8 weight converted to bfloat16 (exact: |q| <= 127), the per-channel scale
# applied to the output. Measured on the 135M model's projections, one thread: at 64 rows
# 0.55x float32's time against 1.5x for _weight_int8pack_mm; at 16 rows 0.71x against 0.75x.
INT8_GEMM_MIN_ROWS = 16


def int8_matmul_cpu(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] int8
    scales_bf16: torch.Tensor,  # [N] bfloat16
    scales: torch.Tensor | None = None,  # [N] float32; needed from INT8_GEMM_MIN_ROWS rows on
) -> torch.Tensor:  # [M, N], x's dtype
    if x.shape[0] >= INT8_GEMM_MIN_ROWS and scales is not None:
        y = torch.nn.functional.linear(x.to(torch.bfloat16), qweight.to(torch.bfloat16))
        return (y.to(torch.float32) * scales).to(x.dtype)
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scales_bf16)
    return y.to(x.dtype)


def int4_matmul_cpu(
    x: torch.Tensor,  # [M, K]
    cpu_packed: torch.Tensor,  # from int4_cpu_pack
    scales_and_zeros: torch.Tensor,  # [K // group_size, N, 2] bfloat16
    group_size: int,
) -> torch.Tensor:  # [M, N], x's dtype
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), cpu_packed, group_size, scales_and_zeros
    )
    return y.to(x.dtype)


# -- GGUF blocks of 32 (Q8_0, Q4_1), kept as the file stores them ------------------------
#
# A weight [N, K] is N rows of ceil(K / 32) blocks, bytes [N, blocks * block bytes] uint8:
#
#   Q8_0  34 bytes: float16 d, 32 x int8 q                  w = d * q
#   Q4_1  20 bytes: float16 d, float16 m, 16 bytes of q     w = d * q + m, q in [0, 15]
#         (byte j: weight j in the low nibble, weight j + 16 in the high one)
#
# llama.cpp's layouts, so a GGUF file's tensors of these types serve as they are (no
# dequantizing, no requantizing). Where K is not a multiple of 32 the last block is padded
# (quantized zeros); the kernel pads the activations with zeros to match. The native kernel
# (kernels/csrc/quant_matmul.cpp) dequantizes in registers, the same weights as
# dequantize_gguf gives. Both take the activations rounded to 8 bits per block of 32
# (round_activations_q8: llama.cpp pairs Q4_1 with its Q8_1 and Q8_0 with its Q8_0, as here),
# at every batch size, so that batch-1 decode runs on integer dot products and a request's
# result does not depend on its batch. Only the float rounding order differs between the
# kernel and gguf_matmul_ref.

GGUF_BLOCK = 32
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}
GGUF_KINDS = {"Q8_0": 0, "Q4_1": 1}  # the native op's ``kind``


def _pad_blocks(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> float32 [N, blocks, 32]
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.to(torch.float32), (0, -k % GGUF_BLOCK))
    return padded.view(n, -1, GGUF_BLOCK)


def _half_bytes(t: torch.Tensor) -> torch.Tensor:  # float16 [N, B] -> uint8 [N, B, 2]
    return t.contiguous().view(torch.uint8).view(*t.shape, 2)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` float -> Q8_0 blocks ``[N, ceil(K / 32) * 34]`` uint8: per block,
    d = max |w| / 127 (stored float16), q = round(w / d)."""
    blocks = _pad_blocks(weight)
    d = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16)
    df = d.float()
    q = torch.round(blocks / torch.where(df > 0, df, 1.0)[..., None]).clamp(-127, 127).to(torch.int8)
    out = torch.cat((_half_bytes(d), q.view(torch.uint8)), dim=-1)
    return out.view(weight.shape[0], -1).contiguous()


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` float -> Q4_1 blocks ``[N, ceil(K / 32) * 20]`` uint8: per block, m = min
    and d = (max - min) / 15 (stored float16), q = round((w - m) / d) in [0, 15]."""
    blocks = _pad_blocks(weight)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d, m = ((high - low) / 15.0).to(torch.float16), low.to(torch.float16)
    df, mf = d.float(), m.float()
    q = torch.round((blocks - mf[..., None]) / torch.where(df > 0, df, 1.0)[..., None]).clamp(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    out = torch.cat((_half_bytes(d), _half_bytes(m), packed), dim=-1)
    return out.view(weight.shape[0], -1).contiguous()


def gguf_block_parts(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF blocks ``[N, row bytes]`` -> their parts, ``w = d * q + m`` per block of 32:
    d and m float32 ``[N, blocks]``, q int8 ``[N, blocks * 32]``. Q8_0 has no m: it is -0,
    which leaves ``d * q`` as it is (zeros' signs included); Q4_1's q are 0-15, the low
    nibbles of the 16 bytes (weights 0-15), then the high ones (16-31)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, GGUF_BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float().reshape(n, -1)
    if qtype == "Q8_0":
        return d, torch.full_like(d, -0.0), b[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
    packed = b[..., 4:]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).view(torch.int8).reshape(n, -1)
    return d, b[..., 2:4].contiguous().view(torch.float16).float().reshape(n, -1), q


def dequantize_gguf(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """GGUF blocks ``[N, row bytes]`` -> float32 ``[N, in_features]``, as llama.cpp's
    reference computes them (a product, then a sum: no FMA; d * q is exact in float32)."""
    d, m, q = gguf_block_parts(blocks, qtype)
    n = blocks.shape[0]
    w = d[..., None] * q.view(n, -1, GGUF_BLOCK).float() + m[..., None]
    return w.reshape(n, -1)[:, :in_features]


def round_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` -> float32 ``[M, K]``, each block of 32 along K rounded to 8 bits: d =
    max|x| / 127, x^ = d * round(x / d) (ties to even; an all-zero block stays zero, a block
    holding a value that is not finite becomes NaN). What GGUF weights multiply (the native
    kernel computes the same values)."""
    m, k = x.shape
    blocks = torch.nn.functional.pad(x.to(torch.float32), (0, -k % GGUF_BLOCK)).view(m, -1, GGUF_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(d == 0, torch.zeros_like(blocks), torch.round(blocks / d))
    return (q * d).view(m, -1)[:, :k]


def gguf_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:  # [M, N]
    """Torch reference: ``round_activations_q8(x) @ dequantize_gguf(blocks).T`` in float32,
    cast to x's dtype."""
    w = dequantize_gguf(blocks, qtype, x.shape[1])
    return (round_activations_q8(x) @ w.T).to(x.dtype)


def gguf_matmul_native(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:  # [M, N]
    """The native kernel (kernels/csrc/quant_matmul.cpp; needs splitserve_kernels.native loaded)."""
    y = torch.ops.splitserve.gguf_linear(x.to(torch.float32).contiguous(), blocks, GGUF_KINDS[qtype])
    return y.to(x.dtype)
