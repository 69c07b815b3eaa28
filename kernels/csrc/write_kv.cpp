// KV slot write on CPU: each token's [num_kv_heads, head_dim] rows of K and V are copied
// into their slot of a paged cache of any strides (unit stride along head_dim).
#include <cstring>

#include <ATen/Parallel.h>
#include <ATen/ops/contiguous.h>
#include <ATen/ops/to.h>
#include <c10/util/Exception.h>

#include "paged_attention.h"

namespace splitserve {
namespace {

void check_write_kv_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes(),
                    "key and value must both be [num_tokens, num_kv_heads, head_dim], got ",
                    key.sizes(), " and ", value.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                    "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                    "head_dim], got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK_VALUE(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
                    "key [.., num_kv_heads, head_dim] = ", key.sizes().slice(1),
                    " does not match the cache's ", k_cache.sizes().slice(2));
  const auto dtype = key.scalar_type();
  TORCH_CHECK_VALUE(value.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
                        v_cache.scalar_type() == dtype,
                    "key, value, k_cache, v_cache must share a dtype, got ", dtype, ", ",
                    value.scalar_type(), ", ", k_cache.scalar_type(), ", ", v_cache.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                        (slot_mapping.scalar_type() == at::kInt ||
                         slot_mapping.scalar_type() == at::kLong),
                    "slot_mapping must be [num_tokens=", key.size(0), "] int32/int64, got ",
                    slot_mapping.sizes(), " ", slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                    "k_cache and v_cache must have a unit stride along head_dim");
  TORCH_CHECK_VALUE(key.device().is_cpu() && value.device().is_cpu() &&
                        k_cache.device().is_cpu() && v_cache.device().is_cpu(),
                    "write_kv's tensors must be on the CPU");
}

void copy_rows(const at::Tensor& src, const at::Tensor& cache, int64_t token, int64_t slot) {
  const int64_t block_size = cache.size(1);
  const int64_t num_heads = cache.size(2);
  const int64_t row_bytes = cache.size(3) * cache.element_size();
  const char* from = static_cast<const char*>(src.data_ptr()) + token * src.stride(0) * src.element_size();
  char* to = static_cast<char*>(cache.data_ptr()) +
             ((slot / block_size) * cache.stride(0) + (slot % block_size) * cache.stride(1)) *
                 cache.element_size();
  for (int64_t h = 0; h < num_heads; ++h) {
    std::memcpy(to + h * cache.stride(2) * cache.element_size(),
                from + h * src.stride(1) * src.element_size(), row_bytes);
  }
}

}  // namespace

void write_kv_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                  at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_write_kv_args(key, value, k_cache, v_cache, slot_mapping);
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK_VALUE(slot[t] < num_slots, "slot_mapping[", t, "] = ", slot[t],
                      " is past the cache's ", num_slots, " slots");
  }
  at::parallel_for(0, key.size(0), 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;  // padding: not stored
      copy_rows(k, k_cache, t, slot[t]);
      copy_rows(v, v_cache, t, slot[t]);
    }
  });
}

}  // namespace splitserve
