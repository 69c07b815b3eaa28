// Paged attention on CPU, reading K/V in place through the block table.
//
// One work item (attention_plan.h) is a tile of query rows (token x query head of one GQA
// group) against a range of key positions of one KV head. Keys are visited
// in chunks of up to kChunk positions inside one page:
//
//   kt   = K chunk transposed into [head_dim, kChunk] (L1 scratch), so that scores are
//          broadcast-FMAs over contiguous vectors: s[0:kChunk] += q[d] * kt[d, 0:kChunk]
//   p    = exp(s - running max), masked to the keys the row may see (causal)
//   acc  = acc * exp(old max - new max) + sum_t p[t] * V[t, :]   (V rows read in place)
//
// Rows go through each chunk in blocks of kRowBlock (scores) and kAccRows (values) whose
// FMA chains interleave and share every K/V vector loaded; a decode item (one token, a GQA
// group of rows) scores its few rows straight from the K rows instead (AVX-512 and AVX2),
// all its keys before one exact softmax and then the V rows (attend_decode). Softmax is
// online elsewhere, and in float32 whatever the cache dtype. Items run on the intra-op
// threads, largest first, taken from a shared counter; tiles whose keys were split over
// several items are merged by a combine pass. Vector code is ATen's at::vec::Vectorized,
// compiled once per CPU capability (setup.py), so one source serves AVX-512, AVX2 and NEON.
#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#include "attention_plan.h"
#include "attention_scores.h"
#include "int8_kv.h"
#include "paged_attention_args.h"
#include "threads.h"

namespace splitserve {
namespace {

constexpr int kDirectMaxRows = 4;  // tiles with up to this many rows score keys directly
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename scalar_t>
struct Call {  // one call's tensors as raw pointers and element strides
  const scalar_t* query;
  const scalar_t* k;
  const scalar_t* v;
  scalar_t* out;  // [num_tokens, num_heads, head_dim], contiguous
  const int64_t* block_tables;
  PagedGeometry g;
  // An int8 cache (kernels/splitserve_kernels/kv_int8.py; k and v are then null): rows of head_dim int8 values
  // and their float32 scale, dequantized chunk by chunk into scratch (int8_kv.h).
  const int8_t* k8 = nullptr;
  const int8_t* v8 = nullptr;
};

struct Scratch {  // per thread, reused across calls
  std::vector<float> q, acc, kt, vrows, krows, m, l;
  std::vector<float> scores;  // attend_decode: every score of an item's rows
  alignas(64) float s[4 * kWide];  // scores of a block of rows (kRowBlock <= 4)

  void reserve(int64_t max_rows, int64_t head_dim) {
    q.resize(max_rows * head_dim);
    acc.resize(max_rows * head_dim);
    kt.resize(head_dim * kWide);
    vrows.resize(kChunk * head_dim);
    krows.resize(kChunk * head_dim);
    m.resize(max_rows);
    l.resize(max_rows);
  }
};

Scratch& thread_scratch(const PagedGeometry& g) {
  thread_local Scratch scratch;
  scratch.reserve(g.max_rows, g.head_dim);
  return scratch;
}

// Online softmax over the first `nv` scores of s (the keys this row sees, NV vectors of them):
// turns s into p = exp(s - new max) (0 past nv), updates the running max m and sum l, and
// returns the factor exp(old max - new max) that rescales the row's accumulator.
template <int NV = kChunkVecs>
inline float row_softmax(float* s, int nv, float& m, float& l) {
  Vec chunk_max(kNegInf);
  for (int j = 0; j < NV; ++j) {
    const int visible = std::clamp(nv - j * kVec, 0, kVec);
    chunk_max = at::vec::maximum(chunk_max, Vec::set(Vec(kNegInf), Vec::loadu(s + j * kVec), visible));
  }
  const float new_max = std::max(m, at::vec::vec_reduce_all<float>(
      [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, chunk_max));
  const float alpha = new_max == m ? 1.0f : std::exp(m - new_max);  // 0 while m is -inf
  const Vec vmax(new_max);
  Vec sum(0.0f);
  for (int j = 0; j < NV; ++j) {
    const int visible = std::clamp(nv - j * kVec, 0, kVec);
    const Vec p = Vec::set(Vec(0.0f), (Vec::loadu(s + j * kVec) - vmax).exp_u20(), visible);
    p.store(s + j * kVec);
    sum = sum + p;
  }
  const float chunk_sum = at::vec::vec_reduce_all<float>(
      [](const Vec& a, const Vec& b) { return a + b; }, sum);
  l = l * alpha + chunk_sum;
  m = new_max;
  return alpha;
}

// acc[0:D] = acc * alpha + sum_{t < nv} p[t] * v[t * v_stride + 0:D], any head_dim (the
// vectorised accumulate_rows serves the head_dims dispatch_head_dim names).
inline void row_accumulate(const float* p, int nv, const float* v, int64_t v_stride, float alpha,
                           float* acc, int head_dim) {
  for (int d = 0; d < head_dim; ++d) acc[d] *= alpha;
  for (int t = 0; t < nv; ++t) {
    const float* row = v + t * v_stride;
    for (int d = 0; d < head_dim; ++d) acc[d] += p[t] * row[d];
  }
}

// Rows scored together (kRowBlock) and accumulated together (kAccRows): as many as keep
// their accumulators in the vector registers (32 under AVX-512, 16 under AVX2).
constexpr int kRowBlock = kVec == 16 ? 4 : 2;
constexpr int kAccRows = kVec == 16 ? 4 : 1;
static_assert(kRowBlock <= 4, "Scratch::s holds 4 rows of scores");

// fn(std::integral_constant<int, n>) for a runtime n in [1, kMax].
template <int kMax, typename F>
inline void dispatch_rows(int n, const F& fn) {
  if constexpr (kMax >= 1) {
    if (n == kMax) return fn(std::integral_constant<int, kMax>{});
    if constexpr (kMax > 1) dispatch_rows<kMax - 1>(n, fn);
  }
}

// s[i * kChunk + t] = q_i . k_t for the RB rows q (head_dim kD apart) from the transposed
// chunk kt; two FMA chains per row and vector (as scores_transposed), RB rows interleaved.
template <int RB, int kD>
inline void scores_rows(const float* q, const float* kt, float* s) {
  Vec a0[RB][kChunkVecs], a1[RB][kChunkVecs];
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < kChunkVecs; ++j) a0[i][j] = a1[i][j] = Vec(0.0f);
  }
  for (int d = 0; d < kD; d += 2) {
    Vec k0[kChunkVecs], k1[kChunkVecs];
    for (int j = 0; j < kChunkVecs; ++j) {
      k0[j] = Vec::loadu(kt + d * kChunk + j * kVec);
      k1[j] = Vec::loadu(kt + (d + 1) * kChunk + j * kVec);
    }
    for (int i = 0; i < RB; ++i) {
      const Vec q0(q[i * kD + d]), q1(q[i * kD + d + 1]);
      for (int j = 0; j < kChunkVecs; ++j) {
        a0[i][j] = at::vec::fmadd(q0, k0[j], a0[i][j]);
        a1[i][j] = at::vec::fmadd(q1, k1[j], a1[i][j]);
      }
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < kChunkVecs; ++j) (a0[i][j] + a1[i][j]).store(s + i * kChunk + j * kVec);
  }
}

// acc_i[0:kD] = acc_i * alpha_i + sum_{t < n1 + n2} p_i[t] * V_t for RB rows (p_i = p + i *
// p_stride, 0 past each row's own keys; acc_i = acc + i * kD), the V rows in two runs: n1 at
// v1, then n2 at v2 (v_stride apart). Each V vector is loaded once for all RB rows, and the
// accumulators stay in registers across both runs.
template <int RB, int kD>
inline void accumulate_rows_two(const float* p, int64_t p_stride, int n1, const float* v1, int n2,
                                const float* v2, int64_t v_stride, const float* alpha, float* acc,
                                const float* ahead = nullptr, int ahead_n = 0) {
  constexpr int kN = kD / kVec;
  Vec a[RB][kN];
  for (int i = 0; i < RB; ++i) {
    const Vec va(alpha[i]);
    for (int j = 0; j < kN; ++j) a[i][j] = Vec::loadu(acc + i * kD + j * kVec) * va;
  }
  // The two runs as one loop over keys (not a lambda per run: GCC kept the accumulators of a
  // capturing lambda on the stack, a store and a reload around every FMA).
  const int n = n1 + n2;
  for (int t = 0; t < n; ++t) {
    if (t < ahead_n) prefetch_row<kD>(ahead + t * v_stride);
    const float* row = t < n1 ? v1 + t * v_stride : v2 + (t - n1) * v_stride;
    Vec vv[kN];
    for (int j = 0; j < kN; ++j) vv[j] = Vec::loadu(row + j * kVec);
    for (int i = 0; i < RB; ++i) {
      const Vec pt(p[i * p_stride + t]);
      for (int j = 0; j < kN; ++j) a[i][j] = at::vec::fmadd(pt, vv[j], a[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < kN; ++j) a[i][j].store(acc + i * kD + j * kVec);
  }
}

// The same over nv keys in one run of V rows at v.
template <int RB, int kD>
inline void accumulate_rows(const float* p, int64_t p_stride, int nv, const float* v, int64_t v_stride,
                            const float* alpha, float* acc, const float* ahead = nullptr, int ahead_n = 0) {
  accumulate_rows_two<RB, kD>(p, p_stride, nv, v, 0, v, v_stride, alpha, acc, ahead, ahead_n);
}

template <typename scalar_t>
void load_queries(const Call<scalar_t>& c, const WorkItem& w, Scratch& sc) {
  const auto& g = c.g;
  const float scale = static_cast<float>(g.scale);
  const int64_t heads = g.group * w.num_kv;  // query heads per token of the item
  for (int i = 0; i < w.num_tokens; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* src =
          c.query + (w.tok_begin + i) * g.q_token + (w.kv_head * g.group + h) * g.q_head;
      float* dst = sc.q.data() + (i * heads + h) * g.head_dim;
      for (int d = 0; d < g.head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
    }
  }
}

// V rows of a chunk as float: in place for a float cache, else converted into scratch.
template <typename scalar_t>
const float* value_rows(const scalar_t* v, int64_t slot_stride, int n, int D, Scratch& sc,
                        int64_t& stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    stride = slot_stride;
    return v;
  } else {
    for (int t = 0; t < n; ++t) {
      for (int d = 0; d < D; ++d) sc.vrows[t * D + d] = static_cast<float>(v[t * slot_stride + d]);
    }
    stride = D;
    return sc.vrows.data();
  }
}

// Ask for the n rows (row_bytes each, slot_stride elements apart) of the next chunk: its page
// is elsewhere in memory, so the hardware prefetcher cannot see it coming.
// An int8 row (head_dim + 4 bytes) may end in a cache line its first bytes' step misses: its
// last byte is asked for too. The lines go to L2 (prefetcht1), not L1: the 64 lines of a
// chunk's 4 KB asked into L1 held the L1's few miss buffers. Decode over 30 layers' caches in
// a 2 GiB pool of pages in random order, 2 threads, Zen 4, 3 runs each alternated: 16
// sequences x 320 keys 14.4-17.1 -> 12.0-13.9 ms (AVX-512), 17.2-19.7 -> 12.6-13.7 (AVX2);
// 64 x 200 keys 39.7-45.7 -> 29.3-35.9 ms (AVX-512).
//
// A float decode item (attend_decode) no longer asks for a whole chunk at once: its 64 lines
// (4 KB) in a burst stalled on the miss buffers, and the arithmetic waited with them (perf put
// 20-40% of the item's time on the prefetch instructions). It asks for one row of the next
// chunk per key it multiplies, the rows shared out over the GQA group's query rows (`ahead`),
// and the K pass's last chunk asks for the V pass's first rows. The same benchmark, in one
// process, burst -> spread, medians of 10: 64 x 200 keys 31.6 -> 24.1 ms (AVX-512), 36.9 ->
// 30.3 (AVX2); 16 x 320 keys 13.9 -> 10.7 (AVX-512), 13.2 -> 10.0 (AVX2); one thread, 64 x
// 200, 55.2 -> 46.6 with the rows asked for by the first query row alone. An int8 decode item
// asks for the next chunk's rows one per row it converts (dequantize_rows). Prefill tiles keep
// the chunk ahead (prefetch_ahead).
template <typename elem_t>
inline void prefetch_rows(const elem_t* p, int64_t slot_stride, int n, int64_t row_bytes) {
  for (int t = 0; t < n; ++t) {
    const char* row = reinterpret_cast<const char*>(p + t * slot_stride);
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
    __builtin_prefetch(row + row_bytes - 1, 0, 2);
  }
}

// A prefill tile's keys are asked for this many chunks before they are read (their pages are
// anywhere in memory, so the hardware prefetcher cannot see them coming). Measured when decode
// items did the same, on a batch-64 decode over 30 layers' caches: none 1220 us a call, 1 to 4
// chunks ahead 1054-1068 us, 8 worse (decode items now spread theirs: prefetch_rows).
constexpr int kPrefetchChunks = 2;

// Ask for the K and/or V rows (kK, kV) of the keys in [prefetched, min(until, key_end)), page
// by page, and move `prefetched` on. The first call (prefetched = key_begin) skips the chunk
// about to be read (`n` keys): asking for it now would not help.
template <bool kK, bool kV, typename scalar_t>
inline void prefetch_ahead(const Call<scalar_t>& c, const WorkItem& w, const int64_t* pages, int64_t until,
                           int n, int64_t& prefetched) {
  const auto& g = c.g;
  if (prefetched == w.key_begin) prefetched += n;
  const int64_t end = std::min<int64_t>(until, w.key_end);
  const bool int8 = c.k8 != nullptr;  // rows of head_dim int8 values and a float32 scale
  const int64_t row_bytes = int8 ? g.head_dim + static_cast<int64_t>(sizeof(float))
                                 : g.head_dim * static_cast<int64_t>(sizeof(scalar_t));
  while (prefetched < end) {
    const int64_t offset = prefetched % g.block_size;
    const int rows = static_cast<int>(std::min<int64_t>(g.block_size - offset, end - prefetched));
    const int64_t page = pages[prefetched / g.block_size];
    if constexpr (kK) {
      const int64_t at = page * g.k_block + offset * g.k_slot + w.kv_head * g.k_head;
      if (int8) prefetch_rows(c.k8 + at, g.k_slot, rows, row_bytes);
      else prefetch_rows(c.k + at, g.k_slot, rows, row_bytes);
    }
    if constexpr (kV) {
      const int64_t at = page * g.v_block + offset * g.v_slot + w.kv_head * g.v_head;
      if (int8) prefetch_rows(c.v8 + at, g.v_slot, rows, row_bytes);
      else prefetch_rows(c.v + at, g.v_slot, rows, row_bytes);
    }
    prefetched += rows;
  }
}

// fn(pos, n, page, offset) for the item's keys [key_begin, key_end) in chunks of up to kChunk
// keys inside one page: n keys from position pos, at slot `offset` of block `page`.
template <typename F>
inline void for_each_chunk(const PagedGeometry& g, const WorkItem& w, const int64_t* pages, const F& fn) {
  for (int pos = w.key_begin; pos < w.key_end;) {
    const int64_t offset = pos % g.block_size;
    const int n = static_cast<int>(
        std::min<int64_t>({kChunk, g.block_size - offset, static_cast<int64_t>(w.key_end - pos)}));
    fn(pos, n, pages[pos / g.block_size], offset);
    pos += n;
  }
}

// Decode (one query token: its GQA group's few rows) in two passes over the item's keys, all
// of which the token sees: every score first (K rows only), one exact softmax per row over
// them, then the values (V rows only). Unlike the online softmax of attend_keys there is no
// per-chunk max, rescale or exp of a running state, and no chain through a chunk's softmax
// between its loads and the next chunk's, so many pages' loads are in flight at once.
// An item over several KV heads (attention_plan.h: whole_decode) takes each chunk's heads in
// turn, so a page's K (then V) tiles of every head are read together, front to back.
template <int kD>
void attend_decode(const Call<float>& c, const WorkItem& w, Scratch& sc) {
  static_assert(kD > 0, "the decode path needs a known head_dim");
  const auto& g = c.g;
  const int group = static_cast<int>(g.group);
  const int heads = w.num_kv;
  const int rows = group * heads;  // row h * group + r: query head (kv_head + h) * group + r
  const int64_t* pages = c.block_tables + w.seq * g.bt_seq;
  const int nkeys = w.key_end - w.key_begin;
  // Row r's scores at r * stride; scores_direct writes whole chunks, hence the padding.
  const int64_t stride = (nkeys + 2 * kChunk - 1) / kChunk * kChunk;
  if (static_cast<int64_t>(sc.scores.size()) < rows * stride) sc.scores.resize(rows * stride);
  float* scores = sc.scores.data();
  // Where head h's K (keys) or V rows of the chunk at key position `pos` start in their cache,
  // in elements, and how many keys the chunk has (for_each_chunk's cut).
  const bool int8 = c.k8 != nullptr;
  auto chunk_at = [&](bool keys, int pos, int h, int& count) {
    const int64_t offset = pos % g.block_size;
    count = static_cast<int>(std::min<int64_t>({kChunk, g.block_size - offset, static_cast<int64_t>(w.key_end - pos)}));
    const int64_t page = pages[pos / g.block_size];
    const int64_t head = w.kv_head + h;
    return keys ? page * g.k_block + offset * g.k_slot + head * g.k_head
                : page * g.v_block + offset * g.v_slot + head * g.v_head;
  };
  // Head h's n K rows (kKeys) or V rows of a chunk as float, and their stride: in place in a
  // float cache, or dequantized into scratch from an int8 one. The next chunk's rows are asked
  // for a few at a time among the work on this one (module comment at prefetch_rows).
  auto chunk_rows = [&](auto keys, int pos, int h, int64_t& stride) {
    constexpr bool kKeys = decltype(keys)::value;
    int n = 0;
    const int64_t at = chunk_at(kKeys, pos, h, n);
    if (int8) {
      // The next chunk's rows (after the K pass's last, the V pass's first), one per row converted.
      int ahead_n = 0;
      const int8_t* ahead = nullptr;
      if (pos + n < w.key_end) ahead = (kKeys ? c.k8 : c.v8) + chunk_at(kKeys, pos + n, h, ahead_n);
      else if (kKeys && g.v_slot == g.k_slot) ahead = c.v8 + chunk_at(false, w.key_begin, h, ahead_n);
      float* rows_f = kKeys ? sc.krows.data() : sc.vrows.data();
      dequantize_rows((kKeys ? c.k8 : c.v8) + at, kKeys ? g.k_slot : g.v_slot, n, kD, rows_f, ahead, ahead_n);
      stride = kD;
      return static_cast<const float*>(rows_f);
    }
    stride = kKeys ? g.k_slot : g.v_slot;
    return (kKeys ? c.k : c.v) + at;
  };
  // A float cache's next chunk of head h, K (keys) or V rows, to ask for while this one is multiplied.
  auto ahead_of = [&](bool keys, int pos, int h, int& count) -> const float* {
    if (int8) return nullptr;
    const int64_t at = chunk_at(keys, pos, h, count);
    return (keys ? c.k : c.v) + at;
  };
  for_each_chunk(g, w, pages, [&](int pos, int n, int64_t, int64_t) {
    for (int h = 0; h < heads; ++h) {
      int64_t k_slot = 0;
      const float* kp = chunk_rows(std::true_type{}, pos, h, k_slot);
      // The next chunk's K rows, or after the last the V pass's first rows (where they lie as
      // far apart as the K rows), a share of them with each query row's scores.
      int ahead_n = 0;
      const float* ahead = nullptr;
      if (pos + n < w.key_end) ahead = ahead_of(true, pos + n, h, ahead_n);
      else if (g.v_slot == g.k_slot) ahead = ahead_of(false, w.key_begin, h, ahead_n);
      if (ahead == nullptr) ahead_n = 0;
      for (int r = 0; r < group; ++r) {
        const int lo = ahead_n * r / group, hi = ahead_n * (r + 1) / group;
        const int row = h * group + r;
        scores_direct<kD>(sc.q.data() + row * kD, kp, k_slot, n, scores + row * stride + (pos - w.key_begin),
                          hi > lo ? ahead + lo * k_slot : nullptr, hi - lo);
      }
    }
  });
  for (int r = 0; r < rows; ++r) {  // p = exp(s - max) over the row's nkeys scores
    float* s = scores + r * stride;
    Vec vmax(kNegInf);
    for (int t = 0; t < nkeys; t += kVec) {
      vmax = at::vec::maximum(vmax, Vec::set(Vec(kNegInf), Vec::loadu(s + t), std::min(kVec, nkeys - t)));
    }
    const float max = at::vec::vec_reduce_all<float>(
        [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, vmax);
    const Vec vm(max);
    Vec sum(0.0f);
    for (int t = 0; t < nkeys; t += kVec) {
      const Vec p = Vec::set(Vec(0.0f), (Vec::loadu(s + t) - vm).exp_u20(), std::min(kVec, nkeys - t));
      p.store(s + t);
      sum = sum + p;
    }
    sc.m[r] = max;
    sc.l[r] = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, sum);
  }
  float alpha[kAccRows];  // no rescaling: every p already has the row's final max
  std::fill(alpha, alpha + kAccRows, 1.0f);
  for_each_chunk(g, w, pages, [&](int pos, int n, int64_t, int64_t) {
    for (int h = 0; h < heads; ++h) {
      int64_t v_stride = 0;
      const float* vf = chunk_rows(std::false_type{}, pos, h, v_stride);
      const float* p = scores + h * group * stride + (pos - w.key_begin);
      int ahead_n = 0;  // the next chunk's V rows, shared out as in the K pass
      const float* ahead = pos + n < w.key_end ? ahead_of(false, pos + n, h, ahead_n) : nullptr;
      if (ahead == nullptr) ahead_n = 0;
      const int calls = (group + kAccRows - 1) / kAccRows;
      for (int i = 0; i < group; i += kAccRows) {
        const int lo = ahead_n * (i / kAccRows) / calls, hi = ahead_n * (i / kAccRows + 1) / calls;
        dispatch_rows<kAccRows>(std::min(kAccRows, group - i), [&](auto r) {
          accumulate_rows<decltype(r)::value, kD>(p + i * stride, stride, n, vf, v_stride, alpha,
                                                  sc.acc.data() + (h * group + i) * kD,
                                                  hi > lo ? ahead + lo * v_stride : nullptr, hi - lo);
        });
      }
    }
  });
}

template <typename scalar_t, int kD>
void attend_keys(const Call<scalar_t>& c, const WorkItem& w, Scratch& sc) {
  const auto& g = c.g;
  const int D = static_cast<int>(g.head_dim);
  const int rows = w.num_tokens * static_cast<int>(g.group);
  const int64_t* pages = c.block_tables + w.seq * g.bt_seq;
  // Few rows (decode): score keys straight from the cache; many: transpose each chunk once.
  constexpr bool kDirect = kHasDirectScores && std::is_same_v<scalar_t, float> && kD > 0;
  const bool direct = kDirect && rows <= kDirectMaxRows;
  if constexpr (kDirect) {
    if (direct && w.num_tokens == 1) return attend_decode<kD>(c, w, sc);
  }
  if constexpr (std::is_same_v<scalar_t, float> && kD > 0 && kD % kVec == 0) {
    if (!direct && c.k8 == nullptr) return attend_wide<kD>(c, w, sc);
  }
  int64_t prefetched = w.key_begin;  // keys below this were asked for (prefetch_ahead)
  for_each_chunk(g, w, pages, [&](int pos, int n, int64_t page, int64_t offset) {
    const int64_t k_at = page * g.k_block + offset * g.k_slot + w.kv_head * g.k_head;
    const int64_t v_at = page * g.v_block + offset * g.v_slot + w.kv_head * g.v_head;
    const scalar_t* kp = c.k8 != nullptr ? nullptr : c.k + k_at;
    const scalar_t* vp = c.k8 != nullptr ? nullptr : c.v + v_at;
    int64_t k_slot = g.k_slot;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (c.k8 != nullptr) {  // int8 rows -> float rows of head_dim in scratch
        dequantize_rows(c.k8 + k_at, g.k_slot, n, D, sc.krows.data());
        dequantize_rows(c.v8 + v_at, g.v_slot, n, D, sc.vrows.data());
        kp = sc.krows.data();
        k_slot = D;
      }
    }
    prefetch_ahead<true, true>(c, w, pages, pos + static_cast<int64_t>(kPrefetchChunks) * kChunk, n, prefetched);
    if (!direct) transpose_keys(kp, k_slot, n, D, sc.kt.data());
    int64_t v_stride = D;
    const float* vf = c.k8 != nullptr ? sc.vrows.data() : value_rows(vp, g.v_slot, n, D, sc, v_stride);
    // Rows in blocks: their score and value FMA chains interleave (one row alone is bound by
    // FMA latency, not throughput), and each K/V vector loaded serves every row of the block.
    for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int rb = std::min(kRowBlock, rows - r0);
      float* s = sc.s;
      if constexpr (kD > 0) {
        if (direct) {
          for (int i = 0; i < rb; ++i) {
            scores_direct<kD>(sc.q.data() + (r0 + i) * D, reinterpret_cast<const float*>(kp), k_slot, n,
                              s + i * kChunk);
          }
        } else {
          dispatch_rows<kRowBlock>(rb, [&](auto r) { scores_rows<decltype(r)::value, kD>(sc.q.data() + r0 * D, sc.kt.data(), s); });
        }
      } else {
        for (int i = 0; i < rb; ++i) scores_transposed<kD>(sc.q.data() + (r0 + i) * D, sc.kt.data(), D, s + i * kChunk);
      }
      float alpha[kRowBlock];
      int nv_max = 0;
      for (int i = 0; i < rb; ++i) {
        // Row r is token r / group, at position pos_begin + r / group: it sees keys up to it.
        const int nv = std::min(n, w.pos_begin + (r0 + i) / static_cast<int>(g.group) - pos + 1);
        if (nv <= 0) {  // no key of this chunk: its state stays, p = 0 adds nothing
          std::fill(s + i * kChunk, s + (i + 1) * kChunk, 0.0f);
          alpha[i] = 1.0f;
          continue;
        }
        alpha[i] = row_softmax(s + i * kChunk, nv, sc.m[r0 + i], sc.l[r0 + i]);
        nv_max = std::max(nv_max, nv);
      }
      if (nv_max == 0) continue;
      float* acc = sc.acc.data() + r0 * D;
      if constexpr (kD > 0) {
        for (int i = 0; i < rb; i += kAccRows) {
          dispatch_rows<kAccRows>(std::min(kAccRows, rb - i), [&](auto r) {
            accumulate_rows<decltype(r)::value, kD>(s + i * kChunk, kChunk, nv_max, vf, v_stride, alpha + i,
                                                    acc + i * D);
          });
        }
      } else {
        for (int i = 0; i < rb; ++i) row_accumulate(s + i * kChunk, nv_max, vf, v_stride, alpha[i], acc + i * D, D);
      }
    }
  });
}

// scores_rows over kWide keys (kWideVecs vectors per row) from kt [kD, kWide]: one FMA chain
// per row and vector, RB * kWideVecs of them (8 under AVX-512, 8 under AVX2) hide the latency.
template <int RB, int kD>
inline void scores_rows_wide(const float* q, const float* kt, float* s) {
  Vec a[RB][kWideVecs];
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < kWideVecs; ++j) a[i][j] = Vec(0.0f);
  }
  for (int d = 0; d < kD; ++d) {
    Vec k[kWideVecs];
    for (int j = 0; j < kWideVecs; ++j) k[j] = Vec::loadu(kt + d * kWide + j * kVec);
    for (int i = 0; i < RB; ++i) {
      const Vec qd(q[i * kD + d]);
      for (int j = 0; j < kWideVecs; ++j) a[i][j] = at::vec::fmadd(qd, k[j], a[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < kWideVecs; ++j) a[i][j].store(s + i * kWide + j * kVec);
  }
}

// A float cache's tile of many rows (a prompt's): as attend_keys, but each online-softmax
// step takes two chunks of keys (kWide), which may lie in two pages, so a row's max, exp,
// sums and rescale of its accumulator are paid once per 32 keys instead of per 16. The
// rows' every score and value is the same product as attend_keys's; only the steps at which
// the running max is taken differ.
template <int kD>
void attend_wide(const Call<float>& c, const WorkItem& w, Scratch& sc) {
  const auto& g = c.g;
  const int rows = w.num_tokens * static_cast<int>(g.group);
  const int64_t* pages = c.block_tables + w.seq * g.bt_seq;
  int64_t prefetched = w.key_begin;
  struct Chunk {
    int pos, n;
    const float* k;
    const float* v;
  };
  const auto step = [&](const Chunk& a, const Chunk& b) {  // b.n may be 0
    const int n = a.n + b.n;
    for (int d = 0; d < kD && n < kWide; ++d) {  // the columns no key fills: 0, not stale keys
      std::fill(sc.kt.data() + d * kWide + n, sc.kt.data() + (d + 1) * kWide, 0.0f);
    }
    transpose_keys_into(a.k, g.k_slot, a.n, kD, sc.kt.data(), kWide);
    if (b.n > 0) transpose_keys_into(b.k, g.k_slot, b.n, kD, sc.kt.data() + a.n, kWide);
    for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int rb = std::min(kRowBlock, rows - r0);
      float* s = sc.s;
      dispatch_rows<kRowBlock>(rb, [&](auto r) { scores_rows_wide<decltype(r)::value, kD>(sc.q.data() + r0 * kD, sc.kt.data(), s); });
      float alpha[kRowBlock];
      int nv_max = 0;
      for (int i = 0; i < rb; ++i) {
        const int nv = std::min(n, w.pos_begin + (r0 + i) / static_cast<int>(g.group) - a.pos + 1);
        if (nv <= 0) {
          std::fill(s + i * kWide, s + (i + 1) * kWide, 0.0f);
          alpha[i] = 1.0f;
          continue;
        }
        alpha[i] = row_softmax<kWideVecs>(s + i * kWide, nv, sc.m[r0 + i], sc.l[r0 + i]);
        nv_max = std::max(nv_max, nv);
      }
      if (nv_max == 0) continue;
      const int n1 = std::min(nv_max, a.n), n2 = nv_max - n1;
      float* acc = sc.acc.data() + r0 * kD;
      for (int i = 0; i < rb; i += kAccRows) {
        dispatch_rows<kAccRows>(std::min(kAccRows, rb - i), [&](auto r) {
          accumulate_rows_two<decltype(r)::value, kD>(s + i * kWide, kWide, n1, a.v, n2, b.v, g.v_slot, alpha + i,
                                                      acc + i * kD);
        });
      }
    }
  };
  Chunk pending{0, 0, nullptr, nullptr};
  for_each_chunk(g, w, pages, [&](int pos, int n, int64_t page, int64_t offset) {
    prefetch_ahead<true, true>(c, w, pages, pos + static_cast<int64_t>(kPrefetchChunks) * kChunk, n, prefetched);
    const Chunk here{pos, n, c.k + page * g.k_block + offset * g.k_slot + w.kv_head * g.k_head,
                     c.v + page * g.v_block + offset * g.v_slot + w.kv_head * g.v_head};
    if (pending.n == 0) {
      pending = here;
    } else {
      step(pending, here);
      pending.n = 0;
    }
  });
  if (pending.n > 0) step(pending, Chunk{pending.pos + pending.n, 0, nullptr, nullptr});
}


struct Partials {  // softmax state of split items: [num_partials, max_rows(, head_dim)]
  float* m;
  float* l;
  float* acc;
};

// Whether attend_decode serves a decode item of this call (and so items over every KV head).
template <typename scalar_t, int kD>
bool decode_direct(const PagedGeometry& g) {
  return kHasDirectScores && std::is_same_v<scalar_t, float> && kD > 0 && g.group <= kDirectMaxRows;
}

template <typename scalar_t, int kD>
void run_item(const Call<scalar_t>& c, const WorkItem& w, Scratch& sc, const Partials& part) {
  const auto& g = c.g;
  const int64_t D = g.head_dim;
  if (w.num_kv > 1 && !decode_direct<scalar_t, kD>(g)) {  // the other paths take one KV head at a time
    for (int32_t h = 0; h < w.num_kv; ++h) {
      WorkItem one = w;
      one.kv_head = w.kv_head + h;
      one.num_kv = 1;
      run_item<scalar_t, kD>(c, one, sc, part);
    }
    return;
  }
  const int64_t heads = g.group * w.num_kv;  // query heads per token of the item
  const int rows = w.num_tokens * static_cast<int>(heads);
  load_queries(c, w, sc);
  std::fill(sc.m.begin(), sc.m.begin() + rows, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.0f);
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.0f);
  attend_keys<scalar_t, kD>(c, w, sc);
  for (int r = 0; r < rows; ++r) {
    const float* acc = sc.acc.data() + r * D;
    if (w.partial >= 0) {
      part.m[w.partial * g.max_rows + r] = sc.m[r];
      part.l[w.partial * g.max_rows + r] = sc.l[r];
      std::copy(acc, acc + D, part.acc + (w.partial * g.max_rows + r) * D);
      continue;
    }
    const int64_t head = w.kv_head * g.group + r % heads;
    scalar_t* dst = c.out + ((w.tok_begin + r / heads) * g.num_heads + head) * D;
    const float inv = 1.0f / sc.l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
  }
}

template <typename scalar_t>
void combine_split(const Call<scalar_t>& c, const SplitTile& t, const Partials& part) {
  const auto& g = c.g;
  const int64_t D = g.head_dim;
  std::vector<float> acc(D);
  for (int r = 0; r < t.num_tokens * g.group; ++r) {
    float max = kNegInf;
    for (int i = 0; i < t.num_splits; ++i) max = std::max(max, part.m[(t.first_partial + i) * g.max_rows + r]);
    float sum = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int i = 0; i < t.num_splits; ++i) {
      const int64_t slot = (t.first_partial + i) * g.max_rows + r;
      const float w = std::exp(part.m[slot] - max);  // 0 for a split this row sees nothing of
      sum += part.l[slot] * w;
      const float* a = part.acc + slot * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
    }
    const int64_t head = t.kv_head * g.group + r % g.group;
    scalar_t* dst = c.out + ((t.tok_begin + r / g.group) * g.num_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] / sum);
  }
}

template <typename scalar_t, int kD>
void run_plan(const Call<scalar_t>& c, const AttentionPlan& plan) {
  at::Tensor partial_buf;
  Partials part{nullptr, nullptr, nullptr};
  if (plan.num_partials > 0) {
    const int64_t rows = plan.num_partials * c.g.max_rows;
    partial_buf = at::empty({rows * (2 + c.g.head_dim)}, at::kFloat);
    part = {partial_buf.data_ptr<float>(), partial_buf.data_ptr<float>() + rows,
            partial_buf.data_ptr<float>() + 2 * rows};
  }
  parallel_dynamic(static_cast<int64_t>(plan.items.size()), plan.num_threads, [&](int64_t i) {
    run_item<scalar_t, kD>(c, plan.items[i], thread_scratch(c.g), part);
  });
  parallel_dynamic(static_cast<int64_t>(plan.splits.size()), plan.num_threads,
                   [&](int64_t i) { combine_split(c, plan.splits[i], part); });
}

template <typename scalar_t>
void dispatch_head_dim(const Call<scalar_t>& c, const AttentionPlan& plan) {
  switch (c.g.head_dim) {
    case 32: return run_plan<scalar_t, 32>(c, plan);
    case 64: return run_plan<scalar_t, 64>(c, plan);
    case 96: return run_plan<scalar_t, 96>(c, plan);
    case 128: return run_plan<scalar_t, 128>(c, plan);
    default: return run_plan<scalar_t, 0>(c, plan);
  }
}

}  // namespace

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               double scale, bool batch_invariant) {
  PagedArgs args = check_paged_attention_args(query, k_cache, v_cache, block_tables, seq_lens,
                                              query_start_loc, scale);
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.size(0) == 0) return out;
  PlanInputs inputs = args.plan_inputs(at::in_parallel_region() ? 1 : at::get_num_threads());
  const auto& g = args.geometry;
  inputs.whole_decode = kHasDirectScores && query.scalar_type() == at::kFloat && g.group <= kDirectMaxRows &&
                        (g.head_dim == 32 || g.head_dim == 64 || g.head_dim == 96 || g.head_dim == 128);
  inputs.one_token_items = batch_invariant;
  const AttentionPlan plan = make_attention_plan(inputs);
  if (k_cache.scalar_type() == at::kChar) {  // int8 cache, float32 queries (checked)
    Call<float> call{args.query.data_ptr<float>(), nullptr, nullptr, out.data_ptr<float>(),
                     args.block_tables.data_ptr<int64_t>(), args.geometry};
    call.k8 = k_cache.data_ptr<int8_t>();
    call.v8 = v_cache.data_ptr<int8_t>();
    dispatch_head_dim(call, plan);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_cpu", [&] {
    const Call<scalar_t> call{args.query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                              v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                              args.block_tables.data_ptr<int64_t>(), args.geometry};
    dispatch_head_dim(call, plan);
  });
  return out;
}

}  // namespace splitserve
