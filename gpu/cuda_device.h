// Copyright kvferry authors. Apache-2.0.
#pragma once
// The CUDA implementation of Device (CUDA builds only; include from .cu or CUDA-aware code).
//
// Memory: device memory from cudaMalloc; host memory pinned and mapped (usable by kernels through
// the same pointer) and, when hwloc finds the GPU's NUMA node on a multi-node machine, bound to
// that node before it is registered. Streams: the default stream is a non-blocking stream the
// device creates (never the legacy null stream); a null StreamHandle means it. Every stream the
// attention kernels run on has its own split-KV workspace, allocated when the stream is created
// (or on first use for streams the caller made), so per-step calls never allocate.
// Thread-safety: calls on different streams may come from different threads.

#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "gpu/cuda_kernels.h"
#include "gpu/device.h"
#include "gpu/device_blocks.h"

namespace kvferry::cuda {

class CudaDevice final : public Device {
 public:
  static Result<std::unique_ptr<CudaDevice>> Create(int device_id);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  [[nodiscard]] Backend backend() const override { return Backend::kCuda; }
  [[nodiscard]] std::string name() const override { return name_; }

  Result<void*> AllocDevice(size_t bytes) override;
  void FreeDevice(void* ptr) override;
  Result<void*> AllocHost(size_t bytes) override;
  void FreeHost(void* ptr) override;
  [[nodiscard]] int64_t device_bytes_held() const override;
  [[nodiscard]] size_t stream_scratch_bytes() const override { return kWorkspaceBytes; }

  [[nodiscard]] StreamHandle default_stream() const override { return default_stream_; }
  Result<StreamHandle> CreateStream() override;
  void DestroyStream(StreamHandle stream) override;
  Result<EventHandle> CreateEvent() override;
  Result<EventHandle> CreateTimingEvent() override;
  Result<double> ElapsedMs(EventHandle start, EventHandle end) override;
  void DestroyEvent(EventHandle event) override;
  Status RecordEvent(EventHandle event, StreamHandle stream) override;
  Status WaitEvent(StreamHandle stream, EventHandle event) override;
  Status SynchronizeEvent(EventHandle event) override;
  Status SynchronizeStream(StreamHandle stream) override;

  Status CopyAsync(void* dst, const void* src, size_t bytes, StreamHandle stream) override;
  Status CopyBatchAsync(void** dst, const void** src, size_t* bytes, int64_t count,
                        StreamHandle stream) override;
  Status CopyRows(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                  DType dst_dtype, StreamHandle stream) override;

  Status AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items,
                    StreamHandle stream) override;
  Status AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items,
                     StreamHandle stream) override;
  Status DecodeStep(const DecodeStepArgs& args, StreamHandle stream) override;
  Status Run(const DeviceKernel& kernel, const void* args, StreamHandle stream) override;
  Status SplitStepList(const DecodeStepArgs& step, const SplitListArgs& split,
                       StreamHandle stream) override;
  Status PrefetchListRows(const DecodeStepArgs& next, StreamHandle stream) override;
  Status PrefillChunk(const PrefillChunkArgs& args, StreamHandle stream) override;
  Status PrimeAttention(const PrimeArgs& args, StreamHandle stream) override;
  Status ShadowScan(const ShadowScanArgs& args, StreamHandle stream) override;
  [[nodiscard]] bool IsCapturing(StreamHandle stream) const override;
  Result<std::unique_ptr<StepBank>> CreateStepBank(const StepBankConfig& config) override;
  Result<StepBankSizes> StepBankSizesFor(const StepBankConfig& config) const override;
  [[nodiscard]] bool EventDone(EventHandle event) const override;
  Status MergeLse(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows,
                  int head_dim, void* out, DType out_dtype, StreamHandle stream) override;
  Status WaitHostValue(const uint32_t* word, uint32_t value, StreamHandle stream) override;

  [[nodiscard]] int device_id() const { return device_id_; }
  [[nodiscard]] const cudaDeviceProp& props() const { return props_; }
  [[nodiscard]] const LaunchInfo& launch_info() const { return info_; }
  [[nodiscard]] int64_t total_device_bytes() const override {
    return static_cast<int64_t>(props_.totalGlobalMem);
  }
  /// NUMA node host memory is bound to, or -1 (single node, or unknown).
  [[nodiscard]] int numa_node() const { return numa_node_; }

  /// Split-KV scratch per stream (bytes).
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

 private:
  explicit CudaDevice(int device_id) : device_id_(device_id) {}
  Status Init();
  cudaStream_t Resolve(StreamHandle stream) const {
    return stream == nullptr ? default_stream_ : static_cast<cudaStream_t>(stream);
  }
  Result<AttnWorkspace> Workspace(cudaStream_t stream);
  /// The attention entry points' opening: the device current, the stream and its workspace.
  Result<std::pair<cudaStream_t, AttnWorkspace>> AttendOn(StreamHandle stream);
  /// Host-to-device copies dst[i] <- src[i] (bytes[i]) on \p stream: one batched call where the
  /// runtime and driver have it, else one cudaMemcpyAsync each.
  Status EnqueuePageCopies(void** dst, const void** src, size_t* bytes, int64_t count,
                           cudaStream_t stream);
  Status Activate() const;

  struct HostBlock {
    size_t bytes = 0;
    bool registered = false;  // hwloc-bound + cudaHostRegister (else cudaHostAlloc)
  };

  int device_id_;
  std::string name_;
  cudaDeviceProp props_{};
  LaunchInfo info_;
  cudaStream_t default_stream_ = nullptr;
  int numa_node_ = -1;
  void* topology_ = nullptr;  // hwloc_topology_t when the GPU's NUMA node is known
  void* nodeset_ = nullptr;   // hwloc_nodeset_t of that node
  mutable std::mutex mu_;
  std::atomic<bool> batch_copies_{true};  // cleared when cudaMemcpyBatchAsync is refused
  std::unordered_map<cudaStream_t, float*> workspaces_;
  std::unordered_map<void*, HostBlock> host_blocks_;
  DeviceBlocks device_blocks_;  // live AllocDevice blocks, for device_bytes_held()
};

}  // namespace kvferry::cuda
