// Rows of the int8 KV cache (kernels/splitserve_kernels/kv_int8.py): head_dim int8 values, then the row's
// float32 scale (native byte order); x[d] = q[d] * scale.
#pragma once

#include <cstdint>
#include <cstring>

namespace splitserve {

// out[t * D + d] = q[t][d] * scale[t] for the n rows at rows + t * slot_stride (bytes). With
// `ahead`, the first ahead_n rows there (as far apart) are asked for, one per row converted.
inline void dequantize_rows(const int8_t* rows, int64_t slot_stride, int n, int D, float* out,
                            const int8_t* ahead = nullptr, int ahead_n = 0) {
  for (int t = 0; t < n; ++t) {
    if (t < ahead_n) {  // a row of D + 4 bytes may end in the next cache line
      __builtin_prefetch(ahead + t * slot_stride, 0, 2);
      __builtin_prefetch(ahead + t * slot_stride + D + 3, 0, 2);
    }
    const int8_t* row = rows + t * slot_stride;
    float scale;
    std::memcpy(&scale, row + D, sizeof(float));
    float* dst = out + t * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(row[d]) * scale;
  }
}

}  // namespace splitserve
