// Copyright kvferry authors. Apache-2.0.
// The host twin of Quest's device selection and page bounds (policies/quest/select.cu): what the
// host backend runs, and the reference the CUDA kernels are tested against.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "cpu/select_items.h"
#include "policies/quest/select.h"

namespace kvferry::cpu {
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

// Quest's list for one item; returns the count written to out.
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

}  // namespace
}  // namespace kvferry::cpu

namespace kvferry::detail {

Status QuestSelectHost(const void* args) {
  return cpu::ForEachSelectItem(args, [](const DecodeStepArgs& a, const cpu::SelectItem& it) -> int64_t {
    const size_t meta_bytes =
        static_cast<size_t>(a.meta_pages) * 2 * a.params.head_dim * DTypeSize(a.params.kv_dtype);
    char* meta_t = a.meta + it.t * meta_bytes;
    // The new token's page first (its row was just written through).
    cpu::RecomputeBounds(a.params, it.kv, meta_t, it.pos / a.meta_page, it.pos / a.meta_page, it.n,
                         a.meta_page, nullptr);
    return cpu::QuestSelect(a.params, it.q, meta_t, it.n, a.sink, a.window,
                            StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, it.n), a.meta_page,
                            it.out);
  });
}

Status QuestPageBoundsHost(const void* args) {
  const PageBoundsArgs& a = *static_cast<const PageBoundsArgs*>(args);
  if (a.new_len <= a.pos0) return Status::Ok();
  const int64_t p0 = a.pos0 / a.meta_page, p1 = (a.new_len - 1) / a.meta_page;
  const size_t meta_bytes = static_cast<size_t>(a.meta_pages) * 2 * a.params.head_dim *
                            DTypeSize(a.params.kv_dtype);
  for (int h = 0; h < a.num_kv_heads; ++h) {
    const int64_t t = (static_cast<int64_t>(a.slot) * a.num_layers + a.layer) * a.num_kv_heads + h;
    cpu::RecomputeBounds(a.params, KvPages{a.store.pages + t * a.store.max_pages, a.store.page_tokens},
                         a.meta + t * meta_bytes, p0, p1, a.new_len, a.meta_page, nullptr);
  }
  return Status::Ok();
}

}  // namespace kvferry::detail
