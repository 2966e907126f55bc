// Copyright kvferry authors. Apache-2.0.
// kvferry-bench: attention-level experiments. Prefills --context tokens (synthetic workload or a
// real trace), decodes --steps steps through the Runtime with the chosen policy, route and
// backend, and writes one JSON object: accuracy against dense attention (recall of the oracle
// top-k, attention-mass recall, relative output error) and cost (ms per step, PCIe bytes).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/lib/metrics.h"
#include "bench/lib/safetensors.h"
#include "bench/lib/synthetic.h"
#include "cpu/dtype.h"
#include "kvferry/kvferry.h"
#include "tools/common/args.h"

namespace kvferry::bench {
namespace {

struct Options {
  std::string policy = "oracle";
  int64_t context = 8192;
  double budget = 256;  // tokens, or a fraction of the context when < 1
  int steps = 16;
  int layers = 1;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int batch = 1;
  std::string backend = "host";
  std::string route = "auto";
  int64_t seed = 1;
  std::string json;
  std::string trace;
  std::string weights;  // --policy-weights
  int sink = 4;
  int window = 64;
  std::string kv_dtype = "bf16";
  std::map<std::string, double> params;
  bool accuracy = true;
  int bank_slots = 0;
  std::string bank_map = "vector";
  int cpu_threads = 0;
  bool context_set = false;
};

// The tool's command line (tools/common/args.h): every value checked with its range, --json
// checked writable and --trace readable, all before any work.
tools::ArgParser MakeParser(Options& o) {
  tools::ArgParser p("kvferry-bench",
                     "[options]\n"
                     "Prefills --context tokens (synthetic workload or a --trace), decodes --steps "
                     "steps through the\nRuntime and prints one JSON object: accuracy against dense "
                     "attention and cost.\n");
  constexpr int64_t kMaxTokens = int64_t{1} << 24;
  p.String("--policy", "NAME", "selection policy (the runtime names the ones built)", &o.policy)
      .Value("--context", "N", "tokens prefilled before decoding; with --trace at most its tokens"
             " - --steps (whole number in [1, 16777216]; default 8192)",
             [&o](const std::string& flag, const std::string& v) {
               int64_t x = 0;
               const std::string problem = tools::WholeProblem(v, 1, kMaxTokens, &x);
               if (!problem.empty()) return tools::BadValue(flag, v, problem);
               o.context = x;
               o.context_set = true;
               return std::string();
             }, /*value_may_start_with_dashes=*/true)
      .Value("--budget", "N|F",
             "attended tokens per step: a whole number of tokens in [1, 16777216], or a fraction "
             "of the context in (0, 1) (default 256)",
             [&o](const std::string& flag, const std::string& v) {
               double x = 0;
               const std::string real = tools::RealProblem(v, 0.0, double(kMaxTokens), true, &x);
               if (!real.empty() || (x >= 1.0 && x != std::floor(x))) {
                 int64_t whole = 0;
                 std::string why = tools::WholeProblem(v, 1, kMaxTokens, &whole);
                 if (why.empty()) why = "out of range";  // unreachable: x was not whole
                 const size_t paren = why.find(" (");
                 return tools::BadValue(flag, v, why.substr(0, paren) +
                                                     " (want a whole number of tokens in [1, " +
                                                     std::to_string(kMaxTokens) +
                                                     "] or a fraction of the context in (0, 1))");
               }
               o.budget = x;
               return std::string();
             }, /*value_may_start_with_dashes=*/true)
      .Whole("--steps", "decode steps timed", &o.steps, 1, 1000000)
      .Whole("--layers", "layers (synthetic workload)", &o.layers, 1, 1024)
      .Whole("--q-heads", "query heads (synthetic workload)", &o.q_heads, 1, 1024)
      .Whole("--kv-heads", "KV heads (synthetic workload)", &o.kv_heads, 1, 1024)
      .Whole("--head-dim", "head dimension (synthetic workload)", &o.head_dim, 1, 1024)
      .Whole("--batch", "sequences decoded together", &o.batch, 1, 4096)
      .Choice("--backend", "where the GPU tier lives (cuda needs a CUDA device)", &o.backend,
              {"host", "cuda", "auto"})
      .Choice("--route", "where offloaded rows are attended", &o.route, {"auto", "gpu", "cpu"})
      .Whole("--seed", "synthetic workload's seed", &o.seed, 0,
             std::numeric_limits<int64_t>::max())
      .OutputFile("--json", "also write the JSON object to PATH (checked before the run)", &o.json)
      .InputFile("--trace", "replay a recorded trace (kvferry-llama --dump-trace) instead of the "
                 "synthetic workload", &o.trace, "FILE.safetensors")
      .Whole("--sink", "sink tokens kept resident", &o.sink, 0, 1 << 20)
      .Whole("--window", "recent tokens kept resident", &o.window, 0, 1 << 20)
      .Choice("--kv-dtype", "KV cache element type", &o.kv_dtype, {"bf16", "f16"})
      .KeyReal("--param", "a policy parameter (the runtime checks its name and range)",
               [&o](const std::string& key, double v) { o.params[key] = v; })
      .InputFile("--policy-weights", "trained weights of a policy that takes them (kvpop's scorer, "
                 "scripts/kvpop_train.py)", &o.weights, "FILE.safetensors")
      .Whole("--bank-slots", "device token-bank slots per table (0: no bank)", &o.bank_slots, 0,
             65534)
      .Choice("--bank-map", "token bank's position map", &o.bank_map, {"vector", "hash"})
      .Whole("--cpu-threads", "runtime's CPU threads (0: the cores near the GPU)", &o.cpu_threads,
             0, 4096)
      .Switch("--no-accuracy", "skip the accuracy metrics (cost only)",
              [&o](const std::string&) {
                o.accuracy = false;
                return std::string();
              });
  return p;
}

// Parses the command line; on --help or a usage error prints and exits (0 or 2).
Options Parse(int argc, char** argv) {
  Options o;
  tools::ArgParser p = MakeParser(o);
  const int rc = p.ParseAndReport(argc, argv);
  if (rc >= 0) std::exit(rc);
  // --backend cuda: a GPU must be there, said before any work (the runtime's own error would
  // be the CUDA runtime's, "CUDA driver version is insufficient", on a machine with no driver).
  if (o.backend == "cuda") {
#if defined(KVFERRY_WITH_CUDA)
    const std::string problem = tools::CudaDeviceProblem();
#else
    const std::string problem = "kvferry was built without CUDA (configure with nvcc present)";
#endif
    if (!problem.empty()) {
      std::fprintf(stderr, "kvferry-bench: --backend cuda: %s; use --backend host or auto\n",
                   problem.c_str());
      std::exit(tools::kExitFailure);
    }
  }
  return o;
}

// Where q, k, v come from: the synthetic generator or a recorded trace.
class Source {
 public:
  virtual ~Source() = default;
  virtual void KeysValues(int seq, int layer, int64_t pos0, int64_t count, float* k, float* v) = 0;
  virtual void Queries(int seq, int layer, int64_t pos0, int64_t count, float* q) = 0;
};

class SyntheticSource final : public Source {
 public:
  SyntheticSource(const Options& o, int64_t positions) {
    for (int b = 0; b < o.batch; ++b) {
      SyntheticShape s;
      s.num_layers = o.layers;
      s.num_q_heads = o.q_heads;
      s.num_kv_heads = o.kv_heads;
      s.head_dim = o.head_dim;
      s.max_positions = positions;
      s.seed = static_cast<uint64_t>(o.seed) * 1000003u + static_cast<uint64_t>(b);
      s.sinks = 4;
      gens_.push_back(std::make_unique<SyntheticWorkload>(s));
    }
  }
  void KeysValues(int seq, int layer, int64_t pos0, int64_t count, float* k, float* v) override {
    gens_[seq]->KeysValues(layer, pos0, count, k, v);
  }
  void Queries(int seq, int layer, int64_t pos0, int64_t count, float* q) override {
    gens_[seq]->Queries(layer, pos0, count, q);
  }

 private:
  std::vector<std::unique_ptr<SyntheticWorkload>> gens_;
};

class TraceSource final : public Source {
 public:
  explicit TraceSource(Trace t) : trace_(std::move(t)) {}
  void KeysValues(int, int layer, int64_t pos0, int64_t count, float* k, float* v) override {
    const TraceLayer& l = trace_.layers[layer];
    const int64_t w = static_cast<int64_t>(l.num_kv_heads) * l.head_dim;
    std::copy(l.k.begin() + pos0 * w, l.k.begin() + (pos0 + count) * w, k);
    std::copy(l.v.begin() + pos0 * w, l.v.begin() + (pos0 + count) * w, v);
  }
  void Queries(int, int layer, int64_t pos0, int64_t count, float* q) override {
    const TraceLayer& l = trace_.layers[layer];
    const int64_t w = static_cast<int64_t>(l.num_q_heads) * l.head_dim;
    std::copy(l.q.begin() + pos0 * w, l.q.begin() + (pos0 + count) * w, q);
  }
  const Trace& trace() const { return trace_; }

 private:
  Trace trace_;
};

float RoundKv(DType t, float x) {
  return t == DType::kBF16 ? cpu::Bf16ToF32(cpu::F32ToBf16(x)) : cpu::F16ToF32(cpu::F32ToF16(x));
}

int Run(const Options& opt_in) {
  Options o = opt_in;
  std::unique_ptr<Source> source;
  std::string workload = "synthetic";
  if (!o.trace.empty()) {
    Result<Trace> t = LoadTrace(o.trace);
    if (!t.ok()) {
      std::fprintf(stderr, "error: %s\n", t.status().ToString().c_str());
      return 1;
    }
    const TraceLayer& l0 = t.value().layers.at(0);
    o.layers = static_cast<int>(t.value().layers.size());
    o.q_heads = l0.num_q_heads;
    o.kv_heads = l0.num_kv_heads;
    o.head_dim = l0.head_dim;
    const int64_t tokens = l0.num_tokens;
    if (!o.context_set || o.context + o.steps > tokens) o.context = tokens - o.steps;
    if (o.context < 1) {
      std::fprintf(stderr, "kvferry-bench: --trace %s: %lld tokens, too short for --steps %d "
                   "(it needs at least --steps + 1)\n", o.trace.c_str(),
                   static_cast<long long>(tokens), o.steps);
      return tools::kExitUsage;
    }
    workload = "trace:" + o.trace;
    auto it = t.value().metadata.find("model");
    if (it != t.value().metadata.end()) workload += " (" + it->second + ")";
    source = std::make_unique<TraceSource>(std::move(t).value());
  } else {
    source = std::make_unique<SyntheticSource>(o, o.context + o.steps);
  }

  RuntimeConfig c;
  c.model.num_layers = o.layers;
  c.model.num_q_heads = o.q_heads;
  c.model.num_kv_heads = o.kv_heads;
  c.model.head_dim = o.head_dim;
  c.model.kv_dtype = o.kv_dtype == "f16" ? DType::kF16 : DType::kBF16;
  c.capacity.max_sequences = o.batch;
  c.capacity.max_batch = o.batch;
  c.capacity.max_tokens_per_sequence = o.context + o.steps + 1;
  c.capacity.max_prefill_chunk = std::min<int64_t>(o.context, 2048);
  c.tiers.sink_tokens = o.sink;
  c.tiers.window_tokens = o.window;
  c.tiers.bank_slots = o.bank_slots;
  c.tiers.bank_map = o.bank_map;
  c.policy.name = o.policy;
  if (o.budget < 1.0) {
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = o.budget;
  } else {
    c.policy.budget_tokens = static_cast<int64_t>(o.budget);
  }
  c.policy.params = o.params;
  c.policy.weights_path = o.weights;
  c.route = o.route == "gpu" ? Route::kGpu : o.route == "cpu" ? Route::kCpu : Route::kAuto;
  c.backend = o.backend == "cuda" ? Backend::kCuda : o.backend == "auto" ? Backend::kAuto : Backend::kHost;
  c.cpu_threads = o.cpu_threads;

  auto created = Runtime::Create(c);
  if (!created.ok()) {
    std::fprintf(stderr, "error: %s\n", created.status().ToString().c_str());
    return 1;
  }
  Runtime& rt = *created.value();
  const int hq = o.q_heads, hkv = o.kv_heads, d = o.head_dim, group = hq / hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t total = o.context + o.steps;

  // Stored K/V as the runtime holds them (rounded), for the accuracy metrics.
  std::vector<std::vector<float>> kept_k, kept_v;  // [seq * layers + layer]
  if (o.accuracy) {
    kept_k.resize(static_cast<size_t>(o.batch) * o.layers);
    kept_v.resize(kept_k.size());
    for (auto& x : kept_k) x.reserve(static_cast<size_t>(total * hkv * d));
    for (auto& x : kept_v) x.reserve(static_cast<size_t>(total * hkv * d));
  }
  auto keep = [&](int b, int layer, const float* k, const float* v, int64_t rows) {
    if (!o.accuracy) return;
    auto& kk = kept_k[static_cast<size_t>(b) * o.layers + layer];
    auto& vv = kept_v[static_cast<size_t>(b) * o.layers + layer];
    for (int64_t i = 0; i < rows * hkv * d; ++i) {
      kk.push_back(RoundKv(c.model.kv_dtype, k[i]));
      vv.push_back(RoundKv(c.model.kv_dtype, v[i]));
    }
  };
  auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d});
  };

  using Clock = std::chrono::steady_clock;
  const auto t_prefill = Clock::now();
  std::vector<float> q, k, v, out;
  for (int b = 0; b < o.batch; ++b) {
    if (Status s = rt.AddSequence(static_cast<SequenceId>(b)); !s.ok()) {
      std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
      return 1;
    }
    for (int layer = 0; layer < o.layers; ++layer) {
      for (int64_t p0 = 0; p0 < o.context; p0 += c.capacity.max_prefill_chunk) {
        const int64_t t = std::min<int64_t>(c.capacity.max_prefill_chunk, o.context - p0);
        q.resize(t * hq * d);
        k.resize(t * hkv * d);
        v.resize(t * hkv * d);
        out.resize(t * hq * d);
        source->Queries(b, layer, p0, t, q.data());
        source->KeysValues(b, layer, p0, t, k.data(), v.data());
        Status s = rt.Prefill(static_cast<SequenceId>(b), layer, view(q, t, hq), view(k, t, hkv),
                              view(v, t, hkv), view(out, t, hq));
        if (!s.ok()) {
          std::fprintf(stderr, "error: prefill: %s\n", s.ToString().c_str());
          return 1;
        }
        keep(b, layer, k.data(), v.data(), t);
      }
    }
    std::fprintf(stderr, "prefilled sequence %d/%d (%lld tokens x %d layers)\n", b + 1, o.batch,
                 static_cast<long long>(o.context), o.layers);
  }
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t_prefill).count();
  // The prefill's counters, before they are reset so that the decode's stand alone.
  const Stats prefill_stats = rt.GetStats();
  rt.ResetStats();

  std::vector<SequenceId> seqs(static_cast<size_t>(o.batch));
  for (int b = 0; b < o.batch; ++b) seqs[b] = static_cast<SequenceId>(b);
  double decode_ms = 0, sum_recall = 0, sum_mass = 0, sum_err = 0, max_err = 0;
  int64_t samples = 0;
  std::vector<float> qb(static_cast<size_t>(o.batch) * hq * d), kb(static_cast<size_t>(o.batch) * hkv * d),
      vb(kb.size()), ob(qb.size());
  for (int step = 0; step < o.steps; ++step) {
    const int64_t pos = o.context + step;
    for (int layer = 0; layer < o.layers; ++layer) {
      for (int b = 0; b < o.batch; ++b) {
        source->Queries(b, layer, pos, 1, qb.data() + static_cast<size_t>(b) * hq * d);
        source->KeysValues(b, layer, pos, 1, kb.data() + static_cast<size_t>(b) * hkv * d,
                           vb.data() + static_cast<size_t>(b) * hkv * d);
      }
      const auto t0 = Clock::now();
      Status s = rt.Decode(seqs, layer, view(qb, o.batch, hq), view(kb, o.batch, hkv),
                           view(vb, o.batch, hkv), view(ob, o.batch, hq));
      decode_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (!s.ok()) {
        std::fprintf(stderr, "error: decode: %s\n", s.ToString().c_str());
        return 1;
      }
      if (!o.accuracy) continue;
      for (int b = 0; b < o.batch; ++b) {
        keep(b, layer, kb.data() + static_cast<size_t>(b) * hkv * d,
             vb.data() + static_cast<size_t>(b) * hkv * d, 1);
        const auto& kk = kept_k[static_cast<size_t>(b) * o.layers + layer];
        const auto& vv = kept_v[static_cast<size_t>(b) * o.layers + layer];
        const int64_t n = pos + 1;
        const int64_t budget = c.policy.budget_tokens > 0
                                   ? c.policy.budget_tokens
                                   : static_cast<int64_t>(std::ceil(c.policy.budget_fraction * n));
        for (int h = 0; h < hkv; ++h) {
          auto sel = rt.LastSelection(static_cast<SequenceId>(b), layer, h);
          if (!sel.ok()) {
            std::fprintf(stderr, "error: %s\n", sel.status().ToString().c_str());
            return 1;
          }
          StepAccuracy a = MeasureStep(
              qb.data() + (static_cast<size_t>(b) * hq + h * group) * d, group, d, scale,
              kk.data() + h * d, vv.data() + h * d, static_cast<int64_t>(hkv) * d, n, sel.value(),
              budget, ob.data() + (static_cast<size_t>(b) * hq + h * group) * d);
          sum_recall += a.recall;
          sum_mass += a.mass_recall;
          sum_err += a.rel_err;
          max_err = std::max(max_err, a.rel_err);
          ++samples;
        }
      }
    }
    if (o.steps >= 10 && (step + 1) % std::max(1, o.steps / 10) == 0) {
      std::fprintf(stderr, "step %d/%d  %.3f ms/step\n", step + 1, o.steps, decode_ms / (step + 1));
    }
  }
  // "stats": the decode steps' counters (reset after the prefill, so that bytes and rows are the
  // decode's alone) with the prefill's own counters put back: prefill_tokens used to read 0 next
  // to prefill_s because the reset cleared them.
  Stats st = rt.GetStats();
  st.prefill_tokens = prefill_stats.prefill_tokens;
  st.prefill_chunks_prefetched = prefill_stats.prefill_chunks_prefetched;
  const double tokens = static_cast<double>(o.steps) * o.batch;
  std::ostringstream js;
  js.precision(6);
  js << "{\"policy\":\"" << o.policy << "\",\"workload\":\"" << workload << "\""
     << ",\"context\":" << o.context << ",\"budget\":" << o.budget << ",\"steps\":" << o.steps
     << ",\"layers\":" << o.layers << ",\"q_heads\":" << hq << ",\"kv_heads\":" << hkv
     << ",\"head_dim\":" << d << ",\"batch\":" << o.batch << ",\"kv_dtype\":\"" << o.kv_dtype
     << "\",\"sink\":" << o.sink << ",\"window\":" << o.window
     << ",\"backend\":\"" << BackendName(rt.backend()) << "\",\"route\":\"" << o.route
     << "\",\"seed\":" << o.seed;
  if (!o.weights.empty()) js << ",\"policy_weights\":\"" << o.weights << "\"";
  if (o.accuracy && samples > 0) {
    js << ",\"recall\":" << sum_recall / samples << ",\"mass_recall\":" << sum_mass / samples
       << ",\"rel_err\":" << sum_err / samples << ",\"rel_err_max\":" << max_err;
  } else {
    js << ",\"recall\":null,\"mass_recall\":null,\"rel_err\":null";
  }
  js << ",\"ms_per_step\":" << decode_ms / o.steps
     << ",\"ms_per_layer_step\":" << decode_ms / (static_cast<double>(o.steps) * o.layers)
     << ",\"bytes_h2d\":" << st.bytes_h2d << ",\"bytes_d2h\":" << st.bytes_d2h
     << ",\"bytes_h2d_per_token\":" << st.bytes_h2d / tokens
     << ",\"bytes_d2h_per_token\":" << st.bytes_d2h / tokens << ",\"prefill_s\":" << prefill_s
     << ",\"prefill_tokens\":" << prefill_stats.prefill_tokens
     << ",\"prefill_bytes_h2d\":" << prefill_stats.bytes_h2d
     << ",\"prefill_bytes_d2h\":" << prefill_stats.bytes_d2h
     << ",\"stats\":" << st.ToJson() << "}";
  std::printf("%s\n", js.str().c_str());
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << js.str() << "\n";
    if (!f) {
      std::fprintf(stderr, "error: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvferry::bench

int main(int argc, char** argv) {
  // Errors are values inside; this only turns an escaped exception (std::bad_alloc for a workload
  // larger than memory) into a message and exit 1 instead of an abort.
  try {
    return kvferry::bench::Run(kvferry::bench::Parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvferry-bench: unexpected error: %s\n", e.what());
    return kvferry::tools::kExitFailure;
  }
}
