// Copyright kvferry authors. Apache-2.0.
#include "policies/hip.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/check.h"

namespace kvferry {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct Branch {
  int64_t f, l;  // blocks [f, l)
  float score;
};

}  // namespace

int64_t HipRepresentativeBlock(int64_t f, int64_t l, const HipMaskOptions& opt) {
  const int64_t len = l - f;
  switch (opt.rep) {
    case HipRepresentative::kFirst: return f;
    case HipRepresentative::kLast: return l - 1;
    case HipRepresentative::kRandom:
      return f + static_cast<int64_t>(Mix(opt.seed ^ Mix(static_cast<uint64_t>(f) * 1000003u +
                                                         static_cast<uint64_t>(l))) %
                                      static_cast<uint64_t>(len));
    case HipRepresentative::kCentre:
    default: return f + (len - 1) / 2;
  }
}

float HipBlockScore(const AttnParams& p, const float* q, const KvPages& kv, int64_t begin,
                    int64_t end, int64_t block, int bk) {
  float best = -std::numeric_limits<float>::infinity();
  float row[256];
  const int64_t t0 = begin + block * bk, t1 = std::min<int64_t>(t0 + bk, end);
  for (int64_t t = t0; t < t1; ++t) {
    LoadRowF32(kv, p, t, false, row);
    for (int g = 0; g < p.group; ++g) {
      const float* qg = q + g * p.head_dim;
      float s = 0.0f;
      for (int d = 0; d < p.head_dim; ++d) s += qg[d] * row[d];
      best = std::max(best, p.scale * s);
    }
  }
  return best;
}

int64_t HipMask(const AttnParams& p, const float* q, const KvPages& kv, int64_t begin,
                int64_t end, int64_t k, const HipMaskOptions& opt, std::vector<int32_t>& out_blocks) {
  out_blocks.clear();
  const int64_t bk = std::max(opt.bk, 1);
  const int64_t len = end - begin;
  if (len <= 0 || k < bk) return 0;
  const int64_t nb = (len + bk - 1) / bk;
  const int64_t kn = k / bk;  // K'
  if (nb <= kn) {
    for (int64_t b = 0; b < nb; ++b) out_blocks.push_back(static_cast<int32_t>(b));
    return nb;
  }
  std::vector<Branch> nodes, branches;
  nodes.reserve(static_cast<size_t>(kn));
  for (int64_t j = 0; j < kn; ++j) nodes.push_back({j * nb / kn, (j + 1) * nb / kn, 0.0f});
  const auto score_of = [&](int64_t f, int64_t l) {
    return HipBlockScore(p, q, kv, begin, end, HipRepresentativeBlock(f, l, opt), static_cast<int>(bk));
  };
  const auto better = [](const Branch& a, const Branch& b) {
    const float sa = a.score == a.score ? a.score : -std::numeric_limits<float>::infinity();
    const float sb = b.score == b.score ? b.score : -std::numeric_limits<float>::infinity();
    return sa > sb || (sa == sb && a.f < b.f);
  };
  for (;;) {
    bool split = false;
    branches.clear();
    for (const Branch& nd : nodes) {
      if (nd.l - nd.f > 1) {
        const int64_t m = (nd.f + nd.l) / 2;
        branches.push_back({nd.f, m, score_of(nd.f, m)});
        branches.push_back({m, nd.l, score_of(m, nd.l)});
        split = true;
      } else {
        branches.push_back({nd.f, nd.l, score_of(nd.f, nd.l)});
      }
    }
    if (!split) break;
    std::partial_sort(branches.begin(), branches.begin() + kn, branches.end(), better);
    nodes.assign(branches.begin(), branches.begin() + kn);
  }
  for (const Branch& nd : nodes) out_blocks.push_back(static_cast<int32_t>(nd.f));
  std::sort(out_blocks.begin(), out_blocks.end());
  return static_cast<int64_t>(out_blocks.size());
}

Result<HipParams> ParseHipParams(const std::map<std::string, double>& params) {
  HipParams hp;
  for (const auto& [key, value] : params) {
    if (key == "bk") {
      KVF_ASSIGN_OR_RETURN(int64_t v, IntParam("hip", key, value, 1, 1024));
      hp.bk = static_cast<int>(v);
    } else if (key == "r_m") {
      KVF_ASSIGN_OR_RETURN(int64_t v, IntParam("hip", key, value, 1, 1 << 20));
      hp.r_m = static_cast<int>(v);
    } else if (key == "dense_layers") {
      KVF_ASSIGN_OR_RETURN(int64_t v, IntParam("hip", key, value, 0, 4096));
      hp.dense_layers = static_cast<int>(v);
    } else if (key == "rep") {
      KVF_ASSIGN_OR_RETURN(int64_t v, IntParam("hip", key, value, 0, 3));
      hp.rep = static_cast<int>(v);
    } else {
      return InvalidArgument(detail::StrCat("unknown hip parameter '", key,
                                            "' (known: bk, r_m, dense_layers, rep)"));
    }
  }
  return hp;
}

HipPolicy::HipPolicy(const HipParams& params, int max_sequences, int num_layers, int num_kv_heads)
    : params_(params) {
  states_.Init(max_sequences, num_layers, num_kv_heads);
}

Status HipPolicy::Select(const SelectContext& ctx, std::vector<int32_t>& out) {
  KVF_CHECK_ARG(ctx.n >= 1 && ctx.q != nullptr && ctx.params.group >= 1,
                "hip select needs n >= 1 and a query");
  KVF_CHECK_ARG(ctx.params.head_dim <= 256, "hip: head_dim ", ctx.params.head_dim, " > 256");
  KVF_ASSIGN_OR_RETURN(HeadState * st, states_.Get("hip", ctx.slot, ctx.layer, ctx.kv_head, true));
  const OffloadSplit s = SplitPositions(ctx.n, ctx.sink, ctx.window, ctx.budget);
  if (s.all) {
    SelectAll(ctx.n, out);
    return Status::Ok();
  }
  if (s.k_off <= 0) {
    FinishSelection(s, nullptr, 0, out);
    return Status::Ok();
  }
  if (ctx.layer < params_.dense_layers) {
    thread_local std::vector<int32_t> chosen;
    const int64_t got = ExactOffloadedTopK(ctx, s, chosen);
    FinishSelection(s, chosen.data(), got, out);
    return Status::Ok();
  }
  const bool stale = st->mask.empty() || st->k_off != s.k_off || ctx.n < st->n ||
                     st->since_refresh >= params_.r_m;
  if (stale) {
    HipMaskOptions opt;
    opt.bk = params_.bk;
    opt.rep = static_cast<HipRepresentative>(params_.rep);
    opt.seed = static_cast<uint64_t>(ctx.n) * 131 + static_cast<uint64_t>(ctx.layer) * 7 +
               static_cast<uint64_t>(ctx.kv_head);
    thread_local std::vector<int32_t> blocks;
    HipMask(ctx.params, ctx.q, ctx.kv, s.off_lo, s.off_hi, s.k_off, opt, blocks);
    st->mask.clear();
    for (const int32_t b : blocks) {
      const int64_t t0 = s.off_lo + static_cast<int64_t>(b) * params_.bk;
      const int64_t t1 = std::min<int64_t>(t0 + params_.bk, s.off_hi);
      for (int64_t t = t0; t < t1; ++t) st->mask.push_back(static_cast<int32_t>(t));
    }
    st->k_off = s.k_off;
    st->since_refresh = 0;
  }
  ++st->since_refresh;
  st->n = ctx.n;
  // The cached positions stay inside [sink, off_hi): off_hi only grows between refreshes.
  FinishSelection(s, st->mask.data(), static_cast<int64_t>(st->mask.size()), out);
  return Status::Ok();
}

Result<std::unique_ptr<Policy>> MakeHipPolicy(const RuntimeConfig& config) {
  KVF_ASSIGN_OR_RETURN(HipParams params, ParseHipParams(config.policy.params));
  KVF_RETURN_IF_ERROR(CheckPolicyShape("hip", config));
  KVF_CHECK_ARG(config.model.head_dim <= 256, "hip: head_dim ", config.model.head_dim, " > 256");
  return std::unique_ptr<Policy>(new HipPolicy(params, config.capacity.max_sequences,
                                               config.model.num_layers,
                                               config.model.num_kv_heads));
}

}  // namespace kvferry
