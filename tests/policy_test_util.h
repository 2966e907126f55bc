// Copyright kvferry authors. Apache-2.0.
#pragma once
// Test helpers for the selection policies: a paged KV head built from fp32 rows (stored in a KV
// dtype), SelectContexts over it, synthetic attention with real structure, and recall of the
// exact top-k. Header-only; used by the *_policy_test.cpp files.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "base/attn_types.h"
#include "cpu/dtype.h"
#include "kvferry/kvferry.h"
#include "policies/kvpop/kvpop.h"
#include "policies/policy.h"
#include "policies/select_util.h"

namespace kvferry::testing_util {

/// One KV head's rows in host pages, as the host store lays them out.
class PagedHead {
 public:
  PagedHead(int head_dim, DType dtype, int page_tokens = 64)
      : head_dim_(head_dim), dtype_(dtype), page_tokens_(page_tokens) {}
  void Append(const float* k, const float* v) {
    const int64_t pos = n_;
    if (pos % page_tokens_ == 0) {
      storage_.emplace_back(new char[2 * page_tokens_ * head_dim_ * DTypeSize(dtype_)]);
      ptrs_.push_back(storage_.back().get());
    }
    const size_t elem = DTypeSize(dtype_);
    char* page = storage_.back().get();
    char* krow = page + static_cast<size_t>(pos % page_tokens_) * head_dim_ * elem;
    char* vrow = page + static_cast<size_t>(page_tokens_ + pos % page_tokens_) * head_dim_ * elem;
    for (int d = 0; d < head_dim_; ++d) {
      cpu::StoreFromF32(krow, dtype_, d, k[d]);
      cpu::StoreFromF32(vrow, dtype_, d, v[d]);
    }
    ++n_;
  }
  KvPages pages() const {
    KvPages kv;
    kv.pages = ptrs_.data();
    kv.page_tokens = page_tokens_;
    return kv;
  }
  /// Key row as stored, in fp32.
  std::vector<float> Key(int64_t pos) const {
    std::vector<float> r(static_cast<size_t>(head_dim_));
    AttnParams p;
    p.head_dim = head_dim_;
    p.kv_dtype = dtype_;
    LoadRowF32(pages(), p, pos, false, r.data());
    return r;
  }
  int64_t n() const { return n_; }
  int head_dim() const { return head_dim_; }
  DType dtype() const { return dtype_; }

 private:
  int head_dim_;
  DType dtype_;
  int page_tokens_;
  int64_t n_ = 0;
  std::vector<std::unique_ptr<char[]>> storage_;
  std::vector<void*> ptrs_;
};

inline AttnParams Params(int group, int head_dim, DType dtype) {
  AttnParams p;
  p.group = group;
  p.head_dim = head_dim;
  p.kv_dtype = dtype;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  return p;
}

inline SelectContext Context(const PagedHead& kv, const float* q, int group, int sink, int window,
                             int64_t budget, int layer = 0) {
  SelectContext c;
  c.layer = layer;
  c.n = kv.n();
  c.sink = sink;
  c.window = window;
  c.budget = budget;
  c.q = q;
  c.params = Params(group, kv.head_dim(), kv.dtype());
  c.kv = kv.pages();
  return c;
}

/// Synthetic attention with the structure real heads have: keys an AR(1) walk over positions
/// (neighbours score alike), heavy-tailed channel scales, a few planted spans aligned with the
/// query (retrieval targets) and a query with heavy-tailed channels.
struct Synthetic {
  std::vector<float> q;  // [group][head_dim]
  PagedHead kv;
  Synthetic(int64_t n, int group, int head_dim, uint32_t seed, DType dtype = DType::kBF16,
            double rho = 0.9, int spans = 6, int span_len = 6)
      : kv(head_dim, dtype) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<float> chan(static_cast<size_t>(head_dim));
    for (float& c : chan) c = std::exp(0.8f * nd(rng));
    q.resize(static_cast<size_t>(group) * head_dim);
    std::vector<float> qdir(static_cast<size_t>(head_dim));
    for (int d = 0; d < head_dim; ++d) qdir[d] = nd(rng) * chan[d];
    for (int g = 0; g < group; ++g) {
      for (int d = 0; d < head_dim; ++d) q[g * head_dim + d] = qdir[d] + 0.5f * nd(rng) * chan[d];
    }
    std::vector<int64_t> span_at;
    for (int s = 0; s < spans; ++s) span_at.push_back(static_cast<int64_t>(rng() % std::max<int64_t>(n, 1)));
    std::vector<float> k(static_cast<size_t>(head_dim)), v(static_cast<size_t>(head_dim)),
        walk(static_cast<size_t>(head_dim), 0.0f);
    const float a = static_cast<float>(rho), b = static_cast<float>(std::sqrt(1 - rho * rho));
    double qn = 0;
    for (float x : qdir) qn += x * x;
    const float boost = static_cast<float>(3.0 / std::sqrt(qn + 1e-9));
    for (int64_t i = 0; i < n; ++i) {
      bool hot = false;
      for (int64_t s : span_at) hot |= i >= s && i < s + span_len;
      for (int d = 0; d < head_dim; ++d) {
        walk[d] = a * walk[d] + b * nd(rng);
        k[d] = walk[d] * chan[d] / 2 + (hot ? boost * qdir[d] : 0.0f);
        v[d] = nd(rng);
      }
      kv.Append(k.data(), v.data());
    }
  }
};

/// |chosen ∩ exact| / |exact| over the offloaded range, exact = ExactOffloadedTopK.
inline double OffloadedRecall(const SelectContext& ctx, const std::vector<int32_t>& selection) {
  const OffloadSplit s = SplitPositions(ctx.n, ctx.sink, ctx.window, ctx.budget);
  std::vector<int32_t> exact;
  const int64_t k = ExactOffloadedTopK(ctx, s, exact);
  if (k == 0) return 1.0;
  std::set<int32_t> sel(selection.begin(), selection.end());
  int64_t hit = 0;
  for (int64_t i = 0; i < k; ++i) hit += sel.count(exact[i]);
  return static_cast<double>(hit) / static_cast<double>(k);
}

/// The selection contract every policy keeps: ascending, unique, in [0, n), sinks and window
/// included, at most max(budget, sink + window) positions.
inline void ExpectValidSelection(const SelectContext& ctx, const std::vector<int32_t>& sel) {
  ASSERT_TRUE(std::is_sorted(sel.begin(), sel.end()));
  ASSERT_TRUE(std::adjacent_find(sel.begin(), sel.end()) == sel.end()) << "duplicates";
  if (!sel.empty()) {
    EXPECT_GE(sel.front(), 0);
    EXPECT_LT(sel.back(), ctx.n);
  }
  const OffloadSplit s = SplitPositions(ctx.n, ctx.sink, ctx.window, ctx.budget);
  const int64_t resident = s.sink + (s.n - s.off_hi);
  EXPECT_LE(static_cast<int64_t>(sel.size()), std::max(ctx.budget, resident));
  std::set<int32_t> set(sel.begin(), sel.end());
  for (int64_t i = 0; i < s.sink; ++i) EXPECT_TRUE(set.count(static_cast<int32_t>(i))) << "sink " << i;
  for (int64_t i = s.off_hi; i < s.n; ++i) EXPECT_TRUE(set.count(static_cast<int32_t>(i))) << "window " << i;
}

/// One Select of \p policy on \p ctx, checked (ok, ExpectValidSelection); its OffloadedRecall.
inline double SelectedRecall(Policy& policy, const SelectContext& ctx) {
  std::vector<int32_t> sel;
  const Status st = policy.Select(ctx, sel);
  EXPECT_TRUE(st.ok()) << st.ToString();
  ExpectValidSelection(ctx, sel);
  return OffloadedRecall(ctx, sel);
}

/// Registers "kvpop_mlp_test": KVpop with a trained-looking MLP scorer (hidden 5, fixed random
/// weights drawn for the configuration's model shape), so that runtime tests run the scorer on
/// both backends without a weights file. Idempotent; returns the name.
inline const char* RegisterKvpopMlpTestPolicy() {
  static const bool done = RegisterPolicy("kvpop_mlp_test", [](const RuntimeConfig& c) -> Result<std::unique_ptr<Policy>> {
    KVF_ASSIGN_OR_RETURN(KvpopParams params, ParseKvpopParams(c.policy.params));
    auto w = std::make_shared<KvpopScorerWeights>();
    const int layers = c.model.num_layers, heads = c.model.num_kv_heads, hidden = 5;
    w->num_layers = layers;
    w->num_kv_heads = heads;
    w->in_dim = 2 * c.model.head_dim;
    w->hidden = hidden;
    const size_t lh = static_cast<size_t>(layers) * heads;
    std::mt19937 rng(77);
    std::normal_distribution<float> nd;
    w->w1.resize(lh * hidden * w->in_dim);
    w->b1.resize(lh * hidden);
    w->w2.resize(lh * hidden);
    w->b2.resize(lh);
    w->alpha.resize(lh);
    for (float& x : w->w1) x = 0.3f * nd(rng);
    for (float& x : w->b1) x = 0.1f * nd(rng);
    for (float& x : w->w2) x = nd(rng);
    for (float& x : w->b2) x = nd(rng);
    for (float& x : w->alpha) x = nd(rng);
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<KvpopPolicy> policy, KvpopPolicy::Create(params, std::move(w), c));
    return std::unique_ptr<Policy>(std::move(policy));
  });
  (void)done;
  return "kvpop_mlp_test";
}

}  // namespace kvferry::testing_util
