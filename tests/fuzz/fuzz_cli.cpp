// Copyright kvferry authors. Apache-2.0.
// Fuzzes kvferry-llama's argument parsing. Input: the arguments, separated by NUL bytes. Every
// command line is either accepted with values inside their ranges or refused with a message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "examples/llama/cli.h"

using namespace kvferry::llama;

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
