// Copyright kvferry authors. Apache-2.0.
#pragma once
// Row gathers on the CPU: random rows of the pinned host store copied into a compact staging
// block (pinned too), which one DMA copy then carries to the GPU. Why: on the GPU test machine a
// kernel reading random rows straight from pinned memory (zero-copy) runs at ~51 GB/s only while
// the rows lie within ~256 MB; over a 4 GiB store it drops to ~11 GB/s and over 16 GiB to ~8-10
// GB/s (translation of host pages; docs/cuda.md, bench/results/transfer_span_h100.json). The CPU
// gathers the same rows faster and the copy engine carries a compact block at ~50 GB/s beside
// the compute, so the GPU's SMs read only device memory.

#include <cstddef>
#include <cstdint>

#include "gpu/device.h"  // RowCopy

namespace kvferry {
namespace cpu {
class CpuPool;
}

/// rows[i].dst <- rows[i].src, \p bytes each, on the pool's threads (on the calling thread when
/// \p pool is null), with the sources prefetched a few rows ahead. Returns when every row is
/// copied. Rows must not overlap.
void GatherRowsHost(cpu::CpuPool* pool, const RowCopy* rows, int64_t num_rows, size_t bytes);

}  // namespace kvferry
