// Copyright kvferry authors. Apache-2.0.
#pragma once
// HiP's hierarchical mask (seed 003, notes/hip.md), the parts its three implementations share:
// policies/hip's host Select, the host backend's device-selection twin (cpu/decode_step.cpp) and
// the CUDA kernel (gpu/decode_select.cu, HipMaskKernel). The host two run HipMaskBlocks below;
// the kernel runs the same iteration with a block-wide radix select, and is tested equal to it.
//
// The mask over nb blocks for K' = kn nodes: the first nodes (HipFirstNodes: by default aligned
// runs of a power of two blocks, else the paper's kn even ones); each iteration splits every node of more than one block at m = floor((f + l) / 2) (a
// one-block node is one branch, unsplit), scores each branch by one representative block and
// keeps the kn best branches, by (score desc, first block asc; a NaN score ranks as -inf), until
// no node splits. The result is the kn nodes' first blocks, ascending.
//
// Scores at 4 bits (HiP's `bits` 4, the default): a token's key as SparCas's 4-bit row over every
// dimension (base/sparcas_q4.h, SparcasQuantizeRow) and each query head as its int8 codes
// (SparcasQuantizeQuery), the logit scale * SparcasQ4Dot; the block's score is the max over its
// tokens and the group's heads. Integer dots, so the host and the GPU agree to the bit.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "base/attn_types.h"
#include "policies/hip/args.h"

namespace kvferry {

/// Which token block represents a branch [f, l) of blocks when it is scored.
enum class HipRepresentative : int { kCentre = 0, kFirst = 1, kLast = 2, kRandom = 3 };

/// The most nodes (K' = k_off / bk) the device mask holds: its CTA keeps 2 K' branches in shared
/// memory (24 bytes a node). Past it HiP selects on the host.
constexpr int64_t kHipMaxNodes = 8192;

/// 32-bit words of an item's build query (HipStepArgs::query: the query of its latest mask build
/// or request). CUDA's packed int8 query: per head head_dim / 8 __dp4a pairs (int2), then each
/// head's step (float) and 8 * its code sum (int32); the host backend keeps the int8 codes in
/// dimension order (group * head_dim bytes) in the same room.
KVF_HOST_DEVICE inline int64_t HipQueryWords(int32_t group, int32_t head_dim) {
  return int64_t{group} * (head_dim / 8) * 2 + 2 * int64_t{group};
}

KVF_HOST_DEVICE inline uint64_t HipMix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// The kRandom representative's seed for an item's mask built at length n.
KVF_HOST_DEVICE inline uint64_t HipSeed(int64_t n, int32_t layer, int32_t kv_head) {
  return static_cast<uint64_t>(n) * 131 + static_cast<uint64_t>(layer) * 7 +
         static_cast<uint64_t>(kv_head);
}

/// The representative block of branch [f, l) (l > f).
KVF_HOST_DEVICE inline int64_t HipRepBlock(int64_t f, int64_t l, int32_t rep, uint64_t seed) {
  const int64_t len = l - f;
  switch (rep) {
    case static_cast<int32_t>(HipRepresentative::kFirst): return f;
    case static_cast<int32_t>(HipRepresentative::kLast): return l - 1;
    case static_cast<int32_t>(HipRepresentative::kRandom):
      return f + static_cast<int64_t>(HipMix(seed ^ HipMix(static_cast<uint64_t>(f) * 1000003u +
                                                           static_cast<uint64_t>(l))) %
                                      static_cast<uint64_t>(len));
    default: return f + (len - 1) / 2;  // kCentre
  }
}

/// Whether an item's cached mask must be rebuilt at a ranked step (n positions, k_off picks): none
/// yet, k_off shrank below the one it was built for (its blocks would overrun the list), n fell
/// (a new sequence), or r_m ranked steps passed. k_off that grew (a budget fraction of a growing
/// n) waits for the interval: the kept mask is one node short for at most r_m steps, where a
/// rebuild on the step K' moves rebuilt every layer at once (stop 26: 2.20 against 1.84 ms a
/// step at 128K b1).
/// \p drifted: the query moved away from the one the mask was built from (HipQueryDrifted; HiP's
/// `drift`): the mask is due before its interval.
KVF_HOST_DEVICE inline bool HipMaskStale(int64_t count, int64_t k_off_built, int64_t n_last,
                                         int32_t since_refresh, int64_t k_off, int64_t n,
                                         int32_t r_m, bool drifted = false) {
  return count == 0 || k_off < k_off_built || n < n_last || since_refresh >= r_m || drifted;
}

/// HiP's `drift` d in (0, 1] (0: off): a head's query has moved from the one the item's mask was
/// built from when the cosine of their int8 codes (SparcasQuantizeQuery of every dimension) is
/// below d: dot < 0 or dot^2 < d^2 |built|^2 |now|^2. Integer sums and one rounded product, so
/// the host and the GPU decide alike to the bit.
KVF_HOST_DEVICE inline bool HipDriftedHead(int64_t dot, int64_t built_sq, int64_t now_sq, float drift) {
  if (!(drift > 0.0f)) return false;
  const double d = static_cast<double>(drift);
  const double dd = static_cast<double>(dot);
  return dot < 0 || dd * dd < (d * d) * (static_cast<double>(built_sq) * static_cast<double>(now_sq));
}

/// The host's drift test over a group: whether any head of \p now moved from \p built (int8
/// codes, [group][d]) by HipDriftedHead.
inline bool HipQueryDrifted(const int8_t* built, const int8_t* now, int group, int d, float drift) {
  for (int g = 0; g < group; ++g) {
    int64_t dot = 0, b2 = 0, n2 = 0;
    for (int i = 0; i < d; ++i) {
      const int64_t x = built[g * d + i], y = now[g * d + i];
      dot += x * y;
      b2 += x * x;
      n2 += y * y;
    }
    if (HipDriftedHead(dot, b2, n2, drift)) return true;
  }
  return false;
}

/// kHip: the first layer its mask ranks (see HipStepArgs::dense_layers).
KVF_HOST_DEVICE inline int32_t HipDenseOf(const DecodeStepArgs& a) {
  const HipSelectArgs s = SelectorArgsOf<HipSelectArgs>(a);
  return s.sparcas.dense_layers > s.hip.dense_layers ? s.sparcas.dense_layers : s.hip.dense_layers;
}

/// What a ranked step does with an item's mask.
enum class HipAction : int32_t { kKeep = 0, kBuild = 1, kRequest = 2 };

/// HiP's `lag`. With 0 a stale mask (HipMaskStale) is rebuilt in the step that finds it: kBuild.
/// With 1 only a step without a usable mask builds one (none yet, k_off shrank, n fell); a due
/// rebuild (the interval passed, or the query drifted) is requested: kRequest. The requested mask is
/// built from this step's query beside the step (CUDA: on a side stream, off the step's critical
/// path) and used from the item's next ranked step on (HipPromote); this step keeps the old one.
KVF_HOST_DEVICE inline HipAction HipStepAction(int64_t count, int64_t k_off_built, int64_t n_last,
                                               int32_t since_refresh, int64_t k_off, int64_t n,
                                               int32_t r_m, int32_t lag, bool drifted = false) {
  if (!HipMaskStale(count, k_off_built, n_last, since_refresh, k_off, n, r_m, drifted)) return HipAction::kKeep;
  if (lag == 0 || count == 0 || k_off < k_off_built || n < n_last) return HipAction::kBuild;
  return HipAction::kRequest;
}

/// At an item's ranked step, before HipStepAction: a built request (HipState::pending 2) takes
/// over; a request never built (pending 1: its side launch did not run) is dropped, and the
/// interval asks again.
KVF_HOST_DEVICE inline void HipPromote(HipState& s) {
  if (s.pending == 2) {
    s.cur ^= 1;
    s.count = s.p_count;
    s.k_off = s.p_k_off;
    s.hi = s.p_hi;
    s.since_refresh = s.p_since;
  }
  s.pending = 0;
}

/// since_refresh right after a rebuild (the step then counts itself): 0 when the interval was
/// due or the query drifted; else (a first mask, or k_off shrank or n fell) layer % r_m, so that
/// the layers' later rebuilds spread over the r_m steps (each step rebuilds about 1 / r_m of the
/// layers instead of every layer at once every r_m steps: the same mean step time, a flat one).
KVF_HOST_DEVICE inline int32_t HipSinceAfterBuild(int64_t count, int64_t k_off_built, int64_t n_last,
                                                  int32_t since_refresh, int64_t k_off, int64_t n,
                                                  int32_t r_m, int32_t layer, bool drifted = false) {
  const bool interval = count != 0 && k_off >= k_off_built && n >= n_last && since_refresh >= r_m;
  return interval || drifted || r_m <= 1 ? 0 : layer % r_m;
}

/// The host's state update at a ranked step, after HipPromote and HipStepAction: a mask of
/// \p count blocks built (kBuild, kRequest) at length n over [off_lo, off_hi) for k_off picks is
/// put in use (kBuild: blocks buffer `cur`) or held as built for the next ranked step (kRequest:
/// buffer cur ^ 1, pending 2, its age counted from this step); then the step counts itself. The
/// host policy and the host backend's twin; HipMaskKernel and HipDeferredKernel do the same on
/// the device.
inline void HipRecordStep(HipState& st, HipAction action, int32_t count, int64_t off_lo,
                          int64_t off_hi, int64_t k_off, int64_t n, int32_t r_m, int32_t layer,
                          bool drifted = false) {
  if (action != HipAction::kKeep) {
    const int32_t since =
        HipSinceAfterBuild(st.count, st.k_off, st.n, st.since_refresh, k_off, n, r_m, layer, drifted);
    if (action == HipAction::kBuild) {
      st.since_refresh = since;
      st.count = count;
      st.k_off = k_off;
      st.hi = off_hi;
    } else {
      st.pending = 2;
      st.p_n = n;
      st.p_lo = off_lo;
      st.p_hi = off_hi;
      st.p_k_off = k_off;
      st.p_count = count;
      st.p_since = since + 1;
    }
  }
  ++st.since_refresh;
  st.n = n;
}

/// The first nodes of a mask over nb > kn blocks. Aligned (HiP's `align` 1, the default, as the
/// public code aligns them): nodes of L blocks, L the least power of two >= ceil(nb / kn), at
/// multiples of L (the last cut at nb), ceil(nb / L) <= kn of them; every later split point is
/// then a multiple of a power of two, so the tree stays put while n grows and a rebuilt mask
/// differs from the last one only where the scores do. Else the paper's kn nodes [j nb / kn,
/// (j + 1) nb / kn), whose bounds all move as nb grows.
KVF_HOST_DEVICE inline int64_t HipNodeLen(int64_t nb, int64_t kn) {
  const int64_t need = (nb + kn - 1) / kn;
  int64_t len = 1;
  while (len < need) len <<= 1;
  return len;
}
KVF_HOST_DEVICE inline int64_t HipFirstNodes(int64_t nb, int64_t kn, bool align) {
  if (!align) return kn;
  const int64_t len = HipNodeLen(nb, kn);
  return (nb + len - 1) / len;
}
/// Node j of the first HipFirstNodes: blocks [*f, *l).
KVF_HOST_DEVICE inline void HipFirstNode(int64_t j, int64_t nb, int64_t kn, bool align, int64_t* f,
                                         int64_t* l) {
  if (align) {
    const int64_t len = HipNodeLen(nb, kn);
    *f = j * len;
    *l = (j + 1) * len < nb ? (j + 1) * len : nb;
  } else {
    *f = j * nb / kn;
    *l = (j + 1) * nb / kn;
  }
}

/// The mask (above) over nb blocks for kn nodes, each branch scored by score_of(representative
/// block); the chosen first blocks ascending into out (every block when nb <= kn; none when kn
/// < 1). Host.
template <typename ScoreOf>
void HipMaskBlocks(int64_t nb, int64_t kn, int32_t rep, uint64_t seed, bool align,
                   ScoreOf&& score_of, std::vector<int32_t>& out) {
  out.clear();
  if (nb <= 0 || kn < 1) return;
  if (nb <= kn) {
    for (int64_t b = 0; b < nb; ++b) out.push_back(static_cast<int32_t>(b));
    return;
  }
  struct Branch {
    int64_t f, l;
    float score;
  };
  thread_local std::vector<Branch> nodes, branches;
  nodes.clear();
  for (int64_t j = 0; j < HipFirstNodes(nb, kn, align); ++j) {
    Branch b{0, 0, 0.0f};
    HipFirstNode(j, nb, kn, align, &b.f, &b.l);
    nodes.push_back(b);
  }
  const auto better = [](const Branch& a, const Branch& b) {
    return a.score > b.score || (a.score == b.score && a.f < b.f);
  };
  for (;;) {
    bool split = false;
    branches.clear();
    for (const Branch& nd : nodes) {
      if (nd.l - nd.f > 1) {
        const int64_t m = (nd.f + nd.l) / 2;
        branches.push_back({nd.f, m, 0.0f});
        branches.push_back({m, nd.l, 0.0f});
        split = true;
      } else {
        branches.push_back(nd);
      }
    }
    if (!split) break;  // every node one block: the mask (the kernel scores no more either)
    for (Branch& b : branches) {
      const float s = score_of(HipRepBlock(b.f, b.l, rep, seed));
      b.score = s == s ? s : -std::numeric_limits<float>::infinity();
    }
    const auto keep = static_cast<std::ptrdiff_t>(std::min<int64_t>(kn, static_cast<int64_t>(branches.size())));
    std::partial_sort(branches.begin(), branches.begin() + keep, branches.end(), better);
    nodes.assign(branches.begin(), branches.begin() + keep);
  }
  for (const Branch& nd : nodes) out.push_back(static_cast<int32_t>(nd.f));
  std::sort(out.begin(), out.end());
}

}  // namespace kvferry
