// Copyright kvferry authors. Apache-2.0.
#include "policies/hip/hip.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/check.h"
#include "base/sparcas_q4.h"

namespace kvferry {

int64_t HipRepresentativeBlock(int64_t f, int64_t l, const HipMaskOptions& opt) {
  return HipRepBlock(f, l, static_cast<int32_t>(opt.rep), opt.seed);
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

float HipBlockScoreQ4(const AttnParams& p, const Q8Query& q, const KvPages& kv, int64_t begin,
                      int64_t end, int64_t block, int bk) {
  float best = -std::numeric_limits<float>::infinity();
  float row[256];
  uint32_t words[32];
  const int64_t t0 = begin + block * bk, t1 = std::min<int64_t>(t0 + bk, end);
  for (int64_t t = t0; t < t1; ++t) {
    LoadRowF32(kv, p, t, false, row);
    const float scale = SparcasQuantizeRow(row, p.head_dim, words);
    best = std::max(best, SparcasQ4MaxLogit(q, p.group, words, scale, p.scale));
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
  thread_local Q8Query q4;
  if (opt.bits == 4) QuantizeQueryHeads(q, p.group, p.head_dim, nullptr, p.head_dim, &q4);
  HipMaskBlocks(nb, k / bk, static_cast<int32_t>(opt.rep), opt.seed, opt.align, [&](int64_t block) {
    return opt.bits == 4 ? HipBlockScoreQ4(p, q4, kv, begin, end, block, static_cast<int>(bk))
                         : HipBlockScore(p, q, kv, begin, end, block, static_cast<int>(bk));
  }, out_blocks);
  return static_cast<int64_t>(out_blocks.size());
}

Result<HipParams> ParseHipParams(const std::map<std::string, double>& params) {
  using H = HipParams;
  static const ParamSpec<H> kTable[] = {
      {"bk", &H::bk, 1, 1024},
      {"r_m", &H::r_m, 1, 1 << 20},
      {"dense_layers", &H::dense_layers, 0, 4096},
      {"rep", &H::rep, 0, 3},
      {"bits", &H::bits, 4, 16, false, {4, 16}},
      {"align", &H::align, 0, 1},
      {"lag", &H::lag, 0, 1},
      {"dense_bits", &H::dense_bits, 4, 16, false, {4, 16}},
      {"over", &H::over, 1, 64},
      {"guard", &H::guard, 0, 1},
      {"guard_every", &H::guard_every, 1, 1 << 20},
      {"fresh", &H::fresh, 0, 1},
      {"drift", &H::drift, 0, 1},
  };
  return ParseParams<H>("hip", params, kTable);
}

SparcasParams HipDenseRanking() {
  SparcasParams sp;
  sp.d_b = 1 << 20;  // clamped to head_dim: every dimension
  sp.u = 1 << 30;    // never re-chosen
  sp.dense_layers = 0;
  sp.bits = 4;
  sp.smooth = 0;  // the raw 4-bit rows, as HiP's device selection ranks them
  return sp;
}

HipPolicy::HipPolicy(const HipParams& params, int max_sequences, int num_layers, int num_kv_heads,
                     bool device)
    : params_(params), device_(device), states_(max_sequences, num_layers, num_kv_heads) {
  if ((params_.dense_bits == 4 && params_.dense_layers > 0) || Fresh()) {
    dense_ = std::make_unique<SparcasPolicy>(HipDenseRanking(), max_sequences, num_layers, num_kv_heads);
  }
}

bool HipPolicy::Fresh() const { return params_.guard > 0.0 && params_.fresh != 0; }

bool HipPolicy::DenseQ4(int head_dim) const {
  return params_.dense_bits == 4 && dense_ != nullptr && HipBits(params_, head_dim) == 4;
}

HipSelectArgs HipPolicy::device_args(int head_dim) const {
  HipSelectArgs d;
  d.sparcas.db = head_dim;
  d.sparcas.u = 1 << 30;  // every dimension: never re-chosen
  // Dense layers at 4 bits: the SparCas machinery ranks every layer over the 4-bit rows, and the
  // mask starts at hip.dense_layers; else its exact path below dense_layers.
  const bool q4 = DenseQ4(head_dim);
  d.sparcas.dense_layers = q4 ? 0 : params_.dense_layers;
  d.hip.dense_layers = q4 ? params_.dense_layers : 0;
  d.sparcas.bits = 4;
  d.hip.bk = params_.bk;
  d.hip.r_m = params_.r_m;
  d.hip.rep = params_.rep;
  d.hip.align = params_.align;
  d.hip.lag = params_.lag;
  d.hip.drift = static_cast<float>(params_.drift);
  return d;
}

Status HipPolicy::Select(const SelectContext& ctx, std::vector<int32_t>& out) {
  KVF_CHECK_ARG(ctx.params.head_dim <= 256, "hip: head_dim ", ctx.params.head_dim, " > 256");
  KVF_ASSIGN_OR_RETURN(HeadState * st, states_.ForSelect("hip", ctx));
  const OffloadSplit s = SplitPositions(ctx.n, ctx.sink, ctx.window, ctx.budget);
  if (s.all) {
    SelectAll(ctx.n, out);
    return Status::Ok();
  }
  if (s.k_off <= 0) {
    FinishSelection(s, nullptr, 0, out);
    return Status::Ok();
  }
  if (ctx.layer < params_.dense_layers) ranked_.fetch_add(1, std::memory_order_relaxed);
  if (ctx.layer < params_.dense_layers && DenseQ4(ctx.params.head_dim)) return dense_->Select(ctx, out);
  if (ctx.layer < params_.dense_layers) {
    thread_local std::vector<int32_t> chosen;
    const int64_t got = ExactOffloadedTopK(ctx, s, chosen);
    FinishSelection(s, chosen.data(), got, out);
    return Status::Ok();
  }
  HipState& hs = st->st;
  HipPromote(hs);  // a mask requested at the last ranked step takes over
  // drift: the step's query codes against those of the query the mask was built from.
  const auto drift = static_cast<float>(params_.drift);
  thread_local Q8Query q8;
  if (drift > 0.0f) QuantizeQueryHeads(ctx.q, ctx.params.group, ctx.params.head_dim, nullptr, ctx.params.head_dim, &q8);
  const bool drifted = drift > 0.0f && hs.count > 0 &&
                       HipQueryDrifted(st->built_q.data(), q8.codes.data(), ctx.params.group, ctx.params.head_dim, drift);
  const HipAction action = HipStepAction(hs.count, hs.k_off, hs.n, hs.since_refresh, s.k_off, ctx.n,
                                         params_.r_m, params_.lag, drifted);
  thread_local std::vector<int32_t> blocks;
  blocks.clear();
  if (drift > 0.0f && action != HipAction::kKeep) st->built_q = q8.codes;
  if (action != HipAction::kKeep) {
    HipMaskOptions opt;
    opt.bk = params_.bk;
    opt.rep = static_cast<HipRepresentative>(params_.rep);
    opt.seed = HipSeed(ctx.n, ctx.layer, ctx.kv_head);
    opt.bits = HipBits(params_, ctx.params.head_dim);
    opt.align = params_.align != 0;
    // kBuild: in use from this step; kRequest (lag 1): from the next one (HipRecordStep).
    std::vector<int32_t>& dst = st->masks[action == HipAction::kBuild ? hs.cur : hs.cur ^ 1];
    const bool check = params_.guard > 0.0 && st->rebuilds % params_.guard_every == 0;
    ++st->rebuilds;
    dst.clear();
    if (!st->scan || check) {
      HipMask(ctx.params, ctx.q, ctx.kv, s.off_lo, s.off_hi, s.k_off * params_.over, opt, blocks);
      for (const int32_t b : blocks) {
        const int64_t t0 = s.off_lo + static_cast<int64_t>(b) * params_.bk;
        const int64_t t1 = std::min<int64_t>(t0 + params_.bk, s.off_hi);
        for (int64_t t = t0; t < t1; ++t) dst.push_back(static_cast<int32_t>(t));
      }
    }
    if (Fresh() && st->scan && !check) {
      blocks.assign(1, 0);  // ranked at every step below; the state counts a mask
    } else if (check || st->scan) {
      // One scan: its best first. fresh 1 needs only the check's top k_off; fresh 0 caches the
      // best over k_off as the head's mask, and its first k_off are the check's top k_off.
      const int64_t keep = Fresh() ? s.k_off : s.k_off * params_.over;
      thread_local std::vector<int32_t> ranked;
      ScanTopK(ctx, s, keep, ranked);
      if (check) {
        thread_local std::vector<int32_t> best;  // the ranking's best k_off by score
        best.assign(ranked.begin(), ranked.begin() + std::min<int64_t>(s.k_off, static_cast<int64_t>(ranked.size())));
        std::sort(best.begin(), best.end());
        st->scan = MaskShare(ctx, best, dst) < params_.guard;
      }
      if (st->scan) {
        if (!Fresh()) {
          dst = ranked;
          std::sort(dst.begin(), dst.end());
        }
        blocks.assign(1, 0);  // the state counts a mask (HipRecordStep's count)
      }
    }
  }
  HipRecordStep(hs, action, static_cast<int32_t>(blocks.size()), s.off_lo, s.off_hi, s.k_off, ctx.n,
                params_.r_m, ctx.layer, drifted);
  if (st->scan && Fresh()) {
    ranked_.fetch_add(1, std::memory_order_relaxed);
    return dense_->Select(ctx, out);
  }
  (action == HipAction::kKeep ? cached_ : ranked_).fetch_add(1, std::memory_order_relaxed);
  const std::vector<int32_t>& mask = st->masks[hs.cur];
  // The cached positions stay inside [sink, off_hi): off_hi only grows between refreshes.
  if (params_.over > 1 && static_cast<int64_t>(mask.size()) > s.k_off) {
    thread_local std::vector<int32_t> picked;
    RankCandidates(ctx, mask, s.k_off, picked);
    FinishSelection(s, picked.data(), static_cast<int64_t>(picked.size()), out);
    return Status::Ok();
  }
  FinishSelection(s, mask.data(), static_cast<int64_t>(mask.size()), out);
  return Status::Ok();
}

void HipPolicy::RankCandidates(const SelectContext& ctx, const std::vector<int32_t>& cand, int64_t k,
                               std::vector<int32_t>& picked, bool ascending) const {
  const AttnParams& p = ctx.params;
  thread_local std::vector<std::pair<float, int32_t>> scored;
  scored.clear();
  const bool q4 = HipBits(params_, p.head_dim) == 4;
  thread_local Q8Query q8;
  if (q4) QuantizeQueryHeads(ctx.q, p.group, p.head_dim, nullptr, p.head_dim, &q8);
  for (const int32_t t : cand) {
    const float sc = q4 ? HipBlockScoreQ4(p, q8, ctx.kv, t, t + 1, 0, 1)
                        : HipBlockScore(p, ctx.q, ctx.kv, t, t + 1, 0, 1);
    scored.emplace_back(sc == sc ? sc : -std::numeric_limits<float>::infinity(), t);
  }
  const auto keep = static_cast<std::ptrdiff_t>(std::min<int64_t>(k, static_cast<int64_t>(scored.size())));
  std::partial_sort(scored.begin(), scored.begin() + keep, scored.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  picked.clear();
  for (std::ptrdiff_t i = 0; i < keep; ++i) picked.push_back(scored[i].second);
  if (ascending) std::sort(picked.begin(), picked.end());
}

double HipPolicy::MaskShare(const SelectContext& ctx, const std::vector<int32_t>& best,
                           const std::vector<int32_t>& mask) const {
  const AttnParams& p = ctx.params;
  const bool q4 = HipBits(params_, p.head_dim) == 4;
  thread_local Q8Query q8;
  if (q4) QuantizeQueryHeads(ctx.q, p.group, p.head_dim, nullptr, p.head_dim, &q8);
  thread_local std::vector<float> score;
  score.clear();
  float top = -std::numeric_limits<float>::infinity();
  for (const int32_t t : best) {
    score.push_back(q4 ? HipBlockScoreQ4(p, q8, ctx.kv, t, t + 1, 0, 1)
                       : HipBlockScore(p, ctx.q, ctx.kv, t, t + 1, 0, 1));
    top = std::max(top, score.back());
  }
  double all = 0, kept = 0;
  for (size_t i = 0; i < best.size(); ++i) {
    const double w = std::isfinite(score[i]) ? std::exp(static_cast<double>(score[i] - top)) : 0.0;
    all += w;
    if (std::binary_search(mask.begin(), mask.end(), best[i])) kept += w;
  }
  return all > 0 ? kept / all : 1.0;
}

void HipPolicy::ScanTopK(const SelectContext& ctx, const OffloadSplit& s, int64_t k,
                         std::vector<int32_t>& picked) const {
  thread_local std::vector<int32_t> all;
  all.resize(static_cast<size_t>(s.n_off()));
  for (int64_t i = 0; i < s.n_off(); ++i) all[i] = static_cast<int32_t>(s.off_lo + i);
  RankCandidates(ctx, all, k, picked, /*ascending=*/false);
}

Result<std::unique_ptr<Policy>> MakeHipPolicy(const RuntimeConfig& config) {
  KVF_ASSIGN_OR_RETURN(HipParams params, ParseHipParams(config.policy.params));
  KVF_RETURN_IF_ERROR(CheckPolicyShape("hip", config));
  const int hd = config.model.head_dim;
  KVF_CHECK_ARG(hd <= 256, "hip: head_dim ", hd, " > 256");
  KVF_CHECK_ARG(HipBits(params, hd) == 16 || hd % 8 == 0, "hip parameter 'bits' = 4 needs a head_dim",
                " that is a multiple of 8, not ", hd);
  // The device mask when the scores are 4-bit and the nodes of the runtime's largest list fit its
  // CTA (the bound its launch checks: DecodeStepArgs::budget_cap / bk); else the host selects.
  const bool device = HipBits(params, hd) == 4 && params.over == 1 && params.guard == 0.0 &&
                      ItemListCap(config) / params.bk <= kHipMaxNodes;
  return std::unique_ptr<Policy>(new HipPolicy(params, config.capacity.max_sequences, config.model.num_layers,
                                               config.model.num_kv_heads, device));
}

}  // namespace kvferry
