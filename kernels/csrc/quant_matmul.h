// Weight-only quantized linear over GGUF blocks (kernels/csrc/quant_matmul.cpp).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace splitserve {

// What a row of blocks holds: kinds as splitserve_kernels.quant_matmul.GGUF_KINDS numbers them.
enum GGUFKind : int64_t { kQ8_0 = 0, kQ4_1 = 1 };
constexpr int kBlock = 32;                        // weights per block
constexpr int64_t kBlockBytes[2] = {34, 20};      // bytes per block, by kind

// The kind whose blocks make rows of `row_bytes` for K inputs (whole blocks), or -1.
inline int64_t gguf_kind_of(int64_t row_bytes, int64_t K) {
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  if (row_bytes == blocks * kBlockBytes[kQ8_0]) return kQ8_0;
  if (row_bytes == blocks * kBlockBytes[kQ4_1]) return kQ4_1;
  return -1;
}

// y[M, N] = x^[M, K] @ dequantize(blocks).T, blocks [N, row bytes] uint8 in `kind`'s blocks of
// 32; x float32 with unit stride along K, rounded to 8 bits per block of 32 first.
at::Tensor gguf_linear_cpu(const at::Tensor& x, const at::Tensor& blocks, int64_t kind);

}  // namespace splitserve
