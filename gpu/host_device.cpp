// Copyright kvferry authors. Apache-2.0.
// The host-emulated Device: "device" memory is host memory, streams are synchronous, and kernels
// are the CPU implementations. It runs exactly the plan the CUDA backend runs, so the runtime,
// scheduler and policies are tested on machines without a GPU.
#include <cstdlib>
#include <cstring>
#include <new>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "gpu/device.h"
#include "offload/numa.h"
#include "base/check.h"

namespace kvferry {
namespace {

constexpr size_t kHostAlign = 64;

void* AlignedAlloc(size_t bytes) {
  const size_t rounded = (bytes + kHostAlign - 1) / kHostAlign * kHostAlign;
  return std::aligned_alloc(kHostAlign, rounded == 0 ? kHostAlign : rounded);
}

class HostDevice final : public Device {
 public:
  Backend backend() const override { return Backend::kHost; }
  std::string name() const override { return "host-emulated"; }

  Result<void*> AllocDevice(size_t bytes) override { return Alloc(bytes); }
  void FreeDevice(void* ptr) override { std::free(ptr); }
  // Host-store pages are bound to the NUMA node of the thread that creates the runtime (the
  // engine's), which is where the CPU route's workers run with no GPU to follow.
  Result<void*> AllocHost(size_t bytes) override {
    Result<void*> r = Alloc(bytes);
    if (r.ok()) BindToNumaNode(r.value(), bytes, -1);
    return r;
  }
  void FreeHost(void* ptr) override { std::free(ptr); }

  StreamHandle default_stream() const override { return nullptr; }
  Result<StreamHandle> CreateStream() override { return StreamHandle{nullptr}; }
  void DestroyStream(StreamHandle) override {}
  Result<EventHandle> CreateEvent() override { return EventHandle{nullptr}; }
  void DestroyEvent(EventHandle) override {}
  Status RecordEvent(EventHandle, StreamHandle) override { return Status::Ok(); }
  Status WaitEvent(StreamHandle, EventHandle) override { return Status::Ok(); }
  Status SynchronizeEvent(EventHandle) override { return Status::Ok(); }
  Status SynchronizeStream(StreamHandle) override { return Status::Ok(); }

  Status CopyAsync(void* dst, const void* src, size_t bytes, StreamHandle) override {
    if (bytes != 0) std::memmove(dst, src, bytes);
    return Status::Ok();
  }

  Status CopyRows(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                  DType dst_dtype, StreamHandle) override {
    for (int64_t i = 0; i < num_rows; ++i) {
      cpu::Convert(rows[i].dst, dst_dtype, rows[i].src, src_dtype, elems);
    }
    return Status::Ok();
  }

  Status AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items,
                    StreamHandle) override {
    cpu::AttendRows(p, items, num_items);
    return Status::Ok();
  }

  Status AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items,
                     StreamHandle) override {
    cpu::AttendPaged(p, items, num_items);
    return Status::Ok();
  }

  Status DecodeStep(const DecodeStepArgs& args, StreamHandle) override {
    cpu::DecodeStep(args);
    return Status::Ok();
  }

  Status DecodeSelect(const DecodeStepArgs& args, StreamHandle) override {
    cpu::DecodeSelect(args);
    return Status::Ok();
  }

  Status PageBounds(const PageBoundsArgs& args, StreamHandle) override {
    cpu::PageBounds(args);
    return Status::Ok();
  }

  Status MergeLse(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows,
                  int head_dim, void* out, DType out_dtype, StreamHandle) override {
    if (o_b != nullptr) cpu::MergeLseRef(o_a, lse_a, o_b, lse_b, rows, head_dim);
    if (out != nullptr) cpu::Convert(out, out_dtype, o_a, DType::kF32, rows * head_dim);
    return Status::Ok();
  }

 private:
  static Result<void*> Alloc(size_t bytes) {
    void* p = AlignedAlloc(bytes);
    if (p == nullptr) {
      return ResourceExhausted(detail::StrCat("host allocation of ", bytes, " bytes failed"));
    }
    return p;
  }
};

}  // namespace

std::unique_ptr<Device> MakeHostDevice() { return std::make_unique<HostDevice>(); }

}  // namespace kvferry
