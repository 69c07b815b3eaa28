// A model's Llama decoder layers in one operator call (CPU, float32): per layer, the native
// ops that engine/models/llama.py's LlamaModel._layer calls one at a time, called here in the
// same order on the same arguments, so its output, the residual stream and the KV cache are
// the same bits (in sequence groups, below, attention is planned for one thread and splits no
// row's keys; where the Python route's team would split a long row's keys, that row's sums
// are added in another order). What it saves is the Python and the dispatcher between those calls, and the
// interpreter lock: a custom operator's arguments are let go inside the call, with the lock
// released, and letting go of the last C++ reference to a tensor Python also holds takes the
// lock back (torch keeps a tensor's Python object alive while C++ holds it): with a call per
// layer, 17 times a layer, each a wait whenever the worker's gRPC thread held the lock. The
// weights therefore come in a DecoderWeights object, made once, which holds them in C++ for as
// long as it lives: a call lets go of its eight per-step tensors only.
//
// It serves the layers whose every op is native: weights in column or block panels (panel_gemm.cpp) or
// in GGUF blocks (quant_matmul.cpp), no q/k norms, a float32 or an int8 cache (write_kv.cpp or
// kv_int8.cpp, paged_attention.cpp). The Python route serves the rest (oneDNN's linears,
// quantized formats other than GGUF blocks, CUDA) and is the reference the tests compare
// this with.
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "elementwise.h"
#include "paged_attention.h"
#include "panel_gemm.h"
#include "quant_matmul.h"

namespace splitserve {

// Every layer's weights, in decoder_layers' order: per layer input_norm, qkv, qkv_bias (none
// where the model has no bias), o, post_norm, gate_up, down, each linear in the form the
// caller chose for the call's row count (panels or GGUF blocks).
struct DecoderWeights : torch::CustomClassHolder {
  static constexpr int64_t kPerLayer = 7;
  std::vector<std::optional<at::Tensor>> tensors;

  explicit DecoderWeights(c10::List<std::optional<at::Tensor>> list) {
    TORCH_CHECK_VALUE(!list.empty() && list.size() % kPerLayer == 0, "DecoderWeights: ", kPerLayer,
                      " tensors per layer expected, got ", list.size());
    tensors.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      std::optional<at::Tensor> t = list.get(i);
      TORCH_CHECK_VALUE(i % kPerLayer == 2 || (t.has_value() && t->defined()), "DecoderWeights: tensor ",
                        i % kPerLayer, " of layer ", i / kPerLayer, " is missing (only the qkv bias may be)");
      tensors.push_back(std::move(t));
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(tensors.size()) / kPerLayer; }
};

namespace {

// layer.<linear>(x): a float32 weight is column panels and a 3-d uint8 one block panels
// (panel_gemm.cpp), a 2-d uint8 one rows of GGUF blocks, Q8_0 or Q4_1 as the row's bytes say
// (gguf_kind_of). The bias is added after the product, as GGUFLinear does.
at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                        const std::optional<at::Tensor>& bias) {
  if (weight.scalar_type() != at::kByte || weight.dim() == 3) return panel_linear_cpu(x, weight, out_features, bias);
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) == out_features, "decoder_layer: blocks of ",
                    out_features, " rows expected, got ", weight.sizes());
  const int64_t kind = gguf_kind_of(weight.size(1), x.size(1));
  TORCH_CHECK_VALUE(kind >= 0, "decoder_layer: rows of ", weight.size(1),
                    " bytes are neither Q8_0 nor Q4_1 blocks of ", x.size(1), " inputs");
  at::Tensor y = gguf_linear_cpu(x, weight, kind);
  return bias.has_value() ? y.add_(*bias) : y;
}

// One layer: returns its MLP output (decoder_layers_cpu adds it to x in the next layer's first norm).
at::Tensor decoder_layer_cpu(
    at::Tensor& x,                             // [T, hidden] float32, the residual stream, updated in place
    const std::optional<at::Tensor>& mlp_out,  // [T, hidden], the previous layer's MLP output (none: the first)
    const at::Tensor& input_norm,              // [hidden]
    const at::Tensor& qkv,                     // [(H + 2 KV) D, hidden] in panels or GGUF blocks
    const std::optional<at::Tensor>& qkv_bias,  // [(H + 2 KV) D] or none
    const at::Tensor& o,                       // [hidden, H D], the same
    const at::Tensor& post_norm,               // [hidden]
    const at::Tensor& gate_up,                 // [2 intermediate, hidden], the same
    const at::Tensor& down,                    // [hidden, intermediate], the same
    const at::Tensor& cos,                     // [T, 1, D]
    const at::Tensor& sin,                     // [T, 1, D], signed
    at::Tensor& k_cache,                       // [num_blocks, block_size, KV, D] (int8: D + 4), written in place
    at::Tensor& v_cache,                       // [num_blocks, block_size, KV, D] (int8: D + 4), written in place
    const at::Tensor& slot_mapping,            // [T]
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
    double scale, bool batch_invariant) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                    "decoder_layer: x must be a contiguous float32 [tokens, hidden], got ", x.scalar_type(), " ",
                    x.sizes());
  TORCH_CHECK_VALUE(num_heads >= 1 && num_kv_heads >= 1 && head_dim >= 1 && intermediate >= 1,
                    "decoder_layer: num_heads, num_kv_heads, head_dim and intermediate must be >= 1");
  const int64_t T = x.size(0), hidden = x.size(1), H = num_heads, KV = num_kv_heads, D = head_dim;
  // ops.rms_norm / ops.add_rms_norm_
  at::Tensor h = mlp_out.has_value() ? add_rms_norm_cpu(x, *mlp_out, input_norm, eps) : rms_norm_cpu(x, input_norm, eps);
  // layer.qkv(h), then q and k as one [T, H + KV, D] view, v after them
  const at::Tensor qkv_out = layer_linear(h, qkv, (H + 2 * KV) * D, qkv_bias);
  at::Tensor qk = qkv_out.narrow(1, 0, (H + KV) * D).view({T, H + KV, D});
  const at::Tensor v = qkv_out.narrow(1, (H + KV) * D, KV * D).view({T, KV, D});
  rotary_cpu(qk, cos, sin);
  const at::Tensor q = qk.narrow(1, 0, H);
  const at::Tensor k = qk.narrow(1, H, KV);
  // attend(i, q, k, v): the new K/V into the cache, then attention over it
  if (k_cache.scalar_type() == at::kChar) {
    write_kv_int8_cpu(k, v, k_cache, v_cache, slot_mapping);
  } else {
    write_kv_cpu(k, v, k_cache, v_cache, slot_mapping);
  }
  const at::Tensor attn =
      paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, batch_invariant);
  // ops.add_rms_norm_(x, layer.o(attn), post_norm), then layer.down(ops.silu_mul(layer.gate_up(h)))
  h = add_rms_norm_cpu(x, layer_linear(attn.reshape({T, H * D}), o, hidden, std::nullopt), post_norm, eps);
  return layer_linear(silu_mul_cpu(layer_linear(h, gate_up, 2 * intermediate, std::nullopt)), down, hidden,
                      std::nullopt);
}

// Every layer on one group of rows: x, cos, sin and the step metadata already narrowed to them.
at::Tensor run_layers(at::Tensor& x, const std::vector<std::optional<at::Tensor>>& w, int64_t L, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
                      double scale, bool batch_invariant) {
  std::optional<at::Tensor> mlp_out;  // each layer's, added to x by the next layer's first norm
  for (int64_t i = 0; i < L; ++i) {
    const int64_t b = i * DecoderWeights::kPerLayer;
    at::Tensor layer_cache = kv_cache.select(0, i);
    at::Tensor k_cache = layer_cache.select(0, 0);
    at::Tensor v_cache = layer_cache.select(0, 1);
    mlp_out = decoder_layer_cpu(x, mlp_out, *w[b], *w[b + 1], w[b + 2], *w[b + 3], *w[b + 4], *w[b + 5],
                                *w[b + 6], cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                query_start_loc, num_heads, num_kv_heads, head_dim, intermediate, eps, scale,
                                batch_invariant);
  }
  return *mlp_out;
}

// seq_groups: empty, or the sequences at which the 2nd, 3rd, ... group of rows begins (each
// group whole sequences, in order). Groups run at once, one per intra-op thread, each through
// every layer on its own rows with no join between layers: a decode step of many sequences
// then has one thread's attention (reading the KV cache at the memory's rate) beside the
// other's GEMMs (at the FMA ports' rate), where a team running each op together waits for
// both on both. A row's GEMM outputs are the same bits either way (the panels' per-row sums);
// attention plans each group on one thread (no split keys).
at::Tensor decoder_layers_cpu(
    at::Tensor& x,                                      // [T, hidden], the residual stream, updated in place
    const c10::intrusive_ptr<DecoderWeights>& weights,  // every layer's (DecoderWeights)
    const at::Tensor& cos, const at::Tensor& sin,       // [T, 1, D]; sin signed
    at::Tensor& kv_cache,                               // [layers, 2, ...]: layer i's K is kv_cache[i, 0], V [i, 1]
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate, double eps, double scale, bool batch_invariant, at::IntArrayRef seq_groups) {
  const int64_t L = weights->num_layers();
  TORCH_CHECK_VALUE(kv_cache.dim() >= 3 && kv_cache.size(0) == L && kv_cache.size(1) == 2,
                    "decoder_layers: kv_cache must be [", L, " layers, 2, ...], got ", kv_cache.sizes());
  const auto& w = weights->tensors;
  if (seq_groups.empty()) {
    return run_layers(x, w, L, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, num_heads,
                      num_kv_heads, head_dim, intermediate, eps, scale, batch_invariant);
  }
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK_VALUE(query_start_loc.scalar_type() == at::kLong && query_start_loc.dim() == 1 &&
                        query_start_loc.size(0) == S + 1 && x.dim() == 2 && x.is_contiguous(),
                    "decoder_layers: seq_groups needs int64 query_start_loc [", S + 1, "] and a contiguous x");
  std::vector<int64_t> bounds{0};
  for (int64_t s : seq_groups) {
    TORCH_CHECK_VALUE(bounds.back() < s && s < S, "decoder_layers: seq_groups must rise strictly within (0, ",
                      S, "), got ", seq_groups);
    bounds.push_back(s);
  }
  bounds.push_back(S);
  const at::Tensor starts = query_start_loc.contiguous();
  const int64_t* loc = starts.data_ptr<int64_t>();
  const int64_t G = static_cast<int64_t>(bounds.size()) - 1;
  struct Group {
    at::Tensor x, cos, sin, slots, tables, lens, starts;
    int64_t row0, rows;
  };
  std::vector<Group> groups;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t s0 = bounds[g], s1 = bounds[g + 1], r0 = loc[s0], rows = loc[s1] - loc[s0];
    at::Tensor group_starts = at::empty({s1 - s0 + 1}, starts.options());
    for (int64_t s = s0; s <= s1; ++s) group_starts.data_ptr<int64_t>()[s - s0] = loc[s] - r0;
    groups.push_back(Group{x.narrow(0, r0, rows), cos.narrow(0, r0, rows), sin.narrow(0, r0, rows),
                           slot_mapping.narrow(0, r0, rows), block_tables.narrow(0, s0, s1 - s0),
                           seq_lens.narrow(0, s0, s1 - s0), group_starts, r0, rows});
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  const at::ThreadLocalState caller;  // inference mode and the rest, for the team's other threads
  at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t g = begin; g < end; ++g) {
      Group& grp = groups[g];
      const at::Tensor mlp_out = run_layers(grp.x, w, L, grp.cos, grp.sin, kv_cache, grp.slots, grp.tables, grp.lens,
                                            grp.starts, num_heads, num_kv_heads, head_dim, intermediate, eps, scale,
                                            batch_invariant);
      out.narrow(0, grp.row0, grp.rows).copy_(mlp_out);
    }
  });
  return out;
}

}  // namespace
}  // namespace splitserve

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.class_<splitserve::DecoderWeights>("DecoderWeights")
      .def(torch::init<c10::List<std::optional<at::Tensor>>>())
      .def("num_layers", &splitserve::DecoderWeights::num_layers)
      .def("tensors", [](const c10::intrusive_ptr<splitserve::DecoderWeights>& self) {
        return c10::List<std::optional<at::Tensor>>(self->tensors);
      });
  m.def(
      "decoder_layers(Tensor(a!) x, __torch__.torch.classes.splitserve.DecoderWeights weights, Tensor cos, "
      "Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, int num_heads, int num_kv_heads, int head_dim, int intermediate, float eps, "
      "float scale, bool batch_invariant=False, int[] seq_groups=[]) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) { m.impl("decoder_layers", &splitserve::decoder_layers_cpu); }
