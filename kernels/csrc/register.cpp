// The operators this library adds to torch (torch.ops.splitserve.*), CPU implementations.
// kernels/native.py loads the library and registers their fake (meta) implementations, so
// torch.compile can trace through them.
#include <torch/library.h>

#include "paged_attention.h"

TORCH_LIBRARY(splitserve, m) {
  m.def(
      "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("paged_attention", &splitserve::paged_attention_cpu);
  m.impl("write_kv", &splitserve::write_kv_cpu);
}
