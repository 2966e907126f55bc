// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file cli.h
/// \brief kvferry-llama's command line, testable without running the tool: argument parsing and
/// validation (all of it before the model is loaded), exit codes, and the figures the report
/// prints, each defined once here.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "examples/llama/engine.h"
#include "examples/llama/model.h"
#include "kvferry/config.h"
#include "kvferry/stats.h"
#include "kvferry/status.h"
#include "tools/common/args.h"

namespace kvferry::llama {

/// Exit codes of kvferry-llama (every tool's, tools/common/args.h): 0 done, 1 the run failed
/// (unreadable model, runtime error), 2 usage error (bad flag, value out of range, missing input
/// file), found before any loading.
inline constexpr int kExitOk = tools::kExitOk;
inline constexpr int kExitFailure = tools::kExitFailure;
inline constexpr int kExitUsage = tools::kExitUsage;

/// Largest --context, --budget, --window, --sinks, --lengths, ... (tokens).
inline constexpr int64_t kMaxTokensFlag = int64_t{1} << 20;

enum class Mode { kGenerate, kPerplexity, kPasskey, kTrace, kReport };

/// \brief Everything the command line sets. Defaults are the tool's (see docs/llama.md).
struct Options {
  std::string model, tokenizer, text, prompt, json_out, dump_trace;
  Mode mode = Mode::kGenerate;
  bool help = false;
  int max_new = 64;
  float temperature = 0.0f, top_p = 0.9f;
  uint64_t seed = 1;
  bool chat = false;
  int64_t context = 2048, scored = 512, offset_lines = 0, chunk = 512;
  std::vector<int64_t> lengths{2048};
  std::vector<double> depths{0.1, 0.5, 0.9};
  int trials = 1;
  std::vector<int> trace_layers{0};  ///< empty: all layers ("--trace-layers all")
  int trace_steps = 16;
  bool trace_bf16 = false;
  std::vector<std::string> policies{"streaming"};
  std::vector<int64_t> budgets{256};
  /// Sinks 4, window 64 (most of a 256-token budget left to the policy's choice), KV f16; the
  /// model's shape is filled in once it is loaded.
  RuntimeConfig base;
  bool no_dense = false;
  /// Perplexity and passkey: the lanes decode each step at once (weights read once a step; the
  /// per-lane decode time is then the shared time).
  bool lanes_together = false;
  /// With the matrix products on the GPU: decode steps as the host path runs them (activations
  /// copied to and from the device at every product) instead of Engine::UseGpuDecode's.
  bool host_decode = false;
  bool no_graphs = false;  // decode steps on the GPU without CUDA graphs
  /// PrHS's early-token freezing at prefill (--etf, --etf-psi, --etf-gamma, --etf-start; the
  /// sink from --sinks).
  EtfOptions etf;
};

/// One lane of --policy: "name" or "name:key=value[:key=value...]", the lane's own policy
/// parameters (over --param's; e.g. "sparcas:smooth=1" beside "sparcas" in one run).
struct LaneSpec {
  std::string policy;
  std::map<std::string, double> params;
};
/// Why \p item is not a lane spec, or "" (then *out is set): an empty name, a part without '=',
/// an empty key, a value that is not a finite number, a key given twice.
std::string LaneSpecProblem(const std::string& item, LaneSpec* out);
/// The runtime configuration of lane \p item over \p base: the policy's name, --param's values
/// for a sparse policy (none for dense) and the lane's own.
RuntimeConfig LaneConfig(const RuntimeConfig& base, const std::string& item);

/// Parses argv[1, argc) with the tools' shared parser (tools/common/args.h). Reads no file. Every
/// numeric flag must be a number of the right kind (whole or real) inside its range, and flags
/// must agree (--scored below --context, one mode: --prompt with --perplexity, --passkey or
/// --report is a conflict, --prompt with --dump-trace traces the prompt; the inputs a mode needs;
/// a --prompt that is not empty); the error is kInvalidArgument and names the flag and the value.
/// "-h"/"--help" sets Options::help and skips the checks.
Result<Options> ParseArgs(int argc, const char* const* argv);

/// Checks that need no model: the input files open, output folders exist, --backend cuda has a
/// GPU, and kvferry's Runtime accepts every (policy, budget) with the tiers and --param values
/// (a small host runtime is created and dropped for each). kInvalidArgument naming the flags.
Status CheckBeforeLoad(const Options& o);

/// The --help text.
std::string UsageText();

/// A warning (one line, "" if none) when the run's longest sequence is past the model's trained
/// context (ModelConfig::max_context, GGUF's context_length): names the flag that set the length,
/// the length and the trained context. Generation's length is known only once the prompt is
/// tokenized: GenerationContextWarning.
std::string TrainedContextWarning(const Options& o, int64_t trained_context);
std::string GenerationContextWarning(int64_t prompt_tokens, int64_t max_new,
                                     int64_t trained_context);

/// Name of a file for reports: its base name without the last extension
/// ("data/SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct.Q4_1").
std::string FileLabel(const std::string& path);

// ---- the report's figures ---------------------------------------------------------------------

/// Bytes of K and V that one token occupies over the whole model:
/// 2 (K and V) x layers x KV heads x head_dim x bytes per element of \p kv_dtype.
int64_t KvBytesPerToken(const ModelConfig& model, DType kv_dtype);

/// Rows per (layer, KV head) that a kvferry runtime keeps on the GPU for one sequence of
/// \p context tokens: sinks + window + token-bank slots, no more than the sequence has. Every
/// policy keeps the same (dense included: it reads the other rows from the host store).
int64_t GpuKvRows(const Tiers& tiers, int64_t context);

/// KV bytes one sequence keeps on the GPU: GpuKvRows x KvBytesPerToken, except that a
/// sliding-window layer (ModelConfig::layer_window) keeps its window's rows (at most \p context).
/// A GPU-only dense cache keeps \p context x KvBytesPerToken.
int64_t GpuKvBytes(const ModelConfig& model, DType kv_dtype, const Tiers& tiers, int64_t context);

/// \brief PCIe traffic of some decode steps: the difference of two Stats taken around them (only
/// decode, never prefill, in the window), over the tokens decoded.
struct DecodeTraffic {
  int64_t bytes_h2d = 0;
  int64_t bytes_d2h = 0;
  int64_t tokens = 0;  ///< tokens decoded between the two Stats
  /// (bytes_h2d + bytes_d2h) / tokens; 0 when no token was decoded.
  [[nodiscard]] double bytes_per_token() const;
};
DecodeTraffic TrafficBetween(const Stats& before, const Stats& after, int64_t tokens);

}  // namespace kvferry::llama
