// Copyright kvferry authors. Apache-2.0.
// The host twin of KVpop's device selection (policies/kvpop/select.cu): what the host backend
// runs, and the reference the CUDA kernel is tested against.
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
#include "policies/kvpop/score.h"
#include "policies/kvpop/select.h"

namespace kvferry::cpu {
namespace {

// KVpop's list for one item (see DecodeStepArgs): the newcomers scored, the slots and
// newcomers cut to the k best, as KvpopSelectKernel does (the host policy's one-by-one admission
// keeps the same set: the priorities are static); returns the count written to out.
int64_t KvpopSelect(const DecodeStepArgs& a, const SelectItem& it) {
  const int64_t t = it.t, n = it.n;
  const KvPages& kv = it.kv;
  int32_t* out = it.out;
  const AttnParams& p = a.params;
  const int d = p.head_dim;
  const size_t elem = DTypeSize(p.kv_dtype);
  const OffloadSplit sp = ItemSplitOf(a, n);
  const KvpopStepArgs ka = KvpopArgsOf(a);
  KvpopState& st = ka.state[t];
  if (n < st.next_u) st = KvpopState{};  // a new sequence in this slot
  int32_t* pos = ka.pos + t * ka.cap;
  float* prio = ka.prio + t * ka.cap;
  const int64_t k = std::max<int64_t>(sp.k_off, 0);
  const int64_t lo = std::max(st.next_u, sp.off_lo);
  const int64_t head = static_cast<int64_t>(a.layer) * a.num_kv_heads + t % a.num_kv_heads;
  const float* block = ka.scorer + head * KvpopScorerFloats(ka.hidden, 2 * d);
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
    const float r = KvpopScore(block, ka.hidden, 2 * d, x.data());
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
}  // namespace kvferry::cpu

namespace kvferry::detail {

Status KvpopSelectHost(const void* args) { return cpu::ForEachSelectItem(args, cpu::KvpopSelect); }

}  // namespace kvferry::detail
