// Copyright kvferry authors. Apache-2.0.
// LFPS's optimised Select (block-bounded table scans, bitmap candidate expansion, histogram top-k)
// against a straightforward implementation of the same algorithm kept here as the specification:
// full FilterGreater scans, set_union, watermark expansion, nth_element + sort. Many random decode
// steps over random contexts (odd sizes, GQA 1/3/4/8, budgets with |C1| > k and < k, duplicate
// keys for exact weight ties, frequent renormalisation, cold and primed starts) must give the same
// positions and step info every step, and the same table sums.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "policies/lfps/lfps.h"

namespace kvferry {
namespace {

// ---- the reference: one head, the algorithm as first written ------------------------------------
class ReferenceLfps {
 public:
  explicit ReferenceLfps(const LfpsParams& params) : params_(params) {}

  void OnPrefill(const PrefillContext& ctx) {
    const AttnParams& p = ctx.params;
    const int64_t n = ctx.n;
    const int64_t sink = std::clamp<int64_t>(ctx.sink, 0, n);
    const int64_t off_hi = std::max(sink, n - ctx.window);
    std::fill(ver_.begin(), ver_.end(), 0.0f);
    std::fill(sla_.begin(), sla_.end(), 0.0f);
    Extend(n);
    scale_ = 1.0;
    const int rows = std::min(params_.s, ctx.num_q);
    const int64_t hd = p.head_dim;
    std::vector<float> logits, probs;
    if (off_hi > sink) {
      const double c = 1.0 / (2.0 * rows * (1.0 - params_.r));
      const int64_t len = off_hi - sink;
      const int32_t first = ctx.num_q - rows;
      logits.resize(static_cast<size_t>(rows) * p.group * len);
      probs.resize(static_cast<size_t>(len));
      const float* q0 = ctx.q + static_cast<int64_t>(first) * p.group * hd;
      for (int r0 = 0; r0 < rows * p.group; r0 += 16) {
        AttnParams chunk = p;
        chunk.group = std::min(16, rows * p.group - r0);
        cpu::ScoreRange(chunk, q0 + static_cast<int64_t>(r0) * hd, ctx.kv, sink, off_hi,
                        logits.data() + r0 * len, len);
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t t_row = ctx.q_pos0 + first + r;
        const int64_t visible = std::min(len, t_row + 1 - sink);
        if (visible <= 0) continue;
        for (int g = 0; g < p.group; ++g) {
          const float* l = logits.data() + (static_cast<int64_t>(r) * p.group + g) * len;
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < visible; ++j) m = std::max(m, l[j]);
          double sum = 0.0;
          for (int64_t j = 0; j < visible; ++j) {
            probs[j] = std::exp(l[j] - m);
            sum += probs[j];
          }
          const float inv = static_cast<float>(1.0 / sum);
          for (int64_t j = 0; j < visible; ++j) probs[j] *= inv;
          const double w = c / p.group;
          for (int64_t j = 0; j < visible; ++j) {
            const int64_t i = sink + j;
            ver_[i] += static_cast<float>(w * probs[j]);
            sla_[t_row - i] += static_cast<float>(w * probs[j]);
          }
        }
      }
    }
    k_bar_.assign(static_cast<size_t>(hd), 0.0f);
    const size_t elem = DTypeSize(p.kv_dtype);
    if (n > sink) {
      std::vector<double> ks(static_cast<size_t>(hd), 0.0);
      for (int64_t i = sink; i < n; ++i) {
        const void* k = PagedKRow(ctx.kv, i, p.head_dim, elem);
        for (int64_t d = 0; d < hd; ++d) ks[d] += cpu::LoadAsF32(k, p.kv_dtype, d);
      }
      for (int64_t d = 0; d < hd; ++d) k_bar_[d] = static_cast<float>(ks[d] / (n - sink));
      const int64_t len = n - sink;
      logits.resize(static_cast<size_t>(p.group) * len);
      const float* q_last = ctx.q + static_cast<int64_t>(ctx.num_q - 1) * p.group * hd;
      cpu::ScoreRange(p, q_last, ctx.kv, sink, n, logits.data(), len);
      double sigma_sum = 0.0;
      for (int g = 0; g < p.group; ++g) {
        const float* l = logits.data() + static_cast<int64_t>(g) * len;
        double mean = 0.0, sq = 0.0;
        for (int64_t j = 0; j < len; ++j) mean += l[j];
        mean /= static_cast<double>(len);
        for (int64_t j = 0; j < len; ++j) sq += (l[j] - mean) * (l[j] - mean);
        double qn = 0.0;
        for (int64_t d = 0; d < hd; ++d) {
          qn += static_cast<double>(q_last[g * hd + d]) * q_last[g * hd + d];
        }
        if (qn > 0) sigma_sum += sq / static_cast<double>(len) / qn;
      }
      sigma2_hat_ = sigma_sum / p.group;
    }
    Resync();
    primed_ = true;
    // The scan's shadow: scales = max |K| per channel over every row stored now; a change of
    // scales requantises every row.
    if (params_.scan > 0 && !params_.score_all) {
      std::vector<float> scale(static_cast<size_t>(hd), 0.0f);
      const size_t elem = DTypeSize(p.kv_dtype);
      for (int64_t i = 0; i < n; ++i) {
        const void* k = PagedKRow(ctx.kv, i, p.head_dim, elem);
        for (int c = 0; c < p.head_dim; ++c) {
          scale[c] = std::max(scale[c], std::fabs(cpu::LoadAsF32(k, p.kv_dtype, c)));
        }
      }
      for (float& x : scale) x = x > 0.0f && std::isfinite(x) ? x : 1.0f;
      if (scale != k8_scale_) k8_.clear();
      Shadow(p, ctx.kv, n);
    }
  }

  void Select(const SelectContext& ctx, std::vector<int32_t>& out, LfpsStepInfo* info_out) {
    LfpsStepInfo info;
    const AttnParams& p = ctx.params;
    const int64_t n = ctx.n, t = n - 1;
    const int64_t sink = std::clamp<int64_t>(ctx.sink, 0, n);
    const int64_t off_lo = sink, off_hi = std::max(sink, n - ctx.window);
    const int64_t n_off = off_hi - off_lo;
    const int64_t k_off = ctx.budget - (sink + (n - off_hi));
    info.offloaded = n_off;
    out.clear();
    auto finish = [&](const std::vector<int32_t>* chosen) {
      for (int64_t i = 0; i < sink; ++i) out.push_back(static_cast<int32_t>(i));
      if (chosen != nullptr) out.insert(out.end(), chosen->begin(), chosen->end());
      for (int64_t i = off_hi; i < n; ++i) out.push_back(static_cast<int32_t>(i));
      *info_out = info;
    };
    if (k_off >= n_off) {
      info.all = true;
      for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(i));
      *info_out = info;
      return;
    }
    if (k_off <= 0) return finish(nullptr);
    Extend(n);
    const int group = p.group;
    const int64_t hd = p.head_dim;
    if (primed_ && params_.eps < 1.0 && sink > 0) {
      const int64_t loc_lo = std::max(sink, n - params_.local);
      const int64_t n_loc = n - loc_lo;
      const int64_t n_glob = std::max<int64_t>(0, n - sink - n_loc);
      const int64_t ld = sink + n_loc;
      std::vector<float> logits(static_cast<size_t>(group) * ld);
      cpu::ScoreRange(p, ctx.q, ctx.kv, 0, sink, logits.data(), ld);
      if (n_loc > 0) cpu::ScoreRange(p, ctx.q, ctx.kv, loc_lo, n, logits.data() + sink, ld);
      double min_rho = 1.0;
      for (int g = 0; g < group; ++g) {
        const float* qg = ctx.q + g * hd;
        double qk = 0.0, qq = 0.0;
        for (int64_t d = 0; d < hd; ++d) {
          qk += static_cast<double>(qg[d]) * k_bar_[d];
          qq += static_cast<double>(qg[d]) * qg[d];
        }
        const float* l = logits.data() + g * ld;
        const double log_glob = n_glob > 0 ? std::log(static_cast<double>(n_glob)) +
                                                 p.scale * qk + 0.5 * qq * sigma2_hat_
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
        return finish(nullptr);
      }
    }
    std::vector<int32_t> c1;
    if (params_.score_all) {
      for (int64_t i = off_lo; i < off_hi; ++i) c1.push_back(static_cast<int32_t>(i));
    } else {
      const Threshold tv = ComputeThreshold(ver_pow_, n_off);
      const Threshold ts = ComputeThreshold(sla_pow_, n_off);
      std::vector<int32_t> ver_hits(static_cast<size_t>(n_off)), sla_hits(ver_hits.size());
      int64_t nv = 0, ns = 0;
      if (tv.ok) {
        nv = cpu::FilterGreater(ver_.data() + off_lo, n_off, tv.tau, static_cast<int32_t>(off_lo),
                                ver_hits.data());
      }
      if (ts.ok) {
        const int64_t d_lo = t - off_hi + 1;
        ns = cpu::FilterGreater(sla_.data() + d_lo, n_off, ts.tau, static_cast<int32_t>(d_lo),
                                sla_hits.data());
        for (int64_t j = 0; j < ns; ++j) sla_hits[j] = static_cast<int32_t>(t - sla_hits[j]);
        std::reverse(sla_hits.begin(), sla_hits.begin() + ns);
      }
      std::vector<int32_t> c0;
      std::set_union(ver_hits.begin(), ver_hits.begin() + nv, sla_hits.begin(),
                     sla_hits.begin() + ns, std::back_inserter(c0));
      info.c0 = static_cast<int64_t>(c0.size());
      int64_t considered = off_lo - 1;
      for (int32_t i : c0) {
        for (int off : {-1, 0, 1, 2}) {
          const int64_t j = static_cast<int64_t>(i) + off;
          if (j <= considered || j >= off_hi) continue;
          considered = j;
          if ((tv.ok && ver_[j] > tv.mean) || (ts.ok && sla_[t - j] > ts.mean)) {
            c1.push_back(static_cast<int32_t>(j));
          }
        }
      }
    }
    // Scan: integer approximate logits over the r channels with the largest group |q| * scale.
    const std::vector<int32_t> hist = c1;
    const bool scan_now = params_.scan > 0 && ++since_scan_ >= scan_period_;
    // No candidate from the tables: the scan nominates them (instead of the exact fallback).
    const bool rescue = params_.scan > 0 && params_.fallback && c1.empty() && !params_.score_all;
    info.rescued = rescue;
    if ((rescue || (scan_now && (!c1.empty() || !params_.fallback))) && !params_.score_all) {
      since_scan_ = 0;
      const int64_t want = std::min<int64_t>(
          n_off - static_cast<int64_t>(c1.size()),
          static_cast<int64_t>(std::ceil(params_.scan_factor * static_cast<double>(k_off))));
      if (want > 0) {
        Shadow(p, ctx.kv, n);
        const int r = std::min<int>(params_.scan, static_cast<int>(hd));
        std::vector<float> imp(static_cast<size_t>(hd));
        for (int64_t c = 0; c < hd; ++c) {
          float a = 0.0f;
          for (int g = 0; g < group; ++g) a += std::fabs(ctx.q[g * hd + c]);
          imp[c] = a * k8_scale_[c];
        }
        std::vector<int32_t> ch(static_cast<size_t>(hd));
        std::iota(ch.begin(), ch.end(), 0);
        std::sort(ch.begin(), ch.end(), [&](int32_t x, int32_t y) {
          return imp[x] > imp[y] || (imp[x] == imp[y] && x < y);
        });
        float wmax = 0.0f;
        for (int c = 0; c < r; ++c) {
          for (int g = 0; g < group; ++g) {
            wmax = std::max(wmax, std::fabs(ctx.q[g * hd + ch[c]] * k8_scale_[ch[c]]));
          }
        }
        const float wscale = wmax > 0.0f && std::isfinite(wmax) ? 16384.0f / wmax : 0.0f;
        std::vector<int32_t> acc(static_cast<size_t>(group) * n_off, 0);
        for (int g = 0; g < group; ++g) {
          for (int c = 0; c < r; ++c) {
            const float v = ctx.q[g * hd + ch[c]] * k8_scale_[ch[c]] * wscale;
            const int32_t wq = static_cast<int32_t>(std::lrint(v == v ? v : 0.0f));
            for (int64_t j = 0; j < n_off; ++j) {
              acc[g * n_off + j] += wq * static_cast<int32_t>(k8_[ch[c]][off_lo + j]);
            }
          }
        }
        std::vector<int32_t> mx(static_cast<size_t>(group), std::numeric_limits<int32_t>::min());
        for (int g = 0; g < group; ++g) {
          for (int64_t j = 0; j < n_off; ++j) mx[g] = std::max(mx[g], acc[g * n_off + j]);
        }
        std::vector<std::pair<float, int32_t>> cand;
        for (int64_t j = 0; j < n_off; ++j) {
          const int32_t pos = static_cast<int32_t>(off_lo + j);
          if (std::binary_search(c1.begin(), c1.end(), pos)) continue;
          int32_t best = acc[j] - mx[0];
          for (int g = 1; g < group; ++g) best = std::max(best, acc[g * n_off + j] - mx[g]);
          cand.emplace_back(static_cast<float>(best), pos);
        }
        std::sort(cand.begin(), cand.end(), [](const auto& x, const auto& y) {
          return x.first > y.first || (x.first == y.first && x.second < y.second);
        });
        for (int64_t i = 0; i < want; ++i) c1.push_back(cand[i].second);
        std::sort(c1.begin(), c1.end());
        info.scanned = want;
      }
    }
    // Fill from the tables: best max(ver, sla) outside C1, the most recent first on ties.
    const int64_t want_fill =
        params_.fill > 0
            ? std::min<int64_t>(n_off, static_cast<int64_t>(std::ceil(params_.fill * k_off)))
            : 0;
    if ((!c1.empty() || !params_.fallback) && static_cast<int64_t>(c1.size()) < want_fill) {
      std::vector<std::pair<float, int32_t>> cand;
      for (int64_t i = off_hi - 1; i >= off_lo; --i) {
        if (std::binary_search(c1.begin(), c1.end(), static_cast<int32_t>(i))) continue;
        cand.emplace_back(std::max(ver_[i], sla_[t - i]), static_cast<int32_t>(i));
      }
      std::stable_sort(cand.begin(), cand.end(),
                       [](const auto& x, const auto& y) { return x.first > y.first; });
      const int64_t need = want_fill - static_cast<int64_t>(c1.size());
      for (int64_t i = 0; i < need; ++i) c1.push_back(cand[i].second);
      std::sort(c1.begin(), c1.end());
      info.filled = need;
    }
    if (c1.empty()) {
      if (!params_.fallback) return finish(nullptr);
      info.fallback = true;
      for (int64_t i = off_lo; i < off_hi; ++i) c1.push_back(static_cast<int32_t>(i));
    }
    const int64_t m = static_cast<int64_t>(c1.size());
    info.c1 = m;
    // Ranking rows: C1, then (rank 1) the resident sinks and local tokens in the normaliser.
    std::vector<int32_t> rows = c1;
    if (params_.rank >= 1) {
      for (int64_t i = 0; i < sink; ++i) rows.push_back(static_cast<int32_t>(i));
      for (int64_t i = std::max(sink, n - params_.local); i < n; ++i) {
        rows.push_back(static_cast<int32_t>(i));
      }
    }
    const int64_t ld = static_cast<int64_t>(rows.size());
    std::vector<float> logits(static_cast<size_t>(group) * ld), w(static_cast<size_t>(ld), 0.0f);
    cpu::ScorePositions(p, ctx.q, ctx.kv, rows.data(), static_cast<int32_t>(ld), logits.data());
    for (int g = 0; g < group; ++g) {
      cpu::SoftmaxAccumulate(logits.data() + g * ld, ld, 1.0f, w.data());
    }
    w.resize(static_cast<size_t>(m));
    std::vector<int32_t> c2_idx(static_cast<size_t>(m));
    std::iota(c2_idx.begin(), c2_idx.end(), 0);
    if (m > k_off) {
      for (float& x : w) {
        if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();
      }
      const float* wp = w.data();
      std::nth_element(c2_idx.begin(), c2_idx.begin() + (k_off - 1), c2_idx.end(),
                       [wp](int32_t a, int32_t b) {
                         return wp[a] > wp[b] || (wp[a] == wp[b] && a < b);
                       });
      c2_idx.resize(static_cast<size_t>(k_off));
      std::sort(c2_idx.begin(), c2_idx.end());
    }
    const int64_t k2 = static_cast<int64_t>(c2_idx.size());
    info.c2 = k2;
    if (params_.scan > 0 && info.scanned > 0) {
      int64_t from_scan = 0;
      for (int32_t j : c2_idx) from_scan += !std::binary_search(hist.begin(), hist.end(), c1[j]);
      scan_period_ = 16 * from_scan >= k2 ? 1 : std::min(2 * scan_period_, params_.scan_max_period);
    }
    std::fill(w.begin(), w.begin() + k2, 0.0f);
    std::vector<float> probs(static_cast<size_t>(k2));
    for (int g = 0; g < group; ++g) {
      for (int64_t j = 0; j < k2; ++j) probs[j] = logits[g * ld + c2_idx[j]];
      cpu::SoftmaxAccumulate(probs.data(), k2, 1.0f / static_cast<float>(group), w.data());
    }
    scale_ *= params_.r;
    const double inv_scale = 1.0 / scale_;
    const double base = 1.0 / (2.0 * static_cast<double>(k2));
    std::vector<int32_t> c2;
    for (int64_t j = 0; j < k2; ++j) {
      const int64_t pos = c1[c2_idx[j]];
      c2.push_back(static_cast<int32_t>(pos));
      const double delta = (w[j] - base) * inv_scale;
      Add(ver_, ver_pow_, pos, delta);
      Add(sla_, sla_pow_, t - pos, delta);
    }
    if (scale_ < 1e-6) {
      for (float& x : ver_) x = static_cast<float>(x * scale_);
      for (float& x : sla_) x = static_cast<float>(x * scale_);
      scale_ = 1.0;
      Resync();
    }
    finish(&c2);
  }

  void TableSums(double* ver, double* sla) const {
    double sv = 0.0, ss = 0.0;
    for (float x : ver_) sv += x;
    for (float x : sla_) ss += x;
    *ver = sv * scale_;
    *sla = ss * scale_;
  }

 private:
  struct Threshold {
    bool ok = false;
    float tau = 0.0f, mean = 0.0f;
  };
  Threshold ComputeThreshold(const double* pw, int64_t count) const {
    Threshold th;
    if (count <= 0) return th;
    const double n = static_cast<double>(count);
    const double m = pw[1] / n;
    const double m2 = pw[2] - n * m * m;
    const double m4 = pw[4] - 4.0 * m * pw[3] + 6.0 * m * m * pw[2] - 3.0 * n * m * m * m * m;
    if (!(m2 > 0.0) || !(m4 > 0.0)) return th;
    const double kurt = m4 / (m2 * m2);
    th.ok = std::isfinite(kurt) && kurt > 0.0;
    th.tau = static_cast<float>(params_.a * m / kurt);
    th.mean = static_cast<float>(m);
    return th;
  }
  void Extend(int64_t n) {
    if (static_cast<int64_t>(ver_.size()) < n) ver_.resize(static_cast<size_t>(n), 0.0f);
    if (static_cast<int64_t>(sla_.size()) < n) sla_.resize(static_cast<size_t>(n), 0.0f);
  }
  static void PowerSums(const std::vector<float>& u, double* pw) {
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
  void Resync() {
    PowerSums(ver_, ver_pow_);
    PowerSums(sla_, sla_pow_);
  }
  static void Add(std::vector<float>& u, double* pw, int64_t i, double delta) {
    const double old = u[i];
    u[i] = static_cast<float>(old + delta);
    const double stored = u[i];
    double o = old, s = stored;
    for (int k = 1; k <= 4; ++k) {
      pw[k] += s - o;
      o *= old;
      s *= stored;
    }
  }

  // The scan's int8 shadow: scales from the rows stored when it is made (at OnPrefill, else at the
  // first scan), rows added as they come.
  void Shadow(const AttnParams& p, const KvPages& kv, int64_t n) {
    const size_t elem = DTypeSize(p.kv_dtype);
    if (k8_.empty()) {
      k8_.resize(static_cast<size_t>(p.head_dim));
      k8_scale_.assign(static_cast<size_t>(p.head_dim), 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        const void* k = PagedKRow(kv, i, p.head_dim, elem);
        for (int c = 0; c < p.head_dim; ++c) {
          k8_scale_[c] = std::max(k8_scale_[c], std::fabs(cpu::LoadAsF32(k, p.kv_dtype, c)));
        }
      }
      for (float& x : k8_scale_) x = x > 0.0f && std::isfinite(x) ? x : 1.0f;
    }
    for (int64_t i = static_cast<int64_t>(k8_[0].size()); i < n; ++i) {
      const void* k = PagedKRow(kv, i, p.head_dim, elem);
      for (int c = 0; c < p.head_dim; ++c) {
        const float v = cpu::LoadAsF32(k, p.kv_dtype, c) * (127.0f / k8_scale_[c]);
        k8_[c].push_back(static_cast<int8_t>(std::lrint(std::clamp(v == v ? v : 0.0f, -127.0f, 127.0f))));
      }
    }
  }

  LfpsParams params_;
  std::vector<std::vector<int8_t>> k8_;
  std::vector<float> k8_scale_;
  int scan_period_ = 1, since_scan_ = 0;
  std::vector<float> ver_, sla_, k_bar_;
  double scale_ = 1.0, sigma2_hat_ = 0.0;
  double ver_pow_[5] = {0, 0, 0, 0, 0}, sla_pow_[5] = {0, 0, 0, 0, 0};
  bool primed_ = false;
};

// ---- the workload ------------------------------------------------------------------------------
constexpr int kHd = 64;
constexpr int kPage = 64;

// A bf16 KV head in the host store's page layout, filled for the whole run up front.
class KvHead {
 public:
  explicit KvHead(int64_t capacity) {
    const int64_t pages = (capacity + kPage - 1) / kPage;
    storage_.resize(static_cast<size_t>(pages));
    for (auto& s : storage_) {
      s.assign(static_cast<size_t>(2) * kPage * kHd, 0);
      ptrs_.push_back(s.data());
    }
    kv_.pages = ptrs_.data();
    kv_.page_tokens = kPage;
  }
  void Set(int64_t pos, const float* k, const float* v) {
    uint16_t* page = storage_[pos / kPage].data();
    const int64_t row = pos % kPage;
    for (int d = 0; d < kHd; ++d) {
      page[row * kHd + d] = cpu::F32ToBf16(k[d]);
      page[(kPage + row) * kHd + d] = cpu::F32ToBf16(v[d]);
    }
  }
  const KvPages& kv() const { return kv_; }

 private:
  std::vector<std::vector<uint16_t>> storage_;
  std::vector<void*> ptrs_;
  KvPages kv_;
};

struct Case {
  int64_t n0;      // context at the first decode step
  int group;
  int sink, window;
  double budget_frac;  // budget = ceil(frac * n) + resident
  double a, r;
  bool prime, fallback;
  double eps;
  int steps;
  bool sink_heavy = false;  // sink keys along the direction: sink-dominated stints (bypass)
  // The budget-filling stages (defaults: the paper, none of them).
  double fill = 0.0;
  int rank = 0, scan = 0;
  double scan_factor = 2.0;
  int scan_max_period = 8;
  int threads = 1;  // SelectContext::threads
};

// Keys: noise, a few "retrieval" keys along a hidden direction that the queries follow in stints
// (so the tables have something to learn and forget), runs of identical keys (exact weight ties)
// and some all-zero keys (ties at logit 0). The first offloaded positions are retrieval keys, so the
// lower edge of the offloaded range is hot too.
void FillHead(std::mt19937& rng, KvHead& head, int64_t total, int sink, bool sink_heavy,
              const std::vector<float>& dir) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> k(kHd), v(kHd), dup(kHd);
  int dup_left = 0;
  for (int64_t i = 0; i < total; ++i) {
    for (int d = 0; d < kHd; ++d) v[d] = nd(rng);
    const float r = u(rng);
    if (sink_heavy && i < sink) {
      for (int d = 0; d < kHd; ++d) k[d] = 0.3f * nd(rng) + 4.0f * dir[d];
    } else if (dup_left > 0) {
      k = dup;
      --dup_left;
    } else if (r < 0.01f) {
      for (int d = 0; d < kHd; ++d) k[d] = 0.0f;
    } else if (r < 0.03f) {
      for (int d = 0; d < kHd; ++d) dup[d] = nd(rng) + 2.0f * dir[d];
      k = dup;
      dup_left = 1 + static_cast<int>(u(rng) * 6);
    } else {
      const float align = r < 0.06f || (i >= sink && i < sink + 3) ? 3.0f : 0.0f;
      for (int d = 0; d < kHd; ++d) k[d] = nd(rng) + align * dir[d];
    }
    head.Set(i, k.data(), v.data());
  }
}

AttnParams Params(int group) {
  AttnParams p;
  p.group = group;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  return p;
}

// What the steps of a run covered.
struct Coverage {
  int64_t over_k = 0, under_k = 0, fallback = 0, bypassed = 0, big_c1 = 0, scanned = 0,
          filled = 0, full = 0, rescued = 0;
};

void RunCase(const Case& c, uint32_t seed, Coverage* cov) {
  SCOPED_TRACE(testing::Message() << "seed " << seed << " n0 " << c.n0 << " group " << c.group
                                  << " sink " << c.sink << " window " << c.window << " budget "
                                  << c.budget_frac << " a " << c.a << " r " << c.r << " prime "
                                  << c.prime << " fallback " << c.fallback << " eps " << c.eps);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  constexpr int kHeads = 2;
  const int64_t total = c.n0 + c.steps;
  LfpsParams lp;
  lp.a = c.a;
  lp.r = c.r;
  lp.eps = c.eps;
  lp.fallback = c.fallback;
  lp.fill = c.fill;
  lp.rank = c.rank;
  lp.scan = c.scan;
  lp.scan_factor = c.scan_factor;
  lp.scan_max_period = c.scan_max_period;
  LfpsPolicy policy(lp, 1, 1, kHeads, total);
  std::vector<ReferenceLfps> refs(kHeads, ReferenceLfps(lp));
  std::vector<KvHead> heads;
  std::vector<std::vector<float>> dirs;
  for (int h = 0; h < kHeads; ++h) {
    heads.emplace_back(total);
    std::vector<float> dir(kHd);
    for (float& x : dir) x = nd(rng);
    FillHead(rng, heads.back(), total, c.sink, c.sink_heavy, dir);
    dirs.push_back(dir);
  }
  const AttnParams p = Params(c.group);
  if (c.prime) {
    const int rows = 24;
    for (int h = 0; h < kHeads; ++h) {
      std::vector<float> q(static_cast<size_t>(rows) * c.group * kHd);
      for (size_t i = 0; i < q.size(); ++i) q[i] = nd(rng) + 1.5f * dirs[h][i % kHd];
      PrefillContext pc;
      pc.kv_head = h;
      pc.q_pos0 = c.n0 - 1 - rows;
      pc.num_q = rows;
      pc.n = c.n0 - 1;
      pc.sink = c.sink;
      pc.window = c.window;
      pc.q = q.data();
      pc.params = p;
      pc.kv = heads[h].kv();
      ASSERT_TRUE(policy.OnPrefill(pc).ok());
      refs[h].OnPrefill(pc);
    }
  }
  std::vector<int32_t> got, want;
  std::vector<float> q(static_cast<size_t>(c.group) * kHd);
  for (int step = 0; step < c.steps; ++step) {
    const int64_t n = c.n0 + step;
    const float follow = (step / 7) % 3 == 0 ? 0.0f : 2.0f;  // stints on / off the direction
    for (int h = 0; h < kHeads; ++h) {
      for (size_t i = 0; i < q.size(); ++i) q[i] = 1.5f * nd(rng) + follow * dirs[h][i % kHd];
      SelectContext ctx;
      ctx.kv_head = h;
      ctx.n = n;
      ctx.sink = c.sink;
      ctx.window = c.window;
      ctx.budget = static_cast<int64_t>(std::ceil(c.budget_frac * n)) + c.sink + c.window;
      ctx.q = q.data();
      ctx.params = p;
      ctx.kv = heads[h].kv();
      ctx.threads = c.threads;
      LfpsStepInfo gi, wi;
      ASSERT_TRUE(policy.SelectWithInfo(ctx, got, &gi).ok());
      refs[h].Select(ctx, want, &wi);
      ASSERT_EQ(got, want) << "step " << step << " head " << h << " c1 " << wi.c1 << " c2 "
                           << wi.c2;
      ASSERT_EQ(gi.all, wi.all) << "step " << step;
      ASSERT_EQ(gi.bypassed, wi.bypassed) << "step " << step;
      ASSERT_EQ(gi.fallback, wi.fallback) << "step " << step;
      ASSERT_EQ(gi.rescued, wi.rescued) << "step " << step;
      ASSERT_EQ(gi.rho, wi.rho) << "step " << step;
      ASSERT_EQ(gi.offloaded, wi.offloaded) << "step " << step;
      ASSERT_EQ(gi.c0, wi.c0) << "step " << step;
      ASSERT_EQ(gi.c1, wi.c1) << "step " << step;
      ASSERT_EQ(gi.c2, wi.c2) << "step " << step;
      ASSERT_EQ(gi.scanned, wi.scanned) << "step " << step;
      ASSERT_EQ(gi.filled, wi.filled) << "step " << step;
      const int64_t k = ctx.budget - c.sink - c.window;
      cov->over_k += wi.c1 > k;
      cov->under_k += wi.c1 > 0 && wi.c1 <= k;
      cov->fallback += wi.fallback;
      cov->rescued += wi.rescued;
      cov->bypassed += wi.bypassed;
      cov->big_c1 += wi.c1 > k && wi.c1 >= 2048;
      cov->scanned += wi.scanned > 0;
      cov->filled += wi.filled > 0;
      cov->full += !wi.all && !wi.bypassed && wi.c2 == k;
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    double gv = 0, gs = 0, wv = 0, ws = 0;
    ASSERT_TRUE(policy.TableSums(0, 0, h, &gv, &gs));
    refs[h].TableSums(&wv, &ws);
    EXPECT_EQ(gv, wv);
    EXPECT_EQ(gs, ws);
  }
}

TEST(LfpsEquivalenceTest, SmallContextsEveryGqaRatio) {
  // n0, group, sink, window, budget_frac, a, r, prime, fallback, eps, steps, sink_heavy
  const Case cases[] = {
      {97, 1, 4, 16, 0.02, 0.2, 0.95, true, true, 0.85, 120, true},
      {97, 3, 1, 0, 0.3, 0.2, 0.5, false, true, 2.0, 120},
      {1000, 4, 4, 64, 0.02, 0.2, 0.95, true, true, 0.85, 150},
      {1000, 8, 0, 32, 0.4, 0.05, 0.5, true, false, 2.0, 150},
      {4099, 3, 4, 64, 0.01, 0.2, 0.9, true, true, 0.85, 120, true},
      {4099, 1, 4, 17, 0.5, 1.0, 0.5, false, true, 0.3, 120},
      {2049, 8, 2, 63, 0.05, 0.05, 0.6, true, true, 2.0, 120},
      {777, 4, 4, 64, 0.15, 0.2, 0.5, false, false, 0.85, 150},
  };
  uint32_t seed = 100;
  Coverage cov;
  for (const Case& c : cases) {
    RunCase(c, seed++, &cov);
    if (HasFatalFailure()) return;
  }
  // The workload reaches every branch: |C1| > k and <= k, the fallback and the bypass.
  EXPECT_GT(cov.over_k, 100);
  EXPECT_GT(cov.under_k, 100);
  EXPECT_GT(cov.fallback, 0);
  EXPECT_GT(cov.bypassed, 0);
}

// The budget-filling stages (resident-normalised ranking, the int8 channel scan with its adaptive
// period, the fill from the tables) against the reference, step by step.
TEST(LfpsEquivalenceTest, ScanFillAndRanking) {
  // n0, group, sink, window, budget_frac, a, r, prime, fallback, eps, steps, sink_heavy,
  // fill, rank, scan, scan_factor, scan_max_period
  const Case cases[] = {
      {1000, 4, 4, 64, 0.05, 0.2, 0.95, true, true, 0.85, 150, false, 1.0, 1, 16, 2.0, 8},
      {777, 3, 4, 16, 0.1, 0.4, 0.9, true, true, 2.0, 150, true, 1.0, 1, 8, 1.0, 1},
      {2049, 1, 2, 63, 0.03, 0.2, 0.95, false, true, 0.85, 120, false, 2.0, 1, 5, 3.0, 4},
      {4099, 8, 4, 64, 0.02, 0.2, 0.95, true, false, 2.0, 120, false, 1.0, 0, 16, 0.5, 16},
      {1500, 4, 0, 32, 0.2, 1.0, 0.5, true, true, 2.0, 120, false, 1.5, 1, 0, 2.0, 8},
  };
  uint32_t seed = 300;
  Coverage cov;
  for (const Case& c : cases) {
    RunCase(c, seed++, &cov);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(cov.scanned, 100);
  EXPECT_GT(cov.filled, 20);
  EXPECT_GT(cov.rescued, 0);  // no candidate from the tables: the scan nominates them
  EXPECT_GT(cov.full, 300);  // the selection uses the whole budget
}

// Large enough that |C1| and the fallback's full candidate set take the histogram top-k path, and
// that the tables span many filter blocks.
TEST(LfpsEquivalenceTest, LargeContexts) {
  const Case cases[] = {
      {20011, 4, 4, 64, 0.02, 0.05, 0.95, true, true, 2.0, 60},
      {12289, 3, 4, 64, 0.02, 0.2, 0.5, false, true, 0.85, 60},
      {9001, 8, 0, 0, 0.1, 0.02, 0.7, true, true, 2.0, 60},
      {16384, 1, 4, 64, 0.3, 0.05, 0.5, true, true, 2.0, 60},
  };
  uint32_t seed = 200;
  Coverage cov;
  for (const Case& c : cases) {
    RunCase(c, seed++, &cov);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(cov.big_c1, 20);
  EXPECT_GT(cov.under_k, 20);
}

// The scan over contexts large enough for its sampled collection threshold and for its split into
// ranges over threads (SelectContext::threads), step by step against the reference.
TEST(LfpsEquivalenceTest, ScanLargeContexts) {
  // n0, group, sink, window, budget_frac, a, r, prime, fallback, eps, steps, sink_heavy,
  // fill, rank, scan, scan_factor, scan_max_period, threads
  const Case cases[] = {
      {20011, 4, 4, 64, 0.02, 0.2, 0.95, true, true, 0.85, 40, false, 1.0, 1, 16, 2.0, 8, 4},
      {33001, 8, 4, 256, 0.02, 0.2, 0.95, true, true, 2.0, 30, false, 1.0, 1, 16, 2.0, 1, 3},
      {17000, 1, 4, 64, 0.05, 0.1, 0.9, false, true, 0.85, 30, false, 0.0, 0, 5, 1.0, 2, 1},
      {24577, 3, 0, 32, 0.01, 0.2, 0.95, true, false, 2.0, 30, true, 1.0, 1, 64, 4.0, 4, 2},
  };
  uint32_t seed = 400;
  Coverage cov;
  for (const Case& c : cases) {
    RunCase(c, seed++, &cov);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(cov.scanned, 60);
}

}  // namespace
}  // namespace kvferry
