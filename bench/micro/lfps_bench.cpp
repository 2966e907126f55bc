// Copyright kvferry authors. Apache-2.0.
// LFPS vs exact top-k on one core, same queries, at 4K/16K/64K/128K tokens, plus quality:
// recall of the exact top-k, |C1|/n (keys given an exact q.k), bypassed heads, attention-mass
// recall and the relative L2 error of the output vs dense attention. Written as JSON.
//
// Workload: the shared synthetic generator of kvferry-bench (bench/lib/synthetic.h,
// kvferry::bench::SyntheticWorkload; seeded, 32 query / 8 KV heads, head_dim 128): sinks, local
// decay through a shared content vector under RoPE, heavy-tailed channels and retrieval targets
// that queries switch on for stints of steps. One layer, one sequence; K/V are generated for the
// whole run up front (in parallel, bit-identical to a serial generation) and stored as bf16 in the
// host store's page layout; step t appends nothing but reveals position t (n grows by one).
// Usage: lfps_bench [out.json] [--quick] [--tokens N (one context length only)]
//                   [--steps N (measured decode steps; default 24, 12 with --quick)]
//                   [--param name=value ... (LFPS parameters; the paper: rank=0 fill=0 scan=0)]
// recall_exact_topk is against the oracle's ranking (the group's summed softmax over all n keys,
// offloaded part); recall_offloaded_softmax_topk against the timed baseline's set (softmax over the
// offloaded keys only, the definition used before issue 12).
//
// Real traces: lfps_bench --trace T.safetensors [--from P] [--budgets 82,128,205,256,512]
//   [--layers 4,8] [--param name=value ...] [--label L] [--detail-budget B] [--json OUT]
// replays a kvferry-llama trace (docs/llama.md) teacher-forced, every layer and KV head, and writes
// recall, mass, keys scored and where the exact top-k positions were lost (see RunReplay).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <thread>

#include "bench/lib/safetensors.h"
#include "bench/lib/trace_kv.h"
#include "bench/lib/synthetic.h"
#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "policies/basic.h"
#include "policies/lfps/lfps.h"

namespace kvferry {
namespace {

constexpr int kHd = 128, kGroup = 4, kPage = 256, kSink = 4, kWindow = 64;
constexpr double kBudgetFrac = 0.02;

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One KV head's rows in the host store's page layout; n() grows by one per decode step (the rows
// themselves are all generated up front).
class SynthHead {
 public:
  explicit SynthHead(int64_t capacity) {
    const int64_t pages = (capacity + kPage - 1) / kPage;
    for (int64_t p = 0; p < pages; ++p) {
      pages_.emplace_back(new uint16_t[static_cast<size_t>(2) * kPage * kHd]);
      ptrs_.push_back(pages_.back().get());
    }
    kv_.pages = ptrs_.data();
    kv_.page_tokens = kPage;
  }
  void Store(int64_t pos, const float* k, const float* v) {
    uint16_t* page = pages_[pos / kPage].get();
    const int64_t row = pos % kPage;
    for (int d = 0; d < kHd; ++d) {
      page[row * kHd + d] = cpu::F32ToBf16(k[d]);
      page[(kPage + row) * kHd + d] = cpu::F32ToBf16(v[d]);
    }
  }
  void SetN(int64_t n) { n_ = n; }
  void Append() { ++n_; }
  int64_t n() const { return n_; }
  const KvPages& kv() const { return kv_; }

 private:
  std::vector<std::unique_ptr<uint16_t[]>> pages_;
  std::vector<void*> ptrs_;
  KvPages kv_;
  int64_t n_ = 0;
};

// Generates K/V of positions [0, total) for every KV head into heads, in parallel chunks.
void Generate(const bench::SyntheticWorkload& wl, int64_t total,
              std::vector<std::unique_ptr<SynthHead>>& heads) {
  const int hkv = wl.shape().num_kv_heads;
  const int nt = std::max(1, std::min(32, static_cast<int>(std::thread::hardware_concurrency())));
  std::vector<std::thread> th;
  for (int w = 0; w < nt; ++w) {
    th.emplace_back([&, w] {
      constexpr int64_t kChunk = 256;
      std::vector<float> k(static_cast<size_t>(kChunk) * hkv * kHd), v(k.size());
      for (int64_t p0 = static_cast<int64_t>(w) * kChunk; p0 < total; p0 += kChunk * nt) {
        const int64_t cnt = std::min(kChunk, total - p0);
        wl.KeysValues(0, p0, cnt, k.data(), v.data());
        for (int64_t t = 0; t < cnt; ++t) {
          for (int h = 0; h < hkv; ++h) {
            const size_t off = (static_cast<size_t>(t) * hkv + h) * kHd;
            heads[h]->Store(p0 + t, k.data() + off, v.data() + off);
          }
        }
      }
    });
  }
  for (auto& t : th) t.join();
}

AttnParams Params() {
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  return p;
}

// The exact top-k baseline on the offloaded range: score every key, group-summed softmax, top-k.
void ExactTopK(const SynthHead& h, const float* q, int64_t k_off, std::vector<float>& logits,
               std::vector<float>& w, std::vector<int32_t>& out) {
  const AttnParams p = Params();
  const int64_t n = h.n(), lo = kSink, hi = n - kWindow, m = hi - lo;
  logits.resize(static_cast<size_t>(kGroup) * m);
  w.assign(static_cast<size_t>(m), 0.0f);
  cpu::ScoreRange(p, q, h.kv(), lo, hi, logits.data(), m);
  // Same vectorised softmax as LFPS uses, so the baseline is not handicapped by scalar exp.
  for (int g = 0; g < kGroup; ++g) cpu::SoftmaxAccumulate(logits.data() + g * m, m, 1.0f, w.data());
  out.resize(static_cast<size_t>(k_off));
  cpu::TopK(w.data(), m, k_off, out.data());
  for (int32_t& x : out) x += static_cast<int32_t>(lo);
  std::sort(out.begin(), out.end());
}

std::string Fmt(double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.4g", x);
  return buf;
}

// ---- Real-trace replay (--trace): teacher-forced decode over a kvferry-llama attention trace ----
// Every layer and KV head of the trace: the policy is primed at position `from` from the last
// prefill chunk's queries (as the runtime does), then steps t = from .. T-1 with the trace's query
// of t over the keys [0, t]. Against the exact attention of the group (softmax over all t + 1 keys,
// summed over the group's query heads) it measures, per budget: recall of the exact top-k over the
// offloaded range (the paper's eta), recall of the oracle's top-budget set over all positions
// (kvferry-bench's metric), attention mass kept, keys scored, and where the missed exact top-k
// positions were lost. Exact top-k (score every offloaded key) is timed on the same steps.

struct ReplayOptions {
  std::string trace, out, label = "lfps";
  int64_t from = -1;
  std::vector<int64_t> budgets{82, 128, 205, 256, 512};
  std::map<std::string, double> params;
  int sink = 4, window = 64, chunk = 512;
  int64_t detail_budget = 256;
  DType kv_dtype = DType::kF16;
  std::vector<int64_t> layers;  // empty: all traced layers
};

// Why an exact top-k position was not chosen.
enum Loss { kBypass, kRankedOut, kMeanFilter, kBelowTau, kLeftWindow, kNoHistory, kNumLoss };
const char* const kLossNames[kNumLoss] = {"bypass",   "ranked_out",  "mean_filter",
                                          "below_tau", "left_window", "no_history"};

struct Tally {
  int64_t steps = 0, bypassed = 0, fallbacks = 0, all = 0;
  double recall_off = 0, recall_all = 0, mass = 0, scored = 0, offloaded = 0, attended = 0;
  double stream_recall_off = 0, stream_recall_all = 0, stream_mass = 0, oracle_mass = 0;
  double fresh = 0;  // exact top-k positions not in the previous step's exact top-k
  double target = 0;  // exact top-k positions (sum of k_off)
  double loss[kNumLoss] = {};
  double lfps_s = 0, exact_s = 0;
  void Add(const Tally& o) {
    steps += o.steps, bypassed += o.bypassed, fallbacks += o.fallbacks, all += o.all;
    recall_off += o.recall_off, recall_all += o.recall_all, mass += o.mass, scored += o.scored;
    offloaded += o.offloaded, attended += o.attended;
    stream_recall_off += o.stream_recall_off, stream_recall_all += o.stream_recall_all;
    stream_mass += o.stream_mass, oracle_mass += o.oracle_mass, fresh += o.fresh;
    target += o.target;
    for (int i = 0; i < kNumLoss; ++i) loss[i] += o.loss[i];
    lfps_s += o.lfps_s, exact_s += o.exact_s;
  }
  std::string Json() const {
    const double st = std::max<int64_t>(steps, 1);
    std::string j = "{\"steps\": " + std::to_string(steps) +
                    ", \"recall_off\": " + Fmt(recall_off / st) +
                    ", \"recall_all\": " + Fmt(recall_all / st) + ", \"mass\": " + Fmt(mass / st) +
                    ", \"scored_frac\": " + Fmt(scored / std::max(offloaded, 1.0)) +
                    ", \"attended\": " + Fmt(attended / st) +
                    ", \"bypass_frac\": " + Fmt(bypassed / st) +
                    ", \"fallback_frac\": " + Fmt(fallbacks / st) +
                    ", \"streaming_recall_off\": " + Fmt(stream_recall_off / st) +
                    ", \"streaming_recall_all\": " + Fmt(stream_recall_all / st) +
                    ", \"streaming_mass\": " + Fmt(stream_mass / st) +
                    ", \"oracle_mass\": " + Fmt(oracle_mass / st) +
                    ", \"fresh_frac\": " + Fmt(fresh / std::max(target, 1.0)) +
                    ", \"lfps_select_ms\": " + Fmt(lfps_s / st * 1e3) +
                    ", \"exact_topk_ms\": " + Fmt(exact_s / st * 1e3) +
                    ", \"speedup\": " + Fmt(exact_s / std::max(lfps_s, 1e-12)) + ", \"lost\": {";
    for (int i = 0; i < kNumLoss; ++i) {
      j += std::string(i ? ", " : "") + "\"" + kLossNames[i] + "\": " +
           Fmt(loss[i] / std::max(target, 1.0));
    }
    return j + "}}";
  }
};

using bench::TraceHead;

int RunReplay(const ReplayOptions& o) {
  const double t_load = Seconds();
  auto tr = bench::LoadTrace(o.trace);
  if (!tr.ok()) {
    std::fprintf(stderr, "error: %s\n", tr.status().ToString().c_str());
    return 1;
  }
  bench::Trace& trace = tr.value();
  if (!bench::KeepTraceLayers(trace, o.layers)) {
    std::fprintf(stderr, "error: --layers selects no traced layer\n");
    return 1;
  }
  const bench::TraceLayer& l0 = trace.layers.at(0);
  const int64_t T = l0.num_tokens;
  const int hq = l0.num_q_heads, hkv = l0.num_kv_heads, d = l0.head_dim, group = hq / hkv;
  const int64_t from = o.from > 0 ? o.from : T - 1024;
  std::fprintf(stderr, "trace %s: %zu layers, T %lld, heads %d/%d, d %d, loaded in %.1f s\n",
               o.trace.c_str(), trace.layers.size(), static_cast<long long>(T), hq, hkv, d,
               Seconds() - t_load);
  RuntimeConfig rc;
  rc.capacity.max_sequences = 1;
  rc.model.num_layers = 1;
  rc.model.num_kv_heads = hkv;
  rc.capacity.max_tokens_per_sequence = T;
  rc.policy.name = "lfps";
  rc.policy.params = o.params;
  if (auto chk = MakeLfpsPolicy(rc); !chk.ok()) {
    std::fprintf(stderr, "error: %s\n", chk.status().ToString().c_str());
    return 1;
  }
  AttnParams p;
  p.group = group;
  p.head_dim = d;
  p.kv_dtype = o.kv_dtype;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  const size_t nb = o.budgets.size();
  std::vector<Tally> total(nb);
  std::vector<std::vector<Tally>> per_head(trace.layers.size() * hkv, std::vector<Tally>(nb));
  std::vector<float> logits, w, w_off, ex_logits, ex_w, qbuf(static_cast<size_t>(group) * d);
  std::vector<int32_t> order, out, ex_set, stream_sel, oracle_set;
  std::vector<std::vector<std::vector<char>>> prev_top(
      nb, std::vector<std::vector<char>>(hkv, std::vector<char>(static_cast<size_t>(T), 0)));
  std::vector<char> in_out(static_cast<size_t>(T)), in_c1(static_cast<size_t>(T)),
      in_c0(static_cast<size_t>(T) + 4);
  for (size_t li = 0; li < trace.layers.size(); ++li) {
    const bench::TraceLayer& L = trace.layers[li];
    std::vector<std::unique_ptr<TraceHead>> heads;
    for (int h = 0; h < hkv; ++h) heads.push_back(std::make_unique<TraceHead>(L, h, o.kv_dtype));
    std::vector<std::unique_ptr<Policy>> pols;
    for (size_t b = 0; b < nb; ++b) pols.push_back(std::move(MakeLfpsPolicy(rc).value()));
    for (auto& v : prev_top) for (auto& x : v) std::fill(x.begin(), x.end(), 0);
    // Prime from the last prefill chunk [chunk0, from).
    const int64_t chunk0 = std::max<int64_t>(0, ((from - 1) / o.chunk) * o.chunk);
    std::vector<float> pq(static_cast<size_t>(from - chunk0) * group * d);
    for (int h = 0; h < hkv; ++h) {
      for (int64_t t = chunk0; t < from; ++t) {
        std::copy_n(L.q.data() + (t * hq + h * group) * d, group * d,
                    pq.data() + (t - chunk0) * group * d);
      }
      PrefillContext pc;
      pc.kv_head = h;
      pc.q_pos0 = chunk0;
      pc.num_q = static_cast<int32_t>(from - chunk0);
      pc.n = from;
      pc.sink = o.sink;
      pc.window = o.window;
      pc.q = pq.data();
      pc.params = p;
      pc.kv = heads[h]->kv();
      for (auto& pol : pols) {
        if (Status s = pol->OnPrefill(pc); !s.ok()) {
          std::fprintf(stderr, "error: prefill: %s\n", s.ToString().c_str());
          return 1;
        }
      }
    }
    for (int64_t t = from; t < T; ++t) {
      const int64_t n = t + 1, lo = o.sink, hi = std::max<int64_t>(lo, n - o.window), m = hi - lo;
      for (int h = 0; h < hkv; ++h) {
        std::copy_n(L.q.data() + (t * hq + h * group) * d, group * d, qbuf.data());
        // Exact attention of the group over [0, n).
        logits.resize(static_cast<size_t>(group) * n);
        w.assign(static_cast<size_t>(n), 0.0f);
        cpu::ScoreRange(p, qbuf.data(), heads[h]->kv(), 0, n, logits.data(), n);
        for (int g = 0; g < group; ++g) cpu::SoftmaxAccumulate(logits.data() + g * n, n, 1.0f, w.data());
        order.resize(static_cast<size_t>(m));
        std::iota(order.begin(), order.end(), static_cast<int32_t>(lo));
        const int64_t kmax = std::min<int64_t>(m, o.budgets.back());
        std::partial_sort(order.begin(), order.begin() + kmax, order.end(), [&](int32_t a, int32_t b) {
          return w[a] != w[b] ? w[a] > w[b] : a < b;
        });
        std::vector<int32_t> all_order(static_cast<size_t>(n));
        std::iota(all_order.begin(), all_order.end(), 0);
        const int64_t amax = std::min<int64_t>(n, o.budgets.back());
        std::partial_sort(all_order.begin(), all_order.begin() + amax, all_order.end(),
                          [&](int32_t a, int32_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; });
        double oracle_mass_unused = 0;
        (void)oracle_mass_unused;
        for (size_t b = 0; b < nb; ++b) {
          const int64_t budget = o.budgets[b];
          const int64_t k_off = std::min<int64_t>(m, budget - o.sink - (n - hi));
          Tally& ta = per_head[li * hkv + h][b];
          SelectContext ctx;
          ctx.kv_head = h;
          ctx.n = n;
          ctx.sink = o.sink;
          ctx.window = o.window;
          ctx.budget = budget;
          ctx.q = qbuf.data();
          ctx.params = p;
          ctx.kv = heads[h]->kv();
          LfpsStepInfo info;
          LfpsStepDetail dbg;
          dbg.probe.assign(order.begin(), order.begin() + std::max<int64_t>(0, k_off));
          std::sort(dbg.probe.begin(), dbg.probe.end());
          auto& lfps = static_cast<LfpsPolicy&>(*pols[b]);
          const double t0 = Seconds();
          if (Status s = lfps.SelectWithInfo(ctx, out, &info, &dbg); !s.ok()) {
            std::fprintf(stderr, "error: select: %s\n", s.ToString().c_str());
            return 1;
          }
          const double t1 = Seconds();
          // The timed exact top-k baseline over the offloaded range.
          if (k_off > 0) {
            ex_logits.resize(static_cast<size_t>(group) * m);
            ex_w.assign(static_cast<size_t>(m), 0.0f);
            ex_set.resize(static_cast<size_t>(k_off));
            const double t2 = Seconds();
            cpu::ScoreRange(p, qbuf.data(), heads[h]->kv(), lo, hi, ex_logits.data(), m);
            for (int g = 0; g < group; ++g) {
              cpu::SoftmaxAccumulate(ex_logits.data() + g * m, m, 1.0f, ex_w.data());
            }
            cpu::TopK(ex_w.data(), m, k_off, ex_set.data());
            ta.exact_s += Seconds() - t2;
          }
          ta.lfps_s += t1 - t0;
          ++ta.steps;
          ta.bypassed += info.bypassed;
          ta.fallbacks += info.fallback;
          ta.all += info.all;
          ta.scored += static_cast<double>(info.c1);
          ta.offloaded += static_cast<double>(info.offloaded);
          ta.attended += static_cast<double>(out.size());
          for (int32_t x : out) in_out[x] = 1;
          double mass = 0;
          for (int32_t x : out) mass += w[x];
          ta.mass += mass / group;
          // Recall of the oracle's top-budget over everything.
          const int64_t ka = std::min<int64_t>(n, budget);
          int64_t hit_all = 0;
          double omass = 0;
          for (int64_t i = 0; i < ka; ++i) hit_all += in_out[all_order[i]], omass += w[all_order[i]];
          ta.recall_all += static_cast<double>(hit_all) / ka;
          ta.oracle_mass += omass / group;
          // Streaming at the same budget.
          StreamingSelect(n, o.sink, budget, stream_sel);
          double smass = 0;
          int64_t s_all = 0, s_off = 0;
          for (int32_t x : stream_sel) smass += w[x];
          {
            std::vector<char>& mark = in_c1;  // reuse as scratch
            for (int32_t x : stream_sel) mark[x] = 1;
            for (int64_t i = 0; i < ka; ++i) s_all += mark[all_order[i]];
            for (int64_t i = 0; i < k_off; ++i) s_off += mark[order[i]];
            for (int32_t x : stream_sel) mark[x] = 0;
          }
          ta.stream_mass += smass / group;
          ta.stream_recall_all += static_cast<double>(s_all) / ka;
          if (k_off > 0) {
            ta.stream_recall_off += static_cast<double>(s_off) / k_off;
            // Recall of the exact top-k_off and why the misses were lost.
            for (int32_t x : dbg.c1) in_c1[x] = 1;
            for (int32_t x : dbg.c0) in_c0[x] = 1;
            int64_t hit = 0;
            std::vector<char>& prev = prev_top[b][h];
            for (size_t i = 0; i < dbg.probe.size(); ++i) {
              const int32_t j = dbg.probe[i];
              ta.fresh += prev[j] == 0;
              if (in_out[j]) {
                ++hit;
                continue;
              }
              Loss why;
              if (info.bypassed) {
                why = kBypass;
              } else if (in_c1[j]) {
                why = kRankedOut;
              } else if (in_c0[j + 1] || in_c0[j] || (j >= 1 && in_c0[j - 1]) || (j >= 2 && in_c0[j - 2])) {
                why = kMeanFilter;
              } else if (dbg.probe_ver[i] > 0 || dbg.probe_sla[i] > 0) {
                why = kBelowTau;
              } else if (j >= hi - 32) {
                why = kLeftWindow;
              } else {
                why = kNoHistory;
              }
              ta.loss[why] += 1;
            }
            ta.target += static_cast<double>(dbg.probe.size());
            ta.recall_off += static_cast<double>(hit) / k_off;
            for (int32_t x : dbg.c1) in_c1[x] = 0;
            for (int32_t x : dbg.c0) in_c0[x] = 0;
            std::fill(prev.begin(), prev.end(), 0);
            for (int32_t j : dbg.probe) prev[j] = 1;
          } else {
            ta.recall_off += 1.0;
            ta.stream_recall_off += 1.0;
          }
          for (int32_t x : out) in_out[x] = 0;
        }
      }
    }
    Tally lt;
    for (int h = 0; h < hkv; ++h) lt.Add(per_head[li * hkv + h][0]);
    std::fprintf(stderr, "layer %d done (%.0f s): budget %lld recall_off %.3f mass %.3f\n", L.layer,
                 Seconds() - t_load, static_cast<long long>(o.budgets[0]),
                 lt.recall_off / std::max<int64_t>(1, lt.steps), lt.mass / std::max<int64_t>(1, lt.steps));
  }
  std::ostringstream js;
  std::string params;
  for (const auto& [k, v] : o.params) params += (params.empty() ? "" : ", ") + ("\"" + k + "\": " + Fmt(v));
  js << "{\"bench\": \"lfps_trace_replay\", \"label\": \"" << o.label << "\", \"trace\": \""
     << o.trace << "\", \"text\": \"" << (trace.metadata.count("text") ? trace.metadata.at("text") : "")
     << "\", \"positions\": " << T << ", \"from\": " << from << ", \"layers\": " << trace.layers.size()
     << ", \"q_heads\": " << hq << ", \"kv_heads\": " << hkv << ", \"head_dim\": " << d
     << ", \"sink\": " << o.sink << ", \"window\": " << o.window
     << ", \"kv_dtype\": \"" << (o.kv_dtype == DType::kBF16 ? "bf16" : "f16") << "\", \"params\": {"
     << params << "}, \"cpu_isa\": \"" << cpu::AttendRowsImplName() << "\", \"budgets\": [";
  for (size_t b = 0; b < nb; ++b) {
    Tally all;
    for (const auto& ph : per_head) all.Add(ph[b]);
    total[b] = all;
    js << (b ? ",\n  " : "\n  ") << "{\"budget\": " << o.budgets[b] << ", \"budget_frac\": "
       << Fmt(static_cast<double>(o.budgets[b]) / static_cast<double>(T)) << ", \"all\": " << all.Json()
       << "}";
    std::fprintf(stderr,
                 "budget %4lld: recall_off %.3f recall_all %.3f mass %.3f (oracle %.3f, streaming %.3f "
                 "r_off %.3f) scored %.2f%% attended %.0f bypass %.3f fresh %.3f speedup %.2fx\n",
                 static_cast<long long>(o.budgets[b]), all.recall_off / all.steps,
                 all.recall_all / all.steps, all.mass / all.steps, all.oracle_mass / all.steps,
                 all.stream_mass / all.steps, all.stream_recall_off / all.steps,
                 100.0 * all.scored / all.offloaded, all.attended / all.steps,
                 static_cast<double>(all.bypassed) / all.steps, all.fresh / std::max(all.target, 1.0),
                 all.exact_s / all.lfps_s);
    std::fprintf(stderr, "   lost:");
    for (int i = 0; i < kNumLoss; ++i) std::fprintf(stderr, " %s %.3f", kLossNames[i], all.loss[i] / std::max(all.target, 1.0));
    std::fprintf(stderr, "\n");
  }
  js << "],\n \"per_head_budget\": " << o.detail_budget << ", \"per_head\": [";
  const auto it = std::find(o.budgets.begin(), o.budgets.end(), o.detail_budget);
  if (it != o.budgets.end()) {
    const size_t b = static_cast<size_t>(it - o.budgets.begin());
    for (size_t li = 0; li < trace.layers.size(); ++li) {
      for (int h = 0; h < hkv; ++h) {
        js << (li + h ? ",\n  " : "\n  ") << "{\"layer\": " << trace.layers[li].layer
           << ", \"kv_head\": " << h << ", \"all\": " << per_head[li * hkv + h][b].Json() << "}";
      }
    }
  }
  js << "]}\n";
  if (!o.out.empty()) {
    std::ofstream(o.out) << js.str();
    std::fprintf(stderr, "wrote %s\n", o.out.c_str());
  }
  return 0;
}

std::vector<int64_t> ParseInts(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::atoll(item.c_str()));
  return v;
}

// lfps_bench --trace FILE [--from P] [--budgets 82,128,...] [--param k=v]... [--label L]
//            [--detail-budget B] [--kv-dtype f16|bf16] [--json OUT]
int ReplayMain(int argc, char** argv) {
  ReplayOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--trace") o.trace = next();
    else if (a == "--from") o.from = std::atoll(next().c_str());
    else if (a == "--budgets") o.budgets = ParseInts(next());
    else if (a == "--layers") o.layers = ParseInts(next());
    else if (a == "--label") o.label = next();
    else if (a == "--json") o.out = next();
    else if (a == "--detail-budget") o.detail_budget = std::atoll(next().c_str());
    else if (a == "--sink") o.sink = std::atoi(next().c_str());
    else if (a == "--window") o.window = std::atoi(next().c_str());
    else if (a == "--kv-dtype") o.kv_dtype = next() == "bf16" ? DType::kBF16 : DType::kF16;
    else if (a == "--param") {
      const std::string kv = next();
      const size_t eq = kv.find('=');
      if (eq == std::string::npos) {
        std::fprintf(stderr, "--param wants k=v\n");
        return 2;
      }
      o.params[kv.substr(0, eq)] = std::strtod(kv.c_str() + eq + 1, nullptr);
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::sort(o.budgets.begin(), o.budgets.end());
  return RunReplay(o);
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--trace") == 0) return kvferry::ReplayMain(argc, argv);
  }
  using namespace kvferry;  // NOLINT
  std::string out_path = "bench/results/lfps.json";
  bool quick = false;
  int64_t only = 0;
  int steps_arg = 0;
  std::map<std::string, double> lfps_params;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--param") == 0 && i + 1 < argc) {
      const std::string kv = argv[++i];
      const size_t eq = kv.find('=');
      if (eq == std::string::npos) return 2;
      lfps_params[kv.substr(0, eq)] = std::strtod(kv.c_str() + eq + 1, nullptr);
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
      only = std::atoll(argv[++i]);
    } else if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps_arg = std::max(1, std::atoi(argv[++i]));
    } else {
      out_path = argv[i];
    }
  }
  const std::vector<int64_t> lengths =
      only > 0 ? std::vector<int64_t>{only}
      : quick  ? std::vector<int64_t>{4096, 16384}
               : std::vector<int64_t>{4096, 16384, 65536, 131072};
  const int num_heads = 8;  // KV heads of the synthetic model (32 query heads, GQA 4)
  const int warmup = 4, steps = steps_arg > 0 ? steps_arg : (quick ? 12 : 24);
  const double paper_speedup[] = {4.3, 8.1, 14.7, 0.0};
  const double paper_c1[] = {6.0, 4.1, 2.0, 1.7};
  const AttnParams p = Params();
  std::string json = "{\n  \"bench\": \"lfps\",\n  \"cpu_isa\": \"" +
                     std::string(cpu::AttendRowsImplName()) + "\",\n  \"threads\": 1,\n" +
                     "  \"shape\": {\"head_dim\": 128, \"group\": 4, \"kv_heads\": 8, \"sink\": 4, "
                     "\"window\": 64, \"budget_frac\": 0.02},\n  \"workload\": \"bench/lib/synthetic.h "
                     "SyntheticWorkload (as kvferry-bench), seed 1234 + run index, defaults otherwise\",\n  \"params\": {" +
                     [&] {
                       std::string o;
                       for (const auto& [k, v] : lfps_params) o += (o.empty() ? "\"" : ", \"") + k + "\": " + Fmt(v);
                       return o;
                     }() + "},\n  \"runs\": [\n";
  for (size_t li = 0; li < lengths.size(); ++li) {
    const int64_t n0 = lengths[li];
    RuntimeConfig config;
    config.capacity.max_sequences = 1;
    config.model.num_layers = 1;
    config.model.num_kv_heads = num_heads;
    config.capacity.max_tokens_per_sequence = n0 + warmup + steps + 1;
    config.policy.params = lfps_params;
    auto policy_or = MakeLfpsPolicy(config);
    if (!policy_or.ok()) return 1;
    auto& lfps = static_cast<LfpsPolicy&>(**policy_or);
    std::vector<std::unique_ptr<SynthHead>> heads;
    const double t_gen = Seconds();
    bench::SyntheticShape shape;
    shape.num_layers = 1;
    shape.num_q_heads = num_heads * kGroup;
    shape.num_kv_heads = num_heads;
    shape.head_dim = kHd;
    shape.max_positions = n0;
    shape.seed = 1234u + static_cast<uint64_t>(li);
    shape.sinks = kSink;
    const bench::SyntheticWorkload wl(shape);
    const int64_t total = n0 + warmup + steps;
    for (int h = 0; h < num_heads; ++h) heads.push_back(std::make_unique<SynthHead>(total));
    Generate(wl, total, heads);
    // Prime from the last 32 prompt queries: [32][q heads][hd] -> per KV head [32][group][hd].
    std::vector<float> all_q(static_cast<size_t>(32) * shape.num_q_heads * kHd);
    wl.Queries(0, n0 - 32, 32, all_q.data());
    for (int h = 0; h < num_heads; ++h) {
      heads[h]->SetN(n0);
      std::vector<float> pq(static_cast<size_t>(32) * kGroup * kHd);
      for (int r = 0; r < 32; ++r) {
        std::copy_n(all_q.data() + (static_cast<size_t>(r) * shape.num_q_heads + h * kGroup) * kHd,
                    kGroup * kHd, pq.data() + static_cast<size_t>(r) * kGroup * kHd);
      }
      PrefillContext pc;
      pc.kv_head = h;
      pc.q_pos0 = n0 - 32;
      pc.num_q = 32;
      pc.n = n0;
      pc.sink = kSink;
      pc.window = kWindow;
      pc.q = pq.data();
      pc.params = p;
      pc.kv = heads[h]->kv();
      if (!lfps.OnPrefill(pc).ok()) return 1;
    }
    std::fprintf(stderr, "n=%lld: workload + priming %.1f s\n", static_cast<long long>(n0),
                 Seconds() - t_gen);
    double t_exact = 0, t_lfps = 0, t_exact_e2e = 0, t_lfps_e2e = 0;
    double recall_sum = 0, mass_sum = 0, err_sum = 0, c1_sum = 0, off_sum = 0;
    int64_t measured = 0, bypassed = 0, fallbacks = 0, head_steps = 0;
    std::vector<float> q(kGroup * kHd), logits, w, o_sel(kGroup * kHd), lse_sel(kGroup),
        o_dense(kGroup * kHd), lse_dense(kGroup), o_tmp(kGroup * kHd), lse_tmp(kGroup);
    std::vector<int32_t> exact_set, lfps_set, resident_plus_exact, truth;
    std::vector<float> full_logits, full_w;
    double oracle_recall_sum = 0;
    int64_t scanned_steps = 0;
    std::vector<float> step_q(static_cast<size_t>(shape.num_q_heads) * kHd);
    for (int step = 0; step < warmup + steps; ++step) {
      wl.Queries(0, heads[0]->n(), 1, step_q.data());  // the query of the token appended now
      for (int h = 0; h < num_heads; ++h) {
        SynthHead& hd = *heads[h];
        hd.Append();
        const int64_t n = hd.n();
        std::copy_n(step_q.data() + static_cast<size_t>(h) * kGroup * kHd, kGroup * kHd, q.data());
        const int64_t budget = static_cast<int64_t>(std::ceil(kBudgetFrac * n));
        const int64_t k_off = budget - kSink - kWindow;
        // LFPS (+ its sparse attention over the offloaded part it chose). Runs first, so that its
        // row reads are not served from the LLC that exact top-k's full scan just filled.
        SelectContext ctx;
        ctx.kv_head = h;
        ctx.n = n;
        ctx.sink = kSink;
        ctx.window = kWindow;
        ctx.budget = budget;
        ctx.q = q.data();
        ctx.params = p;
        ctx.kv = hd.kv();
        LfpsStepInfo info;
        const double t3 = Seconds();
        if (!lfps.SelectWithInfo(ctx, lfps_set, &info).ok()) return 1;
        const double t4 = Seconds();
        cpu::PositionAttnItem li_item{q.data(), o_sel.data(), lse_sel.data(), hd.kv(),
                                      lfps_set.data(), static_cast<int32_t>(lfps_set.size())};
        cpu::AttendPositions(p, &li_item, 1);
        const double t5 = Seconds();
        // Exact top-k (+ its sparse attention).
        double t0 = Seconds();
        ExactTopK(hd, q.data(), k_off, logits, w, exact_set);
        double t1 = Seconds();
        cpu::PositionAttnItem ei{q.data(), o_tmp.data(), lse_tmp.data(), hd.kv(),
                                 exact_set.data(), static_cast<int32_t>(exact_set.size())};
        cpu::AttendPositions(p, &ei, 1);
        double t2 = Seconds();
        if (step < warmup) continue;
        ++head_steps;
        bypassed += info.bypassed;
        fallbacks += info.fallback;
        scanned_steps += info.scanned > 0;
        t_exact += t1 - t0;
        t_exact_e2e += t2 - t0;
        t_lfps += t4 - t3;
        t_lfps_e2e += t5 - t3;
        c1_sum += static_cast<double>(info.c1);
        off_sum += static_cast<double>(info.offloaded);
        // Quality vs dense attention.
        kvferry::PagedAttnItem dense{q.data(), o_dense.data(), lse_dense.data(), hd.kv(), n - 1, 1};
        cpu::AttendPagedWith(cpu::DenseImpl::kSimd, p, dense);
        double mass = 0, num = 0, den = 0;
        for (int g = 0; g < kGroup; ++g) {
          mass += std::exp(static_cast<double>(lse_sel[g]) - lse_dense[g]);
          for (int d = 0; d < kHd; ++d) {
            const double e = o_sel[g * kHd + d] - o_dense[g * kHd + d];
            num += e * e;
            den += static_cast<double>(o_dense[g * kHd + d]) * o_dense[g * kHd + d];
          }
        }
        mass_sum += mass / kGroup;
        err_sum += std::sqrt(num / den);
        if (!info.bypassed) {  // recall of the timed baseline's set (softmax over the offloaded keys)
          int64_t hit = 0;
          for (int32_t x : exact_set) hit += std::binary_search(lfps_set.begin(), lfps_set.end(), x);
          recall_sum += static_cast<double>(hit) / std::max<size_t>(1, exact_set.size());
          ++measured;
        }
        {  // recall of the oracle's top-k: the group's summed softmax over all n keys, offloaded part
          full_logits.resize(static_cast<size_t>(kGroup) * n);
          full_w.assign(static_cast<size_t>(n), 0.0f);
          cpu::ScoreRange(p, q.data(), hd.kv(), 0, n, full_logits.data(), n);
          for (int g = 0; g < kGroup; ++g) {
            cpu::SoftmaxAccumulate(full_logits.data() + g * n, n, 1.0f, full_w.data());
          }
          truth.resize(static_cast<size_t>(k_off));
          cpu::TopK(full_w.data() + kSink, n - kWindow - kSink, k_off, truth.data());
          int64_t hit = 0;
          for (int32_t x : truth) {
            hit += std::binary_search(lfps_set.begin(), lfps_set.end(), static_cast<int32_t>(x + kSink));
          }
          oracle_recall_sum += static_cast<double>(hit) / std::max<int64_t>(1, k_off);
        }
      }
    }
    const double speed = t_exact / t_lfps, speed_e2e = t_exact_e2e / t_lfps_e2e;
    std::fprintf(stderr,
                 "n=%lld exact %.3f ms lfps %.3f ms speedup %.2fx (e2e %.2fx) recall %.3f (of the "
                 "offloaded-softmax top-k %.3f) scanned steps %.2f "
                 "c1 %.2f%% bypass %.2f mass %.3f err %.3f fallback %lld\n",
                 static_cast<long long>(n0), t_exact / head_steps * 1e3, t_lfps / head_steps * 1e3,
                 speed, speed_e2e, oracle_recall_sum / head_steps,
                 recall_sum / std::max<int64_t>(1, measured),
                 static_cast<double>(scanned_steps) / head_steps,
                 100.0 * c1_sum / off_sum, static_cast<double>(bypassed) / head_steps,
                 mass_sum / head_steps, err_sum / head_steps, static_cast<long long>(fallbacks));
    json += std::string(li == 0 ? "" : ",\n") + "    {\"tokens\": " + std::to_string(n0) +
            ", \"head_steps\": " + std::to_string(head_steps) +
            ", \"exact_topk_ms\": " + Fmt(t_exact / head_steps * 1e3) +
            ", \"lfps_select_ms\": " + Fmt(t_lfps / head_steps * 1e3) +
            ", \"speedup_select\": " + Fmt(speed) +
            ", \"exact_e2e_ms\": " + Fmt(t_exact_e2e / head_steps * 1e3) +
            ", \"lfps_e2e_ms\": " + Fmt(t_lfps_e2e / head_steps * 1e3) +
            ", \"speedup_e2e\": " + Fmt(speed_e2e) +
            ", \"paper_speedup\": " + Fmt(paper_speedup[li]) +
            ", \"recall_exact_topk\": " + Fmt(oracle_recall_sum / head_steps) +
            ", \"recall_offloaded_softmax_topk\": " + Fmt(recall_sum / std::max<int64_t>(1, measured)) +
            ", \"scanned_steps_frac\": " + Fmt(static_cast<double>(scanned_steps) / head_steps) +
            ", \"c1_frac_pct\": " + Fmt(100.0 * c1_sum / off_sum) +
            ", \"paper_c1_frac_pct_a0.2\": " + Fmt(paper_c1[li]) +
            ", \"bypass_frac\": " + Fmt(static_cast<double>(bypassed) / head_steps) +
            ", \"fallback_frac\": " + Fmt(static_cast<double>(fallbacks) / head_steps) +
            ", \"mass_recall\": " + Fmt(mass_sum / head_steps) +
            ", \"rel_err\": " + Fmt(err_sum / head_steps) + "}";
  }
  json += "\n  ],\n  \"notes\": \"one thread; paper 4.3/8.1/14.7x at 4K/16K/64K (no 128K ratio; "
          "paper_speedup 0 there); paper c1 column for 128K is its 128K entry, 64K uses its 64K "
          "entry\"\n}\n";
  std::ofstream(out_path) << json;
  std::fprintf(stderr, "wrote %s\n", out_path.c_str());
  return 0;
}
