// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file tensor.h
/// \brief Non-owning tensor views that say where their data lives.

#include <array>
#include <cstddef>
#include <cstdint>

namespace kvferry {

/// \brief Element types. KV may be stored as kBF16 or kFP16; activations (q, out) may also be kF32.
enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

/// Bytes per element of \p dtype.
constexpr size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }
/// "f32", "bf16", "f16".
const char* DTypeName(DType dtype);

/// \brief Where a tensor's memory lives. kHost covers pageable and pinned host memory.
enum class MemoryKind : uint8_t { kHost = 0, kDevice = 1 };

/// \brief A non-owning, strided view of up to 4 dimensions. The caller owns the memory and keeps it
/// alive until the call that reads or writes it has completed on its stream. Strides are in
/// elements; the innermost dimension must be contiguous (stride 1).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  MemoryKind where = MemoryKind::kHost;
  int ndim = 0;
  std::array<int64_t, 4> shape{};
  std::array<int64_t, 4> stride{};  ///< in elements

  /// Contiguous row-major view.
  static TensorView Contiguous(void* data, DType dtype, MemoryKind where,
                               std::initializer_list<int64_t> shape);
  [[nodiscard]] int64_t numel() const;
  [[nodiscard]] bool is_contiguous() const;
  /// Pointer to element (i0, i1, i2) of a 3-D view.
  [[nodiscard]] void* at(int64_t i0, int64_t i1 = 0, int64_t i2 = 0) const {
    return static_cast<char*>(data) +
           (i0 * stride[0] + i1 * stride[1] + i2 * stride[2]) * static_cast<int64_t>(DTypeSize(dtype));
  }
};

/// \brief Opaque stream handle. For the CUDA backend it is a cudaStream_t; nullptr means the
/// runtime's own stream. The host backend ignores it (work is complete when the call returns).
using StreamHandle = void*;

}  // namespace kvferry
