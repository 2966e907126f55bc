// Copyright kvferry authors. Apache-2.0.
// LFPS on the CPU. Decisions on the paper's open questions (docs/lfps.md says more):
//  - Slash alignment: the slash table is stored by distance d = t - i, so a step's update lands on
//    the diagonal and the next query reads key i at its own distance t' - i: the table is shifted by
//    one before selection (the paper's Phi_sla[i-1] form), for free, and the decay is one global
//    scale factor. The offsets {-1, 0, 1, 2} are applied to positions as printed.
//  - k: k = budget - resident tokens; C2 = top-k of C1 by exact score, C2 = C1 when |C1| <= k (no
//    filler). When the tables give no candidate at all (cold start, or a state the decay alone can
//    never leave, since tau / mean is scale-free) the step scores every offloaded key (exact
//    top-k), which also re-seeds the tables; "fallback" = 0 turns this off.
//  - GQA: one pair of tables per KV head (4x less memory at Llama-3's ratio; the group's candidate
//    rows are read once). Ranking by the group's summed softmax weight over C1; the table update
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
#include "policies/lfps.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "runtime/check.h"

namespace kvferry {
namespace {

constexpr double kRenormBelow = 1e-6;  // renormalise stored tables when the global scale gets here
constexpr int kMaxQueriesPerScore = 16;  // cpu::kMaxSimdGroup

// Thread-local scratch: Select allocates only while these grow to the largest context seen.
struct Scratch {
  std::vector<int32_t> hits, c1, c2_idx, c2;
  std::vector<uint64_t> c0_bits;
  std::vector<uint32_t> keys, bin_keys;
  std::vector<float> logits, weights, probs;
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
  LfpsParams lp;
  for (const auto& [key, value] : params) {
    if (key == "s") {
      KVF_CHECK_ARG(value >= 1 && value <= 4096 && value == std::floor(value),
                    "lfps s ", value, " must be an integer in [1, 4096]");
      lp.s = static_cast<int>(value);
    } else if (key == "r") {
      KVF_CHECK_ARG(value > 0 && value < 1, "lfps r ", value, " must be in (0, 1)");
      lp.r = value;
    } else if (key == "eps") {
      KVF_CHECK_ARG(value > 0, "lfps eps ", value, " must be > 0 (>= 1 disables the bypass)");
      lp.eps = value;
    } else if (key == "a") {
      KVF_CHECK_ARG(value >= 0 && std::isfinite(value), "lfps a ", value, " must be >= 0");
      lp.a = value;
    } else if (key == "local") {
      KVF_CHECK_ARG(value >= 0 && value <= 1024 && value == std::floor(value), "lfps local ",
                    value, " must be an integer in [0, 1024]");
      lp.local = static_cast<int>(value);
    } else if (key == "fallback") {
      KVF_CHECK_ARG(value == 0 || value == 1, "lfps fallback ", value, " must be 0 or 1");
      lp.fallback = value == 1;
    } else if (key == "score_all") {
      KVF_CHECK_ARG(value == 0 || value == 1, "lfps score_all ", value, " must be 0 or 1");
      lp.score_all = value == 1;
    } else {
      return InvalidArgument(detail::StrCat("unknown lfps parameter '", key,
                                            "' (known: s, r, eps, a, local, fallback, score_all)"));
    }
  }
  return lp;
}

LfpsPolicy::LfpsPolicy(const LfpsParams& params, int max_sequences, int num_layers,
                       int num_kv_heads, int64_t max_tokens)
    : params_(params),
      max_sequences_(max_sequences),
      num_layers_(num_layers),
      num_kv_heads_(num_kv_heads),
      max_tokens_(max_tokens) {
  states_.resize(static_cast<size_t>(max_sequences) * num_layers * num_kv_heads);
}

LfpsPolicy::~LfpsPolicy() = default;

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
  for (size_t i = 0; i < per_slot; ++i) states_[slot * per_slot + i].reset();
}

Status LfpsPolicy::OnPrefill(const PrefillContext& ctx) {
  KVF_CHECK_ARG(ctx.q != nullptr && ctx.num_q >= 1, "lfps prefill needs queries");
  KVF_ASSIGN_OR_RETURN(HeadState * st, State(ctx.slot, ctx.layer, ctx.kv_head, true));
  const AttnParams& p = ctx.params;
  const int64_t n = ctx.n;
  const int64_t sink = std::clamp<int64_t>(ctx.sink, 0, n);
  const int64_t off_hi = std::max(sink, n - ctx.window);  // offloaded range at the end of prefill
  // A later chunk re-primes from its own last rows: only the end of the prompt matters.
  std::fill(st->ver.begin(), st->ver.end(), 0.0f);
  std::fill(st->sla.begin(), st->sla.end(), 0.0f);
  st->Extend(n);
  st->scale = 1.0;
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
  st->Resync();
  st->primed = true;
  return Status::Ok();
}

Status LfpsPolicy::Select(const SelectContext& ctx, std::vector<int32_t>& out) {
  return SelectWithInfo(ctx, out, nullptr);
}

Status LfpsPolicy::SelectWithInfo(const SelectContext& ctx, std::vector<int32_t>& out,
                                  LfpsStepInfo* info_out) {
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
  steps_.fetch_add(1, std::memory_order_relaxed);
  offloaded_.fetch_add(n_off, std::memory_order_relaxed);
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
    const size_t elem = DTypeSize(p.kv_dtype);
    const int64_t row_bytes = static_cast<int64_t>(p.head_dim) * static_cast<int64_t>(elem);
    for (int64_t i = 0; i < n; i = i + 1 == sink ? loc_lo : i + 1) {
      const char* row = static_cast<const char*>(PagedKRow(ctx.kv, i, p.head_dim, elem));
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
    }
  }
  KVF_ASSIGN_OR_RETURN(HeadState * st, State(ctx.slot, ctx.layer, ctx.kv_head, true));
  st->Extend(n);
  Scratch& sc = GetScratch();
  const int group = p.group;
  const int64_t hd = p.head_dim;

  // (1) Bypass test: rho = w_sink / (w_sink + w_glob + w_loc) per query head (Eq. 5-6).
  if (st->primed && bypass_test) {
    const int64_t n_loc = n - loc_lo;
    const int64_t n_glob = std::max<int64_t>(0, n - sink - n_loc);
    const int64_t ld = sink + n_loc;
    // The query-only terms first, while the rows arrive.
    double* log_glob = Room(sc.log_glob, group);
    for (int g = 0; g < group; ++g) {
      const float* qg = ctx.q + g * hd;
      double qk = 0.0, qq = 0.0;
      for (int64_t d = 0; d < hd; ++d) {
        qk += static_cast<double>(qg[d]) * st->k_bar[d];
        qq += static_cast<double>(qg[d]) * qg[d];
      }
      log_glob[g] = n_glob > 0 ? std::log(static_cast<double>(n_glob)) + p.scale * qk +
                                     0.5 * qq * st->sigma2_hat
                               : -std::numeric_limits<double>::infinity();
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
    info.rho = min_rho;
    if (min_rho > params_.eps) {
      info.bypassed = true;
      bypassed_.fetch_add(1, std::memory_order_relaxed);
      return finish(nullptr, 0);
    }
  }

  // (2)-(3) Candidates: C0 from the thresholds, C1 by expansion (Eq. 7-9).
  int32_t* c1 = Room(sc.c1, n_off);
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
    info.c0 = c0;
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
  if (m == 0) {
    if (!params_.fallback) return finish(nullptr, 0);
    info.fallback = true;
    fallbacks_.fetch_add(1, std::memory_order_relaxed);
    std::iota(c1, c1 + n_off, static_cast<int32_t>(off_lo));
    m = n_off;
  }
  info.c1 = m;
  scored_.fetch_add(m, std::memory_order_relaxed);

  // (4) Exact scores on C1; rank by the group's summed softmax weight; C2 = top-k.
  float* logits = Room(sc.logits, group * m);
  float* weights = Room(sc.weights, m);
  std::fill(weights, weights + m, 0.0f);
  cpu::ScorePositions(p, ctx.q, ctx.kv, c1, static_cast<int32_t>(m), logits);
  for (int g = 0; g < group; ++g) cpu::SoftmaxAccumulate(logits + g * m, m, 1.0f, weights);
  int32_t* c2_idx = Room(sc.c2_idx, m);  // indices into c1, ascending
  int64_t k2 = m;
  if (m <= k_off) {
    std::iota(c2_idx, c2_idx + m, 0);
  } else {
    k2 = TopKAscending(weights, m, k_off, sc, c2_idx);
  }
  info.c2 = k2;

  // (5) Table update (Eq. 10) with p = the group's mean softmax over C2:
  // Phi <- r Phi + p - 1/(2|C2|) on C2, r Phi elsewhere (a global scale).
  std::fill(weights, weights + k2, 0.0f);
  float* probs = Room(sc.probs, k2);
  for (int g = 0; g < group; ++g) {
    const float* l = logits + g * m;
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
  return finish(c2, k2);
}

LfpsStats LfpsPolicy::stats() const {
  LfpsStats s;
  s.steps = steps_.load(std::memory_order_relaxed);
  s.bypassed = bypassed_.load(std::memory_order_relaxed);
  s.fallbacks = fallbacks_.load(std::memory_order_relaxed);
  s.all = all_.load(std::memory_order_relaxed);
  s.scored_keys = scored_.load(std::memory_order_relaxed);
  s.offloaded_keys = offloaded_.load(std::memory_order_relaxed);
  return s;
}

bool LfpsPolicy::TableSums(int slot, int layer, int kv_head, double* ver, double* sla) const {
  if (slot < 0 || slot >= max_sequences_ || layer < 0 || layer >= num_layers_ || kv_head < 0 ||
      kv_head >= num_kv_heads_) {
    return false;
  }
  const auto& st =
      states_[(static_cast<size_t>(slot) * num_layers_ + layer) * num_kv_heads_ + kv_head];
  if (st == nullptr) return false;
  double sv = 0.0, ss = 0.0;
  for (float x : st->ver) sv += x;
  for (float x : st->sla) ss += x;
  *ver = sv * st->scale;
  *sla = ss * st->scale;
  return true;
}

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
