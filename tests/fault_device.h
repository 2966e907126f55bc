// Copyright kvferry authors. Apache-2.0.
#pragma once
// Fault injection for tests: a Device that forwards every call to the real one
// (host or CUDA) and fails the Nth call of a chosen entry point from now.
//
// Why a wrapping Device rather than fault points compiled into the library:
// every failure the runtime can meet from the accelerator (an allocation, a
// copy, a launch, an event) reaches it as the Status of a Device call, so
// wrapping the Device reaches all of them with no code in the library's run
// path at all (zero cost when off, not even a branch), it works unchanged over
// the CUDA backend, and the host store and token bank, which allocate through
// the same Device, are covered too. The only hook in the library is
// detail::ScopedDeviceDecorator, read once at Runtime::Create.
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "gpu/device.h"
#include "kvferry/status_macros.h"
#include "runtime/runtime_impl.h"

namespace kvferry::testing {

enum class FaultPoint : int {
  kAllocDevice,
  kAllocHost,
  kCreateStream,
  kCreateEvent,
  kRecordEvent,
  kWaitEvent,
  kSynchronizeEvent,
  kSynchronizeStream,
  kCopyAsync,
  kCopyRows,
  kAttendRows,
  kAttendPaged,
  kDecodeStep,
  kRun,
  kPrefillChunk,
  kMergeLse,
  kPrimeAttention,
  kSplitStepList,
  kPrefetchListRows,
  kCount,
};

inline const char *FaultPointName(FaultPoint p) {
  static constexpr const char *kNames[] = {
      "AllocDevice",  "AllocHost",        "CreateStream",      "CreateEvent",  "RecordEvent",
      "WaitEvent",    "SynchronizeEvent", "SynchronizeStream", "CopyAsync",    "CopyRows",
      "AttendRows",   "AttendPaged",      "DecodeStep",        "Run",          "PrefillChunk",
      "MergeLse",     "PrimeAttention",    "SplitStepList",
      "PrefetchListRows"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(FaultPoint::kCount));
  return kNames[static_cast<int>(p)];
}

/// kBefore: the call fails without doing anything (a launch or allocation that
/// is refused). kAfter: the call does its work, then reports the error (an
/// asynchronous error surfacing late), the harder case for a caller's rollback.
enum class FaultMode : uint8_t { kBefore, kAfter };

/// Counts the calls of every point and fails the armed one. One thread at a
/// time (the runtime calls its Device under its mutex).
class FaultInjector {
 public:
  /// Fails the \p nth call (1 = the next) of \p point from now, once.
  void FailNth(FaultPoint point, int64_t nth, FaultMode mode = FaultMode::kBefore) {
    armed_ = point;
    countdown_ = nth;
    mode_ = mode;
  }
  void Disarm() { countdown_ = 0; }
  [[nodiscard]] int64_t calls(FaultPoint p) const { return calls_[static_cast<int>(p)]; }
  /// Faults injected so far.
  [[nodiscard]] int64_t fired() const { return fired_; }

  // Called by FaultyDevice on every call of \p p: true if this call must fail.
  bool Hit(FaultPoint p) {
    ++calls_[static_cast<int>(p)];
    if (countdown_ <= 0 || p != armed_) return false;
    if (--countdown_ > 0) return false;
    ++fired_;
    return true;
  }
  [[nodiscard]] FaultMode mode() const { return mode_; }
  static Status Error(FaultPoint p, size_t bytes = 0) {
    if (p == FaultPoint::kAllocDevice || p == FaultPoint::kAllocHost) {
      return ResourceExhausted(
          detail::StrCat("injected: ", FaultPointName(p), " of ", bytes, " bytes failed"));
    }
    return DeviceError(detail::StrCat("injected: ", FaultPointName(p), " failed"));
  }

 private:
  std::array<int64_t, static_cast<size_t>(FaultPoint::kCount)> calls_{};
  FaultPoint armed_ = FaultPoint::kCount;
  int64_t countdown_ = 0;
  FaultMode mode_ = FaultMode::kBefore;
  int64_t fired_ = 0;
};

class FaultyDevice final : public Device {
 public:
  FaultyDevice(std::unique_ptr<Device> inner, std::shared_ptr<FaultInjector> faults)
      : inner_(std::move(inner)), faults_(std::move(faults)) {}

  Backend backend() const override { return inner_->backend(); }
  std::string name() const override { return "faulty(" + inner_->name() + ")"; }
  std::string pci_bus_id() const override { return inner_->pci_bus_id(); }

  Result<void *> AllocDevice(size_t bytes) override {
    if (faults_->Hit(FaultPoint::kAllocDevice)) {
      return FaultInjector::Error(FaultPoint::kAllocDevice, bytes);
    }
    return inner_->AllocDevice(bytes);
  }
  void FreeDevice(void *ptr) override { inner_->FreeDevice(ptr); }
  Result<void *> AllocHost(size_t bytes) override {
    if (faults_->Hit(FaultPoint::kAllocHost)) {
      return FaultInjector::Error(FaultPoint::kAllocHost, bytes);
    }
    return inner_->AllocHost(bytes);
  }
  void FreeHost(void *ptr) override { inner_->FreeHost(ptr); }
  int64_t device_bytes_held() const override { return inner_->device_bytes_held(); }
  size_t stream_scratch_bytes() const override { return inner_->stream_scratch_bytes(); }

  StreamHandle default_stream() const override { return inner_->default_stream(); }
  Result<StreamHandle> CreateStream() override {
    if (faults_->Hit(FaultPoint::kCreateStream))
      return FaultInjector::Error(FaultPoint::kCreateStream);
    return inner_->CreateStream();
  }
  void DestroyStream(StreamHandle stream) override { inner_->DestroyStream(stream); }
  Result<EventHandle> CreateEvent() override {
    if (faults_->Hit(FaultPoint::kCreateEvent))
      return FaultInjector::Error(FaultPoint::kCreateEvent);
    return inner_->CreateEvent();
  }
  Result<EventHandle> CreateTimingEvent() override {
    if (faults_->Hit(FaultPoint::kCreateEvent))
      return FaultInjector::Error(FaultPoint::kCreateEvent);
    return inner_->CreateTimingEvent();
  }
  Result<double> ElapsedMs(EventHandle start, EventHandle end) override {
    return inner_->ElapsedMs(start, end);
  }
  void DestroyEvent(EventHandle event) override { inner_->DestroyEvent(event); }
  Status RecordEvent(EventHandle event, StreamHandle stream) override {
    return Run(FaultPoint::kRecordEvent, [&] { return inner_->RecordEvent(event, stream); });
  }
  Status WaitEvent(StreamHandle stream, EventHandle event) override {
    return Run(FaultPoint::kWaitEvent, [&] { return inner_->WaitEvent(stream, event); });
  }
  Status SynchronizeEvent(EventHandle event) override {
    return Run(FaultPoint::kSynchronizeEvent, [&] { return inner_->SynchronizeEvent(event); });
  }
  Status SynchronizeStream(StreamHandle stream) override {
    return Run(FaultPoint::kSynchronizeStream, [&] { return inner_->SynchronizeStream(stream); });
  }
  Status CopyAsync(void *dst, const void *src, size_t bytes, StreamHandle stream) override {
    return Run(FaultPoint::kCopyAsync, [&] { return inner_->CopyAsync(dst, src, bytes, stream); });
  }
  Status CopyRows(const RowCopy *rows, int64_t num_rows, int elems, DType src_dtype,
                  DType dst_dtype, StreamHandle stream) override {
    return Run(FaultPoint::kCopyRows, [&] {
      return inner_->CopyRows(rows, num_rows, elems, src_dtype, dst_dtype, stream);
    });
  }
  Status AttendRows(const AttnParams &p, const RowAttnItem *items, int64_t num_items,
                    StreamHandle stream) override {
    return Run(FaultPoint::kAttendRows,
               [&] { return inner_->AttendRows(p, items, num_items, stream); });
  }
  Status AttendPaged(const AttnParams &p, const PagedAttnItem *items, int64_t num_items,
                     StreamHandle stream) override {
    return Run(FaultPoint::kAttendPaged,
               [&] { return inner_->AttendPaged(p, items, num_items, stream); });
  }
  Status DecodeStep(const DecodeStepArgs &args, StreamHandle stream) override {
    return Run(FaultPoint::kDecodeStep, [&] { return inner_->DecodeStep(args, stream); });
  }
  Status Run(const DeviceKernel &kernel, const void *args, StreamHandle stream) override {
    return Run(FaultPoint::kRun, [&] { return inner_->Run(kernel, args, stream); });
  }
  Status SplitStepList(const DecodeStepArgs &step, const SplitListArgs &split,
                       StreamHandle stream) override {
    return Run(FaultPoint::kSplitStepList, [&] { return inner_->SplitStepList(step, split, stream); });
  }
  Status PrefetchListRows(const DecodeStepArgs &next, StreamHandle stream) override {
    return Run(FaultPoint::kPrefetchListRows, [&] { return inner_->PrefetchListRows(next, stream); });
  }
  Status PrefillChunk(const PrefillChunkArgs &args, StreamHandle stream) override {
    return Run(FaultPoint::kPrefillChunk, [&] { return inner_->PrefillChunk(args, stream); });
  }
  Status ShadowScan(const ShadowScanArgs &args, StreamHandle stream) override {
    return inner_->ShadowScan(args, stream);
  }
  int64_t total_device_bytes() const override { return inner_->total_device_bytes(); }
  Status PrimeAttention(const PrimeArgs &args, StreamHandle stream) override {
    return Run(FaultPoint::kPrimeAttention, [&] { return inner_->PrimeAttention(args, stream); });
  }
  // The device bank allocates on the inner device (its own calls, Admit and ResetTables, are not
  // wrapped: its admission is a kernel on the runtime's stream, so faults reach it through that
  // stream's calls): creating it counts as one device allocation that can fail.
  Result<std::unique_ptr<StepBank>> CreateStepBank(const StepBankConfig &config) override {
    if (faults_->Hit(FaultPoint::kAllocDevice)) {
      return FaultInjector::Error(FaultPoint::kAllocDevice);
    }
    return inner_->CreateStepBank(config);
  }
  Result<StepBankSizes> StepBankSizesFor(const StepBankConfig &config) const override {
    return inner_->StepBankSizesFor(config);
  }
  bool IsCapturing(StreamHandle stream) const override { return inner_->IsCapturing(stream); }
  bool EventDone(EventHandle event) const override { return inner_->EventDone(event); }
  Status WaitHostValue(const uint32_t* word, uint32_t value, StreamHandle stream) override {
    return inner_->WaitHostValue(word, value, stream);
  }
  Status MergeLse(float *o_a, float *lse_a, const float *o_b, const float *lse_b, int64_t rows,
                  int head_dim, void *out, DType out_dtype, StreamHandle stream) override {
    return Run(FaultPoint::kMergeLse, [&] {
      return inner_->MergeLse(o_a, lse_a, o_b, lse_b, rows, head_dim, out, out_dtype, stream);
    });
  }

 private:
  template <typename F>
  Status Run(FaultPoint p, F &&call) {
    if (!faults_->Hit(p)) return call();
    if (faults_->mode() == FaultMode::kAfter) call().IgnoreError();
    return FaultInjector::Error(p);
  }

  std::unique_ptr<Device> inner_;
  std::shared_ptr<FaultInjector> faults_;
};

/// While alive, Runtime::Create on this thread runs on a FaultyDevice driven by
/// faults().
class ScopedFaults {
 public:
  ScopedFaults()
      : faults_(std::make_shared<FaultInjector>()),
        scope_([f = faults_](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
          return std::make_unique<FaultyDevice>(std::move(d), f);
        }) {}
  FaultInjector &faults() { return *faults_; }
  std::shared_ptr<FaultInjector> shared() { return faults_; }

 private:
  std::shared_ptr<FaultInjector> faults_;
  detail::ScopedDeviceDecorator scope_;
};

}  // namespace kvferry::testing
