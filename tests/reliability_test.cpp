// Copyright kvferry authors. Apache-2.0.
// Reliability of the runtime (docs/reliability.md, "Faults, concurrency,
// capacity, soak"):
//   * injected device faults (tests/fault_device.h): every allocation, copy,
//   launch and event of
//     a call failing, before or after doing its work; the call returns a clear
//     Status and every sequence is as before it, which is checked by running a
//     twin runtime that never saw the fault through the same calls and
//     comparing every later output exactly;
//   * calls from several threads (the contract on Runtime);
//   * capacity edges;
//   * a short soak (tests/soak.h; kvferry_soak runs the long one).
// Each test runs on the host backend, and again on CUDA where a GPU is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fault_device.h"
#include "kvferry/kvferry.h"
#include "soak.h"

namespace kvferry {
namespace {

using testing::FaultInjector;
using testing::FaultMode;
using testing::FaultPoint;
using testing::FaultPointName;
using testing::ScopedFaults;

constexpr int kLayers = 2, kKvHeads = 2, kGroup = 2, kHeadDim = 64;

// A small runtime: rings of 16 tokens behind 4 sinks, so that the test contexts
// (20 to 60 tokens) have offloaded rows and every append evicts a ring row.
RuntimeConfig SmallConfig(const std::string &policy, Route route, int bank_slots, Backend backend) {
  RuntimeConfig c;
  c.model.num_layers = kLayers;
  c.model.num_kv_heads = kKvHeads;
  c.model.num_q_heads = kKvHeads * kGroup;
  c.model.head_dim = kHeadDim;
  c.capacity.max_sequences = 4;
  c.capacity.max_batch = 3;
  c.capacity.max_tokens_per_sequence = 1024;
  c.capacity.max_prefill_chunk = 64;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 16;
  c.tiers.bank_slots = bank_slots;
  c.policy.name = policy;
  c.policy.budget_tokens = 24;
  c.route = route;
  c.backend = backend;
  c.cpu_threads = 2;
  // Twins must split work between the routes alike: no measured (run-to-run)
  // rates.
  c.probe_at_start = false;
  return c;
}

// A macro: GTEST_SKIP returns from the test body only when written in it.
#define SKIP_WITHOUT_BACKEND(b) \
  if ((b) == Backend::kCuda && !CudaAvailable()) GTEST_SKIP() << "no CUDA GPU"

// Deterministic inputs: call i's tensors depend on i only, so twins get the
// same data.
std::vector<float> Inputs(uint32_t seed, int64_t count) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(count));
  for (float &e : x) e = normal(rng);
  return x;
}

TensorView View(std::vector<float> &x, int64_t rows, int heads) {
  return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, kHeadDim});
}

constexpr int kHq = kKvHeads * kGroup;

Status DecodeCall(Runtime &rt, const std::vector<SequenceId> &seqs, int layer, uint32_t seed,
                  std::vector<float> &out) {
  const auto b = static_cast<int64_t>(seqs.size());
  auto q = Inputs(seed, b * kHq * kHeadDim), k = Inputs(seed + 1, b * kKvHeads * kHeadDim),
       v = Inputs(seed + 2, b * kKvHeads * kHeadDim);
  out.assign(q.size(), 0.0f);
  return rt.Decode(seqs, layer, View(q, b, kHq), View(k, b, kKvHeads), View(v, b, kKvHeads),
                   View(out, b, kHq));
}

Status PrefillCall(Runtime &rt, SequenceId seq, int layer, int64_t tokens, uint32_t seed,
                   std::vector<float> &out) {
  auto q = Inputs(seed, tokens * kHq * kHeadDim),
       k = Inputs(seed + 1, tokens * kKvHeads * kHeadDim),
       v = Inputs(seed + 2, tokens * kKvHeads * kHeadDim);
  out.assign(q.size(), 0.0f);
  return rt.Prefill(seq, layer, View(q, tokens, kHq), View(k, tokens, kKvHeads),
                    View(v, tokens, kKvHeads), View(out, tokens, kHq));
}

Status AppendCall(Runtime &rt, SequenceId seq, int layer, int64_t tokens, uint32_t seed) {
  auto k = Inputs(seed + 1, tokens * kKvHeads * kHeadDim),
       v = Inputs(seed + 2, tokens * kKvHeads * kHeadDim);
  return rt.Append(seq, layer, View(k, tokens, kKvHeads), View(v, tokens, kKvHeads));
}

// Prefills `tokens` at every layer in chunks of at most 20.
void PrefillAll(Runtime &rt, SequenceId seq, int64_t tokens, uint32_t seed) {
  std::vector<float> out;
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int64_t t0 = 0; t0 < tokens; t0 += 20) {
      const Status st = PrefillCall(rt, seq, layer, std::min<int64_t>(20, tokens - t0),
                                    seed + static_cast<uint32_t>(100 * layer + t0), out);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }
}

double Norm(const std::vector<float> &x) {
  double s = 0;
  for (float e : x) s += static_cast<double>(e) * e;
  return std::sqrt(s);
}

// Exact equality (bit for bit) of two outputs, or within a relative error of
// `tol` when > 0.
::testing::AssertionResult SameOutput(const std::vector<float> &a, const std::vector<float> &b,
                                      double tol) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  if (Norm(a) == 0.0) return ::testing::AssertionFailure() << "output is all zero";
  if (tol == 0.0) {
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
        return ::testing::AssertionFailure()
               << "first mismatch at " << i << ": " << a[i] << " vs " << b[i];
      }
    }
    return ::testing::AssertionSuccess();
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  if (std::sqrt(num / den) > tol) {
    return ::testing::AssertionFailure() << "relative error " << std::sqrt(num / den);
  }
  return ::testing::AssertionSuccess();
}

// ---- injected faults during a call
// --------------------------------------------------------------

// One runtime call of a script, on some runtime; writes its output (if any) to
// `out`.
struct Call {
  std::string what;
  std::function<Status(Runtime &, std::vector<float> &)> run;
};

std::vector<Call> DecodeSteps(const std::vector<SequenceId> &seqs, int steps, uint32_t seed) {
  std::vector<Call> calls;
  for (int s = 0; s < steps; ++s) {
    for (int layer = 0; layer < kLayers; ++layer) {
      const uint32_t sd = seed + static_cast<uint32_t>(10 * s + layer) * 7;
      calls.push_back({"decode layer " + std::to_string(layer),
                       [seqs, layer, sd](Runtime &rt, std::vector<float> &out) {
                         return DecodeCall(rt, seqs, layer, sd, out);
                       }});
    }
  }
  return calls;
}

// The calls that get the fault, by kind.
std::vector<Call> TargetCalls(const std::string &kind) {
  std::vector<Call> calls;
  if (kind == "decode") {
    calls = DecodeSteps({1, 2}, 1, 500);
  } else if (kind == "plan") {
    calls.push_back({"plan", [](Runtime &rt, std::vector<float> &out) {
                       out.clear();
                       const std::vector<SequenceId> seqs = {1, 2};
                       return rt.PlanDecode(seqs);
                     }});
    for (Call &c : DecodeSteps({1, 2}, 1, 600)) calls.push_back(std::move(c));
  } else {
    // A second chunk of sequence 3 (21 tokens so far): longer than the ring, so
    // its rows pass through every ring row of the sequence.
    for (int layer = 0; layer < kLayers; ++layer) {
      const uint32_t sd = 700 + 10 * layer;
      if (kind == "prefill") {
        calls.push_back({"prefill layer " + std::to_string(layer),
                         [layer, sd](Runtime &rt, std::vector<float> &out) {
                           return PrefillCall(rt, 3, layer, 23, sd, out);
                         }});
      } else {
        calls.push_back({"append layer " + std::to_string(layer),
                         [layer, sd](Runtime &rt, std::vector<float> &out) {
                           out.clear();
                           return AppendCall(rt, 3, layer, 23, sd);
                         }});
      }
    }
  }
  return calls;
}

struct ScriptResult {
  int64_t fired = 0;           // faults injected during the target calls
  int failed_targets = 0;      // target calls that returned an error
  bool degraded = false;       // a fault fired and the call still succeeded (bank admission)
  std::vector<Status> errors;  // what the failed calls returned
};

using FaultParam = std::tuple<std::string, Route, int, std::string, FaultMode, Backend>;

class FaultMatrix : public ::testing::TestWithParam<FaultParam> {};

// Runs setup, two decode steps, the target calls with `point`'s `nth` call
// failing on runtime A (B skips the calls A failed), then three decode steps of
// every sequence, comparing every output both produced and every length after
// every call.
ScriptResult RunScript(const RuntimeConfig &config, const std::string &kind, FaultPoint point,
                       int64_t nth, FaultMode mode) {
  ScriptResult result;
  auto rb = Runtime::Create(config);  // the twin, on the plain device
  EXPECT_TRUE(rb.ok()) << rb.status().ToString();
  if (!rb.ok()) return result;
  ScopedFaults scope;
  auto ra = Runtime::Create(config);
  EXPECT_TRUE(ra.ok()) << ra.status().ToString();
  if (!ra.ok()) return result;
  Runtime &a = *ra.value();
  Runtime &b = *rb.value();
  for (Runtime *rt : {&a, &b}) {
    for (SequenceId s : {1, 2, 3}) EXPECT_TRUE(rt->AddSequence(s).ok());
    PrefillAll(*rt, 1, 37, 11);
    PrefillAll(*rt, 2, 29, 22);
    PrefillAll(*rt, 3, 21, 33);
  }
  std::vector<Call> before = DecodeSteps({1, 2}, 2, 100);
  std::vector<Call> target = TargetCalls(kind);
  std::vector<Call> after = DecodeSteps({1, 2}, 3, 200);
  for (Call &c : DecodeSteps({3}, 3, 300)) after.push_back(std::move(c));

  double tol = 0.0;
  // A planned layer that failed on A is rolled back there, while on B, which
  // skipped the call, the plan still counts its token until B's next Decode of
  // that layer: lengths agree again after the first step of `after`.
  int unsettled_calls = 0;
  auto check_lengths = [&](const std::string &where) {
    if (unsettled_calls > 0) {
      --unsettled_calls;
      return;
    }
    for (SequenceId s : {1, 2, 3}) {
      for (int layer = 0; layer < kLayers; ++layer) {
        auto la = a.SequenceLength(s, layer), lb = b.SequenceLength(s, layer);
        ASSERT_TRUE(la.ok() && lb.ok());
        EXPECT_EQ(la.value(), lb.value())
            << "sequence " << s << " layer " << layer << " after " << where;
      }
    }
  };
  auto run_both = [&](const Call &c, bool armed) {
    std::vector<float> out_a, out_b;
    const int64_t fired_before = scope.faults().fired();
    const Status sa = c.run(a, out_a);
    const bool fired = scope.faults().fired() > fired_before;
    if (armed) {
      result.fired += fired ? 1 : 0;
      if (!sa.ok()) {
        ++result.failed_targets;
        result.errors.push_back(sa);
      } else if (fired) {
        result.degraded = true;
      }
    }
    if (!sa.ok()) {
      EXPECT_TRUE(armed && fired) << c.what << " failed with no fault injected: " << sa.ToString();
      if (kind == "plan" && c.what != "plan") unsettled_calls = 1 + kLayers + kLayers;
      check_lengths(c.what + " (failed on A, skipped on B)");
      return;
    }
    const Status sb = c.run(b, out_b);
    ASSERT_TRUE(sb.ok()) << c.what << " on the twin: " << sb.ToString();
    if (!out_a.empty()) EXPECT_TRUE(SameOutput(out_a, out_b, tol)) << c.what;
    check_lengths(c.what);
    // After a degraded call (the bank lost a batch of admissions), rows come
    // from other places than in the twin, so sums run in another order: equal
    // to within fp32 rounding, not bits.
    if (result.degraded) tol = 1e-5;
  };
  for (const Call &c : before) run_both(c, false);
  scope.faults().FailNth(point, nth, mode);
  for (const Call &c : target) run_both(c, true);
  scope.faults().Disarm();
  for (const Call &c : after) run_both(c, false);
  return result;
}

TEST_P(FaultMatrix, FailedCallsChangeNothing) {
  const auto &[param_policy, route, bank, kind, mode, backend] = GetParam();
  SKIP_WITHOUT_BACKEND(backend);
  const size_t plus = param_policy.find("+split");
  const std::string policy = param_policy.substr(0, plus);
  RuntimeConfig config = SmallConfig(policy, route, bank, backend);
  // "X+split": policy X with every planned layer's misses split half and half between the device
  // and the CPU (RuntimeConfig::split_share; the scheduler's split, route auto).
  if (plus != std::string::npos) config.split_share = 0.5;
  int64_t total_fired = 0;
  std::string failed_at,
      degraded_at;  // "CopyRows x3": calls that failed the target, or degraded
  for (int p = static_cast<int>(FaultPoint::kRecordEvent); p < static_cast<int>(FaultPoint::kCount);
       ++p) {
    const auto point = static_cast<FaultPoint>(p);
    // Every call of the point inside the target calls, in turn, until the Nth
    // is past them.
    int64_t failed = 0, degraded = 0;
    for (int64_t nth = 1; nth < 64; ++nth) {
      SCOPED_TRACE(::testing::Message() << FaultPointName(point) << " call " << nth);
      const ScriptResult r = RunScript(config, kind, point, nth, mode);
      if (::testing::Test::HasFatalFailure()) return;
      if (r.fired == 0) break;
      total_fired += r.fired;
      if (r.degraded) {
        // Only the bank's admission may absorb a fault: its step's output
        // stands.
        EXPECT_GT(bank, 0);
        EXPECT_TRUE(point == FaultPoint::kCopyRows || point == FaultPoint::kRecordEvent ||
                    point == FaultPoint::kWaitEvent || point == FaultPoint::kSynchronizeEvent);
        ++degraded;
        continue;
      }
      ++failed;
      ASSERT_EQ(r.failed_targets, 1);
      const Status &st = r.errors[0];
      EXPECT_EQ(st.code(), StatusCode::kDeviceError) << st.ToString();
      EXPECT_NE(st.message().find(std::string("injected: ") + FaultPointName(point)),
                std::string::npos)
          << st.ToString();
      EXPECT_EQ(st.message().find("unspecified state"), std::string::npos) << st.ToString();
    }
    if (failed > 0)
      failed_at += std::string(" ") + FaultPointName(point) + " x" + std::to_string(failed);
    if (degraded > 0) {
      degraded_at += std::string(" ") + FaultPointName(point) + " x" + std::to_string(degraded);
    }
  }
  EXPECT_GT(total_fired, 0) << "no fault reached the target calls";
  std::printf("[ info ] failed the call:%s; absorbed (bank admission):%s\n", failed_at.c_str(),
              degraded_at.empty() ? " none" : degraded_at.c_str());
}

std::string FaultName(const ::testing::TestParamInfo<FaultParam> &info) {
  const auto &[param_policy, route, bank, kind, mode, backend] = info.param;
  std::string policy = param_policy;
  std::replace(policy.begin(), policy.end(), '+', '_');
  return policy + "_" + RouteName(route) + (bank > 0 ? "_bank" : "") + "_" + kind + "_" +
         (mode == FaultMode::kBefore ? "before" : "after") + "_" + BackendName(backend);
}

INSTANTIATE_TEST_SUITE_P(
    Faults, FaultMatrix,
    ::testing::Combine(::testing::Values("streaming"), ::testing::Values(Route::kAuto),
                       ::testing::Values(0),
                       ::testing::Values("decode", "plan", "prefill", "append"),
                       ::testing::Values(FaultMode::kBefore, FaultMode::kAfter),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    FaultName);
INSTANTIATE_TEST_SUITE_P(
    FaultsOracle, FaultMatrix,
    ::testing::Combine(::testing::Values("oracle"), ::testing::Values(Route::kAuto, Route::kCpu),
                       ::testing::Values(0), ::testing::Values("decode", "plan", "prefill"),
                       ::testing::Values(FaultMode::kBefore, FaultMode::kAfter),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    FaultName);
INSTANTIATE_TEST_SUITE_P(
    FaultsDense, FaultMatrix,
    ::testing::Combine(::testing::Values("dense"), ::testing::Values(Route::kCpu),
                       ::testing::Values(0), ::testing::Values("decode", "prefill"),
                       ::testing::Values(FaultMode::kBefore, FaultMode::kAfter),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    FaultName);
// KVpop selected on the device: a failed step after its selection kernel ran has already taken
// the newcomer into the slots; that admission is idempotent (the same token, the same score), so
// the retried step and the twin that skipped the call keep the same slots.
INSTANTIATE_TEST_SUITE_P(
    FaultsKvpop, FaultMatrix,
    ::testing::Combine(::testing::Values("kvpop"), ::testing::Values(Route::kGpu),
                       ::testing::Values(0, 256), ::testing::Values("decode", "prefill"),
                       ::testing::Values(FaultMode::kBefore, FaultMode::kAfter),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    FaultName);
// The scheduler's split (route auto, a device selection without a bank): a fault in the q copy,
// the split, the step, the device's wait or the merge fails the call, whose CPU share is then
// collected and the layer rolled back.
INSTANTIATE_TEST_SUITE_P(
    FaultsSplit, FaultMatrix,
    ::testing::Combine(::testing::Values("oracle+split", "quest+split"), ::testing::Values(Route::kAuto),
                       ::testing::Values(0), ::testing::Values("decode", "plan"),
                       ::testing::Values(FaultMode::kBefore, FaultMode::kAfter),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    FaultName);
// Cross-layer sharing with the device bank (xl+): on CUDA each planned layer whose next layer
// takes its list prefetches that layer's misses beside its step (PrefetchListRows on the
// admissions' stream); a fault there, or in its events, fails the call like any of the step's.
INSTANTIATE_TEST_SUITE_P(
    FaultsXlPrefetch, FaultMatrix,
    ::testing::Combine(::testing::Values("xl+oracle"), ::testing::Values(Route::kGpu),
                       ::testing::Values(256), ::testing::Values("decode", "plan"),
                       ::testing::Values(FaultMode::kBefore, FaultMode::kAfter),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    FaultName);
// With a bank large enough never to evict, twins that admit alike hold the same
// rows.
INSTANTIATE_TEST_SUITE_P(
    FaultsBank, FaultMatrix,
    ::testing::Combine(::testing::Values("oracle"), ::testing::Values(Route::kGpu),
                       ::testing::Values(256), ::testing::Values("decode", "prefill"),
                       ::testing::Values(FaultMode::kBefore, FaultMode::kAfter),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    FaultName);

// A policy that selects on the host (streaming's Select here) with a bank on route gpu: on CUDA
// the planned step with the host's lists and the device bank (every fault of the list upload,
// the step and the q copy fails the call and rolls it back), on the host backend the host path
// with the host-managed bank.
INSTANTIATE_TEST_SUITE_P(
    FaultsHostListBank, FaultMatrix,
    ::testing::Combine(::testing::Values("streaming"), ::testing::Values(Route::kGpu),
                       ::testing::Values(256), ::testing::Values("decode", "plan"),
                       ::testing::Values(FaultMode::kBefore, FaultMode::kAfter),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    FaultName);

// ---- allocation failures
// ----------------------------------------------------------------------

class AllocFaults : public ::testing::TestWithParam<Backend> {};

// Every allocation, stream and event Create makes fails in turn: Create returns
// the error and frees what it had (LeakSanitizer checks that in CI), and the
// next Create works.
TEST_P(AllocFaults, CreateFailsCleanlyAtEveryAllocation) {
  SKIP_WITHOUT_BACKEND(GetParam());
  for (const RuntimeConfig &config : {SmallConfig("streaming", Route::kAuto, 0, GetParam()),
                                      SmallConfig("oracle", Route::kGpu, 64, GetParam())}) {
    for (FaultPoint point : {FaultPoint::kAllocDevice, FaultPoint::kAllocHost,
                             FaultPoint::kCreateEvent, FaultPoint::kCreateStream}) {
      int64_t fired = 0;
      for (int64_t nth = 1; nth < 1000; ++nth) {
        ScopedFaults scope;
        scope.faults().FailNth(point, nth);
        auto r = Runtime::Create(config);
        if (scope.faults().fired() == 0) {
          EXPECT_TRUE(r.ok()) << r.status().ToString();
          break;
        }
        ++fired;
        ASSERT_FALSE(r.ok()) << FaultPointName(point) << " " << nth;
        const bool memory = point == FaultPoint::kAllocDevice || point == FaultPoint::kAllocHost;
        EXPECT_EQ(r.status().code(),
                  memory ? StatusCode::kResourceExhausted : StatusCode::kDeviceError)
            << r.status().ToString();
        EXPECT_NE(r.status().message().find("injected"), std::string::npos);
      }
      if (point == FaultPoint::kAllocDevice || point == FaultPoint::kAllocHost ||
          point == FaultPoint::kCreateEvent) {
        EXPECT_GT(fired, 0) << FaultPointName(point) << " " << config.policy.name;
      }
      // The host-managed bank admits on a side stream; on CUDA oracle selects on the device and
      // its bank lives inside the step (admitted on the runtime's stream: no stream of its own).
      if (point == FaultPoint::kCreateStream && config.tiers.bank_slots > 0 &&
          GetParam() == Backend::kHost) {
        EXPECT_GT(fired, 0) << "the bank's side stream";
      }
    }
  }
}

// Device memory is taken at Create only: nothing a sequence does later
// allocates on the device, so no call can fail for device memory after Create.
// (Host-store pages are the only later allocation: see
// HostStoreGrowthFailureChangesNothing.)
TEST_P(AllocFaults, NoDeviceAllocationAfterCreate) {
  SKIP_WITHOUT_BACKEND(GetParam());
  for (const RuntimeConfig &config : {SmallConfig("streaming", Route::kAuto, 0, GetParam()),
                                      SmallConfig("oracle", Route::kCpu, 0, GetParam()),
                                      SmallConfig("oracle", Route::kGpu, 64, GetParam())}) {
    ScopedFaults scope;
    auto r = Runtime::Create(config);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    Runtime &rt = *r.value();
    const int64_t device_allocs = scope.faults().calls(FaultPoint::kAllocDevice);
    const int64_t device_bytes = rt.GetStats().device_bytes_reserved;
    EXPECT_GT(device_allocs, 0);
    for (int round = 0; round < 3; ++round) {
      for (SequenceId s : {1, 2, 3}) ASSERT_TRUE(rt.AddSequence(s).ok());
      PrefillAll(rt, 1, 300, 1);
      PrefillAll(rt, 2, 40, 2);
      PrefillAll(rt, 3, 5, 3);
      std::vector<float> out;
      for (int step = 0; step < 20; ++step) {
        for (int layer = 0; layer < kLayers; ++layer) {
          ASSERT_TRUE(DecodeCall(rt, {1, 2, 3}, layer, 9 + step, out).ok());
        }
      }
      for (SequenceId s : {1, 2, 3}) ASSERT_TRUE(rt.RemoveSequence(s).ok());
    }
    EXPECT_EQ(scope.faults().calls(FaultPoint::kAllocDevice), device_allocs) << config.policy.name;
    EXPECT_EQ(rt.GetStats().device_bytes_reserved, device_bytes);
  }
}

// The host store takes pages as sequences grow: a page allocation that fails is
// kResourceExhausted, the call changes nothing, the other sequences keep every
// token, and the same call succeeds once memory is back (the store grows past
// host_bytes_at_create).
TEST_P(AllocFaults, HostStoreGrowthFailureChangesNothing) {
  SKIP_WITHOUT_BACKEND(GetParam());
  for (const auto &[policy, route] : {std::pair<std::string, Route>{"streaming", Route::kAuto},
                                      {"oracle", Route::kCpu},
                                      {"dense", Route::kCpu}}) {
    SCOPED_TRACE(policy + " " + RouteName(route));
    RuntimeConfig config = SmallConfig(policy, route, 0, GetParam());
    // Pages of 256 tokens, one per (layer, KV head): 8 pages hold sequences 1
    // and 2 (<= 256 tokens) at every layer and head, and nothing else.
    const int64_t page_bytes = int64_t{2} * 256 * kHeadDim * 2;
    config.capacity.host_bytes_at_create = 8 * page_bytes;
    auto rb = Runtime::Create(config);  // the twin, on the plain device
    ScopedFaults scope;
    auto ra = Runtime::Create(config);
    ASSERT_TRUE(ra.ok() && rb.ok());
    Runtime &a = *ra.value();
    Runtime &b = *rb.value();
    for (Runtime *rt : {&a, &b}) {
      for (SequenceId s : {1, 2, 3}) ASSERT_TRUE(rt->AddSequence(s).ok());
      PrefillAll(*rt, 1, 200, 1);
      PrefillAll(*rt, 2, 256,
                 2);  // its next token needs a new page at every (layer, head)
    }
    const int64_t reserved = a.GetStats().host_bytes_reserved;
    std::vector<float> out_a, out_b;
    // Decode: sequence 2 needs a page, the store must grow, the allocation
    // fails.
    scope.faults().FailNth(FaultPoint::kAllocHost, 1);
    Status st = DecodeCall(a, {1, 2}, 0, 5, out_a);
    EXPECT_EQ(scope.faults().fired(), 1);
    EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
    EXPECT_NE(st.message().find("injected: AllocHost of"), std::string::npos) << st.ToString();
    EXPECT_EQ(a.SequenceLength(1, 0).value(), 200);
    EXPECT_EQ(a.SequenceLength(2, 0).value(), 256);
    EXPECT_EQ(a.GetStats().host_bytes_reserved, reserved);
    // Prefill of a new sequence: same.
    scope.faults().FailNth(FaultPoint::kAllocHost, 1);
    st = PrefillCall(a, 3, 0, 30, 6, out_a);
    EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
    EXPECT_EQ(a.SequenceLength(3, 0).value(), 0);
    // Memory is back: the same calls work and match the twin that never failed.
    for (int step = 0; step < 3; ++step) {
      for (int layer = 0; layer < kLayers; ++layer) {
        ASSERT_TRUE(DecodeCall(a, {1, 2}, layer, 40 + step * 2 + layer, out_a).ok());
        ASSERT_TRUE(DecodeCall(b, {1, 2}, layer, 40 + step * 2 + layer, out_b).ok());
        EXPECT_TRUE(SameOutput(out_a, out_b, 0.0)) << "step " << step << " layer " << layer;
      }
    }
    for (int layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(PrefillCall(a, 3, layer, 30, 60 + layer, out_a).ok());
      ASSERT_TRUE(PrefillCall(b, 3, layer, 30, 60 + layer, out_b).ok());
      EXPECT_TRUE(SameOutput(out_a, out_b, 0.0));
    }
    EXPECT_GT(a.GetStats().host_bytes_reserved, reserved) << "grew past host_bytes_at_create";
    EXPECT_EQ(a.SequenceLength(2, 1).value(), 259);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, AllocFaults, ::testing::Values(Backend::kHost, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend> &info) {
                           return std::string(BackendName(info.param));
                         });

// ---- the token bank
// ---------------------------------------------------------------------------

// The bank is allocated at Create and never grows. When it cannot take rows,
// decode goes on from the host store: a one-slot bank (almost every row a miss)
// and a bank whose admission copies fail give the outputs of a runtime without
// a bank.
TEST(BankDegradation, FullOrFailingBankLosesNoToken) {
  for (Backend backend : {Backend::kHost, Backend::kCuda}) {
    if (backend == Backend::kCuda && !CudaAvailable()) continue;
    for (const char *how : {"one slot", "admission fails"}) {
      // On CUDA oracle's bank is the device bank inside the step: its admission is a kernel, not
      // the host bank's copies, so there is no copy to fail (FaultMatrix fails the step's calls).
      if (backend == Backend::kCuda && std::string(how) == "admission fails") continue;
      SCOPED_TRACE(std::string(how) + " " + BackendName(backend));
      RuntimeConfig with_bank =
          SmallConfig("oracle", Route::kGpu, std::string(how) == "one slot" ? 1 : 64, backend);
      RuntimeConfig without = SmallConfig("oracle", Route::kGpu, 0, backend);
      auto rb = Runtime::Create(without);
      ScopedFaults scope;
      auto ra = Runtime::Create(with_bank);
      ASSERT_TRUE(ra.ok() && rb.ok());
      Runtime &a = *ra.value();
      Runtime &b = *rb.value();
      for (Runtime *rt : {&a, &b}) {
        for (SequenceId s : {1, 2}) ASSERT_TRUE(rt->AddSequence(s).ok());
        PrefillAll(*rt, 1, 120, 1);
        PrefillAll(*rt, 2, 60, 2);
      }
      std::vector<float> out_a, out_b;
      int64_t admit_failures = 0;
      for (int step = 0; step < 8; ++step) {
        for (int layer = 0; layer < kLayers; ++layer) {
          // Every admission copy fails: after the step's q, k and v
          // conversions, the fourth CopyRows of a host-selection step is the
          // bank's.
          if (std::string(how) == "admission fails")
            scope.faults().FailNth(FaultPoint::kCopyRows, 4);
          const Status st = DecodeCall(a, {1, 2}, layer, 80 + 2 * step + layer, out_a);
          ASSERT_TRUE(st.ok()) << st.ToString();
          scope.faults().Disarm();
          ASSERT_TRUE(DecodeCall(b, {1, 2}, layer, 80 + 2 * step + layer, out_b).ok());
          EXPECT_TRUE(SameOutput(out_a, out_b, 1e-5)) << "step " << step << " layer " << layer;
        }
      }
      for (SequenceId s : {1, 2}) {
        EXPECT_EQ(a.SequenceLength(s, 1).value(), b.SequenceLength(s, 1).value());
      }
      const Stats sa = a.GetStats();
      admit_failures = sa.bank_admit_failures;
      if (std::string(how) == "admission fails") {
        EXPECT_EQ(admit_failures, 16);
        EXPECT_EQ(sa.bank_admitted, 0);
        EXPECT_EQ(sa.rows_bank_hit, 0);
      } else {
        EXPECT_EQ(admit_failures, 0);
        EXPECT_GT(sa.bank_evicted, 0) << "the one slot is recycled";
      }
      EXPECT_GT(sa.rows_fetched, 0);
      EXPECT_EQ(sa.rows_selected,
                sa.rows_resident + sa.rows_bank_hit + sa.rows_fetched + sa.rows_cpu);
    }
  }
}

// ---- capacity edges
// ---------------------------------------------------------------------------
// Covered in runtime_test.cpp: AddSequence past max_sequences
// (BadInput.ErrorsLeaveOtherSequencesIntact: kResourceExhausted, the live
// sequence decodes on), a prefill past max_tokens_per_sequence (same test),
// decode of a sequence never prefilled (same test: kFailedPrecondition "decode
// before prefill"), decode on a one-token context
// (MultiSequence.BatchedDecodeWithChurnMatchesReference prefills sequence 10
// with 1 token, then decodes it against the reference), and the host-store byte
// limit (BadInput.HostStoreLimitIsResourceExhausted). Growth past
// host_bytes_at_create: AllocFaults.HostStoreGrowthFailureChangesNothing.

class CapacityEdges : public ::testing::TestWithParam<std::tuple<std::string, Route, Backend>> {};

// A sequence at max_tokens_per_sequence: one more decode fails with
// kResourceExhausted for the whole batch, nothing changes, and the others
// decode on as in a twin that never tried.
TEST_P(CapacityEdges, DecodePastMaxTokensFailsWholeBatch) {
  const auto &[policy, route, backend] = GetParam();
  SKIP_WITHOUT_BACKEND(backend);
  RuntimeConfig config = SmallConfig(policy, route, 0, backend);
  config.capacity.max_tokens_per_sequence = 41;
  auto ra = Runtime::Create(config), rb = Runtime::Create(config);
  ASSERT_TRUE(ra.ok() && rb.ok());
  Runtime &a = *ra.value();
  Runtime &b = *rb.value();
  std::vector<float> out_a, out_b;
  for (Runtime *rt : {&a, &b}) {
    for (SequenceId s : {1, 2}) ASSERT_TRUE(rt->AddSequence(s).ok());
    PrefillAll(*rt, 1, 40, 1);
    PrefillAll(*rt, 2, 20, 2);
    for (int layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(DecodeCall(*rt, {1, 2}, layer, 7 + layer, out_a).ok());  // 1 is now full
    }
  }
  const Status st = DecodeCall(a, {2, 1}, 0, 9, out_a);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_NE(st.message().find("sequence 1 is full at layer 0 (max_tokens_per_sequence 41)"),
            std::string::npos)
      << st.ToString();
  EXPECT_EQ(a.SequenceLength(1, 0).value(), 41);
  EXPECT_EQ(a.SequenceLength(2, 0).value(), 21);
  const std::vector<SequenceId> both = {1, 2};
  EXPECT_EQ(a.PlanDecode(both).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(a.SequenceLength(2, 1).value(), 21);
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(DecodeCall(a, {2}, layer, 30 + 2 * step + layer, out_a).ok());
      ASSERT_TRUE(DecodeCall(b, {2}, layer, 30 + 2 * step + layer, out_b).ok());
      EXPECT_TRUE(SameOutput(out_a, out_b, 0.0));
    }
  }
  EXPECT_EQ(a.SequenceLength(1, 1).value(), 41);
}

// A batch naming a removed sequence fails as a whole with kNotFound; the other
// sequences keep every token and decode on as in a twin.
TEST_P(CapacityEdges, BatchWithRemovedSequenceFailsWhole) {
  const auto &[policy, route, backend] = GetParam();
  SKIP_WITHOUT_BACKEND(backend);
  const RuntimeConfig config = SmallConfig(policy, route, 0, backend);
  auto ra = Runtime::Create(config), rb = Runtime::Create(config);
  ASSERT_TRUE(ra.ok() && rb.ok());
  Runtime &a = *ra.value();
  Runtime &b = *rb.value();
  std::vector<float> out_a, out_b;
  for (Runtime *rt : {&a, &b}) {
    for (SequenceId s : {1, 2, 3}) ASSERT_TRUE(rt->AddSequence(s).ok());
    PrefillAll(*rt, 1, 30, 1);
    PrefillAll(*rt, 2, 25, 2);
    PrefillAll(*rt, 3, 1, 3);  // a one-token context
    ASSERT_TRUE(rt->RemoveSequence(2).ok());
  }
  for (int layer = 0; layer < kLayers; ++layer) {
    const Status st = DecodeCall(a, {1, 2, 3}, layer, 5, out_a);
    EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
    EXPECT_NE(st.message().find("sequence 2 is not live"), std::string::npos) << st.ToString();
    EXPECT_EQ(a.SequenceLength(1, layer).value(), 30);
    EXPECT_EQ(a.SequenceLength(3, layer).value(), 1);
  }
  const std::vector<SequenceId> with_removed = {3, 2};
  EXPECT_EQ(a.PlanDecode(with_removed).code(), StatusCode::kNotFound);
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(DecodeCall(a, {1, 3}, layer, 50 + 2 * step + layer, out_a).ok());
      ASSERT_TRUE(DecodeCall(b, {1, 3}, layer, 50 + 2 * step + layer, out_b).ok());
      EXPECT_TRUE(SameOutput(out_a, out_b, 0.0));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Paths, CapacityEdges,
    ::testing::Combine(::testing::Values("streaming", "oracle"),
                       ::testing::Values(Route::kAuto, Route::kCpu),
                       ::testing::Values(Backend::kHost, Backend::kCuda)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, Route, Backend>> &info) {
      return std::get<0>(info.param) + "_" + RouteName(std::get<1>(info.param)) + "_" +
             BackendName(std::get<2>(info.param));
    });

// ---- threads
// ----------------------------------------------------------------------------------

// A planned step spans calls: its sequences cannot be removed between its first
// and last Decode; others can, and the step completes as in a twin.
TEST(Concurrency, RemoveDuringPlannedStep) {
  for (Backend backend : {Backend::kHost, Backend::kCuda}) {
    if (backend == Backend::kCuda && !CudaAvailable()) continue;
    const RuntimeConfig config = SmallConfig("streaming", Route::kAuto, 0, backend);
    auto ra = Runtime::Create(config), rb = Runtime::Create(config);
    ASSERT_TRUE(ra.ok() && rb.ok());
    Runtime &a = *ra.value();
    Runtime &b = *rb.value();
    for (Runtime *rt : {&a, &b}) {
      for (SequenceId s : {1, 2, 3}) ASSERT_TRUE(rt->AddSequence(s).ok());
      PrefillAll(*rt, 1, 30, 1);
      PrefillAll(*rt, 2, 25, 2);
      PrefillAll(*rt, 3, 20, 3);
    }
    const std::vector<SequenceId> step = {1, 2};
    std::vector<float> out_a, out_b;
    ASSERT_TRUE(a.PlanDecode(step).ok());
    ASSERT_TRUE(b.PlanDecode(step).ok());
    ASSERT_TRUE(DecodeCall(a, step, 0, 5, out_a).ok());
    ASSERT_TRUE(DecodeCall(b, step, 0, 5, out_b).ok());
    const Status st = a.RemoveSequence(2);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("has run 1 of 2 layers"), std::string::npos) << st.ToString();
    ASSERT_TRUE(a.RemoveSequence(3).ok());  // not in the step
    ASSERT_TRUE(b.RemoveSequence(3).ok());
    ASSERT_TRUE(DecodeCall(a, step, 1, 6, out_a).ok());
    ASSERT_TRUE(DecodeCall(b, step, 1, 6, out_b).ok());
    EXPECT_TRUE(SameOutput(out_a, out_b, 0.0));
    EXPECT_EQ(a.GetStats().decode_planned, 2);
    ASSERT_TRUE(a.RemoveSequence(2).ok());  // the step is complete
    ASSERT_TRUE(b.RemoveSequence(2).ok());
    ASSERT_TRUE(DecodeCall(a, {1}, 0, 7, out_a).ok());
    ASSERT_TRUE(DecodeCall(b, {1}, 0, 7, out_b).ok());
    EXPECT_TRUE(SameOutput(out_a, out_b, 0.0));
    EXPECT_EQ(a.SequenceLength(1, 0).value(), 32);
    EXPECT_EQ(a.SequenceLength(1, 1).value(), 31);
  }
}

struct HammerCounts {
  std::atomic<int64_t> adds{0}, add_full{0}, removes{0}, stats{0}, resets{0}, prefills{0};
  std::atomic<int64_t> bad{0};  // calls that returned something the contract does not allow
};

// Other threads add, prefill and remove their own sequences, read stats and
// lengths, and reset the stats for a few seconds while this thread decodes a
// batch of three sequences. The outputs equal those of the same decodes on a
// runtime nobody else touched; no slot is lost.
class Concurrency : public ::testing::TestWithParam<std::tuple<std::string, Route, Backend>> {};

TEST_P(Concurrency, HammeringThreadsDoNotDisturbDecode) {
  const auto &[policy, route, backend] = GetParam();
  SKIP_WITHOUT_BACKEND(backend);
  RuntimeConfig config = SmallConfig(policy, route, 0, backend);
  // Two slots besides the batch's for three threads: some of their adds are
  // refused.
  config.capacity.max_sequences = 5;
  config.capacity.max_tokens_per_sequence = 4096;
  auto ra = Runtime::Create(config), rb = Runtime::Create(config);
  ASSERT_TRUE(ra.ok() && rb.ok());
  Runtime &a = *ra.value();
  Runtime &b = *rb.value();
  const std::vector<SequenceId> batch = {1, 2, 3};
  for (Runtime *rt : {&a, &b}) {
    for (SequenceId s : batch) ASSERT_TRUE(rt->AddSequence(s).ok());
    PrefillAll(*rt, 1, 40, 1);
    PrefillAll(*rt, 2, 25, 2);
    PrefillAll(*rt, 3, 17, 3);
  }
  // The twin first: its outputs, step by step.
  constexpr auto kRun = std::chrono::milliseconds(3000);
  std::vector<std::vector<float>> expected;
  std::vector<float> out;
  const auto t_twin = std::chrono::steady_clock::now();
  int steps = 0;
  for (; steps < 3000 && std::chrono::steady_clock::now() - t_twin < kRun / 2; ++steps) {
    for (int layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(DecodeCall(b, batch, layer, 1000 + 2 * steps + layer, out).ok());
      expected.push_back(out);
    }
  }

  HammerCounts counts;
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> o;
      std::vector<int64_t> last_len(batch.size(), 0);
      uint64_t i = 0;
      while (!stop.load()) {
        const SequenceId mine = 1000 + static_cast<SequenceId>(t) * 1000000 + (i++ % 1000);
        const Status add = a.AddSequence(mine);
        if (add.ok()) {
          ++counts.adds;
          if (i % 4 == 0) {
            // Its own sequence, so its own call order: a prefill from this
            // thread.
            if (PrefillCall(a, mine, 0, 8, static_cast<uint32_t>(i), o).ok()) {
              ++counts.prefills;
            } else {
              ++counts.bad;
            }
          }
          if (a.RemoveSequence(mine).ok()) {
            ++counts.removes;
          } else {
            ++counts.bad;
          }
        } else if (add.code() == StatusCode::kResourceExhausted) {
          ++counts.add_full;
        } else {
          ++counts.bad;
        }
        const Stats s = a.GetStats();
        ++counts.stats;
        // A snapshot is never torn: its row counters add up.
        if (s.rows_selected != s.rows_resident + s.rows_bank_hit + s.rows_fetched + s.rows_cpu) {
          ++counts.bad;
        }
        for (size_t j = 0; j < batch.size(); ++j) {
          // Layer 1 first: layer 0 of a step runs before layer 1, and lengths
          // only grow, so a later read of layer 0 is never behind; neither goes
          // back.
          auto l1 = a.SequenceLength(batch[j], 1);
          auto l0 = a.SequenceLength(batch[j], 0);
          if (!l0.ok() || !l1.ok() || l0.value() < l1.value() || l1.value() < last_len[j]) {
            ++counts.bad;
          } else {
            last_len[j] = l1.value();
          }
        }
        if (t == 0 && i % 64 == 0) {
          a.ResetStats();
          ++counts.resets;
        }
      }
    });
  }
  int mismatches = 0;
  for (int s = 0; s < steps; ++s) {
    for (int layer = 0; layer < kLayers; ++layer) {
      const Status st = DecodeCall(a, batch, layer, 1000 + 2 * s + layer, out);
      if (!st.ok()) {
        ADD_FAILURE() << "step " << s << ": " << st.ToString();
        ++mismatches;
        continue;
      }
      const ::testing::AssertionResult same = SameOutput(out, expected[2 * s + layer], 0.0);
      if (!same && ++mismatches < 4)
        ADD_FAILURE() << "step " << s << " layer " << layer << ": " << same.message();
    }
  }
  stop = true;
  for (std::thread &th : threads) th.join();
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(counts.bad.load(), 0);
  EXPECT_GT(counts.adds.load(), 10);
  EXPECT_EQ(counts.adds.load(), counts.removes.load());
  EXPECT_GT(counts.stats.load(), 10);
  for (SequenceId q : batch) {
    EXPECT_EQ(a.SequenceLength(q, 1).value(), b.SequenceLength(q, 1).value());
  }
  EXPECT_GT(counts.add_full.load(), 0);
  // Every slot the threads took came back: 2 free ones, then the third is
  // refused.
  for (SequenceId s = 50; s < 52; ++s) EXPECT_TRUE(a.AddSequence(s).ok()) << s;
  EXPECT_EQ(a.AddSequence(52).code(), StatusCode::kResourceExhausted);
  std::printf(
      "[ info ] %d steps; adds %lld (refused full %lld), prefills "
      "%lld, stats reads %lld, "
      "resets %lld\n",
      steps, static_cast<long long>(counts.adds.load()),
      static_cast<long long>(counts.add_full.load()),
      static_cast<long long>(counts.prefills.load()), static_cast<long long>(counts.stats.load()),
      static_cast<long long>(counts.resets.load()));
}

INSTANTIATE_TEST_SUITE_P(
    Paths, Concurrency,
    ::testing::Values(std::make_tuple("streaming", Route::kAuto, Backend::kHost),
                      std::make_tuple("oracle", Route::kCpu, Backend::kHost),
                      std::make_tuple("streaming", Route::kAuto, Backend::kCuda),
                      std::make_tuple("oracle", Route::kCpu, Backend::kCuda)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, Route, Backend>> &info) {
      return std::get<0>(info.param) + "_" + RouteName(std::get<1>(info.param)) + "_" +
             BackendName(std::get<2>(info.param));
    });

// ---- soak
// -------------------------------------------------------------------------------------

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kUnderAsan = true;
#else
constexpr bool kUnderAsan = false;
#endif
#else
constexpr bool kUnderAsan = false;
#endif

// Many decode steps with sequences coming and going: after a warm-up, the
// process's resident memory and the runtime's host and device bytes stop
// growing.
TEST(Soak, MemoryFlatAfterWarmUp) {
  for (const auto &[policy, route] :
       {std::pair<std::string, Route>{"streaming", Route::kAuto}, {"oracle", Route::kCpu}}) {
    testing::SoakOptions o;
    o.policy = policy;
    o.route = route;
    o.steps = 20000;
    o.warmup_steps = 5000;
    const Result<testing::SoakReport> r = testing::RunSoak(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const testing::SoakReport &s = r.value();
    std::printf("[ info ] %s\n", s.ToJson().c_str());
    EXPECT_EQ(s.steps, o.steps);
    EXPECT_GT(s.sequences_added, 20) << "churn";
    EXPECT_EQ(s.end.host_bytes, s.warm.host_bytes) << policy;
    EXPECT_EQ(s.end.device_bytes, s.warm.device_bytes) << policy;
    EXPECT_EQ(s.max.host_bytes, s.warm.host_bytes) << policy;
    // RSS: allocator noise only (a few pages), nothing that scales with the
    // steps. Not under AddressSanitizer: its quarantine keeps freed blocks
    // resident (tens of MB over this run) and LeakSanitizer checks leaks there.
    if (!kUnderAsan) {
      EXPECT_LT(s.end.rss_bytes - s.warm.rss_bytes, int64_t{2} << 20) << policy;
    }
    EXPECT_GT(s.output_norm, 0.0);
  }
}

}  // namespace
}  // namespace kvferry
