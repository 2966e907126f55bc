// Copyright kvferry authors. Apache-2.0.
#pragma once
// The transfer engine (CUDA backend): separate H2D and D2H streams, token-granular gathers from the
// pinned host store (a zero-copy kernel that reads host rows over PCIe, or CUB's batched memcpy),
// the asynchronous write-through of appended K/V to the host store, and a bandwidth probe run at
// start whose figures the scheduler's cost model and the stats use.
// Without CUDA, Create returns kUnimplemented (the host backend needs no transfers).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry {

/// Measured link figures (GB/s = 1e9 bytes/s), medians over repeats.
struct TransferProbe {
  double h2d_gbps = 0;               ///< pinned host -> device cudaMemcpyAsync, contiguous
  double d2h_gbps = 0;               ///< device -> pinned host, contiguous
  double d2d_gbps = 0;               ///< device -> device copy, read + write bytes (HBM)
  double zero_copy_gather_gbps = 0;  ///< kernel reading random rows of pinned host memory
  double batched_copy_gbps = 0;      ///< cub::DeviceMemcpy::Batched of the same rows
  int64_t probe_bytes = 0;           ///< bytes per contiguous copy
  int gather_row_bytes = 0;          ///< row size of the gathers
  int64_t gather_rows = 0;
  /// One JSON object with every field.
  [[nodiscard]] std::string ToJson() const;
};

class TransferEngine {
 public:
  /// \p device must be the CUDA device (MakeCudaDevice); \p max_rows bounds one batched copy.
  static Result<std::unique_ptr<TransferEngine>> Create(Device* device, int64_t max_rows);
  virtual ~TransferEngine() = default;

  [[nodiscard]] virtual StreamHandle h2d_stream() const = 0;
  [[nodiscard]] virtual StreamHandle d2h_stream() const = 0;

  /// Zero-copy gather: rows[i].dst <- rows[i].src (row_bytes each) by a kernel on \p stream that
  /// reads host rows directly over PCIe (null stream = h2d_stream). rows[] device-readable.
  virtual Status GatherZeroCopy(const RowCopy* rows, int64_t num_rows, int row_bytes,
                                StreamHandle stream) = 0;
  /// The same with cub::DeviceMemcpy::Batched (srcs/dsts/sizes device-readable arrays).
  virtual Status GatherBatched(const void* const* srcs, void* const* dsts, const size_t* sizes,
                               int64_t num_rows, StreamHandle stream) = 0;
  /// Write-through of appended rows (device -> pinned host store, converting dtype) on the D2H
  /// stream, ordered after the work issued so far on \p after (the stream that produced k/v). The
  /// caller orders later readers of those host rows after d2h_stream() with an event.
  virtual Status WriteThrough(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                              DType dst_dtype, StreamHandle after) = 0;

  /// Measures the link with \p bytes per contiguous copy and random \p row_bytes-row gathers.
  virtual Result<TransferProbe> Probe(size_t bytes = size_t{256} << 20, int row_bytes = 256) = 0;
};

}  // namespace kvferry
