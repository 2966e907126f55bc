// Copyright kvferry authors. Apache-2.0.
// The tools' command line (tools/common/args.h) and every tool run as a user runs it: a bad value
// (not a number, overflow, negative, fractional) is exit 2 naming the flag and the accepted range,
// --help prints the usage and exits 0, an unknown flag is exit 2 naming it, an unwritable output
// path is exit 2 before any work, and a run that can measure nothing (no CUDA device) exits 1
// saying so. Never an uncaught exception (exit 134). kvferry-llama's own cases are in
// llama_cli_test.cpp.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tools/common/args.h"

namespace kvferry::tools {
namespace {

// ---- the parser ---------------------------------------------------------------------------------

// A parser of every kind of flag, as the tools declare them.
struct Flags {
  int steps = 16;
  int64_t context = 8192;
  double drift = 0, psi = 0.5;
  std::vector<int64_t> contexts{32768};
  std::vector<int> batches{1, 4};
  std::vector<double> depths{0.5};
  std::string backend = "host", policy = "oracle", json, trace;
  bool no_dense = false;
  std::vector<std::pair<std::string, double>> params;
  ArgParser parser{"tool", "[options]\nWhat the tool does.\n"};
  Flags() {
    parser.Whole("--steps", "decode steps", &steps, 1, 1000000)
        .Whole("--context", "tokens", &context, 1, int64_t{1} << 24)
        .Real("--query-drift", "drift", &drift, 0.0, 1000.0)
        .Real("--psi", "share", &psi, 0.0, 1.0, /*lo_open=*/true)
        .WholeList("--contexts", "contexts", &contexts, 64, int64_t{1} << 24)
        .WholeList("--batches", "batches", &batches, 1, 1024)
        .RealList("--depths", "depths", &depths, 0.0, 1.0)
        .Choice("--backend", "backend", &backend, {"host", "cuda", "auto"})
        .String("--policy", "NAME", "policy", &policy)
        .OutputFile("--json", "rows", &json)
        .InputFile("--trace", "trace", &trace)
        .Switch("--no-dense", "no dense lane", &no_dense)
        .KeyReal("--param", "a parameter",
                 [this](const std::string& k, double v) { params.emplace_back(k, v); });
  }
  ParseResult Parse(std::vector<std::string> args) {
    std::vector<const char*> argv{"tool"};
    for (const std::string& a : args) argv.push_back(a.c_str());
    return parser.Parse(static_cast<int>(argv.size()), argv.data());
  }
  // The message of a refused command line ("" if it was accepted).
  std::string Error(std::vector<std::string> args) {
    const ParseResult r = Parse(std::move(args));
    EXPECT_EQ(r.kind, ParseResult::Kind::kError);
    return r.message;
  }
};

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kvferry_tools_cli_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

TEST(ToolsCliParser, AcceptsEveryKindOfValue) {
  Flags f;
  const ParseResult r = f.Parse({"--steps", "20", "--context=4096", "--query-drift", "0.25",
                                 "--psi", "1", "--contexts", "64,131072", "--batches", "2",
                                 "--depths", "0,1", "--backend", "cuda", "--policy", "lfps",
                                 "--no-dense", "--param", "r=0.5", "--param", "k=-3"});
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(f.steps, 20);
  EXPECT_EQ(f.context, 4096);
  EXPECT_DOUBLE_EQ(f.drift, 0.25);
  EXPECT_DOUBLE_EQ(f.psi, 1.0);
  EXPECT_EQ(f.contexts, (std::vector<int64_t>{64, 131072}));
  EXPECT_EQ(f.batches, std::vector<int>{2});
  EXPECT_EQ(f.depths, (std::vector<double>{0.0, 1.0}));
  EXPECT_EQ(f.backend, "cuda");
  EXPECT_EQ(f.policy, "lfps");
  EXPECT_TRUE(f.no_dense);
  ASSERT_EQ(f.params.size(), 2u);
  EXPECT_EQ(f.params[1].first, "k");
  EXPECT_DOUBLE_EQ(f.params[1].second, -3.0);
  EXPECT_TRUE(f.parser.given("--steps"));
  EXPECT_FALSE(f.parser.given("--json"));
  // The last of a repeated flag wins (kvferry-e2e's and kvferry-bench's scripts rely on it)...
  Flags g;
  ASSERT_TRUE(g.Parse({"--steps", "3", "--steps", "5"}).ok());
  EXPECT_EQ(g.steps, 5);
  // ...unless the tool refuses repeats (kvferry-llama); repeatable flags still repeat.
  Flags h;
  h.parser.set_allow_repeats(false);
  EXPECT_EQ(h.Error({"--steps", "3", "--steps", "5"}), "--steps given twice");
  EXPECT_TRUE(h.Parse({"--param", "a=1", "--param", "b=2"}).ok());
}

TEST(ToolsCliParser, BadValuesNameTheFlagTheValueAndTheRange) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--steps", "abc"}, "--steps abc: not a number (want a whole number in [1, 1000000])"},
      {{"--steps", "99999999999999999999"},
       "--steps 99999999999999999999: out of range (want a whole number in [1, 1000000])"},
      {{"--steps", "-5"}, "--steps -5: negative (want a whole number in [1, 1000000])"},
      {{"--steps", "-99999999999999999999"},
       "--steps -99999999999999999999: negative and out of range (want a whole number in [1, "
       "1000000])"},
      {{"--steps", "1.5"}, "--steps 1.5: not a whole number (want a whole number in [1, 1000000])"},
      {{"--steps", "0"}, "--steps 0: out of range (want a whole number in [1, 1000000])"},
      {{"--steps", ""}, "--steps '': not a number (want a whole number in [1, 1000000])"},
      {{"--steps", "12abc"}, "--steps 12abc: not a number (want a whole number in [1, 1000000])"},
      {{"--steps", "1e400"}, "--steps 1e400: out of range (want a whole number in [1, 1000000])"},
      {{"--context", "99999999999999999999"},
       "--context 99999999999999999999: out of range (want a whole number in [1, 16777216])"},
      {{"--query-drift", "nan"}, "--query-drift nan: not a finite number (want a number in [0, 1000])"},
      {{"--query-drift", "-1"}, "--query-drift -1: negative (want a number in [0, 1000])"},
      {{"--query-drift", "x"}, "--query-drift x: not a number (want a number in [0, 1000])"},
      {{"--psi", "0"}, "--psi 0: out of range (want a number in (0, 1])"},
      {{"--contexts", "-5"}, "--contexts -5: negative (want a whole number in [64, 16777216])"},
      {{"--contexts", "4096,abc"},
       "--contexts 4096,abc: item abc not a number (want a whole number in [64, 16777216])"},
      {{"--contexts", "4096,"}, "--contexts 4096,: empty item in the comma-separated list"},
      {{"--contexts", ""}, "--contexts '': empty list"},
      {{"--batches", "99999999999"},
       "--batches 99999999999: out of range (want a whole number in [1, 1024])"},
      {{"--depths", "0.5,1.5"}, "--depths 0.5,1.5: item 1.5 out of range (want a number in [0, 1])"},
      {{"--backend", "gpu"}, "--backend gpu: want host, cuda or auto"},
      {{"--param", "r"}, "--param r: want name=value"},
      {{"--param", "r=x"}, "--param r x: not a number (want a number in [-1e+300, 1e+300])"},
  };
  for (const Case& c : cases) {
    Flags f;
    EXPECT_EQ(f.Error(c.args), c.message) << c.args[0] << " " << c.args[1];
  }
  // A refused value leaves the default.
  Flags f;
  f.Error({"--steps", "abc"});
  EXPECT_EQ(f.steps, 16);
}

TEST(ToolsCliParser, UnknownFlagsMissingValuesAndStrayArguments) {
  Flags f;
  EXPECT_EQ(f.Error({"--frobnicate"}), "unknown option --frobnicate");
  EXPECT_EQ(f.Error({"--step", "3"}), "unknown option --step (did you mean --steps?)");
  EXPECT_EQ(f.Error({"--steps"}), "--steps needs a value");
  EXPECT_EQ(f.Error({"--policy", "--steps", "3"}), "--policy needs a value (got the flag --steps)");
  EXPECT_EQ(f.Error({"--no-dense=1"}), "--no-dense takes no value (got --no-dense=1)");
  EXPECT_EQ(f.Error({"stray"}), "unexpected argument stray (options start with --)");
  EXPECT_EQ(f.Error({"-x"}), "unknown option -x");
}

TEST(ToolsCliParser, HelpPrintsEveryFlagWithItsRangeAndDefault) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--help"}, {"-h"}, {"--steps", "3", "--help"}}) {
    Flags f;
    EXPECT_TRUE(f.Parse(args).help()) << args[0];
  }
  // A problem before --help is still a problem.
  Flags f;
  EXPECT_FALSE(f.Parse({"--steps", "x", "--help"}).ok());
  const std::string usage = f.parser.Usage();
  EXPECT_EQ(usage.rfind("usage: tool [options]\nWhat the tool does.\noptions:\n", 0), 0u) << usage;
  for (const char* want :
       {"--steps N", "decode steps (whole number in [1, 1000000]; default 16)",
        "--psi X", "(number in (0, 1]; default 0.5)", "--contexts N[,N...]",
        "(whole numbers in [64, 16777216]; default 32768)", "--batches N[,N...]", "default 1,4",
        "--backend host|cuda|auto", "--param NAME=VALUE", "repeatable", "-h, --help",
        "exit codes: 0 done, 1 the run failed or measured nothing, 2 usage error"}) {
    EXPECT_NE(usage.find(want), std::string::npos) << want << "\n" << usage;
  }
}

TEST(ToolsCliParser, OutputPathsAreCheckedBeforeAnyWork) {
  Flags f;
  EXPECT_EQ(f.Error({"--json", "/nonexistent/dir/rows.jsonl"}),
            "--json /nonexistent/dir/rows.jsonl: folder /nonexistent/dir does not exist");
  const std::string dir = std::filesystem::temp_directory_path().string();
  EXPECT_EQ(f.Error({"--json", dir}), "--json " + dir + ": is a folder, not a file");
  // Checked by opening it: a new file is not left behind, an existing one is not truncated.
  const std::string fresh = TempPath("fresh.json");
  Flags g;
  ASSERT_TRUE(g.Parse({"--json", fresh}).ok());
  EXPECT_EQ(g.json, fresh);
  EXPECT_FALSE(std::filesystem::exists(fresh));
  const std::string existing = TempPath("existing.json");
  { std::ofstream(existing) << "{\"row\":1}\n"; }
  ASSERT_TRUE(g.Parse({"--json", existing}).ok());
  EXPECT_EQ(std::filesystem::file_size(existing), 10u);
  // A file that cannot be written (unless this runs as root, which may write anyway).
  std::filesystem::permissions(existing, std::filesystem::perms::owner_read);
  if (::geteuid() != 0) {
    EXPECT_NE(g.Error({"--json", existing}).find(": cannot be written: "), std::string::npos);
  }
  std::filesystem::remove(existing);
  // Input files must open.
  EXPECT_EQ(f.Error({"--trace", "/nonexistent/t.safetensors"}),
            "--trace /nonexistent/t.safetensors: cannot open the file");
  // Low-level checks the tools share.
  EXPECT_EQ(WritableFileProblem(""), "empty path");
  EXPECT_EQ(ReadableFileProblem(dir), "is a folder, not a file");
}

TEST(ToolsCliParser, ParseAndReportPrintsAndReturnsTheExitCode) {
  const auto run = [](std::vector<std::string> args, std::string* out, std::string* err) {
    Flags f;
    std::vector<const char*> argv{"tool"};
    for (const std::string& a : args) argv.push_back(a.c_str());
    std::FILE* o = std::tmpfile();
    std::FILE* e = std::tmpfile();
    const int rc = f.parser.ParseAndReport(static_cast<int>(argv.size()), argv.data(), o, e);
    for (auto [file, text] : {std::pair{o, out}, std::pair{e, err}}) {
      std::fflush(file);
      std::rewind(file);
      text->clear();
      for (int c; (c = std::fgetc(file)) != EOF;) text->push_back(static_cast<char>(c));
      std::fclose(file);
    }
    return rc;
  };
  std::string out, err;
  EXPECT_EQ(run({"--help"}, &out, &err), kExitOk);
  EXPECT_EQ(out.rfind("usage: tool", 0), 0u);
  EXPECT_EQ(err, "");
  EXPECT_EQ(run({"--steps", "abc"}, &out, &err), kExitUsage);
  EXPECT_EQ(out, "");
  EXPECT_EQ(err,
            "tool: --steps abc: not a number (want a whole number in [1, 1000000])\n"
            "(tool --help lists the options)\n");
  EXPECT_EQ(run({"--steps", "3"}, &out, &err), -1);
  EXPECT_EQ(out + err, "");
}

TEST(ToolsCliParser, CudaDeviceProblemNamesWhatIsMissing) {
  const std::string problem = CudaDeviceProblem();
  if (problem.empty()) GTEST_SKIP() << "this machine has a CUDA device";
  EXPECT_EQ(problem.rfind("no CUDA device found", 0), 0u) << problem;
  EXPECT_EQ(problem.find("insufficient"), std::string::npos) << problem;
}

// ---- the tools, run as a user runs them ---------------------------------------------------------

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string all;  // stdout and stderr
};

// Runs \p bin with \p args (a shell word list) with CUDA_VISIBLE_DEVICES empty, so that "no CUDA
// device" is what every machine sees, GPU or not.
RunResult RunTool(const std::string& bin, const std::string& args, bool hide_gpus = true) {
  RunResult r;
  const std::string out_file = TempPath("stdout.txt");
  const std::string env = hide_gpus ? "CUDA_VISIBLE_DEVICES= " : "";
  const std::string cmd = env + bin + " " + args + " 2>&1 1>" + out_file + " | cat; exit ${PIPESTATUS[0]}";
  // Through bash: stderr captured by the pipe, stdout in a file, the tool's own exit code kept.
  const std::string shell = "bash -c '" + [&] {
    std::string q;
    for (char c : cmd) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q;
  }() + "'";
  FILE* p = ::popen(shell.c_str(), "r");
  if (p == nullptr) return r;
  std::string err;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) err.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(out_file);
  r.out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  std::filesystem::remove(out_file);
  r.all = r.out + err;
  return r;
}

struct ToolCase {
  std::string args;
  int exit_code;
  std::vector<std::string> says;  // in stdout + stderr
};

void ExpectCases(const std::string& bin, const std::vector<ToolCase>& cases) {
  for (const ToolCase& c : cases) {
    const RunResult r = RunTool(bin, c.args);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.args << ":\n" << r.all;
    for (const std::string& s : c.says) {
      EXPECT_NE(r.all.find(s), std::string::npos) << c.args << ": wants '" << s << "' in:\n" << r.all;
    }
    EXPECT_EQ(r.all.find("terminate called"), std::string::npos) << c.args << ":\n" << r.all;
    EXPECT_EQ(r.all.find("insufficient"), std::string::npos) << c.args << ":\n" << r.all;
  }
}

// The usage errors every tool answers alike: exit 2, the flag named, before any work.
std::vector<ToolCase> UsageCases(const std::string& tool, const std::string& int_flag,
                                 const std::string& range, const std::string& valid) {
  return {
      {int_flag + " abc " + valid, kExitUsage,
       {tool + ": " + int_flag + " abc: not a number (want a whole number in " + range + ")",
        "--help lists the options"}},
      {int_flag + " 99999999999999999999 " + valid, kExitUsage,
       {int_flag + " 99999999999999999999: out of range (want a whole number in " + range + ")"}},
      {int_flag + " -5 " + valid, kExitUsage, {int_flag + " -5: negative"}},
      {int_flag + " 1.5 " + valid, kExitUsage, {int_flag + " 1.5: not a whole number"}},
      {"--frobnicate " + valid, kExitUsage, {tool + ": unknown option --frobnicate"}},
      {"--json /nonexistent/dir/out.json " + valid, kExitUsage,
       {"--json /nonexistent/dir/out.json: folder /nonexistent/dir does not exist"}},
  };
}

void ExpectHelp(const std::string& bin, const std::string& tool,
                const std::vector<std::string>& flags) {
  for (const char* h : {"--help", "-h"}) {
    const RunResult r = RunTool(bin, h);
    EXPECT_EQ(r.exit_code, kExitOk) << r.all;
    EXPECT_EQ(r.out.rfind("usage: " + tool, 0), 0u) << "usage not on stdout:\n" << r.all;
    EXPECT_EQ(r.all.find("error:"), std::string::npos) << r.all;
    for (const std::string& f : flags) EXPECT_NE(r.out.find(f), std::string::npos) << f << "\n" << r.out;
  }
}

// A tool's path: the environment variable (a tool built elsewhere, e.g. kvferry-e2e of a CUDA
// tree against this test binary) or the path CMake gave at configure time ("" if not built).
std::string ToolPath(const char* env, const char* configured) {
  const char* e = std::getenv(env);
  return e != nullptr && *e != 0 ? std::string(e) : std::string(configured);
}
#if !defined(KVFERRY_E2E_BIN)
#define KVFERRY_E2E_BIN ""
#endif
#if !defined(KVFERRY_BENCH_BIN)
#define KVFERRY_BENCH_BIN ""
#endif
#if !defined(KVFERRY_EMBED_BIN)
#define KVFERRY_EMBED_BIN ""
#endif
const std::string kE2e = ToolPath("KVFERRY_E2E_BIN", KVFERRY_E2E_BIN);
const std::string kBench = ToolPath("KVFERRY_BENCH_BIN", KVFERRY_BENCH_BIN);
const std::string kEmbed = ToolPath("KVFERRY_EMBED_BIN", KVFERRY_EMBED_BIN);

bool Built(const std::string& bin) {
  std::error_code ec;
  return !bin.empty() && std::filesystem::exists(bin, ec);
}

TEST(ToolsCliE2e, HelpAndUsageErrors) {
  if (!Built(kE2e)) GTEST_SKIP() << "kvferry-e2e not built in this tree (it needs CUDA)";
  ExpectHelp(kE2e, "kvferry-e2e", {"--contexts N[,N...]", "[64, 16777216]", "--modes", "--json"});
  std::vector<ToolCase> cases = UsageCases("kvferry-e2e", "--steps", "[1, 1000000]", "");
  const std::vector<ToolCase> more = {
      {"--contexts abc", kExitUsage, {"--contexts abc: not a number"}},
      {"--contexts 99999999999999999999", kExitUsage, {"--contexts 99999999999999999999: out of range"}},
      {"--contexts -5", kExitUsage, {"--contexts -5: negative"}},
      {"--context 4096", kExitUsage, {"unknown option --context (did you mean --contexts?)"}},
      {"--modes nosuch", kExitUsage,
       {"--modes nosuch: unknown mode (want dense_cpu, dense_resident,", "prefill_lfps"}},
      {"--modes dense_resident,nosuch", kExitUsage, {"item nosuch unknown mode"}},
      {"--route cpu", kExitUsage, {"--route cpu: want gpu or auto"}},
      {"--modes prefill_dense --prefill-layers 1", kExitUsage, {"--prefill-layers 1: "}},
      {"--trace /nonexistent/dir/tr", kExitUsage, {"--trace /nonexistent/dir/tr: folder"}},
  };
  cases.insert(cases.end(), more.begin(), more.end());
  ExpectCases(kE2e, cases);
}

TEST(ToolsCliE2e, NoCudaDeviceIsAFailureThatSaysSo) {
  if (!Built(kE2e)) GTEST_SKIP() << "kvferry-e2e not built in this tree (it needs CUDA)";
  // Valid flags, every mode kind: nothing can be measured without a device (CUDA_VISIBLE_DEVICES
  // is empty here), and the tool says so once instead of writing "skipped" rows and exiting 0.
  const std::string json = TempPath("e2e.jsonl");
  const RunResult r = RunTool(kE2e, "--contexts 4096 --batches 1 --steps 1 --layers 2 "
                                    "--modes dense_resident,cis+quest_bank,prefill_lfps --json " +
                                        json);
  EXPECT_EQ(r.exit_code, kExitFailure) << r.all;
  EXPECT_NE(r.all.find("kvferry-e2e: no CUDA device found"), std::string::npos) << r.all;
  EXPECT_NE(r.all.find("nothing measured"), std::string::npos) << r.all;
  EXPECT_EQ(r.all.find("skipped"), std::string::npos) << r.all;
  EXPECT_EQ(r.all.find("insufficient"), std::string::npos) << r.all;
  std::error_code ec;
  EXPECT_TRUE(!std::filesystem::exists(json, ec) || std::filesystem::file_size(json) == 0);
  std::filesystem::remove(json, ec);
}

TEST(ToolsCliBench, HelpAndUsageErrors) {
  if (!Built(kBench)) GTEST_SKIP() << "kvferry-bench not built in this tree";
  ExpectHelp(kBench, "kvferry-bench", {"--context N", "--budget N|F", "--backend host|cuda|auto"});
  const RunResult help = RunTool(kBench, "--help");
  EXPECT_EQ(help.all.find("error: help"), std::string::npos) << help.all;
  std::vector<ToolCase> cases = UsageCases("kvferry-bench", "--steps", "[1, 1000000]", "");
  const std::vector<ToolCase> more = {
      {"--context 99999999999999999999", kExitUsage, {"--context 99999999999999999999: out of range"}},
      {"--context -5", kExitUsage, {"--context -5: negative"}},
      {"--budget 1.5", kExitUsage,
       {"--budget 1.5: not a whole number (want a whole number of tokens in [1, 16777216] or a "
        "fraction of the context in (0, 1))"}},
      {"--budget 0", kExitUsage, {"--budget 0: out of range"}},
      {"--budget -5", kExitUsage, {"--budget -5: negative"}},
      {"--steps 0", kExitUsage, {"--steps 0: out of range (want a whole number in [1, 1000000])"}},
      {"--batch 0", kExitUsage, {"--batch 0: out of range"}},
      {"--param r=x", kExitUsage, {"--param r x: not a number"}},
      {"--trace /nonexistent/t.safetensors", kExitUsage,
       {"--trace /nonexistent/t.safetensors: cannot open the file"}},
      {"--kv-dtype f32", kExitUsage, {"--kv-dtype f32: want bf16 or f16"}},
      {"--policy-weights /nonexistent/w.safetensors", kExitUsage,
       {"--policy-weights /nonexistent/w.safetensors: cannot open the file"}},
  };
  cases.insert(cases.end(), more.begin(), more.end());
  ExpectCases(kBench, cases);
  // The --json check comes before the run: nothing was prefilled.
  const RunResult r = RunTool(kBench, "--context 100000 --json /nonexistent/dir/out.json");
  EXPECT_EQ(r.exit_code, kExitUsage);
  EXPECT_EQ(r.all.find("prefilled"), std::string::npos) << r.all;
}

// --policy-weights reaches the policy: a file that is not a safetensors file is refused by kvpop's
// scorer at Create, naming the weights path, before anything is prefilled.
TEST(ToolsCliBench, PolicyWeightsReachThePolicy) {
  if (!Built(kBench)) GTEST_SKIP() << "kvferry-bench not built in this tree";
  const std::string w = TempPath("not_weights.safetensors");
  std::ofstream(w) << "not a safetensors file";
  const RunResult r = RunTool(kBench, "--policy kvpop --policy-weights " + w +
                                      " --context 300 --steps 2 --budget 96 --layers 2 --q-heads 4 "
                                      "--kv-heads 2 --head-dim 64 --backend host");
  EXPECT_EQ(r.exit_code, kExitFailure) << r.all;
  EXPECT_NE(r.all.find("weights_path"), std::string::npos) << r.all;
  EXPECT_EQ(r.all.find("prefilled"), std::string::npos) << r.all;
}

TEST(ToolsCliBench, BackendCudaWithoutADeviceSaysSo) {
  if (!Built(kBench)) GTEST_SKIP() << "kvferry-bench not built in this tree";
  const RunResult r = RunTool(kBench, "--backend cuda --context 256 --steps 2");
  EXPECT_EQ(r.exit_code, kExitFailure) << r.all;
  const bool no_device = r.all.find("--backend cuda: no CUDA device found") != std::string::npos;
  const bool no_build = r.all.find("--backend cuda: kvferry was built without CUDA") != std::string::npos;
  EXPECT_TRUE(no_device || no_build) << r.all;
  EXPECT_EQ(r.all.find("insufficient"), std::string::npos) << r.all;
  EXPECT_EQ(r.all.find("prefilled"), std::string::npos) << r.all;
}

TEST(ToolsCliBench, StatsCountThePrefillNextToItsTime) {
  if (!Built(kBench)) GTEST_SKIP() << "kvferry-bench not built in this tree";
  const std::string json = TempPath("bench.json");
  const RunResult r = RunTool(kBench, "--policy oracle --context 300 --steps 3 --budget 96 "
                                      "--layers 2 --q-heads 4 --kv-heads 2 --head-dim 64 "
                                      "--backend host --json " + json);
  ASSERT_EQ(r.exit_code, kExitOk) << r.all;
  std::ifstream in(json);
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // 300 tokens x 2 layers, in the stats object and beside prefill_s; decode counters are the
  // decode's (3 steps x 2 layers).
  const size_t stats = s.find("\"stats\":");
  ASSERT_NE(stats, std::string::npos) << s;
  EXPECT_NE(s.find("\"prefill_tokens\":600", stats), std::string::npos) << s;
  EXPECT_NE(s.find("\"decode_steps\":6", stats), std::string::npos) << s;
  EXPECT_NE(s.substr(0, stats).find("\"prefill_tokens\":600"), std::string::npos) << s;
  EXPECT_NE(s.find("\"budget\":96"), std::string::npos) << s;
  std::filesystem::remove(json);
}

TEST(ToolsCliEmbed, HelpUnknownFlagsAndARun) {
  if (!Built(kEmbed)) GTEST_SKIP() << "kvferry-embed not built in this tree";
  ExpectHelp(kEmbed, "kvferry-embed", {"--help"});
  ExpectCases(kEmbed, {{"--frobnicate", kExitUsage, {"kvferry-embed: unknown option --frobnicate"}},
                       {"stray", kExitUsage, {"unexpected argument stray"}}});
  const RunResult r = RunTool(kEmbed, "");
  EXPECT_EQ(r.exit_code, kExitOk) << r.all;
  EXPECT_NE(r.out.find("backend host, policy oracle"), std::string::npos) << r.all;
}

TEST(ToolsCliMainJob, HelpAndUsageErrorsBeforeAnyDownloadOrBuild) {
  const std::string script =
      (std::filesystem::path(KVFERRY_TEST_DATA_DIR) / ".." / ".." / "scripts" / "main-job.sh")
          .lexically_normal()
          .string();
  if (!std::filesystem::exists(script)) GTEST_SKIP() << script << " not found";
  // Each refused before step 1 (packages), so the test installs and builds nothing.
  const std::string bin = "bash " + script;
  for (const char* h : {"--help", "-h"}) {
    const RunResult r = RunTool(bin, h);
    EXPECT_EQ(r.exit_code, kExitOk) << r.all;
    EXPECT_NE(r.out.find("usage: "), std::string::npos) << r.all;
    EXPECT_NE(r.out.find("--context N"), std::string::npos) << r.all;
    EXPECT_EQ(r.all.find("needs a value"), std::string::npos) << r.all;
  }
  ExpectCases(bin, {
      // --context 4 used to fail on "--scored 0", a flag the user never passed.
      {"--context 4", kExitUsage,
       {"--context 4: out of range (want a whole number in [256, 1048576])", "--help lists"}},
      {"--context abc", kExitUsage, {"--context abc: not a whole number"}},
      {"--context 99999999999999999999", kExitUsage, {"--context 99999999999999999999: out of range"}},
      {"--budget -5", kExitUsage, {"--budget -5: negative"}},
      {"--window 1.5", kExitUsage, {"--window 1.5: not a whole number"}},
      {"--backend gpu", kExitUsage, {"--backend gpu: want host, cuda or auto"}},
      {"--frobnicate", kExitUsage, {"unknown option --frobnicate"}},
      {"--context", kExitUsage, {"--context needs a value"}},
  });
  for (const char* bad : {"--context 4", "--frobnicate"}) {
    const RunResult r = RunTool(bin, bad);
    EXPECT_EQ(r.all.find("[main-job]"), std::string::npos) << "work started:\n" << r.all;
    EXPECT_EQ(r.all.find("--scored"), std::string::npos) << r.all;
  }
}

}  // namespace
}  // namespace kvferry::tools
