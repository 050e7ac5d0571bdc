// Compute-thread binding (vLLM's VLLM_CPU_OMP_THREADS_BIND in spirit): the calling thread's OpenMP
// team of cpus.size() threads, thread t pinned to cpus[t] (the caller is thread 0). GNU OpenMP
// keeps one pool of worker threads per thread that starts parallel regions and reuses it for
// every later region of the same size, so the pins hold for the steps that thread runs
// (torch's at::parallel_for and our kernels). Registered as torch.ops.pagedserve_cpu.bind_threads;
// the Python side is kernels/openmp.py (`bind_compute_threads`).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace {

// Pins the caller's OpenMP team, thread t to cpus[t]; returns how many threads were pinned.
int64_t bind_threads(const std::vector<int64_t>& cpus) {
  const int n = static_cast<int>(cpus.size());
  TORCH_CHECK(n >= 1, "bind_threads: at least one CPU");
  for (int64_t c : cpus) TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "bind_threads: CPU ", c, " out of range");
  at::set_num_threads(n);
  std::atomic<int> pinned{0};
#pragma omp parallel num_threads(n)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[omp_get_thread_num()]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) pinned.fetch_add(1);
  }
  return pinned.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("bind_threads(int[] cpus) -> int", &bind_threads); }
