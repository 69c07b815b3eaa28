// Fused elementwise ops of a decoder layer (kernels/csrc/elementwise.cpp); references in
// kernels/splitserve_kernels/elementwise.py.
#pragma once

#include <ATen/core/Tensor.h>

namespace splitserve {

// weight * cast(x * rsqrt(mean(x^2) + eps)) per row; x [rows, hidden] with unit-stride rows.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);

// x += residual (in place), then rms_norm(x).
at::Tensor add_rms_norm_cpu(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                            double eps);

// Rotate-half RoPE in place: qk [tokens, heads, head_dim] float32; cos, signed sin
// [tokens, (1,) head_dim] contiguous.
void rotary_cpu(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin);

// silu(gate_up[:, :n]) * gate_up[:, n:], float32 [rows, 2n] -> [rows, n].
at::Tensor silu_mul_cpu(const at::Tensor& gate_up);

}  // namespace splitserve
