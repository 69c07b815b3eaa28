// Float32 linear on CPU over a weight packed in column panels:
//   y[M, N] = x[M, K] @ w[N, K].T (+ bias)
//
// pack_panels lays w out once as panels[N / NR][K][NR] (NR = two vectors of output columns,
// the last panel padded with zeros), so that a panel is read front to back. panel_linear
// then runs a register-blocked micro-kernel: MR activation rows x NR columns of y stay in
// 2 * MR vector accumulators while k runs; each step loads the panel's two vectors at k once
// and broadcasts x[m, k] for each of the MR rows (2 * MR fused multiply-adds per 2 + MR loads).
// MR is as many rows as the vector registers hold: 6 under AVX2 (12 accumulators of 16
// registers), 12 under AVX-512 (24 of 32).
//
// Blocking: k goes in blocks of KC (a panel block is 16 KB, staying in L1 while every row
// block passes over it), rows in blocks of MC (x's block of MC x K floats stays in L2 while
// a chunk of panels passes over it), each cut into as few blocks of at most MR rows as fit,
// of even sizes; a block of x rows times a chunk of panels is a work item, and the intra-op
// threads take the items in turn (parallel_dynamic in threads.h), not in fixed shares.
//
// Rounding: y[m, n] sums x[m, k] * w[n, k] over each block of KC keys in order of k (one
// fused multiply-add at a time), adds the blocks' sums in order, then the bias. That order
// depends on nothing else: not on M, on which rows share the batch, on the thread count, nor
// on which thread took the work item, so a row's output is the same in any batch.
//
// Block panels: a weight that a GGUF file stores in blocks of 32 keys (Q8_0: w = d * q; Q4_1:
// w = d * q + m; d and m float16, q an integer) can be laid out as block panels instead:
// per panel and group of 32 keys, the kNR columns' d, then their m (float32), then q[32][kNR]
// (int8). panel_rows turns each block of KC keys back into float32 in a 16 KB buffer, w =
// fma(d, q, m), and runs the same micro-kernel over it. d * q is exact in float32 (an 11-bit
// significand times an integer of at most 8 bits), so the fused multiply-add rounds once, as
// the reference's product-then-sum does (quant_matmul.py's dequantize_gguf); Q8_0's m is -0,
// which leaves d * q as it is, zeros' signs included. The float32 panels of those weights
// hold the same numbers and the sums run in the same order, so the two routes give the same
// bits, reading 1.25 bytes per weight instead of 4.
//
// Measured on an AMD EPYC Zen 3 (2 cores, AVX2), the default model's 120 projections and its
// LM head (30 distinct layers, so weights come from memory as in a step), float32:
//   rows      1     8     16    32    64    256
//   oneDNN    -    34.6  47.7  74.8  127.1 450.5 ms   (torch.ops.mkldnn._linear_pointwise, prepacked)
//   panels   17.3  24.6  33.2  57.9  101.0 395.7 ms   (a standalone prototype of this kernel)
// and this kernel 19.4 / 24.3 / 33.0 / - / 100.8 ms at 1 / 8 / 16 / 64 rows (another run).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "float_vec.h"
#include "panel_gemm.h"
#include "threads.h"

namespace splitserve {
namespace {

using namespace fvec;
// Vectors of columns per panel and rows per block. Tried on Zen 3: 3 vectors x 4 rows (12
// accumulators too) was 8% slower at 16 and 64 rows.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kNV = 2, kMR = 12;
#else
constexpr int kNV = 2, kMR = 6;
#endif
constexpr int kNR = kNV * kLanes;  // output columns per panel
constexpr int kKC = 4096 / kNR;  // a panel block of kKC x kNR floats is 16 KB
// x rows per block: about 256 KB of them under AVX2 (Zen 3's L2 is 512 KB), 512 KB under
// AVX-512. Zen 4 (1 MB of L2), the default model's layers at 64 rows, 2 cores: the down
// projection (K = 1536) then takes one block of rows, not two that each read the weight,
// 0.68 -> 0.58 ms; the hot_path workload 27.2-27.7 -> 26.8-27.0 s with the equal chunks below
// (3 runs each, alternated). Under AVX2 the larger block gained nothing at 64 rows.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kXBlockFloats = 131072;
#else
constexpr int64_t kXBlockFloats = 65536;
#endif
// From this many rows on, each step also asks for the panel one block (16 KB) ahead, every
// 64-byte line of it: with few rows the weight streams faster than the kernel uses it and the
// hardware prefetcher keeps up (asking cost 1-2 rows ~10%), with more it gained ~8% at 8-16
// rows (Zen 3, AVX2: one line a step). Zen 4, the default model's layers, 2 cores: AVX2 23 / 32
// / 95 ms at 8 / 16 / 64 rows against 29 / 42 / 106 without; AVX-512 (two lines a step)
// asking for the first line only took 27 ms at 8 rows, both 21, none 20, alike from 16 rows on.
// The lines go to L2 (prefetcht1), not L1 (3 runs each alternated, Zen 4): AVX-512 at 8 / 15
// rows 21.3-23.4 / 28.8-30.9 ms -> 19.6-20.0 / 27.9-28.8 (into L1 with NTA: no better); AVX2
// at 8 / 64 rows 23.2-24.1 / 93.6-94.4 -> 19.5-21.8 / 89-93.
constexpr int64_t kPrefetchRows = 8;
// Chunks of panels per intra-op thread when x is one block of rows (decode): a thread taken
// off its core holds up one chunk, not its share (parallel_dynamic).
constexpr int64_t kChunksPerThread = 4;

// Block panels (above): keys per group, and a group's bytes in a panel.
constexpr int kGroup = 32;
constexpr int64_t kGroupBytes = (2 * static_cast<int64_t>(sizeof(float)) + kGroup) * kNR;
static_assert(kKC % kGroup == 0, "a block of keys must hold whole groups");
// Block panels go through the block buffer (dequantize_block) when several row blocks pass
// over a block of keys, and are turned into floats in registers (micro_blocks) when one does:
// there a weight vector serves its rows once, and the buffer's stores and reloads cost more
// than the conversion. The default model's 120 projections, Zen 4, 2 threads, ms (float32
// panels / buffer / registers): AVX-512 1 row 14.7 / 6.8 / 5.3, 4 rows 14.6 / 10.6 / 8.3,
// 16 rows 20.9 / 20.4 / 23.5, 64 rows 71.8 / 70.0 / 79.5; AVX2 1 row 14.8 / 9.0 / 5.7, 4 rows
// 17.0 / 12.0 / 8.7, 16 rows 22.5 / 21.1 / 27.1.
constexpr int64_t kFusedBlocks = 1;

struct Problem {
  const float* x;  // [M, K], row stride ldx
  int64_t ldx;
  const float* panels;  // [num_panels, K, kNR], or nullptr with blocks
  const uint8_t* blocks;  // [num_panels, K / kGroup, kGroupBytes], or nullptr with panels
  const float* bias;    // [N] or nullptr
  float* y;             // [M, N], contiguous
  int64_t M, N, K;
};

// A micro-kernel's MR x kNV accumulators: zeroed, and added onto y (unless `first`: onto the
// earlier key blocks' sums), plus `bias` (kNR values) when given, then stored.
template <int MR>
inline void zero(VF (&c)[MR][kNV]) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < kNV; ++j) c[i][j] = vzero();
  }
}

template <int MR>
inline void store(VF (&c)[MR][kNV], float* y, int64_t ldy, bool first, const float* bias) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < kNV; ++j) {
      if (!first) c[i][j] = vadd(vload(y + i * ldy + j * kLanes), c[i][j]);
      if (bias != nullptr) c[i][j] = vadd(c[i][j], vload(bias + j * kLanes));
      vstore(y + i * ldy + j * kLanes, c[i][j]);
    }
  }
}

// c[i] += x[i, k] * w[k] for the MR rows (x's row stride ldx).
template <int MR>
inline void rank1(VF (&c)[MR][kNV], const float* x, int64_t ldx, const VF* wv) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    const VF xv = vset(x[i * ldx]);
#pragma GCC unroll 4
    for (int j = 0; j < kNV; ++j) c[i][j] = vfma(xv, wv[j], c[i][j]);
  }
}

// y[0:MR, 0:kNR] (row stride ldy) (+)= x[0:MR, 0:kc] . w[0:kc, 0:kNR]: the block's sums start
// at zero and, unless `first`, are added to y's; `bias` (kNR values), when given, is added last.
template <int MR, bool kPrefetch>
inline void micro(const float* x, int64_t ldx, const float* w, int kc, float* y, int64_t ldy, bool first,
                  const float* bias) {
  VF c[MR][kNV];
  zero(c);
  for (int k = 0; k < kc; ++k) {
    if constexpr (kPrefetch) {
#pragma GCC unroll 4
      for (int l = 0; l < kNR / 16; ++l) __builtin_prefetch(w + (k + kKC) * kNR + l * 16, 0, 2);  // each 64-byte line
    }
    VF wv[kNV];
#pragma GCC unroll 4
    for (int j = 0; j < kNV; ++j) wv[j] = vload(w + k * kNR + j * kLanes);
    rank1(c, x + k, ldx, wv);
  }
  store(c, y, ldy, first, bias);
}

// micro over a block panel's groups (kc / kGroup of them from `groups`): each weight vector is
// turned into floats in registers, w = fma(d, q, m), and used for all MR rows, instead of
// going through the block buffer (below). The same sums in the same order.
template <int MR>
inline void micro_blocks(const float* x, int64_t ldx, const uint8_t* groups, int kc, float* y, int64_t ldy,
                         bool first, const float* bias) {
  VF c[MR][kNV];
  zero(c);
  for (int g = 0; g < kc / kGroup; ++g) {
    const uint8_t* group = groups + g * kGroupBytes;
    const float* d = reinterpret_cast<const float*>(group);
    const int8_t* q = reinterpret_cast<const int8_t*>(group + 2 * sizeof(float) * kNR);
    for (int kk = 0; kk < kGroup; ++kk) {
      VF wv[kNV];
#pragma GCC unroll 4
      for (int j = 0; j < kNV; ++j) wv[j] = vfma(vload(d + j * kLanes), vint8s(q + kk * kNR + j * kLanes), vload(d + kNR + j * kLanes));
      rank1(c, x + g * kGroup + kk, ldx, wv);
    }
  }
  store(c, y, ldy, first, bias);
}

// micro (or micro_blocks) for `rows` <= kMR rows.
template <bool kPrefetch, bool kBlocks = false, int MR = kMR, class W>
inline void micro_rows(int rows, const float* x, int64_t ldx, const W* w, int kc, float* y, int64_t ldy,
                       bool first, const float* bias) {
  if constexpr (MR > 1) {
    if (rows < MR) return micro_rows<kPrefetch, kBlocks, MR - 1>(rows, x, ldx, w, kc, y, ldy, first, bias);
  }
  if constexpr (kBlocks) {
    micro_blocks<MR>(x, ldx, w, kc, y, ldy, first, bias);
  } else {
    micro<MR, kPrefetch>(x, ldx, w, kc, y, ldy, first, bias);
  }
}

// Keys [k0, k0 + kc) of a block panel (its groups from `panel`) as float32 panel rows into
// out[kc][kNR]: w = fma(d, q, m). With `prefetch`, asks for the groups one block of keys ahead.
inline void dequantize_block(const uint8_t* panel, int64_t k0, int64_t kc, float* out, bool prefetch) {
  for (int64_t g = k0 / kGroup; g < (k0 + kc) / kGroup; ++g) {
    const uint8_t* group = panel + g * kGroupBytes;
    if (prefetch) {
      for (int64_t l = 0; l < kGroupBytes; l += 64) __builtin_prefetch(group + (kKC / kGroup) * kGroupBytes + l, 0, 2);
    }
    const float* d = reinterpret_cast<const float*>(group);
    const int8_t* q = reinterpret_cast<const int8_t*>(group + 2 * sizeof(float) * kNR);
    VF dv[kNV], mv[kNV];
#pragma GCC unroll 4
    for (int j = 0; j < kNV; ++j) {
      dv[j] = vload(d + j * kLanes);
      mv[j] = vload(d + kNR + j * kLanes);
    }
    float* o = out + (g * kGroup - k0) * kNR;
#pragma GCC unroll 4
    for (int kk = 0; kk < kGroup; ++kk) {
#pragma GCC unroll 4
      for (int j = 0; j < kNV; ++j) vstore(o + kk * kNR + j * kLanes, vfma(dv[j], vint8s(q + kk * kNR + j * kLanes), mv[j]));
    }
  }
}

// Rows [m0, m1) of y's columns of panel p.
void panel_rows(const Problem& p, int64_t panel, int64_t m0, int64_t m1) {
  const int64_t n0 = panel * kNR;
  const bool full = n0 + kNR <= p.N;
  // A partial last panel is computed into a tile and its valid columns copied out.
  alignas(64) float tile[kMR * kNR];
  alignas(64) float bias_tile[kNR];
  const float* bias = nullptr;
  if (p.bias != nullptr) {
    if (full) {
      bias = p.bias + n0;
    } else {
      std::fill(bias_tile, bias_tile + kNR, 0.0f);
      std::copy(p.bias + n0, p.bias + p.N, bias_tile);
      bias = bias_tile;
    }
  }
  const float* w = p.panels != nullptr ? p.panels + panel * p.K * kNR : nullptr;
  const uint8_t* wb = p.blocks != nullptr ? p.blocks + panel * (p.K / kGroup) * kGroupBytes : nullptr;
  alignas(64) float block[kKC * kNR];  // a block panel's keys [k0, k0 + kKC) as floats
  // The rows go in as few blocks as kMR allows, of sizes that differ by at most one: a
  // short block runs fewer FMA chains than the pipelines hold (16 rows: 6 + 5 + 5, not 6 + 6 + 4).
  const int64_t num_blocks = (m1 - m0 + kMR - 1) / kMR;
  const int64_t base = (m1 - m0) / num_blocks, extra = (m1 - m0) % num_blocks;
  if (full) {
    // k blocks outside the row blocks: a panel block (16 KB) stays in L1 while every row block
    // passes over it. Each output's sums run in the same order as below, so the bits are equal.
    // Against row blocks outside (Zen 3, busy, 120 projections, interleaved, medians): 2048 rows
    // 125 / 116 GFLOP/s, 256 rows 115 / 105, 64 rows 113 / 100.
    for (int64_t k0 = 0; k0 < p.K; k0 += kKC) {
      const int kc = static_cast<int>(std::min<int64_t>(kKC, p.K - k0));
      const float* bk = k0 + kc == p.K ? bias : nullptr;
      const float* wk = w != nullptr ? w + k0 * kNR : block;
      const bool fused = w == nullptr && num_blocks <= kFusedBlocks;
      if (w == nullptr && !fused) dequantize_block(wb, k0, kc, block, p.M >= kPrefetchRows);
      for (int64_t b = 0, m = m0; b < num_blocks; ++b) {
        const int rows = static_cast<int>(base + (b < extra ? 1 : 0));
        const float* xk = p.x + m * p.ldx + k0;
        float* y = p.y + m * p.N + n0;
        if (fused) {
          micro_rows<false, true>(rows, xk, p.ldx, wb + k0 / kGroup * kGroupBytes, kc, y, p.N, k0 == 0, bk);
        } else if (p.M >= kPrefetchRows && w != nullptr) {
          micro_rows<true>(rows, xk, p.ldx, wk, kc, y, p.N, k0 == 0, bk);
        } else {
          micro_rows<false>(rows, xk, p.ldx, wk, kc, y, p.N, k0 == 0, bk);
        }
        m += rows;
      }
    }
    return;
  }
  // A partial last panel: row block by row block, through the tile (a block panel's whole
  // panel turned into floats first).
  std::vector<float> whole;
  if (w == nullptr) {
    whole.resize(p.K * kNR);
    dequantize_block(wb, 0, p.K, whole.data(), false);
    w = whole.data();
  }
  for (int64_t b = 0, m = m0; b < num_blocks; ++b) {
    const int rows = static_cast<int>(base + (b < extra ? 1 : 0));
    for (int64_t k0 = 0; k0 < p.K; k0 += kKC) {
      const int kc = static_cast<int>(std::min<int64_t>(kKC, p.K - k0));
      const bool last = k0 + kc == p.K;
      const float* xk = p.x + m * p.ldx + k0;
      const float* bk = last ? bias : nullptr;
      if (p.M >= kPrefetchRows) {
        micro_rows<true>(rows, xk, p.ldx, w + k0 * kNR, kc, tile, kNR, k0 == 0, bk);
      } else {
        micro_rows<false>(rows, xk, p.ldx, w + k0 * kNR, kc, tile, kNR, k0 == 0, bk);
      }
    }
    for (int i = 0; i < rows; ++i) std::copy(tile + i * kNR, tile + i * kNR + (p.N - n0), p.y + (m + i) * p.N + n0);
    m += rows;
  }
}

at::Tensor pack_panels_cpu(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
                    "pack_panels: weight must be float32 [N, K], got ", weight.scalar_type(), " ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t num_panels = (N + kNR - 1) / kNR;
  at::Tensor panels = at::zeros({num_panels, K, kNR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(kNR, N - p * kNR);
      for (int64_t j = 0; j < cols; ++j) {
        const float* row = src + (p * kNR + j) * K;
        float* out = dst + p * K * kNR + j;
        for (int64_t k = 0; k < K; ++k) out[k * kNR] = row[k];
      }
    }
  });
  return panels;
}

// d, m [N, K / kGroup] float32 and q [N, K] int8 (a GGUF weight's parts: w = d * q + m per
// group of 32 keys) as block panels [num_panels, K / kGroup, kGroupBytes], the last panel's
// missing columns zero.
at::Tensor pack_block_panels_cpu(const at::Tensor& d, const at::Tensor& m, const at::Tensor& q) {
  TORCH_CHECK_VALUE(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) % kGroup == 0,
                    "pack_block_panels: q must be int8 [N, K] with K a multiple of ", kGroup, ", got ",
                    q.scalar_type(), " ", q.sizes());
  const int64_t N = q.size(0), K = q.size(1), G = K / kGroup;
  for (const at::Tensor* t : {&d, &m}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->sizes() == at::IntArrayRef({N, G}),
                      "pack_block_panels: d and m must be float32 [", N, ", ", G, "], got ", t->scalar_type(), " ",
                      t->sizes());
  }
  const at::Tensor dc = d.contiguous(), mc = m.contiguous(), qc = q.contiguous();
  const int64_t num_panels = (N + kNR - 1) / kNR;
  at::Tensor out = at::zeros({num_panels, G, kGroupBytes}, q.options().dtype(at::kByte));
  const float* ds = dc.data_ptr<float>();
  const float* ms = mc.data_ptr<float>();
  const int8_t* qs = qc.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(kNR, N - p * kNR);
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* group = dst + (p * G + g) * kGroupBytes;
        float* gd = reinterpret_cast<float*>(group);
        int8_t* gq = reinterpret_cast<int8_t*>(group + 2 * sizeof(float) * kNR);
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t n = p * kNR + j;
          gd[j] = ds[n * G + g];
          gd[kNR + j] = ms[n * G + g];
          for (int kk = 0; kk < kGroup; ++kk) gq[kk * kNR + j] = qs[n * K + g * kGroup + kk];
        }
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor panel_linear_cpu(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
                    "panel_linear: x must be float32 [M, K] with unit stride along K, got ", x.scalar_type(), " ",
                    x.sizes(), " strides ", x.strides());
  const bool blocks = panels.scalar_type() == at::kByte;
  if (blocks) {
    TORCH_CHECK_VALUE(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kGroupBytes,
                      "panel_linear: block panels must be contiguous uint8 [num_panels, K / ", kGroup, ", ",
                      kGroupBytes, "] from this library's pack_block_panels, got ", panels.sizes());
    TORCH_CHECK_VALUE(panels.size(1) * kGroup == x.size(1), "panel_linear: x has K = ", x.size(1),
                      ", block panels have ", panels.size(1) * kGroup);
  } else {
    TORCH_CHECK_VALUE(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                          panels.size(2) == kNR,
                      "panel_linear: panels must be contiguous float32 [num_panels, K, ", kNR,
                      "] from this library's pack_panels, got ", panels.scalar_type(), " ", panels.sizes());
    TORCH_CHECK_VALUE(panels.size(1) == x.size(1), "panel_linear: x has K = ", x.size(1), ", panels have ",
                      panels.size(1));
  }
  TORCH_CHECK_VALUE(out_features >= 1 && out_features <= panels.size(0) * kNR &&
                        out_features > (panels.size(0) - 1) * kNR,
                    "panel_linear: out_features ", out_features, " does not fit ", panels.size(0), " panels of ",
                    kNR);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                          bias->is_contiguous(),
                      "panel_linear: bias must be contiguous float32 [out_features]");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), N = out_features, K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0) return y;
  if (K == 0) return b == nullptr ? y.zero_() : y.copy_(bias->unsqueeze(0).expand({M, N}));
  const Problem p{x.data_ptr<float>(), x.stride(0), blocks ? nullptr : panels.data_ptr<float>(),
                  blocks ? panels.data_ptr<uint8_t>() : nullptr, b, y.data_ptr<float>(), M, N, K};
  const int64_t num_panels = panels.size(0);
  const int64_t mc = std::max<int64_t>(kMR, kXBlockFloats / K / kMR * kMR);
  // The work goes in items of one block of x rows times a chunk of contiguous panels (at
  // least ~64K weights' worth), handed to whichever thread asks next (parallel_dynamic), the
  // row blocks in order. Few row blocks (decode): about kChunksPerThread chunks per thread;
  // many (prefill): one per thread, so that weights and x are read as often as with a
  // fixed split, each thread passing each of its row blocks over a panel range.
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * kNR));
  const int64_t max_chunks = std::max<int64_t>(1, num_panels / grain);
  const int64_t num_row_blocks = (M + mc - 1) / mc;
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), max_chunks);
  // Chunks of equal size where they can be: the fewest multiple of the thread count, from
  // the chunks above, that divides the panels and the grain allows. Threads that take equal
  // items in turn finish together, where 8 chunks of 30 panels (3 or 4 each) left one thread
  // 2 panels behind at the region's end (16 against 14: the QKV projection, 960 columns).
  int64_t num_chunks = 1;
  if (threads > 1) {
    const int64_t wanted = threads * std::max<int64_t>(1, kChunksPerThread / num_row_blocks);
    num_chunks = std::min(max_chunks, wanted);
    for (int64_t c = wanted; c <= max_chunks; c += threads) {
      if (num_panels % c == 0) {
        num_chunks = c;
        break;
      }
    }
  }
  parallel_dynamic(num_row_blocks * num_chunks, threads, [&](int64_t item) {
    const int64_t m0 = item / num_chunks * mc, m1 = std::min(M, m0 + mc), chunk = item % num_chunks;
    const int64_t end = (chunk + 1) * num_panels / num_chunks;
    for (int64_t panel = chunk * num_panels / num_chunks; panel < end; ++panel) panel_rows(p, panel, m0, m1);
  });
  return y;
}

}  // namespace splitserve

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
  m.def("pack_block_panels(Tensor d, Tensor m, Tensor q) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("pack_panels", &splitserve::pack_panels_cpu);
  m.impl("panel_linear", &splitserve::panel_linear_cpu);
  m.impl("pack_block_panels", &splitserve::pack_block_panels_cpu);
}
