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
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <thread>

#include "bench/lib/synthetic.h"
#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "policies/lfps.h"

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

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  using namespace kvferry;  // NOLINT
  std::string out_path = "bench/results/lfps.json";
  bool quick = false;
  int64_t only = 0;
  int steps_arg = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
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
                     "SyntheticWorkload (as kvferry-bench), seed 1234 + run index, defaults otherwise\",\n  \"params\": {\"s\": 32, \"r\": "
                     "0.95, \"eps\": 0.85, \"a\": 0.2},\n  \"runs\": [\n";
  for (size_t li = 0; li < lengths.size(); ++li) {
    const int64_t n0 = lengths[li];
    RuntimeConfig config;
    config.capacity.max_sequences = 1;
    config.model.num_layers = 1;
    config.model.num_kv_heads = num_heads;
    config.capacity.max_tokens_per_sequence = n0 + warmup + steps + 1;
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
    std::vector<int32_t> exact_set, lfps_set, resident_plus_exact;
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
        if (!info.bypassed) {  // recall of the exact top-k over the offloaded range
          int64_t hit = 0;
          for (int32_t x : exact_set) hit += std::binary_search(lfps_set.begin(), lfps_set.end(), x);
          recall_sum += static_cast<double>(hit) / std::max<size_t>(1, exact_set.size());
          ++measured;
        }
      }
    }
    const double speed = t_exact / t_lfps, speed_e2e = t_exact_e2e / t_lfps_e2e;
    std::fprintf(stderr,
                 "n=%lld exact %.3f ms lfps %.3f ms speedup %.2fx (e2e %.2fx) recall %.3f "
                 "c1 %.2f%% bypass %.2f mass %.3f err %.3f fallback %lld\n",
                 static_cast<long long>(n0), t_exact / head_steps * 1e3, t_lfps / head_steps * 1e3,
                 speed, speed_e2e, recall_sum / std::max<int64_t>(1, measured),
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
            ", \"recall_exact_topk\": " + Fmt(recall_sum / std::max<int64_t>(1, measured)) +
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
