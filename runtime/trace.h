// Copyright kvferry authors. Apache-2.0.
#pragma once
// A timeline of the runtime's host-side work in the Chrome trace event format (chrome://tracing,
// Perfetto): complete events ("ph":"X") of every stage a call runs on the caller's thread (append
// and plan, select, resolve, GPU enqueue, CPU attention, merge, admit, prefill) and of every CPU
// task of the planned step on the pool's threads, each on its thread's track. Recording is off
// until Start; a span then costs two clock reads and one atomic increment into a buffer sized at
// Start (no allocation on the decode path); spans past its capacity are counted, not kept.
// On CUDA the spans are the host's side of each stage (enqueue, waits, CPU work): the kernels run
// later on the stream and are not in this timeline.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::detail {

class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  /// Starts recording into room for \p max_events spans (earlier ones are dropped).
  Status Start(int64_t max_events);
  [[nodiscard]] bool on() const { return on_.load(std::memory_order_relaxed); }
  /// Records [t0, t1) as \p name (a string literal) of category \p cat; \p arg (>= 0) is shown
  /// as args.item. Safe from any thread while recording.
  void Span(const char* name, const char* cat, Clock::time_point t0, Clock::time_point t1,
            int64_t arg = -1);
  /// Writes the spans recorded since Start to \p path as Chrome trace JSON and stops.
  Status Write(const std::string& path);
  [[nodiscard]] int64_t recorded() const;
  [[nodiscard]] int64_t dropped() const;

 private:
  struct Event {
    const char* name;
    const char* cat;
    int64_t ts_ns;
    int64_t dur_ns;
    int64_t arg;
    uint32_t tid;
  };
  std::vector<Event> events_;
  std::atomic<int64_t> next_{0};
  std::atomic<bool> on_{false};
  Clock::time_point origin_{};
};

}  // namespace kvferry::detail
