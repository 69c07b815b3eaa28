// Native CPU kernels for paged KV (see kernels/csrc/paged_attention.cpp, kernels/csrc/write_kv.cpp,
// kernels/csrc/kv_int8.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace splitserve {

// Causal attention of a ragged batch (decode, prefill, chunked prefill) over paged KV,
// reading K/V in place through the block table. Same contract as
// splitserve_kernels.paged_attention.paged_attention_ref.
at::Tensor paged_attention_cpu(
    const at::Tensor& query,            // [num_tokens, num_heads, head_dim]
    const at::Tensor& k_cache,          // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,          // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& block_tables,     // [num_seqs, max_blocks_per_seq] int32/int64
    const at::Tensor& seq_lens,         // [num_seqs] int32/int64
    const at::Tensor& query_start_loc,  // [num_seqs + 1] int32/int64
    double scale,
    bool batch_invariant = false);      // PlanInputs::one_token_items

// Store each token's K/V rows at its slot (block_id * block_size + offset); a negative slot
// skips the token. Same contract as splitserve_kernels.kv_write.write_kv_ref.
void write_kv_cpu(
    const at::Tensor& key,           // [num_tokens, num_kv_heads, head_dim]
    const at::Tensor& value,         // [num_tokens, num_kv_heads, head_dim]
    at::Tensor& k_cache,             // [num_blocks, block_size, num_kv_heads, head_dim]
    at::Tensor& v_cache,             // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& slot_mapping); // [num_tokens] int32/int64

// The same into an int8 cache (kernels/csrc/kv_int8.cpp): each row quantized, then its
// float32 scale. Same contract as splitserve_kernels.kv_int8.write_kv_int8_ref.
void write_kv_int8_cpu(
    const at::Tensor& key,           // [num_tokens, num_kv_heads, head_dim] float32
    const at::Tensor& value,         // [num_tokens, num_kv_heads, head_dim] float32
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim + 4] int8
    const at::Tensor& v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim + 4] int8
    const at::Tensor& slot_mapping); // [num_tokens] int32/int64

}  // namespace splitserve
