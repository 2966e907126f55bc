// Copyright kvferry authors. Apache-2.0.
// LFPS on the CPU. Decisions on the paper's open questions (docs/lfps.md says more):
//  - Slash alignment: the slash table is stored by distance d = t - i, so a step's update lands on
//    the diagonal and the next query reads key i at its own distance t' - i: the table is shifted by
//    one before selection (the paper's Phi_sla[i-1] form), for free, and the decay is one global
//    scale factor. The offsets {-1, 0, 1, 2} are applied to positions as printed.
//  - k: k = budget - resident tokens; C2 = top-k of C1 by exact score. The paper's C2 = C1 when
//    |C1| <= k left most of the budget unused on real heads (SmolLM2: LFPS@512 attended ~264
//    tokens). Now (docs/lfps.md, issue 12) C1 is widened before the exact scoring by two sources of
//    evidence so that the selection fills the budget: the scan ("scan" channels, every step while it
//    pays off) adds the ceil(scan_factor k) best positions by an approximate q.k over an int8
//    channel-major shadow of K; the fill ("fill") tops C1 up to ceil(fill k) with the best table
//    entries below the thresholds. rank=0 fill=0 scan=0 is the paper, bit for bit
//    (tests/lfps_equivalence_test.cpp). When the tables give no candidate at all (cold start, or a
//    state the decay alone can never leave, since tau / mean is scale-free) the step scores every
//    offloaded key (exact top-k), which also re-seeds the tables; "fallback" = 0 turns this off.
//  - GQA: one pair of tables per KV head (4x less memory at Llama-3's ratio; the group's candidate
//    rows are read once). Ranking by the group's summed softmax weight over C1 (rank=1: each head's
//    softmax normalised over C1 plus the resident sinks and local tokens, whose exact logits are
//    cheap, so that a head whose mass sits on the sink does not outvote the others); the table update
//    uses p = the group's mean softmax over C2, so sum p = 1 and sum Phi -> 0.5 / (1 - r) still
//    holds. Bypass only when every head of the group is sink-dominated (min rho > eps): one
//    retrieval head in a group needs the offloaded tokens.
//  - Bypass output: the Policy interface returns positions, so a bypassed head attends its resident
//    set (sinks + window) only; the paper's V-bar alone ignores the sink that by definition holds
//    most of the mass. Tables stay frozen on bypassed steps.
//  - sigma: sigma_hat^2 = Var_i(scale q.k_i) / |q|^2 over the offloaded keys for the last prefill
//    query (averaged over the group), so |q|^2 sigma_hat^2 estimates the logit variance at decode
//    and w_glob = n_glob exp(scale q.K_bar + |q|^2 sigma_hat^2 / 2) is the log-normal mean.
//  - Sink: w_sink sums all resident sink tokens; w_loc sums the last `local` (6) positions, the new
//    token included. p (and the tables) cover offloaded positions only, so sinks and the window do
//    not bias them (the paper's footnote).
//  - Kurtosis as printed (no factor n), over the n_off offloaded entries, from running power sums
//    (exact resync at every renormalisation), so thresholds cost O(1). The candidate scan reads only
//    the table blocks whose upper bound (kept per cpu::kFilterBlock entries) exceeds tau.
#include "policies/lfps/lfps.h"
#include "policies/select_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include "base/check.h"
#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/kernels.h"
#include "cpu/reference.h"

namespace kvferry {
namespace {

constexpr double kRenormBelow = 1e-6;  // renormalise stored tables when the global scale gets here
constexpr int kMaxQueriesPerScore = 16;  // cpu::kMaxSimdGroup

// Thread-local scratch: Select allocates only while these grow to the largest context seen.
struct Scratch {
  std::vector<int32_t> hits, c1, c2_idx, c2, fill, merged;
  std::vector<uint64_t> c0_bits;
  std::vector<uint32_t> keys, bin_keys;
  std::vector<float> logits, weights, probs, fill_score, chan_imp;
  std::vector<int32_t> scan_acc, scan_w, scan_idx, scan_max;
  std::vector<uint32_t> scan_key, scan_sample;
  std::vector<int32_t> chans, hist;
  std::vector<double> log_glob;
};
Scratch& GetScratch() {
  thread_local Scratch s;
  return s;
}

// Room for n elements; only ever grows (resize down and up again would value-initialise the gap
// on every step).
template <typename T>
T* Room(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// Upper bound of every stored entry per cpu::kFilterBlock entries, exact (max of the non-NaN
// entries, -inf if none).
void RebuildBounds(const std::vector<float>& u, std::vector<float>& bound) {
  constexpr int64_t kB = cpu::kFilterBlock;
  const int64_t n = static_cast<int64_t>(u.size());
  bound.assign(static_cast<size_t>((n + kB - 1) / kB), -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; ++i) {
    float& b = bound[i / kB];
    if (u[i] > b) b = u[i];
  }
}

// pw[k] = sum_i u_i^k, k = 1..4, in one pass (products, not pow).
void PowerSums(const std::vector<float>& u, double* pw) {
  double s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0;
  for (const float f : u) {
    const double x = f, x2 = x * x;
    s1 += x;
    s2 += x2;
    s3 += x2 * x;
    s4 += x2 * x2;
  }
  pw[1] = s1;
  pw[2] = s2;
  pw[3] = s3;
  pw[4] = s4;
}

constexpr int kMaxShadowDim = 512;  // head_dim bound of the scan's shadow (runtime: <= 256)
constexpr int64_t kShadowTile = 64;  // rows quantised per transposition tile
// A prompt's shadow (PrimeShadow) is made in up to kShadowRanges ranges of rows in parallel.
constexpr int kShadowRanges = 4;
constexpr int64_t kShadowRangeMin = 4096;

// fn(i) for i in [0, count): inline for one range, else as TBB tasks in the calling thread's arena
// (the runtime's pool, when Select runs in a pool task: no extra threads). Isolated, so that a
// thread waiting here takes no outer task (another head's Select would reuse its thread-local
// Scratch); the tasks use only the caller's buffers.
template <typename F>
void ForRanges(int count, const F& fn) {
  if (count <= 1) {
    fn(0);
    return;
  }
  tbb::this_task_arena::isolate([&] { tbb::parallel_for(0, count, [&](int i) { fn(i); }); });
}

// fn(b, e, i) over rows [begin, end) in `ranges` tile-aligned ranges (ForRanges: the runtime's
// pool when a prefill's priming runs in its task).
template <typename F>
void ForShadowRanges(int64_t begin, int64_t end, int ranges, const F& fn) {
  auto bound = [&](int i) {
    if (i >= ranges) return end;
    return std::max(begin, begin + ((end - begin) * i / ranges) / kShadowTile * kShadowTile);
  };
  ForRanges(ranges, [&](int i) { fn(bound(i), bound(i + 1), i); });
}
int ShadowRangeCount(int64_t rows) {
  return static_cast<int>(std::clamp<int64_t>(rows / kShadowRangeMin, 1, kShadowRanges));
}

// One K row as fp32 (the dtype switch outside the loop, so the bf16 case vectorises).
void LoadRowF32(const void* src, DType dtype, int hd, float* dst) {
  if (dtype == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int c = 0; c < hd; ++c) dst[c] = cpu::Bf16ToF32(s[c]);
  } else if (dtype == DType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(hd) * sizeof(float));
  } else {
    for (int c = 0; c < hd; ++c) dst[c] = cpu::LoadAsF32(src, dtype, c);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void RowAbsMax(const float* x, int hd, float* mx) {
  for (int c = 0; c < hd; ++c) mx[c] = std::max(mx[c], std::fabs(x[c]));  // NaN keeps mx
}

// out[c] = round(clamp(x[c] * mul[c], -127, 127)) (NaN -> 0, ties to even as lrint), seen raised
// to |x[c]|.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void QuantizeRow(const float* x, const float* mul, int hd, int8_t* out, float* seen) {
  for (int c = 0; c < hd; ++c) {
    seen[c] = std::max(seen[c], std::fabs(x[c]));
    float v = x[c] * mul[c];
    v = v == v ? v : 0.0f;
    v = std::min(std::max(v, -127.0f), 127.0f);
    out[c] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(v)));
  }
}

}  // namespace

struct LfpsPolicy::HeadState {
  std::vector<float> ver;  ///< stored vertical table by position; true value = scale * ver[i]
  std::vector<float> sla;  ///< stored slash table by distance t - i; true value = scale * sla[d]
  /// Per cpu::kFilterBlock entries of ver / sla: >= every stored entry of the block. Updates only
  /// raise them, the candidate scan tightens the blocks it reads, Resync rebuilds them exactly.
  std::vector<float> ver_bound, sla_bound;
  double scale = 1.0;      ///< r^(steps since last renormalisation)
  double ver_pow[5] = {0, 0, 0, 0, 0};  ///< sum of ver^k, k = 1..4 (stored units)
  double sla_pow[5] = {0, 0, 0, 0, 0};
  std::vector<float> k_bar, v_bar;  ///< mean offloaded K and V at prefill
  double sigma2_hat = 0.0;
  bool primed = false;
  /// The scan's int8 channel-major shadow of K: k8[c * k8_cap + i] = round(127 K[i][c] /
  /// k8_scale[c]) clamped, for rows [0, k8_n). The scales are the channels' max |K| over every row
  /// stored when the shadow was made or last re-primed (PrimeShadow, at each OnPrefill); rows added
  /// by decode steps are quantised with them (clamped), one row per step.
  std::unique_ptr<int8_t[]> k8;
  int64_t k8_cap = 0, k8_n = 0;
  int scan_period = 1, since_scan = 0;  ///< the scan runs every scan_period steps (adaptive)
  std::vector<float> k8_scale;
  std::vector<float> k8_seen;  ///< max |K| per channel over rows [0, k8_n) (raw, before the fix-up)

  /// Brings the shadow up to n rows (quantising only the rows it lacks); makes it from rows [0, n)
  /// if there is none. Returns the rows quantised.
  int64_t SyncShadow(const AttnParams& p, const KvPages& kv, int64_t n, int64_t max_tokens) {
    if (k8 == nullptr) return PrimeShadow(p, kv, n, max_tokens);
    if (n > k8_cap) GrowShadow(n);
    const int64_t from = k8_n;
    QuantizeShadowRows(p, kv, k8_n, n);
    return n - from;
  }

  /// The shadow of rows [0, n) with scales from all of them: the first call sizes it for max_tokens
  /// rows (virtual memory until written); later calls quantise only the new rows unless they raise a
  /// channel's max, which requantises every row. Returns the rows quantised.
  int64_t PrimeShadow(const AttnParams& p, const KvPages& kv, int64_t n, int64_t max_tokens) {
    const int64_t hd = p.head_dim;
    std::vector<float> mx(static_cast<size_t>(hd), 0.0f);
    if (k8 == nullptr) {
      k8_cap = std::max(max_tokens, n);
      k8.reset(new int8_t[static_cast<size_t>(hd * k8_cap)]);
      k8_n = 0;
    } else {
      if (n > k8_cap) GrowShadow(n);
      mx = k8_seen;
    }
    // Both passes over the rows split into ranges (a 32K prompt: 8 MB of K per head, twice), their
    // per-channel maxima merged: max is exact in any order, so the shadow is the serial one.
    const int64_t first = std::min(k8_n, n);
    int ranges = ShadowRangeCount(n - first);
    std::vector<float> part(static_cast<size_t>(ranges * hd), 0.0f);
    ForShadowRanges(first, n, ranges, [&](int64_t b, int64_t e, int i) {
      ShadowChannelMax(p, kv, b, e, part.data() + i * hd);
    });
    for (int i = 0; i < ranges; ++i) {
      for (int64_t c = 0; c < hd; ++c) mx[c] = std::max(mx[c], part[i * hd + c]);
    }
    for (float& x : mx) x = x > 0.0f && std::isfinite(x) ? x : 1.0f;
    if (mx != k8_scale) {
      k8_scale = mx;
      k8_n = 0;
    }
    if (k8_n == 0) k8_seen.assign(static_cast<size_t>(hd), 0.0f);
    const int64_t from = k8_n;
    ranges = ShadowRangeCount(n - from);
    part.assign(static_cast<size_t>(ranges * hd), 0.0f);
    ForShadowRanges(from, n, ranges, [&](int64_t b, int64_t e, int i) {
      QuantizeShadowRange(p, kv, b, e, part.data() + i * hd);
    });
    for (int i = 0; i < ranges; ++i) {
      for (int64_t c = 0; c < hd; ++c) k8_seen[c] = std::max(k8_seen[c], part[i * hd + c]);
    }
    k8_n = n;
    return n - from;
  }

  void GrowShadow(int64_t n) {
    const int64_t hd = static_cast<int64_t>(k8_scale.size());
    const int64_t cap = std::max(n, 2 * k8_cap);
    std::unique_ptr<int8_t[]> grown(new int8_t[static_cast<size_t>(hd * cap)]);
    for (int64_t c = 0; c < hd; ++c) std::copy_n(k8.get() + c * k8_cap, k8_n, grown.get() + c * cap);
    k8 = std::move(grown);
    k8_cap = cap;
  }

  // mx[c] = max(mx[c], |K[i][c]|) over rows [begin, end).
  static void ShadowChannelMax(const AttnParams& p, const KvPages& kv, int64_t begin, int64_t end,
                               float* mx) {
    const size_t elem = DTypeSize(p.kv_dtype);
    float row[kMaxShadowDim];
    for (int64_t i = begin; i < end; ++i) {
      LoadRowF32(PagedKRow(kv, i, p.head_dim, elem), p.kv_dtype, p.head_dim, row);
      RowAbsMax(row, p.head_dim, mx);
    }
  }

  // Quantises rows [begin, end) (begin == k8_n) into the channel rows, kShadowTile rows at a time
  // through a row-major tile, and raises k8_seen.
  void QuantizeShadowRows(const AttnParams& p, const KvPages& kv, int64_t begin, int64_t end) {
    QuantizeShadowRange(p, kv, begin, end, k8_seen.data());
    k8_n = end;
  }
  // Rows [begin, end) into the channel rows, raising seen[c] (max |K| per channel). Disjoint ranges
  // may run at once (begin a multiple of kShadowTile, except the first).
  void QuantizeShadowRange(const AttnParams& p, const KvPages& kv, int64_t begin, int64_t end,
                           float* seen) {
    const int hd = p.head_dim;
    const size_t elem = DTypeSize(p.kv_dtype);
    float mul[kMaxShadowDim], row[kMaxShadowDim];
    for (int c = 0; c < hd; ++c) mul[c] = 127.0f / k8_scale[c];
    int8_t tile[kShadowTile * kMaxShadowDim];
    for (int64_t i0 = begin; i0 < end; i0 += kShadowTile) {
      const int64_t cnt = std::min<int64_t>(kShadowTile, end - i0);
      for (int64_t r = 0; r < cnt; ++r) {
        LoadRowF32(PagedKRow(kv, i0 + r, hd, elem), p.kv_dtype, hd, row);
        QuantizeRow(row, mul, hd, tile + r * hd, seen);
      }
      for (int c = 0; c < hd; ++c) {
        int8_t* dst = k8.get() + static_cast<int64_t>(c) * k8_cap + i0;
        for (int64_t r = 0; r < cnt; ++r) dst[r] = tile[r * hd + c];
      }
    }
  }

  void Reserve(int64_t max_tokens) {
    if (static_cast<int64_t>(ver.capacity()) < max_tokens) {
      ver.reserve(static_cast<size_t>(max_tokens));
      sla.reserve(static_cast<size_t>(max_tokens));
      const int64_t blocks = (max_tokens + cpu::kFilterBlock - 1) / cpu::kFilterBlock;
      ver_bound.reserve(static_cast<size_t>(blocks));
      sla_bound.reserve(static_cast<size_t>(blocks));
    }
  }
  static void ExtendTable(std::vector<float>& u, std::vector<float>& bound, int64_t n) {
    const int64_t old = static_cast<int64_t>(u.size());
    if (old >= n) return;
    u.resize(static_cast<size_t>(n), 0.0f);
    // The new zeros join the old last block (when partial) and fill new blocks.
    if (old % cpu::kFilterBlock != 0) {
      float& b = bound[old / cpu::kFilterBlock];
      b = std::max(b, 0.0f);
    }
    bound.resize(static_cast<size_t>((n + cpu::kFilterBlock - 1) / cpu::kFilterBlock), 0.0f);
  }
  void Extend(int64_t n) {  // new positions / distances start at 0
    ExtendTable(ver, ver_bound, n);
    ExtendTable(sla, sla_bound, n);
  }
  void Resync() {
    PowerSums(ver, ver_pow);
    PowerSums(sla, sla_pow);
    RebuildBounds(ver, ver_bound);
    RebuildBounds(sla, sla_bound);
  }
  void Renormalise() {
    for (float& x : ver) x = static_cast<float>(x * scale);
    for (float& x : sla) x = static_cast<float>(x * scale);
    scale = 1.0;
    Resync();
  }
  static void Add(std::vector<float>& u, double* pw, std::vector<float>& bound, int64_t i,
                  double delta) {
    const double old = u[i];
    const double now = old + delta;
    u[i] = static_cast<float>(now);
    float& b = bound[i / cpu::kFilterBlock];
    if (u[i] > b) b = u[i];
    const double stored = u[i];
    double o = old, s = stored;
    for (int k = 1; k <= 4; ++k) {
      pw[k] += s - o;
      o *= old;
      s *= stored;
    }
  }
};

namespace {

// mean / kurtosis threshold (stored units, so the global scale cancels) over count entries.
struct Threshold {
  bool ok = false;
  float tau = 0.0f;   // C0: u > tau
  float mean = 0.0f;  // expansion filter: u > mean
};

Threshold ComputeThreshold(const double* pw, int64_t count, double a) {
  Threshold t;
  if (count <= 0) return t;
  const double n = static_cast<double>(count);
  const double m = pw[1] / n;
  const double m2 = pw[2] - n * m * m;
  const double m4 = pw[4] - 4.0 * m * pw[3] + 6.0 * m * m * pw[2] - 3.0 * n * m * m * m * m;
  if (!(m2 > 0.0) || !(m4 > 0.0)) return t;
  const double kurt = m4 / (m2 * m2);
  t.ok = std::isfinite(kurt) && kurt > 0.0;
  t.tau = static_cast<float>(a * m / kurt);
  t.mean = static_cast<float>(m);
  return t;
}

void AppendRange(std::vector<int32_t>& out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) out.push_back(static_cast<int32_t>(i));
}

// Unsigned key with the order of the float: NaN as -inf (it ranks last), -0 as +0 (they are equal
// as floats, so they must tie).
inline uint32_t OrderedKey(float f) {
  f = f != f ? -std::numeric_limits<float>::infinity() : f + 0.0f;
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

// The top k of w[0, m) in TopK's order (value descending, lower index first on ties; NaN ranks
// last), written as ascending indices; 0 < k < m; returns k. The k-th largest key v is found by
// selection over a small set: above kRadixMin keys, an 11-bit histogram of the key's top bits finds
// the bin that holds it and only that bin's keys are partitioned. Then one pass in index order takes
// every key > v and the first (k - #{> v}) keys == v, which is the sorted set directly.
int64_t TopKAscending(const float* w, int64_t m, int64_t k, Scratch& sc, int32_t* out) {
  constexpr int64_t kRadixMin = 1536;
  constexpr int kShift = 21, kBins = 1 << (32 - kShift);
  uint32_t* key = Room(sc.keys, m);
  uint32_t* cand = Room(sc.bin_keys, m);
  for (int64_t j = 0; j < m; ++j) key[j] = OrderedKey(w[j]);
  int64_t nc = m, need = k;  // v is the need-th largest of cand[0, nc)
  if (m < kRadixMin) {
    std::copy_n(key, m, cand);
  } else {
    uint32_t hist[2][kBins] = {};  // two interleaved counts: equal neighbours do not serialise
    int64_t j = 0;
    for (; j + 2 <= m; j += 2) {
      ++hist[0][key[j] >> kShift];
      ++hist[1][key[j + 1] >> kShift];
    }
    if (j < m) ++hist[0][key[j] >> kShift];
    uint32_t bin = kBins - 1;
    for (;; --bin) {
      const int64_t h = static_cast<int64_t>(hist[0][bin]) + hist[1][bin];
      if (h >= need) break;
      need -= h;
    }
    nc = 0;
    for (j = 0; j < m; ++j) {
      cand[nc] = key[j];
      nc += (key[j] >> kShift) == bin;
    }
  }
  std::nth_element(cand, cand + (need - 1), cand + nc, std::greater<uint32_t>());
  const uint32_t v = cand[need - 1];
  int64_t ties = need;  // keys == v to take, lower index first
  for (int64_t i = 0; i < need - 1; ++i) ties -= cand[i] > v;
  int64_t c = 0;
  for (int64_t j = 0; j < m; ++j) {
    const bool eq = key[j] == v;
    const bool take = key[j] > v || (eq && ties > 0);
    out[c] = static_cast<int32_t>(j);
    c += take;
    ties -= eq && take;
  }
  return c;
}

// ---- the scan (step 3a) -------------------------------------------------------------------------
// A scan over many tokens may be split into ranges run as TBB tasks (SelectContext::threads). The
// split never changes a result: head maxima combine exactly and the ranges' candidate lists are
// concatenated in range order.
constexpr int64_t kScanRangeMin = 8192;  // tokens per range at least
constexpr int kScanMaxRanges = 64;
constexpr int64_t kScanSampleMin = 4096;  // fewer offloaded tokens: every key is a candidate
constexpr int kScanSamples = 1024;
constexpr int64_t kScoreRangeMin = 512;  // exact-scored positions per task at least

int ScanRanges(int64_t len, int threads) {
  if (threads <= 1 || len < 2 * kScanRangeMin) return 1;
  return static_cast<int>(std::min<int64_t>({threads, len / kScanRangeMin, kScanMaxRanges}));
}
// Range i of `ranges` over [0, len): boundaries on multiples of 64 tokens.
int64_t RangeBegin(int64_t len, int ranges, int i) {
  return i >= ranges ? len : (len * i / ranges) & ~int64_t{63};
}

// acc[g * len + j] for j in [0, len) and mx[g] = the max over j (args.begin / end / head_max are
// set here); range_max has room for ranges * group.
void ScanAll(const cpu::CpuKernels& kern, const cpu::ScanInt8Args& args, int64_t len, int ranges,
             int32_t* range_max, int32_t* mx) {
  const int group = args.group;
  ForRanges(ranges, [&](int i) {
    cpu::ScanInt8Args a = args;
    a.begin = RangeBegin(len, ranges, i);
    a.end = RangeBegin(len, ranges, i + 1);
    a.head_max = range_max + static_cast<int64_t>(i) * group;
    kern.scan_int8(a);
  });
  for (int g = 0; g < group; ++g) {
    mx[g] = range_max[g];
    for (int i = 1; i < ranges; ++i) mx[g] = std::max(mx[g], range_max[i * group + g]);
  }
}

// Every j in [0, len) with ScanKey(score_j) >= thr and off_lo + j not in the ascending list
// excl[0, m), ascending, into idx / key (room for len); returns how many.
int64_t ScanCollectAll(const cpu::CpuKernels& kern, const int32_t* acc, int64_t len, int group,
                       const int32_t* mx, uint32_t thr, const int32_t* excl, int64_t m,
                       int64_t off_lo, int ranges, int32_t* idx, uint32_t* key) {
  int64_t counts[kScanMaxRanges];
  ForRanges(ranges, [&](int i) {
    cpu::ScanCollectArgs a;
    a.acc = acc;
    a.ld = len;
    a.group = group;
    a.mx = mx;
    a.begin = RangeBegin(len, ranges, i);
    a.end = RangeBegin(len, ranges, i + 1);
    a.thr = thr;
    a.idx = idx + a.begin;
    a.key = key + a.begin;
    counts[i] = kern.scan_collect(a);
  });
  // Compact in range order (in place: a kept entry never moves right), dropping excl.
  int64_t o = 0, e = 0;
  for (int i = 0; i < ranges; ++i) {
    const int64_t b = RangeBegin(len, ranges, i);
    for (int64_t t = 0; t < counts[i]; ++t) {
      const int64_t pos = off_lo + idx[b + t];
      while (e < m && excl[e] < pos) ++e;
      if (e < m && excl[e] == pos) continue;
      idx[o] = idx[b + t];
      key[o++] = key[b + t];
    }
  }
  return o;
}

// The need-th largest of key[0, c) (all >= lo; 0 < need <= c) into *v; returns #{key > *v}. A
// histogram of (key - lo) over kKeyBins bins finds the bin that holds it, and only that bin's keys
// are partitioned: two passes over the keys instead of a copy and an nth_element over all of them
// (which cost as much as the scan's collect pass at 64K).
int64_t NthLargestKey(const uint32_t* key, int64_t c, int64_t need, uint32_t lo, Scratch& sc,
                      uint32_t* v) {
  constexpr int kKeyBins = 2048;
  constexpr int64_t kKeyHistMin = 1024;  // fewer keys: nth_element over a copy is as fast
  uint32_t* tmp = Room(sc.keys, c);
  if (c < kKeyHistMin) {
    std::copy_n(key, c, tmp);
    std::nth_element(tmp, tmp + (need - 1), tmp + c, std::greater<uint32_t>());
    *v = tmp[need - 1];
    int64_t greater = 0;
    for (int64_t i = 0; i < need - 1; ++i) greater += tmp[i] > *v;
    return greater;
  }
  uint32_t hi = lo;
  for (int64_t i = 0; i < c; ++i) hi = std::max(hi, key[i]);
  int shift = 0;
  while (((hi - lo) >> shift) >= static_cast<uint32_t>(kKeyBins)) ++shift;
  int32_t hist[kKeyBins] = {};
  for (int64_t i = 0; i < c; ++i) ++hist[(key[i] - lo) >> shift];
  int64_t above = 0;  // keys in the bins above bin b
  int b = static_cast<int>((hi - lo) >> shift);
  while (above + hist[b] < need) above += hist[b--];
  int64_t nb = 0;
  for (int64_t i = 0; i < c; ++i) {
    if (static_cast<int>((key[i] - lo) >> shift) == b) tmp[nb++] = key[i];
  }
  const int64_t r = need - above;  // the r-th largest of the bin, 1 <= r <= nb
  std::nth_element(tmp, tmp + (r - 1), tmp + nb, std::greater<uint32_t>());
  *v = tmp[r - 1];
  int64_t greater = above;
  for (int64_t i = 0; i < r - 1; ++i) greater += tmp[i] > *v;
  return greater;
}

// The need best of the ascending idx[0, c) by key (all >= lo; 0 < need <= c), ties to the lower
// index, written ascending to out: v = the need-th largest key, then every key > v and the first
// (need - #{> v}) keys == v. Returns need.
int64_t TakeBest(const int32_t* idx, const uint32_t* key, int64_t c, int64_t need, uint32_t lo,
                 Scratch& sc, int32_t* out) {
  uint32_t v = 0;
  const int64_t greater = NthLargestKey(key, c, need, lo, sc, &v);
  int64_t ties = need - greater;
  int64_t o = 0;
  for (int64_t i = 0; i < c; ++i) {
    const bool eq = key[i] == v;
    const bool take = key[i] > v || (eq && ties > 0);
    out[o] = idx[i];
    o += take;
    ties -= eq && take;
  }
  return o;
}

// The scan's picks: the `need` best j in [0, len) by score_j = (float) max_g (acc[g len + j] -
// mx[g]) with off_lo + j not in the ascending list excl[0, m), written as ascending j, in
// TopKAscending's order (value descending, lower index first on ties); 0 < need <= len - m. This is
// the set TopKAscending picks from the scores with the excluded ones at -inf (they rank below every
// score and need <= len - m keeps them out). Instead of keying, histogramming and re-reading every
// score, a stratified sample of kScanSamples scores sets a key threshold that about 1.5 need + 4
// standard deviations pass, one vectorised pass collects the keys at or above it, and the exact
// selection runs over those. The set does not depend on the threshold as long as >= need keys pass
// (checked: else the pass is repeated with every key).
int64_t ScanTopK(const cpu::CpuKernels& kern, const int32_t* acc, int64_t len, int group,
                 const int32_t* mx, const int32_t* excl, int64_t m, int64_t off_lo, int64_t need,
                 int ranges, const lfps_internal::ScanPicksOptions& opt, Scratch& sc, int32_t* out,
                 bool* retried) {
  int32_t* idx = Room(sc.scan_idx, len);
  uint32_t* key = Room(sc.scan_key, len);
  uint32_t thr = 0;
  if (opt.force_thr) {
    thr = opt.thr;
  } else if (len >= kScanSampleMin) {
    uint32_t* smp = Room(sc.scan_sample, kScanSamples);
    int64_t ns = 0, e = 0;
    for (int i = 0; i < kScanSamples; ++i) {
      // One position per stratum, at a hashed offset (the cache may repeat with a period).
      const int64_t lo = len * i / kScanSamples, hi = len * (i + 1) / kScanSamples;
      // (A multiply-shift, not a modulo: a 64-bit division per sample cost as much as the rest.)
      const uint64_t h = (static_cast<uint32_t>(i) * 2654435761u) >> 8;
      const int64_t j = lo + static_cast<int64_t>((h * static_cast<uint64_t>(hi - lo)) >> 24);
      while (e < m && excl[e] < off_lo + j) ++e;
      if (e < m && excl[e] == off_lo + j) continue;
      int32_t s = acc[j] - mx[0];
      for (int g = 1; g < group; ++g) s = std::max(s, acc[g * len + j] - mx[g]);
      smp[ns++] = cpu::ScanKey(s);
    }
    const double mean = static_cast<double>(need) / static_cast<double>(len - m) * ns;
    const int64_t q = static_cast<int64_t>(std::ceil(1.5 * mean + 4.0 * std::sqrt(mean) + 4.0));
    if (q < ns) {
      std::nth_element(smp, smp + (q - 1), smp + ns, std::greater<uint32_t>());
      thr = smp[q - 1];
    }
  }
  int64_t c = ScanCollectAll(kern, acc, len, group, mx, thr, excl, m, off_lo, ranges, idx, key);
  *retried = c < need && thr != 0;
  if (*retried) {
    c = ScanCollectAll(kern, acc, len, group, mx, 0, excl, m, off_lo, ranges, idx, key);
  }
  return TakeBest(idx, key, c, need, *retried ? 0 : thr, sc, out);
}

// Scan and picks (ScanAll + ScanTopK) with scratch from sc; args: rows, w, r, group.
int64_t ScanPicksImpl(const cpu::CpuKernels* kern, cpu::ScanInt8Args args, int64_t len,
                      const int32_t* excl, int64_t m, int64_t off_lo, int64_t need,
                      const lfps_internal::ScanPicksOptions& opt, Scratch& sc, int32_t* out,
                      bool* retried) {
  if (kern == nullptr) {
    kern = cpu::ScanArgsFitSimd(args) ? &cpu::BestCpuKernels() : &cpu::ScalarKernels();
  }
  const int group = args.group;
  const int ranges = ScanRanges(len, opt.threads);
  args.acc = Room(sc.scan_acc, static_cast<int64_t>(group) * len);
  args.ld = len;
  int32_t* mx = Room(sc.scan_max, static_cast<int64_t>(ranges + 1) * group);
  ScanAll(*kern, args, len, ranges, mx + group, mx);
  *retried = false;
  if (need >= len) {
    std::iota(out, out + len, 0);
    return len;
  }
  return ScanTopK(*kern, args.acc, len, group, mx, excl, m, off_lo, need, ranges, opt, sc, out,
                  retried);
}

// The scan's picks from a device's ranking (SelectContext::scan): ScanTopK's picks (the need best
// j outside the ascending list excl[0, m), ascending j; need <= len - m unless need >= len) taken
// from the device's best dp.count. They are the same whenever at least need of those lie outside
// excl (the device's list is a prefix of the order by (key desc, j asc), so the first need outside
// excl in that order are in it); returns -1 when fewer do (the caller then scans on the host).
int64_t DevicePicks(const DeviceScanPicks& dp, const int32_t* excl, int64_t m, int64_t off_lo,
                    int64_t need, Scratch& sc, int32_t* out) {
  if (need >= dp.len) {
    std::iota(out, out + dp.len, 0);
    return dp.len;
  }
  int32_t* idx = Room(sc.scan_idx, dp.count);
  uint32_t* key = Room(sc.scan_key, dp.count);
  uint32_t lo = UINT32_MAX;
  int64_t c = 0, e = 0;
  for (int64_t i = 0; i < dp.count; ++i) {
    const auto j = static_cast<int32_t>(dp.picks[i] & 0xffffffffu);
    const int64_t pos = off_lo + j;
    while (e < m && excl[e] < pos) ++e;
    if (e < m && excl[e] == pos) continue;
    idx[c] = j;
    key[c] = static_cast<uint32_t>(dp.picks[i] >> 32);
    lo = std::min(lo, key[c++]);
  }
  if (c < need) return -1;
  return TakeBest(idx, key, c, need, lo, sc, out);
}

// Softmax of logits[0..count) written to probs (fp32), returns nothing; count > 0.
void Softmax(const float* logits, int64_t count, float* probs) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) m = std::max(m, logits[j]);
  double sum = 0.0;
  for (int64_t j = 0; j < count; ++j) {
    probs[j] = std::exp(logits[j] - m);
    sum += probs[j];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t j = 0; j < count; ++j) probs[j] *= inv;
}

// Scaled logits of many query rows (rows x head_dim, contiguous) over [begin, end), in chunks of
// at most kMaxQueriesPerScore rows so each chunk reads K once with the SIMD kernels.
void ScoreManyRows(const AttnParams& p, const float* q, int rows, const KvPages& kv, int64_t begin,
                   int64_t end, float* logits) {
  const int64_t ld = end - begin;
  for (int r0 = 0; r0 < rows; r0 += kMaxQueriesPerScore) {
    AttnParams chunk = p;
    chunk.group = std::min(kMaxQueriesPerScore, rows - r0);
    cpu::ScoreRange(chunk, q + static_cast<int64_t>(r0) * p.head_dim, kv, begin, end,
                    logits + r0 * ld, ld);
  }
}

}  // namespace

Result<LfpsParams> ParseLfpsParams(const std::map<std::string, double>& params) {
  using L = LfpsParams;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  static const ParamSpec<L> kTable[] = {
      {"s", &L::s, 1, 4096},
      {"r", &L::r, 0, 1, true},
      {"eps", &L::eps, 0, kInf, true},  // >= 1 disables the bypass
      {"a", &L::a, 0, kInf},
      {"local", &L::local, 0, 1024},
      {"fallback", &L::fallback, 0, 1},
      {"score_all", &L::score_all, 0, 1},
      {"fill", &L::fill, 0, 64},
      {"rank", &L::rank, 0, 2},
      {"scan", &L::scan, 0, 256},
      {"scan_factor", &L::scan_factor, 0, 64},
      {"scan_max_period", &L::scan_max_period, 1, 1024},
      {"per_head_budget", &L::per_head_budget, 0, 1e15},
      {"profile", &L::profile, 0, 1},
  };
  return ParseParams<L>("lfps", params, kTable);
}

LfpsPolicy::LfpsPolicy(const LfpsParams& params, int max_sequences, int num_layers,
                       int num_kv_heads, int64_t max_tokens)
    : params_(params),
      max_sequences_(max_sequences),
      num_layers_(num_layers),
      num_kv_heads_(num_kv_heads),
      max_tokens_(max_tokens) {
  states_.resize(static_cast<size_t>(max_sequences) * num_layers * num_kv_heads);
  profile_ = params.profile;
  need_.reset(new std::atomic<float>[states_.size()]);
  for (size_t i = 0; i < states_.size(); ++i) need_[i].store(-1.0f, std::memory_order_relaxed);
}

int64_t LfpsPolicy::PerHeadK(int slot, int layer, int kv_head, int64_t k_avg, int64_t k_cap) const {
  // Water-filling of the layer's k_avg * heads offloaded picks over its heads in proportion to their
  // need, none above k_cap; a head with no need measured yet (or a layer where some is missing)
  // takes the average.
  if (k_avg <= 0) return 0;
  const int h_count = num_kv_heads_;
  double need[256];
  bool fixed[256] = {};
  if (h_count > 256) return k_avg;
  for (int h = 0; h < h_count; ++h) {
    need[h] = need_[NeedIndex(slot, layer, h)].load(std::memory_order_relaxed);
    if (need[h] < 0) return std::min(k_avg, k_cap);
    need[h] = std::max(need[h], 1e-4);
  }
  double left = static_cast<double>(k_avg) * h_count;
  for (int round = 0; round < h_count; ++round) {
    double w = 0.0;
    for (int h = 0; h < h_count; ++h) w += fixed[h] ? 0.0 : need[h];
    bool changed = false;
    for (int h = 0; h < h_count; ++h) {
      if (!fixed[h] && left * need[h] / w >= static_cast<double>(k_cap)) {
        fixed[h] = true;
        left -= static_cast<double>(k_cap);
        changed = true;
      }
    }
    if (!changed) break;
  }
  if (fixed[kv_head]) return k_cap;
  double w = 0.0;
  for (int h = 0; h < h_count; ++h) w += fixed[h] ? 0.0 : need[h];
  return std::clamp<int64_t>(std::llround(left * need[kv_head] / w), 1, k_cap);
}

LfpsPolicy::~LfpsPolicy() {
  if (!profile_) return;
  static constexpr const char* kNames[kPhases] = {"state+bypass", "tables", "scan", "fill",
                                                   "score", "rank", "update"};
  const int64_t steps = std::max<int64_t>(1, steps_.load());
  std::fprintf(stderr, "lfps profile: %lld selects, us per select:", static_cast<long long>(steps));
  for (int i = 0; i < kPhases; ++i) {
    std::fprintf(stderr, " %s %.1f", kNames[i], phase_ns_[i].load() * 1e-3 / steps);
  }
  std::fprintf(stderr, "\n");
}

Result<LfpsPolicy::HeadState*> LfpsPolicy::State(int slot, int layer, int kv_head, bool create) {
  KVF_CHECK_ARG(slot >= 0 && slot < max_sequences_, "lfps slot ", slot, " out of range [0, ",
                max_sequences_, ")");
  KVF_CHECK_ARG(layer >= 0 && layer < num_layers_, "lfps layer ", layer, " out of range [0, ",
                num_layers_, ")");
  KVF_CHECK_ARG(kv_head >= 0 && kv_head < num_kv_heads_, "lfps kv_head ", kv_head,
                " out of range [0, ", num_kv_heads_, ")");
  auto& st = states_[(static_cast<size_t>(slot) * num_layers_ + layer) * num_kv_heads_ + kv_head];
  if (st == nullptr && create) {
    st = std::make_unique<HeadState>();
    st->Reserve(max_tokens_);
  }
  return st.get();
}

void LfpsPolicy::OnSequenceRemoved(int slot) {
  if (slot < 0 || slot >= max_sequences_) return;
  const size_t per_slot = static_cast<size_t>(num_layers_) * num_kv_heads_;
  for (size_t i = 0; i < per_slot; ++i) {
    states_[slot * per_slot + i].reset();
    need_[slot * per_slot + i].store(-1.0f, std::memory_order_relaxed);
  }
}

Status LfpsPolicy::OnPrefill(const PrefillContext& ctx) {
  KVF_CHECK_ARG(ctx.q != nullptr && ctx.num_q >= 1, "lfps prefill needs queries");
  KVF_ASSIGN_OR_RETURN(HeadState * st, State(ctx.slot, ctx.layer, ctx.kv_head, true));
  const AttnParams& p = ctx.params;
  const int64_t n = ctx.n;
  const int64_t sink = std::clamp<int64_t>(ctx.sink, 0, n);
  const int64_t off_hi = std::max(sink, n - ctx.window);  // offloaded range at the end of prefill
  BeginPrime(st, n);
  const int rows = std::min(params_.s, ctx.num_q);
  const int64_t hd = p.head_dim;
  Scratch& sc = GetScratch();
  if (off_hi > sink) {
    // Phi_ver[i] = c sum_rows A[i], Phi_sla[t_row - i] = c sum_rows A[i], c = 1 / (2 s (1 - r)),
    // with A the group's mean softmax of the row over the offloaded keys.
    const double c = 1.0 / (2.0 * rows * (1.0 - params_.r));
    const int64_t len = off_hi - sink;
    const int32_t first = ctx.num_q - rows;
    sc.logits.resize(static_cast<size_t>(rows) * p.group * len);
    sc.probs.resize(static_cast<size_t>(len));
    ScoreManyRows(p, ctx.q + static_cast<int64_t>(first) * p.group * hd, rows * p.group, ctx.kv,
                  sink, off_hi, sc.logits.data());
    for (int r = 0; r < rows; ++r) {
      const int64_t t_row = ctx.q_pos0 + first + r;
      const int64_t visible = std::min(len, t_row + 1 - sink);  // causal
      if (visible <= 0) continue;
      for (int g = 0; g < p.group; ++g) {
        const float* l = sc.logits.data() + (static_cast<int64_t>(r) * p.group + g) * len;
        Softmax(l, visible, sc.probs.data());
        const double w = c / p.group;
        for (int64_t j = 0; j < visible; ++j) {
          const int64_t i = sink + j;
          st->ver[i] += static_cast<float>(w * sc.probs[j]);
          st->sla[t_row - i] += static_cast<float>(w * sc.probs[j]);
        }
      }
    }
  }
  // Priors for the bypass test: mean K, V over the non-sink keys and the logit spread of the last
  // prefill query.
  st->k_bar.assign(static_cast<size_t>(hd), 0.0f);
  st->v_bar.assign(static_cast<size_t>(hd), 0.0f);
  const size_t elem = DTypeSize(p.kv_dtype);
  if (n > sink) {
    std::vector<double> ks(static_cast<size_t>(hd), 0.0), vs(static_cast<size_t>(hd), 0.0);
    for (int64_t i = sink; i < n; ++i) {
      const void* k = PagedKRow(ctx.kv, i, p.head_dim, elem);
      const void* v = PagedVRow(ctx.kv, i, p.head_dim, elem);
      for (int64_t d = 0; d < hd; ++d) {
        ks[d] += cpu::LoadAsF32(k, p.kv_dtype, d);
        vs[d] += cpu::LoadAsF32(v, p.kv_dtype, d);
      }
    }
    for (int64_t d = 0; d < hd; ++d) {
      st->k_bar[d] = static_cast<float>(ks[d] / (n - sink));
      st->v_bar[d] = static_cast<float>(vs[d] / (n - sink));
    }
    const int64_t len = n - sink;
    sc.logits.resize(static_cast<size_t>(p.group) * len);
    const float* q_last = ctx.q + static_cast<int64_t>(ctx.num_q - 1) * p.group * hd;
    cpu::ScoreRange(p, q_last, ctx.kv, sink, n, sc.logits.data(), len);
    double sigma_sum = 0.0;
    for (int g = 0; g < p.group; ++g) {
      const float* l = sc.logits.data() + static_cast<int64_t>(g) * len;
      double mean = 0.0, sq = 0.0;
      for (int64_t j = 0; j < len; ++j) mean += l[j];
      mean /= static_cast<double>(len);
      for (int64_t j = 0; j < len; ++j) sq += (l[j] - mean) * (l[j] - mean);
      double qn = 0.0;
      for (int64_t d = 0; d < hd; ++d) qn += static_cast<double>(q_last[g * hd + d]) * q_last[g * hd + d];
      if (qn > 0) sigma_sum += sq / static_cast<double>(len) / qn;
    }
    st->sigma2_hat = sigma_sum / p.group;
  }
  FinishPrime(st, ctx);
  return Status::Ok();
}

void LfpsPolicy::BeginPrime(HeadState* st, int64_t n) {
  // A later chunk re-primes from its own last rows: only the end of the prompt matters.
  std::fill(st->ver.begin(), st->ver.end(), 0.0f);
  std::fill(st->sla.begin(), st->sla.end(), 0.0f);
  st->Extend(n);
  st->scale = 1.0;
}

void LfpsPolicy::FinishPrime(HeadState* st, const PrefillContext& ctx) {
  st->Resync();
  st->primed = true;
  // The scan's shadow is made here, on the prompt's path, so that a decode step only quantises its
  // own new row (making it at the first scan costs a pass over every K row inside a token step).
  if (params_.scan > 0 && !params_.score_all) {
    st->PrimeShadow(ctx.params, ctx.kv, ctx.n, max_tokens_);
  }
}

Status LfpsPolicy::OnPrefillPrimed(const PrefillContext& ctx, const PrimedStats& primed) {
  const AttnParams& p = ctx.params;
  const int rows = std::min(params_.s, ctx.num_q);
  KVF_CHECK_ARG(ctx.num_q >= 1 && primed.rows == rows, "lfps primed from ", primed.rows,
                " rows of a chunk of ", ctx.num_q, ", expected ", rows);
  KVF_CHECK_ARG(primed.ver != nullptr && primed.sla != nullptr && primed.stats != nullptr,
                "lfps primed without its tables or stats");
  KVF_ASSIGN_OR_RETURN(HeadState * st, State(ctx.slot, ctx.layer, ctx.kv_head, true));
  const int64_t n = ctx.n;
  const int64_t sink = std::clamp<int64_t>(ctx.sink, 0, n);
  const int64_t off_hi = std::max(sink, n - ctx.window);
  BeginPrime(st, n);
  if (off_hi > sink) {
    // OnPrefill's c / group per weight: the device summed the weights over rows and the group.
    const double w = 1.0 / (2.0 * rows * (1.0 - params_.r)) / p.group;
    for (int64_t i = sink; i < off_hi; ++i) st->ver[i] = static_cast<float>(w * primed.ver[i]);
    for (int64_t d = 0; d < n; ++d) st->sla[d] = static_cast<float>(w * primed.sla[d]);
  }
  const int hd = p.head_dim;
  st->k_bar.assign(static_cast<size_t>(hd), 0.0f);
  st->v_bar.assign(static_cast<size_t>(hd), 0.0f);
  if (n > sink) {
    const double len = static_cast<double>(n - sink);
    const double* k_sum = primed.stats;
    const double* v_sum = k_sum + hd;
    const double* l_sq = v_sum + hd + p.group;
    const double* q_sq = l_sq + p.group;
    for (int d = 0; d < hd; ++d) {
      st->k_bar[d] = static_cast<float>(k_sum[d] / len);
      st->v_bar[d] = static_cast<float>(v_sum[d] / len);
    }
    double sigma_sum = 0.0;
    for (int g = 0; g < p.group; ++g) {
      if (q_sq[g] > 0) sigma_sum += l_sq[g] / len / q_sq[g];
    }
    st->sigma2_hat = sigma_sum / p.group;
  }
  FinishPrime(st, ctx);
  return Status::Ok();
}

Status LfpsPolicy::Select(const SelectContext& ctx, std::vector<int32_t>& out) {
  return SelectWithInfo(ctx, out, nullptr, nullptr);
}

namespace {

// Clears what a Select reports in its detail (NaN: not read this step).
void ResetDetail(LfpsStepDetail* dbg) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  dbg->c0.clear();
  dbg->c1.clear();
  dbg->probe_ver.assign(dbg->probe.size(), kNaN);
  dbg->probe_sla.assign(dbg->probe.size(), kNaN);
  dbg->tau_ver = dbg->tau_sla = dbg->mean_ver = dbg->mean_sla = kNaN;
}

// The log of the summed weight that query head qg gives n_glob unscored offloaded keys of mean
// k_bar and per-dimension variance sigma2_hat (hd dimensions): log n_glob + scale q.k_bar +
// sigma2_hat |q|^2 / 2; -inf when there are none.
double LogGlobalWeight(const float* qg, const float* k_bar, double sigma2_hat, int64_t hd,
                       float scale, int64_t n_glob) {
  double qk = 0.0, qq = 0.0;
  for (int64_t d = 0; d < hd; ++d) {
    qk += static_cast<double>(qg[d]) * k_bar[d];
    qq += static_cast<double>(qg[d]) * qg[d];
  }
  return n_glob > 0 ? std::log(static_cast<double>(n_glob)) + scale * qk + 0.5 * qq * sigma2_hat
                    : -std::numeric_limits<double>::infinity();
}

// The bypass test's K rows, the sinks [0, sink) and the local tokens [loc_lo, n) (sink > 0).
void PrefetchBypassRows(const SelectContext& ctx, int64_t n, int64_t sink, int64_t loc_lo) {
  const AttnParams& p = ctx.params;
  const size_t elem = DTypeSize(p.kv_dtype);
  const int64_t row_bytes = static_cast<int64_t>(p.head_dim) * static_cast<int64_t>(elem);
  for (int64_t i = 0; i < n; i = i + 1 == sink ? loc_lo : i + 1) {
    const char* row = static_cast<const char*>(PagedKRow(ctx.kv, i, p.head_dim, elem));
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
  }
}

}  // namespace

// One Select's working state, handed from stage to stage of SelectWithInfo: the step's geometry
// (positions [0, n), t = n - 1; offloaded [off_lo, off_hi), off_lo = sink; the bypass test's and
// the ranking's local tokens [loc_lo, n)), the head, the thread's scratch, what the step reports,
// and what the stages have built so far.
struct LfpsPolicy::SelectStep {
  const SelectContext& ctx;
  const AttnParams& p;
  int64_t n, t, sink, off_lo, off_hi, n_off, loc_lo;
  int group;
  int64_t hd;
  HeadState* st;
  Scratch& sc;
  LfpsStepInfo& info;
  LfpsStepDetail* dbg;
  int64_t k_sel = 0;  // offloaded picks allowed: k_off, or this head's share (per_head_budget)
  // C1, ascending positions, in c1[0, m) (room for the resident positions the ranking appends);
  // hist_m: the size of C1 from the tables alone (a scan keeps that list in sc.hist).
  int32_t* c1 = nullptr;
  int64_t m = 0, hist_m = 0;
  // The exact scoring (ScoreCandidates): logits[g * ld + j] of head g for c1[j], j < ld, and
  // weights[0, ld); the ranking (RankCandidates): C2 = c1[c2_idx[0, k2)], c2_idx ascending.
  int64_t ld = 0, k2 = 0;
  float* logits = nullptr;
  float* weights = nullptr;
  int32_t* c2_idx = nullptr;
};

Status LfpsPolicy::SelectWithInfo(const SelectContext& ctx, std::vector<int32_t>& out,
                                  LfpsStepInfo* info_out, LfpsStepDetail* dbg) {
  KVF_CHECK_ARG(ctx.n >= 1 && ctx.q != nullptr && ctx.params.group >= 1,
                "lfps select needs n >= 1 and a query");
  KVF_RETURN_IF_ERROR(State(ctx.slot, ctx.layer, ctx.kv_head, false).status());
  LfpsStepInfo info;
  const AttnParams& p = ctx.params;
  const int64_t n = ctx.n;
  const int64_t t = n - 1;
  const int64_t sink = std::clamp<int64_t>(ctx.sink, 0, n);
  const int64_t off_lo = sink;
  const int64_t off_hi = std::max(sink, n - ctx.window);
  const int64_t n_off = off_hi - off_lo;
  const int64_t k_off = ctx.budget - (sink + (n - off_hi));
  info.offloaded = n_off;
  out.clear();
  if (dbg != nullptr) ResetDetail(dbg);
  steps_.fetch_add(1, std::memory_order_relaxed);
  offloaded_.fetch_add(n_off, std::memory_order_relaxed);
  using PhaseClock = std::chrono::steady_clock;
  PhaseClock::time_point phase_t = profile_ ? PhaseClock::now() : PhaseClock::time_point{};
  auto phase = [&](int i) {
    if (!profile_) return;
    const PhaseClock::time_point now = PhaseClock::now();
    phase_ns_[i].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(now - phase_t).count(),
                           std::memory_order_relaxed);
    phase_t = now;
  };
  auto finish = [&](const int32_t* chosen, int64_t count) {
    AppendRange(out, 0, sink);
    out.insert(out.end(), chosen, chosen + count);
    AppendRange(out, off_hi, n);
    if (info_out != nullptr) *info_out = info;
    return Status::Ok();
  };
  if (k_off >= n_off) {  // the budget covers everything
    info.all = true;
    all_.fetch_add(1, std::memory_order_relaxed);
    AppendRange(out, 0, n);
    if (info_out != nullptr) *info_out = info;
    return Status::Ok();
  }
  if (k_off <= 0) return finish(nullptr, 0);

  const bool bypass_test = params_.eps < 1.0 && sink > 0;
  const int64_t loc_lo = std::max(sink, n - params_.local);
  if (bypass_test) {  // its K rows are usually out of cache: start loading them now
    PrefetchBypassRows(ctx, n, sink, loc_lo);
  }
  KVF_ASSIGN_OR_RETURN(HeadState * st, State(ctx.slot, ctx.layer, ctx.kv_head, true));
  st->Extend(n);
  Scratch& sc = GetScratch();
  SelectStep s{.ctx = ctx, .p = p, .n = n, .t = t, .sink = sink, .off_lo = off_lo,
               .off_hi = off_hi, .n_off = n_off, .loc_lo = loc_lo, .group = p.group,
               .hd = p.head_dim, .st = st, .sc = sc, .info = info, .dbg = dbg};

  // (1) Bypass test: rho = w_sink / (w_sink + w_glob + w_loc) per query head (Eq. 5-6).
  if (st->primed && bypass_test) {
    const double min_rho = MinSinkShare(s);
    info.rho = min_rho;
    if (min_rho > params_.eps) {
      info.bypassed = true;
      bypassed_.fetch_add(1, std::memory_order_relaxed);
      return finish(nullptr, 0);
    }
  }

  phase(0);
  // Per-head budget: this head's share of the layer's offloaded picks, by measured need.
  s.k_sel = k_off;
  if (params_.per_head_budget > 0) {
    s.k_sel = std::min(k_off, PerHeadK(ctx.slot, ctx.layer, ctx.kv_head,
                                       params_.per_head_budget - (sink + (n - off_hi)), k_off));
    info.k = s.k_sel;
    if (s.k_sel <= 0) return finish(nullptr, 0);
  }

  // (2)-(3) Candidates: C0 from the thresholds, C1 by expansion (Eq. 7-9). Room for the resident
  // positions the ranking may append (sinks, the local tokens, one pseudo-row).
  const int64_t n_loc_rank = n - loc_lo;
  s.c1 = Room(sc.c1, n_off + sink + n_loc_rank + 1);
  TableCandidates(s);
  phase(1);
  KVF_RETURN_IF_ERROR(ScanCandidates(s));  // (3a)
  phase(2);
  FillCandidates(s);  // (3b)
  phase(3);
  if (s.m == 0) {
    if (!params_.fallback) return finish(nullptr, 0);
    info.fallback = true;
    fallbacks_.fetch_add(1, std::memory_order_relaxed);
    std::iota(s.c1, s.c1 + n_off, static_cast<int32_t>(off_lo));
    s.m = n_off;
  }
  info.c1 = s.m;
  scored_.fetch_add(s.m, std::memory_order_relaxed);
  if (dbg != nullptr) ReportCandidates(s);

  // (4) Exact scores on C1; rank by the group's summed softmax weight; C2 = top-k. With rank >= 1
  // each head's softmax is normalised over C1 plus the resident sinks and local tokens (rank 2:
  // plus the log-normal estimate of the rest), which brings each head's weights close to its
  // weights over all positions, so that the group's sum ranks as the oracle's does.
  const bool glob_row = params_.rank >= 2 && st->primed;
  ScoreCandidates(s, glob_row);
  phase(4);
  RankCandidates(s, glob_row);
  info.c2 = s.k2;
  if (params_.scan > 0 && info.scanned > 0) AdaptScanPeriod(s);
  if (params_.per_head_budget > 0) UpdateNeed(s);

  phase(5);
  const int32_t* c2 = UpdateTables(s);  // (5)
  phase(6);
  return finish(c2, s.k2);
}

double LfpsPolicy::MinSinkShare(SelectStep& s) {
  const SelectContext& ctx = s.ctx;
  const AttnParams& p = s.p;
  const HeadState* st = s.st;
  Scratch& sc = s.sc;
  const int64_t n = s.n, sink = s.sink, loc_lo = s.loc_lo, hd = s.hd;
  const int group = s.group;
  const int64_t n_loc = n - loc_lo;
  const int64_t n_glob = std::max<int64_t>(0, n - sink - n_loc);
  const int64_t ld = sink + n_loc;
  // The query-only terms first, while the rows arrive.
  double* log_glob = Room(sc.log_glob, group);
  for (int g = 0; g < group; ++g) {
    log_glob[g] =
        LogGlobalWeight(ctx.q + g * hd, st->k_bar.data(), st->sigma2_hat, hd, p.scale, n_glob);
  }
  float* logits = Room(sc.logits, group * ld);
  cpu::ScoreRange(p, ctx.q, ctx.kv, 0, sink, logits, ld);
  if (n_loc > 0) cpu::ScoreRange(p, ctx.q, ctx.kv, loc_lo, n, logits + sink, ld);
  double min_rho = 1.0;
  for (int g = 0; g < group; ++g) {
    const float* l = logits + g * ld;
    double m = log_glob[g];
    for (int64_t j = 0; j < ld; ++j) m = std::max(m, static_cast<double>(l[j]));
    double w_sink = 0.0, w_rest = std::exp(log_glob[g] - m);
    for (int64_t j = 0; j < sink; ++j) w_sink += std::exp(l[j] - m);
    for (int64_t j = sink; j < ld; ++j) w_rest += std::exp(l[j] - m);
    min_rho = std::min(min_rho, w_sink / (w_sink + w_rest));
  }
  return min_rho;
}

void LfpsPolicy::TableCandidates(SelectStep& s) const {
  HeadState* st = s.st;  // the candidate scan tightens the bounds of the blocks it reads
  Scratch& sc = s.sc;
  LfpsStepDetail* dbg = s.dbg;
  const int64_t t = s.t, off_lo = s.off_lo, off_hi = s.off_hi, n_off = s.n_off;
  int32_t* c1 = s.c1;
  int64_t m = 0;
  if (params_.score_all) {
    std::iota(c1, c1 + n_off, static_cast<int32_t>(off_lo));
    m = n_off;
  } else {
    const Threshold tv = ComputeThreshold(st->ver_pow, n_off, params_.a);
    const Threshold ts = ComputeThreshold(st->sla_pow, n_off, params_.a);
    // C0 = the union of both tables' hits as a bitmap over positions (bit i of word w: position
    // 64 w + i), words [w_lo, w_hi) plus one zero guard word on each side for the expansion.
    const int64_t w_lo = off_lo >> 6, w_hi = ((off_hi - 1) >> 6) + 1;
    uint64_t* bits = Room(sc.c0_bits, w_hi + 2) + 1;
    std::fill(bits + w_lo - 1, bits + w_hi + 1, uint64_t{0});
    int32_t* hits = Room(sc.hits, n_off);
    int64_t c0 = 0;
    if (tv.ok) {
      const int64_t nv = cpu::FilterGreaterBlocked(st->ver.data(), st->ver_bound.data(), off_lo,
                                                   off_hi, tv.tau, hits);
      for (int64_t j = 0; j < nv; ++j) bits[hits[j] >> 6] |= uint64_t{1} << (hits[j] & 63);
      c0 = nv;
    }
    if (ts.ok) {
      // Distances t - i for i in [off_lo, off_hi) are [t - off_hi + 1, t - off_lo].
      const int64_t ns = cpu::FilterGreaterBlocked(st->sla.data(), st->sla_bound.data(),
                                                   t - off_hi + 1, t - off_lo + 1, ts.tau, hits);
      for (int64_t j = 0; j < ns; ++j) {
        const int64_t i = t - hits[j];
        uint64_t& word = bits[i >> 6];
        const uint64_t bit = uint64_t{1} << (i & 63);
        c0 += (word & bit) == 0;
        word |= bit;
      }
    }
    s.info.c0 = c0;
    if (dbg != nullptr) {
      const float sc = static_cast<float>(st->scale);
      if (tv.ok) dbg->tau_ver = tv.tau * sc, dbg->mean_ver = tv.mean * sc;
      if (ts.ok) dbg->tau_sla = ts.tau * sc, dbg->mean_sla = ts.mean * sc;
      for (int64_t i = off_lo; i < off_hi; ++i) {
        if ((bits[i >> 6] >> (i & 63)) & 1) dbg->c0.push_back(static_cast<int32_t>(i));
      }
    }
    // Expansion: position j is a candidate if one of j + 1, j, j - 1, j - 2 is in C0 (offsets
    // {-1, 0, 1, 2}), inside [off_lo, off_hi); kept if either table is above its mean there. Bits
    // come out ascending and unique. A table without a threshold keeps nothing (mean +inf).
    constexpr float kInf = std::numeric_limits<float>::infinity();
    const float ver_mean = tv.ok ? tv.mean : kInf;
    const float sla_mean = ts.ok ? ts.mean : kInf;
    const float* ver = st->ver.data();
    const float* sla = st->sla.data();
    for (int64_t w = w_lo; w < w_hi; ++w) {
      const uint64_t x = bits[w];
      uint64_t cand = x | (x >> 1) | (bits[w + 1] << 63) | (x << 1) | (bits[w - 1] >> 63) |
                      (x << 2) | (bits[w - 1] >> 62);
      if (w == w_lo) cand &= ~uint64_t{0} << (off_lo & 63);
      if (w == w_hi - 1 && (off_hi & 63) != 0) cand &= (uint64_t{1} << (off_hi & 63)) - 1;
      while (cand != 0) {
        const int64_t j = (w << 6) + __builtin_ctzll(cand);
        cand &= cand - 1;
        c1[m] = static_cast<int32_t>(j);
        m += (ver[j] > ver_mean) | (sla[t - j] > sla_mean);
      }
    }
  }
  s.m = m;
}

Status LfpsPolicy::ScanCandidates(SelectStep& s) {
  const SelectContext& ctx = s.ctx;
  HeadState* st = s.st;
  Scratch& sc = s.sc;
  const int64_t off_lo = s.off_lo, n_off = s.n_off;
  int32_t* c1 = s.c1;
  int64_t m = s.m;
  // (3a) Scan: approximate logits of every offloaded key from the int8 shadow over the r channels
  // with the largest |q| * scale (summed over the group), max over the group's heads of the logit
  // minus the head's max; the best ceil(scan_factor k) positions outside C1 join C1.
  const bool scan_now = params_.scan > 0 && ++st->since_scan >= st->scan_period;
  // When the tables give no candidate, the scan (when on) nominates them instead of the exact
  // fallback over every offloaded key: the exact work stays O(k) every step.
  const bool rescue = params_.scan > 0 && params_.fallback && m == 0 && !params_.score_all;
  s.info.rescued = rescue;
  s.hist_m = m;  // C1 from the tables alone
  if ((rescue || (scan_now && (m > 0 || !params_.fallback))) && !params_.score_all) {
    st->since_scan = 0;
    const int64_t want_scan = std::min<int64_t>(
        n_off - m, static_cast<int64_t>(std::ceil(params_.scan_factor * static_cast<double>(s.k_sel))));
    const int r = std::min<int>(params_.scan, static_cast<int>(s.hd));
    int32_t* pick = Room(sc.fill, want_scan + 1);
    int64_t got = -1;
    // The device's ranking (SelectContext::scan) gives the same picks when enough of it lies
    // outside C1; otherwise the host scans.
    const DeviceScanPicks* dp = ctx.scan;
    if (want_scan > 0 && dp != nullptr && dp->off_lo == off_lo && dp->len == n_off &&
        dp->channels == r) {
      if (dp->wait != nullptr) KVF_RETURN_IF_ERROR(dp->wait(dp->wait_arg));
      got = DevicePicks(*dp, c1, m, off_lo, want_scan, sc, pick);
      (got >= 0 ? device_scans_ : device_scans_short_).fetch_add(1, std::memory_order_relaxed);
    }
    if (want_scan > 0 && got < 0) got = HostScanPicks(s, r, want_scan, pick);
    if (want_scan > 0) {
      int32_t* merged = Room(sc.merged, m + got);
      int64_t a = 0, b = 0, o = 0;
      while (a < m || b < got) {
        const int32_t pb = b < got ? static_cast<int32_t>(off_lo + pick[b]) : INT32_MAX;
        if (a < m && c1[a] < pb) {
          merged[o++] = c1[a++];
        } else {
          merged[o++] = pb;
          ++b;
        }
      }
      int32_t* hist = Room(sc.hist, m);
      std::copy_n(c1, m, hist);
      std::copy_n(merged, o, c1);
      s.info.scanned = got;
      s.hist_m = m;
      s.m = o;
    }
  }
  return Status::Ok();
}

int64_t LfpsPolicy::HostScanPicks(SelectStep& s, int r, int64_t want_scan, int32_t* pick) {
  const SelectContext& ctx = s.ctx;
  HeadState* st = s.st;
  Scratch& sc = s.sc;
  const int64_t hd = s.hd;
  const int group = s.group;
  shadow_rows_.fetch_add(st->SyncShadow(ctx.params, ctx.kv, s.n, max_tokens_),
                         std::memory_order_relaxed);
  // The r channels with the largest |q| * scale (summed over the group) and one integer
  // scale for the whole group (so heads compare): |w| <= 2^14.
  float* imp = Room(sc.chan_imp, hd);
  int32_t* ch = Room(sc.chans, hd);
  int32_t* wq = Room(sc.scan_w, static_cast<int64_t>(group) * r);
  cpu::ShadowScanWeights(ctx.q, st->k8_scale.data(), group, static_cast<int>(hd), r, imp, ch, wq);
  const int8_t* rows[256];
  for (int c = 0; c < r; ++c) rows[c] = st->k8.get() + static_cast<int64_t>(ch[c]) * st->k8_cap + s.off_lo;
  // Approximate logits (exact integers: every kernel table agrees bit for bit), then the
  // best positions outside C1 by max_g (logit_g - max logit_g).
  cpu::ScanInt8Args args;
  args.rows = rows;
  args.w = wq;
  args.r = r;
  args.group = group;
  lfps_internal::ScanPicksOptions opt;
  opt.threads = ctx.threads;
  bool retried = false;
  return ScanPicksImpl(nullptr, args, s.n_off, s.c1, s.m, s.off_lo, want_scan, opt, sc, pick,
                       &retried);
}

void LfpsPolicy::FillCandidates(SelectStep& s) const {
  const HeadState* st = s.st;
  Scratch& sc = s.sc;
  const int64_t t = s.t, off_hi = s.off_hi, n_off = s.n_off;
  int32_t* c1 = s.c1;
  const int64_t m = s.m;
  // (3b) Fill: when the tables nominate fewer than ceil(fill k) candidates, add the offloaded
  // positions with the best table evidence max(Phi_ver[i], Phi_sla[t - i]) (ties: the most recent
  // first), so that the exact scoring, and through it the selection, uses the budget.
  const int64_t want =
      params_.fill > 0 ? std::min<int64_t>(n_off, static_cast<int64_t>(std::ceil(params_.fill *
                                                                                  s.k_sel)))
                       : 0;
  if ((m > 0 || !params_.fallback) && m < want) {
    const int64_t need = want - m;
    float* score = Room(sc.fill_score, n_off);  // r = off_hi - 1 - i: most recent first
    const float* ver = st->ver.data();
    const float* sla = st->sla.data() + (t - off_hi + 1);
    for (int64_t r = 0; r < n_off; ++r) score[r] = std::max(ver[off_hi - 1 - r], sla[r]);
    for (int64_t j = 0; j < m; ++j) score[off_hi - 1 - c1[j]] = -std::numeric_limits<float>::infinity();
    int32_t* pick = Room(sc.fill, need + 1);
    int64_t got = need;
    if (need < n_off) {
      got = TopKAscending(score, n_off, need, sc, pick);
    } else {
      std::iota(pick, pick + n_off, 0);
    }
    // pick holds r ascending = positions descending: merge both ascending lists.
    int32_t* merged = Room(sc.merged, m + got);
    int64_t a = 0, b = got - 1, o = 0;
    while (a < m || b >= 0) {
      const int32_t pb = b >= 0 ? static_cast<int32_t>(off_hi - 1 - pick[b]) : INT32_MAX;
      if (a < m && c1[a] < pb) {
        merged[o++] = c1[a++];
      } else {
        merged[o++] = pb;
        --b;
      }
    }
    std::copy_n(merged, o, c1);
    s.info.filled = got;
    s.m = o;
  }
}

void LfpsPolicy::ReportCandidates(SelectStep& s) {
  const HeadState* st = s.st;
  LfpsStepDetail* dbg = s.dbg;
  const int64_t t = s.t;
  dbg->c1.assign(s.c1, s.c1 + s.m);
  for (size_t j = 0; j < dbg->probe.size(); ++j) {
    const int64_t pos = dbg->probe[j];
    if (pos < 0 || pos > t) continue;
    dbg->probe_ver[j] = static_cast<float>(st->ver[pos] * st->scale);
    dbg->probe_sla[j] = static_cast<float>(st->sla[t - pos] * st->scale);
  }
}

void LfpsPolicy::ScoreCandidates(SelectStep& s, bool glob_row) const {
  const SelectContext& ctx = s.ctx;
  const AttnParams& p = s.p;
  Scratch& sc = s.sc;
  const int64_t n = s.n, sink = s.sink, loc_lo = s.loc_lo;
  int32_t* c1 = s.c1;
  int64_t ld = s.m;
  if (params_.rank >= 1) {
    for (int64_t i = 0; i < sink; ++i) c1[ld++] = static_cast<int32_t>(i);
    for (int64_t i = loc_lo; i < n; ++i) c1[ld++] = static_cast<int32_t>(i);
    if (glob_row) c1[ld++] = 0;  // a placeholder row: its logit is replaced below
  }
  float* logits = Room(sc.logits, s.group * ld);
  float* weights = Room(sc.weights, ld);
  std::fill(weights, weights + ld, 0.0f);
  // The rows lie scattered in host memory (DRAM-latency bound): split over the Select's threads.
  const int score_ranges = static_cast<int>(
      std::clamp<int64_t>(ld / kScoreRangeMin, 1, std::max(1, ctx.threads)));
  ForRanges(score_ranges, [&](int i) {
    const int64_t b = ld * i / score_ranges, e = ld * (i + 1) / score_ranges;
    cpu::ScorePositions(p, ctx.q, ctx.kv, c1 + b, static_cast<int32_t>(e - b), logits + b, ld);
  });
  s.ld = ld;
  s.logits = logits;
  s.weights = weights;
}

void LfpsPolicy::RankCandidates(SelectStep& s, bool glob_row) const {
  const SelectContext& ctx = s.ctx;
  const AttnParams& p = s.p;
  const HeadState* st = s.st;
  const int64_t n = s.n, sink = s.sink, hd = s.hd, m = s.m, ld = s.ld;
  const int group = s.group;
  float* logits = s.logits;
  float* weights = s.weights;
  if (glob_row) {
    const int64_t n_loc_rank = n - s.loc_lo;
    const int64_t n_glob = std::max<int64_t>(0, n - sink - n_loc_rank - m);
    for (int g = 0; g < group; ++g) {
      logits[g * ld + ld - 1] = static_cast<float>(
          LogGlobalWeight(ctx.q + g * hd, st->k_bar.data(), st->sigma2_hat, hd, p.scale, n_glob));
    }
  }
  for (int g = 0; g < group; ++g) cpu::SoftmaxAccumulate(logits + g * ld, ld, 1.0f, weights);
  int32_t* c2_idx = Room(s.sc.c2_idx, m);  // indices into c1, ascending
  int64_t k2 = m;
  if (m <= s.k_sel) {
    std::iota(c2_idx, c2_idx + m, 0);
  } else {
    k2 = TopKAscending(weights, m, s.k_sel, s.sc, c2_idx);
  }
  s.c2_idx = c2_idx;
  s.k2 = k2;
}

void LfpsPolicy::AdaptScanPeriod(SelectStep& s) const {
  HeadState* st = s.st;
  const int32_t* c1 = s.c1;
  const int32_t* c2_idx = s.c2_idx;
  const int64_t k2 = s.k2, hist_m = s.hist_m;
  // Adaptive scan period: a scan whose candidates made few of C2 (< 1/16) doubles the period (up to
  // scan_max_period); one that mattered brings it back to every step. Scan-only candidates are the
  // positions of C1 \ C1_tables, recognised by a merge with the tables' list (kept in hist).
  int64_t from_scan = 0;
  const int32_t* hist = s.sc.hist.data();
  // Both lists ascending (c2_idx is, and so is c1): one merge walk.
  int64_t h = 0;
  for (int64_t j = 0; j < k2; ++j) {
    const int32_t pos = c1[c2_idx[j]];
    while (h < hist_m && hist[h] < pos) ++h;
    from_scan += !(h < hist_m && hist[h] == pos);
  }
  st->scan_period = 16 * from_scan >= k2 ? 1 : std::min(2 * st->scan_period, params_.scan_max_period);
}

void LfpsPolicy::UpdateNeed(SelectStep& s) {
  const SelectContext& ctx = s.ctx;
  const float* weights = s.weights;
  // Need: the head's estimated attention share on offloaded tokens (C1's weight under the
  // resident-normalised ranking), an EMA over steps.
  double share = 0.0;
  for (int64_t j = 0; j < s.m; ++j) share += weights[j];
  share /= s.group;
  std::atomic<float>& need = need_[NeedIndex(ctx.slot, ctx.layer, ctx.kv_head)];
  const float old = need.load(std::memory_order_relaxed);
  need.store(old < 0 ? static_cast<float>(share) : static_cast<float>(0.9 * old + 0.1 * share),
             std::memory_order_relaxed);
}

const int32_t* LfpsPolicy::UpdateTables(SelectStep& s) const {
  HeadState* st = s.st;
  Scratch& sc = s.sc;
  const int64_t t = s.t, ld = s.ld, k2 = s.k2;
  const int group = s.group;
  const int32_t* c1 = s.c1;
  const int32_t* c2_idx = s.c2_idx;
  const float* logits = s.logits;
  float* weights = s.weights;
  // (5) Table update (Eq. 10) with p = the group's mean softmax over C2:
  // Phi <- r Phi + p - 1/(2|C2|) on C2, r Phi elsewhere (a global scale).
  std::fill(weights, weights + k2, 0.0f);
  float* probs = Room(sc.probs, k2);
  for (int g = 0; g < group; ++g) {
    const float* l = logits + g * ld;
    for (int64_t j = 0; j < k2; ++j) probs[j] = l[c2_idx[j]];
    cpu::SoftmaxAccumulate(probs, k2, 1.0f / static_cast<float>(group), weights);
  }
  st->scale *= params_.r;
  const double inv_scale = 1.0 / st->scale;
  const double base = 1.0 / (2.0 * static_cast<double>(k2));
  int32_t* c2 = Room(sc.c2, k2);
  for (int64_t j = 0; j < k2; ++j) {
    c2[j] = c1[c2_idx[j]];
  }
  // The table lines were read by the expansion, but the scoring's row stream has evicted them
  // since: fetch them a few entries ahead.
  constexpr int64_t kAhead = 8;
  float* ver = st->ver.data();
  float* sla = st->sla.data();
  for (int64_t j = 0; j < std::min(k2, kAhead); ++j) {
    __builtin_prefetch(ver + c2[j], 1);
    __builtin_prefetch(sla + (t - c2[j]), 1);
  }
  for (int64_t j = 0; j < k2; ++j) {
    if (j + kAhead < k2) {
      __builtin_prefetch(ver + c2[j + kAhead], 1);
      __builtin_prefetch(sla + (t - c2[j + kAhead]), 1);
    }
    const int64_t pos = c2[j];
    const double delta = (weights[j] - base) * inv_scale;
    HeadState::Add(st->ver, st->ver_pow, st->ver_bound, pos, delta);
    HeadState::Add(st->sla, st->sla_pow, st->sla_bound, t - pos, delta);
  }
  if (st->scale < kRenormBelow) st->Renormalise();
  return c2;
}

LfpsStats LfpsPolicy::stats() const {
  LfpsStats s;
  s.steps = steps_.load(std::memory_order_relaxed);
  s.bypassed = bypassed_.load(std::memory_order_relaxed);
  s.device_scans = device_scans_.load(std::memory_order_relaxed);
  s.device_scans_short = device_scans_short_.load(std::memory_order_relaxed);
  s.fallbacks = fallbacks_.load(std::memory_order_relaxed);
  s.all = all_.load(std::memory_order_relaxed);
  s.scored_keys = scored_.load(std::memory_order_relaxed);
  s.offloaded_keys = offloaded_.load(std::memory_order_relaxed);
  s.shadow_rows_in_select = shadow_rows_.load(std::memory_order_relaxed);
  return s;
}

int64_t LfpsPolicy::device_scan_picks(int64_t k) const {
  if (device_scan_channels() == 0 || k <= 0) return 0;
  return 3 * static_cast<int64_t>(std::ceil(params_.scan_factor * static_cast<double>(k))) + 64;
}

const LfpsPolicy::HeadState* LfpsPolicy::Peek(int slot, int layer, int kv_head) const {
  if (slot < 0 || slot >= max_sequences_ || layer < 0 || layer >= num_layers_ || kv_head < 0 ||
      kv_head >= num_kv_heads_) {
    return nullptr;
  }
  return states_[NeedIndex(slot, layer, kv_head)].get();
}

bool LfpsPolicy::ScanShadow(int slot, int layer, int kv_head, ScanShadowView* out) const {
  const HeadState* st = Peek(slot, layer, kv_head);
  if (st == nullptr || st->k8 == nullptr) return false;
  out->k8 = st->k8.get();
  out->cap = st->k8_cap;
  out->n = st->k8_n;
  out->scale = st->k8_scale.data();
  return true;
}

bool LfpsPolicy::TableSums(int slot, int layer, int kv_head, double* ver, double* sla) const {
  const HeadState* st = Peek(slot, layer, kv_head);
  if (st == nullptr) return false;
  double sv = 0.0, ss = 0.0;
  for (float x : st->ver) sv += x;
  for (float x : st->sla) ss += x;
  *ver = sv * st->scale;
  *sla = ss * st->scale;
  return true;
}

bool LfpsPolicy::GetPrimedState(int slot, int layer, int kv_head, PrimedState* out) const {
  const HeadState* st = Peek(slot, layer, kv_head);
  if (st == nullptr) return false;
  out->ver.resize(st->ver.size());
  out->sla.resize(st->sla.size());
  for (size_t i = 0; i < st->ver.size(); ++i) {
    out->ver[i] = static_cast<float>(st->ver[i] * st->scale);
  }
  for (size_t i = 0; i < st->sla.size(); ++i) {
    out->sla[i] = static_cast<float>(st->sla[i] * st->scale);
  }
  out->k_bar = st->k_bar;
  out->v_bar = st->v_bar;
  out->sigma2_hat = st->sigma2_hat;
  return true;
}

namespace lfps_internal {

int64_t ScanPicks(const int8_t* const* rows, const int32_t* w, int r, int group, int64_t len,
                  const int32_t* excl, int64_t m, int64_t off_lo, int64_t need,
                  const ScanPicksOptions& opt, std::vector<int32_t>& out, bool* retried) {
  const cpu::CpuKernels* kern = nullptr;
  if (opt.isa >= 0) {
    kern = cpu::GetCpuKernels(static_cast<cpu::CpuIsa>(opt.isa));
    if (kern == nullptr) return -1;
  }
  cpu::ScanInt8Args args;
  args.rows = rows;
  args.w = w;
  args.r = r;
  args.group = group;
  if (kern != nullptr && kern->isa != cpu::CpuIsa::kScalar && !cpu::ScanArgsFitSimd(args)) {
    return -1;
  }
  Scratch sc;
  out.assign(static_cast<size_t>(std::min(need, len)) + 1, 0);
  bool again = false;
  const int64_t got =
      ScanPicksImpl(kern, args, len, excl, m, off_lo, need, opt, sc, out.data(), &again);
  out.resize(static_cast<size_t>(got));
  if (retried != nullptr) *retried = again;
  return got;
}

}  // namespace lfps_internal

Result<std::unique_ptr<Policy>> MakeLfpsPolicy(const RuntimeConfig& config) {
  KVF_ASSIGN_OR_RETURN(LfpsParams params, ParseLfpsParams(config.policy.params));
  KVF_CHECK_ARG(config.capacity.max_sequences >= 1 && config.model.num_layers >= 1 &&
                    config.model.num_kv_heads >= 1,
                "lfps needs at least one sequence, layer and KV head");
  return std::unique_ptr<Policy>(new LfpsPolicy(params, config.capacity.max_sequences,
                                                config.model.num_layers,
                                                config.model.num_kv_heads,
                                                config.capacity.max_tokens_per_sequence));
}

}  // namespace kvferry
