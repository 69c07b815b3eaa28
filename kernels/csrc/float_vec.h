// Float vectors of the CPU capability a library is compiled for (setup.py's variants):
// __m512 (16 lanes) under AVX-512, __m256 (8 lanes) under AVX2, a plain 8-float struct
// elsewhere; the few operations the linear kernels (panel_gemm.cpp, quant_matmul.cpp) need.
// vhalves: kLanes float16 values as floats; vint8s: kLanes int8 values as floats; vsum_each:
// lane i = the sum of v[i]'s lanes.
// kMaxRowTile: how many activation rows a kernel keeps accumulators for per weight row
// (AVX-512 has 32 vector registers, AVX2 16).
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/Half.h>
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
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, VF a) { _mm512_storeu_ps(p, a); }
inline float vsum(VF a) { return _mm512_reduce_add_ps(a); }
inline VF vhalves(const uint16_t* h) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))); }
inline VF vint8s(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
// Lane i of the result: the sum of the lanes of v[i] (kLanes vectors).
inline VF vsum_each(const VF* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // pairs of lanes within 128-bit lanes
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane j of b[i]: lane j's sums of v[4i .. 4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // add the 128-bit lanes pairwise
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}
#elif defined(CPU_CAPABILITY_AVX2)
using VF = __m256;
constexpr int kLanes = 8;
constexpr int kMaxRowTile = 2;
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vset(float a) { return _mm256_set1_ps(a); }
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, VF a) { _mm256_storeu_ps(p, a); }
inline float vsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VF vhalves(const uint16_t* h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))); }
inline VF vint8s(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
// Lane i of the result: the sum of the lanes of v[i] (kLanes vectors).
inline VF vsum_each(const VF* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // 128-bit lane h: v[0..3] / v[4..7] halves
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
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
inline VF vadd(VF a, VF b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline void vstore(float* p, VF a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline float vsum(VF a) {
  float s = 0.0f;
  for (float x : a.v) s += x;
  return s;
}
inline VF vhalves(const uint16_t* h) {
  VF r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
  return r;
}
inline VF vint8s(const int8_t* q) {
  VF r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(q[i]);
  return r;
}
inline VF vsum_each(const VF* v) {
  VF r;
  for (int i = 0; i < 8; ++i) r.v[i] = vsum(v[i]);
  return r;
}
#endif

}  // namespace fvec
}  // namespace splitserve
