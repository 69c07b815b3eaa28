// Float vectors of the CPU capability a library is compiled for (setup.py's variants):
// __m512 (16 lanes) under AVX-512, __m256 (8 lanes) under AVX2, a plain 8-float struct
// elsewhere; the few operations the linear kernels (dense_gemv.cpp, quant_matmul.cpp) need.
// kMaxRowTile: how many activation rows a kernel keeps accumulators for per weight row
// (AVX-512 has 32 vector registers, AVX2 16).
#pragma once

#include <cstring>

#include <immintrin.h>

namespace splitserve {
namespace fvec {

#if defined(CPU_CAPABILITY_AVX512)
using VF = __m512;
constexpr int kLanes = 16;
constexpr int kMaxRowTile = 4;
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vset(float a) { return _mm512_set1_ps(a); }
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline float vsum(VF a) { return _mm512_reduce_add_ps(a); }
#elif defined(CPU_CAPABILITY_AVX2)
using VF = __m256;
constexpr int kLanes = 8;
constexpr int kMaxRowTile = 2;
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vset(float a) { return _mm256_set1_ps(a); }
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline float vsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
struct VF {
  float v[8];
};
constexpr int kLanes = 8;
constexpr int kMaxRowTile = 2;
inline VF vzero() { return VF{}; }
inline VF vset(float a) {
  VF r;
  for (float& x : r.v) x = a;
  return r;
}
inline VF vload(const float* p) {
  VF r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline VF vfma(VF a, VF b, VF c) {
  for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline VF vmul(VF a, VF b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline float vsum(VF a) {
  float s = 0.0f;
  for (float x : a.v) s += x;
  return s;
}
#endif

}  // namespace fvec
}  // namespace splitserve
