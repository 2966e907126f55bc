// Copyright kvferry authors. Apache-2.0.
#include "bench/lib/synthetic.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace kvferry::bench {
namespace {

// Counter-based randomness: any (stream, index) pair gives the same numbers on every run.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t Key(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return Mix(Mix(Mix(Mix(a) ^ b) ^ c) ^ d);
}
double Uniform(uint64_t key) { return (static_cast<double>(Mix(key) >> 11) + 0.5) * 0x1.0p-53; }
float Gaussian(uint64_t key) {
  const double u1 = Uniform(key), u2 = Uniform(key ^ 0x5bd1e995ull);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

constexpr float kSinkKey = 9.0f;      // sink key norm along its direction
constexpr float kSinkQuery = 2.2f;    // query weight on the sink direction
constexpr float kContent = 1.1f;      // shared content (local decay)
constexpr float kTargetKey = 7.0f;
constexpr float kTargetQuery = 1.6f;
constexpr float kNoise = 0.55f;

}  // namespace

SyntheticWorkload::SyntheticWorkload(const SyntheticShape& shape) : shape_(shape) {
  const int d = shape.head_dim, half = d / 2;
  inv_freq_.resize(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) inv_freq_[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / d));
  std::mt19937_64 rng(shape.seed);
  std::normal_distribution<float> normal;
  std::lognormal_distribution<float> heavy(0.0f, 0.6f);
  // Slow frequencies: the last quarter of the rotate-half pairs barely rotate over the context.
  const int slow0 = half - std::max(2, half / 4);
  auto slow_unit = [&]() {
    std::vector<float> v(static_cast<size_t>(d), 0.0f);
    double norm = 0;
    for (int i = slow0; i < half; ++i) {
      v[i] = normal(rng);
      v[i + half] = normal(rng);
      norm += v[i] * v[i] + v[i + half] * v[i + half];
    }
    for (float& x : v) x = static_cast<float>(x / std::sqrt(norm));
    return v;
  };
  heads_.resize(static_cast<size_t>(shape.num_layers) * shape.num_kv_heads);
  for (HeadParams& h : heads_) {
    h.q_scale.resize(d);
    h.k_scale.resize(d);
    h.content.resize(d);
    for (int c = 0; c < d; ++c) {
      h.q_scale[c] = heavy(rng);
      h.k_scale[c] = heavy(rng);
      h.content[c] = normal(rng) * kContent / std::sqrt(1.0f);
    }
    h.sink_dir = slow_unit();
    const int64_t span = std::max<int64_t>(1, shape.max_positions - shape.sinks);
    for (int t = 0; t < shape.targets_per_head; ++t) {
      h.target_dir.push_back(slow_unit());
      h.target_pos.push_back(shape.sinks + static_cast<int64_t>(rng() % static_cast<uint64_t>(span)));
    }
  }
}

void SyntheticWorkload::Rope(float* x, int64_t pos) const {
  const int half = shape_.head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double a = static_cast<double>(pos) * inv_freq_[i];
    const float c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
    const float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x0 * s + x1 * c;
  }
}

bool SyntheticWorkload::TargetActive(int layer, int kv_head, int target, int64_t pos) const {
  const int64_t stint = pos / std::max(1, shape_.stint_steps);
  return Uniform(Key(shape_.seed ^ 0x7a11, static_cast<uint64_t>(layer * 4096 + kv_head),
                     static_cast<uint64_t>(target), static_cast<uint64_t>(stint))) <
         shape_.active_fraction;
}

void SyntheticWorkload::KeysValues(int layer, int64_t pos0, int64_t count, float* k,
                                   float* v) const {
  const int d = shape_.head_dim, hkv = shape_.num_kv_heads;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t pos = pos0 + t;
    for (int h = 0; h < hkv; ++h) {
      const HeadParams& hp = heads_[static_cast<size_t>(layer) * hkv + h];
      float* kr = k + (t * hkv + h) * d;
      float* vr = v + (t * hkv + h) * d;
      const uint64_t base = Key(shape_.seed, static_cast<uint64_t>(layer), static_cast<uint64_t>(h),
                                static_cast<uint64_t>(pos));
      for (int c = 0; c < d; ++c) {
        kr[c] = hp.content[c] + kNoise * hp.k_scale[c] * Gaussian(base + 2 * c);
        vr[c] = Gaussian(base + 2 * c + 1);
      }
      if (pos < shape_.sinks) {
        for (int c = 0; c < d; ++c) kr[c] += kSinkKey * hp.sink_dir[c];
      }
      for (size_t i = 0; i < hp.target_pos.size(); ++i) {
        if (hp.target_pos[i] == pos) {
          for (int c = 0; c < d; ++c) kr[c] += kTargetKey * hp.target_dir[i][c];
        }
      }
      Rope(kr, pos);
    }
  }
}

void SyntheticWorkload::Queries(int layer, int64_t pos0, int64_t count, float* q) const {
  const int d = shape_.head_dim, hq = shape_.num_q_heads, hkv = shape_.num_kv_heads;
  const int group = hq / hkv;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t pos = pos0 + t;
    for (int qh = 0; qh < hq; ++qh) {
      const int h = qh / group;
      const HeadParams& hp = heads_[static_cast<size_t>(layer) * hkv + h];
      float* qr = q + (t * hq + qh) * d;
      const uint64_t base = Key(shape_.seed ^ 0x51, static_cast<uint64_t>(layer),
                                static_cast<uint64_t>(qh), static_cast<uint64_t>(pos));
      // Each query head of the group weighs the shared structure a little differently.
      const float w = 0.75f + 0.5f * static_cast<float>(Uniform(base ^ 0xabc));
      for (int c = 0; c < d; ++c) {
        qr[c] = w * hp.content[c] + kNoise * hp.q_scale[c] * Gaussian(base + c) +
                w * kSinkQuery * hp.sink_dir[c];
      }
      for (size_t i = 0; i < hp.target_pos.size(); ++i) {
        if (hp.target_pos[i] < pos && TargetActive(layer, h, static_cast<int>(i), pos)) {
          for (int c = 0; c < d; ++c) qr[c] += w * kTargetQuery * hp.target_dir[i][c];
        }
      }
      Rope(qr, pos);
    }
  }
}

}  // namespace kvferry::bench
