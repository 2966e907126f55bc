// Copyright kvferry authors. Apache-2.0.
// Where a policy's quality goes, per layer and KV head, on a real attention trace: any registered
// policy (or wrapper stack) replayed teacher-forced over a kvferry-llama trace (docs/llama.md,
// `--dump-trace`), several lanes (policy, budget, parameters) sharing one exact attention per step.
//
//   select_replay_bench --trace T.safetensors [--from P] [--sink 4] [--window 64] [--chunk 512]
//       [--layers 0,5] [--threads N] [--json OUT] [--detail LABEL] [--policy-weights FILE]
//       --lane [LABEL=]POLICY@BUDGET[:key=value,...]  (repeatable)
//
// Each lane's policy is built by the registry (MakePolicy) for the trace's shape, primed through
// OnPrefill with every prompt chunk of [0, from) (queries passed when the policy asks for them),
// then asked to Select at every step t = from .. T-1 with the trace's query of t over the keys
// [0, t]. Against the exact attention (softmax over all t + 1 keys, each query head of the GQA
// group) a lane gets, per (layer, KV head) and in total:
//   recall     fraction of the exact top-k_off of the offloaded range (the oracle's ranking: the
//              group's summed softmax) that the selection holds (k_off = budget - sink - window);
//   mass       attention mass kept (group mean), next to the oracle's and streaming's at the
//              same budget (oracle_mass, streaming_mass);
//   rel_err    ||o_sel - o|| / ||o|| of the attention output (group mean; o_sel renormalised over
//              the selection), the quantity perplexity feels;
//   turnover   fraction of the selected offloaded positions not selected at the previous step
//              (what a token bank misses), next to the exact top-k's own turnover (fresh);
//   select_us  the policy's Select time per call.
// Layers run in parallel over --threads unless a lane is a cross-layer wrapper ("xl+"), which
// needs the layers of a step in order. KVpop's trained scorer comes from --policy-weights
// (PolicyConfig::weights_path), as in the runtime.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/lib/safetensors.h"
#include "bench/lib/trace_kv.h"
#include "cpu/attention.h"
#include "kvferry/config.h"
#include "policies/policy.h"

namespace kvferry {
namespace {

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Fmt(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.5g", std::isfinite(x) ? x : 0.0);
  return b;
}

struct Lane {
  std::string label, policy;
  int64_t budget = 0;
  std::map<std::string, double> params;
  std::unique_ptr<Policy> pol;
};

// One lane's sums over steps of one (layer, KV head).
struct Tally {
  int64_t steps = 0;
  double recall = 0, mass = 0, oracle_mass = 0, streaming_mass = 0, rel_err = 0, oracle_err = 0;
  double turnover = 0, fresh = 0, select_s = 0;
  void Add(const Tally& o) {
    steps += o.steps, recall += o.recall, mass += o.mass, oracle_mass += o.oracle_mass;
    streaming_mass += o.streaming_mass, rel_err += o.rel_err, oracle_err += o.oracle_err;
    turnover += o.turnover, fresh += o.fresh, select_s += o.select_s;
  }
  std::string Json() const {
    const double s = static_cast<double>(std::max<int64_t>(steps, 1));
    return "{\"steps\": " + std::to_string(steps) + ", \"recall\": " + Fmt(recall / s) +
           ", \"mass\": " + Fmt(mass / s) + ", \"oracle_mass\": " + Fmt(oracle_mass / s) +
           ", \"streaming_mass\": " + Fmt(streaming_mass / s) + ", \"rel_err\": " + Fmt(rel_err / s) +
           ", \"oracle_rel_err\": " + Fmt(oracle_err / s) + ", \"turnover\": " + Fmt(turnover / s) +
           ", \"fresh\": " + Fmt(fresh / s) + ", \"select_us\": " + Fmt(select_s / s * 1e6) + "}";
  }
};

struct Options {
  std::string trace, json, detail, weights;
  int64_t from = -1;
  int sink = 4, window = 64, chunk = 512, threads = 0;
  std::vector<int64_t> layers;
  std::vector<std::string> lanes;
};

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr,
               "select_replay_bench: %s\nusage: select_replay_bench --trace T.safetensors --lane "
               "[LABEL=]POLICY@BUDGET[:k=v,...] [--lane ...] [--from P] [--sink 4] [--window 64] "
               "[--chunk 512] [--layers 0,5] [--threads N] [--json OUT] [--detail LABEL] "
               "[--policy-weights FILE]\n",
               why.c_str());
  std::exit(2);
}

Lane ParseLane(const std::string& spec) {
  Lane l;
  std::string s = spec;
  // A label is what precedes the first '=' when a POLICY@BUDGET follows it (parameters come
  // after a ':', so a '=' before any ':' is the label's).
  if (const size_t eq = s.find('='); eq != std::string::npos && eq < s.find(':') &&
                                     s.find('@', eq) != std::string::npos) {
    l.label = s.substr(0, eq);
    s = s.substr(eq + 1);
  }
  const size_t at = s.find('@');
  if (at == std::string::npos || at == 0) Usage("--lane " + spec + ": want POLICY@BUDGET");
  l.policy = s.substr(0, at);
  const size_t colon = s.find(':', at);
  char* end = nullptr;
  const std::string b = s.substr(at + 1, colon == std::string::npos ? std::string::npos : colon - at - 1);
  l.budget = std::strtoll(b.c_str(), &end, 10);
  if (end == b.c_str() || *end != '\0' || l.budget < 1) Usage("--lane " + spec + ": bad budget '" + b + "'");
  if (colon != std::string::npos) {
    std::stringstream ss(s.substr(colon + 1));
    std::string kv;
    while (std::getline(ss, kv, ',')) {
      const size_t e = kv.find('=');
      if (e == std::string::npos) Usage("--lane " + spec + ": parameter '" + kv + "' is not k=v");
      l.params[kv.substr(0, e)] = std::strtod(kv.c_str() + e + 1, nullptr);
    }
  }
  if (l.label.empty()) l.label = spec;
  return l;
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Usage(a + " needs a value");
      return argv[++i];
    };
    auto whole = [&](const std::string& v, int64_t lo) {
      char* end = nullptr;
      const long long x = std::strtoll(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || x < lo) Usage(a + " " + v + ": want a whole number >= " + std::to_string(lo));
      return static_cast<int64_t>(x);
    };
    if (a == "--trace") o.trace = next();
    else if (a == "--json") o.json = next();
    else if (a == "--detail") o.detail = next();
    else if (a == "--policy-weights") o.weights = next();
    else if (a == "--lane") o.lanes.push_back(next());
    else if (a == "--from") o.from = whole(next(), 1);
    else if (a == "--sink") o.sink = static_cast<int>(whole(next(), 0));
    else if (a == "--window") o.window = static_cast<int>(whole(next(), 0));
    else if (a == "--chunk") o.chunk = static_cast<int>(whole(next(), 1));
    else if (a == "--threads") o.threads = static_cast<int>(whole(next(), 0));
    else if (a == "--layers") {
      std::stringstream ss(next());
      std::string x;
      while (std::getline(ss, x, ',')) o.layers.push_back(whole(x, 0));
    } else if (a == "--help" || a == "-h") {
      std::printf("see the header of bench/micro/select_replay_bench.cpp\n");
      std::exit(0);
    } else {
      Usage("unknown argument " + a);
    }
  }
  if (o.trace.empty()) Usage("--trace is required");
  if (o.lanes.empty()) Usage("at least one --lane is required");
  return o;
}

// The exact attention of one (layer, KV head) at one step, shared by every lane.
struct Exact {
  std::vector<float> logits, p, w;     // [group][n] logits, per-head softmax, group sum
  std::vector<float> o;                // [group][d] exact outputs
  std::vector<double> o_norm;          // [group]
  std::vector<int32_t> order;          // offloaded positions, best first (prefix sorted)
};

void ComputeExact(const AttnParams& prm, const float* q, const bench::TraceHead& head,
                  const bench::TraceLayer& L, int h, int64_t n, int64_t lo, int64_t hi,
                  int64_t kmax, Exact& ex) {
  const int g = prm.group, d = prm.head_dim;
  ex.logits.resize(static_cast<size_t>(g) * n);
  ex.p.resize(ex.logits.size());
  ex.w.assign(static_cast<size_t>(n), 0.0f);
  cpu::ScoreRange(prm, q, head.kv(), 0, n, ex.logits.data(), n);
  ex.o.assign(static_cast<size_t>(g) * d, 0.0f);
  ex.o_norm.assign(g, 0.0);
  for (int gi = 0; gi < g; ++gi) {
    const float* x = ex.logits.data() + static_cast<size_t>(gi) * n;
    float* pg = ex.p.data() + static_cast<size_t>(gi) * n;
    const float mx = *std::max_element(x, x + n);
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += pg[j] = std::exp(x[j] - mx);
    const float inv = static_cast<float>(1.0 / sum);
    float* og = ex.o.data() + static_cast<size_t>(gi) * d;
    for (int64_t j = 0; j < n; ++j) {
      pg[j] *= inv;
      ex.w[j] += pg[j];
      const float* v = L.v.data() + (j * L.num_kv_heads + h) * d;
      for (int e = 0; e < d; ++e) og[e] += pg[j] * v[e];
    }
    double nn = 0;
    for (int e = 0; e < d; ++e) nn += double(og[e]) * og[e];
    ex.o_norm[gi] = std::sqrt(nn);
  }
  ex.order.resize(static_cast<size_t>(std::max<int64_t>(0, hi - lo)));
  std::iota(ex.order.begin(), ex.order.end(), static_cast<int32_t>(lo));
  const int64_t k = std::min<int64_t>(kmax, static_cast<int64_t>(ex.order.size()));
  std::partial_sort(ex.order.begin(), ex.order.begin() + k, ex.order.end(), [&](int32_t a, int32_t b) {
    return ex.w[a] != ex.w[b] ? ex.w[a] > ex.w[b] : a < b;
  });
}

// Mass kept and output error of a selection (ascending positions) against the exact attention.
void Judge(const Exact& ex, const bench::TraceLayer& L, int h, const AttnParams& prm,
           const std::vector<int32_t>& sel, double* mass, double* err) {
  const int g = prm.group, d = prm.head_dim;
  const int64_t n = static_cast<int64_t>(ex.w.size());
  double m = 0, e_sum = 0;
  std::vector<float> os(static_cast<size_t>(d));
  for (int gi = 0; gi < g; ++gi) {
    const float* pg = ex.p.data() + static_cast<size_t>(gi) * n;
    std::fill(os.begin(), os.end(), 0.0f);
    double z = 0;
    for (const int32_t j : sel) {
      z += pg[j];
      const float* v = L.v.data() + (static_cast<int64_t>(j) * L.num_kv_heads + h) * d;
      for (int e = 0; e < d; ++e) os[e] += pg[j] * v[e];
    }
    m += z;
    const float* og = ex.o.data() + static_cast<size_t>(gi) * d;
    double diff = 0;
    for (int e = 0; e < d; ++e) {
      const double x = z > 0 ? os[e] / z : 0.0;
      diff += (x - og[e]) * (x - og[e]);
    }
    e_sum += std::sqrt(diff) / std::max(ex.o_norm[gi], 1e-30);
  }
  *mass = m / g;
  *err = e_sum / g;
}

int Run(const Options& o) {
  const double t_start = Seconds();
  auto tr = bench::LoadTrace(o.trace);
  if (!tr.ok()) {
    std::fprintf(stderr, "select_replay_bench: %s\n", tr.status().ToString().c_str());
    return 1;
  }
  bench::Trace& trace = tr.value();
  if (!bench::KeepTraceLayers(trace, o.layers)) Usage("--layers selects no traced layer");
  const bench::TraceLayer& l0 = trace.layers.front();
  const int64_t T = l0.num_tokens;
  const int hq = l0.num_q_heads, hkv = l0.num_kv_heads, d = l0.head_dim, group = hq / hkv;
  const int64_t from = o.from > 0 ? o.from : std::max<int64_t>(1, T - 1024);
  if (from >= T) Usage("--from " + std::to_string(from) + " is not below the trace's " + std::to_string(T) + " tokens");
  int max_layer = 0;
  for (const auto& l : trace.layers) max_layer = std::max(max_layer, l.layer);
  AttnParams prm;
  prm.group = group;
  prm.head_dim = d;
  prm.kv_dtype = DType::kF16;
  prm.scale = 1.0f / std::sqrt(static_cast<float>(d));

  std::vector<Lane> lanes;
  bool ordered = false;
  for (const std::string& spec : o.lanes) {
    Lane l = ParseLane(spec);
    RuntimeConfig rc;
    rc.model.num_layers = max_layer + 1;
    rc.model.num_q_heads = hq;
    rc.model.num_kv_heads = hkv;
    rc.model.head_dim = d;
    rc.model.kv_dtype = prm.kv_dtype;
    rc.capacity.max_sequences = 1;
    rc.capacity.max_batch = 1;
    rc.capacity.max_tokens_per_sequence = T;
    rc.tiers.sink_tokens = o.sink;
    rc.tiers.window_tokens = o.window;
    rc.policy.name = l.policy;
    rc.policy.budget_tokens = l.budget;
    rc.policy.params = l.params;
    rc.policy.weights_path = o.weights;
    auto pol = MakePolicy(rc);
    if (!pol.ok()) {
      std::fprintf(stderr, "select_replay_bench: lane %s: %s\n", l.label.c_str(), pol.status().ToString().c_str());
      return 2;
    }
    l.pol = std::move(pol).value();
    ordered |= l.policy.find("xl+") != std::string::npos;
    lanes.push_back(std::move(l));
  }
  const size_t nl = lanes.size(), nlay = trace.layers.size();
  int64_t kmax = 0;
  for (const Lane& l : lanes) kmax = std::max(kmax, l.budget);
  std::fprintf(stderr, "trace %s: %zu layers, T %lld, heads %d/%d, d %d, from %lld, %zu lanes (%.1f s)\n",
               o.trace.c_str(), nlay, static_cast<long long>(T), hq, hkv, d,
               static_cast<long long>(from), nl, Seconds() - t_start);

  std::vector<std::vector<std::unique_ptr<bench::TraceHead>>> heads(nlay);
  // tally[(lane * nlay + layer) * hkv + h]; prev selections / exact top-k for the turnovers.
  std::vector<Tally> tally(nl * nlay * hkv);
  std::vector<std::vector<char>> prev_sel(nl * nlay * hkv), prev_top(nl * nlay * hkv);
  std::vector<Status> failure(nlay, Status::Ok());

  auto prime = [&](size_t li) {
    const bench::TraceLayer& L = trace.layers[li];
    for (int h = 0; h < hkv; ++h) heads[li].push_back(std::make_unique<bench::TraceHead>(L, h, prm.kv_dtype));
    std::vector<float> pq;
    for (int64_t c0 = 0; c0 < from; c0 += o.chunk) {
      const int64_t c1 = std::min<int64_t>(from, c0 + o.chunk);
      for (int h = 0; h < hkv; ++h) {
        pq.resize(static_cast<size_t>(c1 - c0) * group * d);
        for (int64_t t = c0; t < c1; ++t) {
          std::copy_n(L.q.data() + (t * hq + h * group) * d, group * d, pq.data() + (t - c0) * group * d);
        }
        for (Lane& lane : lanes) {
          PrefillContext pc;
          pc.layer = L.layer;
          pc.kv_head = h;
          pc.q_pos0 = c0;
          pc.num_q = static_cast<int32_t>(c1 - c0);
          pc.n = c1;
          pc.sink = o.sink;
          pc.window = o.window;
          pc.q = lane.pol->wants_prefill_queries() ? pq.data() : nullptr;
          pc.params = prm;
          pc.kv = heads[li][h]->kv();
          if (Status s = lane.pol->OnPrefill(pc); !s.ok()) failure[li] = s;
        }
      }
    }
    for (size_t i = 0; i < nl; ++i) {
      for (int h = 0; h < hkv; ++h) {
        prev_sel[(i * nlay + li) * hkv + h].assign(static_cast<size_t>(T), 0);
        prev_top[(i * nlay + li) * hkv + h].assign(static_cast<size_t>(T), 0);
      }
    }
  };

  auto step = [&](size_t li, int64_t t, Exact& ex, std::vector<int32_t>& out, std::vector<int32_t>& stream) {
    const bench::TraceLayer& L = trace.layers[li];
    const int64_t n = t + 1;
    for (int h = 0; h < hkv; ++h) {
      const float* q = L.q.data() + (t * hq + h * group) * d;
      const int64_t lo = std::min<int64_t>(o.sink, n), hi = std::max<int64_t>(lo, n - o.window);
      ComputeExact(prm, q, *heads[li][h], L, h, n, lo, hi, kmax, ex);
      for (size_t i = 0; i < nl; ++i) {
        Lane& lane = lanes[i];
        const size_t ti = (i * nlay + li) * hkv + h;
        Tally& ta = tally[ti];
        SelectContext ctx;
        ctx.layer = L.layer;
        ctx.kv_head = h;
        ctx.n = n;
        ctx.sink = o.sink;
        ctx.window = o.window;
        ctx.budget = lane.budget;
        ctx.q = q;
        ctx.params = prm;
        ctx.kv = heads[li][h]->kv();
        out.clear();
        const double s0 = Seconds();
        if (Status s = lane.pol->Select(ctx, out); !s.ok()) {
          failure[li] = s;
          return;
        }
        ta.select_s += Seconds() - s0;
        ++ta.steps;
        const int64_t k_off = std::clamp<int64_t>(lane.budget - (lo) - (n - hi), 0, hi - lo);
        std::vector<char>& ps = prev_sel[ti];
        std::vector<char>& pt = prev_top[ti];
        // recall of the exact top-k_off, and the exact top-k's own turnover
        std::vector<char> in(static_cast<size_t>(n), 0);
        for (const int32_t x : out) in[x] = 1;
        int64_t hit = 0, fresh = 0;
        for (int64_t r = 0; r < k_off; ++r) {
          hit += in[ex.order[r]];
          fresh += pt[ex.order[r]] == 0;
        }
        ta.recall += k_off > 0 ? double(hit) / k_off : 1.0;
        ta.fresh += k_off > 0 ? double(fresh) / k_off : 0.0;
        std::fill(pt.begin(), pt.end(), 0);
        for (int64_t r = 0; r < k_off; ++r) pt[ex.order[r]] = 1;
        int64_t sel_off = 0, new_off = 0;
        for (const int32_t x : out) {
          if (x >= lo && x < hi) {
            ++sel_off;
            new_off += ps[x] == 0;
          }
        }
        ta.turnover += sel_off > 0 ? double(new_off) / sel_off : 0.0;
        std::fill(ps.begin(), ps.end(), 0);
        for (const int32_t x : out) ps[x] = 1;
        double m = 0, e = 0;
        Judge(ex, L, h, prm, out, &m, &e);
        ta.mass += m, ta.rel_err += e;
        // the oracle's and streaming's selections at the same budget
        std::vector<int32_t>& orc = stream;
        orc.clear();
        for (int64_t x = 0; x < lo; ++x) orc.push_back(static_cast<int32_t>(x));
        orc.insert(orc.end(), ex.order.begin(), ex.order.begin() + k_off);
        for (int64_t x = hi; x < n; ++x) orc.push_back(static_cast<int32_t>(x));
        Judge(ex, L, h, prm, orc, &m, &e);
        ta.oracle_mass += m, ta.oracle_err += e;
        orc.clear();
        const int64_t recent = std::max<int64_t>(0, std::min<int64_t>(n - lo, lane.budget - lo));
        for (int64_t x = 0; x < lo; ++x) orc.push_back(static_cast<int32_t>(x));
        for (int64_t x = n - recent; x < n; ++x) orc.push_back(static_cast<int32_t>(x));
        Judge(ex, L, h, prm, orc, &m, &e);
        ta.streaming_mass += m;
      }
    }
  };

  const int threads = ordered ? 1 : std::max(1, o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency()));
  std::atomic<size_t> next_layer{0};
  std::mutex log_mu;
  auto worker = [&] {
    Exact ex;
    std::vector<int32_t> out, scratch;
    for (size_t li = next_layer++; li < nlay; li = next_layer++) {
      prime(li);
      for (int64_t t = from; t < T && failure[li].ok(); ++t) step(li, t, ex, out, scratch);
      std::lock_guard<std::mutex> lock(log_mu);
      std::fprintf(stderr, "layer %d done (%.0f s)\n", trace.layers[li].layer, Seconds() - t_start);
    }
  };
  if (ordered) {
    Exact ex;
    std::vector<int32_t> out, scratch;
    for (size_t li = 0; li < nlay; ++li) prime(li);
    for (int64_t t = from; t < T; ++t) {
      for (size_t li = 0; li < nlay && failure[li].ok(); ++li) step(li, t, ex, out, scratch);
    }
  } else {
    std::vector<std::thread> pool;
    for (int w = 0; w < threads; ++w) pool.emplace_back(worker);
    for (auto& th : pool) th.join();
  }
  for (size_t li = 0; li < nlay; ++li) {
    if (!failure[li].ok()) {
      std::fprintf(stderr, "select_replay_bench: layer %d: %s\n", trace.layers[li].layer,
                   failure[li].ToString().c_str());
      return 1;
    }
  }

  std::ostringstream js;
  js << "{\"bench\": \"select_replay\", \"trace\": \"" << o.trace << "\", \"text\": \""
     << (trace.metadata.count("text") ? trace.metadata.at("text") : "") << "\", \"positions\": " << T
     << ", \"from\": " << from << ", \"layers\": " << nlay << ", \"q_heads\": " << hq
     << ", \"kv_heads\": " << hkv << ", \"head_dim\": " << d << ", \"sink\": " << o.sink
     << ", \"window\": " << o.window << ", \"lanes\": [";
  for (size_t i = 0; i < nl; ++i) {
    const Lane& lane = lanes[i];
    Tally all;
    std::ostringstream per_layer, per_head;
    for (size_t li = 0; li < nlay; ++li) {
      Tally lt;
      for (int h = 0; h < hkv; ++h) {
        const Tally& th = tally[(i * nlay + li) * hkv + h];
        lt.Add(th);
        if (lane.label == o.detail) {
          per_head << (li + h ? ",\n    " : "\n    ") << "{\"layer\": " << trace.layers[li].layer
                   << ", \"kv_head\": " << h << ", \"all\": " << th.Json() << "}";
        }
      }
      all.Add(lt);
      per_layer << (li ? ",\n    " : "\n    ") << "{\"layer\": " << trace.layers[li].layer
                << ", \"all\": " << lt.Json() << "}";
    }
    std::string params;
    for (const auto& [k, v] : lane.params) params += (params.empty() ? "\"" : ", \"") + k + "\": " + Fmt(v);
    js << (i ? ",\n " : "\n ") << "{\"label\": \"" << lane.label << "\", \"policy\": \"" << lane.policy
       << "\", \"budget\": " << lane.budget << ", \"params\": {" << params << "}, \"all\": " << all.Json()
       << ",\n  \"per_layer\": [" << per_layer.str() << "]";
    if (lane.label == o.detail) js << ",\n  \"per_head\": [" << per_head.str() << "]";
    js << "}";
    const double s = static_cast<double>(std::max<int64_t>(all.steps, 1));
    std::printf("%-40s recall %.3f mass %.3f (oracle %.3f, streaming %.3f) rel_err %.3f (oracle %.3f) "
                "turnover %.3f (exact %.3f) select %.1f us\n",
                lane.label.c_str(), all.recall / s, all.mass / s, all.oracle_mass / s,
                all.streaming_mass / s, all.rel_err / s, all.oracle_err / s, all.turnover / s,
                all.fresh / s, all.select_s / s * 1e6);
  }
  js << "]}\n";
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << js.str();
    if (!f) {
      std::fprintf(stderr, "select_replay_bench: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  std::fprintf(stderr, "done in %.0f s\n", Seconds() - t_start);
  return 0;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) { return kvferry::Run(kvferry::Parse(argc, argv)); }
