// Copyright kvferry authors. Apache-2.0.
#pragma once
// The soak: many decode steps on small shapes with sequences added and removed
// throughout, sampling the process's resident memory and the runtime's
// host-store and device bytes. Shared by the CI test
// (Soak.MemoryFlatAfterWarmUp, a few seconds) and kvferry_soak (a million
// steps, bench/results/soak.json).
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvferry/kvferry.h"
#include "kvferry/status_macros.h"

namespace kvferry::testing {

struct SoakOptions {
  std::string policy = "streaming";
  Route route = Route::kAuto;
  Backend backend = Backend::kHost;
  int64_t steps = 20000;        ///< Decode calls (one layer of a batch each)
  int64_t warmup_steps = 5000;  ///< steps before the "warm" sample
  int live = 3;                 ///< sequences live at once, decoded as one batch
  int64_t min_len = 24,
          max_len = 320;     ///< a sequence is removed at a length drawn from this range
  int64_t max_prefill = 40;  ///< a new sequence is prefilled with 1..max_prefill tokens
  uint32_t seed = 1;
};

struct SoakSample {
  int64_t rss_bytes = 0;
  int64_t host_bytes = 0;    ///< Stats::host_bytes_reserved (pinned with CUDA)
  int64_t device_bytes = 0;  ///< Stats::device_bytes_reserved
};

struct SoakReport {
  SoakOptions options;
  int64_t steps = 0;
  int64_t decode_tokens = 0;
  int64_t sequences_added = 0;
  double wall_s = 0;
  SoakSample start, warm, end, max;
  double output_norm = 0;          ///< of the last step's output (non-zero)
  std::vector<int64_t> rss_trace;  ///< RSS at every tenth of the steps
  /// malloc's bytes in use (all arenas, mmapped blocks included) at every
  /// tenth: a leak grows this; allocator caching and first touches of reserved
  /// pages grow RSS only.
  std::vector<int64_t> heap_trace;

  [[nodiscard]] std::string ToJson() const {
    std::ostringstream os;
    auto sample = [&](const char *name, int64_t SoakSample::*field) {
      os << "\"" << name << "\":{\"start\":" << start.*field << ",\"after_warmup\":" << warm.*field
         << ",\"end\":" << end.*field << ",\"max\":" << max.*field << "}";
    };
    os << "{\"policy\":\"" << options.policy << "\",\"route\":\"" << RouteName(options.route)
       << "\",\"backend\":\"" << BackendName(options.backend) << "\",\"steps\":" << steps
       << ",\"warmup_steps\":" << options.warmup_steps << ",\"decode_tokens\":" << decode_tokens
       << ",\"sequences_added\":" << sequences_added << ",\"live_sequences\":" << options.live
       << ",\"wall_s\":" << wall_s << ",\"steps_per_s\":" << (wall_s > 0 ? steps / wall_s : 0)
       << ",";
    sample("rss_bytes", &SoakSample::rss_bytes);
    os << ",";
    sample("host_store_bytes", &SoakSample::host_bytes);
    os << ",";
    sample("device_bytes", &SoakSample::device_bytes);
    os << ",\"rss_bytes_every_tenth\":[";
    for (size_t i = 0; i < rss_trace.size(); ++i) os << (i ? "," : "") << rss_trace[i];
    os << "],\"heap_in_use_bytes_every_tenth\":[";
    for (size_t i = 0; i < heap_trace.size(); ++i) os << (i ? "," : "") << heap_trace[i];
    os << "]}";
    return os.str();
  }
};

inline int64_t ResidentSetBytes() {
  long pages = 0, resident = 0;
  FILE *f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  const int n = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE) : -1;
}

inline Result<SoakReport> RunSoak(const SoakOptions &o) {
  constexpr int kLayers = 2, kKvHeads = 2, kQHeads = 4, kHeadDim = 64;
  RuntimeConfig c;
  c.model.num_layers = kLayers;
  c.model.num_kv_heads = kKvHeads;
  c.model.num_q_heads = kQHeads;
  c.model.head_dim = kHeadDim;
  c.capacity.max_sequences = o.live + 1;
  c.capacity.max_batch = o.live;
  c.capacity.max_tokens_per_sequence = o.max_len + 1;
  c.capacity.max_prefill_chunk = o.max_prefill;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 16;
  c.policy.name = o.policy;
  c.policy.budget_tokens = 32;
  c.route = o.route;
  c.backend = o.backend;
  c.cpu_threads = 2;
  c.probe_at_start = false;
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::Create(c));

  // Inputs are drawn once and cycled, so that the soak times the runtime, not
  // the generator.
  std::mt19937 rng(o.seed);
  std::normal_distribution<float> normal;
  auto draw = [&](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float &e : x) e = normal(rng);
    return x;
  };
  constexpr int kInputSets = 8;
  const int64_t b = o.live;
  std::vector<std::vector<float>> qs, ks, vs;
  for (int i = 0; i < kInputSets; ++i) {
    qs.push_back(draw(std::max(b, o.max_prefill) * kQHeads * kHeadDim));
    ks.push_back(draw(std::max(b, o.max_prefill) * kKvHeads * kHeadDim));
    vs.push_back(draw(std::max(b, o.max_prefill) * kKvHeads * kHeadDim));
  }
  std::vector<float> out(static_cast<size_t>(std::max(b, o.max_prefill) * kQHeads * kHeadDim));
  auto view = [&](std::vector<float> &x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost,
                                  {rows, heads, kHeadDim});
  };

  SoakReport report;
  report.options = o;
  std::vector<SequenceId> live;
  std::vector<int64_t> remove_at;
  SequenceId next_id = 1;
  std::uniform_int_distribution<int64_t> len_dist(o.min_len, o.max_len);
  std::uniform_int_distribution<int64_t> prefill_dist(1, o.max_prefill);
  auto add = [&]() -> Status {
    const SequenceId id = next_id++;
    KVF_RETURN_IF_ERROR(rt->AddSequence(id));
    const int64_t tokens = prefill_dist(rng);
    for (int layer = 0; layer < kLayers; ++layer) {
      const int set = static_cast<int>(id % kInputSets);
      KVF_RETURN_IF_ERROR(rt->Prefill(id, layer, view(qs[set], tokens, kQHeads),
                                      view(ks[set], tokens, kKvHeads),
                                      view(vs[set], tokens, kKvHeads), view(out, tokens, kQHeads)));
    }
    live.push_back(id);
    remove_at.push_back(std::max(len_dist(rng), tokens + 1));
    ++report.sequences_added;
    return Status::Ok();
  };
  auto sample = [&]() {
    const Stats s = rt->GetStats();
    return SoakSample{ResidentSetBytes(), s.host_bytes_reserved, s.device_bytes_reserved};
  };
  auto rss_trace_push = [&](int64_t) {
    report.rss_trace.push_back(ResidentSetBytes());
    const struct mallinfo2 mi = mallinfo2();
    report.heap_trace.push_back(static_cast<int64_t>(mi.uordblks + mi.hblkhd));
  };
  auto take_max = [&](const SoakSample &s) {
    report.max.rss_bytes = std::max(report.max.rss_bytes, s.rss_bytes);
    report.max.host_bytes = std::max(report.max.host_bytes, s.host_bytes);
    report.max.device_bytes = std::max(report.max.device_bytes, s.device_bytes);
  };

  for (int i = 0; i < o.live; ++i) KVF_RETURN_IF_ERROR(add());
  report.start = sample();
  take_max(report.start);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t step = 0;
  while (step < o.steps) {
    for (int layer = 0; layer < kLayers && step < o.steps; ++layer, ++step) {
      const int set = static_cast<int>(step % kInputSets);
      KVF_RETURN_IF_ERROR(rt->Decode(live, layer, view(qs[set], b, kQHeads),
                                     view(ks[set], b, kKvHeads), view(vs[set], b, kKvHeads),
                                     view(out, b, kQHeads)));
      report.decode_tokens += b;
      if (step + 1 == o.warmup_steps) {
        report.warm = sample();
        take_max(report.warm);
      } else if ((step + 1) % 1000 == 0) {
        take_max(sample());
      }
      if (o.steps >= 10 && (step + 1) % (o.steps / 10) == 0) rss_trace_push(step);
    }
    // Churn: a sequence that reached its length (at every layer) leaves, a
    // fresh one comes.
    for (size_t i = 0; i < live.size(); ++i) {
      KVF_ASSIGN_OR_RETURN(const int64_t n, rt->SequenceLength(live[i], kLayers - 1));
      if (n < remove_at[i]) continue;
      KVF_RETURN_IF_ERROR(rt->RemoveSequence(live[i]));
      live.erase(live.begin() + static_cast<int64_t>(i));
      remove_at.erase(remove_at.begin() + static_cast<int64_t>(i));
      KVF_RETURN_IF_ERROR(add());
      // The new sequence went to the back; the one now at i is looked at next.
      --i;
    }
  }
  report.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.steps = step;
  report.end = sample();
  take_max(report.end);
  double norm = 0;
  for (int64_t i = 0; i < b * kQHeads * kHeadDim; ++i) norm += static_cast<double>(out[i]) * out[i];
  report.output_norm = std::sqrt(norm);
  return report;
}

}  // namespace kvferry::testing
