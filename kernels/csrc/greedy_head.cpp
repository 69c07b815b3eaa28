// The greedy token of each row straight from the LM head, without every float32 logit:
// a bfloat16 screen with a rigorous error bound, then the float32 logit of the few tokens the
// bound cannot rule out (CPUs with AVX512_BF16; engine/models/greedy_head.py).
//
//   1. s[r, n] = bf16(x[r]) . bf16(w[n]), by vdpbf16ps over the weight in bfloat16 panels
//      [P][K/2][32][2] (32 tokens' columns; the pairs of k each lane multiplies), two products
//      per lane per instruction where float32 has one.
//   2. Let f[r, n] be the float32 logit panel_linear computes (panel_gemm.cpp). Then
//      |s - f| <= B[r, n] = c(K) * |x[r]| * |w[n]| + small terms (norms are L2): rounding x
//      and w to bfloat16 moves each product by at most (2u + u^2)|w_k x_k| (u = 2^-8); the
//      screen's sum rounds at most K times and panel_linear's K + K / kKC times, each by at
//      most 2^-24 of sum |w_k x_k|; and by Cauchy-Schwarz sum |w_k x_k| <= |x| |w|. So
//      c(K) = (2u + u^2 + (2.01 K + 8) 2^-24) * 1.001 (0.00790 for K = 576), the 0.1% for the
//      norms' and the bound's own rounding; the terms below cover bfloat16's flushed
//      denormals (vdpbf16ps treats them as zero) and the rounding of s +- B.
//   3. The argmax of f is among the n with s + B >= L = max_m (s - B): f[argmax] >= f[m] >=
//      s[m] - B[m] for every m. Those candidates' f are computed exactly as panel_linear
//      computes them (blocks of kKC keys, one fused multiply-add at a time, the blocks' sums
//      added in order), so the token is the one argmax over panel_linear's logits gives, the
//      first on ties: bit for bit, not approximately. On the default model's final hidden
//      states the median row kept 1 candidate (mean 6, 90th percentile 13, max 176 of 49152).
//      The screen works out B, L's parts and each panel's max of s + B while its tile is still
//      in registers (TileBounds), so this step reads s only in the few panels that reach L,
//      where it once read all of s and the norms twice (25 MB at 64 rows).
//
// A row whose x is not finite, or whose candidates' logits are not, gets -1: the caller then
// takes the logits path (NaN and infinity rules as argmax_rows has them).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "threads.h"

namespace splitserve {
namespace {

constexpr int kCols = 32;  // tokens per bfloat16 panel
// The float32 panels' geometry (panel_gemm.cpp): columns per panel and keys per block, whose
// order of summation the exact logits repeat.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kPanelCols = 32;
#else
constexpr int kPanelCols = 16;
#endif
constexpr int kKC = 4096 / kPanelCols;

// c(K) of the bound (above).
inline double bound_coef(int64_t K) {
  return (std::ldexp(1.0, -7) + std::ldexp(1.0, -16) + (2.01 * static_cast<double>(K) + 8.0) * std::ldexp(1.0, -24)) *
         1.001;
}

// float32 -> bfloat16 bits, round to nearest even (finite inputs).
inline uint16_t to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// f[n] for x (K floats) as panel_linear computes it from the float32 panels [P][K][kPanelCols].
inline float exact_logit(const float* x, const float* panels, int64_t K, int64_t n) {
  const float* w = panels + (n / kPanelCols) * K * kPanelCols + n % kPanelCols;
  float y = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t k1 = std::min<int64_t>(K, k0 + kKC);
    float c = 0.0f;
    for (int64_t k = k0; k < k1; ++k) c = std::fma(x[k], w[k * kPanelCols], c);
    y = k0 == 0 ? c : y + c;
  }
  return y;
}

#if defined(CPU_CAPABILITY_AVX512)
#define SS_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))

constexpr int kMR = 12;

// What the screen keeps of each tile besides s, for step 3 without reading s back: the bound
// B = a |w| + e + slack |s| of each of the panel's tokens (as pick_row had it), then per row the
// running max of s - B over a chunk's panels (L's part), the max of s + B over this panel's
// tokens (a panel whose max is under L has no candidate), and whether any s is not finite.
struct TileBounds {
  const float* norms;  // the panel's tokens' norms (valid lanes read)
  __mmask16 m0, m1;    // valid lanes (tokens below vocab) of the panel's two halves
  const float* va;     // per row: a (1 + 2^-20), as a float
  const float* ve;     // per row: e
  float* lower;        // per row: max of s - B so far (this chunk)
  float* upper;        // per row, ldu apart: this panel's max of s + B
  int64_t ldu;
  char* poisoned;      // per row: some s not finite (this chunk)
};

constexpr float kSlack = 0x1p-20f;  // the rounding of s +- B in float

// B for screened logits sv of tokens with norms nv (pick_row's candidates test the same floats).
SS_BF16_TARGET inline __m512 tile_bound(__m512 sv, __m512 nv, __m512 va, __m512 ve) {
  return _mm512_add_ps(_mm512_fmadd_ps(va, nv, ve), _mm512_mul_ps(_mm512_set1_ps(kSlack), _mm512_abs_ps(sv)));
}

// s[0:MR, 0:32] = x[0:MR] . w over k2 pairs of keys (x: MR rows of pairs, ldx apart), and
// the tile's TileBounds.
template <int MR>
SS_BF16_TARGET void micro(const uint32_t* x, int64_t ldx, const uint16_t* w, int64_t k2, float* s, int64_t lds,
                          const TileBounds& tb) {
  __m512 c[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k2; ++kk) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kk * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kk * 2 * kCols + kCols);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * ldx + kk]));
      c[i][0] = _mm512_dpbf16_ps(c[i][0], xv, w0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], xv, w1);
    }
  }
  const __m512 n0 = _mm512_maskz_loadu_ps(tb.m0, tb.norms), n1 = _mm512_maskz_loadu_ps(tb.m1, tb.norms + 16);
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), zero = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(s + i * lds, c[i][0]);
    _mm512_storeu_ps(s + i * lds + 16, c[i][1]);
    const __m512 va = _mm512_set1_ps(tb.va[i]), ve = _mm512_set1_ps(tb.ve[i]);
    const __m512 b0 = tile_bound(c[i][0], n0, va, ve), b1 = tile_bound(c[i][1], n1, va, ve);
    const __m512 lo = _mm512_max_ps(_mm512_mask_sub_ps(none, tb.m0, c[i][0], b0),
                                    _mm512_mask_sub_ps(none, tb.m1, c[i][1], b1));
    const __m512 hi = _mm512_max_ps(_mm512_mask_add_ps(none, tb.m0, c[i][0], b0),
                                    _mm512_mask_add_ps(none, tb.m1, c[i][1], b1));
    tb.lower[i] = std::max(tb.lower[i], _mm512_reduce_max_ps(lo));
    tb.upper[i * tb.ldu] = _mm512_reduce_max_ps(hi);
    // inf * 0 and NaN * 0 are NaN
    const __m512 z = _mm512_add_ps(_mm512_maskz_mul_ps(tb.m0, c[i][0], zero), _mm512_maskz_mul_ps(tb.m1, c[i][1], zero));
    if (_mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q) != 0) tb.poisoned[i] = 1;
  }
}

// Step 3 for one row: its screened logits s (P panels of them), the tokens' norms, its va and
// ve (TileBounds), L (the max of s - B) and each panel's max of s + B. Reads s only in the panels
// whose max reaches L. -1 where a candidate's logit is not finite.
SS_BF16_TARGET int64_t pick_row(const float* s, const float* norms, int64_t vocab, float va_r, float ve_r,
                                float lower, const float* upper, const float* x, const float* panels, int64_t K) {
  const __m512 va = _mm512_set1_ps(va_r), ve = _mm512_set1_ps(ve_r), vl = _mm512_set1_ps(lower);
  float best = 0.0f;
  int64_t best_at = -1;
  for (int64_t p = 0; p * kCols < vocab; ++p) {
    if (!(upper[p] >= lower)) continue;  // no token of the panel reaches L
    for (int64_t n = p * kCols; n < std::min<int64_t>(vocab, (p + 1) * kCols); n += 16) {
      const __mmask16 m = n + 16 <= vocab ? 0xFFFF : static_cast<__mmask16>((1u << (vocab - n)) - 1);
      const __m512 sv = _mm512_maskz_loadu_ps(m, s + n), nv = _mm512_maskz_loadu_ps(m, norms + n);
      for (uint32_t keep = _mm512_mask_cmp_ps_mask(m, _mm512_add_ps(sv, tile_bound(sv, nv, va, ve)), vl, _CMP_GE_OQ);
           keep != 0; keep &= keep - 1) {
        const int64_t t = n + __builtin_ctz(keep);
        const float f = exact_logit(x, panels, K, t);
        if (!std::isfinite(f)) return -1;
        if (best_at < 0 || f > best) {
          best = f;
          best_at = t;
        }
      }
    }
  }
  return best_at;
}

template <int MR = kMR>
void micro_rows(int rows, const uint32_t* x, int64_t ldx, const uint16_t* w, int64_t k2, float* s, int64_t lds,
                const TileBounds& tb) {
  if constexpr (MR > 1) {
    if (rows < MR) return micro_rows<MR - 1>(rows, x, ldx, w, k2, s, lds, tb);
  }
  micro<MR>(x, ldx, w, k2, s, lds, tb);
}

bool cpu_has_bf16() { return __builtin_cpu_supports("avx512bf16"); }
#else
bool cpu_has_bf16() { return false; }
#endif

}  // namespace

bool greedy_head_available_cpu() { return cpu_has_bf16(); }

at::Tensor greedy_head_cpu(const at::Tensor& x, const at::Tensor& panels16, const at::Tensor& norms,
                           const at::Tensor& panels, int64_t vocab) {
  TORCH_CHECK(cpu_has_bf16(), "greedy_head: this library or CPU has no AVX512_BF16");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                    "greedy_head: x must be contiguous float32 [rows, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t R = x.size(0), K = x.size(1), K2 = (K + 1) / 2;
  const int64_t P = (vocab + kCols - 1) / kCols;
  TORCH_CHECK_VALUE(panels16.scalar_type() == at::kBFloat16 && panels16.is_contiguous() &&
                        panels16.sizes() == at::IntArrayRef({P, K2, kCols, 2}),
                    "greedy_head: panels16 must be contiguous bfloat16 [", P, ", ", K2, ", ", kCols,
                    ", 2], got ", panels16.scalar_type(), " ", panels16.sizes());
  TORCH_CHECK_VALUE(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == vocab,
                    "greedy_head: norms must be contiguous float32 [", vocab, "]");
  TORCH_CHECK_VALUE(panels.scalar_type() == at::kFloat && panels.is_contiguous() && panels.dim() == 3 &&
                        panels.size(1) == K && panels.size(2) == kPanelCols && panels.size(0) * kPanelCols >= vocab,
                    "greedy_head: panels must be this library's float32 panels [", (vocab + kPanelCols - 1) / kPanelCols,
                    ", ", K, ", ", kPanelCols, "], got ", panels.sizes());
  at::Tensor tokens = at::empty({R}, x.options().dtype(at::kLong));
#if defined(CPU_CAPABILITY_AVX512)
  if (R == 0) return tokens;
  const float* xf = x.data_ptr<float>();
  // x in bfloat16 pairs, and each row's norm (double, then the bound's coefficient).
  std::vector<uint32_t> xb(R * K2, 0);
  std::vector<float> bound_va(R), bound_ve(R);
  std::vector<char> finite(R);
  for (int64_t r = 0; r < R; ++r) {
    double sq = 0.0;
    bool ok = true;
    for (int64_t k = 0; k < K; ++k) {
      const float v = xf[r * K + k];
      ok = ok && std::isfinite(v);
      sq += static_cast<double>(v) * v;
      const uint32_t h = ok ? to_bf16(v) : 0;
      xb[r * K2 + k / 2] |= k % 2 == 0 ? h : h << 16;
    }
    const double norm = std::sqrt(sq);
    finite[r] = ok && std::isfinite(norm);
    // bfloat16's flushed denormals: a product with a denormal x_k moves by under 2^-126 |w_k|,
    // with a denormal w_k by under 2^-126 |x_k|, and each flushed product or sum by under
    // 2^-126: in all under K 2^-120 (|w| + |x| + 1), twice that for the rounding of s +- B.
    const double tiny = 2.0 * static_cast<double>(K) * std::ldexp(1.0, -120);
    bound_va[r] = static_cast<float>((bound_coef(K) * norm + tiny) * (1.0 + std::ldexp(1.0, -20)));
    bound_ve[r] = static_cast<float>(tiny * (1.0 + norm));
  }
  // 1-2. The screen, into s [R, P * kCols], with its TileBounds: chunks of panels over the
  // threads, all rows each; L's part and the poison flag per row and chunk.
  std::vector<float> s(R * P * kCols);
  const uint16_t* w16 = reinterpret_cast<const uint16_t*>(panels16.data_ptr<at::BFloat16>());
  const float* nf = norms.data_ptr<float>();
  const int64_t num_blocks = (R + kMR - 1) / kMR;
  const int64_t base = R / num_blocks, extra = R % num_blocks;
  const int64_t num_chunks = std::min<int64_t>(P, 8 * std::max(1, at::get_num_threads()));
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), num_chunks);
  std::vector<float> lower(num_chunks * R, -std::numeric_limits<float>::infinity()), upper(R * P);
  std::vector<char> poisoned(num_chunks * R, 0);
  parallel_dynamic(num_chunks, threads, [&](int64_t chunk) {
    for (int64_t p = chunk * P / num_chunks; p < (chunk + 1) * P / num_chunks; ++p) {
      const int64_t n0 = p * kCols, valid = std::min<int64_t>(kCols, vocab - n0);
      TileBounds tb{nf + n0,
                    static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1),
                    static_cast<__mmask16>(valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (1u << (valid - 16)) - 1),
                    nullptr, nullptr, nullptr, nullptr, P, nullptr};
      for (int64_t b = 0, m = 0; b < num_blocks; ++b) {
        const int rows = static_cast<int>(base + (b < extra ? 1 : 0));
        tb.va = bound_va.data() + m;
        tb.ve = bound_ve.data() + m;
        tb.lower = lower.data() + chunk * R + m;
        tb.upper = upper.data() + m * P + p;
        tb.poisoned = poisoned.data() + chunk * R + m;
        micro_rows(rows, xb.data() + m * K2, K2, w16 + p * K2 * 2 * kCols, K2, s.data() + m * P * kCols + p * kCols,
                   P * kCols, tb);
        m += rows;
      }
    }
  });
  // 3. Per row: L, the candidates (in the panels that reach it), their exact logits.
  const float* pf = panels.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float l = -std::numeric_limits<float>::infinity();
      bool ok = finite[r];
      for (int64_t c = 0; c < num_chunks; ++c) {
        l = std::max(l, lower[c * R + r]);
        ok = ok && !poisoned[c * R + r];
      }
      out[r] = ok ? pick_row(s.data() + r * P * kCols, nf, vocab, bound_va[r], bound_ve[r], l, upper.data() + r * P,
                             xf + r * K, pf, K)
                  : -1;
    }
  });
#endif
  return tokens;
}

}  // namespace splitserve

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("greedy_head_available() -> bool", &splitserve::greedy_head_available_cpu);
  m.def("greedy_head(Tensor x, Tensor panels16, Tensor norms, Tensor panels, int vocab) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("greedy_head", &splitserve::greedy_head_cpu);
}
