#include "paged_attention_args.h"

#include <string>

#include <algorithm>

#include <ATen/ops/contiguous.h>
#include <ATen/ops/to.h>
#include <c10/util/Exception.h>

namespace splitserve {
namespace {

at::Tensor as_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
                    " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU");
  return t.to(at::kLong).contiguous();
}

void check_shapes(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const at::Tensor& query_start_loc) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [num_tokens, num_heads, head_dim], got ",
                    query.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                    "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                    "head_dim], got ", k_cache.sizes(), " and ", v_cache.sizes());
  // An int8 cache (kernels/splitserve_kernels/kv_int8.py): rows of head_dim int8 values and a float32 scale.
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const int64_t row = int8 ? query.size(2) + 4 : query.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == row, "query head_dim ", query.size(2),
                    (int8 ? " needs int8 cache rows of head_dim + 4 = " : " != cache head_dim "), row,
                    (int8 ? ", got " : ""), (int8 ? std::to_string(k_cache.size(3)) : ""));
  TORCH_CHECK_VALUE(!int8 || (query.scalar_type() == at::kFloat && query.size(2) % 4 == 0),
                    "an int8 KV cache needs float32 queries and head_dim a multiple of 4");
  TORCH_CHECK_VALUE(k_cache.size(2) > 0 && query.size(1) % k_cache.size(2) == 0, "num_heads ",
                    query.size(1), " is not a multiple of num_kv_heads ", k_cache.size(2));
  TORCH_CHECK_VALUE((int8 || query.scalar_type() == k_cache.scalar_type()) &&
                        k_cache.scalar_type() == v_cache.scalar_type(),
                    "query/k_cache/v_cache dtypes differ: ", query.scalar_type(), ", ",
                    k_cache.scalar_type(), ", ", v_cache.scalar_type());
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && query_start_loc.dim() == 1 &&
                        query_start_loc.size(0) == num_seqs + 1,
                    "seq_lens must be [num_seqs] and query_start_loc [num_seqs + 1], got ",
                    seq_lens.sizes(), " and ", query_start_loc.sizes());
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
                    "block_tables must be [num_seqs=", num_seqs, ", max_blocks], got ",
                    block_tables.sizes());
  TORCH_CHECK_VALUE(query.device().is_cpu() && k_cache.device().is_cpu() &&
                        v_cache.device().is_cpu(),
                    "query, k_cache and v_cache must be on the CPU");
  TORCH_CHECK_VALUE(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                    "k_cache and v_cache must have a unit stride along head_dim");
}

}  // namespace

PlanInputs PagedArgs::plan_inputs(int64_t num_threads) const {
  return PlanInputs{seq_lens.data_ptr<int64_t>(), query_start_loc.data_ptr<int64_t>(),
                    block_tables.data_ptr<int64_t>(), seq_lens.size(0), query.size(0),
                    block_tables.size(1), geometry.block_size, num_blocks,
                    geometry.num_kv_heads, geometry.group, std::max<int64_t>(num_threads, 1)};
}

PagedArgs check_paged_attention_args(const at::Tensor& query, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens,
                                     const at::Tensor& query_start_loc, double scale) {
  check_shapes(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc);
  PagedArgs a;
  a.query = query.stride(2) == 1 ? query : query.contiguous();
  a.block_tables = as_index(block_tables, "block_tables");
  a.seq_lens = as_index(seq_lens, "seq_lens");
  a.query_start_loc = as_index(query_start_loc, "query_start_loc");
  a.num_blocks = k_cache.size(0);
  PagedGeometry& g = a.geometry;
  g.num_heads = query.size(1);
  g.num_kv_heads = k_cache.size(2);
  g.group = g.num_heads / g.num_kv_heads;
  g.head_dim = query.size(2);
  g.block_size = k_cache.size(1);
  g.q_token = a.query.stride(0);
  g.q_head = a.query.stride(1);
  g.k_block = k_cache.stride(0);
  g.k_slot = k_cache.stride(1);
  g.k_head = k_cache.stride(2);
  g.v_block = v_cache.stride(0);
  g.v_slot = v_cache.stride(1);
  g.v_head = v_cache.stride(2);
  g.bt_seq = a.block_tables.stride(0);
  g.scale = scale;
  // A tile holds max(1, kMaxRows / group) tokens, so at most this many rows; a decode item
  // over every KV head (attention_plan.h) holds num_heads.
  g.max_rows = std::max(std::max<int64_t>(1, kMaxRows / g.group) * g.group, g.num_heads);
  return a;
}

}  // namespace splitserve
