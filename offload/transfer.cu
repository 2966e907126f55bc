// Copyright kvferry authors. Apache-2.0.
// CUDA transfer engine: streams, zero-copy and batched gathers, write-through, bandwidth probe.

#include <cub/device/device_memcpy.cuh>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu/cuda_check.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_kernels.h"
#include "offload/transfer.h"
#include "base/check.h"

namespace kvferry {
namespace {

class CudaTransferEngine final : public TransferEngine {
 public:
  CudaTransferEngine(cuda::CudaDevice* dev, int64_t max_rows) : dev_(dev), max_rows_(max_rows) {}
  ~CudaTransferEngine() override {
    KVF_CUDA_WARN(cudaSetDevice(dev_->device_id()));
    if (h2d_ != nullptr) KVF_CUDA_WARN(cudaStreamSynchronize(h2d_));
    if (d2h_ != nullptr) KVF_CUDA_WARN(cudaStreamSynchronize(d2h_));
    if (temp_ != nullptr) KVF_CUDA_WARN(cudaFree(temp_));
    if (after_ != nullptr) KVF_CUDA_WARN(cudaEventDestroy(after_));
    if (h2d_ != nullptr) KVF_CUDA_WARN(cudaStreamDestroy(h2d_));
    if (d2h_ != nullptr) KVF_CUDA_WARN(cudaStreamDestroy(d2h_));
  }

  Status Init() {
    KVF_CUDA_CHECK(cudaSetDevice(dev_->device_id()));
    KVF_CUDA_CHECK(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
    KVF_CUDA_CHECK(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
    KVF_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
    // Size CUB's scratch once for the largest batch, so gathers never allocate.
    KVF_CUDA_CHECK(cub::DeviceMemcpy::Batched(nullptr, temp_bytes_,
                                              static_cast<const void* const*>(nullptr),
                                              static_cast<void* const*>(nullptr),
                                              static_cast<const size_t*>(nullptr),
                                              std::max<int64_t>(max_rows_, 1), h2d_));
    KVF_CUDA_CHECK(cudaMalloc(&temp_, std::max<size_t>(temp_bytes_, 16)));
    return Status::Ok();
  }

  StreamHandle h2d_stream() const override { return h2d_; }
  StreamHandle d2h_stream() const override { return d2h_; }

  Status GatherZeroCopy(const RowCopy* rows, int64_t num_rows, int row_bytes,
                        StreamHandle stream) override {
    KVF_CHECK_ARG(row_bytes % 2 == 0, "GatherZeroCopy: row_bytes ", row_bytes, " is odd");
    // A bf16 "conversion" to bf16 is a plain copy; the kernel uses 16-byte accesses when aligned.
    return cuda::LaunchCopyRows(rows, num_rows, row_bytes / 2, DType::kBF16, DType::kBF16,
                                Resolve(stream));
  }

  Status GatherBatched(const void* const* srcs, void* const* dsts, const size_t* sizes,
                       int64_t num_rows, StreamHandle stream) override {
    KVF_CHECK_ARG(num_rows >= 0 && num_rows <= max_rows_, "GatherBatched: ", num_rows,
                  " rows, engine sized for ", max_rows_);
    if (num_rows == 0) return Status::Ok();
    size_t temp_bytes = temp_bytes_;
    KVF_CUDA_CHECK(cub::DeviceMemcpy::Batched(temp_, temp_bytes, srcs, dsts, sizes, num_rows,
                                              Resolve(stream)));
    return Status::Ok();
  }

  Status WriteThrough(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                      DType dst_dtype, StreamHandle after) override {
    KVF_CUDA_CHECK(cudaEventRecord(after_, after == nullptr
                                               ? static_cast<cudaStream_t>(dev_->default_stream())
                                               : static_cast<cudaStream_t>(after)));
    KVF_CUDA_CHECK(cudaStreamWaitEvent(d2h_, after_, 0));
    return cuda::LaunchCopyRows(rows, num_rows, elems, src_dtype, dst_dtype, d2h_);
  }

  Result<TransferProbe> Probe(size_t bytes, int row_bytes) override;

 private:
  cudaStream_t Resolve(StreamHandle s) const {
    return s == nullptr ? h2d_ : static_cast<cudaStream_t>(s);
  }

  cuda::CudaDevice* dev_;
  int64_t max_rows_;
  cudaStream_t h2d_ = nullptr;
  cudaStream_t d2h_ = nullptr;
  cudaEvent_t after_ = nullptr;
  void* temp_ = nullptr;
  size_t temp_bytes_ = 0;
};

// Median milliseconds of \p reps runs of \p fn on \p stream, after one warm-up.
template <typename Fn>
Result<float> TimeMedian(cudaStream_t stream, int reps, Fn&& fn) {
  cudaEvent_t a, b;
  KVF_CUDA_CHECK(cudaEventCreate(&a));
  KVF_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r <= reps; ++r) {
    KVF_CUDA_CHECK(cudaEventRecord(a, stream));
    const Status st = fn();
    KVF_CUDA_CHECK(cudaEventRecord(b, stream));
    KVF_CUDA_CHECK(cudaEventSynchronize(b));
    if (!st.ok()) {
      KVF_CUDA_WARN(cudaEventDestroy(a));
      KVF_CUDA_WARN(cudaEventDestroy(b));
      return st;
    }
    float t = 0;
    KVF_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    if (r > 0) ms.push_back(t);
  }
  KVF_CUDA_WARN(cudaEventDestroy(a));
  KVF_CUDA_WARN(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

Result<TransferProbe> CudaTransferEngine::Probe(size_t bytes, int row_bytes) {
  KVF_CHECK_ARG(row_bytes >= 16 && row_bytes % 16 == 0, "Probe: row_bytes ", row_bytes,
                " must be a multiple of 16");
  KVF_CUDA_CHECK(cudaSetDevice(dev_->device_id()));
  TransferProbe out;
  out.probe_bytes = static_cast<int64_t>(bytes);
  out.gather_row_bytes = row_bytes;
  KVF_ASSIGN_OR_RETURN(void* host, dev_->AllocHost(bytes));
  void* d0 = nullptr;
  void* d1 = nullptr;
  Status st = [&]() -> Status {
    KVF_CUDA_CHECK(cudaMalloc(&d0, bytes));
    KVF_CUDA_CHECK(cudaMalloc(&d1, bytes));
    std::memset(host, 0x3c, bytes);  // touch: the pages are real, not zero-fill on demand
    KVF_CUDA_CHECK(cudaMemsetAsync(d0, 0x11, bytes, h2d_));
    const double gb = static_cast<double>(bytes) / 1e9;
    KVF_ASSIGN_OR_RETURN(float h2d_ms, TimeMedian(h2d_, 5, [&]() -> Status {
      KVF_CUDA_CHECK(cudaMemcpyAsync(d0, host, bytes, cudaMemcpyHostToDevice, h2d_));
      return Status::Ok();
    }));
    KVF_ASSIGN_OR_RETURN(float d2h_ms, TimeMedian(d2h_, 5, [&]() -> Status {
      KVF_CUDA_CHECK(cudaMemcpyAsync(host, d0, bytes, cudaMemcpyDeviceToHost, d2h_));
      return Status::Ok();
    }));
    KVF_ASSIGN_OR_RETURN(float d2d_ms, TimeMedian(h2d_, 5, [&]() -> Status {
      KVF_CUDA_CHECK(cudaMemcpyAsync(d1, d0, bytes, cudaMemcpyDeviceToDevice, h2d_));
      return Status::Ok();
    }));
    out.h2d_gbps = gb / (h2d_ms * 1e-3);
    out.d2h_gbps = gb / (d2h_ms * 1e-3);
    out.d2d_gbps = 2 * gb / (d2d_ms * 1e-3);

    // Gathers: rows of the host buffer in random order into consecutive device rows.
    const int64_t rows = std::min<int64_t>(static_cast<int64_t>(bytes / row_bytes), max_rows_);
    out.gather_rows = rows;
    std::vector<int64_t> perm(static_cast<size_t>(bytes / row_bytes));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(42));
    std::vector<RowCopy> rc(rows);
    std::vector<const void*> srcs(rows);
    std::vector<void*> dsts(rows);
    std::vector<size_t> sizes(rows, static_cast<size_t>(row_bytes));
    for (int64_t i = 0; i < rows; ++i) {
      srcs[i] = static_cast<const char*>(host) + perm[i] * row_bytes;
      dsts[i] = static_cast<char*>(d0) + i * row_bytes;
      rc[i] = RowCopy{dsts[i], srcs[i]};
    }
    // Descriptors in device memory (d1 is free scratch now).
    const size_t need = rows * (sizeof(RowCopy) + 2 * sizeof(void*) + sizeof(size_t));
    KVF_CHECK_ARG(need <= bytes, "Probe: buffer too small for the gather descriptors");
    char* p = static_cast<char*>(d1);
    auto* rc_d = reinterpret_cast<RowCopy*>(p);
    auto* src_d = reinterpret_cast<const void**>(p + rows * sizeof(RowCopy));
    auto* dst_d = reinterpret_cast<void**>(p + rows * (sizeof(RowCopy) + sizeof(void*)));
    auto* size_d = reinterpret_cast<size_t*>(p + rows * (sizeof(RowCopy) + 2 * sizeof(void*)));
    KVF_CUDA_CHECK(cudaMemcpyAsync(rc_d, rc.data(), rows * sizeof(RowCopy), cudaMemcpyDefault, h2d_));
    KVF_CUDA_CHECK(cudaMemcpyAsync(src_d, srcs.data(), rows * sizeof(void*), cudaMemcpyDefault, h2d_));
    KVF_CUDA_CHECK(cudaMemcpyAsync(dst_d, dsts.data(), rows * sizeof(void*), cudaMemcpyDefault, h2d_));
    KVF_CUDA_CHECK(cudaMemcpyAsync(size_d, sizes.data(), rows * sizeof(size_t), cudaMemcpyDefault, h2d_));
    const double gather_gb = static_cast<double>(rows) * row_bytes / 1e9;
    KVF_ASSIGN_OR_RETURN(float zc_ms, TimeMedian(h2d_, 5, [&] {
      return GatherZeroCopy(rc_d, rows, row_bytes, h2d_);
    }));
    KVF_ASSIGN_OR_RETURN(float batched_ms, TimeMedian(h2d_, 5, [&] {
      return GatherBatched(src_d, dst_d, size_d, rows, h2d_);
    }));
    out.zero_copy_gather_gbps = gather_gb / (zc_ms * 1e-3);
    out.batched_copy_gbps = gather_gb / (batched_ms * 1e-3);
    KVF_CUDA_CHECK(cudaStreamSynchronize(h2d_));
    return Status::Ok();
  }();
  if (d0 != nullptr) KVF_CUDA_WARN(cudaFree(d0));
  if (d1 != nullptr) KVF_CUDA_WARN(cudaFree(d1));
  dev_->FreeHost(host);
  KVF_RETURN_IF_ERROR(st);
  return out;
}

}  // namespace

Result<std::unique_ptr<TransferEngine>> TransferEngine::Create(Device* device, int64_t max_rows) {
  auto* cuda_dev = dynamic_cast<cuda::CudaDevice*>(device);
  KVF_CHECK_ARG(cuda_dev != nullptr, "TransferEngine needs the CUDA device, got ",
                device == nullptr ? "null" : device->name());
  KVF_CHECK_ARG(max_rows >= 1, "TransferEngine: max_rows ", max_rows);
  auto engine = std::make_unique<CudaTransferEngine>(cuda_dev, max_rows);
  KVF_RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<TransferEngine>(std::move(engine));
}

}  // namespace kvferry
