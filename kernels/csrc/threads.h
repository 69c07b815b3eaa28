// Pinning the intra-op threads (kernels/csrc/threads.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace splitserve {

// Sets torch's intra-op threads to cpus.size() and pins thread i to cpus[i]. Returns, per
// thread, the CPU it was pinned to (-1 where the kernel refused).
std::vector<int64_t> bind_threads_cpu(const std::vector<int64_t>& cpus);

// The calling thread runs torch's parallel ops on itself alone: it never starts an OpenMP
// team. Only this thread's count changes (torch.set_num_threads would change every thread's).
void single_intra_op_thread_cpu();

// Per intra-op thread: the one CPU it is pinned to, or -2 where it may run on several.
std::vector<int64_t> thread_cpus_cpu();

}  // namespace splitserve
