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
//    (exact resync at every renormalisation), so thresholds cost O(1) and only the candidate scan is
//    O(n) (2 floats per position, vectorised).
#include "policies/lfps.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "runtime/check.h"

namespace kvferry {
namespace {

constexpr double kRenormBelow = 1e-6;  // renormalise stored tables when the global scale gets here
constexpr int kOffsets[] = {-1, 0, 1, 2};
constexpr int kMaxQueriesPerScore = 16;  // cpu::kMaxSimdGroup

// Thread-local scratch: Select allocates only while these grow to the largest context seen.
struct Scratch {
  std::vector<int32_t> ver_hits, sla_hits, c0, c1, c2_idx, c2;
  std::vector<float> logits, weights, probs;
};
Scratch& GetScratch() {
  thread_local Scratch s;
  return s;
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
    }
  }
  void Extend(int64_t n) {  // new positions / distances start at 0
    if (static_cast<int64_t>(ver.size()) < n) ver.resize(static_cast<size_t>(n), 0.0f);
    if (static_cast<int64_t>(sla.size()) < n) sla.resize(static_cast<size_t>(n), 0.0f);
  }
  void Resync() {
    PowerSums(ver, ver_pow);
    PowerSums(sla, sla_pow);
  }
  void Renormalise() {
    for (float& x : ver) x = static_cast<float>(x * scale);
    for (float& x : sla) x = static_cast<float>(x * scale);
    scale = 1.0;
    Resync();
  }
  static void Add(std::vector<float>& u, double* pw, int64_t i, double delta) {
    const double old = u[i];
    const double now = old + delta;
    u[i] = static_cast<float>(now);
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
  auto finish = [&](const std::vector<int32_t>* chosen) {
    AppendRange(out, 0, sink);
    if (chosen != nullptr) out.insert(out.end(), chosen->begin(), chosen->end());
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
  if (k_off <= 0) return finish(nullptr);

  KVF_ASSIGN_OR_RETURN(HeadState * st, State(ctx.slot, ctx.layer, ctx.kv_head, true));
  st->Extend(n);
  Scratch& sc = GetScratch();
  const int group = p.group;
  const int64_t hd = p.head_dim;

  // (1) Bypass test: rho = w_sink / (w_sink + w_glob + w_loc) per query head (Eq. 5-6).
  if (st->primed && params_.eps < 1.0 && sink > 0) {
    const int64_t loc_lo = std::max(sink, n - params_.local);
    const int64_t n_loc = n - loc_lo;
    const int64_t n_glob = std::max<int64_t>(0, n - sink - n_loc);
    sc.logits.resize(static_cast<size_t>(group) * (sink + n_loc));
    const int64_t ld = sink + n_loc;
    cpu::ScoreRange(p, ctx.q, ctx.kv, 0, sink, sc.logits.data(), ld);
    if (n_loc > 0) cpu::ScoreRange(p, ctx.q, ctx.kv, loc_lo, n, sc.logits.data() + sink, ld);
    double min_rho = 1.0;
    for (int g = 0; g < group; ++g) {
      const float* qg = ctx.q + g * hd;
      double qk = 0.0, qq = 0.0;
      for (int64_t d = 0; d < hd; ++d) {
        qk += static_cast<double>(qg[d]) * st->k_bar[d];
        qq += static_cast<double>(qg[d]) * qg[d];
      }
      const float* l = sc.logits.data() + g * ld;
      const double log_glob = n_glob > 0 ? std::log(static_cast<double>(n_glob)) + p.scale * qk +
                                               0.5 * qq * st->sigma2_hat
                                         : -std::numeric_limits<double>::infinity();
      double m = log_glob;
      for (int64_t j = 0; j < ld; ++j) m = std::max(m, static_cast<double>(l[j]));
      double w_sink = 0.0, w_rest = std::exp(log_glob - m);
      for (int64_t j = 0; j < sink; ++j) w_sink += std::exp(l[j] - m);
      for (int64_t j = sink; j < ld; ++j) w_rest += std::exp(l[j] - m);
      min_rho = std::min(min_rho, w_sink / (w_sink + w_rest));
    }
    info.rho = min_rho;
    if (min_rho > params_.eps) {
      info.bypassed = true;
      bypassed_.fetch_add(1, std::memory_order_relaxed);
      return finish(nullptr);
    }
  }

  // (2)-(3) Candidates: C0 from the thresholds, C1 by expansion (Eq. 7-9).
  std::vector<int32_t>& c1 = sc.c1;
  c1.clear();
  if (params_.score_all) {
    AppendRange(c1, off_lo, off_hi);
  } else {
    const Threshold tv = ComputeThreshold(st->ver_pow, n_off, params_.a);
    const Threshold ts = ComputeThreshold(st->sla_pow, n_off, params_.a);
    sc.ver_hits.resize(static_cast<size_t>(n_off));
    sc.sla_hits.resize(static_cast<size_t>(n_off));
    int64_t nv = 0, ns = 0;
    if (tv.ok) {
      nv = cpu::FilterGreater(st->ver.data() + off_lo, n_off, tv.tau, static_cast<int32_t>(off_lo),
                              sc.ver_hits.data());
    }
    if (ts.ok) {
      // Distances t - i for i in [off_lo, off_hi) are [t - off_hi + 1, t - off_lo].
      const int64_t d_lo = t - off_hi + 1;
      ns = cpu::FilterGreater(st->sla.data() + d_lo, n_off, ts.tau, static_cast<int32_t>(d_lo),
                              sc.sla_hits.data());
      for (int64_t j = 0; j < ns; ++j) sc.sla_hits[j] = static_cast<int32_t>(t - sc.sla_hits[j]);
      std::reverse(sc.sla_hits.begin(), sc.sla_hits.begin() + ns);  // ascending positions
    }
    std::vector<int32_t>& c0 = sc.c0;
    c0.resize(static_cast<size_t>(nv + ns));
    c0.resize(static_cast<size_t>(
        std::set_union(sc.ver_hits.begin(), sc.ver_hits.begin() + nv, sc.sla_hits.begin(),
                       sc.sla_hits.begin() + ns, c0.begin()) -
        c0.begin()));
    info.c0 = static_cast<int64_t>(c0.size());
    // Expansion: i + {-1, 0, 1, 2}, kept if either table is above its mean there. C0 ascending and
    // offsets ascending: a watermark of the last position considered keeps C1 sorted and unique.
    const float* ver = st->ver.data();
    const float* sla = st->sla.data();
    int64_t considered = off_lo - 1;
    for (int32_t i : c0) {
      for (int off : kOffsets) {
        const int64_t j = static_cast<int64_t>(i) + off;
        if (j <= considered || j >= off_hi) continue;
        considered = j;
        if ((tv.ok && ver[j] > tv.mean) || (ts.ok && sla[t - j] > ts.mean)) {
          c1.push_back(static_cast<int32_t>(j));
        }
      }
    }
  }
  if (c1.empty()) {
    if (!params_.fallback) return finish(nullptr);
    info.fallback = true;
    fallbacks_.fetch_add(1, std::memory_order_relaxed);
    AppendRange(c1, off_lo, off_hi);
  }
  const int64_t m = static_cast<int64_t>(c1.size());
  info.c1 = m;
  scored_.fetch_add(m, std::memory_order_relaxed);

  // (4) Exact scores on C1; rank by the group's summed softmax weight; C2 = top-k.
  sc.logits.resize(static_cast<size_t>(group) * m);
  sc.weights.assign(static_cast<size_t>(m), 0.0f);
  sc.probs.resize(static_cast<size_t>(m));
  cpu::ScorePositions(p, ctx.q, ctx.kv, c1.data(), static_cast<int32_t>(m), sc.logits.data());
  for (int g = 0; g < group; ++g) {
    cpu::SoftmaxAccumulate(sc.logits.data() + g * m, m, 1.0f, sc.weights.data());
  }
  std::vector<int32_t>& c2_idx = sc.c2_idx;  // indices into c1
  if (m <= k_off) {
    c2_idx.resize(static_cast<size_t>(m));
    std::iota(c2_idx.begin(), c2_idx.end(), 0);
  } else {
    // The top-k set (TopK's order: weight descending, lower index first on ties) by selection in
    // O(m), then ascending indices; the ranking within the set is never used. NaN ranks last.
    float* w = sc.weights.data();
    for (int64_t j = 0; j < m; ++j) {
      if (std::isnan(w[j])) w[j] = -std::numeric_limits<float>::infinity();
    }
    c2_idx.resize(static_cast<size_t>(m));
    std::iota(c2_idx.begin(), c2_idx.end(), 0);
    std::nth_element(c2_idx.begin(), c2_idx.begin() + (k_off - 1), c2_idx.end(),
                     [w](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); });
    c2_idx.resize(static_cast<size_t>(k_off));
    std::sort(c2_idx.begin(), c2_idx.end());
  }
  const int64_t k2 = static_cast<int64_t>(c2_idx.size());
  info.c2 = k2;

  // (5) Table update (Eq. 10) with p = the group's mean softmax over C2:
  // Phi <- r Phi + p - 1/(2|C2|) on C2, r Phi elsewhere (a global scale).
  std::fill(sc.weights.begin(), sc.weights.begin() + k2, 0.0f);
  for (int g = 0; g < group; ++g) {
    const float* l = sc.logits.data() + g * m;
    for (int64_t j = 0; j < k2; ++j) sc.probs[j] = l[c2_idx[j]];
    cpu::SoftmaxAccumulate(sc.probs.data(), k2, 1.0f / static_cast<float>(group),
                           sc.weights.data());
  }
  st->scale *= params_.r;
  const double inv_scale = 1.0 / st->scale;
  const double base = 1.0 / (2.0 * static_cast<double>(k2));
  std::vector<int32_t>& c2 = sc.c2;
  c2.resize(static_cast<size_t>(k2));
  for (int64_t j = 0; j < k2; ++j) {
    const int64_t pos = c1[c2_idx[j]];
    c2[j] = static_cast<int32_t>(pos);
    const double delta = (sc.weights[j] - base) * inv_scale;
    HeadState::Add(st->ver, st->ver_pow, pos, delta);
    HeadState::Add(st->sla, st->sla_pow, t - pos, delta);
  }
  if (st->scale < kRenormBelow) st->Renormalise();
  return finish(&c2);
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
