// Pinning the intra-op threads (kernels/csrc/threads.cpp), and handing work to them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>

namespace splitserve {

// Sets torch's intra-op threads to cpus.size() and pins thread i to cpus[i]. Returns, per
// thread, the CPU it was pinned to (-1 where the kernel refused).
std::vector<int64_t> bind_threads_cpu(const std::vector<int64_t>& cpus);

// The calling thread runs torch's parallel ops on itself alone: it never starts an OpenMP
// team. Only this thread's count changes (torch.set_num_threads would change every thread's).
void single_intra_op_thread_cpu();

// Per intra-op thread: the one CPU it is pinned to, or -2 where it may run on several.
std::vector<int64_t> thread_cpus_cpu();

// Runs fn(i) for i in [0, n) on up to max_threads intra-op threads, each taking the next
// index when it is done with its last. A thread the OS takes off its core (another process's
// turn, or the host's) holds up only the item it is on: the others take the rest, where a
// fixed split would leave its whole share waiting at the region's end.
template <typename F>
void parallel_dynamic(int64_t n, int64_t max_threads, const F& fn) {
  const int64_t num_threads = std::min<int64_t>(max_threads, n);
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  if (num_threads <= 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, num_threads, 1, worker);
  }
}

}  // namespace splitserve
