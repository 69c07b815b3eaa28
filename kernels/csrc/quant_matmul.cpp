// Weight-only quantized linear on CPU over llama.cpp's blocks of 32 weights, kept as the
// GGUF file stores them (kernels/splitserve_kernels/quant_matmul.py documents the formats):
//
//   Q8_0  34 bytes: fp16 d, then 32 int8 q            w = d * q
//   Q4_1  20 bytes: fp16 d, fp16 m, then 16 bytes     w = d * q + m, q in [0, 15]; byte j holds
//                   weight j (low nibble) and j + 16 (high nibble)
//
// y[i, n] = sum_k x[i, k] * w[n, k], dequantized in registers:
//   sum_b ( d_b * sum_{k in b} q_k x_k  +  m_b * sum_{k in b} x_k )
// Both take x rounded to 8 bits per block of 32 (below, row_tile_x8), at every batch size.
// The integer weights become floats exactly; only the order of float rounding differs from
// x^ @ dequantize(W).T (the per-block sums are taken first, then scaled by d).
//
// Tiles: NT weight rows x MT activation rows share each dequantized block; the weight rows of
// a tile stay in L1 while every MT-row group of x passes over them, so the weights stream
// from memory once per call whatever M is. Work is split over N on the intra-op threads.
// One activation row (batch-1 decode) takes row_tile_x8 instead: a row's blocks in groups of
// kLanes, each block's dot in exact integers, its scales applied by one FMA per block pair.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "float_vec.h"
#include "quant_matmul.h"

namespace splitserve {
namespace {


inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

using namespace fvec;

#if defined(CPU_CAPABILITY_AVX512)
// 32 weights of a block as 2 float vectors.
inline void q8_floats(const uint8_t* q, VF* out) {
  for (int j = 0; j < 2; ++j) {
    out[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j))));
  }
}
inline void q4_floats(const uint8_t* qs, VF* out) {
  // byte j -> lane j, then its low nibble is weight j and its high nibble weight j + 16
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
  out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline VF cvt8(__m128i bytes_lo8, bool is_signed) {
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes_lo8) : _mm256_cvtepu8_epi32(bytes_lo8));
}
inline void q8_floats(const uint8_t* q, VF* out) {
  for (int j = 0; j < 4; ++j) out[j] = cvt8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j)), true);
}
inline void q4_floats(const uint8_t* qs, VF* out) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  out[0] = cvt8(lo, false);
  out[1] = cvt8(_mm_srli_si128(lo, 8), false);
  out[2] = cvt8(hi, false);
  out[3] = cvt8(_mm_srli_si128(hi, 8), false);
}
#else
inline void q8_floats(const uint8_t* q, VF* out) {
  for (int i = 0; i < kBlock; ++i) out[i / 8].v[i % 8] = static_cast<float>(static_cast<int8_t>(q[i]));
}
inline void q4_floats(const uint8_t* qs, VF* out) {
  for (int j = 0; j < 16; ++j) {
    out[j / 8].v[j % 8] = static_cast<float>(qs[j] & 0x0F);
    out[2 + j / 8].v[j % 8] = static_cast<float>(qs[j] >> 4);
  }
}
#endif

constexpr int kVecs = kBlock / kLanes;  // float vectors per block

struct Problem {
  const float* x;       // [M, K], row stride ldx
  int64_t ldx;
  const uint8_t* w;     // [N, row_bytes]
  int64_t row_bytes;
  const float* xsum;    // Q4_1: [M, K / 32] block sums of x
  float* y;             // [M, N]
  int64_t M, N, K;
};

// y[m0 : m0 + MT, n0 : n0 + NT] for weight rows n0.. and activation rows m0..
template <int kind, int NT, int MT>
void tile(const Problem& p, int64_t n0, int64_t m0) {
  VF acc[NT][MT];
  float macc[NT][MT];
  for (int a = 0; a < NT; ++a) {
    for (int i = 0; i < MT; ++i) {
      acc[a][i] = vzero();
      macc[a][i] = 0.0f;
    }
  }
  const int64_t blocks = p.K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = p.x + m0 * p.ldx + b * kBlock;
    for (int a = 0; a < NT; ++a) {
      const uint8_t* blk = p.w + (n0 + a) * p.row_bytes + b * kBlockBytes[kind];
      // The same block of the next tile's rows: the weights stream from memory in row
      // order, and NT interleaved streams need help to keep enough loads in flight.
      __builtin_prefetch(blk + NT * p.row_bytes, 0, 0);
      VF q[kVecs];
      if constexpr (kind == kQ8_0) {
        q8_floats(blk + 2, q);
      } else {
        q4_floats(blk + 4, q);
      }
      const VF d = vset(half_to_float(blk));
      for (int i = 0; i < MT; ++i) {
        const float* xr = xb + i * p.ldx;
        VF s = vmul(q[0], vload(xr));
        for (int j = 1; j < kVecs; ++j) s = vfma(q[j], vload(xr + j * kLanes), s);
        acc[a][i] = vfma(d, s, acc[a][i]);
      }
      if constexpr (kind == kQ4_1) {
        const float m = half_to_float(blk + 2);
        for (int i = 0; i < MT; ++i) macc[a][i] += m * p.xsum[(m0 + i) * blocks + b];
      }
    }
  }
  for (int a = 0; a < NT; ++a) {
    for (int i = 0; i < MT; ++i) p.y[(m0 + i) * p.N + n0 + a] = vsum(acc[a][i]) + macc[a][i];
  }
}

// How far ahead of the blocks it reads row_tile_x8 prefetches every cache line of the
// stream: the hardware prefetcher alone kept it waiting on memory. Default model's 121
// projections (Q4_1), one thread, Zen 4: a line per group 64 blocks ahead 17 -> 13 ms
// (AVX2), every line 2 KiB ahead 8.4 ms (AVX2 and AVX-512); 1-4 KiB measure the same.
constexpr int64_t kPrefetchBytes = 2048;

// Every cache line of the `bytes` at `at` is asked for kPrefetchBytes ahead.
inline void prefetch_lines_ahead(const uint8_t* at, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(at + kPrefetchBytes + off, 0, 0);
}

// Activations are x rounded to 8 bits per block of 32 (llama.cpp's Q8_1 for Q4_1, its Q8_0 for
// Q8_0): dx = max|x| / 127, q_x = round(x / dx) (ties to even), x^ = dx * q_x; a block that
// holds a value that is not finite gets dx = NaN, so every output it meets is NaN, as the
// reference's x^ makes it. At every batch size the kernels compute y = x^ @ dequantize(W).T,
// so a request's result does not depend on what it is batched with;
// kernels/splitserve_kernels/quant_matmul.py's reference does the same.
// Many rows: x^ in float, through tile / rows_via_scratch. One row (batch-1 decode, bound
// by the weights' bytes): a block's dot is sum_k q_k q_x,k in exact integer arithmetic, then
//   y = sum_b ( d_b * dx_b * isum_b  [Q4_1: +  m_b * dx_b * sum_k q_x,k] )
// The integer dot is maddubs (unsigned bytes times signed bytes, pairs summed in int16) and
// madd (pairs of those summed in int32). Q4_1: the nibbles times q_x (2 * 15 * 127 < 2^15).
// Q8_0: |q| times q_x carrying q's sign (2 * 128 * 127 < 2^15). Two integer instructions per
// 32 (AVX-512: 64) weights instead of a conversion and an FMA per 16 weights (row_tile_x8;
// measured where it is called).
// q_x's layout follows the kernel. Q4_1's blocks in whole groups of kLanes go in runs of
// kX8Run (AVX-512: 4, AVX2: 2) blocks A, B, ..., each run's weights 0..15 first, then its
// weights 16..31: [A 0..15, B 0..15, ..., A 16..31, B 16..31, ...]. The run's low nibbles
// then load as one vector and its high nibbles as one more. Q4_1's last blocks, past the
// whole groups, and every Q8_0 block are in natural order.
struct X8Problem {
  const int8_t* qx;    // [K], the layout above
  const float* dx;     // [K / 32] x's block scales
  const float* xsum;   // [K / 32] x's block sums
  const uint8_t* w;    // [N, row_bytes]
  int64_t row_bytes;
  float* y;            // [N]
  int64_t N, K;
};

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kX8Run = 4;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kX8Run = 2;
#else
constexpr int64_t kX8Run = 1;
#endif

// Where weight k of block b (of nb) finds its q_x in the layout above.
inline int64_t qx_pos(int64_t kind, int64_t b, int64_t nb, int k) {
  if (kind == kQ4_1 && b < nb / kLanes * kLanes) {
    return b / kX8Run * kX8Run * kBlock + (k / 16) * (16 * kX8Run) + (b % kX8Run) * 16 + k % 16;
  }
  return b * kBlock + k;
}

// One block of x (32 floats) rounded: q (natural order); returns its scale dx, and the
// rounded block's sum dx * sum_k q_k into *sum. Not finite anywhere: q = 0, dx = sum = NaN.
inline float round_block(const float* xb, int8_t* q, float* sum) {
  float amax = 0.0f;
  bool finite = true;
  for (int k = 0; k < kBlock; ++k) {
    amax = std::max(amax, std::abs(xb[k]));
    finite = finite && std::isfinite(xb[k]);
  }
  if (!finite) {
    std::memset(q, 0, kBlock);
    *sum = std::numeric_limits<float>::quiet_NaN();
    return *sum;
  }
  const float d = amax / 127.0f;
  int32_t qsum = 0;
  for (int k = 0; k < kBlock; ++k) {
    q[k] = d == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(xb[k] / d));
    qsum += q[k];
  }
  *sum = d * static_cast<float>(qsum);
  return d;
}

// One row of x (K floats) -> its q_x (kind's layout above), block scales dx and sums xsum.
void quantize_x(int64_t kind, const float* x, int64_t K, int8_t* qx, float* dx, float* xsum) {
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    int8_t q[kBlock];
    dx[b] = round_block(x + b * kBlock, q, xsum + b);
    for (int k = 0; k < kBlock; ++k) qx[qx_pos(kind, b, nb, k)] = q[k];
  }
}

// One row of x (K floats) -> x^ = dx * q_x in float (natural order) and the block sums.
void round_x(const float* x, int64_t K, float* xr, float* xsum) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    int8_t q[kBlock];
    const float d = round_block(x + b * kBlock, q, xsum + b);
    for (int k = 0; k < kBlock; ++k) xr[b * kBlock + k] = d * static_cast<float>(q[k]);
  }
}

constexpr int64_t kQuantsAt[2] = {2, 4};  // where a block's quants start, by kind

// One block's quants against its q_x (natural order) as an exact integer sum.
template <int kind>
int32_t block_isum(const uint8_t* blk, const int8_t* qx) {
  int32_t isum = 0;
  if constexpr (kind == kQ8_0) {
    for (int k = 0; k < kBlock; ++k) isum += static_cast<int8_t>(blk[2 + k]) * qx[k];
  } else {
    for (int k = 0; k < 16; ++k) isum += (blk[4 + k] & 0x0F) * qx[k] + (blk[4 + k] >> 4) * qx[k + 16];
  }
  return isum;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// One block's quants (qs: the first) against its q_x (natural order) as 8 int32 partial sums.
template <int kind>
inline __m256i x8_block(const uint8_t* qs, const int8_t* qx) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  __m256i p16;
  if constexpr (kind == kQ8_0) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m256i nib = _mm256_and_si256(
        _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1), _mm256_set1_epi8(0x0F));
    p16 = _mm256_maddubs_epi16(nib, x);
  }
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
#endif

// A run of kX8Run consecutive Q4_1 blocks (blk: the first one's first byte) against their
// q_x (the run layout above) as int32 partial sums, 4 lanes per block in order. The low and
// high nibbles' products are summed in int16 (4 * 15 * 127 < 2^15) before one madd.
#if defined(CPU_CAPABILITY_AVX512)
inline __m512i q4_1_run(const uint8_t* blk, const int8_t* qx) {
  constexpr int64_t bb = kBlockBytes[kQ4_1];
  const auto quants = [blk](int j) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + j * bb + 4)); };
  __m512i v = _mm512_castsi128_si512(quants(0));
  v = _mm512_inserti32x4(v, quants(1), 1);
  v = _mm512_inserti32x4(v, quants(2), 2);
  v = _mm512_inserti32x4(v, quants(3), 3);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i p16 = _mm512_add_epi16(
      _mm512_maddubs_epi16(_mm512_and_si512(v, mask), _mm512_loadu_si512(qx)),
      _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), _mm512_loadu_si512(qx + 64)));
  return _mm512_madd_epi16(p16, _mm512_set1_epi16(1));
}

// Two consecutive Q8_0 blocks A, B (blk: A's first byte) against their q_x (natural order) as
// 16 int32 partial sums, lanes 0-7 A's and 8-15 B's.
inline __m512i q8_0_pair(const uint8_t* blk, const int8_t* qx) {
  constexpr int64_t bb = kBlockBytes[kQ8_0];
  const __m512i x = _mm512_loadu_si512(qx);
  const __m512i w = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + bb + 2)), 1);
  // x with q's sign: AVX-512 has no vpsignb, so negate where q < 0 (q = 0 multiplies to 0)
  const __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx), _mm512_set1_epi16(1));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline __m256i q4_1_run(const uint8_t* blk, const int8_t* qx) {
  constexpr int64_t bb = kBlockBytes[kQ4_1];
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + bb + 4)), 1);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i p16 = _mm256_add_epi16(
      _mm256_maddubs_epi16(_mm256_and_si256(v, mask), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx))),
      _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32))));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
#endif

// The d of kLanes consecutive Q8_0 blocks (blk: the first one's first byte) as floats.
inline VF q8_0_scales(const uint8_t* blk) {
  alignas(64) uint16_t dh[kLanes];
  for (int j = 0; j < kLanes; ++j) std::memcpy(&dh[j], blk + j * kBlockBytes[kQ8_0], 2);
  return vhalves(dh);
}

// The d and m of kLanes consecutive Q4_1 blocks (blk: the first one's first byte) as floats,
// lane j block j's. Each block's d and m are its first 4 bytes, so the words 10 j and 10 j + 1
// of the group. On AVX-512 the group's 320 bytes are 5 vectors, and 3 word permutes and a
// blend put the 16 d's in the low half of one vector, the m's in its high half (a gather
// measured slower than the scalar loads it replaces, on Zen 4).
inline void q4_1_scales(const uint8_t* blk, VF* d, VF* m) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kLanes * kBlockBytes[kQ4_1] == 5 * 64, "a group of Q4_1 blocks is 5 vectors");
  // word permutes: lane j < 16 takes block j's d, lane 16 + j its m (a: index < 32, b: >= 32)
  alignas(64) static constexpr int16_t kLo[32] = {  // words 0-63 -> blocks 0-6
      0, 10, 20, 30, 40, 50, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 11, 21, 31, 41, 51, 61, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  alignas(64) static constexpr int16_t kMid[32] = {  // words 64-127 -> blocks 7-12
      0, 0, 0, 0, 0, 0, 0, 6, 16, 26, 36, 46, 56, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 17, 27, 37, 47, 57, 0, 0, 0};
  alignas(64) static constexpr int16_t kHi[32] = {  // the two above, then words 128-159 -> blocks 13-15
      0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 34, 44, 54, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 35, 45, 55};
  const auto at = [blk](int v) { return _mm512_loadu_si512(blk + 64 * v); };
  const auto idx = [](const int16_t* i) { return _mm512_load_si512(i); };
  const __m512i lo = _mm512_permutex2var_epi16(at(0), idx(kLo), at(1));
  const __m512i mid = _mm512_permutex2var_epi16(at(2), idx(kMid), at(3));
  const __m512i dm = _mm512_permutex2var_epi16(_mm512_mask_blend_epi16(0x1F801F80u, lo, mid), idx(kHi), at(4));
  *d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
  *m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
#elif defined(CPU_CAPABILITY_AVX2)
  // block j's d | m << 16 is the group's dword 5 j, so lane j of the 8 dwords at byte 16 j:
  // 8 loads, each blended in at its lane
  const auto at = [blk](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 * j)); };
  __m256i dm = at(0);
  dm = _mm256_blend_epi32(dm, at(1), 0x02);
  dm = _mm256_blend_epi32(dm, at(2), 0x04);
  dm = _mm256_blend_epi32(dm, at(3), 0x08);
  dm = _mm256_blend_epi32(dm, at(4), 0x10);
  dm = _mm256_blend_epi32(dm, at(5), 0x20);
  dm = _mm256_blend_epi32(dm, at(6), 0x40);
  dm = _mm256_blend_epi32(dm, at(7), 0x80);
  // each 128-bit lane: its 4 d's in bytes 0-7, its 4 m's in bytes 8-15; then d's low, m's high
  const __m256i split = _mm256_shuffle_epi8(
      dm, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m256i halves = _mm256_permute4x64_epi64(split, 0xD8);  // quads 0, 2, 1, 3
  *d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  *m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
#else
  alignas(64) uint16_t dh[kLanes], mh[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    std::memcpy(&dh[j], blk + j * kBlockBytes[kQ4_1], 2);
    std::memcpy(&mh[j], blk + j * kBlockBytes[kQ4_1] + 2, 2);
  }
  *d = vhalves(dh);
  *m = vhalves(mh);
#endif
}

// row_tile_x8: the blocks in groups of kLanes, their scales fetched together; the last blocks
// of a row (K = 576: 2 of 18) join the same vector accumulator, each scaled per lane, and one
// reduction ends the row. The default model's 120 Q4_1 projections, one thread, Zen 4,
// 4 runs each alternated: AVX-512 6.7-7.0 ms before (scales loaded one by one, the last
// blocks reduced one by one), 5.8-6.2 with q4_1_scales, 5.4-5.9 with both; AVX2 6.5-6.8
// before, 5.9-6.3 after. Runs of blocks (q4_1_run) instead of one block (AVX2) or a pair
// (AVX-512) per maddubs: 5.3 -> 4.4 ms (AVX-512), 5.1 -> 4.5 (AVX2). Q8_0 here instead of
// float activations (a conversion and an FMA per 16 weights): 7.8 -> 5.5 ms, 20.5 GB/s.
template <int kind, int NT>
void row_tile_x8(const X8Problem& p, int64_t n0) {
  constexpr int64_t bb = kBlockBytes[kind];
  const int64_t blocks = p.K / kBlock, grouped = blocks / kLanes * kLanes;
  float out[NT];
  for (int a = 0; a < NT; ++a) {
    const uint8_t* row = p.w + (n0 + a) * p.row_bytes;
    VF acc = vzero(), macc = vzero();
    for (int64_t b0 = 0; b0 < grouped; b0 += kLanes) {
      prefetch_lines_ahead(row + b0 * bb, kLanes * bb);
      VF d;
      if constexpr (kind == kQ4_1) {
        VF m;
        q4_1_scales(row + b0 * bb, &d, &m);
        macc = vfma(m, vload(p.xsum + b0), macc);
      } else {
        d = q8_0_scales(row + b0 * bb);
      }
      const VF s = vmul(d, vload(p.dx + b0));  // lane j: d * dx of block b0 + j
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (kind == kQ8_0) {
        for (int j = 0; j < kLanes; j += 2) {  // blocks b0 + j, b0 + j + 1
          const __m512i p32 = q8_0_pair(row + (b0 + j) * bb, p.qx + (b0 + j) * kBlock);
          const __m512i idx = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(j), _mm512_set1_epi32(j + 1));
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), _mm512_permutexvar_ps(idx, s), acc);
        }
      } else {
        for (int j = 0; j < kLanes; j += kX8Run) {  // blocks b0 + j .. b0 + j + 3, 4 lanes each
          const __m512i p32 = q4_1_run(row + (b0 + j) * bb, p.qx + (b0 + j) * kBlock);
          const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(j), _mm512_srli_epi32(
              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2));
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), _mm512_permutexvar_ps(idx, s), acc);
        }
      }
#elif defined(CPU_CAPABILITY_AVX2)
      if constexpr (kind == kQ8_0) {
        __m256i dots[kLanes];
        for (int j = 0; j < kLanes; ++j) dots[j] = x8_block<kind>(row + (b0 + j) * bb + kQuantsAt[kind], p.qx + (b0 + j) * kBlock);
        // lane j: block j's sum (vsum_each's pattern, in exact integers), then one FMA
        const __m256i a0 = _mm256_hadd_epi32(dots[0], dots[1]), a1 = _mm256_hadd_epi32(dots[2], dots[3]);
        const __m256i a2 = _mm256_hadd_epi32(dots[4], dots[5]), a3 = _mm256_hadd_epi32(dots[6], dots[7]);
        const __m256i h0 = _mm256_hadd_epi32(a0, a1), h1 = _mm256_hadd_epi32(a2, a3);
        const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, acc);
      } else {
        // 4 runs of 2 blocks, each 128-bit half one block's 4 partial sums; three hadds leave
        // blocks 0, 2, 4, 6 in the low half and 1, 3, 5, 7 in the high half
        __m256i runs[kLanes / kX8Run];
        for (int j = 0; j < kLanes; j += kX8Run) runs[j / kX8Run] = q4_1_run(row + (b0 + j) * bb, p.qx + (b0 + j) * kBlock);
        const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(runs[0], runs[1]), _mm256_hadd_epi32(runs[2], runs[3]));
        const VF sp = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), sp, acc);
      }
#else
      for (int j = 0; j < kLanes; ++j) {
        acc.v[0] += s.v[j] * static_cast<float>(block_isum<kind>(row + (b0 + j) * bb, p.qx + (b0 + j) * kBlock));
      }
#endif
    }
    // the last blocks: their integer sums join acc (scaled per lane), Q4_1's minimums' terms y
    float y = 0.0f;
    for (int64_t b = grouped; b < blocks; ++b) {
      const uint8_t* blk = row + b * bb;
      const float s0 = half_to_float(blk) * p.dx[b];
      if constexpr (kind == kQ4_1) y += half_to_float(blk + 2) * p.xsum[b];
#if defined(CPU_CAPABILITY_AVX512)
      if (kind == kQ8_0 && b + 1 < blocks) {  // a pair
        const float s1 = half_to_float(blk + bb) * p.dx[b + 1];
        const __m512 sv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q8_0_pair(blk, p.qx + b * kBlock)), sv, acc);
        ++b;  // its pair's second block is done
      } else {
        const __m256 dots = _mm256_cvtepi32_ps(x8_block<kind>(blk + kQuantsAt[kind], p.qx + b * kBlock));
        acc = _mm512_fmadd_ps(_mm512_zextps256_ps512(dots), _mm512_set1_ps(s0), acc);
      }
#elif defined(CPU_CAPABILITY_AVX2)
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(x8_block<kind>(blk + kQuantsAt[kind], p.qx + b * kBlock)),
                            _mm256_set1_ps(s0), acc);
#else
      y += s0 * static_cast<float>(block_isum<kind>(blk, p.qx + b * kBlock));
#endif
    }
    y += vsum(vadd(acc, macc));
    out[a] = y;
  }
  for (int a = 0; a < NT; ++a) p.y[n0 + a] = out[a];
}

constexpr int kMT = 4;  // activation rows per tile (batches)
constexpr int kNT = 4;  // weight rows per tile

// Many activation rows: the NT weight rows are dequantized once into float scratch (the
// reference's values: d * q, then + m) and a float micro-kernel runs every row group over
// them, instead of dequantizing each block once per group of kMT rows.
constexpr int64_t kScratchMinRows = 8;
// From this many rows the whole weight is dequantized into float32 once per call and ATen's
// float GEMM (oneDNN) multiplies: a prompt's rows amortise the N x K floats written and read.
constexpr int64_t kDenseMinRows = 256;
constexpr int kFloatMT = kMaxRowTile;

template <int kind>
void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * kBlockBytes[kind];
    const VF d = vset(half_to_float(blk));
    float* o = out + b * kBlock;
    VF q[kVecs];
    if constexpr (kind == kQ8_0) {
      q8_floats(blk + 2, q);
      for (int v = 0; v < kVecs; ++v) vstore(o + v * kLanes, vmul(d, q[v]));
    } else {
      q4_floats(blk + 4, q);
      const VF m = vset(half_to_float(blk + 2));
      for (int v = 0; v < kVecs; ++v) vstore(o + v * kLanes, vadd(vmul(d, q[v]), m));  // d * q is exact
    }
  }
}

template <int NT, int MT>
void float_tile(const Problem& p, const float* w, int64_t n0, int64_t m0) {
  VF acc[NT][MT];
  for (int a = 0; a < NT; ++a) {
    for (int i = 0; i < MT; ++i) acc[a][i] = vzero();
  }
  for (int64_t k = 0; k < p.K; k += kLanes) {
    VF wv[NT];
    for (int a = 0; a < NT; ++a) wv[a] = vload(w + a * p.K + k);
    for (int i = 0; i < MT; ++i) {
      const VF xv = vload(p.x + (m0 + i) * p.ldx + k);
      for (int a = 0; a < NT; ++a) acc[a][i] = vfma(wv[a], xv, acc[a][i]);
    }
  }
  for (int a = 0; a < NT; ++a) {
    for (int i = 0; i < MT; ++i) p.y[(m0 + i) * p.N + n0 + a] = vsum(acc[a][i]);
  }
}

template <int kind, int NT>
void rows_via_scratch(const Problem& p, int64_t n0) {
  thread_local std::vector<float> w;
  w.resize(NT * p.K);
  for (int a = 0; a < NT; ++a) dequantize_row<kind>(p.w + (n0 + a) * p.row_bytes, p.K, w.data() + a * p.K);
  int64_t m = 0;
  for (; m + kFloatMT <= p.M; m += kFloatMT) float_tile<NT, kFloatMT>(p, w.data(), n0, m);
  for (; m < p.M; ++m) float_tile<NT, 1>(p, w.data(), n0, m);
}

// Weight rows [n0, n0 + NT) against every activation row.
template <int kind, int NT>
void rows(const Problem& p, int64_t n0) {
  if (p.M >= kScratchMinRows) return rows_via_scratch<kind, NT>(p, n0);
  int64_t m = 0;
  for (; m + kMT <= p.M; m += kMT) tile<kind, NT, kMT>(p, n0, m);
  for (; m < p.M; ++m) tile<kind, NT, 1>(p, n0, m);
}

// Weight rows in tiles of kNT over the intra-op threads: tile(n0, kNT), the last rows
// tile(n, 1) one by one. ~64K weights per task: a 576 x 1536 projection splits in ~14 tasks.
template <class Tile>
void for_each_tile(int64_t N, int64_t K, const Tile& tile) {
  at::parallel_for(0, (N + kNT - 1) / kNT, std::max<int64_t>(1, 65536 / (kNT * K)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNT;
      if (n0 + kNT <= N) {
        tile(n0, std::integral_constant<int, kNT>{});
      } else {
        for (int64_t n = n0; n < N; ++n) tile(n, std::integral_constant<int, 1>{});
      }
    }
  });
}

template <int kind>
void run(const Problem& p) {
  for_each_tile(p.N, p.K, [&](int64_t n0, auto nt) { rows<kind, decltype(nt)::value>(p, n0); });
}

// y = x^ @ dequantize(blocks).T for x [M, K] (whole blocks, rows ldx apart) in `kind`'s blocks:
// x rounded to 8 bits per block (above) with its block sums for Q4_1's minimums' term, then one
// row's integer dots, a prompt's dense GEMM, or the tiles.
template <int kind>
void linear_kind(const float* xd, int64_t ldx, const at::Tensor& blocks, at::Tensor& y) {
  const int64_t M = y.size(0), N = y.size(1), nb = blocks.size(1) / kBlockBytes[kind], K = nb * kBlock;
  const uint8_t* bd = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  if (M == 1) {
    std::vector<int8_t> qx(K);
    std::vector<float> dx(nb), xsum(nb);
    quantize_x(kind, xd, K, qx.data(), dx.data(), xsum.data());
    const X8Problem p{qx.data(), dx.data(), xsum.data(), bd, row_bytes, y.data_ptr<float>(), N, K};
    for_each_tile(N, K, [&](int64_t n0, auto nt) { row_tile_x8<kind, decltype(nt)::value>(p, n0); });
    return;
  }
  std::vector<float> xr(M * K), xsum(M * nb);  // x^ in float, natural order
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) round_x(xd + i * ldx, K, xr.data() + i * K, xsum.data() + i * nb);
  });
  if (M >= kDenseMinRows) {  // a prompt's rows: the weight dequantized once, then a float GEMM
    at::Tensor w = at::empty({N, K}, y.options());
    float* wd = w.data_ptr<float>();
    at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) dequantize_row<kind>(bd + n * row_bytes, K, wd + n * K);
    });
    at::mm_out(y, at::from_blob(xr.data(), {M, K}, y.options()), w.t());
    return;
  }
  run<kind>(Problem{xr.data(), K, bd, row_bytes, xsum.data(), y.data_ptr<float>(), M, N, K});
}

}  // namespace

at::Tensor gguf_linear_cpu(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK_VALUE(kind == kQ8_0 || kind == kQ4_1, "gguf_linear: kind must be 0 (Q8_0) or 1 (Q4_1), got ", kind);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
                    "gguf_linear: x must be float32 [M, K] with unit stride along K, got ", x.scalar_type(),
                    " ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK_VALUE(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
                    "gguf_linear: blocks must be contiguous uint8 [N, K / 32 * block bytes], got ",
                    blocks.scalar_type(), " ", blocks.sizes());
  const int64_t M = x.size(0), N = blocks.size(0);
  const int64_t K = (x.size(1) + kBlock - 1) / kBlock * kBlock;  // whole blocks
  TORCH_CHECK_VALUE(blocks.size(1) == K / kBlock * kBlockBytes[kind], "gguf_linear: x has K = ",
                    x.size(1), ", so blocks rows need ", K / kBlock * kBlockBytes[kind],
                    " bytes, got ", blocks.size(1));
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  // K not a multiple of 32: x padded with zeros to whole blocks (the weights' padding is
  // whatever their blocks hold; zero activations make it count for nothing).
  const at::Tensor xp = K == x.size(1) ? x : at::constant_pad_nd(x, {0, K - x.size(1)}, 0.0);
  const float* xd = xp.data_ptr<float>();
  if (kind == kQ8_0) {
    linear_kind<kQ8_0>(xd, xp.stride(0), blocks, y);
  } else {
    linear_kind<kQ4_1>(xd, xp.stride(0), blocks, y);
  }
  return y;
}

}  // namespace splitserve

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("gguf_linear", &splitserve::gguf_linear_cpu);
}
