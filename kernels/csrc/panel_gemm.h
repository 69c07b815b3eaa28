// Float32 linear over a weight packed in column panels (kernels/csrc/panel_gemm.cpp).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace splitserve {

// y[M, out_features] = x[M, K] @ weight.T (+ bias), the weight as pack_panels (float32) or
// pack_block_panels (uint8) laid it out; x float32 with unit stride along K.
at::Tensor panel_linear_cpu(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                            const std::optional<at::Tensor>& bias);

}  // namespace splitserve
