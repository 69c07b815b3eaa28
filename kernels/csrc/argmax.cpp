// Greedy tokens: the index of each row's largest logit, the first one on ties, as
// torch.argmax / max(dim).indices compute it (a NaN counts as the largest, the first NaN
// wins, as in torch). ATen's reduction ran a [64, 49152] batch on one thread in ~1.5 ms, a
// pass over 12 MB; here the rows are split over the intra-op threads and each row is one
// vectorised pass: every lane keeps its largest value and the first index it was seen at,
// and the lanes are merged at the end (largest value, then smallest index).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace splitserve {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kVec = Vec::size();

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
  }
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_at = 0;
  int64_t i = 0;
  if (n >= kVec) {
    // Indices as floats: exact below 2^24 (checked by the caller).
    Vec lane_best = Vec::loadu(x), lane_at = Vec::arange(0.0f, 1.0f), at = lane_at, nan_seen = lane_best.isnan();
    for (i = kVec; i + kVec <= n; i += kVec) {
      at = at + Vec(static_cast<float>(kVec));
      const Vec v = Vec::loadu(x + i);
      const Vec greater = v > lane_best;  // false for NaN: NaNs are looked for apart
      lane_best = Vec::blendv(lane_best, v, greater);
      lane_at = Vec::blendv(lane_at, at, greater);
      nan_seen = nan_seen | v.isnan();
    }
    float values[kVec], where[kVec], nans[kVec];
    lane_best.store(values);
    lane_at.store(where);
    nan_seen.store(nans);
    bool any_nan = false;
    for (int l = 0; l < kVec; ++l) {
      uint32_t bits;
      std::memcpy(&bits, &nans[l], sizeof(bits));
      any_nan = any_nan || bits != 0;
    }
    if (any_nan) return first_nan(x, n);
    best = values[0];
    best_at = static_cast<int64_t>(where[0]);
    for (int l = 1; l < kVec; ++l) {
      const int64_t w = static_cast<int64_t>(where[l]);
      if (values[l] > best || (values[l] == best && w < best_at)) {
        best = values[l];
        best_at = w;
      }
    }
  } else if (n > 0) {
    best = x[0];
    i = 1;
    if (std::isnan(best)) return 0;
  }
  for (; i < n; ++i) {  // the tail, after every vector's index
    if (std::isnan(x[i])) return i;
    if (x[i] > best) {
      best = x[i];
      best_at = i;
    }
  }
  return best_at;
}

at::Tensor argmax_rows_cpu(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
                    "argmax_rows: logits must be float32 [rows, vocab] with unit stride along vocab, got ",
                    logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK_VALUE(n > 0 && n < (int64_t{1} << 24), "argmax_rows: vocab must be in [1, 2^24), got ", n);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  // ~64K logits per task: a batch-1 row stays on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * stride, n);
  });
  return out;
}

}  // namespace
}  // namespace splitserve

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("argmax_rows", &splitserve::argmax_rows_cpu);
}
