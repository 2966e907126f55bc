// Copyright kvferry authors. Apache-2.0.
#include "policies/sparcas/sparcas.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/check.h"
#include "base/sparcas_q4.h"

namespace kvferry {

void SparcasChooseDims(const float* q, int group, int head_dim, int d_b, int32_t* out_dims) {
  d_b = std::clamp(d_b, 1, head_dim);
  thread_local std::vector<float> imp;
  thread_local std::vector<int32_t> idx;
  imp.assign(static_cast<size_t>(head_dim), 0.0f);
  for (int g = 0; g < group; ++g) {
    for (int d = 0; d < head_dim; ++d) imp[d] += std::fabs(q[g * head_dim + d]);
  }
  idx.resize(static_cast<size_t>(head_dim));
  std::iota(idx.begin(), idx.end(), 0);
  const auto better = [&](int32_t a, int32_t b) {
    const float ia = imp[a] == imp[a] ? imp[a] : -1.0f;  // NaN ranks last
    const float ib = imp[b] == imp[b] ? imp[b] : -1.0f;
    return ia > ib || (ia == ib && a < b);
  };
  std::partial_sort(idx.begin(), idx.begin() + d_b, idx.end(), better);
  std::copy_n(idx.begin(), d_b, out_dims);
  std::sort(out_dims, out_dims + d_b);
}

void SparcasGatherCompact(const float* key, const int32_t* dims, int d_b, float* compact) {
  for (int i = 0; i < d_b; ++i) compact[i] = key[dims[i]];
}

void SparcasApproxScores(const float* q, int group, int head_dim, const int32_t* dims, int d_b,
                         const float* compact, int64_t n, float scale, float* out, int64_t ld) {
  float qd[256 * 16];  // group * d_b <= 16 * 256 (cpu::kMaxSimdGroup heads, head_dim <= 256)
  const bool small = static_cast<int64_t>(group) * d_b <= 256 * 16;
  thread_local std::vector<float> big;
  float* qs = qd;
  if (!small) {
    big.resize(static_cast<size_t>(group) * d_b);
    qs = big.data();
  }
  for (int g = 0; g < group; ++g) {
    for (int i = 0; i < d_b; ++i) qs[g * d_b + i] = q[g * head_dim + dims[i]];
  }
  for (int g = 0; g < group; ++g) {
    const float* qg = qs + g * d_b;
    float* o = out + g * ld;
    for (int64_t j = 0; j < n; ++j) {
      const float* c = compact + j * d_b;
      float s = 0.0f;
      for (int i = 0; i < d_b; ++i) s += qg[i] * c[i];
      o[j] = scale * s;
    }
  }
}

void SparcasApproxScoresQ4(const float* q, int group, int head_dim, const int32_t* dims, int d_b,
                           const uint32_t* words, const float* row_scale, int64_t n, float scale,
                           float* out, int64_t ld) {
  thread_local Q8Query q8;
  QuantizeQueryHeads(q, group, head_dim, dims, d_b, &q8);
  const int w = SparcasQ4Words(d_b);
  for (int g = 0; g < group; ++g) {
    for (int64_t j = 0; j < n; ++j) out[g * ld + j] = SparcasQ4Logit(q8, g, words + j * w, row_scale[j], scale);
  }
}

Result<SparcasParams> ParseSparcasParams(const std::map<std::string, double>& params) {
  static const ParamSpec<SparcasParams> kTable[] = {
      {"d_b", &SparcasParams::d_b, 1, 256},
      {"u", &SparcasParams::u, 1, 1 << 20},
      {"dense_layers", &SparcasParams::dense_layers, 0, 4096},
      {"bits", &SparcasParams::bits, 4, 16, false, {4, 16}},
      {"smooth", &SparcasParams::smooth, 0, 1},
  };
  return ParseParams<SparcasParams>("sparcas", params, kTable);
}

int SparcasDb(const SparcasParams& params, int head_dim) {
  int d_b = params.d_b;
  if (d_b <= 0) {
    d_b = SparcasBits(params, head_dim) == 4 ? (head_dim / 2 + 7) / 8 * 8 : (16 * head_dim + 127) / 128;
  }
  return std::clamp(d_b, 1, head_dim);
}

SparcasPolicy::SparcasPolicy(const SparcasParams& params, int max_sequences, int num_layers,
                             int num_kv_heads)
    : params_(params), states_(max_sequences, num_layers, num_kv_heads) {}

Status SparcasPolicy::Select(const SelectContext& ctx, std::vector<int32_t>& out) {
  KVF_ASSIGN_OR_RETURN(HeadState * st, states_.ForSelect("sparcas", ctx));
  const AttnParams& p = ctx.params;
  const int hd = p.head_dim;
  const int64_t n = ctx.n;
  const OffloadSplit s = SplitPositions(n, ctx.sink, ctx.window, ctx.budget);
  if (s.all || s.k_off <= 0) {
    // Nothing to rank; the compact keys catch up at the next ranked step.
    if (s.all) {
      SelectAll(n, out);
    } else {
      FinishSelection(s, nullptr, 0, out);
    }
    return Status::Ok();
  }
  const int d_b = SparcasDimsOf(ctx.layer, params_.dense_layers, SparcasDb(params_, hd), hd);
  const int bits = SparcasBitsOf(ctx.layer, params_.dense_layers, SparcasBits(params_, hd));
  if (st->seen > n) st->seen = 0;
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(hd));
  // Smoothing (4-bit layers): the channel scales of the rows held at the first ranked step; the
  // query is scaled by them from then on (and the kept key dimensions divided by them).
  const bool smooth = params_.smooth != 0 && bits == 4;
  const float* q = ctx.q;
  thread_local std::vector<float> q_smooth;
  if (smooth) {
    if (st->scales.empty()) {
      st->scales.resize(static_cast<size_t>(hd));
      SparcasChannelScales(
          n, hd, [&](int64_t j, float* r) { LoadRowF32(ctx.kv, p, j, false, r); }, row.data(),
          st->scales.data());
    }
    q_smooth.resize(static_cast<size_t>(p.group) * hd);
    SparcasScaleQuery(ctx.q, p.group, hd, st->scales.data(), q_smooth.data());
    q = q_smooth.data();
  }
  // Stage 1 (query only): dimensions, every u steps; a change re-gathers every compact row.
  bool regather = false;
  if (st->d_b != d_b || st->bits != bits || st->dims.empty() || st->since_refresh >= params_.u) {
    std::vector<int32_t> dims(static_cast<size_t>(d_b));
    SparcasChooseDims(q, p.group, hd, d_b, dims.data());
    regather = st->d_b != d_b || st->bits != bits || dims != st->dims;
    st->dims = std::move(dims);
    st->d_b = d_b;
    st->bits = bits;
    st->since_refresh = 0;
  }
  ++st->since_refresh;
  const int64_t from = regather ? 0 : st->seen;
  const int words = SparcasQ4Words(d_b);
  if (bits == 4) {
    if (static_cast<int64_t>(st->q4_scale.size()) < n) {
      const size_t rows = static_cast<size_t>(std::max<int64_t>(n, 2 * st->q4_scale.size()));
      st->q4.resize(rows * words);
      st->q4_scale.resize(rows);
    }
  } else if (static_cast<int64_t>(st->compact.size()) < n * d_b) {
    st->compact.resize(static_cast<size_t>(std::max<int64_t>(n * d_b, 2 * st->compact.size())));
  }
  thread_local std::vector<float> kept;
  kept.resize(static_cast<size_t>(d_b));
  for (int64_t pos = from; pos < n; ++pos) {
    LoadRowF32(ctx.kv, p, pos, false, row.data());
    if (bits == 4) {
      SparcasGatherCompact(row.data(), st->dims.data(), d_b, kept.data());
      if (smooth) {
        for (int i = 0; i < d_b; ++i) kept[i] /= st->scales[st->dims[i]];
      }
      st->q4_scale[pos] = SparcasQuantizeRow(kept.data(), d_b, st->q4.data() + pos * words);
    } else {
      SparcasGatherCompact(row.data(), st->dims.data(), d_b, st->compact.data() + pos * d_b);
    }
  }
  st->seen = n;
  // Stage 2: partial scores of every position, group softmax sum, top-k of the offloaded range.
  thread_local std::vector<float> logits, weights;
  thread_local std::vector<int32_t> chosen;
  logits.resize(static_cast<size_t>(p.group) * n);
  weights.resize(static_cast<size_t>(n));
  if (bits == 4) {
    SparcasApproxScoresQ4(q, p.group, hd, st->dims.data(), d_b, st->q4.data(),
                          st->q4_scale.data(), n, p.scale, logits.data(), n);
  } else {
    SparcasApproxScores(ctx.q, p.group, hd, st->dims.data(), d_b, st->compact.data(), n, p.scale,
                        logits.data(), n);
  }
  GroupSoftmaxSum(logits.data(), p.group, n, n, weights.data());
  chosen.resize(static_cast<size_t>(s.k_off));
  const int64_t got = TopKAscendingIndices(weights.data() + s.off_lo, s.n_off(), s.k_off,
                                           static_cast<int32_t>(s.off_lo), chosen.data());
  FinishSelection(s, chosen.data(), got, out);
  return Status::Ok();
}

Result<std::unique_ptr<Policy>> MakeSparcasPolicy(const RuntimeConfig& config) {
  KVF_ASSIGN_OR_RETURN(SparcasParams params, ParseSparcasParams(config.policy.params));
  KVF_RETURN_IF_ERROR(CheckPolicyShape("sparcas", config));
  KVF_CHECK_ARG(params.d_b <= config.model.head_dim, "sparcas parameter 'd_b' = ", params.d_b,
                " exceeds head_dim ", config.model.head_dim);
  if (SparcasBits(params, config.model.head_dim) == 4) {
    const int d_b = SparcasDb(params, config.model.head_dim);
    KVF_CHECK_ARG(d_b % 8 == 0, "sparcas parameter 'd_b' = ", d_b,
                  " at 'bits' 4 must be a multiple of 8 (head_dim ", config.model.head_dim, ")");
  }
  return std::unique_ptr<Policy>(new SparcasPolicy(params, config.capacity.max_sequences,
                                                   config.model.num_layers,
                                                   config.model.num_kv_heads));
}

}  // namespace kvferry
