// Copyright kvferry authors. Apache-2.0.
#include "offload/host_gather.h"

#include <algorithm>
#include <cstring>

#include "cpu/pool.h"

namespace kvferry {
namespace {

// Prefetch distance in rows: enough independent misses in flight per thread to hide a DRAM (and
// page-walk) latency behind the copies of the rows before it.
constexpr int64_t kAhead = 8;

void Prefetch(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 0);
}

void GatherRange(const RowCopy* rows, int64_t begin, int64_t end, size_t bytes) {
  for (int64_t i = begin; i < std::min(begin + kAhead, end); ++i) Prefetch(rows[i].src, bytes);
  for (int64_t i = begin; i < end; ++i) {
    if (i + kAhead < end) Prefetch(rows[i + kAhead].src, bytes);
    std::memcpy(rows[i].dst, rows[i].src, bytes);
  }
}

}  // namespace

void GatherRowsHost(cpu::CpuPool* pool, const RowCopy* rows, int64_t num_rows, size_t bytes) {
  if (num_rows <= 0 || bytes == 0) return;
  // Below ~64 KB the pool's dispatch costs more than the copies.
  if (pool == nullptr || num_rows * static_cast<int64_t>(bytes) < (int64_t{64} << 10)) {
    GatherRange(rows, 0, num_rows, bytes);
    return;
  }
  const int64_t chunks = std::min<int64_t>(num_rows, int64_t{4} * pool->num_threads());
  pool->ParallelFor(chunks, [&](int64_t c) {
    GatherRange(rows, num_rows * c / chunks, num_rows * (c + 1) / chunks, bytes);
  });
}

}  // namespace kvferry
