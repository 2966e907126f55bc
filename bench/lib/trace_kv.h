// Copyright kvferry authors. Apache-2.0.
#pragma once
// One KV head of a recorded attention trace (bench/lib/safetensors.h's TraceLayer) as the paged
// rows a policy reads (KvPages, f16 or bf16, every trace position), for the trace replays of
// lfps_bench and select_replay_bench.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "bench/lib/safetensors.h"
#include "cpu/dtype.h"
#include "kvferry/kv_pages.h"
#include "kvferry/tensor.h"

namespace kvferry::bench {

/// Keeps only the traced layers listed in \p layers (all of them when the list is empty); false
/// when the list selects none.
inline bool KeepTraceLayers(Trace& trace, const std::vector<int64_t>& layers) {
  if (layers.empty()) return true;
  std::vector<TraceLayer> keep;
  for (auto& l : trace.layers) {
    if (std::find(layers.begin(), layers.end(), l.layer) != layers.end()) keep.push_back(std::move(l));
  }
  trace.layers = std::move(keep);
  return !trace.layers.empty();
}

class TraceHead {
 public:
  static constexpr int64_t kPage = 256;
  TraceHead(const TraceLayer& l, int h, DType dt) {
    const int d = l.head_dim;
    const int64_t T = l.num_tokens;
    const int64_t pages = (T + kPage - 1) / kPage;
    for (int64_t p = 0; p < pages; ++p) {
      pages_.emplace_back(new uint16_t[static_cast<size_t>(2) * kPage * d]());
      ptrs_.push_back(pages_.back().get());
    }
    for (int64_t t = 0; t < T; ++t) {
      uint16_t* page = pages_[t / kPage].get();
      const int64_t row = t % kPage;
      const float* k = l.k.data() + (t * l.num_kv_heads + h) * d;
      const float* v = l.v.data() + (t * l.num_kv_heads + h) * d;
      for (int e = 0; e < d; ++e) {
        page[row * d + e] = dt == DType::kBF16 ? cpu::F32ToBf16(k[e]) : cpu::F32ToF16(k[e]);
        page[(kPage + row) * d + e] = dt == DType::kBF16 ? cpu::F32ToBf16(v[e]) : cpu::F32ToF16(v[e]);
      }
    }
    kv_.pages = ptrs_.data();
    kv_.page_tokens = kPage;
  }
  TraceHead(const TraceHead&) = delete;
  TraceHead& operator=(const TraceHead&) = delete;
  [[nodiscard]] const KvPages& kv() const { return kv_; }

 private:
  std::vector<std::unique_ptr<uint16_t[]>> pages_;
  std::vector<void*> ptrs_;
  KvPages kv_;
};

}  // namespace kvferry::bench
