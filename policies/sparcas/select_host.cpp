// Copyright kvferry authors. Apache-2.0.
// The host twin of SparCas's device selection (policies/sparcas/select.cu): what the host backend
// runs, and the reference the CUDA kernels are tested against. HiP's twin reuses the compact rows.
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
#include "base/sparcas_q4.h"
#include "policies/sparcas/select.h"

namespace kvferry::cpu {

CompactRows UpdateCompactRows(const DecodeStepArgs& a, int64_t t, const float* q, const KvPages& kv,
                              int64_t n) {
  const AttnParams& p = a.params;
  const int d = p.head_dim;
  const size_t elem = DTypeSize(p.kv_dtype);
  const SparcasStepArgs sa = SparcasArgsOf(a);
  SparcasState& st = sa.state[t];
  int32_t* dims = sa.dims + t * d;
  const int d_b = SparcasDimsOf(a.layer, sa.dense_layers, sa.db, d);
  const bool q4 = SparcasBitsOf(a.layer, sa.dense_layers, sa.bits) == 4;
  float* scales = sa.smooth != 0 && q4 && sa.scales != nullptr
                      ? sa.scales + t * d
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
  if (st.d_b != d_b || st.since_refresh >= sa.u) {
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
                                         sa.db, sa.dense_layers, sa.bits) *
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

namespace {

// SparCas's list for one item (see DecodeStepArgs); returns the count written to out.
int64_t SparcasList(const DecodeStepArgs& a, int64_t t, const float* q, const KvPages& kv, int64_t n,
                    int32_t* out) {
  return CompactRankedList(a, t, q, kv, n, out, [&](const OffloadSplit& sp, int64_t c, const CompactRows& rows) {
    const AttnParams& p = a.params;
    const int d = p.head_dim, d_b = rows.d_b;
    const int64_t off_lo = sp.off_lo, off_hi = sp.off_hi, k_off = sp.k_off;
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

}  // namespace

int64_t SparcasSelect(const DecodeStepArgs& a, const SelectItem& it) {
  return SparcasList(a, it.t, it.q, it.kv, it.n, it.out);
}

}  // namespace kvferry::cpu

namespace kvferry::detail {

Status SparcasSelectHost(const void* args) { return cpu::ForEachSelectItem(args, cpu::SparcasSelect); }

}  // namespace kvferry::detail
