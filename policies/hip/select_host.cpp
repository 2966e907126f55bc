// Copyright kvferry authors. Apache-2.0.
// The host twin of HiP's device selection (policies/hip/select.cu): what the host backend runs,
// and the reference the CUDA kernels are tested against.
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
#include "policies/hip/mask.h"
#include "base/sparcas_q4.h"
#include "policies/hip/select.h"
#include "policies/sparcas/select.h"

namespace kvferry::cpu {
namespace {

// HiP's list for one item (see DecodeStepArgs and policies/hip/mask.h); returns the count
// written to out.
int64_t HipList(const DecodeStepArgs& a, int64_t t, const float* q, const KvPages& kv, int64_t n,
                int32_t* out) {
  // Every dimension, 4 bits.
  return CompactRankedList(a, t, q, kv, n, out, [&](const OffloadSplit& sp, int64_t c, const CompactRows& rows) {
    const AttnParams& p = a.params;
    const int d = p.head_dim;
    const int64_t off_lo = sp.off_lo, off_hi = sp.off_hi, k_off = sp.k_off;
    const HipStepArgs ha = HipArgsOf(a);
    HipState& st = ha.state[t];
    const int64_t bk = std::max(ha.bk, 1);
    HipPromote(st);
    // HiP's drift: the step's query codes against those the mask was built from (this backend
    // keeps them in dimension order).
    thread_local Q8Query q8;
    const bool drift = ha.drift > 0.0f;
    int8_t* built_q = drift ? reinterpret_cast<int8_t*>(ha.query + t * HipQueryWords(p.group, d)) : nullptr;
    if (drift) QuantizeQueryHeads(q, p.group, d, nullptr, d, &q8);
    const bool drifted = drift && st.count > 0 && HipQueryDrifted(built_q, q8.codes.data(), p.group, d, ha.drift);
    const HipAction action = HipStepAction(st.count, st.k_off, st.n, st.since_refresh, k_off, n,
                                           ha.r_m, ha.lag, drifted);
    int32_t built = 0;  // blocks of the mask built at this step
    if (action != HipAction::kKeep) {
      // kRequest: CUDA builds it on a side stream from this step's query (HipDeferredCuda);
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
        HipMaskBlocks((off_hi - off_lo + bk - 1) / bk, k_off / bk, ha.rep,
                      HipSeed(n, a.layer, static_cast<int32_t>(t % a.num_kv_heads)), ha.align != 0,
                      score_of, mask);
      }
      const int32_t buf = action == HipAction::kBuild ? st.cur : st.cur ^ 1;
      std::copy(mask.begin(), mask.end(), ha.blocks + (2 * t + buf) * ha.max_nodes);
      built = static_cast<int32_t>(mask.size());
    }
    HipRecordStep(st, action, built, off_lo, off_hi, k_off, n, ha.r_m, a.layer, drifted);
    const int32_t* blocks = ha.blocks + (2 * t + st.cur) * ha.max_nodes;
    for (int32_t j = 0; j < st.count; ++j) {
      const int64_t t0 = off_lo + blocks[j] * bk, t1 = std::min(t0 + bk, st.hi);
      for (int64_t i = t0; i < t1; ++i) out[c++] = static_cast<int32_t>(i);
    }
    return c;
  });
}

int64_t HipSelect(const DecodeStepArgs& a, const SelectItem& it) {
  if (a.layer < HipDenseOf(a)) return SparcasSelect(a, it);
  return HipList(a, it.t, it.q, it.kv, it.n, it.out);
}

}  // namespace
}  // namespace kvferry::cpu

namespace kvferry::detail {

Status HipSelectHost(const void* args) { return cpu::ForEachSelectItem(args, cpu::HipSelect); }

}  // namespace kvferry::detail
