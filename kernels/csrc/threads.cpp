// Pinning torch's intra-op (OpenMP) threads, one per CPU, as vLLM's CPU worker does.
//
// Unpinned, the scheduler may leave two threads of one team on one core while another
// process holds the other core; every parallel region then waits at its barrier for a
// thread that cannot run, and a 2-thread engine on shared cores ran several times slower
// than a 1-thread one. Pinned, each thread keeps a fair share of its own core.
#include <omp.h>
#include <sched.h>

#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "threads.h"

namespace splitserve {

std::vector<int64_t> bind_threads_cpu(const std::vector<int64_t>& cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK_VALUE(n >= 1, "bind_threads: need at least one CPU");
  for (int64_t cpu : cpus) {
    TORCH_CHECK_VALUE(0 <= cpu && cpu < CPU_SETSIZE, "bind_threads: bad CPU id ", cpu);
  }
  at::set_num_threads(static_cast<int>(n));
  std::vector<int64_t> bound(n, -1);
  // One index per thread of the team: thread i runs index i and pins itself to cpus[i].
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) bound[i] = cpus[i];
    }
  });
  return bound;
}

void single_intra_op_thread_cpu() {
  // torch sets each thread's OpenMP count to its process-wide count on the thread's first
  // parallel op (or first get_num_threads); do that first, so it does not undo ours.
  at::get_num_threads();
  omp_set_num_threads(1);
}

std::vector<int64_t> thread_cpus_cpu() {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> cpus(n, -2);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      if (sched_getaffinity(0, sizeof(set), &set) != 0) continue;
      cpus[i] = CPU_COUNT(&set) == 1 ? -1 : -2;  // -2: not pinned
      for (int c = 0; c < CPU_SETSIZE && CPU_COUNT(&set) == 1; ++c) {
        if (CPU_ISSET(c, &set)) cpus[i] = c;
      }
    }
  });
  return cpus;
}

}  // namespace splitserve
