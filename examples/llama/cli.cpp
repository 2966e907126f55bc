// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/cli.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <system_error>

#include "kvferry/runtime.h"
#include "kvferry/status_macros.h"

#if !defined(KVFERRY_CLI_NO_RUNTIME)
#include "kvferry/runtime.h"
#endif

namespace kvferry::llama {
namespace {

using detail::StrCat;
using tools::BadValue;

Result<std::vector<int64_t>> ParseWholeList(const std::string& flag, const std::string& text,
                                            int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  const std::string problem = tools::ListItemProblem(flag, text, [&](const std::string& item) {
    int64_t v = 0;
    std::string p = tools::WholeProblem(item, lo, hi, &v);
    if (p.empty()) out.push_back(v);
    return p;
  });
  if (!problem.empty()) return InvalidArgument(problem);
  return out;
}

const char* ModeFlag(Mode m) {
  switch (m) {
    case Mode::kGenerate: return "--prompt";
    case Mode::kPerplexity: return "--perplexity";
    case Mode::kPasskey: return "--passkey";
    case Mode::kTrace: return "--dump-trace";
    case Mode::kReport: return "--report";
  }
  return "?";
}

Status CheckReadable(const std::string& flag, const std::string& path) {
  const std::string problem = tools::ReadableFileProblem(path);
  return problem.empty() ? Status::Ok() : InvalidArgument(BadValue(flag, path, problem));
}

// Checked by opening it (without truncating; a new file is removed again), so that a read-only
// folder is found before the model loads, not after the run.
Status CheckWritable(const std::string& flag, const std::string& path) {
  const std::string problem = tools::WritableFileProblem(path);
  return problem.empty() ? Status::Ok() : InvalidArgument(BadValue(flag, path, problem));
}

}  // namespace

std::string UsageText() {
  return "usage: kvferry-llama --model FILE [--tokenizer tok.bin] MODE [options]\n"
         "modes (one): --prompt TEXT | --perplexity | --passkey | --dump-trace FILE | --report\n"
         "text:    --text FILE --offset-lines N --context N (2048) --scored N (512) --chunk N (512)\n"
         "gen:     --max-new N (64) --temperature T (0) --top-p P (0.9) --seed S --chat\n"
         "passkey: --lengths 2048,4096 --depths 0.1,0.5,0.9 --trials N\n"
         "trace:   --trace-layers 0,15 | all --trace-steps N --trace-dtype f32|bf16\n"
         "runtime: --policy a[,b:k=v] (streaming) --budget n[,m] (256) --backend host|cuda|auto\n"
         "         --route auto|gpu|cpu --kv-dtype f16|bf16 --sinks N (4) --window N (64)\n"
         "         --bank-slots N (0) --cpu-threads N --param k=v --policy-weights FILE --no-dense\n"
         "         --lanes-together (perplexity, passkey: every lane's decode step in one pass)\n"
         "         --host-decode (on the GPU: activations through host memory at every product)\n"
         "         --no-graphs (on the GPU: every decode step launched kernel by kernel)\n"
         "prefill: --etf (PrHS's early-token freezing) --etf-psi P (0.5) --etf-gamma G (1)\n"
         "         --etf-start L (3N/4) --etf-copy-kv (frozen rows keep the layer below's K/V)\n"
         "output:  --json FILE\n"
         "exit codes: 0 done, 1 the run failed, 2 usage error (reported before the model loads)\n";
}

Result<Options> ParseArgs(int argc, const char* const* argv) {
  Options o;
  o.base.tiers.sink_tokens = 4;
  o.base.tiers.window_tokens = 64;
  o.base.model.kv_dtype = DType::kF16;
  std::string layers_arg;
  bool mode_set = false;
  const auto set_mode = [&](Mode m, const std::string& flag) -> std::string {
    if (mode_set && o.mode != m) {
      return StrCat(flag, ": only one mode at a time, and ", ModeFlag(o.mode), " was given too");
    }
    o.mode = m;
    mode_set = true;
    return "";
  };
  // Flags whose typed value lands in a narrower field than the parser's.
  int64_t max_new = o.max_new, trials = o.trials, trace_steps = o.trace_steps, sinks = 4,
          window = 64, bank_slots = 0, cpu_threads = 0, etf_start = o.etf.start;
  int64_t seed = static_cast<int64_t>(o.seed);
  double temperature = o.temperature, top_p = o.top_p;
  std::string trace_dtype = "f32", backend = "host", route = "auto", kv_dtype = "f16";
  tools::ArgParser parser("kvferry-llama", "");
  parser.set_allow_repeats(false);
  parser.set_usage(UsageText());
  const auto mode_switch = [&](Mode m) {
    return [&set_mode, m](const std::string& flag) { return set_mode(m, flag); };
  };
  parser.String("--model", "FILE", "", &o.model)
      .String("--tokenizer", "FILE", "", &o.tokenizer)
      .String("--text", "FILE", "", &o.text)
      .String("--prompt", "TEXT", "", &o.prompt, /*may_start_with_dashes=*/true)
      .Switch("--perplexity", "", mode_switch(Mode::kPerplexity))
      .Switch("--passkey", "", mode_switch(Mode::kPasskey))
      .Switch("--report", "", mode_switch(Mode::kReport))
      .Value("--dump-trace", "FILE", "", [&](const std::string& flag, const std::string& v) {
        o.dump_trace = v;
        return set_mode(Mode::kTrace, flag);
      })
      .String("--json", "FILE", "", &o.json_out)
      .Whole("--max-new", "", &max_new, 0, kMaxTokensFlag)
      .Real("--temperature", "", &temperature, 0.0, 100.0)
      .Real("--top-p", "", &top_p, 0.0, 1.0, /*lo_open=*/true)
      .Whole("--seed", "", &seed, 0, std::numeric_limits<int64_t>::max())
      .Switch("--chat", "", &o.chat)
      .Whole("--context", "", &o.context, 3, kMaxTokensFlag)
      .Whole("--scored", "", &o.scored, 1, kMaxTokensFlag)
      .Whole("--offset-lines", "", &o.offset_lines, 0, int64_t{1} << 31)
      .Whole("--chunk", "", &o.chunk, 1, 65536)
      .Whole("--trials", "", &trials, 1, 10000)
      .WholeList("--lengths", "", &o.lengths, 1, kMaxTokensFlag)
      .RealList("--depths", "", &o.depths, 0.0, 1.0)
      .String("--trace-layers", "LIST", "", &layers_arg, /*may_start_with_dashes=*/true)
      .Whole("--trace-steps", "", &trace_steps, 0, kMaxTokensFlag)
      .Choice("--trace-dtype", "", &trace_dtype, {"f32", "bf16"})
      .Value("--policy", "LIST", "", [&](const std::string& flag, const std::string& v) {
        std::vector<std::string> items;
        const std::string problem = tools::SplitListProblem(v, &items);
        if (!problem.empty()) return BadValue(flag, v, problem);
        for (const std::string& item : items) {
          LaneSpec spec;
          const std::string why = LaneSpecProblem(item, &spec);
          if (!why.empty()) return BadValue(flag, v, StrCat("lane '", item, "': ", why));
        }
        o.policies = std::move(items);
        return std::string();
      })
      .WholeList("--budget", "", &o.budgets, 1, kMaxTokensFlag)
      .Choice("--backend", "", &backend, {"host", "cuda", "auto"})
      .Choice("--route", "", &route, {"auto", "gpu", "cpu"})
      .Choice("--kv-dtype", "", &kv_dtype, {"f16", "bf16"})
      .Whole("--sinks", "", &sinks, 0, kMaxTokensFlag)
      .Whole("--window", "", &window, 1, kMaxTokensFlag)
      .Whole("--bank-slots", "", &bank_slots, 0, kMaxTokensFlag)
      .Whole("--cpu-threads", "", &cpu_threads, 0, 4096)
      .KeyReal("--param", "", [&](const std::string& name, double x) {
        o.base.policy.params[name] = x;  // the runtime checks the range
      })
      .String("--policy-weights", "FILE", "", &o.base.policy.weights_path)
      .Switch("--no-dense", "", &o.no_dense)
      .Switch("--lanes-together", "", &o.lanes_together)
      .Switch("--host-decode", "", &o.host_decode)
      .Switch("--no-graphs", "", &o.no_graphs)
      .Switch("--etf", "", &o.etf.on)
      .Switch("--etf-copy-kv", "", &o.etf.copy_kv)
      .Real("--etf-psi", "", &o.etf.psi, 0.0, 1.0, /*lo_open=*/true)
      .Real("--etf-gamma", "", &o.etf.gamma, 0.0, 1e3, /*lo_open=*/true)
      .Whole("--etf-start", "", &etf_start, 0, 4095);
  const tools::ParseResult parsed = parser.Parse(argc, argv);
  if (parsed.help()) {
    o.help = true;
    return o;
  }
  if (!parsed.ok()) return InvalidArgument(parsed.message);
  o.max_new = static_cast<int>(max_new);
  o.trials = static_cast<int>(trials);
  o.trace_steps = static_cast<int>(trace_steps);
  o.seed = static_cast<uint64_t>(seed);
  o.temperature = static_cast<float>(temperature);
  o.top_p = static_cast<float>(top_p);
  o.trace_bf16 = trace_dtype == "bf16";
  if (parser.given("--backend")) {
    o.base.backend = backend == "cuda" ? Backend::kCuda : backend == "auto" ? Backend::kAuto
                                                                             : Backend::kHost;
  }
  if (parser.given("--route")) {
    o.base.route = route == "gpu" ? Route::kGpu : route == "cpu" ? Route::kCpu : Route::kAuto;
  }
  if (parser.given("--kv-dtype")) o.base.model.kv_dtype = kv_dtype == "bf16" ? DType::kBF16 : DType::kF16;
  o.base.tiers.sink_tokens = static_cast<int>(sinks);
  o.base.tiers.window_tokens = static_cast<int>(window);
  if (parser.given("--bank-slots")) o.base.tiers.bank_slots = static_cast<int>(bank_slots);
  if (parser.given("--cpu-threads")) o.base.cpu_threads = static_cast<int>(cpu_threads);
  // Any --etf-* turns ETF on.
  if (parser.given("--etf-copy-kv") || parser.given("--etf-psi") || parser.given("--etf-gamma") ||
      parser.given("--etf-start")) {
    o.etf.on = true;
  }
  if (parser.given("--etf-start")) o.etf.start = static_cast<int>(etf_start);

  const bool prompt_set = parser.given("--prompt");
  if (prompt_set && o.prompt.empty()) {
    return InvalidArgument("--prompt '': the prompt is empty (give the text to continue, e.g. "
                           "--prompt \"Once upon a time\")");
  }
  // --prompt is the generation mode, except that --dump-trace traces the prompt's tokens.
  if (prompt_set && mode_set && o.mode != Mode::kTrace) {
    return InvalidArgument(StrCat("--prompt: only one mode at a time, and ", ModeFlag(o.mode),
                                  " was given too (--prompt generates text; ", ModeFlag(o.mode),
                                  " takes its tokens from --text)"));
  }
  if (!mode_set && prompt_set) o.mode = Mode::kGenerate;
  if (layers_arg == "all") {
    o.trace_layers.clear();  // filled once the model is known
  } else if (parser.given("--trace-layers")) {
    KVF_ASSIGN_OR_RETURN(std::vector<int64_t> layers,
                         ParseWholeList("--trace-layers", layers_arg, 0, 4095));
    o.trace_layers.assign(layers.begin(), layers.end());
  }
  // What the mode needs.
  KVF_CHECK_ARG(!o.model.empty(), "--model FILE is required");
  switch (o.mode) {
    case Mode::kGenerate:
      KVF_CHECK_ARG(!o.prompt.empty(), "no mode given: use --prompt TEXT, --perplexity, --passkey, "
                                       "--dump-trace FILE or --report");
      break;
    case Mode::kPerplexity:
    case Mode::kPasskey:
    case Mode::kReport:
      KVF_CHECK_ARG(!o.text.empty(), ModeFlag(o.mode),
                    " needs --text FILE (scripts/fetch-data.sh fetches data/kjv.txt)");
      break;
    case Mode::kTrace:
      KVF_CHECK_ARG(!o.text.empty() || !o.prompt.empty(), "--dump-trace needs --text or --prompt");
      break;
  }
  // The budget counts every attended token, and sinks and window are attended at every step.
  const int64_t resident =
      static_cast<int64_t>(o.base.tiers.sink_tokens) + o.base.tiers.window_tokens;
  const bool any_sparse = std::any_of(o.policies.begin(), o.policies.end(),
                                      [](const std::string& p) { return p != "dense"; });
  for (int64_t b : o.budgets) {
    if (any_sparse && b < resident) {
      return InvalidArgument(StrCat("--budget ", b, ": below --sinks ", o.base.tiers.sink_tokens,
                                    " + --window ", o.base.tiers.window_tokens, " = ", resident,
                                    ", the tokens every step attends (the budget counts them)"));
    }
  }
  if (o.mode == Mode::kPerplexity || o.mode == Mode::kReport) {
    // The window's first token is only an input and the scored tokens need a prefix before them.
    if (o.scored > o.context - 2) {
      return InvalidArgument(StrCat(parser.given("--scored") ? "--scored " : "--scored (default) ",
                                    o.scored, ": must be at most --context ", o.context,
                                    " - 2 = ", o.context - 2,
                                    " (the scored tokens need at least one token before them)"));
    }
  }
  return o;
}

std::string TrainedContextWarning(const Options& o, int64_t trained_context) {
  if (trained_context <= 0) return "";
  std::string what;
  int64_t longest = 0;
  switch (o.mode) {
    case Mode::kPerplexity:
    case Mode::kReport:
      longest = o.context;
      what = StrCat("--context ", o.context);
      break;
    case Mode::kPasskey:
      for (int64_t l : o.lengths) longest = std::max(longest, l);
      what = StrCat("--lengths up to ", longest);
      break;
    case Mode::kTrace:
      if (o.text.empty()) return "";  // the prompt's length is known after tokenizing
      longest = o.context + o.trace_steps;
      what = StrCat("--context ", o.context, " + --trace-steps ", o.trace_steps, " = ", longest);
      break;
    case Mode::kGenerate:
      return "";  // the prompt's length is known after tokenizing (GenerationContextWarning)
  }
  if (longest <= trained_context) return "";
  return StrCat("warning: ", what, " tokens is past the model's trained context of ",
                trained_context, " tokens (its context_length): positions past it were never "
                "seen in training, so perplexity and retrieval there measure the model's "
                "extrapolation, not kvferry");
}

std::string GenerationContextWarning(int64_t prompt_tokens, int64_t max_new,
                                     int64_t trained_context) {
  if (trained_context <= 0 || prompt_tokens + max_new <= trained_context) return "";
  return StrCat("warning: the prompt's ", prompt_tokens, " tokens + --max-new ", max_new, " = ",
                prompt_tokens + max_new, " tokens is past the model's trained context of ",
                trained_context, " tokens (its context_length)");
}

Status CheckBeforeLoad(const Options& o) {
  KVF_RETURN_IF_ERROR(CheckReadable("--model", o.model));
  if (!o.tokenizer.empty()) KVF_RETURN_IF_ERROR(CheckReadable("--tokenizer", o.tokenizer));
  if (!o.text.empty()) KVF_RETURN_IF_ERROR(CheckReadable("--text", o.text));
  if (!o.json_out.empty()) KVF_RETURN_IF_ERROR(CheckWritable("--json", o.json_out));
  if (!o.dump_trace.empty()) KVF_RETURN_IF_ERROR(CheckWritable("--dump-trace", o.dump_trace));
#if !defined(KVFERRY_CLI_NO_RUNTIME)
  if (o.base.backend == Backend::kCuda && !CudaAvailable()) {
#if defined(KVFERRY_WITH_CUDA)
    // The driver's own answer: "no NVIDIA driver", "the driver sees no GPU" (tools/common).
    std::string why = tools::CudaDeviceProblem();
    if (why.empty()) why = "no CUDA device found (the CUDA runtime sees none)";
#else
    const std::string why = "kvferry was built without CUDA";
#endif
    return InvalidArgument(StrCat("--backend cuda: ", why, "; use --backend host or auto"));
  }
  // Longest sequence any mode asks of a runtime.
  int64_t max_tokens = o.context + o.max_new + o.trace_steps + 1;
  for (int64_t l : o.lengths) max_tokens = std::max(max_tokens, l + 64);
  // Let the runtime judge each lane's policy, budget, tiers and parameters on a small model shape
  // (one layer, GQA 2:1), on the host backend and without its start-up probes. head_dim is the
  // largest any path takes (256): a parameter bounded by the head dimension (sparcas's d_b) must
  // not be refused for a model whose heads are wider than a probe's; against the model's own
  // head_dim it is checked when the run creates its runtime.
  std::vector<std::pair<std::string, int64_t>> lanes;
  for (const std::string& p : o.policies) {
    if (p == "dense") {
      lanes.emplace_back(p, 0);
      continue;
    }
    for (int64_t b : o.budgets) lanes.emplace_back(p, b);
  }
  for (const auto& [policy, budget] : lanes) {
    RuntimeConfig rc = LaneConfig(o.base, policy);
    rc.model.num_layers = 1;
    rc.model.num_q_heads = 2;
    rc.model.num_kv_heads = 1;
    rc.model.head_dim = 256;
    rc.backend = Backend::kHost;
    rc.probe_at_start = false;
    rc.cpu_threads = 1;
    rc.policy.budget_tokens = policy == "dense" ? max_tokens : budget;
    // A trained KVpop scorer fits the real model only; the run's own Create checks its shape.
    if (policy.find("kvpop") != std::string::npos) rc.policy.params["device"] = 0;
    rc.capacity.max_sequences = 1;
    rc.capacity.max_batch = 1;
    rc.capacity.max_tokens_per_sequence = max_tokens;
    rc.capacity.max_prefill_chunk = o.chunk;
    auto rt = Runtime::Create(rc);
    if (!rt.ok()) {
      const std::string flags = policy == "dense" ? StrCat("--policy ", policy)
                                                  : StrCat("--policy ", policy, " --budget ", budget);
      return InvalidArgument(StrCat(flags, ": ", rt.status().message()));
    }
  }
#endif
  return Status::Ok();
}

std::string LaneSpecProblem(const std::string& item, LaneSpec* out) {
  LaneSpec spec;
  size_t at = item.find(':');
  spec.policy = item.substr(0, at);
  if (spec.policy.empty()) return "no policy name before ':'";
  while (at != std::string::npos) {
    const size_t next = item.find(':', at + 1);
    const std::string part = item.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    const size_t eq = part.find('=');
    if (eq == std::string::npos) return StrCat("'", part, "' is not key=value (want name:key=value[:key=value])");
    const std::string key = part.substr(0, eq);
    if (key.empty()) return StrCat("'", part, "' has no key");
    double x = 0;
    const std::string why = tools::RealProblem(part.substr(eq + 1), -1e300, 1e300, false, &x);
    if (!why.empty()) return StrCat("parameter ", key, ": ", why);
    if (!spec.params.emplace(key, x).second) return StrCat("parameter ", key, " given twice");
    at = next;
  }
  *out = std::move(spec);
  return "";
}

RuntimeConfig LaneConfig(const RuntimeConfig& base, const std::string& item) {
  LaneSpec spec;
  LaneSpecProblem(item, &spec);  // checked by ParseArgs
  RuntimeConfig rc = base;
  rc.policy.name = spec.policy;
  if (spec.policy == "dense") rc.policy.params.clear();  // --param is for the sparse policies
  for (const auto& [key, value] : spec.params) rc.policy.params[key] = value;
  return rc;
}

std::string FileLabel(const std::string& path) {
  const std::filesystem::path p(path);
  std::string stem = p.stem().string();
  return stem.empty() ? path : stem;
}

int64_t KvBytesPerToken(const ModelConfig& model, DType kv_dtype) {
  return int64_t{2} * model.num_layers * model.num_kv_heads * model.head_dim *
         static_cast<int64_t>(DTypeSize(kv_dtype));
}

int64_t GpuKvRows(const Tiers& tiers, int64_t context) {
  const int64_t kept = static_cast<int64_t>(tiers.sink_tokens) + tiers.window_tokens +
                       tiers.bank_slots;
  return std::clamp<int64_t>(kept, 0, std::max<int64_t>(context, 0));
}

int64_t GpuKvBytes(const ModelConfig& model, DType kv_dtype, const Tiers& tiers, int64_t context) {
  // Per layer: a global layer keeps its tiers' rows, a sliding-window layer its window's.
  const int64_t layer_bytes = KvBytesPerToken(model, kv_dtype) / std::max(model.num_layers, 1);
  int64_t bytes = 0;
  for (int l = 0; l < model.num_layers; ++l) {
    const int64_t w = model.window_of(l);
    bytes += layer_bytes * (w > 0 ? std::clamp<int64_t>(w, 0, std::max<int64_t>(context, 0))
                                  : GpuKvRows(tiers, context));
  }
  return bytes;
}

double DecodeTraffic::bytes_per_token() const {
  if (tokens <= 0) return 0.0;
  return static_cast<double>(bytes_h2d + bytes_d2h) / static_cast<double>(tokens);
}

DecodeTraffic TrafficBetween(const Stats& before, const Stats& after, int64_t tokens) {
  DecodeTraffic t;
  t.bytes_h2d = after.bytes_h2d - before.bytes_h2d;
  t.bytes_d2h = after.bytes_d2h - before.bytes_d2h;
  t.tokens = tokens;
  return t;
}

}  // namespace kvferry::llama
