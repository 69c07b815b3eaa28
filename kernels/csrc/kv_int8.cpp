// The quantizing K/V write of the int8 KV cache (kernels/splitserve_kernels/kv_int8.py's write_kv_int8_ref, the
// same arithmetic): per token and KV head, scale = max |x| / 127, q = x / scale rounded half
// away from zero, clamped to [-127, 127]; the row is q then the float32 scale. A row holding a NaN
// or an infinity is stored as zeros under a NaN scale, so it reads back as NaN, never as numbers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <ATen/core/Tensor.h>
#include <ATen/ops/contiguous.h>
#include <ATen/ops/to.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "paged_attention.h"

namespace splitserve {
namespace {

void quantize_row(const float* x, int64_t D, int8_t* row) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t d = 0; d < D; ++d) {
    finite = finite && std::isfinite(x[d]);
    amax = std::max(amax, std::fabs(x[d]));
  }
  if (!finite) {  // a NaN or an infinity stays one: zeros under a NaN scale read back as NaN
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memset(row, 0, static_cast<size_t>(D));
    std::memcpy(row + D, &nan, sizeof(float));
    return;
  }
  const float scale = amax / 127.0f;
  const float safe = scale > 0.0f ? scale : 1.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float y = x[d] / safe;
    const float q = std::copysign(std::floor(std::fabs(y) + 0.5f), y);
    row[d] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
  }
  std::memcpy(row + D, &scale, sizeof(float));
}

void write_one(const at::Tensor& src, const at::Tensor& cache, const int64_t* slots) {
  const int64_t T = src.size(0), H = src.size(1), D = src.size(2), block_size = cache.size(1);
  const float* x = src.data_ptr<float>();
  int8_t* base = cache.data_ptr<int8_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    int8_t* at = base + (slot / block_size) * cache.stride(0) + (slot % block_size) * cache.stride(1);
    for (int64_t h = 0; h < H; ++h) quantize_row(x + t * src.stride(0) + h * src.stride(1), D, at + h * cache.stride(2));
  }
}

}  // namespace

void write_kv_int8_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes() && key.scalar_type() == at::kFloat &&
                        value.scalar_type() == at::kFloat,
                    "write_kv_int8: key and value must both be float32 [num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                        k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar &&
                        k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2) + 4 &&
                        k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                    "write_kv_int8: caches must be int8 [num_blocks, block_size, num_kv_heads, head_dim + 4] "
                    "with contiguous rows, got ", k_cache.sizes());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
                    "write_kv_int8: slot_mapping must be [num_tokens=", key.size(0), "]");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  write_one(k, k_cache, slots.data_ptr<int64_t>());
  write_one(v, v_cache, slots.data_ptr<int64_t>());
}

}  // namespace splitserve

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("write_kv_int8(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("write_kv_int8", &splitserve::write_kv_int8_cpu);
}
