// Copyright kvferry authors. Apache-2.0.
// prefill_host_bench: dense causal prefill on the host backend through the public API, as an
// engine without a GPU runs it. One layer, one sequence: a prompt of T tokens goes through
// Runtime::Prefill in chunks of C tokens (host f32 q/k/v/out tensors, as examples/llama passes
// them); only the Prefill calls are timed (the random inputs of a chunk are made before its call).
//
// Shapes: llama8b (Llama-3.1-8B attention: 32 q / 8 KV heads, head_dim 128, bf16 KV, chunks of
// 2048 as kvferry-bench uses) and smollm2 (SmolLM2-135M: 9 q / 3 KV heads, head_dim 64, f16 KV
// and chunks of 512, as examples/llama runs it).
//
// Reports tokens/s and attention GFLOP/s: causal attention of T tokens costs
// 4 * head_dim * q_heads * T (T + 1) / 2 flops (QK^T and PV; softmax not counted).
//
//   prefill_host_bench [--shapes llama8b,smollm2] [--tokens 2048,8192] [--chunk N]
//                      [--threads N] [--repeats R] [--label NAME] [--json OUT]
// --chunk overrides both shapes' chunk; --threads 0 = all cores (the runtime's default); the best
// of --repeats runs (fresh sequence each), after one untimed warm-up of up to 4096 tokens per
// shape, is reported.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu/attention.h"
#include "cpu/cpu_features.h"
#include "kvferry/kvferry.h"

namespace kvferry {
namespace {

struct Shape {
  std::string name;
  int q_heads, kv_heads, head_dim;
  DType kv_dtype;
  int64_t chunk;
};

const Shape kShapes[] = {
    {"llama8b", 32, 8, 128, DType::kBF16, 2048},
    {"smollm2", 9, 3, 64, DType::kF16, 512},
};

struct Row {
  std::string shape;
  int64_t tokens = 0, chunk = 0;
  double seconds = 0, tokens_per_s = 0, gflops = 0;
};

[[noreturn]] void Usage(const char* msg) {
  std::fprintf(stderr,
               "error: %s\nusage: prefill_host_bench [--shapes llama8b,smollm2] "
               "[--tokens 2048,8192] [--chunk N] [--threads N] [--repeats R] [--label NAME] "
               "[--json OUT]\n",
               msg);
  std::exit(2);
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

double Flops(const Shape& s, int64_t tokens) {
  return 4.0 * s.head_dim * s.q_heads * static_cast<double>(tokens) * (tokens + 1) / 2.0;
}

// One prefill of \p tokens tokens in chunks; returns the seconds spent inside Runtime::Prefill.
Result<double> RunOnce(Runtime& rt, SequenceId seq, const Shape& s, int64_t tokens, int64_t chunk,
                       std::mt19937& rng) {
  KVF_RETURN_IF_ERROR(rt.AddSequence(seq));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> q, k, v, out;
  const int d = s.head_dim;
  auto view = [d](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d});
  };
  double seconds = 0;
  for (int64_t p0 = 0; p0 < tokens; p0 += chunk) {
    const int64_t t = std::min(chunk, tokens - p0);
    q.resize(static_cast<size_t>(t * s.q_heads * d));
    k.resize(static_cast<size_t>(t * s.kv_heads * d));
    v.resize(k.size());
    out.assign(q.size(), 0.0f);
    for (float& x : q) x = 2.0f * dist(rng);
    for (float& x : k) x = dist(rng);
    for (float& x : v) x = dist(rng);
    const auto t0 = std::chrono::steady_clock::now();
    KVF_RETURN_IF_ERROR(rt.Prefill(seq, 0, view(q, t, s.q_heads), view(k, t, s.kv_heads),
                                   view(v, t, s.kv_heads), view(out, t, s.q_heads)));
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // A result that is all zero or not finite would make the timing meaningless.
    double norm = 0;
    for (float x : out) norm += static_cast<double>(x) * x;
    if (!(norm > 0) || !std::isfinite(norm)) {
      return Status(StatusCode::kInternal, "prefill output is zero or not finite");
    }
  }
  KVF_RETURN_IF_ERROR(rt.RemoveSequence(seq));
  return seconds;
}

int Main(int argc, char** argv) {
  std::vector<std::string> shapes = {"llama8b", "smollm2"};
  std::vector<int64_t> token_list = {2048, 8192};
  int64_t chunk_override = 0;
  int threads = 0, repeats = 1;
  std::string label = "run", json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) Usage((a + " needs a value").c_str());
    const std::string val = argv[++i];
    if (a == "--shapes") {
      shapes = Split(val);
    } else if (a == "--tokens") {
      token_list.clear();
      for (const std::string& t : Split(val)) token_list.push_back(std::atoll(t.c_str()));
    } else if (a == "--chunk") {
      chunk_override = std::atoll(val.c_str());
    } else if (a == "--threads") {
      threads = std::atoi(val.c_str());
    } else if (a == "--repeats") {
      repeats = std::max(1, std::atoi(val.c_str()));
    } else if (a == "--label") {
      label = val;
    } else if (a == "--json") {
      json = val;
    } else {
      Usage(("unknown flag " + a).c_str());
    }
  }
  for (int64_t t : token_list) {
    if (t < 1) Usage("--tokens: want whole numbers >= 1");
  }
  std::vector<Row> rows;
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  for (const std::string& name : shapes) {
    const Shape* found = nullptr;
    for (const Shape& s : kShapes) {
      if (s.name == name) found = &s;
    }
    if (found == nullptr) Usage(("unknown shape " + name).c_str());
    const Shape& s = *found;
    const int64_t chunk = chunk_override > 0 ? chunk_override : s.chunk;
    const int64_t max_tokens = *std::max_element(token_list.begin(), token_list.end());
    RuntimeConfig c;
    c.model.num_layers = 1;
    c.model.num_q_heads = s.q_heads;
    c.model.num_kv_heads = s.kv_heads;
    c.model.head_dim = s.head_dim;
    c.model.kv_dtype = s.kv_dtype;
    c.capacity.max_sequences = 1;
    c.capacity.max_batch = 1;
    c.capacity.max_tokens_per_sequence = max_tokens + 1;
    c.capacity.max_prefill_chunk = chunk;
    c.policy.name = "dense";
    c.backend = Backend::kHost;
    c.cpu_threads = threads;
    c.probe_at_start = false;
    auto created = Runtime::Create(c);
    if (!created.ok()) {
      std::fprintf(stderr, "error: %s\n", created.status().ToString().c_str());
      return 1;
    }
    Runtime& rt = *created.value();
    std::mt19937 rng(1234);
    SequenceId seq = 1;
    // Untimed warm-up: oneDNN JIT-compiles each matmul shape once per thread; 4096 tokens meet
    // every shape the timed runs use.
    if (Result<double> w = RunOnce(rt, seq++, s, std::min<int64_t>(max_tokens, 4096), chunk, rng);
        !w.ok()) {
      std::fprintf(stderr, "error: %s warm-up: %s\n", s.name.c_str(), w.status().ToString().c_str());
      return 1;
    }
    for (int64_t tokens : token_list) {
      double best = 0;
      for (int r = 0; r < repeats; ++r) {
        Result<double> sec = RunOnce(rt, seq++, s, tokens, chunk, rng);
        if (!sec.ok()) {
          std::fprintf(stderr, "error: %s T=%lld: %s\n", s.name.c_str(),
                       static_cast<long long>(tokens), sec.status().ToString().c_str());
          return 1;
        }
        if (r == 0 || sec.value() < best) best = sec.value();
      }
      Row row;
      row.shape = s.name;
      row.tokens = tokens;
      row.chunk = chunk;
      row.seconds = best;
      row.tokens_per_s = static_cast<double>(tokens) / best;
      row.gflops = Flops(s, tokens) / best * 1e-9;
      std::printf("%-8s T=%-6lld chunk=%-5lld %9.3f s %10.1f tok/s %8.1f GFLOP/s\n",
                  s.name.c_str(), static_cast<long long>(tokens), static_cast<long long>(chunk),
                  best, row.tokens_per_s, row.gflops);
      std::fflush(stdout);
      rows.push_back(row);
    }
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"bench\": \"prefill_host\", \"label\": \"" << label << "\", \"hardware_threads\": " << hw
      << ", \"cpu_threads\": " << threads << ", \"cpu_isa\": \""
      << cpu::CpuIsaName(cpu::BestCpuIsa()) << "\", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      f << (i ? ",\n  " : "\n  ") << "{\"shape\": \"" << r.shape << "\", \"tokens\": " << r.tokens
        << ", \"chunk\": " << r.chunk << ", \"seconds\": " << r.seconds
        << ", \"tokens_per_s\": " << r.tokens_per_s << ", \"gflops\": " << r.gflops << "}";
    }
    f << "\n]}\n";
  }
  return 0;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) { return kvferry::Main(argc, argv); }
