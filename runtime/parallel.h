// Copyright kvferry authors. Apache-2.0.
#pragma once
// The one place the runtime touches TBB directly: a parallel loop over independent items.
#include <cstdint>
#include <functional>

namespace kvferry {
/// Runs fn(i) for i in [0, n), possibly concurrently; returns when all are done.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);
}  // namespace kvferry
