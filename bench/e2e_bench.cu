// Copyright kvferry authors. Apache-2.0.
// kvferry-e2e: the Runtime driven the way an engine drives it. Every token step runs the attention
// of all layers (Llama-3.1-8B shape by default: 32 layers, 32 q / 8 KV heads, head_dim 128, bf16)
// through the public API with device tensors on the caller's stream; policies whose step is
// capture-safe run as one CUDA graph per token step (PlanDecode, then the graph), the others call
// Decode layer by layer. The cache is filled with Append (device tensors made on the GPU) plus a
// 32-token Prefill per layer that primes policies learning from the prompt's last queries.
// One JSON object per row; scripts/device/e2e_sdpa.py adds torch SDPA's time in the same run.
// `kvferry-e2e --help` lists every flag with its range. Exit codes: 0 at least one row measured
// (or every row larger than the memory allowed: the rows say so), 1 nothing measured (no CUDA
// device, every row skipped for another reason) or a failed run, 2 usage error (a bad value, an
// unknown flag or mode, an unwritable --json: found before any work).
//
//   kvferry-e2e --json out.json [--contexts 32768,131072] [--batches 1,4] [--modes a,b,..]
//               [--steps 20] [--layers 32] [--host-gib 100] [--device-gib 70]
//               [--prefill-chunks 2048,8192] [--prefill-layers 3] [--prefill-order layer|chunk]
//               [--cpu-threads N] [--trace PREFIX] [--param key=value ...] [--query-drift E] [--unique-kv] [--budget-tokens N]
//               [--async-cpu -1|0|1] [--engine-us U] [--engine-gpu-us U] [--route gpu|auto]
// --query real|repeated, --query-drift E, --query-rho R: the decode query. repeated (the default,
// the token bank's best case): one query for every step, as a repeated prompt token. Moving:
// q_s = q_0 + E z_s with z_s = R z_(s-1) + sqrt(1 - R^2) n_s, fresh noise n_s at every step (an
// anchor that stays plus an AR(1) walk that moves; no query ever repeats). real: E and R
// calibrated so that the exact top-k's overlap between steps 1-32 apart matches recorded SmolLM2
// decoding (bench/query_calibration.py, bench/results/query_calibration.json). A moving query
// changes SparCas's dimensions at its refreshes and what the bank must hold; the row says "query"
// ("real", "repeated (best case)" or "moving (drift E, rho R)"), "query_drift" and "query_rho".
// --gpu-gib G caps the runtime's device memory (Capacity::gpu_bytes; the _bank modes take the
// largest bank that fits). A mode may be prefixed by PrHS wrappers: "cis+lfps", "psaw+cis+oracle".
// Modes: dense_cpu (dense, every row attended on the CPU cores), dense_resident (window covers the context), streaming (budget 1024, window 256: 768 rows
// per KV head read over PCIe each step), streaming_resident (budget 1024 = sinks + window: nothing
// read over PCIe), oracle (2%),
// quest (2%, page bounds on the GPU), sparcas (2%, compact keys on the GPU), lfps (2%, route auto), lfps_gpu (2%, route gpu), full_streaming (dense, every row read over PCIe); hip (2%, masks on the GPU); kvpop (2%, slots on the GPU, a random width-16 MLP scorer); any of oracle, quest, sparcas, hip, kvpop with "_bank" appended runs
// with the device token bank (slots for twice the offloaded picks per sequence, layer and KV head);
// any other registered policy's name (knorm, or an engine's own) runs it at 2%, with "_bank" too.

#include <cuda_runtime.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "bench/lib/safetensors.h"
#include "kvferry/kvferry.h"
#include "tools/common/args.h"
#include "tools/common/progress.h"

namespace {

namespace tools = kvferry::tools;
using kvferry::DType;
using kvferry::MemoryKind;
using kvferry::Runtime;
using kvferry::RuntimeConfig;
using kvferry::SequenceId;
using kvferry::Stats;
using kvferry::TensorView;

#define CHECK_CUDA(x)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// Element i of the seeded uniform fill in [-2, 2), truncated to bf16 (FillBf16's value).
__device__ inline uint16_t HashBf16(int64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  const float f = (static_cast<float>(h & 0xffff) / 65536.0f - 0.5f) * 4.0f;
  return static_cast<uint16_t>(__float_as_uint(f) >> 16);
}

__device__ inline float Bf16ToF(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

// The moving query's step (--query-drift, --query-rho): z = rho z + sqrt(1 - rho^2) n with fresh
// noise n (seed), or z = n at the first step; q = bf16(q0 + e z), rounded to nearest even.
__global__ void MoveQuery(uint16_t* q, const uint16_t* q0, float* z, int64_t n, uint32_t seed, float e,
                          float rho, bool first) {
  const float c = sqrtf(fmaxf(0.0f, 1.0f - rho * rho));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float noise = Bf16ToF(HashBf16(i, seed));
    const float zi = first ? noise : rho * z[i] + c * noise;
    z[i] = zi;
    const uint32_t bits = __float_as_uint(Bf16ToF(q0[i]) + e * zi);
    q[i] = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}

// Spins for ns nanoseconds of the GPU's global timer (--engine-gpu-us).
__global__ void SpinKernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

__global__ void FillBf16(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = HashBf16(i, seed);
  }
}

struct Options {
  std::vector<int64_t> contexts = {32768, 131072};
  std::vector<int> batches = {1, 4};
  std::vector<std::string> modes = {"dense_resident", "streaming_resident", "streaming", "oracle",
                                    "lfps", "full_streaming"};
  int steps = 20;
  int layers = 32;
  double host_gib = 100;
  double device_gib = 70;
  // --gpu-gib G: Capacity::gpu_bytes = G GiB for every decode mode (0: no cap); the "_bank" modes
  // then take the largest bank that fits (Tiers::bank_slots = -1).
  double gpu_gib = 0;
  std::string json;
  std::vector<int64_t> prefill_chunks = {2048, 8192};  // prefill_* modes
  int prefill_layers = 3;                              // the first is a warm-up
  // "layer": every chunk of a layer, then the next layer; "chunk": chunk c of every layer, then
  // chunk c + 1 (how an engine runs a model over a long prompt); every layer timed.
  std::string prefill_order = "layer";
  int cpu_threads = 0;  // RuntimeConfig::cpu_threads (0: the cores near the GPU)
  // One more token step after the timed ones, recorded by Runtime::StartTrace/WriteTrace into
  // <trace_prefix>_<mode>_<context>_b<batch>.json (host timeline, Chrome trace format).
  std::string trace_prefix;
  // --param k=v (repeatable): config.policy.params of every decode and prefill mode (unknown keys
  // are the policy's error); written into each row as "params".
  std::vector<std::pair<std::string, double>> params;
  // The decode query (see the top): drift E and rho R of the moving query; E = 0 repeats it.
  double query_drift = 0;  // --query-drift
  double query_rho = 0;    // --query-rho
  std::string query = "repeated";  // --query: repeated, real, or "moving" (--query-drift given)
  // --budget-tokens N: the 2% modes select N tokens at every context instead (the flat check: a
  // fixed budget past it, 2% of 128K at 512K).
  int64_t budget_tokens = 0;
  // --unique-kv: every prompt chunk's keys drawn afresh (else one 4096-token chunk repeats: keys
  // recur every 4096 positions, which leaves a hierarchical search such as HiP's choosing among
  // identical copies).
  bool unique_kv = false;
  // --async-cpu N: RuntimeConfig::async_cpu (-1, the default: on with CUDA; 0: the CPU part of a
  // CPU-placed policy's step on the calling thread).
  int async_cpu = -1;
  // --split-share F: RuntimeConfig::split_share (-1, the default: the cost model's; 1: every miss
  // of a split step on the CPU).
  double split_share = -1.0;
  // --cpu-spin-us N: RuntimeConfig::cpu_spin_us (0, the default: the pool's workers sleep at once).
  int64_t cpu_spin_us = 0;
  // --route auto: the device-selection modes (oracle, quest, sparcas, hip, kvpop; no bank) on
  // route auto, where the scheduler splits each layer's misses with the CPU (Stats::decode_split;
  // outside a CUDA graph only: compare ms_per_token_step_no_graph); default gpu.
  std::string route = "gpu";
  // --engine-us U: after each Decode the caller spins U microseconds on the host, standing for the
  // engine's own host work of the layer (launching its projections and MLP); the rows add the
  // time the caller spent inside Decode ("ms_in_decode_per_step", call by call).
  double engine_us = 0;
  // --engine-gpu-us U: after each Decode a kernel of U microseconds on the stream (one thread
  // spinning on the GPU's clock), standing for the time of the engine's own GPU work of the layer
  // (its projections and MLP: Llama-3.1-8B's 0.44 GB of bf16 weights a layer take about 150 us
  // at 3 TB/s); in the graph too. Its time, not its bandwidth: it reads no memory.
  double engine_gpu_us = 0;
};

// Puts --param's pairs into the policy's parameters and the row ("params":{"k":v,...}).
void AddParams(const Options& o, RuntimeConfig& c, std::ostringstream& row) {
  if (o.params.empty()) return;
  row << ",\"params\":{";
  for (size_t i = 0; i < o.params.size(); ++i) {
    c.policy.params[o.params[i].first] = o.params[i].second;
    // The shortest text that reads back as the same double (a stream's 6 digits wrote 2^20 as
    // 1.04858e+06).
    char num[32];
    const auto end = std::to_chars(num, num + sizeof(num), o.params[i].second).ptr;
    row << (i ? "," : "") << "\"" << o.params[i].first << "\":" << std::string_view(num, end - num);
  }
  row << "}";
}

// The modes RunOne and RunPrefill know. A decode mode may be prefixed by PrHS wrappers ("cis+",
// "psaw+", "xl+", any order) and suffixed by "_bank".
const char* const kDecodeModes[] = {"dense_cpu", "dense_resident", "streaming", "streaming_resident",
                                    "oracle", "quest", "sparcas", "hip", "kvpop", "lfps",
                                    "lfps_gpu", "full_streaming"};
const char* const kPrefillModes[] = {"prefill_dense", "prefill_lfps"};

std::string ModeProblem(const std::string& mode) {
  for (const char* m : kPrefillModes) {
    if (mode == m) return "";
  }
  std::string inner = mode;
  for (bool more = true; more;) {
    more = false;
    for (const char* w : {"cis+", "psaw+", "xl+"}) {
      if (inner.rfind(w, 0) == 0) {
        inner = inner.substr(std::string_view(w).size());
        more = true;
      }
    }
  }
  if (inner.size() > 5 && inner.compare(inner.size() - 5, 5, "_bank") == 0) {
    inner = inner.substr(0, inner.size() - 5);
  }
  for (const char* m : kDecodeModes) {
    if (inner == m) return "";
  }
  for (const std::string& m : kvferry::PolicyNames()) {  // any other registered policy, at 2%
    if (inner == m) return "";
  }
  std::string want;
  for (const char* m : kDecodeModes) want += std::string(m) + ", ";
  return "unknown mode (want " + want + "prefill_dense, prefill_lfps or a registered policy's name; a decode mode may take "
         "the prefixes cis+, psaw+, xl+ and the suffix _bank)";
}

constexpr int64_t kMaxContext = int64_t{1} << 24;

// Parses the command line (tools/common/args.h); on --help or a usage error prints and exits
// (0 or 2) before any work. --json and --trace's folder are checked writable here.
// --query real: the moving query's drift and rho fitted to recorded SmolLM2 decoding
// (bench/query_calibration.py; the fit and its overlaps in bench/results/query_calibration.json).
constexpr double kRealQueryDrift = 0.36;
constexpr double kRealQueryRho = 0.3;

std::string QueryLabel(const Options& o) {
  if (o.query == "real") return "real";
  if (o.query_drift == 0) return "repeated (best case)";
  std::ostringstream s;
  s << "moving (drift " << o.query_drift << ", rho " << o.query_rho << ")";
  return s.str();
}

Options Parse(int argc, char** argv) {
  Options o;
  tools::ArgParser p(
      "kvferry-e2e",
      "[options]\n"
      "The Runtime driven the way an engine drives it (device tensors, CUDA graphs; Llama-3.1-8B's\n"
      "attention shape), one JSON row per context x batch x mode. Needs a CUDA device.\n");
  p.OutputFile("--json", "append every row to PATH (checked before the run)", &o.json)
      .WholeList("--contexts", "tokens in the KV cache", &o.contexts, 64, kMaxContext)
      .WholeList("--batches", "sequences decoded together", &o.batches, 1, 1024)
      .Value("--modes", "M[,M...]",
             "what runs: decode modes (dense_cpu, dense_resident, streaming, streaming_resident, "
             "oracle, quest, sparcas, hip, kvpop, lfps, lfps_gpu, full_streaming; prefixes cis+, "
             "psaw+, xl+; suffix _bank) and prefill_dense, prefill_lfps",
             [&o](const std::string& flag, const std::string& v) {
               std::vector<std::string> modes;
               const std::string problem = tools::ListItemProblem(
                   flag, v, [&](const std::string& m) {
                     std::string why = ModeProblem(m);
                     if (why.empty()) modes.push_back(m);
                     return why;
                   });
               if (problem.empty()) o.modes = std::move(modes);
               return problem;
             })
      .Whole("--steps", "token steps timed per row", &o.steps, 1, 1000000)
      .Whole("--layers", "layers of a decode row", &o.layers, 1, 1024)
      .Real("--host-gib", "host memory a row may use for the KV (larger rows are skipped)",
            &o.host_gib, 0.0, 1e6, /*lo_open=*/true, "GIB")
      .Real("--device-gib", "device memory dense_resident may use for the KV", &o.device_gib, 0.0,
            1e6, /*lo_open=*/true, "GIB")
      .Real("--gpu-gib", "Capacity::gpu_bytes of every decode mode (0: no cap)", &o.gpu_gib, 0.0,
            1e6, /*lo_open=*/false, "GIB")
      .Whole("--budget-tokens", "the 2% modes select N tokens at every context instead (0: 2%)",
             &o.budget_tokens, 0, kMaxContext)
      .WholeList("--prefill-chunks", "prefill chunk sizes (prefill_* modes)", &o.prefill_chunks, 1,
                 int64_t{1} << 20)
      .Whole("--prefill-layers", "layers of a prefill row (layer order: the first is a warm-up)",
             &o.prefill_layers, 1, 1024)
      .Choice("--prefill-order", "every chunk of a layer, or chunk c of every layer first",
              &o.prefill_order, {"layer", "chunk"})
      .Whole("--cpu-threads", "RuntimeConfig::cpu_threads (0: the cores near the GPU)",
             &o.cpu_threads, 0, 4096)
      .String("--trace", "PREFIX", "one more token step traced into PREFIX_<mode>_<context>_b<batch>.json",
              &o.trace_prefix)
      .KeyReal("--param", "config.policy.params of every mode (the policy checks the names)",
               [&o](const std::string& key, double v) { o.params.emplace_back(key, v); })
      .Choice("--query", "the decode query: repeated (the bank's best case) or real (calibrated motion)",
              &o.query, {"repeated", "real"})
      .Real("--query-drift", "the moving query's drift E (q = q0 + E z; 0: repeated)",
            &o.query_drift, 0.0, 1000.0, /*lo_open=*/false, "E")
      .Real("--query-rho", "the moving query's step-to-step correlation R of z (0: fresh every step)",
            &o.query_rho, 0.0, 0.999, /*lo_open=*/false, "R")
      .Switch("--unique-kv", "every prompt chunk's keys drawn afresh", &o.unique_kv)
      .Whole("--async-cpu", "RuntimeConfig::async_cpu (-1: on with CUDA)", &o.async_cpu, -1, 1)
      .Real("--split-share", "RuntimeConfig::split_share (-1: the cost model's, else in [0, 1])",
            &o.split_share, -1.0, 1.0, /*lo_open=*/false, "F")
      .Whole("--cpu-spin-us", "RuntimeConfig::cpu_spin_us (the pool's spin between layers)",
             &o.cpu_spin_us, 0, 1000000)
      .Choice("--route", "route of the device-selection modes", &o.route, {"gpu", "auto"})
      .Real("--engine-us", "host spin after each Decode (the engine's own host work)",
            &o.engine_us, 0.0, 1e6, /*lo_open=*/false, "US")
      .Real("--engine-gpu-us", "GPU spin kernel after each Decode (the engine's own GPU work)",
            &o.engine_gpu_us, 0.0, 1e6, /*lo_open=*/false, "US");
  p.set_epilog("example: kvferry-e2e --contexts 32768 --batches 1 --modes dense_resident,lfps "
               "--steps 10 --json rows.jsonl\n");
  const int rc = p.ParseAndReport(argc, argv);
  if (rc >= 0) std::exit(rc);
  if (o.query == "real") {
    if (o.query_drift != 0) {
      std::exit(p.ReportUsageError("--query real sets the drift and rho itself: drop --query-drift"));
    }
    o.query_drift = kRealQueryDrift;
    o.query_rho = kRealQueryRho;
  } else if (o.query_drift == 0 && o.query_rho != 0) {
    std::exit(p.ReportUsageError("--query-rho " + std::to_string(o.query_rho) +
                                 ": the repeated query has no walk (give --query-drift too)"));
  }
  const bool any_prefill = std::any_of(o.modes.begin(), o.modes.end(), [](const std::string& m) {
    return m.rfind("prefill_", 0) == 0;
  });
  if (any_prefill && o.prefill_order == "layer" && o.prefill_layers < 2) {
    std::exit(p.ReportUsageError(
        "--prefill-layers " + std::to_string(o.prefill_layers) +
        ": the layer order times the layers after the first (a warm-up), so it needs at least 2 "
        "(or --prefill-order chunk)"));
  }
  if (!o.trace_prefix.empty()) {
    const std::string probe = o.trace_prefix + "_" + o.modes.front() + ".json";
    const std::string problem = tools::WritableFileProblem(probe);
    if (!problem.empty()) {
      std::exit(p.ReportUsageError(tools::BadValue("--trace", o.trace_prefix, problem)));
    }
  }
  return o;
}

void Check(const kvferry::Status& st, const char* what) {
  if (st.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, st.ToString().c_str());
  std::exit(1);
}

double Now() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Row {
  std::string json;
};

// The "kvpop" mode's scorer: an MLP of hidden width 16 (what scripts/kvpop_train.py trains for
// SmolLM2) with random weights for this model shape, written once as the safetensors file that
// PolicyConfig::weights_path names, so the step pays for a real scorer. Returns the path.
std::string KvpopWeightsFile(int layers, int kv_heads, int head_dim) {
  const int64_t hidden = 16, in_dim = 2 * head_dim;
  const std::string path = "/tmp/kvferry_e2e_kvpop_" + std::to_string(layers) + ".safetensors";
  uint32_t state = 12345;
  auto next = [&] {  // uniform in [-1, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
  };
  kvferry::bench::SafetensorsFile file;
  file.metadata["format"] = "kvferry-kvpop-mlp-v1";
  const std::vector<std::pair<const char*, std::vector<int64_t>>> tensors = {
      {"alpha", {layers, kv_heads}}, {"b1", {layers, kv_heads, hidden}}, {"b2", {layers, kv_heads}},
      {"w1", {layers, kv_heads, hidden, in_dim}}, {"w2", {layers, kv_heads, hidden}}};
  for (const auto& [name, shape] : tensors) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const float scale = std::string_view(name) == "w1" ? 1.0f / std::sqrt(static_cast<float>(in_dim)) : 1.0f;
    std::vector<float> data(static_cast<size_t>(n));
    for (float& x : data) x = scale * next();
    kvferry::bench::AddFloatTensor(file, name, shape, data.data(), false);
  }
  Check(kvferry::bench::WriteSafetensors(path, file), "writing the kvpop scorer");
  return path;
}

std::string RunOne(const Options& o, int64_t ctx, int batch, const std::string& mode) {
  constexpr int kHq = 32, kHkv = 8, kD = 128, kSink = 4, kWindow = 256, kPrime = 32;
  const double kv_gib = static_cast<double>(batch) * ctx * o.layers * kHkv * 2 * kD * 2 / (1 << 30);
  std::ostringstream row;
  row << "{\"name\":\"decode\",\"mode\":\"" << mode << "\",\"context\":" << ctx << ",\"batch\":" << batch
      << ",\"layers\":" << o.layers;
  const bool resident = mode == "dense_resident";
  // "<mode>_bank": the same policy with the device token bank (slots for twice the offloaded picks).
  const bool bank = mode.size() > 5 && mode.compare(mode.size() - 5, 5, "_bank") == 0;
  // PrHS wrappers in front of a mode ("cis+lfps", "psaw+cis+quest_bank"): the mode's policy
  // wrapped by them (policies/prhs/prhs.h).
  std::string wrappers, inner = mode;
  for (bool more = true; more;) {
    more = false;
    for (const char* w : {"cis+", "psaw+", "xl+"}) {
      if (inner.rfind(w, 0) == 0) {
        wrappers += w;
        inner = inner.substr(std::string_view(w).size());
        more = true;
      }
    }
  }
  const std::string base = bank ? inner.substr(0, inner.size() - 5) : inner;
  if (kv_gib * 1.05 > o.host_gib || (resident && kv_gib * 1.05 > o.device_gib)) {
    row << ",\"skipped\":\"KV of " << kv_gib << " GiB exceeds the memory allowed\"}";
    return row.str();
  }
  RuntimeConfig c;
  c.model = {.num_layers = o.layers, .num_q_heads = kHq, .num_kv_heads = kHkv, .head_dim = kD,
             .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = batch;
  c.capacity.max_batch = batch;
  c.capacity.max_tokens_per_sequence = ctx + 3 * o.steps + 64;  // warm-ups, plain, graph, timed runs
  c.capacity.max_prefill_chunk = 4096;
  c.tiers.sink_tokens = kSink;
  c.tiers.window_tokens = resident ? static_cast<int>(c.capacity.max_tokens_per_sequence) - kSink : kWindow;
  c.backend = kvferry::Backend::kCuda;
  // The cost model's rates probed at Create (~0.1 s) for every mode: the split's share (route
  // auto), and the rows' cost_* fields.
  c.probe_at_start = true;
  c.cpu_threads = o.cpu_threads;
  c.async_cpu = o.async_cpu;
  c.split_share = o.split_share;
  c.cpu_spin_us = o.cpu_spin_us;
  c.route = kvferry::Route::kGpu;
  if (base == "dense_cpu") {  // every row attended by the CPU cores next to the host store
    c.policy.name = "dense";
    c.route = kvferry::Route::kCpu;
  } else if (base == "dense_resident" || base == "full_streaming") {
    c.policy.name = "dense";
  } else if (base == "streaming") {
    c.policy.name = "streaming";
    c.policy.budget_tokens = 1024;
  } else if (base == "streaming_resident") {
    // The 1024 attended tokens are the resident tier (sinks + window); the rest is offloaded.
    c.policy.name = "streaming";
    c.policy.budget_tokens = 1024;
    c.tiers.window_tokens = 1024 - kSink;
  } else if (base == "oracle") {
    c.policy.name = "oracle";
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
  } else if (base == "quest") {
    c.policy.name = "quest";  // page bounds on the GPU, pages of 16
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
  } else if (base == "sparcas") {
    c.policy.name = "sparcas";  // 64 of 128 key dimensions at 4 bits on the GPU (--param bits=16: the paper's 16 in bf16), first 2 layers exact
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
  } else if (base == "hip") {
    c.policy.name = "hip";  // HiP's masks from 4-bit rows of every dimension on the GPU, rebuilt every 8 steps beside the step (lag 1), first 3 layers SparCas's 4-bit top-k over every dimension (--param dense_bits=16: exact)
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
  } else if (base == "kvpop") {
    // KVpop's slots on the GPU, scored by a random MLP of width 16 (KvpopWeightsFile); the
    // e2e's random keys make no trained scorer meaningful, only its cost.
    c.policy.name = "kvpop";
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
    c.policy.weights_path = KvpopWeightsFile(o.layers, kHkv, kD);
  } else if (base == "lfps_gpu") {
    c.policy.name = "lfps";  // every selected offloaded row read by the GPU (zero-copy)
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
  } else if (base == "lfps") {
    c.policy.name = "lfps";
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
    c.route = kvferry::Route::kAuto;
  } else if (const std::vector<std::string> names = kvferry::PolicyNames();
             std::find(names.begin(), names.end(), base) != names.end()) {
    c.policy.name = base;  // any other registered policy (knorm, an engine's own) at 2%
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
  } else {
    row << ",\"skipped\":\"unknown mode\"}";
    return row.str();
  }
  c.policy.name = wrappers + c.policy.name;
  if (o.route == "auto" && (base == "oracle" || base == "quest" || base == "sparcas" || base == "hip" ||
                            base == "kvpop")) {
    c.route = kvferry::Route::kAuto;
  }
  if (o.budget_tokens > 0 && c.policy.budget_fraction > 0) {
    c.policy.budget_tokens = o.budget_tokens;
    c.policy.budget_fraction = 0;
  }
  if (o.gpu_gib > 0) c.capacity.gpu_bytes = static_cast<int64_t>(o.gpu_gib * (1 << 30));
  if (bank && o.gpu_gib > 0) {
    c.tiers.bank_slots = -1;  // the largest bank the cap leaves room for
  } else if (bank) {
    const int64_t budget = c.policy.budget_fraction > 0
                               ? static_cast<int64_t>(std::ceil(c.policy.budget_fraction * ctx))
                               : c.policy.budget_tokens;
    const int64_t picks = budget - kSink - kWindow;
    c.tiers.bank_slots = static_cast<int>(std::clamp<int64_t>(2 * picks, 64, 65534));
  }
  row << ",\"policy\":\"" << c.policy.name << "\",\"route\":\"" << kvferry::RouteName(c.route) << "\""
      << ",\"bank_slots\":" << c.tiers.bank_slots;
  row << ",\"query\":\"" << QueryLabel(o) << "\"";
  if (o.query_drift != 0) row << ",\"query_drift\":" << o.query_drift << ",\"query_rho\":" << o.query_rho;
  if (o.unique_kv) row << ",\"unique_kv\":true";
  if (o.async_cpu >= 0) row << ",\"async_cpu\":" << o.async_cpu;
  if (o.split_share >= 0) row << ",\"split_share\":" << o.split_share;
  if (o.cpu_spin_us > 0) row << ",\"cpu_spin_us\":" << o.cpu_spin_us;
  if (o.engine_us > 0) row << ",\"engine_us\":" << o.engine_us;
  if (o.engine_gpu_us > 0) row << ",\"engine_gpu_us\":" << o.engine_gpu_us;
  if (o.budget_tokens > 0) row << ",\"budget_tokens\":" << c.policy.budget_tokens;
  AddParams(o, c, row);
  auto made = Runtime::Create(c);
  if (!made.ok()) {
    row << ",\"skipped\":\"" << made.status().ToString() << "\"}";
    return row.str();
  }
  std::unique_ptr<Runtime> rt = std::move(made).value();
  if (c.tiers.bank_slots < 0) row << ",\"bank_slots_chosen\":" << rt->config().tiers.bank_slots;
  if (c.capacity.gpu_bytes > 0) row << ",\"gpu_bytes_cap\":" << c.capacity.gpu_bytes;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Inputs made on the GPU: one chunk of K/V reused for every Append, per-step q/k/v/out.
  const int64_t chunk = 4096;
  uint16_t *ck, *cv, *pq, *pout, *q, *k, *v, *out;
  CHECK_CUDA(cudaMalloc(&ck, chunk * kHkv * kD * 2));
  CHECK_CUDA(cudaMalloc(&cv, chunk * kHkv * kD * 2));
  CHECK_CUDA(cudaMalloc(&pq, kPrime * kHq * kD * 2));
  CHECK_CUDA(cudaMalloc(&pout, kPrime * kHq * kD * 2));
  CHECK_CUDA(cudaMalloc(&q, batch * kHq * kD * 2));
  CHECK_CUDA(cudaMalloc(&k, batch * kHkv * kD * 2));
  CHECK_CUDA(cudaMalloc(&v, batch * kHkv * kD * 2));
  CHECK_CUDA(cudaMalloc(&out, batch * kHq * kD * 2));
  FillBf16<<<256, 256, 0, stream>>>(ck, chunk * kHkv * kD, 1);
  FillBf16<<<256, 256, 0, stream>>>(cv, chunk * kHkv * kD, 2);
  FillBf16<<<64, 256, 0, stream>>>(pq, kPrime * kHq * kD, 3);
  FillBf16<<<64, 256, 0, stream>>>(q, batch * kHq * kD, 4);
  FillBf16<<<64, 256, 0, stream>>>(k, batch * kHkv * kD, 5);
  FillBf16<<<64, 256, 0, stream>>>(v, batch * kHkv * kD, 6);
  // The moving query: q0 keeps the anchor, z the walk; next_query writes step s's query into q
  // (a CUDA graph reads q where it was captured), its noise drawn afresh from seed 1000 + s.
  const int64_t q_elems = batch * kHq * kD;
  uint16_t* q0 = nullptr;
  float* q_walk = nullptr;
  if (o.query_drift != 0) {
    CHECK_CUDA(cudaMalloc(&q0, q_elems * 2));
    CHECK_CUDA(cudaMalloc(&q_walk, q_elems * 4));
    CHECK_CUDA(cudaMemcpyAsync(q0, q, q_elems * 2, cudaMemcpyDeviceToDevice, stream));
  }
  uint32_t query_step = 0;
  auto next_query = [&] {
    if (q0 == nullptr) return;
    MoveQuery<<<64, 256, 0, stream>>>(q, q0, q_walk, q_elems, 1000 + query_step,
                                      static_cast<float>(o.query_drift), static_cast<float>(o.query_rho),
                                      query_step == 0);
    CHECK_CUDA(cudaGetLastError());
    ++query_step;
  };
  CHECK_CUDA(cudaStreamSynchronize(stream));
  auto view = [](void* p, int64_t rows, int heads) {
    return TensorView::Contiguous(p, DType::kBF16, MemoryKind::kDevice, {rows, heads, kD});
  };
  const double t_fill0 = Now();
  std::vector<SequenceId> seqs;
  kvferry::tools::Progress progress("fill " + std::to_string(ctx / 1024) + "K x " +
                                        std::to_string(batch),
                                    static_cast<int64_t>(batch) * o.layers, "layers");
  for (int b = 0; b < batch; ++b) {
    const SequenceId s = 100 + b;
    seqs.push_back(s);
    Check(rt->AddSequence(s), "AddSequence");
    for (int l = 0; l < o.layers; ++l) {
      for (int64_t pos = 0; pos < ctx - kPrime; pos += chunk) {
        const int64_t n = std::min<int64_t>(chunk, ctx - kPrime - pos);
        if (o.unique_kv) {  // this chunk's keys drawn afresh (the stream orders it after the last Append)
          FillBf16<<<256, 256, 0, stream>>>(ck, n * kHkv * kD,
                                            static_cast<uint32_t>(7919 + (b * o.layers + l) * 1031 + pos / chunk));
        }
        const kvferry::Status st = rt->Append(s, l, view(ck, n, kHkv), view(cv, n, kHkv), stream);
        if (!st.ok()) {
          row << ",\"skipped\":\"append: " << st.ToString() << "\"}";
          return row.str();
        }
      }
      const kvferry::Status st = rt->Prefill(s, l, view(pq, kPrime, kHq), view(ck, kPrime, kHkv),
                                             view(cv, kPrime, kHkv), view(pout, kPrime, kHq), stream);
      if (!st.ok()) {
        row << ",\"skipped\":\"prefill: " << st.ToString() << "\"}";
        return row.str();
      }
      progress.Update(static_cast<int64_t>(b) * o.layers + l + 1);
    }
  }
  progress.Finish();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const double fill_s = (Now() - t_fill0) * 1e-3;

  // capturing: the step goes into the graph, which reads whatever q holds at each replay.
  double ms_in_decode = 0;  // host time inside Decode, summed
  auto step_plain = [&](bool plan, bool capturing = false) {
    if (!capturing) next_query();
    if (plan) Check(rt->PlanDecode(seqs, stream), "PlanDecode");
    for (int l = 0; l < o.layers; ++l) {
      const double td = Now();
      const kvferry::Status st =
          rt->Decode(seqs, l, view(q, batch, kHq), view(k, batch, kHkv), view(v, batch, kHkv),
                     view(out, batch, kHq), stream);
      ms_in_decode += Now() - td;
      if (!st.ok()) {
        std::fprintf(stderr, "decode: %s\n", st.ToString().c_str());
        std::exit(1);
      }
      if (o.engine_gpu_us > 0) {  // the engine's own GPU work of the layer
        SpinKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(o.engine_gpu_us * 1e3));
        CHECK_CUDA(cudaGetLastError());
      }
      if (o.engine_us > 0 && !capturing) {  // the engine's own host work of the layer
        const double until = Now() + o.engine_us * 1e-3;
        while (Now() < until) {
        }
      }
    }
  };
  const bool graph_ok = rt->decode_is_capture_safe();
  // Warm-up. The first step is timed on its own: it is where a policy catches up with the prompt
  // (KVpop scores every token that left the window; SparCas gathers its compact rows).
  double ms_first_step = 0;
  for (int i = 0; i < 2; ++i) {
    const double tw = Now();
    step_plain(graph_ok);
    if (i == 0) {
      CHECK_CUDA(cudaStreamSynchronize(stream));
      ms_first_step = Now() - tw;
    }
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  // Call by call.
  rt->ResetStats();
  ms_in_decode = 0;
  double t0 = Now();
  for (int i = 0; i < o.steps; ++i) step_plain(graph_ok);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const double ms_plain = (Now() - t0) / o.steps;
  const double ms_in_decode_plain = ms_in_decode / o.steps;
  const Stats sp = rt->GetStats();
  if (!o.trace_prefix.empty()) {
    const std::string path = o.trace_prefix + "_" + mode + "_" + std::to_string(ctx) + "_b" +
                             std::to_string(batch) + ".json";
    Check(rt->StartTrace(), "StartTrace");
    step_plain(graph_ok);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    Check(rt->WriteTrace(path), "WriteTrace");
  }
  double ms_graph = -1;
  Stats sg{};
  if (graph_ok) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    Check(rt->PlanDecode(seqs, stream), "PlanDecode");
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    step_plain(false, true);
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    for (int i = 0; i < 2; ++i) {
      next_query();
      Check(rt->PlanDecode(seqs, stream), "PlanDecode");
      CHECK_CUDA(cudaGraphLaunch(exec, stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    rt->ResetStats();
    t0 = Now();
    for (int i = 0; i < o.steps; ++i) {
      next_query();
      Check(rt->PlanDecode(seqs, stream), "PlanDecode");
      CHECK_CUDA(cudaGraphLaunch(exec, stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    ms_graph = (Now() - t0) / o.steps;
    sg = rt->GetStats();
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
  }
  // The device selection alone: call by call again with its launches timed on the stream
  // (Runtime::TimeDeviceSelect; 0 for policies that select on the host).
  Check(rt->TimeDeviceSelect(true), "TimeDeviceSelect");
  rt->ResetStats();
  for (int i = 0; i < o.steps; ++i) step_plain(graph_ok);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const Stats st_timed = rt->GetStats();
  const double ms_select_device = st_timed.ms_select_device / o.steps;
  Check(rt->TimeDeviceSelect(false), "TimeDeviceSelect");
  const double steps = o.steps;
  const double ms = graph_ok ? ms_graph : ms_plain;
  row << ",\"capture_safe\":" << (graph_ok ? "true" : "false") << ",\"ms_per_token_step\":" << ms
      << ",\"ms_per_token_step_no_graph\":" << ms_plain
      << ",\"ms_in_decode_per_step\":" << ms_in_decode_plain
      << ",\"host_syncs_per_step\":" << (graph_ok ? sg.host_syncs : sp.host_syncs) / steps
      << ",\"host_syncs_per_step_no_graph\":" << sp.host_syncs / steps
      << ",\"bytes_h2d_per_step\":" << sp.bytes_h2d / steps
      << ",\"rows_selected_per_step\":" << sp.rows_selected / steps
      << ",\"rows_fetched_per_step\":" << sp.rows_fetched / steps
      << ",\"rows_bank_hit_per_step\":" << sp.rows_bank_hit / steps
      // Of the offloaded selected rows, the share the bank served (-1 without a bank or misses).
      << ",\"bank_hit_rate\":"
      << (sp.rows_bank_hit + sp.rows_fetched > 0 && rt->config().tiers.bank_slots > 0
              ? static_cast<double>(sp.rows_bank_hit) / static_cast<double>(sp.rows_bank_hit + sp.rows_fetched)
              : -1.0)
      << ",\"bank_admitted_per_step\":" << sp.bank_admitted / steps
      << ",\"rows_cpu_per_step\":" << sp.rows_cpu / steps
      << ",\"decode_split_per_step\":" << sp.decode_split / steps
      << ",\"decode_prefetched_per_step\":" << sp.decode_prefetched / steps
      << ",\"xl_gap_us\":" << sp.xl_gap_us
      // The cost model's CPU rate (probed at Create) and the one the steps' CPU kernels measured.
      << ",\"cost_cpu_gbps\":" << sp.cost_cpu_gbps << ",\"cost_cpu_gbps_measured\":" << sp.cost_cpu_gbps_measured
      << ",\"scans_device_per_step\":" << sp.scans_device / steps
      << ",\"scans_device_short_per_step\":" << sp.scans_device_short / steps
      << ",\"ms_select_device_per_step\":" << ms_select_device
      // The same calls' step (attention) time, and the cost model's device rates (probed at
      // Create) beside the ones these timed calls measured.
      << ",\"ms_attend_device_per_step\":" << st_timed.ms_attend_device / o.steps
      << ",\"cost_hbm_gbps\":" << st_timed.cost_hbm_gbps << ",\"cost_h2d_gbps\":" << st_timed.cost_h2d_gbps
      << ",\"cost_pcie_gbps\":" << st_timed.cost_pcie_gbps
      << ",\"split_share\":" << sp.split_share
      << ",\"cost_select_gbps_measured\":" << st_timed.cost_select_gbps_measured
      << ",\"cost_attend_gbps_measured\":" << st_timed.cost_attend_gbps_measured
      << ",\"select_key_bytes_per_step\":" << sp.select_key_bytes / steps
      << ",\"stages_ms_per_step\":{"
      << "\"append\":" << sp.ms_append / steps << ",\"select\":" << sp.ms_select / steps
      << ",\"resolve\":" << sp.ms_resolve / steps << ",\"attend_gpu\":" << sp.ms_attend_gpu / steps
      << ",\"attend_cpu\":" << sp.ms_attend_cpu / steps << ",\"merge\":" << sp.ms_merge / steps
      << ",\"admit\":" << sp.ms_admit / steps << "}"
      << ",\"gpu_bytes\":" << sp.device_bytes_reserved << ",\"host_bytes\":" << sp.host_bytes_reserved
      << ",\"fill_s\":" << fill_s << ",\"ms_first_step\":" << ms_first_step << "}";
  for (void* p : {static_cast<void*>(ck), static_cast<void*>(cv), static_cast<void*>(pq),
                  static_cast<void*>(pout), static_cast<void*>(q), static_cast<void*>(k),
                  static_cast<void*>(v), static_cast<void*>(out), static_cast<void*>(q0), static_cast<void*>(q_walk)}) {
    CHECK_CUDA(cudaFree(p));
  }
  rt.reset();
  CHECK_CUDA(cudaStreamDestroy(stream));
  return row.str();
}


// Prefill of one prompt of ctx tokens through Runtime::Prefill in chunks, device tensors, the
// Llama-3.1-8B attention shape: ms per layer (layers after the first, a warm-up; a second prompt
// after a first that grew and pinned the host store, whose time is ms_per_layer_cold), tokens/s and the
// causal attention's TFLOP/s (2 * Hq * D * ctx^2 flops: QK^T and PV over the causal half).
// Modes: prefill_dense (dense policy) and prefill_lfps (LFPS primes its tables from the queries).
std::string RunPrefill(const Options& o, int64_t ctx, int64_t chunk, const std::string& mode) {
  constexpr int kHq = 32, kHkv = 8, kD = 128;
  const bool chunk_major = o.prefill_order == "chunk";
  std::ostringstream row;
  row << "{\"name\":\"prefill\",\"mode\":\"" << mode << "\",\"context\":" << ctx
      << ",\"batch\":1,\"chunk\":" << chunk << ",\"order\":\"" << o.prefill_order << "\""
      << ",\"layers_timed\":" << (chunk_major ? o.prefill_layers : o.prefill_layers - 1);
  RuntimeConfig c;
  c.model = {.num_layers = o.prefill_layers, .num_q_heads = kHq, .num_kv_heads = kHkv,
             .head_dim = kD, .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = 1;
  c.capacity.max_batch = 1;
  c.capacity.max_tokens_per_sequence = ctx + 8;  // and two decode steps after the prompt
  c.capacity.max_prefill_chunk = chunk;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 256;
  c.backend = kvferry::Backend::kCuda;
  c.route = kvferry::Route::kGpu;
  c.probe_at_start = false;
  c.policy.name = mode == "prefill_lfps" ? "lfps" : "dense";
  c.policy.budget_tokens = mode == "prefill_lfps" ? 0 : ctx;
  c.policy.budget_fraction = mode == "prefill_lfps" ? 0.02 : 0.0;
  row << ",\"policy\":\"" << c.policy.name << "\"";
  AddParams(o, c, row);
  // Chunks after the first overlap the history copy with the attention (kept in the row for the
  // tables that read it).
  row << ",\"history_overlap\":true";
  auto made = Runtime::Create(c);
  if (!made.ok()) {
    row << ",\"skipped\":\"" << made.status().ToString() << "\"}";
    return row.str();
  }
  std::unique_ptr<Runtime> rt = std::move(made).value();
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint16_t *q, *k, *v, *out;
  CHECK_CUDA(cudaMalloc(&q, chunk * kHq * kD * 2));
  CHECK_CUDA(cudaMalloc(&k, chunk * kHkv * kD * 2));
  CHECK_CUDA(cudaMalloc(&v, chunk * kHkv * kD * 2));
  CHECK_CUDA(cudaMalloc(&out, chunk * kHq * kD * 2));
  FillBf16<<<256, 256, 0, stream>>>(q, chunk * kHq * kD, 11);
  FillBf16<<<256, 256, 0, stream>>>(k, chunk * kHkv * kD, 12);
  FillBf16<<<256, 256, 0, stream>>>(v, chunk * kHkv * kD, 13);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  auto view = [](void* p, int64_t rows, int heads) {
    return TensorView::Contiguous(p, DType::kBF16, MemoryKind::kDevice, {rows, heads, kD});
  };
  // Twice: the first prompt pins the host store's pages as it grows (cold), the second reuses
  // them (warm: an engine serving one request after another).
  double ms_cold = 0, ms = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const SequenceId s = 7 + pass;
    Check(rt->AddSequence(s), "AddSequence");
    double t0 = 0;
    auto prefill = [&](int l, int64_t pos) {
      const int64_t n = std::min<int64_t>(chunk, ctx - pos);
      const kvferry::Status st = rt->Prefill(s, l, view(q, n, kHq), view(k, n, kHkv), view(v, n, kHkv),
                                             view(out, n, kHq), stream);
      if (!st.ok()) row << ",\"skipped\":\"prefill: " << st.ToString() << "\"}";
      return st.ok();
    };
    if (chunk_major) {
      CHECK_CUDA(cudaStreamSynchronize(stream));
      rt->ResetStats();
      t0 = Now();
      for (int64_t pos = 0; pos < ctx; pos += chunk) {
        for (int l = 0; l < o.prefill_layers; ++l) {
          if (!prefill(l, pos)) return row.str();
        }
      }
    } else {
      for (int l = 0; l < o.prefill_layers; ++l) {
        if (l == 1) {
          CHECK_CUDA(cudaStreamSynchronize(stream));
          rt->ResetStats();
          t0 = Now();
        }
        for (int64_t pos = 0; pos < ctx; pos += chunk) {
          if (!prefill(l, pos)) return row.str();
        }
      }
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    (pass == 0 ? ms_cold : ms) =
        (Now() - t0) / std::max(1, chunk_major ? o.prefill_layers : o.prefill_layers - 1);
    if (pass == 0) Check(rt->RemoveSequence(s), "RemoveSequence");
  }
  const kvferry::Stats st = rt->GetStats();
  // Two decode steps after the second prompt, every layer: the first primes a policy that learns
  // from the prompt (deferred to it, Runtime::Prefill), the second is a plain step. The priming's
  // own time (Stats::ms_prime) is added to the prefill's in ms_per_layer_with_prime; the first
  // step also pays one-time costs of any policy (dense too), so the two steps are reported apart.
  double ms_decode[2] = {0, 0};
  const SequenceId last = 7 + 1;
  for (int step = 0; step < 2; ++step) {
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const double td = Now();
    for (int l = 0; l < o.prefill_layers; ++l) {
      const kvferry::Status sd = rt->Decode({&last, 1}, l, view(q, 1, kHq), view(k, 1, kHkv),
                                            view(v, 1, kHkv), view(out, 1, kHq), stream);
      if (!sd.ok()) {
        row << ",\"skipped\":\"decode after prefill: " << sd.ToString() << "\"}";
        return row.str();
      }
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    ms_decode[step] = (Now() - td) / o.prefill_layers;
  }
  const double ms_prime = rt->GetStats().ms_prime - st.ms_prime;

  const double flops = 2.0 * kHq * kD * static_cast<double>(ctx) * static_cast<double>(ctx);
  const double layers_timed = std::max(1, chunk_major ? o.prefill_layers : o.prefill_layers - 1);
  row << ",\"ms_per_layer\":" << ms << ",\"ms_per_layer_cold\":" << ms_cold
      << ",\"tokens_per_s\":" << ctx / (ms * 1e-3)
      << ",\"tflops\":" << flops / (ms * 1e-3) * 1e-12
      << ",\"host_syncs_per_layer\":" << static_cast<double>(st.host_syncs) / layers_timed
      << ",\"chunks_prefetched\":" << st.prefill_chunks_prefetched
      << ",\"bytes_h2d_per_layer\":" << static_cast<double>(st.bytes_h2d) / layers_timed
      << ",\"ms_prime_in_prefill_per_layer\":" << st.ms_prime / layers_timed
      << ",\"ms_first_decode_per_layer\":" << ms_decode[0]
      << ",\"ms_second_decode_per_layer\":" << ms_decode[1]
      << ",\"ms_prime_at_decode_per_layer\":" << ms_prime / o.prefill_layers
      << ",\"ms_per_layer_with_prime\":" << ms + ms_prime / o.prefill_layers
      << "}";
  for (void* p : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(out)}) {
    CHECK_CUDA(cudaFree(p));
  }
  rt.reset();
  CHECK_CUDA(cudaStreamDestroy(stream));
  return row.str();
}

// A row that measured nothing says why in "skipped".
bool Skipped(const std::string& row) { return row.find("\"skipped\":") != std::string::npos; }

int Main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  // A GPU must be there: said before any row, rather than one "skipped" row per combination
  // (whose message, on a machine without a driver, was the CUDA runtime's "CUDA driver version is
  // insufficient").
  std::string no_gpu = tools::CudaDeviceProblem();
  if (no_gpu.empty()) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      no_gpu = std::string("no CUDA device found: the CUDA runtime says ") +
               (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
  }
  if (!no_gpu.empty()) {
    std::fprintf(stderr, "kvferry-e2e: %s; nothing measured\n", no_gpu.c_str());
    return tools::kExitFailure;
  }
  std::ofstream f;
  if (!o.json.empty()) {
    f.open(o.json, std::ios::app);
    if (!f) {
      std::fprintf(stderr, "kvferry-e2e: --json %s: cannot be opened\n", o.json.c_str());
      return tools::kExitFailure;
    }
  }
  int rows = 0, measured = 0;
  bool all_capacity = true;  // every skipped row skipped for want of memory
  std::string first_skip;
  const auto emit = [&](const std::string& r) {
    std::printf("%s\n", r.c_str());
    std::fflush(stdout);
    if (f.is_open()) {
      f << r << "\n" << std::flush;
      if (!f) {
        std::fprintf(stderr, "kvferry-e2e: --json %s: write failed\n", o.json.c_str());
        std::exit(tools::kExitFailure);
      }
    }
    ++rows;
    if (!Skipped(r)) {
      ++measured;
      return;
    }
    if (first_skip.empty()) first_skip = r;
    if (r.find("\"skipped\":\"KV of ") == std::string::npos &&
        r.find("\"skipped\":\"resource exhausted") == std::string::npos) {
      all_capacity = false;
    }
  };
  for (int64_t ctx : o.contexts) {
    for (int batch : o.batches) {
      for (const std::string& mode : o.modes) {
        if (mode.rfind("prefill_", 0) == 0) {
          if (batch != o.batches.front()) continue;  // one prompt: batch 1
          for (int64_t chunk : o.prefill_chunks) emit(RunPrefill(o, ctx, chunk, mode));
          continue;
        }
        emit(RunOne(o, ctx, batch, mode));
      }
    }
  }
  if (measured == 0 && !all_capacity) {
    std::fprintf(stderr, "kvferry-e2e: nothing measured: all %d rows skipped (first: %s)\n", rows,
                 first_skip.c_str());
    return tools::kExitFailure;
  }
  if (measured == 0) {
    // Every row is larger than the memory it may use (--host-gib, --device-gib, --gpu-gib): that
    // is the answer a capacity sweep asks for (bench/reproduce.py scale), not a failure.
    std::fprintf(stderr, "kvferry-e2e: no row fits the memory allowed: all %d rows skipped "
                 "(first: %s)\n", rows, first_skip.c_str());
    return tools::kExitOk;
  }
  if (measured < rows) {
    std::fprintf(stderr, "kvferry-e2e: %d of %d rows measured, %d skipped (see \"skipped\")\n",
                 measured, rows, rows - measured);
  }
  return tools::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvferry-e2e: unexpected error: %s\n", e.what());
    return tools::kExitFailure;
  }
}
