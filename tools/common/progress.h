// Copyright kvferry authors. Apache-2.0.
#pragma once
// Progress of a long loop on stderr (kvferry-llama's prefill and evaluations, kvferry-e2e's
// fill): a live line (carriage return) with the rate and an ETA when stderr is a terminal, else a
// plain line every few seconds (so a log shows the job is alive without filling up). The clock
// and the stream can be replaced (tests).
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

namespace kvferry::tools {

/// "1:05:03", "4:07" or "0:09" for \p seconds (negative or not finite: "?").
inline std::string FormatDuration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e9) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  }
  return buf;
}

class Progress {
 public:
  using Clock = std::function<double()>;  // seconds, monotonic
  /// \p what names the loop ("prefill"), \p total its steps, \p unit their name ("tokens").
  /// Silent for loops shorter than \p min_total steps.
  Progress(std::string what, int64_t total, std::string unit, std::FILE* out = stderr,
           int tty = -1, Clock clock = nullptr, double every_s = 5.0, int64_t min_total = 2)
      : what_(std::move(what)), unit_(std::move(unit)), total_(total), out_(out),
        every_s_(every_s), clock_(clock ? std::move(clock) : Clock(SteadySeconds)) {
    tty_ = tty >= 0 ? tty != 0 : (out_ != nullptr && isatty(fileno(out_)) != 0);
    silent_ = out_ == nullptr || total_ < min_total;
    start_ = last_ = clock_();
  }
  ~Progress() { Finish(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// \p done steps of total are complete.
  void Update(int64_t done) {
    done_ = done;
    if (silent_) return;
    const double now = clock_();
    const double gap = tty_ ? 0.2 : every_s_;
    if (now - last_ < gap && done < total_) return;
    last_ = now;
    std::fprintf(out_, "%s%s%s", tty_ ? "\r" : "", Line(now).c_str(), tty_ ? "\033[K" : "\n");
    std::fflush(out_);
    printed_ = true;
  }
  /// Ends a live line (called by the destructor).
  void Finish() {
    if (silent_ || finished_) return;
    finished_ = true;
    if (tty_ && printed_) std::fputc('\n', out_);
  }
  /// "prefill: 4096/8192 tokens (50%), 1234.5 tokens/s, ETA 0:03".
  [[nodiscard]] std::string Line(double now) const {
    const double elapsed = now - start_;
    const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0.0;
    const double eta = rate > 0 ? static_cast<double>(total_ - done_) / rate : -1.0;
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s: %lld/%lld %s (%.0f%%), %.1f %s/s, %s %s", what_.c_str(),
                  static_cast<long long>(done_), static_cast<long long>(total_), unit_.c_str(),
                  total_ > 0 ? 100.0 * static_cast<double>(done_) / static_cast<double>(total_) : 100.0,
                  rate, unit_.c_str(), done_ >= total_ ? "took" : "ETA",
                  FormatDuration(done_ >= total_ ? elapsed : eta).c_str());
    return buf;
  }

 private:
  static double SteadySeconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  std::string what_, unit_;
  int64_t total_ = 0, done_ = 0;
  std::FILE* out_;
  double every_s_;
  Clock clock_;
  bool tty_ = false, silent_ = false, printed_ = false, finished_ = false;
  double start_ = 0, last_ = 0;
};

}  // namespace kvferry::tools
