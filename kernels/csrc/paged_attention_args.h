// Argument checks and geometry (sizes, element strides) of a paged-attention call.
#pragma once

#include <ATen/core/Tensor.h>

#include "attention_plan.h"

namespace splitserve {

struct PagedGeometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t max_rows;                   // query rows of the largest tile
  int64_t q_token, q_head;            // query strides
  int64_t k_block, k_slot, k_head;    // k_cache strides (head_dim stride is 1)
  int64_t v_block, v_slot, v_head;    // v_cache strides
  int64_t bt_seq;                     // block_tables row stride
  double scale;
};

struct PagedArgs {
  at::Tensor query;  // unit stride along head_dim
  at::Tensor block_tables, seq_lens, query_start_loc;  // int64, contiguous
  PagedGeometry geometry;
  int64_t num_blocks;

  PlanInputs plan_inputs(int64_t num_threads) const;
};

// Raises ValueError (TORCH_CHECK_VALUE) for anything the torch reference refuses.
PagedArgs check_paged_attention_args(const at::Tensor& query, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens,
                                     const at::Tensor& query_start_loc, double scale);

}  // namespace splitserve
