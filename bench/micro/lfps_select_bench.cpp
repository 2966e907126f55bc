// Copyright kvferry authors. Apache-2.0.
// lfps_select_bench: LFPS Select against the exact top-k (OracleSelect) on the
// kvferry-e2e workload, on the host, one thread, one layer of the Llama-3.1-8B
// shape (8 KV heads x group 4, head_dim 128, bf16, sink 4, window 256, budget
// 2% of n).
//
// kvferry-e2e (bench/e2e_bench.cu) fills the cache the way an engine does:
// Append of one 4096-row chunk of hashed-uniform K/V repeated up to n - 32,
// then a 32-token Prefill (the same chunk's first rows) that primes LFPS
// through OnPrefill; every decode step uses the same q and new k/v. This
// reproduces those values bit for bit (the same hash) and calls the policies
// directly with the contexts the runtime builds (Runtime::Decode's
// SelectContext), so that select time is measured per (layer, KV head) with
// nothing else around it. Both policies see the same steps; each variant runs
// `--warmup` untimed steps first (kvferry-e2e runs 2) and then `--steps` timed
// ones, and the whole schedule is repeated `--repeats` times interleaved
// (variants alternate within a repeat) so that load from other processes
// spreads over all of them; the best and median repeat are reported.
//
//   lfps_select_bench [--contexts 8192,32768,131072] [--steps 20] [--warmup 2]
//   [--repeats 3]
//                     [--variant name:k=v,k=v ...] [--json OUT]
//                     [--select-threads N] [--prefetch ROWS]
// --select-threads N: each LFPS Select gets SelectContext::threads = N and runs
// inside a TBB arena of N threads (one head at a time, its scan split over the
// arena); the selections are the same for every N.
// Variants default to: oracle, lfps (defaults), lfps_paper (rank=0 fill=0
// scan=0).
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
#include <string>
#include <vector>

#include <oneapi/tbb/task_arena.h>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "kvferry/kvferry.h"
#include "policies/basic.h"
#include "policies/lfps/lfps.h"

namespace kvferry {
namespace {

constexpr int kHkv = 8, kGroup = 4, kHq = kHkv * kGroup, kHd = 128, kPage = 256;
constexpr int kSink = 4, kWindow = 256, kPrime = 32;
constexpr int64_t kChunk = 4096;
constexpr double kBudgetFrac = 0.02;

double Now() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// bench/e2e_bench.cu FillBf16, element i of a buffer made with \p seed.
uint16_t HashBf16(int64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  const float f = (static_cast<float>(h & 0xffff) / 65536.0f - 0.5f) * 4.0f;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}
float HashF32(int64_t i, uint32_t seed) {
  return cpu::Bf16ToF32(HashBf16(i, seed));
}

// One KV head's rows in the host store's page layout.
class Head {
public:
  explicit Head(int64_t capacity) {
    for (int64_t p = 0; p < (capacity + kPage - 1) / kPage; ++p) {
      pages_.emplace_back(new uint16_t[static_cast<size_t>(2) * kPage * kHd]);
      ptrs_.push_back(pages_.back().get());
    }
    kv_.pages = ptrs_.data();
    kv_.page_tokens = kPage;
  }
  // Row of position pos from element offset `base` of buffers seeded 1 (K) and
  // 2 (V).
  void Store(int64_t pos, int64_t base, uint32_t k_seed, uint32_t v_seed) {
    uint16_t *page = pages_[pos / kPage].get();
    const int64_t row = pos % kPage;
    for (int d = 0; d < kHd; ++d) {
      page[row * kHd + d] = HashBf16(base + d, k_seed);
      page[(kPage + row) * kHd + d] = HashBf16(base + d, v_seed);
    }
  }
  const KvPages &kv() const { return kv_; }

private:
  std::vector<std::unique_ptr<uint16_t[]>> pages_;
  std::vector<void *> ptrs_;
  KvPages kv_;
};

AttnParams Params() {
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  return p;
}

struct Variant {
  std::string name;
  bool oracle = false;
  std::map<std::string, double> params;
};

struct Result1 {
  double ms_per_layer =
      0; // select time of the 8 heads of one layer, one thread, per step
  double c1_frac = 0, filled_frac = 0, scanned_frac = 0, fallback_frac = 0,
         recall = 0;
  double scan_steps_frac = 0;
};

std::string Fmt(double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.4g", x);
  return buf;
}

// The kvferry-e2e flow through the public Runtime on the host backend: Append +
// 32-token Prefill per layer, `warmup` untimed token steps, then `steps` timed
// ones; prints Stats per step.
// --trace PATH (runtime mode): the last timed token step's host timeline, Chrome trace JSON.
std::string g_trace_path;

int RunRuntime(int64_t ctx, int layers, int steps, int warmup, int threads,
               const std::map<std::string, double> &lfps_params,
               const std::string &policy) {
  RuntimeConfig c;
  c.model = {.num_layers = layers,
             .num_q_heads = kHq,
             .num_kv_heads = kHkv,
             .head_dim = kHd,
             .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = 1;
  c.capacity.max_batch = 1;
  c.capacity.max_tokens_per_sequence = ctx + 2 * steps + 64;
  c.capacity.max_prefill_chunk = 4096;
  c.tiers.sink_tokens = kSink;
  c.tiers.window_tokens = kWindow;
  c.backend = Backend::kHost;
  c.route = Route::kAuto;
  c.probe_at_start = false;
  c.cpu_threads = threads;
  c.policy.name = policy;
  c.policy.budget_tokens = 0;
  c.policy.budget_fraction = kBudgetFrac;
  c.policy.params = lfps_params;
  auto made = Runtime::Create(c);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<Runtime> rt = std::move(made).value();
  auto fill = [](int64_t n, uint32_t seed) {
    std::vector<uint16_t> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      x[i] = HashBf16(i, seed);
    return x;
  };
  std::vector<uint16_t> ck = fill(kChunk * kHkv * kHd, 1),
                        cv = fill(kChunk * kHkv * kHd, 2);
  std::vector<uint16_t> pq = fill(kPrime * kHq * kHd, 3), pout(pq.size());
  std::vector<uint16_t> q = fill(kHq * kHd, 4), k = fill(kHkv * kHd, 5),
                        v = fill(kHkv * kHd, 6);
  std::vector<uint16_t> out(q.size());
  auto view = [](uint16_t *p, int64_t rows, int heads) {
    return TensorView::Contiguous(p, DType::kBF16, MemoryKind::kHost,
                                  {rows, heads, kHd});
  };
  const SequenceId seq = 100;
  if (!rt->AddSequence(seq).ok())
    return 1;
  for (int l = 0; l < layers; ++l) {
    for (int64_t pos = 0; pos < ctx - kPrime; pos += kChunk) {
      const int64_t n = std::min<int64_t>(kChunk, ctx - kPrime - pos);
      if (Status st = rt->Append(seq, l, view(ck.data(), n, kHkv),
                                 view(cv.data(), n, kHkv));
          !st.ok()) {
        std::fprintf(stderr, "append: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    if (Status st = rt->Prefill(
            seq, l, view(pq.data(), kPrime, kHq), view(ck.data(), kPrime, kHkv),
            view(cv.data(), kPrime, kHkv), view(pout.data(), kPrime, kHq));
        !st.ok()) {
      std::fprintf(stderr, "prefill: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  const SequenceId seqs[1] = {seq};
  double sel_prev = 0;
  double t_timed = 0, sel_timed = 0;
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) {
      rt->ResetStats();
      sel_prev = 0;
    }
    const bool trace = !g_trace_path.empty() && i == warmup + steps - 1;
    if (trace) {
      if (Status st = rt->StartTrace(); !st.ok()) {
        std::fprintf(stderr, "trace: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    const double t0 = Now();
    for (int l = 0; l < layers; ++l) {
      if (Status st = rt->Decode(
              seqs, l, view(q.data(), 1, kHq), view(k.data(), 1, kHkv),
              view(v.data(), 1, kHkv), view(out.data(), 1, kHq));
          !st.ok()) {
        std::fprintf(stderr, "decode: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    const double dt = Now() - t0;
    if (trace) {
      if (Status st = rt->WriteTrace(g_trace_path); !st.ok()) {
        std::fprintf(stderr, "trace: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    const Stats s = rt->GetStats();
    std::fprintf(stderr, "%s step %d: %.2f ms, select %.2f ms\n",
                 i < warmup ? "warmup" : "timed", i, dt,
                 s.ms_select - sel_prev);
    sel_prev = s.ms_select;
    if (i >= warmup)
      t_timed += dt;
  }
  sel_timed = rt->GetStats().ms_select;
  std::printf(
      "{\"mode\": \"runtime_host\", \"policy\": \"%s\", \"context\": %lld, "
      "\"layers\": %d, "
      "\"threads\": %d, \"ms_per_step\": %.4g, \"select_ms_per_step\": %.4g}\n",
      policy.c_str(), static_cast<long long>(ctx), layers, threads,
      t_timed / steps, sel_timed / steps);
  return 0;
}

int Main(int argc, char **argv) {
  std::vector<int64_t> contexts{8192, 32768, 131072};
  int steps = 20, warmup = 2, repeats = 3;
  std::string json;
  bool verbose = false, recall = true;
  int runtime_layers = 0, threads = 2, select_threads = 1;
  std::vector<Variant> variants;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--contexts") {
      contexts.clear();
      std::stringstream ss(next());
      for (std::string x; std::getline(ss, x, ',');)
        contexts.push_back(std::stoll(x));
    } else if (a == "--steps") {
      steps = std::stoi(next());
    } else if (a == "--warmup") {
      warmup = std::stoi(next());
    } else if (a == "--repeats") {
      repeats = std::stoi(next());
    } else if (a == "--runtime") {
      runtime_layers = std::stoi(next());
    } else if (a == "--threads") {
      threads = std::stoi(next());
    } else if (a == "--select-threads") {
      select_threads = std::max(1, std::stoi(next()));
    } else if (a == "--trace") {
      g_trace_path = next();
    } else if (a == "--prefetch") {
      // Rows the gather kernels (the exact scoring of C1) prefetch ahead (cpu::SetGatherPrefetch).
      cpu::SetGatherPrefetch(std::stoi(next()), 0);
    } else if (a == "--no-recall") {
      recall = false;
    } else if (a == "--verbose") {
      verbose = true;
    } else if (a == "--json") {
      json = next();
    } else if (a == "--variant") {
      // name or name:k=v,k=v; "oracle" is the exact top-k.
      const std::string s = next();
      Variant v;
      const size_t colon = s.find(':');
      v.name = s.substr(0, colon);
      v.oracle = v.name == "oracle";
      if (colon != std::string::npos) {
        std::stringstream ss(s.substr(colon + 1));
        for (std::string kv; std::getline(ss, kv, ',');) {
          const size_t eq = kv.find('=');
          if (eq == std::string::npos) {
            std::fprintf(stderr, "bad variant parameter '%s'\n", kv.c_str());
            return 2;
          }
          v.params[kv.substr(0, eq)] = std::stod(kv.substr(eq + 1));
        }
      }
      variants.push_back(v);
    } else {
      std::fprintf(stderr,
                   "usage: lfps_select_bench [--contexts a,b] [--steps N] [--warmup N] "
                   "[--repeats N] [--variant name[:k=v,..]]... [--json OUT] "
                   "[--select-threads N] [--runtime LAYERS --threads N [--trace PATH]]\n");
      return 2;
    }
  }
  if (variants.empty()) {
    variants.push_back({"oracle", true, {}});
    variants.push_back({"lfps", false, {}});
    variants.push_back(
        {"lfps_paper", false, {{"rank", 0}, {"fill", 0}, {"scan", 0}}});
  }
  if (runtime_layers > 0) {
    for (const int64_t ctx : contexts) {
      for (const Variant &v : variants) {
        const int rc = RunRuntime(ctx, runtime_layers, steps, warmup, threads,
                                  v.params, v.oracle ? "oracle" : "lfps");
        if (rc != 0)
          return rc;
      }
    }
    return 0;
  }
  const AttnParams params = Params();
  tbb::task_arena arena(select_threads);
  std::ostringstream rows;
  bool first_row = true;
  for (const int64_t ctx : contexts) {
    const int64_t cap =
        ctx + static_cast<int64_t>(repeats) * (warmup + steps) + 64;
    // Every variant starts from the same cache; the decode steps all append the
    // same k/v, so the rows past ctx are equal whichever variant wrote them.
    std::vector<std::unique_ptr<Head>> heads;
    for (int h = 0; h < kHkv; ++h)
      heads.emplace_back(new Head(cap));
    for (int h = 0; h < kHkv; ++h) {
      for (int64_t pos = 0; pos < ctx - kPrime; ++pos) {
        heads[h]->Store(pos, ((pos % kChunk) * kHkv + h) * kHd, 1, 2);
      }
      for (int64_t r = 0; r < kPrime; ++r)
        heads[h]->Store(ctx - kPrime + r, (r * kHkv + h) * kHd, 1, 2);
      for (int64_t pos = ctx; pos < cap; ++pos)
        heads[h]->Store(pos, h * kHd, 5, 6);
    }
    // Queries: prefill [kPrime][kHq][kHd] (seed 3), decode [kHq][kHd] (seed 4),
    // per KV head in the policy's layout ([rows][group][kHd]).
    std::vector<std::vector<float>> prime_q(kHkv), step_q(kHkv);
    for (int h = 0; h < kHkv; ++h) {
      prime_q[h].resize(static_cast<size_t>(kPrime) * kGroup * kHd);
      step_q[h].resize(static_cast<size_t>(kGroup) * kHd);
      for (int r = 0; r < kPrime; ++r) {
        for (int g = 0; g < kGroup; ++g) {
          for (int d = 0; d < kHd; ++d) {
            prime_q[h][(static_cast<size_t>(r) * kGroup + g) * kHd + d] =
                HashF32((static_cast<int64_t>(r) * kHq + h * kGroup + g) * kHd +
                            d,
                        3);
          }
        }
      }
      for (int g = 0; g < kGroup; ++g) {
        for (int d = 0; d < kHd; ++d) {
          step_q[h][static_cast<size_t>(g) * kHd + d] =
              HashF32((h * kGroup + g) * kHd + d, 4);
        }
      }
    }
    const size_t nv = variants.size();
    std::vector<std::vector<Result1>> res(nv);
    for (int rep = 0; rep < repeats; ++rep) {
      for (size_t vi = 0; vi < nv; ++vi) {
        const Variant &var = variants[vi];
        std::unique_ptr<LfpsPolicy> lfps;
        if (!var.oracle) {
          auto lp = ParseLfpsParams(var.params);
          if (!lp.ok()) {
            std::fprintf(stderr, "%s\n", lp.status().ToString().c_str());
            return 2;
          }
          lfps.reset(new LfpsPolicy(lp.value(), 1, 1, kHkv, cap));
          for (int h = 0; h < kHkv; ++h) {
            PrefillContext pc;
            pc.kv_head = h;
            pc.q_pos0 = ctx - kPrime;
            pc.num_q = kPrime;
            pc.n = ctx;
            pc.sink = kSink;
            pc.window = kWindow;
            pc.q = prime_q[h].data();
            pc.params = params;
            pc.kv = heads[h]->kv();
            if (Status s = lfps->OnPrefill(pc); !s.ok()) {
              std::fprintf(stderr, "%s\n", s.ToString().c_str());
              return 1;
            }
          }
        }
        Result1 r;
        double ms = 0;
        int64_t off = 0;
        std::vector<int32_t> out, want;
        for (int step = 0; step < warmup + steps; ++step) {
          const bool timed = step >= warmup;
          const int64_t n = ctx + 1 + step;
          for (int h = 0; h < kHkv; ++h) {
            SelectContext sc;
            sc.kv_head = h;
            sc.n = n;
            sc.sink = kSink;
            sc.window = kWindow;
            sc.budget = static_cast<int64_t>(
                std::ceil(kBudgetFrac * static_cast<double>(n)));
            sc.q = step_q[h].data();
            sc.params = params;
            sc.kv = heads[h]->kv();
            sc.threads = select_threads;
            LfpsStepInfo info;
            Status st = Status::Ok();
            const double t0 = Now();
            if (var.oracle) {
              OracleSelect(sc, out);
            } else if (select_threads > 1) {
              arena.execute([&] { st = lfps->SelectWithInfo(sc, out, &info); });
            } else {
              st = lfps->SelectWithInfo(sc, out, &info);
            }
            const double dt = Now() - t0;
            if (!st.ok()) {
              std::fprintf(stderr, "%s\n", st.ToString().c_str());
              return 1;
            }
            if (verbose && !var.oracle) {
              std::fprintf(stderr,
                           "step %d head %d: %.3f ms c0 %lld c1 %lld scanned "
                           "%lld filled %lld fb %d byp %d\n",
                           step, h, dt, (long long)info.c0, (long long)info.c1,
                           (long long)info.scanned, (long long)info.filled,
                           (int)info.fallback, (int)info.bypassed);
            }
            if (!timed)
              continue;
            ms += dt;
            if (!var.oracle) {
              const double o = std::max<int64_t>(info.offloaded, 1);
              r.c1_frac += info.c1 / o;
              r.filled_frac += info.filled / o;
              r.scanned_frac += info.scanned / o;
              r.fallback_frac += info.fallback;
              r.scan_steps_frac += info.scanned > 0;
              off += 1;
            }
            if (!var.oracle && recall) {
              // Recall of the exact top-budget set (the oracle's), untimed.
              OracleSelect(sc, want);
              int64_t hit = 0;
              size_t a = 0;
              for (const int32_t x : want) {
                while (a < out.size() && out[a] < x)
                  ++a;
                hit += a < out.size() && out[a] == x;
              }
              r.recall +=
                  static_cast<double>(hit) / std::max<size_t>(want.size(), 1);
            }
          }
        }
        r.ms_per_layer = ms / steps;
        if (off > 0) {
          r.c1_frac /= off, r.filled_frac /= off, r.scanned_frac /= off;
          r.fallback_frac /= off, r.recall /= off, r.scan_steps_frac /= off;
        }
        res[vi].push_back(r);
        std::fprintf(stderr,
                     "ctx %lld rep %d %-14s %8.3f ms/layer-step  c1 %.4f\n",
                     static_cast<long long>(ctx), rep, var.name.c_str(),
                     r.ms_per_layer, r.c1_frac);
      }
    }
    // Best and median over repeats; the oracle (first oracle variant) is the
    // named baseline.
    double oracle_best = 0, oracle_median = 0;
    auto best_median = [](std::vector<Result1> v, double *best,
                          double *median) {
      std::sort(v.begin(), v.end(), [](const Result1 &a, const Result1 &b) {
        return a.ms_per_layer < b.ms_per_layer;
      });
      *best = v.front().ms_per_layer;
      *median = v[v.size() / 2].ms_per_layer;
      return v[v.size() / 2];
    };
    for (size_t vi = 0; vi < nv; ++vi) {
      if (variants[vi].oracle) {
        best_median(res[vi], &oracle_best, &oracle_median);
        break;
      }
    }
    for (size_t vi = 0; vi < nv; ++vi) {
      double best, median;
      const Result1 m = best_median(res[vi], &best, &median);
      std::ostringstream row;
      row << "{\"context\": " << ctx << ", \"variant\": \"" << variants[vi].name
          << "\", \"params\": {";
      bool f = true;
      for (const auto &[k, v] : variants[vi].params) {
        row << (f ? "" : ", ") << "\"" << k << "\": " << Fmt(v);
        f = false;
      }
      row << "}, \"select_ms_per_layer_best\": " << Fmt(best)
          << ", \"select_ms_per_layer_median\": " << Fmt(median)
          << ", \"select_ms_per_head_median\": " << Fmt(median / kHkv);
      if (oracle_best > 0) {
        row << ", \"speedup_vs_exact_topk_best\": " << Fmt(oracle_best / best)
            << ", \"speedup_vs_exact_topk_median\": "
            << Fmt(oracle_median / median);
      }
      if (!variants[vi].oracle) {
        row << ", \"c1_frac\": " << Fmt(m.c1_frac)
            << ", \"filled_frac\": " << Fmt(m.filled_frac)
            << ", \"scanned_frac\": " << Fmt(m.scanned_frac)
            << ", \"scan_steps_frac\": " << Fmt(m.scan_steps_frac)
            << ", \"fallback_frac\": " << Fmt(m.fallback_frac)
            << ", \"recall_oracle\": " << Fmt(m.recall);
      }
      row << "}";
      std::printf("%s\n", row.str().c_str());
      std::fflush(stdout);
      rows << (first_row ? "" : ",\n  ") << row.str();
      first_row = false;
    }
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\n \"bench\": \"lfps_select\",\n \"steps\": " << steps
      << ", \"warmup\": " << warmup << ", \"repeats\": " << repeats
      << ",\n \"rows\": [\n  " << rows.str() << "\n ]\n}\n";
  }
  return 0;
}

} // namespace
} // namespace kvferry

int main(int argc, char **argv) { return kvferry::Main(argc, argv); }
