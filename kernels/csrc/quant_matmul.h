// Weight-only quantized linear over GGUF blocks (kernels/csrc/quant_matmul.cpp).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace splitserve {

// What a row of blocks holds: kinds as splitserve_kernels.quant_matmul.GGUF_KINDS numbers them.
enum GGUFKind : int64_t { kQ8_0 = 0, kQ4_1 = 1 };

// y[M, N] = x[M, K] @ dequantize(blocks).T, blocks [N, row bytes] uint8 in `kind`'s blocks of
// 32; x float32 with unit stride along K (Q4_1 rounds it to 8 bits per block first).
at::Tensor gguf_linear_cpu(const at::Tensor& x, const at::Tensor& blocks, int64_t kind);

}  // namespace splitserve
