// Copyright kvferry authors. Apache-2.0.
// The host implementation of a planned decode step (DecodeStepArgs): what the host-emulated
// device runs, stage by stage as the CUDA kernels do, so both backends execute the same plan.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "base/bank_map.h"
#include "base/hip_mask.h"
#include "base/kvpop_score.h"
#include "base/offload_split.h"
#include "base/psaw.h"
#include "base/sparcas_q4.h"
#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/reference.h"

namespace kvferry::cpu {
namespace {

struct ItemRows {
  const char* resident_k;
  size_t resident_v_offset;
  const KvPages kv;
};

}  // namespace

void DecodeStep(const DecodeStepArgs& a) {
  const AttnParams& p = a.params;
  const int hkv = a.num_kv_heads, d = p.head_dim, group = p.group;
  const int64_t hq = static_cast<int64_t>(hkv) * group;
  const size_t elem = DTypeSize(p.kv_dtype);
  const size_t row_bytes = static_cast<size_t>(d) * elem;
  const int64_t rows_per_slot = static_cast<int64_t>(a.sink) + a.window;

  auto item_rows = [&](int slot, int h) {
    const int64_t t = (static_cast<int64_t>(slot) * a.num_layers + a.layer) * hkv + h;
    return ItemRows{a.resident + static_cast<size_t>(t * 2 * rows_per_slot) * row_bytes,
                    static_cast<size_t>(rows_per_slot) * row_bytes,
                    KvPages{a.store.pages + t * a.store.max_pages, a.store.page_tokens}};
  };

  // 1 append (all items first, as the CUDA append kernel completes before attention starts).
  for (int32_t b = 0; b < a.batch; ++b) {
    const int slot = a.slots[b];
    const int64_t pos = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer];
    const int64_t n = pos + 1;
    ConvertSpan(a.q_f32 + b * hq * d, DType::kF32,
                static_cast<const char*>(a.q) + b * hq * d * DTypeSize(a.q_dtype), a.q_dtype,
                hq * d);
    for (int h = 0; h < hkv; ++h) {
      const ItemRows r = item_rows(slot, h);
      const int64_t src = (static_cast<int64_t>(b) * hkv + h) * d;
      const void* ks = static_cast<const char*>(a.k) + src * DTypeSize(a.k_dtype);
      const void* vs = static_cast<const char*>(a.v) + src * DTypeSize(a.v_dtype);
      if (!a.host_writes_store) {
        ConvertSpan(const_cast<void*>(PagedKRow(r.kv, pos, d, elem)), p.kv_dtype, ks, a.k_dtype, d);
        ConvertSpan(const_cast<void*>(PagedVRow(r.kv, pos, d, elem)), p.kv_dtype, vs, a.v_dtype, d);
      }
      const int64_t row = ResidentRowOf(pos, n, a.sink, a.window);
      if (row >= 0) {
        char* rk = const_cast<char*>(r.resident_k) + static_cast<size_t>(row) * row_bytes;
        ConvertSpan(rk, p.kv_dtype, ks, a.k_dtype, d);
        ConvertSpan(rk + r.resident_v_offset, p.kv_dtype, vs, a.v_dtype, d);
      }
    }
  }

  // 2 attend and 3 combine, item by item.
  thread_local std::vector<const void*> k_rows, v_rows;
  thread_local std::vector<float> o, lse;
  o.resize(static_cast<size_t>(group) * d);
  lse.resize(static_cast<size_t>(group));
  for (int32_t b = 0; b < a.batch; ++b) {
    const int slot = a.slots[b];
    const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
    for (int h = 0; h < hkv; ++h) {
      const int64_t item = static_cast<int64_t>(b) * hkv + h;
      const ItemRows r = item_rows(slot, h);
      int64_t count = 0;
      StepRange range;
      if (a.mode == StepRowMode::kList) {
        count = a.list_count[item];
      } else {
        range = SinksAndRecent(n, a.sink, StepBudget(a.budget_tokens, a.budget_fraction,
                                                     a.budget_cap, n));
        count = range.count;
      }
      k_rows.resize(static_cast<size_t>(count));
      v_rows.resize(static_cast<size_t>(count));
      for (int64_t j = 0; j < count; ++j) {
        const int64_t pos = a.mode == StepRowMode::kList
                                ? a.list[item * a.list_cap + j]
                                : (j < range.sinks ? j : range.recent_begin + (j - range.sinks));
        const int64_t row = ResidentRowOf(pos, n, a.sink, a.window);
        if (row >= 0) {
          k_rows[j] = r.resident_k + static_cast<size_t>(row) * row_bytes;
          v_rows[j] = r.resident_k + static_cast<size_t>(row) * row_bytes + r.resident_v_offset;
        } else {
          k_rows[j] = PagedKRow(r.kv, pos, d, elem);
          v_rows[j] = PagedVRow(r.kv, pos, d, elem);
        }
      }
      const float* q = a.q_f32 + b * hq * d + static_cast<int64_t>(h) * group * d;
      const RowAttnItem it{q, o.data(), lse.data(), k_rows.data(), v_rows.data(),
                           static_cast<int32_t>(count)};
      AttendRows(p, &it, 1);
      const int64_t row0 = b * hq + static_cast<int64_t>(h) * group;  // first query head's row
      if (a.o_cpu != nullptr) {
        MergeLseRef(o.data(), lse.data(), a.o_cpu + row0 * d, a.lse_cpu + row0, group, d);
      }
      ConvertSpan(static_cast<char*>(a.out) + row0 * d * DTypeSize(a.out_dtype), a.out_dtype,
                  o.data(), DType::kF32, static_cast<int64_t>(group) * d);
      if (a.lse != nullptr) {
        for (int g = 0; g < group; ++g) a.lse[row0 + g] = lse[g];
      }
    }
  }
}

void ExactTopKSelect(const AttnParams& p, const float* q, const KvPages& kv, int64_t n, int64_t k,
                     std::vector<float>& logits, std::vector<float>& weights, int32_t* out) {
  k = std::min(k, n);
  if (k <= 0) return;
  logits.resize(static_cast<size_t>(n) * p.group);
  weights.assign(static_cast<size_t>(n), 0.0f);
  ScorePaged(p, q, kv, n, logits.data());
  for (int g = 0; g < p.group; ++g) {
    SoftmaxAccumulate(logits.data() + static_cast<int64_t>(g) * n, n, 1.0f, weights.data());
  }
  TopK(weights.data(), n, k, out);
  std::sort(out, out + k);
}

namespace {

// Page bounds of one KV head's pages [p0, p1] over rows [pg * page, min(.., n)) of the store;
// row n - 1 from new_row (fp32, already rounded to the KV dtype) when set.
void RecomputeBounds(const AttnParams& p, const KvPages& kv, char* meta_t, int64_t p0, int64_t p1,
                     int64_t n, int page, const float* new_row) {
  const int d = p.head_dim;
  const size_t elem = DTypeSize(p.kv_dtype);
  thread_local std::vector<float> lo, hi, row;
  lo.resize(static_cast<size_t>(d));
  hi.resize(static_cast<size_t>(d));
  row.resize(static_cast<size_t>(d));
  for (int64_t pg = p0; pg <= p1; ++pg) {
    std::fill(lo.begin(), lo.end(), std::numeric_limits<float>::infinity());
    std::fill(hi.begin(), hi.end(), -std::numeric_limits<float>::infinity());
    const int64_t end = std::min<int64_t>((pg + 1) * page, n);
    for (int64_t pos = pg * page; pos < end; ++pos) {
      const float* x = row.data();
      if (new_row != nullptr && pos == n - 1) {
        x = new_row;
      } else {
        ConvertSpan(row.data(), DType::kF32, PagedKRow(kv, pos, d, elem), p.kv_dtype, d);
      }
      for (int i = 0; i < d; ++i) {
        lo[i] = std::min(lo[i], x[i]);
        hi[i] = std::max(hi[i], x[i]);
      }
    }
    char* dst = meta_t + static_cast<size_t>(pg) * 2 * d * elem;
    ConvertSpan(dst, p.kv_dtype, lo.data(), DType::kF32, d);
    ConvertSpan(dst + d * elem, p.kv_dtype, hi.data(), DType::kF32, d);
  }
}

// SelectScoring::kQuestPages for one item; returns the count written to out.
int64_t QuestSelect(const AttnParams& p, const float* q, const char* meta_t, int64_t n, int sink,
                    int window, int64_t budget, int page, int32_t* out) {
  const int d = p.head_dim;
  const size_t elem = DTypeSize(p.kv_dtype);
  const int64_t sinks = std::clamp<int64_t>(sink, 0, n);
  const int64_t off_lo = sinks, off_hi = std::max(sinks, n - std::max(window, 0));
  const int64_t k_off = budget - (sinks + (n - off_hi));
  int64_t c = 0;
  if (k_off >= off_hi - off_lo) {
    for (int64_t i = 0; i < n; ++i) out[c++] = static_cast<int32_t>(i);
    return c;
  }
  for (int64_t i = 0; i < sinks; ++i) out[c++] = static_cast<int32_t>(i);
  if (k_off > 0) {
    const int64_t p_lo = off_lo / page, p_hi = (off_hi - 1) / page + 1, np = p_hi - p_lo;
    thread_local std::vector<float> lo, hi, ub, score;
    thread_local std::vector<int32_t> best;
    lo.resize(static_cast<size_t>(d));
    hi.resize(static_cast<size_t>(d));
    ub.resize(static_cast<size_t>(p.group * np));
    for (int64_t i = 0; i < np; ++i) {
      const char* src = meta_t + static_cast<size_t>(p_lo + i) * 2 * d * elem;
      ConvertSpan(lo.data(), DType::kF32, src, p.kv_dtype, d);
      ConvertSpan(hi.data(), DType::kF32, src + d * elem, p.kv_dtype, d);
      for (int g = 0; g < p.group; ++g) {
        const float* qg = q + static_cast<int64_t>(g) * d;
        float s = 0.0f;
        for (int j = 0; j < d; ++j) s += std::max(qg[j] * lo[j], qg[j] * hi[j]);
        ub[g * np + i] = p.scale * s;
      }
    }
    score.assign(static_cast<size_t>(np), -std::numeric_limits<float>::infinity());
    for (int g = 0; g < p.group; ++g) {
      const float* u = ub.data() + g * np;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < np; ++i) mx = std::max(mx, u[i]);
      for (int64_t i = 0; i < np; ++i) score[i] = std::max(score[i], u[i] - mx);
    }
    // Enough pages to fill k_off even when the first and last are cut.
    const int64_t want = std::min<int64_t>(np, k_off / page + 3);
    best.resize(static_cast<size_t>(want));
    TopK(score.data(), np, want, best.data());  // by score, ties to the lower page
    thread_local std::vector<std::pair<int64_t, int64_t>> takes;  // (page, positions taken)
    takes.clear();
    int64_t left = k_off;
    for (int64_t i = 0; i < want && left > 0; ++i) {
      const int64_t pg = p_lo + best[i];
      const int64_t take = std::min(std::min((pg + 1) * page, off_hi) - std::max(pg * page, off_lo), left);
      takes.emplace_back(pg, take);
      left -= take;
    }
    std::sort(takes.begin(), takes.end());
    for (const auto& [pg, take] : takes) {
      const int64_t a = std::max(pg * page, off_lo);
      for (int64_t pos = a; pos < a + take; ++pos) out[c++] = static_cast<int32_t>(pos);
    }
  }
  for (int64_t i = off_hi; i < n; ++i) out[c++] = static_cast<int32_t>(i);
  return c;
}

// An item's split at this step (base/offload_split.h; QuestSplitOf on the GPU).
OffloadSplit ItemSplitOf(const DecodeStepArgs& a, int64_t n) {
  return SplitPositions(n, a.sink, a.window, StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n));
}
// The list's head: every position when the split takes all, else the sinks; returns the count.
int64_t WriteListHead(const OffloadSplit& sp, int64_t n, int32_t* out) {
  const int64_t count = sp.all ? n : sp.sink;
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(i);
  return count;
}

// A ranked list (kSparcas, kHip): the head, then, when the split offloads positions and takes
// some, rank(sp, c) appends its k_off picks at out[c] and returns the new count; then the window.
template <typename Rank>
int64_t WriteRankedList(const DecodeStepArgs& a, int64_t n, int32_t* out, const Rank& rank) {
  const OffloadSplit sp = ItemSplitOf(a, n);
  int64_t c = WriteListHead(sp, n, out);
  if (sp.all) return c;
  if (sp.k_off > 0) c = rank(sp, c);
  for (int64_t i = sp.off_hi; i < n; ++i) out[c++] = static_cast<int32_t>(i);
  return c;
}

// SparCas's compact rows of item t (kSparcas, and kHip's every-dimension rows) brought up to n
// positions: the dimensions chosen at the first ranked step and every sparcas.u ranked steps (a
// change re-gathers every row), then the rows stored since the last ranked step. With smoothing
// (4-bit layers), the channel scales are taken at the first ranked step (base/sparcas_q4.h).
struct CompactRows {
  char* base = nullptr;
  const int32_t* dims = nullptr;
  const float* scales = nullptr;  ///< smooth: [head_dim] (null: none)
  int d_b = 0;
  bool q4 = false;
  int words = 0;
  const uint32_t* Q4Row(int64_t j) const {
    return reinterpret_cast<const uint32_t*>(base + static_cast<size_t>(j) * (words + 1) * 4);
  }
  static float Q4Scale(const uint32_t* row, int words) {
    float scale;
    std::memcpy(&scale, row + words, sizeof(float));
    return scale;
  }
};

CompactRows UpdateCompactRows(const DecodeStepArgs& a, int64_t t, const float* q, const KvPages& kv,
                              int64_t n) {
  const AttnParams& p = a.params;
  const int d = p.head_dim;
  const size_t elem = DTypeSize(p.kv_dtype);
  SparcasState& st = a.sparcas.state[t];
  int32_t* dims = a.sparcas.dims + t * d;
  const int d_b = SparcasDimsOf(a.layer, a.sparcas.dense_layers, a.sparcas.db, d);
  const bool q4 = SparcasBitsOf(a.layer, a.sparcas.dense_layers, a.sparcas.bits) == 4;
  float* scales = a.sparcas.smooth != 0 && q4 && a.sparcas.scales != nullptr
                      ? a.sparcas.scales + t * d
                      : nullptr;
  thread_local std::vector<float> row, kept;
  row.resize(static_cast<size_t>(d));
  if (st.seen > n) st.seen = 0;
  if (scales != nullptr && st.d_b == 0) {  // the item's first ranked step
    SparcasChannelScales(
        n, d, [&](int64_t j, float* r) { ConvertSpan(r, DType::kF32, PagedKRow(kv, j, d, elem), p.kv_dtype, d); },
        row.data(), scales);
  }
  bool regather = false;
  if (st.d_b != d_b || st.since_refresh >= a.sparcas.u) {
    thread_local std::vector<float> imp;
    thread_local std::vector<int32_t> idx;
    imp.assign(static_cast<size_t>(d), 0.0f);
    for (int g = 0; g < p.group; ++g) {
      for (int i = 0; i < d; ++i) imp[i] += std::fabs(scales ? q[g * d + i] * scales[i] : q[g * d + i]);
    }
    idx.resize(static_cast<size_t>(d));
    for (int i = 0; i < d; ++i) idx[i] = i;
    const auto better = [&](int32_t x, int32_t y) {
      const float ix = imp[x] == imp[x] ? imp[x] : -1.0f;  // NaN ranks last
      const float iy = imp[y] == imp[y] ? imp[y] : -1.0f;
      return ix > iy || (ix == iy && x < y);
    };
    std::partial_sort(idx.begin(), idx.begin() + d_b, idx.end(), better);
    std::sort(idx.begin(), idx.begin() + d_b);
    regather = st.d_b != d_b || !std::equal(idx.begin(), idx.begin() + d_b, dims);
    std::copy_n(idx.begin(), d_b, dims);
    st.d_b = d_b;
    st.since_refresh = 0;
  }
  ++st.since_refresh;
  const int64_t slot = t / (static_cast<int64_t>(a.num_layers) * a.num_kv_heads);
  CompactRows r;
  r.base = a.meta + SparcasCompactOffset(slot, a.layer, static_cast<int32_t>(t % a.num_kv_heads),
                                         a.num_layers, a.num_kv_heads, a.meta_pages, d,
                                         a.sparcas.db, a.sparcas.dense_layers, a.sparcas.bits) *
                        elem;
  r.dims = dims;
  r.scales = scales;
  r.d_b = d_b;
  r.q4 = q4;
  r.words = SparcasQ4Words(d_b);
  kept.resize(static_cast<size_t>(d_b));
  for (int64_t pos = regather ? 0 : st.seen; pos < n; ++pos) {
    ConvertSpan(row.data(), DType::kF32, PagedKRow(kv, pos, d, elem), p.kv_dtype, d);
    if (r.q4) {  // d_b / 8 words then the f32 scale (base/sparcas_q4.h)
      auto* dst = reinterpret_cast<uint32_t*>(r.base + static_cast<size_t>(pos) * (r.words + 1) * 4);
      for (int i = 0; i < d_b; ++i) kept[i] = scales ? row[dims[i]] / scales[dims[i]] : row[dims[i]];
      const float scale = SparcasQuantizeRow(kept.data(), d_b, dst);
      std::memcpy(dst + r.words, &scale, sizeof(float));
    } else {
      char* dst = r.base + static_cast<size_t>(pos) * d_b * elem;
      for (int i = 0; i < d_b; ++i) ConvertSpan(dst + i * elem, p.kv_dtype, &row[dims[i]], DType::kF32, 1);
    }
  }
  st.seen = n;
  return r;
}

// SelectScoring::kSparcas for one item (see DecodeStepArgs); returns the count written to out.
int64_t SparcasSelect(const DecodeStepArgs& a, int64_t t, const float* q, const KvPages& kv,
                      int64_t n, int32_t* out) {
  return WriteRankedList(a, n, out, [&](const OffloadSplit& sp, int64_t c) {
    const AttnParams& p = a.params;
    const int d = p.head_dim;
    const int64_t off_lo = sp.off_lo, off_hi = sp.off_hi, k_off = sp.k_off;
    const CompactRows rows = UpdateCompactRows(a, t, q, kv, n);
    const int d_b = rows.d_b;
    const int32_t* dims = rows.dims;
    const size_t elem = DTypeSize(p.kv_dtype);
    // Partial logits of every position, the group's softmax sum, top k_off of the offloaded range.
    thread_local std::vector<float> qs, cf, logits, weights;
    thread_local std::vector<int32_t> chosen;
    qs.resize(static_cast<size_t>(p.group) * d_b);
    for (int g = 0; g < p.group; ++g) {
      for (int i = 0; i < d_b; ++i) {
        qs[g * d_b + i] = rows.scales ? q[g * d + dims[i]] * rows.scales[dims[i]] : q[g * d + dims[i]];
      }
    }
    cf.resize(static_cast<size_t>(d_b));
    logits.resize(static_cast<size_t>(p.group) * n);
    thread_local Q8Query q8;  // 4-bit rows: each head's int8 query (base/sparcas_q4.h)
    if (rows.q4) QuantizeQueryHeads(qs.data(), p.group, d_b, nullptr, d_b, &q8);
    for (int64_t j = 0; j < n; ++j) {
      if (rows.q4) {
        const uint32_t* w = rows.Q4Row(j);
        const float scale = CompactRows::Q4Scale(w, rows.words);
        for (int g = 0; g < p.group; ++g) logits[g * n + j] = SparcasQ4Logit(q8, g, w, scale, p.scale);
        continue;
      }
      ConvertSpan(cf.data(), DType::kF32, rows.base + static_cast<size_t>(j) * d_b * elem, p.kv_dtype, d_b);
      for (int g = 0; g < p.group; ++g) {
        float acc = 0.0f;
        for (int i = 0; i < d_b; ++i) acc += qs[g * d_b + i] * cf[i];
        logits[g * n + j] = p.scale * acc;
      }
    }
    weights.assign(static_cast<size_t>(n), 0.0f);
    for (int g = 0; g < p.group; ++g) SoftmaxAccumulate(logits.data() + g * n, n, 1.0f, weights.data());
    chosen.resize(static_cast<size_t>(k_off));
    TopK(weights.data() + off_lo, off_hi - off_lo, k_off, chosen.data());
    std::sort(chosen.begin(), chosen.end());
    for (int64_t i = 0; i < k_off; ++i) out[c++] = static_cast<int32_t>(off_lo + chosen[i]);
    return c;
  });
}

// SelectScoring::kHip for one item (see DecodeStepArgs and base/hip_mask.h); returns the count
// written to out.
int64_t HipSelect(const DecodeStepArgs& a, int64_t t, const float* q, const KvPages& kv, int64_t n,
                  int32_t* out) {
  if (a.layer < HipDenseOf(a)) return SparcasSelect(a, t, q, kv, n, out);
  return WriteRankedList(a, n, out, [&](const OffloadSplit& sp, int64_t c) {
    const AttnParams& p = a.params;
    const int d = p.head_dim;
    const int64_t off_lo = sp.off_lo, off_hi = sp.off_hi, k_off = sp.k_off;
    const CompactRows rows = UpdateCompactRows(a, t, q, kv, n);  // every dimension, 4 bits
    HipState& st = a.hip.state[t];
    const int64_t bk = std::max(a.hip.bk, 1);
    HipPromote(st);
    // HiP's drift: the step's query codes against those the mask was built from (this backend
    // keeps them in dimension order).
    thread_local Q8Query q8;
    const bool drift = a.hip.drift > 0.0f;
    int8_t* built_q = drift ? reinterpret_cast<int8_t*>(a.hip.query + t * HipQueryWords(p.group, d)) : nullptr;
    if (drift) QuantizeQueryHeads(q, p.group, d, nullptr, d, &q8);
    const bool drifted = drift && st.count > 0 && HipQueryDrifted(built_q, q8.codes.data(), p.group, d, a.hip.drift);
    const HipAction action = HipStepAction(st.count, st.k_off, st.n, st.since_refresh, k_off, n,
                                           a.hip.r_m, a.hip.lag, drifted);
    int32_t built = 0;  // blocks of the mask built at this step
    if (action != HipAction::kKeep) {
      // kRequest: CUDA builds it on a side stream from this step's query (DecodeSelectDeferred);
      // here it is built at once into the other buffer and takes over at the next ranked step.
      thread_local std::vector<int32_t> mask;
      if (!drift) QuantizeQueryHeads(q, p.group, d, nullptr, d, &q8);
      if (drift) std::copy(q8.codes.begin(), q8.codes.end(), built_q);
      const auto score_of = [&](int64_t block) {
        float best = -std::numeric_limits<float>::infinity();
        const int64_t t0 = off_lo + block * bk, t1 = std::min(t0 + bk, off_hi);
        for (int64_t j = t0; j < t1; ++j) {
          const uint32_t* w = rows.Q4Row(j);
          best = std::max(best, SparcasQ4MaxLogit(q8, p.group, w, CompactRows::Q4Scale(w, rows.words), p.scale));
        }
        return best;
      };
      mask.clear();
      if (k_off >= bk) {
        HipMaskBlocks((off_hi - off_lo + bk - 1) / bk, k_off / bk, a.hip.rep,
                      HipSeed(n, a.layer, static_cast<int32_t>(t % a.num_kv_heads)), a.hip.align != 0,
                      score_of, mask);
      }
      const int32_t buf = action == HipAction::kBuild ? st.cur : st.cur ^ 1;
      std::copy(mask.begin(), mask.end(), a.hip.blocks + (2 * t + buf) * a.hip.max_nodes);
      built = static_cast<int32_t>(mask.size());
    }
    HipRecordStep(st, action, built, off_lo, off_hi, k_off, n, a.hip.r_m, a.layer, drifted);
    const int32_t* blocks = a.hip.blocks + (2 * t + st.cur) * a.hip.max_nodes;
    for (int32_t j = 0; j < st.count; ++j) {
      const int64_t t0 = off_lo + blocks[j] * bk, t1 = std::min(t0 + bk, st.hi);
      for (int64_t i = t0; i < t1; ++i) out[c++] = static_cast<int32_t>(i);
    }
    return c;
  });
}

// SelectScoring::kKvpop for one item (see DecodeStepArgs): the newcomers scored, the slots and
// newcomers cut to the k best, as KvpopSelectKernel does (the host policy's one-by-one admission
// keeps the same set: the priorities are static); returns the count written to out.
int64_t KvpopSelect(const DecodeStepArgs& a, int64_t t, const KvPages& kv, int64_t n, int32_t* out) {
  const AttnParams& p = a.params;
  const int d = p.head_dim;
  const size_t elem = DTypeSize(p.kv_dtype);
  const OffloadSplit sp = ItemSplitOf(a, n);
  KvpopState& st = a.kvpop.state[t];
  if (n < st.next_u) st = KvpopState{};  // a new sequence in this slot
  int32_t* pos = a.kvpop.pos + t * a.kvpop.cap;
  float* prio = a.kvpop.prio + t * a.kvpop.cap;
  const int64_t k = std::max<int64_t>(sp.k_off, 0);
  const int64_t lo = std::max(st.next_u, sp.off_lo);
  const int64_t head = static_cast<int64_t>(a.layer) * a.num_kv_heads + t % a.num_kv_heads;
  const float* block = a.kvpop.scorer + head * KvpopScorerFloats(a.kvpop.hidden, 2 * d);
  thread_local std::vector<float> x;
  thread_local std::vector<std::pair<float, int32_t>> cand;  // (priority, position)
  x.resize(static_cast<size_t>(2 * d));
  cand.clear();
  for (int64_t i = 0; i < st.count; ++i) cand.emplace_back(prio[i], pos[i]);
  for (int64_t u = lo; u < sp.off_hi; ++u) {
    const void* kr = PagedKRow(kv, u, d, elem);
    const void* vr = PagedVRow(kv, u, d, elem);
    for (int j = 0; j < d; ++j) {
      x[j] = LoadAsF32(kr, p.kv_dtype, j);
      x[d + j] = LoadAsF32(vr, p.kv_dtype, j);
    }
    const float r = KvpopScore(block, a.kvpop.hidden, 2 * d, x.data());
    cand.emplace_back(KvpopPriorityOf(r, u, block[0]), static_cast<int32_t>(u));
  }
  if (static_cast<int64_t>(cand.size()) > k) {
    const auto above = [](const std::pair<float, int32_t>& l, const std::pair<float, int32_t>& r) {
      return KvpopRanksAbove(l.first, l.second, r.first, r.second);
    };
    std::nth_element(cand.begin(), cand.begin() + k, cand.end(), above);
    cand.resize(static_cast<size_t>(k));
    std::sort(cand.begin(), cand.end(), [](const auto& l, const auto& r) { return l.second < r.second; });
  }
  for (size_t i = 0; i < cand.size(); ++i) {
    prio[i] = cand[i].first;
    pos[i] = cand[i].second;
  }
  st.count = static_cast<int64_t>(cand.size());
  st.next_u = std::max(st.next_u, sp.off_hi);
  int64_t c = 0;
  for (int64_t i = 0; i < sp.sink; ++i) out[c++] = static_cast<int32_t>(i);
  for (int64_t i = 0; i < st.count; ++i) out[c++] = pos[i];
  for (int64_t i = sp.off_hi; i < n; ++i) out[c++] = static_cast<int32_t>(i);
  return c;
}

}  // namespace

void PageBounds(const PageBoundsArgs& a) {
  if (a.new_len <= a.pos0) return;
  const int64_t p0 = a.pos0 / a.meta_page, p1 = (a.new_len - 1) / a.meta_page;
  const size_t meta_bytes = static_cast<size_t>(a.meta_pages) * 2 * a.params.head_dim *
                            DTypeSize(a.params.kv_dtype);
  for (int h = 0; h < a.num_kv_heads; ++h) {
    const int64_t t = (static_cast<int64_t>(a.slot) * a.num_layers + a.layer) * a.num_kv_heads + h;
    RecomputeBounds(a.params, KvPages{a.store.pages + t * a.store.max_pages, a.store.page_tokens}, a.meta + t * meta_bytes,
                    p0, p1, a.new_len, a.meta_page, nullptr);
  }
}

void DecodeSelect(const DecodeStepArgs& a) {
  const AttnParams& p = a.params;
  const int hkv = a.num_kv_heads, d = p.head_dim, group = p.group;
  const int64_t hq = static_cast<int64_t>(hkv) * group;
  const size_t elem = DTypeSize(p.kv_dtype);
  thread_local std::vector<float> q, logits, weights;
  q.resize(static_cast<size_t>(group) * d);
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t slot = a.slots[b];
    const int64_t pos = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer];
    const int64_t n = pos + 1;
    const int64_t k = std::min(StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n), n);
    for (int h = 0; h < hkv; ++h) {
      const int64_t item = static_cast<int64_t>(b) * hkv + h;
      const int64_t t = (slot * a.num_layers + a.layer) * hkv + h;
      const KvPages kv{a.store.pages + t * a.store.max_pages, a.store.page_tokens};
      const int64_t src = item * d;
      ConvertSpan(const_cast<void*>(PagedKRow(kv, pos, d, elem)), p.kv_dtype,
                  static_cast<const char*>(a.k) + src * DTypeSize(a.k_dtype), a.k_dtype, d);
      ConvertSpan(q.data(), DType::kF32,
                  static_cast<const char*>(a.q) + (b * hq + h * group) * d * DTypeSize(a.q_dtype),
                  a.q_dtype, static_cast<int64_t>(group) * d);
      int32_t* out = a.list + item * a.list_cap;
      switch (a.scoring) {
        case SelectScoring::kExactTopK:
          ExactTopKSelect(p, q.data(), kv, n, k, logits, weights, out);
          a.list_count[item] = static_cast<int32_t>(k);
          break;
        case SelectScoring::kQuestPages: {
          const size_t meta_bytes = static_cast<size_t>(a.meta_pages) * 2 * d * elem;
          char* meta_t = a.meta + t * meta_bytes;
          // The new token's page first (its row was just written through above).
          RecomputeBounds(p, kv, meta_t, pos / a.meta_page, pos / a.meta_page, n, a.meta_page,
                          nullptr);
          a.list_count[item] = static_cast<int32_t>(
              QuestSelect(p, q.data(), meta_t, n, a.sink, a.window,
                          StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n),
                          a.meta_page, out));
          break;
        }
        case SelectScoring::kSparcas:
          a.list_count[item] = static_cast<int32_t>(SparcasSelect(a, t, q.data(), kv, n, out));
          break;
        case SelectScoring::kHip:
          a.list_count[item] = static_cast<int32_t>(HipSelect(a, t, q.data(), kv, n, out));
          break;
        case SelectScoring::kKvpop:
          a.list_count[item] = static_cast<int32_t>(KvpopSelect(a, t, kv, n, out));
          break;
        case SelectScoring::kNone:
          a.list_count[item] = 0;
          break;
      }
      if (a.hide_fraction > 0.0 && a.scoring != SelectScoring::kNone) {
        a.list_count[item] = static_cast<int32_t>(PsawFilterList(
            out, a.list_count[item], n, a.sink, k, PsawHiddenEndOf(a.hide_fraction, n)));
      }
    }
  }
}

void SplitStepList(const DecodeStepArgs& a, const SplitListArgs& s) {
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
    for (int32_t h = 0; h < a.num_kv_heads; ++h) {
      const int64_t item = static_cast<int64_t>(b) * a.num_kv_heads + h;
      const int32_t* list = a.list + item * a.list_cap;
      const int64_t count = a.list_count[item];
      int64_t misses = 0;
      for (int64_t j = 0; j < count; ++j) misses += ResidentRowOf(list[j], n, a.sink, a.window) < 0;
      const int64_t keep = misses - SplitCpuRows(misses, s.cpu_q10);  // misses the device reads
      int32_t* gpu = s.gpu_list + item * a.list_cap;
      int32_t* cpu = s.cpu_list + item * a.list_cap;
      int64_t n_gpu = 0, n_cpu = 0, seen = 0;
      for (int64_t j = 0; j < count; ++j) {
        const bool miss = ResidentRowOf(list[j], n, a.sink, a.window) < 0;
        if (miss && seen++ >= keep) {
          cpu[n_cpu++] = list[j];
        } else {
          gpu[n_gpu++] = list[j];
        }
      }
      s.gpu_count[item] = static_cast<int32_t>(n_gpu);
      s.cpu_count[item] = static_cast<int32_t>(n_cpu);
    }
  }
}

void PrefetchListRows(const DecodeStepArgs& a) {
  const size_t row_bytes = static_cast<size_t>(a.params.head_dim) * DTypeSize(a.params.kv_dtype);
  const uint32_t pt = static_cast<uint32_t>(a.store.page_tokens);
  const StepBankView& bank = a.bank;
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t slot = a.slots[b];
    const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
    for (int32_t h = 0; h < a.num_kv_heads; ++h) {
      const int64_t item = static_cast<int64_t>(b) * a.num_kv_heads + h;
      const int64_t t = (slot * a.num_layers + a.layer) * a.num_kv_heads + h;
      const int32_t* list = a.list + item * a.list_cap;
      char* stage = bank.stage + static_cast<size_t>(item * a.list_cap) * 2 * row_bytes;
      for (int64_t j = 0; j < a.list_count[item]; ++j) {
        const int32_t pos = list[j];
        if (ResidentRowOf(pos, n, a.sink, a.window) >= 0) continue;
        bool hit = false;
        if (bank.vmap != nullptr) {
          hit = bank.vmap[t * bank.max_positions + pos] != 0xffff;
        } else if (bank.hmap != nullptr) {
          // HashPageMap's probing (gpu/bank_map.cuh): packed (pos << 32 | slot), ~0 empty.
          const unsigned long long* table = bank.hmap + (t << bank.hash_log2);
          const uint32_t mask = (1u << bank.hash_log2) - 1;
          uint32_t i = HashPageMap::Bucket(pos, bank.hash_log2);
          for (uint32_t k = 0; k <= mask; ++k, i = (i + 1) & mask) {
            const unsigned long long e = table[i];
            if (e == ~0ull) break;
            if (static_cast<int32_t>(e >> 32) == pos) {
              hit = true;
              break;
            }
          }
        }
        if (hit) continue;
        const uint32_t p = static_cast<uint32_t>(pos) / pt, off = static_cast<uint32_t>(pos) % pt;
        const char* page = static_cast<const char*>(a.store.pages[t * a.store.max_pages + p]);
        std::memcpy(stage + static_cast<size_t>(j) * 2 * row_bytes, page + off * row_bytes, row_bytes);
        std::memcpy(stage + (static_cast<size_t>(j) * 2 + 1) * row_bytes, page + (pt + off) * row_bytes,
                    row_bytes);
      }
    }
  }
}

}  // namespace kvferry::cpu
