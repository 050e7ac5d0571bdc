// What a compiled op's own OpenMP region needs around torch (csrc/moe.cpp, csrc/linear_heads.cpp):
// the first exception of any thread kept and rethrown after the region (an exception must not
// leave a parallel region), the caller's thread-local state (grad / inference mode) in every
// thread, and torch's thread count.
//
//   ps_omp::Region region;
//   #pragma omp parallel num_threads(region.threads)
//   {
//     at::ThreadLocalStateGuard guard(region.tls);
//     #pragma omp for ...
//     for (...) { if (region.failed) continue; try { ... } catch (...) { region.capture(); } }
//   }
//   region.rethrow();

#pragma once

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>

namespace ps_omp {

struct Region {
  std::atomic<bool> failed{false};  // set by capture(): later work items skip themselves
  const at::ThreadLocalState tls;   // the caller's, for at::ThreadLocalStateGuard in each thread
  const int threads = int(std::max<int64_t>(1, at::get_num_threads()));

  // Inside a catch block: keep the first exception, stop the others' work.
  void capture() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = std::current_exception();
    failed = true;
  }
  // After the region: the kept exception, if any.
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::exception_ptr error_;
  std::mutex mu_;
};

}  // namespace ps_omp
