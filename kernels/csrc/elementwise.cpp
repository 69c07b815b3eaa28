// Fused elementwise ops of a decoder layer: RMSNorm, residual add + RMSNorm, rotary
// embedding in place, SiLU(gate) * up. One pass and one dispatcher call each, where eager
// torch makes 3-9 ops and as many passes over the activations. The arithmetic is the torch
// references' (kernels/splitserve_kernels/elementwise.py) operation for operation (no FMA contraction:
// setup.py builds with -ffp-contract=off), except the order in which the RMSNorm sums
// its squares.
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "elementwise.h"

namespace splitserve {
namespace {

using Vec = at::vec::Vectorized<float>;

// Rows per task: ~128K elements, so that a decode step's activations (64 x 576 here) stay
// on one thread; forking the team costs more than such a pass.
int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, 131072 / std::max<int64_t>(row_len, 1));
}

// SiLU takes an exp and a division per element, ~8x a norm's work per element: ~16K per task,
// so a decode step's [64, 1536] splits over the threads (one thread took ~60 us of it).
int64_t exp_row_grain(int64_t row_len) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1));
}

template <typename scalar_t>
float mean_of_squares(const scalar_t* x, int64_t n) {
  float sum = 0.0f;
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    Vec acc(0.0f);
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec v = Vec::loadu(x + i);
      acc = acc + v * v;
    }
    sum = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
  }
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return sum / static_cast<float>(n);
}

// out = weight * cast(x * rsqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm.
template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(mean_of_squares(x, n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(x[i]) * inv);
    out[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [rows, hidden] with rows of "
                    "unit stride, got ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), op,
                    ": weight must be a contiguous [", x.size(1), "], got ", weight.sizes());
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() && x.device().is_cpu(), op,
                    ": x and weight must be CPU tensors of one dtype");
}

// x += residual over one row, elementwise in x's dtype (as ATen's add_).
template <typename scalar_t>
void add_row(scalar_t* x, const scalar_t* residual, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (; i + Vec::size() <= n; i += Vec::size()) {
      (Vec::loadu(x + i) + Vec::loadu(residual + i)).store(x + i);
    }
  }
  for (; i < n; ++i) x[i] = static_cast<scalar_t>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
}

// out = rms_norm(x) row by row; with a residual, x += residual first, in the same task (one
// parallel region, none below row_grain rows, where a separate add_ forked the team).
template <typename scalar_t>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, at::Tensor& out,
               double eps) {
  const int64_t n = x.size(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* rp = residual != nullptr ? residual->data_ptr<scalar_t>() : nullptr;
  const int64_t r_stride = residual != nullptr ? residual->stride(0) : 0;
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = xp + r * x.stride(0);
      if (rp != nullptr) add_row(row, rp + r * r_stride, n);
      rms_norm_row(row, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

// x = x * cos + roll(x, half) * signed_sin over one head, in place (x copied first).
void rotate_head(float* x, const float* cos, const float* sin, int64_t D, float* tmp) {
  const int64_t half = D / 2;
  std::copy(x, x + D, tmp);
  int64_t d = 0;
  for (; d + Vec::size() <= half; d += Vec::size()) {  // first half reads the second, and back
    const Vec lo = Vec::loadu(tmp + d) * Vec::loadu(cos + d) + Vec::loadu(tmp + d + half) * Vec::loadu(sin + d);
    const Vec hi = Vec::loadu(tmp + d + half) * Vec::loadu(cos + d + half) +
                   Vec::loadu(tmp + d) * Vec::loadu(sin + d + half);
    lo.store(x + d);
    hi.store(x + d + half);
  }
  for (; d < half; ++d) {
    x[d] = tmp[d] * cos[d] + tmp[d + half] * sin[d];
    x[d + half] = tmp[d + half] * cos[d + half] + tmp[d] * sin[d + half];
  }
}

// out[r, i] = silu(g) * u with g = gate_up[r, i], u = gate_up[r, n + i]; silu as torch's
// kernel computes it: g / (1 + exp(-g)).
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  const Vec one(1.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec g = Vec::loadu(gate + i);
    ((g / (one + g.neg().exp())) * Vec::loadu(up + i)).store(out + i);
  }
  if (i < n) {
    const int64_t rest = n - i;
    const Vec g = Vec::loadu(gate + i, rest);
    ((g / (one + g.neg().exp())) * Vec::loadu(up + i, rest)).store(out + i, rest);
  }
}

}  // namespace

void rotary_cpu(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK_VALUE(qk.dim() == 3 && qk.stride(2) == 1 && qk.scalar_type() == at::kFloat &&
                        qk.size(2) % 2 == 0 && qk.device().is_cpu(),
                    "rotary_: qk must be a float32 CPU [tokens, heads, head_dim] (even head_dim) "
                    "with unit stride along head_dim, got ", qk.sizes(), " ", qk.scalar_type());
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK_VALUE(t->numel() == T * D && t->is_contiguous() && t->scalar_type() == at::kFloat,
                      "rotary_: cos and sin must be contiguous float32 [tokens, (1,) head_dim], got ",
                      t->sizes());
  }
  float* base = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, row_grain(H * D), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        rotate_head(base + t * qk.stride(0) + h * qk.stride(1), cp + t * D, sp + t * D, D, tmp.data());
      }
    }
  });
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0 &&
                        gate_up.scalar_type() == at::kFloat && gate_up.device().is_cpu(),
                    "silu_mul: gate_up must be a float32 CPU [rows, 2 * inter] with unit stride, got ",
                    gate_up.sizes(), " ", gate_up.scalar_type());
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, exp_row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = gp + r * gate_up.stride(0);
      silu_mul_row(row, row + n, op + r * n, n);
    }
  });
  return out;
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu",
                                  [&] { norm_rows<scalar_t>(x, nullptr, weight, out, eps); });
  return out;
}

at::Tensor add_rms_norm_cpu(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                            double eps) {
  check_rows(x, weight, "add_rms_norm_");
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
                    "add_rms_norm_: residual must match x, got ", residual.sizes());
  TORCH_CHECK_VALUE(residual.dim() == 2 && residual.stride(1) == 1, "add_rms_norm_: residual rows "
                    "must have unit stride, got strides ", residual.strides());
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_cpu",
                                  [&] { norm_rows<scalar_t>(x, &residual, weight, out, eps); });
  return out;
}

}  // namespace splitserve
