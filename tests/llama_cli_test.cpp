// Copyright kvferry authors. Apache-2.0.
// kvferry-llama's command line: every numeric flag rejects non-numbers, negatives and values out
// of range with a message naming the flag and the value; usage errors are found before the model
// loads and exit with 2; bad model files are named for what they are; the report's figures are
// defined once (KV kept on the GPU, decode PCIe bytes per token) and the report prints the same
// value wherever it prints one.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "examples/llama/cli.h"
#include "examples/llama/model.h"

namespace kvferry::llama {
namespace {

std::string Data(const std::string& name) { return std::string(KVFERRY_TEST_DATA_DIR) + "/" + name; }

Result<Options> Parse(std::vector<std::string> args) {
  std::vector<const char*> argv{"kvferry-llama"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  return ParseArgs(static_cast<int>(argv.size()), argv.data());
}

// A valid perplexity command line with \p flag \p value added.
Result<Options> ParseWith(const std::string& flag, const std::string& value) {
  return Parse({"--model", "m.gguf", "--perplexity", "--text", "t.txt", flag, value});
}

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kvferry_cli_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

TEST(LlamaCli, DefaultsAndAFullCommandLine) {
  auto o = Parse({"--model", "m.gguf", "--prompt", "hello"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->mode, Mode::kGenerate);
  EXPECT_EQ(o->context, 2048);
  EXPECT_EQ(o->base.tiers.sink_tokens, 4);
  EXPECT_EQ(o->base.tiers.window_tokens, 64);
  EXPECT_EQ(o->base.model.kv_dtype, DType::kF16);

  // What scripts/main-job.sh passes.
  o = Parse({"--model", "m.gguf", "--text", "kjv.txt", "--report", "--chat", "--context", "2048",
             "--scored", "256", "--offset-lines", "1000", "--policy", "lfps", "--budget", "256",
             "--window", "192", "--backend", "host", "--json", "out.json"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->mode, Mode::kReport);
  EXPECT_EQ(o->scored, 256);
  EXPECT_EQ(o->offset_lines, 1000);
  EXPECT_EQ(o->policies, std::vector<std::string>{"lfps"});
  EXPECT_EQ(o->budgets, std::vector<int64_t>{256});
  EXPECT_EQ(o->base.tiers.window_tokens, 192);
  EXPECT_EQ(o->base.backend, Backend::kHost);

  o = Parse({"--model", "m", "--passkey", "--text", "t", "--lengths", "2048,4096", "--depths",
             "0,0.5,1", "--trace-layers", "all", "--param", "r=0.95", "--temperature", "0.7"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->lengths, (std::vector<int64_t>{2048, 4096}));
  EXPECT_EQ(o->depths, (std::vector<double>{0.0, 0.5, 1.0}));
  EXPECT_TRUE(o->trace_layers.empty());
  EXPECT_DOUBLE_EQ(o->base.policy.params.at("r"), 0.95);
  EXPECT_FLOAT_EQ(o->temperature, 0.7f);

  o = Parse({"--help"});
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->help);
}

TEST(LlamaCli, EtfFlags) {
  auto o = Parse({"--model", "m", "--perplexity", "--text", "t"});
  ASSERT_TRUE(o.ok());
  EXPECT_FALSE(o->etf.on);
  o = Parse({"--model", "m", "--perplexity", "--text", "t", "--etf"});
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->etf.on);
  EXPECT_DOUBLE_EQ(o->etf.psi, 0.5);
  EXPECT_DOUBLE_EQ(o->etf.gamma, 1.0);
  EXPECT_EQ(o->etf.start, -1);
  EXPECT_FALSE(o->etf.copy_kv);
  o = Parse({"--model", "m", "--perplexity", "--text", "t", "--etf-copy-kv"});
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->etf.on && o->etf.copy_kv);
  o = Parse({"--model", "m", "--perplexity", "--text", "t", "--etf-psi", "0.7", "--etf-gamma", "1.5",
             "--etf-start", "20"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->etf.on);  // any --etf-* turns it on
  EXPECT_DOUBLE_EQ(o->etf.psi, 0.7);
  EXPECT_DOUBLE_EQ(o->etf.gamma, 1.5);
  EXPECT_EQ(o->etf.start, 20);
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--etf-psi", "0"}, {"--etf-psi", "1.5"}, {"--etf-gamma", "0"}, {"--etf-start", "-1"}}) {
    auto bad = ParseWith(flag, value);
    ASSERT_FALSE(bad.ok()) << flag << " " << value;
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find(flag), std::string::npos) << bad.status().message();
  }
}

// Every numeric flag, a value it must refuse, and a word its message must hold.
struct BadNumber {
  std::string flag, value, why;
};

TEST(LlamaCli, EveryNumericFlagRejectsNonNumbersNegativesAndOutOfRange) {
  const std::vector<std::string> numeric = {
      "--max-new", "--temperature", "--top-p",  "--seed",       "--context",
      "--scored",  "--offset-lines", "--chunk", "--trials",     "--lengths",
      "--depths",  "--trace-steps",  "--budget", "--sinks",     "--window",
      "--bank-slots", "--cpu-threads", "--trace-layers"};
  std::vector<BadNumber> cases;
  const std::vector<std::string> lists = {"--lengths", "--depths", "--budget", "--trace-layers"};
  for (const std::string& flag : numeric) {
    const bool list = std::find(lists.begin(), lists.end(), flag) != lists.end();
    cases.push_back({flag, "abc", "not a number"});
    cases.push_back({flag, "", list ? "empty list" : "not a number"});
    cases.push_back({flag, "12abc", "not a"});
    cases.push_back({flag, "-5", "negative"});
    cases.push_back({flag, "1e400", "out of range"});
    cases.push_back({flag, "nan", "not a"});
  }
  for (const char* flag : {"--context", "--budget", "--window", "--sinks", "--lengths",
                           "--max-new", "--trace-steps", "--bank-slots"}) {
    cases.push_back({flag, "99999999999", "out of range"});
    cases.push_back({flag, "1.5", "not a whole number"});
  }
  cases.push_back({"--context", "0", "out of range"});
  cases.push_back({"--context", "2", "out of range"});
  cases.push_back({"--scored", "0", "out of range"});
  cases.push_back({"--chunk", "0", "out of range"});
  cases.push_back({"--window", "0", "out of range"});
  cases.push_back({"--trials", "0", "out of range"});
  cases.push_back({"--top-p", "0", "out of range"});
  cases.push_back({"--top-p", "1.5", "out of range"});
  cases.push_back({"--temperature", "inf", "not a finite number"});
  cases.push_back({"--depths", "0.5,1.5", "out of range"});
  cases.push_back({"--budget", "256,", "empty item"});
  cases.push_back({"--lengths", ",2048", "empty item"});
  cases.push_back({"--trace-layers", "0,-1", "negative"});
  cases.push_back({"--seed", "18446744073709551616", "out of range"});
  for (const BadNumber& c : cases) {
    auto o = ParseWith(c.flag, c.value);
    ASSERT_FALSE(o.ok()) << c.flag << " '" << c.value << "' was accepted";
    EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
    const std::string& m = o.status().message();
    EXPECT_EQ(m.rfind(c.flag, 0), 0u) << "message does not start with the flag: " << m;
    if (!c.value.empty() && c.value.size() < 20) {
      EXPECT_NE(m.find(c.value), std::string::npos) << "message does not name the value: " << m;
    }
    EXPECT_NE(m.find(c.why), std::string::npos) << c.flag << " '" << c.value << "': " << m;
  }
}

TEST(LlamaCli, WhatANewUserHitIsReportedByFlag) {
  // --context -100 used to abort with std::length_error (exit 134).
  auto o = ParseWith("--context", "-100");
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message(), "--context -100: negative (want a whole number in [3, 1048576])");
  // --budget -5 used to say "budget of zero".
  o = ParseWith("--budget", "-5");
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message().find("zero"), std::string::npos) << o.status().message();
  EXPECT_NE(o.status().message().find("--budget -5: negative"), std::string::npos);
  // --context 0 used to name the runtime's max_tokens_per_sequence.
  o = ParseWith("--context", "0");
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message().find("max_tokens"), std::string::npos) << o.status().message();
  EXPECT_NE(o.status().message().find("--context 0"), std::string::npos);
  // --scored 0 used to say it "leaves no prefix".
  o = ParseWith("--scored", "0");
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("--scored 0: out of range"), std::string::npos)
      << o.status().message();
  // More scored tokens than the window holds names both flags, default or not.
  o = Parse({"--model", "m", "--perplexity", "--text", "t", "--context", "100"});
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("--scored (default) 512"), std::string::npos)
      << o.status().message();
  EXPECT_NE(o.status().message().find("--context 100"), std::string::npos);
  o = Parse({"--model", "m", "--report", "--text", "t", "--context", "100", "--scored", "99"});
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("--scored 99: must be at most --context 100 - 2 = 98"),
            std::string::npos)
      << o.status().message();
  EXPECT_TRUE(
      Parse({"--model", "m", "--report", "--text", "t", "--context", "100", "--scored", "98"}).ok());
  // A budget below the always-attended sinks + window.
  o = ParseWith("--budget", "32");
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("--budget 32: below --sinks 4 + --window 64 = 68"),
            std::string::npos)
      << o.status().message();
}

TEST(LlamaCli, FlagsAndModesMustAgree) {
  const auto message = [](std::vector<std::string> args) {
    auto o = Parse(std::move(args));
    EXPECT_FALSE(o.ok());
    return o.ok() ? std::string() : o.status().message();
  };
  EXPECT_EQ(message({"--prompt", "hi"}), "--model FILE is required");
  EXPECT_NE(message({"--model", "m"}).find("no mode given"), std::string::npos);
  EXPECT_NE(message({"--model", "m", "--perplexity"}).find("--perplexity needs --text"),
            std::string::npos);
  EXPECT_NE(message({"--model", "m", "--perplexity", "--passkey", "--text", "t"})
                .find("only one mode"),
            std::string::npos);
  EXPECT_EQ(message({"--model"}), "--model needs a value");
  EXPECT_NE(message({"--model", "--prompt", "hi"}).find("--model needs a value (got the flag"),
            std::string::npos);
  EXPECT_NE(message({"--model", "m", "--prompt", "hi", "--frobnicate"}).find("unknown option"),
            std::string::npos);
  EXPECT_NE(message({"--model", "m", "--prompt", "hi", "--context", "9", "--context", "10"})
                .find("--context given twice"),
            std::string::npos);
  EXPECT_NE(message({"--model", "m", "--prompt", "hi", "--backend", "gpu"}).find("--backend gpu"),
            std::string::npos);
  EXPECT_NE(message({"--model", "m", "--prompt", "hi", "--param", "r"}).find("want name=value"),
            std::string::npos);
  EXPECT_NE(message({"--model", "m", "--prompt", "hi", "--param", "r=x"}).find("--param r x"),
            std::string::npos);
  // --prompt then --dump-trace (or the other way round) is a trace of the prompt.
  auto o = Parse({"--model", "m", "--prompt", "hi", "--dump-trace", "t.st"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->mode, Mode::kTrace);
  o = Parse({"--model", "m", "--dump-trace", "t.st", "--prompt", "hi"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->mode, Mode::kTrace);
}

TEST(LlamaCli, PromptIsOneModeAndMustNotBeEmpty) {
  const auto message = [](std::vector<std::string> args) {
    auto o = Parse(std::move(args));
    EXPECT_FALSE(o.ok());
    return o.ok() ? std::string() : o.status().message();
  };
  // --prompt Hi --perplexity used to run perplexity and ignore the prompt.
  EXPECT_EQ(message({"--model", "m", "--prompt", "Hi", "--perplexity", "--text", "t"}),
            "--prompt: only one mode at a time, and --perplexity was given too (--prompt generates "
            "text; --perplexity takes its tokens from --text)");
  for (const char* mode : {"--perplexity", "--passkey", "--report"}) {
    const std::string m = message({"--model", "m", mode, "--text", "t", "--prompt", "Hi"});
    EXPECT_EQ(m.rfind("--prompt: only one mode at a time, and " + std::string(mode), 0), 0u) << m;
  }
  // --prompt "" used to say "no mode given".
  const std::string empty = message({"--model", "m", "--prompt", ""});
  EXPECT_EQ(empty.rfind("--prompt '': the prompt is empty", 0), 0u) << empty;
  EXPECT_EQ(empty.find("no mode"), std::string::npos) << empty;
  EXPECT_EQ(message({"--model", "m", "--dump-trace", "t.st", "--prompt", ""})
                .rfind("--prompt '': the prompt is empty", 0),
            0u);
  // A prompt may start with dashes; --prompt=TEXT is the same flag.
  auto o = Parse({"--model", "m", "--prompt", "--not a flag--"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->prompt, "--not a flag--");
  o = Parse({"--model", "m", "--prompt=Hi there"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->prompt, "Hi there");
  EXPECT_EQ(o->mode, Mode::kGenerate);
}

TEST(LlamaCli, ContextPastTheTrainedLengthIsWarnedWithBothNumbers) {
  // SmolLM2's GGUF says context_length 8192.
  auto o = Parse({"--model", "m", "--perplexity", "--text", "t", "--context", "16384"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  const std::string w = TrainedContextWarning(*o, 8192);
  EXPECT_EQ(w.rfind("warning: --context 16384 tokens is past the model's trained context of 8192 "
                    "tokens",
                    0),
            0u)
      << w;
  EXPECT_EQ(TrainedContextWarning(*o, 16384), "");
  EXPECT_EQ(TrainedContextWarning(*o, 0), "");  // a model that does not say
  o = Parse({"--model", "m", "--report", "--text", "t", "--context", "8192"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(TrainedContextWarning(*o, 8192), "");
  o = Parse({"--model", "m", "--passkey", "--text", "t", "--lengths", "2048,12000"});
  ASSERT_TRUE(o.ok());
  EXPECT_NE(TrainedContextWarning(*o, 8192).find("--lengths up to 12000 tokens is past the model's "
                                                 "trained context of 8192"),
            std::string::npos);
  o = Parse({"--model", "m", "--dump-trace", "t.st", "--text", "t", "--context", "8190",
             "--trace-steps", "16"});
  ASSERT_TRUE(o.ok());
  EXPECT_NE(TrainedContextWarning(*o, 8192).find("--context 8190 + --trace-steps 16 = 8206"),
            std::string::npos);
  // Generation: known once the prompt is tokenized.
  o = Parse({"--model", "m", "--prompt", "hi"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(TrainedContextWarning(*o, 8192), "");
  EXPECT_EQ(GenerationContextWarning(8000, 192, 8192), "");
  EXPECT_EQ(GenerationContextWarning(8000, 200, 8192),
            "warning: the prompt's 8000 tokens + --max-new 200 = 8200 tokens is past the model's "
            "trained context of 8192 tokens (its context_length)");
}

TEST(LlamaCli, CheckBeforeLoadNamesFilesPoliciesAndBudgets) {
  const std::string model = Data("stories260K.bin");
  const auto check = [&](std::vector<std::string> extra) {
    std::vector<std::string> args{"--model", model, "--perplexity", "--text", model,
                                  "--context", "256", "--scored", "64"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto o = Parse(args);
    EXPECT_TRUE(o.ok()) << o.status().ToString();
    return o.ok() ? CheckBeforeLoad(*o) : o.status();
  };
  EXPECT_TRUE(check({}).ok()) << check({}).ToString();
  Status s = check({"--policy", "foo"});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().rfind("--policy foo --budget 256: unknown policy 'foo'", 0), 0u)
      << s.message();
  // --param goes to the sparse policies only (the dense lane takes none).
  s = check({"--policy", "dense,streaming", "--param", "nonsense=1"});
  EXPECT_EQ(s.message().rfind("--policy streaming --budget 256:", 0), 0u) << s.message();
  // A parameter bounded by the head dimension is judged against the widest head a model may have
  // (Gemma 3's 256), not a probe's: the model's own runtime checks it against its shape.
  s = check({"--policy", "sparcas", "--param", "d_b=256", "--param", "bits=4"});
  EXPECT_TRUE(s.ok()) << s.ToString();
  s = check({"--policy", "sparcas", "--param", "d_b=257"});
  EXPECT_NE(s.message().find("'d_b'"), std::string::npos) << s.message();
  s = check({"--tokenizer", "/nonexistent/tok.bin"});
  EXPECT_EQ(s.message(), "--tokenizer /nonexistent/tok.bin: cannot open the file");
  s = check({"--json", "/nonexistent/dir/out.json"});
  EXPECT_NE(s.message().find("does not exist"), std::string::npos) << s.message();
  auto o = Parse({"--model", "/nonexistent.gguf", "--prompt", "hi"});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(CheckBeforeLoad(*o).message(), "--model /nonexistent.gguf: cannot open the file");
}

// A lane of --policy may carry its own parameters ("sparcas:smooth=1" beside "sparcas"), over
// --param's; a malformed lane is a usage error naming it, a parameter the policy does not take is
// refused before the model loads.
TEST(LlamaCli, LanesCarryTheirOwnParameters) {
  auto o = ParseWith("--policy", "oracle,sparcas,sparcas:smooth=1:u=32");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  ASSERT_EQ(o->policies.size(), 3u);
  o->base.policy.params["dense_layers"] = 1;  // as --param dense_layers=1
  const RuntimeConfig plain = LaneConfig(o->base, o->policies[1]);
  const RuntimeConfig smooth = LaneConfig(o->base, o->policies[2]);
  EXPECT_EQ(plain.policy.name, "sparcas");
  EXPECT_EQ(plain.policy.params, (std::map<std::string, double>{{"dense_layers", 1}}));
  EXPECT_EQ(smooth.policy.name, "sparcas");
  EXPECT_EQ(smooth.policy.params,
            (std::map<std::string, double>{{"dense_layers", 1}, {"smooth", 1}, {"u", 32}}));
  EXPECT_TRUE(LaneConfig(o->base, "dense").policy.params.empty());
  for (const auto& [lane, why] : std::vector<std::pair<std::string, std::string>>{
           {"sparcas:smooth", "lane 'sparcas:smooth': 'smooth' is not key=value"},
           {":u=3", "lane ':u=3': no policy name before ':'"},
           {"sparcas:=1", "lane 'sparcas:=1': '=1' has no key"},
           {"sparcas:u=x", "lane 'sparcas:u=x': parameter u: not a number"},
           {"sparcas:u=1:u=2", "lane 'sparcas:u=1:u=2': parameter u given twice"}}) {
    auto bad = ParseWith("--policy", lane);
    ASSERT_FALSE(bad.ok()) << lane;
    EXPECT_NE(bad.status().message().find(why), std::string::npos) << bad.status().message();
  }
  const std::string model = Data("stories260K.bin");
  auto with = Parse({"--model", model, "--perplexity", "--text", model, "--context", "256",
                     "--scored", "64", "--policy", "sparcas:smooth=1,sparcas:nonsense=1"});
  ASSERT_TRUE(with.ok()) << with.status().ToString();
  const Status s = CheckBeforeLoad(*with);
  EXPECT_EQ(s.message().rfind("--policy sparcas:nonsense=1 --budget 256:", 0), 0u) << s.message();
}

TEST(LlamaCli, ModelFilesAreNamedForWhatTheyAre) {
  const std::string empty = TempPath("empty.gguf");
  { std::ofstream(empty, std::ios::binary); }
  auto m = LoadModel(empty);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kCorruptData);
  EXPECT_NE(m.status().message().find("the file is empty"), std::string::npos)
      << m.status().message();
  EXPECT_EQ(m.status().message().find("llama2.c"), std::string::npos) << m.status().message();
  // A .gguf of other bytes is a GGUF with a bad magic, not a llama2.c checkpoint.
  const std::string text = TempPath("text.gguf");
  { std::ofstream(text, std::ios::binary) << "In the beginning God created the heaven"; }
  m = LoadModel(text);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("gguf: bad magic"), std::string::npos)
      << m.status().message();
  // Three bytes without a .gguf name: neither format.
  const std::string tiny = TempPath("tiny.bin");
  { std::ofstream(tiny, std::ios::binary) << "abc"; }
  m = LoadModel(tiny);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("not a GGUF file"), std::string::npos)
      << m.status().message();
  std::filesystem::remove(empty);
  std::filesystem::remove(text);
  std::filesystem::remove(tiny);
}

TEST(LlamaCli, ReportFiguresAreDefinedOnce) {
  // SmolLM2-135M: 30 layers, 3 KV heads of 64, KV f16: 2 x 30 x 3 x 64 x 2 = 23040 B per token.
  ModelConfig smollm2;
  smollm2.num_layers = 30;
  smollm2.num_kv_heads = 3;
  smollm2.head_dim = 64;
  EXPECT_EQ(KvBytesPerToken(smollm2, DType::kF16), 23040);
  EXPECT_EQ(KvBytesPerToken(smollm2, DType::kBF16), 23040);
  Tiers tiers;
  tiers.sink_tokens = 4;
  tiers.window_tokens = 192;
  tiers.bank_slots = 0;
  EXPECT_EQ(GpuKvRows(tiers, 8192), 196);
  // A short sequence keeps no more than it has: never more than the dense cache.
  EXPECT_EQ(GpuKvRows(tiers, 100), 100);
  EXPECT_EQ(GpuKvBytes(smollm2, DType::kF16, tiers, 100), 100 * 23040);
  tiers.bank_slots = 1024;
  EXPECT_EQ(GpuKvRows(tiers, 8192), 1220);
  EXPECT_EQ(GpuKvRows(tiers, 0), 0);

  Stats before, after;
  before.bytes_h2d = 1000;
  before.bytes_d2h = 50;
  after.bytes_h2d = 5000;
  after.bytes_d2h = 850;
  const DecodeTraffic t = TrafficBetween(before, after, 16);
  EXPECT_EQ(t.bytes_h2d, 4000);
  EXPECT_EQ(t.bytes_d2h, 800);
  EXPECT_DOUBLE_EQ(t.bytes_per_token(), 300.0);
  EXPECT_DOUBLE_EQ(TrafficBetween(before, after, 0).bytes_per_token(), 0.0);

  EXPECT_EQ(FileLabel("data/SmolLM2-135M-Instruct.Q4_1.gguf"), "SmolLM2-135M-Instruct.Q4_1");
  EXPECT_EQ(FileLabel("model"), "model");
}

// ---- the binary --------------------------------------------------------------------------------

// kvferry-llama of the same build tree, or "" if it was not built.
std::string LlamaBinary() {
  std::error_code ec;
#if defined(KVFERRY_LLAMA_BIN)
  return std::filesystem::exists(KVFERRY_LLAMA_BIN, ec) ? std::string(KVFERRY_LLAMA_BIN) : "";
#endif
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const auto bin = exe.parent_path().parent_path() / "examples" / "llama" / "kvferry-llama";
  return std::filesystem::exists(bin, ec) ? bin.string() : "";
}

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

RunResult RunLlama(const std::string& args) {
  RunResult r;
  const std::string cmd = LlamaBinary() + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

TEST(LlamaCliBinary, UsageErrorsExitWithTwoBeforeLoading) {
  if (LlamaBinary().empty()) GTEST_SKIP() << "kvferry-llama not built in this tree";
  const std::string model = "--model " + Data("stories260K.bin") + " --tokenizer " +
                            Data("tok512.bin") + " --perplexity --text " + Data("tok512.bin");
  for (const std::string& bad : {"--context -100", "--budget -5", "--context 0", "--scored 0",
                                 "--policy foo", "--chunk x", "--window 1e9", "--frobnicate"}) {
    const RunResult r = RunLlama(model + " " + bad);
    EXPECT_EQ(r.exit_code, kExitUsage) << bad << ":\n" << r.output;
    EXPECT_EQ(r.output.rfind("kvferry-llama: ", 0), 0u) << bad << ":\n" << r.output;
    EXPECT_NE(r.output.find(bad.substr(0, bad.find(' '))), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("loaded in"), std::string::npos) << "model loaded before " << bad;
    EXPECT_EQ(r.output.find("terminate"), std::string::npos) << r.output;
  }
  // Overflow, a fractional whole number, an unwritable --json, conflicting or empty modes: all
  // usage errors found before the model loads.
  for (const auto& [bad, says] : std::vector<std::pair<std::string, std::string>>{
           {"--context 99999999999999999999", "--context 99999999999999999999: out of range"},
           {"--chunk 1.5", "--chunk 1.5: not a whole number"},
           {"--json /nonexistent/dir/out.json", "folder /nonexistent/dir does not exist"},
           {"--prompt Hi", "--prompt: only one mode at a time, and --perplexity was given too"}}) {
    const RunResult r = RunLlama(model + " " + bad);
    EXPECT_EQ(r.exit_code, kExitUsage) << bad << ":\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << bad << ":\n" << r.output;
    EXPECT_EQ(r.output.find("loaded in"), std::string::npos) << "model loaded before " << bad;
  }
  // --backend cuda on a machine without a GPU (none is visible here): a usage error naming why.
  RunResult r = RunLlama("--model " + Data("stories260K.bin") + " --tokenizer " + Data("tok512.bin") +
                         " --prompt hi --backend cuda");
  if (tools::CudaDeviceProblem().empty()) {
    // This machine has a GPU; the test binary's environment decides what kvferry-llama sees.
  } else {
    EXPECT_EQ(r.exit_code, kExitUsage) << r.output;
    EXPECT_TRUE(r.output.find("--backend cuda: no CUDA device found") != std::string::npos ||
                r.output.find("--backend cuda: kvferry was built without CUDA") != std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("insufficient"), std::string::npos) << r.output;
  }
  r = RunLlama("--model " + Data("stories260K.bin") + " --prompt ''");
  EXPECT_EQ(r.exit_code, kExitUsage) << r.output;
  EXPECT_NE(r.output.find("the prompt is empty"), std::string::npos) << r.output;
  r = RunLlama("--help");
  EXPECT_EQ(r.exit_code, kExitOk);
  EXPECT_NE(r.output.find("usage: kvferry-llama"), std::string::npos);
  r = RunLlama("-h");
  EXPECT_EQ(r.exit_code, kExitOk);
  EXPECT_NE(r.output.find("usage: kvferry-llama"), std::string::npos);
  // A model that does not load is a failed run (1), named for what it is.
  const std::string empty = TempPath("bin_empty.gguf");
  { std::ofstream(empty, std::ios::binary); }
  r = RunLlama("--model " + empty + " --prompt hi");
  EXPECT_EQ(r.exit_code, kExitFailure) << r.output;
  EXPECT_NE(r.output.find("the file is empty"), std::string::npos) << r.output;
  std::filesystem::remove(empty);
}

// The number after "\"key\": " at or after \p from in \p json (first occurrence).
double JsonNumber(const std::string& json, const std::string& key, size_t from = 0) {
  const size_t at = json.find("\"" + key + "\": ", from);
  if (at == std::string::npos) return -1;
  return std::strtod(json.c_str() + at + key.size() + 4, nullptr);
}

TEST(LlamaCliBinary, ReportPrintsEachFigureOnceDefined) {
  if (LlamaBinary().empty()) GTEST_SKIP() << "kvferry-llama not built in this tree";
  // A small text the tiny model's tokenizer knows.
  const std::string text = TempPath("story.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 60; ++i) {
      out << "Once upon a time there was a little girl named Lily. She liked to play with her "
             "ball in the park "
          << i << " times.\n";
    }
  }
  const std::string json_path = TempPath("report.json");
  const RunResult r = RunLlama("--model " + Data("stories260K.bin") + " --tokenizer " +
                               Data("tok512.bin") + " --report --text " + text +
                               " --context 300 --scored 40 --policy streaming --budget 32"
                               " --window 16 --backend host --json " + json_path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(json_path);
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t summary = json.find("\"summary\"");
  ASSERT_NE(summary, std::string::npos) << json;
  // 300 tokens are within stories260K's trained 512: no warning.
  EXPECT_EQ(r.output.find("trained context"), std::string::npos) << r.output;
  // The header names the model file and the text file, and says the GPU is emulated.
  EXPECT_NE(r.output.find("kvferry main job: stories260K, 300-token window of kvferry_cli_test_"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("KJV"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("emulated"), std::string::npos) << r.output;
  // Decode PCIe bytes per token: the summary repeats the perplexity table's sparse lane.
  const size_t sparse_lane = json.find("\"lane\": \"streaming@32\"");
  ASSERT_NE(sparse_lane, std::string::npos);
  const double table = JsonNumber(json, "decode_pcie_bytes_per_token", sparse_lane);
  EXPECT_GT(table, 0);
  EXPECT_EQ(JsonNumber(json, "decode_pcie_bytes_per_token", summary), table);
  EXPECT_EQ(JsonNumber(json, "decode_tokens_per_second", summary),
            JsonNumber(json, "decode_tokens_per_second", sparse_lane));
  // KV kept on the GPU: (4 + 16) rows x 640 B, below the 300-token dense cache.
  EXPECT_EQ(JsonNumber(json, "gpu_kv_bytes_per_sequence", summary), 20 * 640);
  EXPECT_EQ(JsonNumber(json, "dense_gpu_cache_bytes", summary), 300 * 640);
  std::filesystem::remove(text);
  std::filesystem::remove(json_path);
}

TEST(LlamaCliBinary, ContextPastTheTrainedLengthIsWarned) {
  if (LlamaBinary().empty()) GTEST_SKIP() << "kvferry-llama not built in this tree";
  const std::string text = TempPath("long_story.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 80; ++i) {
      out << "Once upon a time there was a little girl named Lily. She liked to play with her "
             "ball in the park "
          << i << " times.\n";
    }
  }
  // stories260K was trained on 512-token sequences (its llama2.c header's seq_len).
  const RunResult r = RunLlama("--model " + Data("stories260K.bin") + " --tokenizer " +
                               Data("tok512.bin") + " --perplexity --text " + text +
                               " --context 600 --scored 8 --policy streaming --budget 32"
                               " --window 16 --backend host --no-dense");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: --context 600 tokens is past the model's trained context of "
                          "512 tokens"),
            std::string::npos)
      << r.output;
  std::filesystem::remove(text);
}

}  // namespace
}  // namespace kvferry::llama
