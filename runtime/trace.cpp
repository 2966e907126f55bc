// Copyright kvferry authors. Apache-2.0.
#include "runtime/trace.h"

#include <algorithm>
#include <cstdio>
#include <memory>

#include "base/check.h"

namespace kvferry::detail {
namespace {

// Small, stable thread ids for the trace's tracks (1 = the first thread that records).
uint32_t TraceThreadId() {
  static std::atomic<uint32_t> next{1};
  thread_local const uint32_t id = next.fetch_add(1, std::memory_order_relaxed);
  return id;
}

}  // namespace

Status TraceRecorder::Start(int64_t max_events) {
  KVF_CHECK_ARG(max_events >= 1 && max_events <= (int64_t{1} << 26), "trace capacity ",
                max_events, " out of range [1, 2^26]");
  on_.store(false, std::memory_order_relaxed);
  events_.assign(static_cast<size_t>(max_events), Event{});
  next_.store(0, std::memory_order_relaxed);
  origin_ = Clock::now();
  on_.store(true, std::memory_order_release);
  return Status::Ok();
}

void TraceRecorder::Span(const char* name, const char* cat, Clock::time_point t0,
                         Clock::time_point t1, int64_t arg) {
  if (!on()) return;
  const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
  if (i >= static_cast<int64_t>(events_.size())) return;  // counted in dropped()
  Event& e = events_[static_cast<size_t>(i)];
  e.name = name;
  e.cat = cat;
  e.ts_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t0 - origin_).count();
  e.dur_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
  e.arg = arg;
  e.tid = TraceThreadId();
}

int64_t TraceRecorder::recorded() const {
  return std::min<int64_t>(next_.load(std::memory_order_relaxed),
                           static_cast<int64_t>(events_.size()));
}

int64_t TraceRecorder::dropped() const {
  return std::max<int64_t>(0, next_.load(std::memory_order_relaxed) -
                                  static_cast<int64_t>(events_.size()));
}

Status TraceRecorder::Write(const std::string& path) {
  KVF_CHECK_CODE(on(), StatusCode::kFailedPrecondition,
                 "no trace is being recorded: call StartTrace first");
  on_.store(false, std::memory_order_relaxed);
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "w"), &std::fclose);
  KVF_CHECK_CODE(f != nullptr, StatusCode::kInvalidArgument, "cannot write trace file '", path, "'");
  const int64_t n = recorded();
  std::fprintf(f.get(), "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"dropped\":%lld},\"traceEvents\":[",
               static_cast<long long>(dropped()));
  std::fprintf(f.get(), "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"args\":{\"name\":\"kvferry runtime (host)\"}}");
  for (int64_t i = 0; i < n; ++i) {
    const Event& e = events_[static_cast<size_t>(i)];
    std::fprintf(f.get(),
                 ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":1,\"tid\":%u,\"ts\":%.3f,"
                 "\"dur\":%.3f",
                 e.name, e.cat, e.tid, static_cast<double>(e.ts_ns) * 1e-3,
                 static_cast<double>(e.dur_ns) * 1e-3);
    if (e.arg >= 0) std::fprintf(f.get(), ",\"args\":{\"item\":%lld}", static_cast<long long>(e.arg));
    std::fputc('}', f.get());
  }
  std::fprintf(f.get(), "]}\n");
  KVF_CHECK_CODE(std::ferror(f.get()) == 0, StatusCode::kInvalidArgument, "writing trace file '",
                 path, "' failed");
  return Status::Ok();
}

}  // namespace kvferry::detail
