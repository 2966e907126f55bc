// Copyright kvferry authors. Apache-2.0.
#pragma once
// A seeded synthetic Q/K/V generator with the structure real attention has:
//  - sink tokens (the first few positions) that draw much of the mass from every query;
//  - local decay: a content vector shared by queries and keys on all RoPE frequencies, so that
//    after RoPE q.k peaks at distance 0 and falls off with distance;
//  - heavy-tailed channels: per-channel scales drawn log-normal for queries and keys;
//  - RoPE (rotate-half, theta 10000) on q and k;
//  - retrieval targets: a few distant positions per KV head whose keys align with a direction
//    (on the slow RoPE frequencies) that queries switch on for stints of many steps, so the same
//    distant positions stay relevant across steps.
// Any (layer, position) can be generated independently and deterministically from the seed.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvferry::bench {

struct SyntheticShape {
  int num_layers = 1;
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
  int64_t max_positions = 8192;  ///< targets are placed in [sinks, max_positions)
  uint64_t seed = 1;
  int sinks = 4;
  int targets_per_head = 16;
  int stint_steps = 32;          ///< how long a target stays switched on or off
  double active_fraction = 0.25; ///< chance a target is on in a stint
};

class SyntheticWorkload {
 public:
  explicit SyntheticWorkload(const SyntheticShape& shape);
  [[nodiscard]] const SyntheticShape& shape() const { return shape_; }

  /// K and V rows of positions [pos0, pos0 + count) at \p layer: [count, num_kv_heads, head_dim].
  void KeysValues(int layer, int64_t pos0, int64_t count, float* k, float* v) const;
  /// Queries of positions [pos0, pos0 + count) at \p layer: [count, num_q_heads, head_dim].
  void Queries(int layer, int64_t pos0, int64_t count, float* q) const;
  /// The retrieval-target positions of (layer, kv head).
  [[nodiscard]] const std::vector<int64_t>& targets(int layer, int kv_head) const {
    return heads_[static_cast<size_t>(layer) * shape_.num_kv_heads + kv_head].target_pos;
  }

 private:
  struct HeadParams {
    std::vector<float> q_scale, k_scale;   // per channel, heavy-tailed
    std::vector<float> content;            // shared q/k content (all frequencies)
    std::vector<float> sink_dir;           // unit, slow frequencies
    std::vector<std::vector<float>> target_dir;  // unit, slow frequencies
    std::vector<int64_t> target_pos;
  };
  void Rope(float* x, int64_t pos) const;
  [[nodiscard]] bool TargetActive(int layer, int kv_head, int target, int64_t pos) const;

  SyntheticShape shape_;
  std::vector<HeadParams> heads_;     // per (layer, kv head)
  std::vector<float> inv_freq_;       // per rotate-half pair
};

}  // namespace kvferry::bench
