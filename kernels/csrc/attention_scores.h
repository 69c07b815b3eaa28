// Scores of one query row against a chunk of up to kChunk keys: s[t] = q . k_t.
//
// Two ways, chosen per work item by attend_keys (paged_attention.cpp):
// * transposed: the chunk's keys are transposed once into kt [head_dim, kChunk] and each
//   row is head_dim broadcast-FMAs over contiguous vectors. The transpose is paid once per
//   chunk for all rows, so this serves tiles with many rows (prefill) on any CPU.
// * direct (AVX-512 and AVX2): each key row is multiplied with q along head_dim, giving one
//   vector of partial sums per key, and a shuffle tree sums 16 (AVX2: 8) such vectors at
//   once. No transpose, so it serves decode (a GQA group's few rows per chunk).
#pragma once

#include <cstdint>
#include <type_traits>

#include <ATen/cpu/vec/vec.h>

namespace splitserve {

constexpr int kChunk = 16;  // keys per online-softmax step

using Vec = at::vec::Vectorized<float>;
constexpr int kVec = Vec::size();
static_assert(kChunk % kVec == 0, "a key chunk must be whole vectors");
constexpr int kChunkVecs = kChunk / kVec;
constexpr int kWide = 2 * kChunk;  // keys per online-softmax step of a float prefill tile
constexpr int kWideVecs = kWide / kVec;

// kt[d * ld + t] = k_t[d] for the n <= kChunk rows k (slot_stride apart); the columns past n
// are left as they are.
inline void transpose_keys_into(const float* k, int64_t slot_stride, int n, int D, float* kt, int ld) {
  if (n == kChunk && D % 16 == 0) {
    for (int d0 = 0; d0 < D; d0 += 16) at::vec::transpose_mxn<float, 16, 16>(k + d0, slot_stride, kt + d0 * ld, ld);
    return;
  }
  for (int t = 0; t < n; ++t) {
    const float* row = k + t * slot_stride;
    for (int d = 0; d < D; ++d) kt[d * ld + t] = row[d];
  }
}

// kt[d * kChunk + t] = k[t * slot_stride + d] for t < n, 0 for n <= t < kChunk.
template <typename scalar_t>
inline void transpose_keys(const scalar_t* k, int64_t slot_stride, int n, int D, float* kt) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (n == kChunk && D % 16 == 0) return transpose_keys_into(k, slot_stride, n, D, kt, kChunk);
  }
  for (int t = 0; t < kChunk; ++t) {
    const scalar_t* row = k + t * slot_stride;
    for (int d = 0; d < D; ++d) {
      kt[d * kChunk + t] = t < n ? static_cast<float>(row[d]) : 0.0f;
    }
  }
}

// s[0:kChunk] from transposed keys (two FMA chains per vector, for the FMA latency).
template <int kD>
inline void scores_transposed(const float* q, const float* kt, int head_dim, float* s) {
  const int D = kD > 0 ? kD : head_dim;
  Vec acc0[kChunkVecs], acc1[kChunkVecs];
  for (int j = 0; j < kChunkVecs; ++j) {
    acc0[j] = Vec(0.0f);
    acc1[j] = Vec(0.0f);
  }
  int d = 0;
  for (; d + 1 < D; d += 2) {
    const Vec q0(q[d]), q1(q[d + 1]);
    for (int j = 0; j < kChunkVecs; ++j) {
      acc0[j] = at::vec::fmadd(q0, Vec::loadu(kt + d * kChunk + j * kVec), acc0[j]);
      acc1[j] = at::vec::fmadd(q1, Vec::loadu(kt + (d + 1) * kChunk + j * kVec), acc1[j]);
    }
  }
  if (d < D) {
    const Vec q0(q[d]);
    for (int j = 0; j < kChunkVecs; ++j) {
      acc0[j] = at::vec::fmadd(q0, Vec::loadu(kt + d * kChunk + j * kVec), acc0[j]);
    }
  }
  for (int j = 0; j < kChunkVecs; ++j) {
    (acc0[j] + acc1[j]).store(s + j * kVec);
  }
}

// Ask for one float key or value row of kD floats (into L2, as prefetch_rows does).
template <int kD>
inline void prefetch_row(const float* row) {
  for (int b = 0; b < kD * static_cast<int>(sizeof(float)); b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, 2);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kHasDirectScores = true;

// Lane i of the result is the sum of the 16 lanes of v[i].
inline __m512 sum_each_of_16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // pairs of lanes within 128-bit lanes
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane j of b[i]: lane j's sums of v[4i .. 4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // add the 128-bit lanes pairwise
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// s[0:16] straight from n <= 16 float key rows (slot_stride apart); s[t] = 0 for t >= n.
// With `ahead`, its first `ahead_n` rows (slot_stride apart) are asked for, one per key scored.
template <int kD>
inline void scores_direct(const float* q, const float* k, int64_t slot_stride, int n, float* s,
                          const float* ahead = nullptr, int ahead_n = 0) {
  static_assert(kD > 0 && kD % 16 == 0, "the direct path needs a head_dim of whole vectors");
  constexpr int kN = kD / 16;
  __m512 qv[kN], partial[16];
  for (int j = 0; j < kN; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
  if (n == 16) {  // a whole chunk: no test per key, so the compiler unrolls it
    for (int t = 0; t < 16; ++t) {
      if (t < ahead_n) prefetch_row<kD>(ahead + t * slot_stride);
      const float* row = k + t * slot_stride;
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < kN; ++j) acc = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(row + 16 * j), acc);
      partial[t] = acc;
    }
  } else {
    for (int t = 0; t < 16; ++t) {
      if (t < ahead_n) prefetch_row<kD>(ahead + t * slot_stride);
      __m512 acc = _mm512_setzero_ps();
      if (t < n) {
        const float* row = k + t * slot_stride;
        for (int j = 0; j < kN; ++j) acc = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(row + 16 * j), acc);
      }
      partial[t] = acc;
    }
  }
  _mm512_storeu_ps(s, sum_each_of_16(partial));
}
#elif defined(CPU_CAPABILITY_AVX2)
constexpr bool kHasDirectScores = true;

// Lane i of the result is the sum of the 8 lanes of v[i].
inline __m256 sum_each_of_8(const __m256* v) {
  // hadd pairs lanes within each 128-bit half: b0 holds v[0..3]'s sums of lanes 0-3 in its
  // low half and of lanes 4-7 in its high half, b1 the same for v[4..7].
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// s[0:8] for 8 whole key rows: all trip counts are constants, so this unrolls without a test.
template <int kD>
inline void scores_direct_8(const float* q, const float* k, int64_t slot_stride, float* s,
                            const float* ahead, int ahead_n) {
  constexpr int kN = kD / 8;
  constexpr int kQPart = 4;
  static_assert(kN % kQPart == 0, "whole parts of q (head_dim 32, 64, 96, 128)");
  __m256 partial[8];
  for (int t = 0; t < 8; ++t) partial[t] = _mm256_setzero_ps();
  for (int j0 = 0; j0 < kN; j0 += kQPart) {
    __m256 qv[kQPart];
    for (int j = 0; j < kQPart; ++j) qv[j] = _mm256_loadu_ps(q + 8 * (j0 + j));
    for (int t = 0; t < 8; ++t) {
      if (j0 == 0 && t < ahead_n) prefetch_row<kD>(ahead + t * slot_stride);  // one row per key
      const float* row = k + t * slot_stride + 8 * j0;
      for (int j = 0; j < kQPart; ++j) partial[t] = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(row + 8 * j), partial[t]);
    }
  }
  _mm256_storeu_ps(s, sum_each_of_8(partial));
}

// As the AVX-512 version, eight keys at a time: q is taken four vectors at a time, so its
// part and the eight keys' partial sums fit the 16 vector registers.
template <int kD>
inline void scores_direct(const float* q, const float* k, int64_t slot_stride, int n, float* s,
                          const float* ahead = nullptr, int ahead_n = 0) {
  static_assert(kD > 0 && kD % 16 == 0, "the direct path needs a head_dim of whole vectors");
  constexpr int kN = kD / 8;
  constexpr int kQPart = 4;
  if (n == kChunk) {
    scores_direct_8<kD>(q, k, slot_stride, s, ahead, ahead_n);
    scores_direct_8<kD>(q, k + 8 * slot_stride, slot_stride, s + 8,
                        ahead_n > 8 ? ahead + 8 * slot_stride : nullptr, ahead_n - 8);
    return;
  }
  for (int t = 0; t < ahead_n; ++t) prefetch_row<kD>(ahead + t * slot_stride);
  for (int t0 = 0; t0 < kChunk; t0 += 8) {
    if (t0 >= n) {
      _mm256_storeu_ps(s + t0, _mm256_setzero_ps());
      continue;
    }
    __m256 partial[8];
    for (int t = 0; t < 8; ++t) partial[t] = _mm256_setzero_ps();
    for (int j0 = 0; j0 < kN; j0 += kQPart) {
      __m256 qv[kQPart];
      for (int j = 0; j < kQPart && j0 + j < kN; ++j) qv[j] = _mm256_loadu_ps(q + 8 * (j0 + j));
      for (int t = 0; t < 8; ++t) {
        if (t0 + t < n) {
          const float* row = k + (t0 + t) * slot_stride + 8 * j0;
          for (int j = 0; j < kQPart && j0 + j < kN; ++j) {
            partial[t] = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(row + 8 * j), partial[t]);
          }
        }
      }
    }
    _mm256_storeu_ps(s + t0, sum_each_of_8(partial));
  }
}
#else
constexpr bool kHasDirectScores = false;

template <int kD>
inline void scores_direct(const float*, const float*, int64_t, int, float*, const float* = nullptr, int = 0) {}
#endif

}  // namespace splitserve
