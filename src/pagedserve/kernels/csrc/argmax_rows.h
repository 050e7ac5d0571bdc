// Per-row argmax results merged from column chunks (argmax.cpp, qlinear.cpp): include after
// argmax_best.h and the scans of argmax_impl.h (vec16_build.h), inside an anonymous namespace.

#pragma once

#include <mutex>
#include <vector>

using ScanFn = ArgBest (*)(const bf16_t*, int64_t, int64_t);

// Per-row results merged from chunks that finish on different threads.
class RowArgmax {
 public:
  RowArgmax(int64_t rows, ScanFn scan) : best_(size_t(rows)), scan_(scan) {}

  // Scans rows [first, end_row) of y (row stride ld) over columns [begin, end) and merges the
  // results into those rows', as columns begin + shift .. end + shift of the rows (shift: where
  // a buffer holding a chunk of the rows' columns starts).
  void scan(const bf16_t* y, int64_t first, int64_t end_row, int64_t ld, int64_t begin,
            int64_t end, int64_t shift = 0) {
    ArgBest local[32];
    for (int64_t r0 = first; r0 < end_row; r0 += 32) {
      const int64_t n = std::min<int64_t>(32, end_row - r0);
      for (int64_t r = 0; r < n; ++r) {
        local[r] = scan_(y + (r0 + r) * ld, begin, end);
        if (local[r].idx >= 0) local[r].idx += shift;
      }
      std::lock_guard<std::mutex> guard(mu_);
      for (int64_t r = 0; r < n; ++r)
        if (arg_better(local[r], best_[r0 + r])) best_[r0 + r] = local[r];
    }
  }

  at::Tensor result(const at::TensorOptions& opts) const {
    at::Tensor out = at::empty({int64_t(best_.size())}, opts.dtype(at::kLong));
    int64_t* p = out.data_ptr<int64_t>();
    for (size_t r = 0; r < best_.size(); ++r) p[r] = std::max<int64_t>(best_[r].idx, 0);
    return out;
  }

 private:
  std::vector<ArgBest> best_;
  ScanFn scan_;
  std::mutex mu_;
};

