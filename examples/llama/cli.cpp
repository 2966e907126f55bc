// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/cli.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <system_error>

#include "kvferry/runtime.h"
#include "kvferry/status_macros.h"

#if !defined(KVFERRY_CLI_NO_RUNTIME)
#include "kvferry/runtime.h"
#endif

namespace kvferry::llama {
namespace {

using detail::StrCat;

// The value as the user typed it, quoted when it would not read as one word.
std::string Shown(const std::string& v) {
  std::string out;
  for (char c : v.substr(0, 64)) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      out += StrCat("\\x", "0123456789abcdef"[u >> 4], "0123456789abcdef"[u & 15]);
    } else {
      out += c;
    }
  }
  if (v.size() > 64) out += "...";
  if (out.empty() || out.find_first_of(" '\\") != std::string::npos) return "'" + out + "'";
  return out;
}

Status BadValue(const std::string& flag, const std::string& value, const std::string& why) {
  return InvalidArgument(StrCat(flag, " ", Shown(value), ": ", why));
}

// Why \p text is not a whole number in [lo, hi] (decimal digits, optional '-'), or "" if it is.
std::string WholeProblem(const std::string& text, int64_t lo, int64_t hi, int64_t* out) {
  const std::string want = StrCat("want a whole number in [", lo, ", ", hi, "]");
  const char* end = text.data() + text.size();
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ptr == end && ec == std::errc::result_out_of_range) {
    return StrCat(text[0] == '-' ? "negative and " : "", "out of range (", want, ")");
  }
  if (ec != std::errc() || ptr != end) {
    // "1.5", "1e3", "1e400": numbers, but not whole ones written in plain digits.
    double d = 0;
    const auto [dptr, dec] = std::from_chars(text.data(), end, d);
    if (dptr == end && dec == std::errc::result_out_of_range) {
      return StrCat("out of range (", want, ")");
    }
    if (dptr == end && dec == std::errc() && std::isfinite(d)) {
      return StrCat("not a whole number (", want, ")");
    }
    return StrCat("not a number (", want, ")");
  }
  if (v < lo || v > hi) return StrCat(v < 0 ? "negative" : "out of range", " (", want, ")");
  *out = v;
  return "";
}

// Why \p text is not a finite real in [lo, hi] (open at lo when lo_open), or "" if it is.
std::string RealProblem(const std::string& text, double lo, double hi, bool lo_open, double* out) {
  const std::string want = StrCat("want a number in ", lo_open ? "(" : "[", lo, ", ", hi, "]");
  const char* end = text.data() + text.size();
  double v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ptr == end && ec == std::errc::result_out_of_range) return StrCat("out of range (", want, ")");
  if (ec != std::errc() || ptr != end) return StrCat("not a number (", want, ")");
  if (!std::isfinite(v)) return StrCat("not a finite number (", want, ")");
  if (v < lo || v > hi || (lo_open && v == lo)) {
    return StrCat(v < 0 && lo >= 0 ? "negative" : "out of range", " (", want, ")");
  }
  *out = v;
  return "";
}

Result<int64_t> ParseWhole(const std::string& flag, const std::string& text, int64_t lo,
                           int64_t hi) {
  int64_t v = 0;
  const std::string problem = WholeProblem(text, lo, hi, &v);
  if (!problem.empty()) return BadValue(flag, text, problem);
  return v;
}

Result<double> ParseReal(const std::string& flag, const std::string& text, double lo, double hi,
                         bool lo_open = false) {
  double v = 0;
  const std::string problem = RealProblem(text, lo, hi, lo_open, &v);
  if (!problem.empty()) return BadValue(flag, text, problem);
  return v;
}

// Comma-separated items, none empty.
Result<std::vector<std::string>> SplitList(const std::string& flag, const std::string& text) {
  if (text.empty()) return BadValue(flag, text, "empty list");
  std::vector<std::string> items;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos
                                                                            : comma - start);
    if (item.empty()) return BadValue(flag, text, "empty item in the comma-separated list");
    items.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (items.size() > 64) return BadValue(flag, text, "more than 64 items");
  return items;
}

// The error of one item of a list names the whole value and, if there are several, the item.
Status BadItem(const std::string& flag, const std::string& text, size_t num_items,
               const std::string& item, const std::string& problem) {
  if (num_items == 1) return BadValue(flag, text, problem);
  return BadValue(flag, text, StrCat("item ", Shown(item), " ", problem));
}

Result<std::vector<int64_t>> ParseWholeList(const std::string& flag, const std::string& text,
                                            int64_t lo, int64_t hi) {
  KVF_ASSIGN_OR_RETURN(std::vector<std::string> items, SplitList(flag, text));
  std::vector<int64_t> out;
  for (const std::string& item : items) {
    int64_t v = 0;
    const std::string problem = WholeProblem(item, lo, hi, &v);
    if (!problem.empty()) return BadItem(flag, text, items.size(), item, problem);
    out.push_back(v);
  }
  return out;
}

Result<std::vector<double>> ParseRealList(const std::string& flag, const std::string& text,
                                          double lo, double hi) {
  KVF_ASSIGN_OR_RETURN(std::vector<std::string> items, SplitList(flag, text));
  std::vector<double> out;
  for (const std::string& item : items) {
    double v = 0;
    const std::string problem = RealProblem(item, lo, hi, false, &v);
    if (!problem.empty()) return BadItem(flag, text, items.size(), item, problem);
    out.push_back(v);
  }
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
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return BadValue(flag, path, "is a folder, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return BadValue(flag, path, "cannot open the file");
  return Status::Ok();
}

Status CheckWritableFolder(const std::string& flag, const std::string& path) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (std::filesystem::is_directory(path, ec)) return BadValue(flag, path, "is a folder, not a file");
  if (!parent.empty() && !std::filesystem::is_directory(parent, ec)) {
    return BadValue(flag, path, StrCat("folder ", parent.string(), " does not exist"));
  }
  return Status::Ok();
}

}  // namespace

std::string UsageText() {
  return "usage: kvferry-llama --model FILE [--tokenizer tok.bin] MODE [options]\n"
         "modes (one): --prompt TEXT | --perplexity | --passkey | --dump-trace FILE | --report\n"
         "text:    --text FILE --offset-lines N --context N (2048) --scored N (512) --chunk N (512)\n"
         "gen:     --max-new N (64) --temperature T (0) --top-p P (0.9) --seed S --chat\n"
         "passkey: --lengths 2048,4096 --depths 0.1,0.5,0.9 --trials N\n"
         "trace:   --trace-layers 0,15 | all --trace-steps N --trace-dtype f32|bf16\n"
         "runtime: --policy a[,b] (streaming) --budget n[,m] (256) --backend host|cuda|auto\n"
         "         --route auto|gpu|cpu --kv-dtype f16|bf16 --sinks N (4) --window N (64)\n"
         "         --bank-slots N (0) --cpu-threads N --param k=v --no-dense\n"
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
  bool layers_set = false;
  std::set<std::string> seen;
  bool mode_set = false;
  bool scored_set = false;
  const auto set_mode = [&](Mode m, const std::string& flag) -> Status {
    if (mode_set && o.mode != m) {
      return InvalidArgument(StrCat(flag, ": only one mode at a time, and ", ModeFlag(o.mode),
                                    " was given too"));
    }
    o.mode = m;
    mode_set = true;
    return Status::Ok();
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i] != nullptr ? argv[i] : "";
    // Takes the flag's value. Values of file and choice flags never start with "--": that is a
    // forgotten value followed by the next flag.
    const auto next = [&](bool may_look_like_flag = false) -> Result<std::string> {
      if (i + 1 >= argc || argv[i + 1] == nullptr) return InvalidArgument(StrCat(a, " needs a value"));
      const std::string v = argv[i + 1];
      if (!may_look_like_flag && v.rfind("--", 0) == 0) {
        return InvalidArgument(StrCat(a, " needs a value (got the flag ", Shown(v), ")"));
      }
      ++i;
      return v;
    };
    const auto whole = [&](int64_t lo, int64_t hi) -> Result<int64_t> {
      KVF_ASSIGN_OR_RETURN(std::string v, next(/*may_look_like_flag=*/true));
      return ParseWhole(a, v, lo, hi);
    };
    const auto real = [&](double lo, double hi, bool lo_open) -> Result<double> {
      KVF_ASSIGN_OR_RETURN(std::string v, next(/*may_look_like_flag=*/true));
      return ParseReal(a, v, lo, hi, lo_open);
    };
    if (a.rfind("--", 0) == 0 && a != "--param" && !seen.insert(a).second) {
      return InvalidArgument(StrCat(a, " given twice"));
    }
    if (a == "--model") { KVF_ASSIGN_OR_RETURN(o.model, next()); }
    else if (a == "--tokenizer") { KVF_ASSIGN_OR_RETURN(o.tokenizer, next()); }
    else if (a == "--text") { KVF_ASSIGN_OR_RETURN(o.text, next()); }
    else if (a == "--prompt") { KVF_ASSIGN_OR_RETURN(o.prompt, next(true)); }
    else if (a == "--perplexity") { KVF_RETURN_IF_ERROR(set_mode(Mode::kPerplexity, a)); }
    else if (a == "--passkey") { KVF_RETURN_IF_ERROR(set_mode(Mode::kPasskey, a)); }
    else if (a == "--report") { KVF_RETURN_IF_ERROR(set_mode(Mode::kReport, a)); }
    else if (a == "--dump-trace") {
      KVF_ASSIGN_OR_RETURN(o.dump_trace, next());
      KVF_RETURN_IF_ERROR(set_mode(Mode::kTrace, a));
    }
    else if (a == "--json") { KVF_ASSIGN_OR_RETURN(o.json_out, next()); }
    else if (a == "--max-new") { KVF_ASSIGN_OR_RETURN(int64_t v, whole(0, kMaxTokensFlag)); o.max_new = static_cast<int>(v); }
    else if (a == "--temperature") { KVF_ASSIGN_OR_RETURN(double v, real(0.0, 100.0, false)); o.temperature = static_cast<float>(v); }
    else if (a == "--top-p") { KVF_ASSIGN_OR_RETURN(double v, real(0.0, 1.0, true)); o.top_p = static_cast<float>(v); }
    else if (a == "--seed") {
      KVF_ASSIGN_OR_RETURN(int64_t v, whole(0, std::numeric_limits<int64_t>::max()));
      o.seed = static_cast<uint64_t>(v);
    }
    else if (a == "--chat") { o.chat = true; }
    else if (a == "--context") { KVF_ASSIGN_OR_RETURN(o.context, whole(3, kMaxTokensFlag)); }
    else if (a == "--scored") { KVF_ASSIGN_OR_RETURN(o.scored, whole(1, kMaxTokensFlag)); scored_set = true; }
    else if (a == "--offset-lines") { KVF_ASSIGN_OR_RETURN(o.offset_lines, whole(0, int64_t{1} << 31)); }
    else if (a == "--chunk") { KVF_ASSIGN_OR_RETURN(o.chunk, whole(1, 65536)); }
    else if (a == "--trials") { KVF_ASSIGN_OR_RETURN(int64_t v, whole(1, 10000)); o.trials = static_cast<int>(v); }
    else if (a == "--lengths") {
      KVF_ASSIGN_OR_RETURN(std::string v, next(true));
      KVF_ASSIGN_OR_RETURN(o.lengths, ParseWholeList(a, v, 1, kMaxTokensFlag));
    } else if (a == "--depths") {
      KVF_ASSIGN_OR_RETURN(std::string v, next(true));
      KVF_ASSIGN_OR_RETURN(o.depths, ParseRealList(a, v, 0.0, 1.0));
    }
    else if (a == "--trace-layers") {
      KVF_ASSIGN_OR_RETURN(layers_arg, next(true));
      layers_set = true;
    }
    else if (a == "--trace-steps") { KVF_ASSIGN_OR_RETURN(int64_t v, whole(0, kMaxTokensFlag)); o.trace_steps = static_cast<int>(v); }
    else if (a == "--trace-dtype") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      if (v != "f32" && v != "bf16") return BadValue(a, v, "want f32 or bf16");
      o.trace_bf16 = v == "bf16";
    } else if (a == "--policy") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      KVF_ASSIGN_OR_RETURN(o.policies, SplitList(a, v));
    } else if (a == "--budget") {
      KVF_ASSIGN_OR_RETURN(std::string v, next(true));
      KVF_ASSIGN_OR_RETURN(o.budgets, ParseWholeList(a, v, 1, kMaxTokensFlag));
    } else if (a == "--backend") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      if (v == "host") o.base.backend = Backend::kHost;
      else if (v == "cuda") o.base.backend = Backend::kCuda;
      else if (v == "auto") o.base.backend = Backend::kAuto;
      else return BadValue(a, v, "want host, cuda or auto");
    } else if (a == "--route") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      if (v == "auto") o.base.route = Route::kAuto;
      else if (v == "gpu") o.base.route = Route::kGpu;
      else if (v == "cpu") o.base.route = Route::kCpu;
      else return BadValue(a, v, "want auto, gpu or cpu");
    } else if (a == "--kv-dtype") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      if (v == "bf16") o.base.model.kv_dtype = DType::kBF16;
      else if (v == "f16") o.base.model.kv_dtype = DType::kF16;
      else return BadValue(a, v, "want f16 or bf16");
    }
    else if (a == "--sinks") { KVF_ASSIGN_OR_RETURN(int64_t v, whole(0, kMaxTokensFlag)); o.base.tiers.sink_tokens = static_cast<int>(v); }
    else if (a == "--window") { KVF_ASSIGN_OR_RETURN(int64_t v, whole(1, kMaxTokensFlag)); o.base.tiers.window_tokens = static_cast<int>(v); }
    else if (a == "--bank-slots") { KVF_ASSIGN_OR_RETURN(int64_t v, whole(0, kMaxTokensFlag)); o.base.tiers.bank_slots = static_cast<int>(v); }
    else if (a == "--cpu-threads") { KVF_ASSIGN_OR_RETURN(int64_t v, whole(0, 4096)); o.base.cpu_threads = static_cast<int>(v); }
    else if (a == "--param") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      const size_t eq = v.find('=');
      if (eq == std::string::npos || eq == 0) return BadValue(a, v, "want name=value");
      const std::string name = v.substr(0, eq);
      KVF_ASSIGN_OR_RETURN(double x, ParseReal(StrCat(a, " ", name), v.substr(eq + 1),
                                               -1e300, 1e300));  // the runtime checks the range
      o.base.policy.params[name] = x;
    } else if (a == "--no-dense") { o.no_dense = true; }
    else if (a == "--etf") { o.etf.on = true; }
    else if (a == "--etf-copy-kv") { o.etf.on = true; o.etf.copy_kv = true; }
    else if (a == "--etf-psi") { KVF_ASSIGN_OR_RETURN(double v, real(0.0, 1.0, true)); o.etf.psi = v; o.etf.on = true; }
    else if (a == "--etf-gamma") { KVF_ASSIGN_OR_RETURN(double v, real(0.0, 1e3, true)); o.etf.gamma = v; o.etf.on = true; }
    else if (a == "--etf-start") { KVF_ASSIGN_OR_RETURN(int64_t v, whole(0, 4095)); o.etf.start = static_cast<int>(v); o.etf.on = true; }
    else if (a == "-h" || a == "--help") { o.help = true; return o; }
    else return InvalidArgument(StrCat("unknown option ", Shown(a)));
  }
  if (!mode_set && !o.prompt.empty()) o.mode = Mode::kGenerate;
  if (layers_arg == "all") {
    o.trace_layers.clear();  // filled once the model is known
  } else if (layers_set) {
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
      return InvalidArgument(StrCat(scored_set ? "--scored " : "--scored (default) ", o.scored,
                                    ": must be at most --context ", o.context,
                                    " - 2 = ", o.context - 2,
                                    " (the scored tokens need at least one token before them)"));
    }
  }
  return o;
}

Status CheckBeforeLoad(const Options& o) {
  KVF_RETURN_IF_ERROR(CheckReadable("--model", o.model));
  if (!o.tokenizer.empty()) KVF_RETURN_IF_ERROR(CheckReadable("--tokenizer", o.tokenizer));
  if (!o.text.empty()) KVF_RETURN_IF_ERROR(CheckReadable("--text", o.text));
  if (!o.json_out.empty()) KVF_RETURN_IF_ERROR(CheckWritableFolder("--json", o.json_out));
  if (!o.dump_trace.empty()) KVF_RETURN_IF_ERROR(CheckWritableFolder("--dump-trace", o.dump_trace));
#if !defined(KVFERRY_CLI_NO_RUNTIME)
  if (o.base.backend == Backend::kCuda && !CudaAvailable()) {
    return InvalidArgument("--backend cuda: no CUDA GPU here (or kvferry was built without CUDA); "
                           "use --backend host or auto");
  }
  // Longest sequence any mode asks of a runtime.
  int64_t max_tokens = o.context + o.max_new + o.trace_steps + 1;
  for (int64_t l : o.lengths) max_tokens = std::max(max_tokens, l + 64);
  // Let the runtime judge each lane's policy, budget, tiers and parameters on a small model shape
  // (one layer, GQA 2:1, head_dim 64), on the host backend and without its start-up probes.
  std::vector<std::pair<std::string, int64_t>> lanes;
  for (const std::string& p : o.policies) {
    if (p == "dense") {
      lanes.emplace_back(p, 0);
      continue;
    }
    for (int64_t b : o.budgets) lanes.emplace_back(p, b);
  }
  for (const auto& [policy, budget] : lanes) {
    RuntimeConfig rc = o.base;
    rc.model.num_layers = 1;
    rc.model.num_q_heads = 2;
    rc.model.num_kv_heads = 1;
    rc.model.head_dim = 64;
    rc.backend = Backend::kHost;
    rc.probe_at_start = false;
    rc.cpu_threads = 1;
    rc.policy.name = policy;
    rc.policy.budget_tokens = policy == "dense" ? max_tokens : budget;
    if (policy == "dense") rc.policy.params.clear();  // --param is for the sparse policies
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
  return GpuKvRows(tiers, context) * KvBytesPerToken(model, kv_dtype);
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
