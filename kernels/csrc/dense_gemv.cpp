// Skinny float32 linear on CPU: y[M, N] = x[M, K] @ w[N, K].T (+ bias), for the few
// activation rows of a decode step (M small: batch-1 and small batches).
//
// At those sizes the layer is bound by reading the weight once. MKL's sgemv reached about
// 15 GB/s on the 2-core machines we measure, one thread or two (it does not split a GEMV
// across the team there), against 37 GB/s that a plain two-thread sum over the same bytes
// reaches. Here the weight rows are split over the intra-op threads, NT rows at a time, and
// each tile of NT weight rows is read once from memory while every group of MT activation
// rows passes over it (the tile stays in L1/L2 between groups).
//
// Per output: sum_k x[m, k] * w[n, k] in vector lanes (fused multiply-add), the lanes summed
// at the end, then the bias. The order of float rounding differs from a BLAS GEMM's; the
// operands and the exact result are the same.
#include <algorithm>
#include <cstdint>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "float_vec.h"

namespace splitserve {
namespace {

using namespace fvec;
constexpr int kMaxMT = kMaxRowTile;

constexpr int kNT = 4;  // weight rows per tile

struct Problem {
  const float* x;  // [M, K], row stride ldx
  int64_t ldx;
  const float* w;  // [N, K], row stride ldw
  int64_t ldw;
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t M, N, K;
};

// y[m0 : m0 + MT, n0 : n0 + NT]
template <int NT, int MT>
void tile(const Problem& p, int64_t n0, int64_t m0) {
  VF acc[NT][MT];
  for (int a = 0; a < NT; ++a) {
    for (int i = 0; i < MT; ++i) acc[a][i] = vzero();
  }
  const int64_t kv = p.K / kLanes * kLanes;
  const float* w0 = p.w + n0 * p.ldw;
  const float* x0 = p.x + m0 * p.ldx;
  for (int64_t k = 0; k < kv; k += kLanes) {
    VF wv[NT];
    for (int a = 0; a < NT; ++a) {
      // The next tile's rows at this column (NT rows further on): NT interleaved streams
      // need help to keep enough loads in flight.
      __builtin_prefetch(w0 + (a + NT) * p.ldw + k, 0, 0);
      wv[a] = vload(w0 + a * p.ldw + k);
    }
    for (int i = 0; i < MT; ++i) {
      const VF xv = vload(x0 + i * p.ldx + k);
      for (int a = 0; a < NT; ++a) acc[a][i] = vfma(wv[a], xv, acc[a][i]);
    }
  }
  for (int a = 0; a < NT; ++a) {
    for (int i = 0; i < MT; ++i) {
      float s = vsum(acc[a][i]);
      for (int64_t k = kv; k < p.K; ++k) s += x0[i * p.ldx + k] * w0[a * p.ldw + k];
      if (p.bias != nullptr) s += p.bias[n0 + a];
      p.y[(m0 + i) * p.N + n0 + a] = s;
    }
  }
}

// Weight rows [n0, n0 + NT) against every activation row, kMaxMT rows at a time.
template <int NT>
void rows(const Problem& p, int64_t n0) {
  int64_t m = 0;
  for (; m + kMaxMT <= p.M; m += kMaxMT) tile<NT, kMaxMT>(p, n0, m);
  if constexpr (kMaxMT > 2) {
    for (; m + 2 <= p.M; m += 2) tile<NT, 2>(p, n0, m);
  }
  for (; m < p.M; ++m) tile<NT, 1>(p, n0, m);
}

at::Tensor dense_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
                    "dense_gemv: x must be float32 [M, K] with unit stride along K, got ", x.scalar_type(), " ",
                    x.sizes(), " strides ", x.strides());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.stride(1) == 1,
                    "dense_gemv: weight must be float32 [N, K] with unit stride along K, got ",
                    weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), "dense_gemv: x has K = ", x.size(1), ", weight has ",
                    weight.size(1));
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                          bias->is_contiguous(),
                      "dense_gemv: bias must be contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const Problem p{x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), weight.stride(0), b,
                  y.data_ptr<float>(), M, N, K};
  const int64_t tiles = (N + kNT - 1) / kNT;
  // ~32K weights (128 KB) per task at least: enough to amortise a task, small enough that a
  // 576 x 576 projection still splits over two threads.
  const int64_t grain = std::max<int64_t>(1, 32768 / (kNT * std::max<int64_t>(K, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNT;
      if (n0 + kNT <= N) {
        rows<kNT>(p, n0);
      } else {
        for (int64_t n = n0; n < N; ++n) rows<1>(p, n);
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace splitserve

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("dense_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("dense_gemv", &splitserve::dense_gemv_cpu);
}
