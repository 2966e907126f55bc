// Copyright kvferry authors. Apache-2.0.
// Fuzzes kvferry-llama's argument parsing and the tools' shared parser (tools/common/args.h,
// which kvferry-bench and kvferry-e2e declare their flags with), on the same arguments. Input:
// the arguments, separated by NUL bytes. Every command line is either accepted with values inside
// their ranges or refused with a message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "examples/llama/cli.h"
#include "tools/common/args.h"

using namespace kvferry::llama;

namespace {

// One flag of every kind the parser declares (no file flags: they would touch the disk), with
// ranges like kvferry-bench's and kvferry-e2e's.
void FuzzSharedParser(const std::vector<const char*>& argv) {
  namespace tools = kvferry::tools;
  int steps = 16;
  int64_t context = 8192;
  uint64_t seed = 1;
  double drift = 0, psi = 0.5;
  std::vector<int64_t> contexts{32768};
  std::vector<int> batches{1};
  std::vector<double> depths{0.5};
  std::string backend = "host", policy = "oracle";
  bool flag = false;
  int params = 0;
  tools::ArgParser p("fuzz", "[options]");
  p.Whole("--steps", "", &steps, 1, 1000000)
      .Whole("--context", "", &context, 1, int64_t{1} << 24)
      .Whole("--seed", "", &seed, 0, INT64_MAX)
      .Real("--query-drift", "", &drift, 0.0, 1000.0)
      .Real("--etf-psi", "", &psi, 0.0, 1.0, /*lo_open=*/true)
      .WholeList("--contexts", "", &contexts, 64, int64_t{1} << 24)
      .WholeList("--batches", "", &batches, 1, 1024)
      .RealList("--depths", "", &depths, 0.0, 1.0)
      .Choice("--backend", "", &backend, {"host", "cuda", "auto"})
      .String("--policy", "NAME", "", &policy)
      .Switch("--no-dense", "", &flag)
      .KeyReal("--param", "", [&](const std::string& k, double v) {
        if (k.empty() || !(v >= -1e300 && v <= 1e300)) std::abort();
        ++params;
      });
  const kvferry::tools::ParseResult r = p.Parse(static_cast<int>(argv.size()), argv.data());
  if (r.help()) return;
  if (!r.ok()) {
    if (r.message.empty()) std::abort();
    return;
  }
  if (steps < 1 || steps > 1000000 || context < 1 || context > (int64_t{1} << 24)) std::abort();
  if (!(drift >= 0 && drift <= 1000) || !(psi > 0 && psi <= 1)) std::abort();
  if (contexts.empty() || batches.empty() || depths.empty()) std::abort();
  for (int64_t c : contexts) {
    if (c < 64 || c > (int64_t{1} << 24)) std::abort();
  }
  for (int b : batches) {
    if (b < 1 || b > 1024) std::abort();
  }
  for (double d : depths) {
    if (!(d >= 0 && d <= 1)) std::abort();
  }
  if (backend != "host" && backend != "cuda" && backend != "auto") std::abort();
  (void)p.Usage();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"kvferry-llama"};
  std::string cur;
  for (size_t i = 0; i < size && args.size() < 64; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(static_cast<char>(data[i]));
    }
  }
  if (!cur.empty()) args.push_back(cur);
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  FuzzSharedParser(argv);
  auto o = ParseArgs(static_cast<int>(argv.size()), argv.data());
  if (!o.ok()) {
    if (o.status().code() != kvferry::StatusCode::kInvalidArgument) std::abort();
    if (o.status().message().empty()) std::abort();
    return 0;
  }
  if (o->help) return 0;
  if (o->model.empty()) std::abort();
  if (o->context < 3 || o->context > kMaxTokensFlag || o->chunk < 1) std::abort();
  if ((o->mode == Mode::kPerplexity || o->mode == Mode::kReport) &&
      (o->scored < 1 || o->scored > o->context - 2)) {
    std::abort();
  }
  if (o->policies.empty() || o->budgets.empty() || o->lengths.empty() || o->depths.empty()) {
    std::abort();
  }
  for (int64_t b : o->budgets) {
    if (b < 1 || b > kMaxTokensFlag) std::abort();
  }
  for (double d : o->depths) {
    if (!(d >= 0.0 && d <= 1.0)) std::abort();
  }
  if (!(o->top_p > 0.0f && o->top_p <= 1.0f) || !(o->temperature >= 0.0f)) std::abort();
  if (o->base.tiers.window_tokens < 1 || o->base.tiers.sink_tokens < 0 || o->trials < 1) std::abort();
  (void)UsageText();
  return 0;
}
