// Copyright kvferry authors. Apache-2.0.
#include "runtime/parallel.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace kvferry {
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t i = r.begin(); i != r.end(); ++i) fn(i);
  });
}
}  // namespace kvferry
