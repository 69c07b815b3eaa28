// The operators this library adds to torch (torch.ops.splitserve.*), CPU implementations.
// kernels/splitserve_kernels/native.py loads the library and registers their fake (meta) implementations, so
// torch.compile can trace through them.
#include <torch/library.h>

#include "elementwise.h"
#include "paged_attention.h"
#include "threads.h"

TORCH_LIBRARY(splitserve, m) {
  m.def(
      "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, bool batch_invariant=False) -> Tensor");
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  // No tensor arguments: one kernel for every dispatch key.
  m.def("bind_threads(int[] cpus) -> int[]", [](c10::IntArrayRef cpus) {
    return splitserve::bind_threads_cpu(std::vector<int64_t>(cpus.begin(), cpus.end()));
  });
  m.def("thread_cpus() -> int[]", &splitserve::thread_cpus_cpu);
  m.def("single_intra_op_thread() -> ()", &splitserve::single_intra_op_thread_cpu);
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("paged_attention", &splitserve::paged_attention_cpu);
  m.impl("write_kv", &splitserve::write_kv_cpu);
  m.impl("rms_norm", &splitserve::rms_norm_cpu);
  m.impl("add_rms_norm_", &splitserve::add_rms_norm_cpu);
  m.impl("rotary_", &splitserve::rotary_cpu);
  m.impl("silu_mul", &splitserve::silu_mul_cpu);
}
