// Copyright kvferry authors. Apache-2.0.
// The host-emulated Device: "device" memory is host memory, streams are synchronous, and kernels
// are the CPU implementations. It runs exactly the plan the CUDA backend runs, so the runtime,
// scheduler and policies are tested on machines without a GPU.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <new>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/numa.h"
#include "cpu/reference.h"
#include "gpu/device.h"
#include "gpu/device_blocks.h"
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

  // "Device" blocks are counted as the CUDA device counts its cudaMalloc blocks, so that the
  // runtime's device memory plan and GPU memory cap are tested without a GPU.
  Result<void*> AllocDevice(size_t bytes) override {
    Result<void*> r = Alloc(bytes);
    if (r.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      device_blocks_.Add(r.value(), bytes);
    }
    return r;
  }
  void FreeDevice(void* ptr) override {
    if (ptr == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      device_blocks_.Remove(ptr);
    }
    std::free(ptr);
  }
  int64_t device_bytes_held() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return device_blocks_.bytes();
  }
  // Host "streams" are synchronous and have no scratch of their own.
  size_t stream_scratch_bytes() const override { return 0; }
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
  // Work on the host "stream" is done when the call returns, so an event is reached when it is
  // recorded: plain events are null, a timing event holds the host clock of its last record.
  Result<EventHandle> CreateEvent() override { return EventHandle{nullptr}; }
  Result<EventHandle> CreateTimingEvent() override {
    return static_cast<EventHandle>(new std::chrono::steady_clock::time_point());
  }
  void DestroyEvent(EventHandle event) override {
    delete static_cast<std::chrono::steady_clock::time_point*>(event);
  }
  Status RecordEvent(EventHandle event, StreamHandle) override {
    if (event != nullptr) *static_cast<std::chrono::steady_clock::time_point*>(event) = std::chrono::steady_clock::now();
    return Status::Ok();
  }
  Result<double> ElapsedMs(EventHandle start, EventHandle end) override {
    KVF_CHECK_ARG(start != nullptr && end != nullptr, "ElapsedMs: not timing events");
    return std::chrono::duration<double, std::milli>(
               *static_cast<std::chrono::steady_clock::time_point*>(end) -
               *static_cast<std::chrono::steady_clock::time_point*>(start))
        .count();
  }
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

  Status Run(const DeviceKernel& kernel, const void* args, StreamHandle) override {
    KVF_CHECK_ARG(kernel.host != nullptr, kernel.name, ": no host twin");
    return kernel.host(args);
  }

  Status SplitStepList(const DecodeStepArgs& step, const SplitListArgs& split, StreamHandle) override {
    cpu::SplitStepList(step, split);
    return Status::Ok();
  }
  Status PrefetchListRows(const DecodeStepArgs& next, StreamHandle) override {
    const size_t row_bytes = static_cast<size_t>(next.params.head_dim) * DTypeSize(next.params.kv_dtype);
    KVF_CHECK_ARG(next.list != nullptr && next.list_count != nullptr && next.positions != nullptr &&
                      next.slots != nullptr && next.store.pages != nullptr && next.bank.stage != nullptr &&
                      row_bytes > 0 && next.store.page_tokens > 0,
                  "prefetch list rows: null list, positions, slots, page table or stage");
    cpu::PrefetchListRows(next);
    return Status::Ok();
  }
  Status ShadowScan(const ShadowScanArgs& args, StreamHandle) override {
    KVF_CHECK_ARG(args.group >= 1 && args.head_dim >= 1 && args.channels >= 1 && args.items >= 0,
                  "ShadowScan: group ", args.group, ", head_dim ", args.head_dim, ", channels ",
                  args.channels, ", items ", args.items);
    cpu::ShadowScanRef(args);
    return Status::Ok();
  }
  Status PrimeAttention(const PrimeArgs& args, StreamHandle) override {
    KVF_RETURN_IF_ERROR(CheckPrimeArgs(args));
    cpu::PrimeAttentionRef(args);
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

  mutable std::mutex mu_;
  DeviceBlocks device_blocks_;
};

}  // namespace

Status CheckPrimeArgs(const PrimeArgs& a) {
  const AttnParams& p = a.params;
  KVF_CHECK_ARG(p.group >= 1 && p.head_dim >= 1, "PrimeAttention: group ", p.group, ", head_dim ",
                p.head_dim);
  KVF_CHECK_ARG(a.num_kv_heads >= 1, "PrimeAttention: ", a.num_kv_heads, " KV heads");
  KVF_CHECK_ARG(a.n >= 1 && a.rows >= 1 && a.t_first >= 0 && a.t_first + a.rows <= a.n,
                "PrimeAttention: rows [", a.t_first, ", ", a.t_first + a.rows,
                ") not inside the stored positions [0, ", a.n, ")");
  KVF_CHECK_ARG(a.sink >= 0 && a.sink <= a.off_hi && a.off_hi <= a.n,
                "PrimeAttention: scored keys [", a.sink, ", ", a.off_hi, ") not inside [0, ", a.n,
                ")");
  KVF_CHECK_ARG(a.store.page_tokens >= 1 && a.store.max_pages * a.store.page_tokens >= a.n,
                "PrimeAttention: ", a.store.max_pages, " pages of ", a.store.page_tokens,
                " tokens hold fewer than ", a.n, " positions");
  KVF_CHECK_ARG(a.table_stride >= 2 * a.n, "PrimeAttention: table stride ", a.table_stride,
                " below 2 n = ", 2 * a.n);
  KVF_CHECK_ARG(a.q_head_stride >= int64_t{a.rows} * p.group * p.head_dim,
                "PrimeAttention: q head stride ", a.q_head_stride,
                " below rows * group * head_dim");
  KVF_CHECK_ARG(a.q != nullptr && a.store.pages != nullptr && a.tables != nullptr && a.stats != nullptr,
                "PrimeAttention: null q, pages, tables or stats");
  return Status::Ok();
}

Status Device::WaitHostValue(const uint32_t* word, uint32_t value, StreamHandle stream) {
  (void)stream;
  KVF_CHECK_ARG(word != nullptr, "WaitHostValue: null word");
  const auto t0 = std::chrono::steady_clock::now();
  const std::atomic_ref<const uint32_t> w(*word);
  while (static_cast<int32_t>(w.load(std::memory_order_acquire) - value) < 0) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(kHostValueTimeoutS)) {
      std::atomic_ref<uint32_t>(const_cast<uint32_t*>(word)[1]).store(1, std::memory_order_release);
      return Internal(detail::StrCat("WaitHostValue: the word stayed below ", value, " for ",
                                     kHostValueTimeoutS, " s"));
    }
    std::this_thread::yield();
  }
  return Status::Ok();
}

std::unique_ptr<Device> MakeHostDevice() { return std::make_unique<HostDevice>(); }

}  // namespace kvferry
