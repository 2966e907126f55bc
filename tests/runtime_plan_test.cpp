// Copyright kvferry authors. Apache-2.0.
// The planned decode step (Runtime::PlanDecode + Decode) on the host-emulated device: a planned
// step equals an unplanned one exactly, a partly run plan gives back the layers it did not run,
// bad input to PlanDecode changes nothing, and a policy that fails after the append leaves every
// sequence exactly as before the call (the window row the append overwrote is put back).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu/attention.h"
#include "offload/token_bank.h"
#include "gpu/device.h"
#include "kvferry/kvferry.h"
#include "policies/basic.h"
#include "policies/policy.h"
#include "tests/policy_test_util.h"

namespace kvferry {
namespace {

RuntimeConfig PlanConfig(const std::string& policy, int layers) {
  RuntimeConfig c;
  c.model = {.num_layers = layers, .num_q_heads = 8, .num_kv_heads = 2, .head_dim = 32,
             .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = 4;
  c.capacity.max_tokens_per_sequence = 512;
  c.capacity.max_batch = 3;
  c.capacity.max_prefill_chunk = 256;
  c.tiers.sink_tokens = 3;
  c.tiers.window_tokens = 8;
  c.policy.name = policy;
  c.policy.budget_tokens = 24;
  c.backend = Backend::kHost;
  c.cpu_threads = 1;
  c.probe_at_start = false;
  return c;
}

// Feeds identical inputs to several runtimes.
struct Feeder {
  explicit Feeder(const RuntimeConfig& c, uint32_t seed) : c(c), rng(seed) {}
  std::vector<float> Random(int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = nd(rng);
    return x;
  }
  TensorView View(std::vector<float>& x, int64_t rows, int heads) const {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost,
                                  {rows, heads, c.model.head_dim});
  }
  void Prefill(std::vector<Runtime*> rts, SequenceId s, int64_t tokens) {
    const ModelShape& m = c.model;
    for (int l = 0; l < m.num_layers; ++l) {
      auto q = Random(tokens * m.num_q_heads * m.head_dim);
      auto k = Random(tokens * m.num_kv_heads * m.head_dim);
      auto v = Random(tokens * m.num_kv_heads * m.head_dim);
      std::vector<float> out(q.size());
      for (Runtime* rt : rts) {
        ASSERT_TRUE(rt->Prefill(s, l, View(q, tokens, m.num_q_heads), View(k, tokens, m.num_kv_heads),
                                View(v, tokens, m.num_kv_heads), View(out, tokens, m.num_q_heads))
                        .ok());
      }
    }
  }
  // One layer's decode inputs for a batch.
  struct Step {
    std::vector<float> q, k, v;
  };
  // With \p layer >= 0 and carry > 0 the query moves as decoding's does: carry times \p layer's
  // last one plus fresh noise (a cosine of about carry between steps).
  Step Make(int64_t batch, int layer = -1) {
    const ModelShape& m = c.model;
    Step st{Random(batch * m.num_q_heads * m.head_dim), Random(batch * m.num_kv_heads * m.head_dim),
            Random(batch * m.num_kv_heads * m.head_dim)};
    if (layer >= 0 && carry > 0.0) {
      std::vector<float>& last = last_q[layer];
      if (last.size() == st.q.size()) {
        const double fresh = std::sqrt(1.0 - carry * carry);
        for (size_t i = 0; i < st.q.size(); ++i) st.q[i] = static_cast<float>(carry * last[i] + fresh * st.q[i]);
      }
      last = st.q;
    }
    return st;
  }
  Status Decode(Runtime& rt, const std::vector<SequenceId>& seqs, int layer, Step& s,
                std::vector<float>& out) {
    const ModelShape& m = c.model;
    const int64_t b = static_cast<int64_t>(seqs.size());
    out.assign(static_cast<size_t>(b * m.num_q_heads * m.head_dim), std::nanf(""));
    return rt.Decode(seqs, layer, View(s.q, b, m.num_q_heads), View(s.k, b, m.num_kv_heads),
                     View(s.v, b, m.num_kv_heads), View(out, b, m.num_q_heads));
  }
  RuntimeConfig c;
  std::mt19937 rng;
  std::normal_distribution<float> nd{0.0f, 1.0f};
  double carry = 0.0;
  std::map<int, std::vector<float>> last_q;
};

std::unique_ptr<Runtime> Make(const RuntimeConfig& c) {
  auto r = Runtime::Create(c);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

double NormOf(const std::vector<float>& x) {
  double s = 0;
  for (float e : x) s += static_cast<double>(e) * e;
  return std::sqrt(s);
}

class PlannedStep : public ::testing::TestWithParam<std::string> {};

TEST_P(PlannedStep, EqualsUnplannedStepExactly) {
  const RuntimeConfig c = PlanConfig(GetParam(), 3);
  auto planned = Make(c), unplanned = Make(c);
  ASSERT_TRUE(planned && unplanned);
  EXPECT_TRUE(planned->decode_is_capture_safe());
  Feeder f(c, 7);
  const std::vector<SequenceId> seqs = {5, 9};
  for (SequenceId s : seqs) {
    ASSERT_TRUE(planned->AddSequence(s).ok());
    ASSERT_TRUE(unplanned->AddSequence(s).ok());
  }
  f.Prefill({planned.get(), unplanned.get()}, 5, 37);
  f.Prefill({planned.get(), unplanned.get()}, 9, 5);  // shorter than sinks + window
  const int steps = 20;  // the window ring wraps; sequence 9 crosses sink + window
  for (int t = 0; t < steps; ++t) {
    ASSERT_TRUE(planned->PlanDecode(seqs).ok());
    for (int l = 0; l < c.model.num_layers; ++l) {
      Feeder::Step s = f.Make(2);
      std::vector<float> a, b;
      ASSERT_TRUE(f.Decode(*planned, seqs, l, s, a).ok());
      ASSERT_TRUE(f.Decode(*unplanned, seqs, l, s, b).ok());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "step " << t << " layer " << l;
      EXPECT_GT(NormOf(a), 0.0);
    }
  }
  for (int l = 0; l < c.model.num_layers; ++l) {
    EXPECT_EQ(*planned->SequenceLength(5, l), 37 + steps);
    EXPECT_EQ(*planned->SequenceLength(9, l), 5 + steps);
    auto sel = planned->LastSelection(5, l, 1);
    ASSERT_TRUE(sel.ok());
    std::vector<int32_t> want;
    StreamingSelect(37 + steps, c.tiers.sink_tokens,
                    GetParam() == "dense" ? 37 + steps : c.policy.budget_tokens, want);
    EXPECT_EQ(*sel, want);
  }
  const Stats sp = planned->GetStats(), su = unplanned->GetStats();
  EXPECT_EQ(sp.decode_planned, steps * c.model.num_layers);
  EXPECT_EQ(su.decode_planned, 0);
  EXPECT_EQ(sp.decode_plans, steps);
  EXPECT_EQ(su.decode_plans, steps * c.model.num_layers);
  EXPECT_EQ(sp.host_syncs, 0);
  EXPECT_EQ(sp.rows_selected, su.rows_selected);
  EXPECT_EQ(sp.rows_fetched, su.rows_fetched);
  EXPECT_EQ(sp.rows_selected, sp.rows_resident + sp.rows_fetched);
}

INSTANTIATE_TEST_SUITE_P(Policies, PlannedStep, ::testing::Values("dense", "streaming"));

TEST(PlannedStep, PartlyRunPlanGivesBackTheLayersItDidNotRun) {
  const RuntimeConfig c = PlanConfig("streaming", 3);
  auto rt = Make(c), twin = Make(c);
  Feeder f(c, 11);
  const std::vector<SequenceId> seqs = {1};
  ASSERT_TRUE(rt->AddSequence(1).ok());
  ASSERT_TRUE(twin->AddSequence(1).ok());
  f.Prefill({rt.get(), twin.get()}, 1, 30);
  ASSERT_TRUE(rt->PlanDecode(seqs).ok());
  for (int l = 0; l < 3; ++l) EXPECT_EQ(*rt->SequenceLength(1, l), 31);  // committed
  Feeder::Step s0 = f.Make(1);
  std::vector<float> a, b;
  ASSERT_TRUE(f.Decode(*rt, seqs, 0, s0, a).ok());
  ASSERT_TRUE(f.Decode(*twin, seqs, 0, s0, b).ok());
  // The engine gave up on layers 1 and 2 of that step: the next plan takes their tokens back.
  ASSERT_TRUE(rt->PlanDecode(seqs).ok());
  EXPECT_EQ(*rt->SequenceLength(1, 0), 32);
  EXPECT_EQ(*rt->SequenceLength(1, 1), 31);
  EXPECT_EQ(*rt->SequenceLength(1, 2), 31);
  for (int l = 0; l < 3; ++l) {
    Feeder::Step s = f.Make(1);
    ASSERT_TRUE(f.Decode(*rt, seqs, l, s, a).ok());
    ASSERT_TRUE(f.Decode(*twin, seqs, l, s, b).ok());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "layer " << l;
  }
}

TEST(PlannedStep, BadPlansChangeNothing) {
  const RuntimeConfig c = PlanConfig("streaming", 2);
  auto rt = Make(c);
  Feeder f(c, 3);
  ASSERT_TRUE(rt->AddSequence(1).ok());
  ASSERT_TRUE(rt->AddSequence(2).ok());
  f.Prefill({rt.get()}, 1, 20);
  const std::vector<SequenceId> unknown = {1, 77}, twice = {1, 1}, unprefilled = {1, 2},
                                too_many = {1, 2, 3, 4};
  EXPECT_EQ(rt->PlanDecode(unknown).code(), StatusCode::kNotFound);
  EXPECT_EQ(rt->PlanDecode(twice).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rt->PlanDecode(unprefilled).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(rt->PlanDecode(too_many).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rt->PlanDecode({}).code(), StatusCode::kInvalidArgument);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(*rt->SequenceLength(1, l), 20);
    EXPECT_EQ(*rt->SequenceLength(2, l), 0);
  }
  // A planned Decode with a bad tensor fails and takes that layer's token back.
  const std::vector<SequenceId> one = {1};
  ASSERT_TRUE(rt->PlanDecode(one).ok());
  Feeder::Step s = f.Make(1);
  std::vector<float> out(8);  // wrong shape
  EXPECT_EQ(rt->Decode(one, 0, f.View(s.q, 1, 8), f.View(s.k, 1, 2), f.View(s.v, 1, 2),
                       f.View(out, 1, 2)).code(),
            StatusCode::kInvalidArgument);
  std::vector<float> good;
  ASSERT_TRUE(f.Decode(*rt, one, 1, s, good).ok());
  ASSERT_TRUE(f.Decode(*rt, one, 0, s, good).ok());  // unplanned now: appends at 20
  EXPECT_EQ(*rt->SequenceLength(1, 0), 21);
  EXPECT_EQ(*rt->SequenceLength(1, 1), 21);
}

// The host timeline (Runtime::StartTrace / WriteTrace): Chrome trace JSON whose stage spans are
// the calls' stages and whose "cpu_item" spans are the planned step's pool tasks, one per
// (sequence, KV head) and layer, each inside its layer's "select" stage; a full buffer drops spans
// and says how many.
TEST(Trace, StepTimelineIsChromeTraceJson) {
  RuntimeConfig c = PlanConfig("lfps", 2);
  c.cpu_threads = 2;
  auto rt = Make(c);
  ASSERT_TRUE(rt);
  const std::string path = ::testing::TempDir() + "kvferry_trace_test.json";
  EXPECT_EQ(rt->WriteTrace(path).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(rt->StartTrace(0).code(), StatusCode::kInvalidArgument);
  Feeder f(c, 11);
  const std::vector<SequenceId> two = {3, 4};
  for (SequenceId s : two) ASSERT_TRUE(rt->AddSequence(s).ok());
  f.Prefill({rt.get()}, 3, 120);
  f.Prefill({rt.get()}, 4, 60);
  auto read = [&]() {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  struct Span {
    std::string name;
    int tid;
    double ts, dur;
  };
  auto spans = [](const std::string& json) {
    std::vector<Span> out;
    const std::regex re(
        "\\{\"name\":\"([a-z_]+)\",\"cat\":\"[a-z]+\",\"ph\":\"X\",\"pid\":1,\"tid\":([0-9]+),"
        "\"ts\":([0-9.]+),\"dur\":([0-9.]+)");
    for (auto it = std::sregex_iterator(json.begin(), json.end(), re); it != std::sregex_iterator(); ++it) {
      out.push_back({(*it)[1], std::stoi((*it)[2]), std::stod((*it)[3]), std::stod((*it)[4])});
    }
    return out;
  };
  const int steps = 3, layers = c.model.num_layers, hkv = c.model.num_kv_heads;
  ASSERT_TRUE(rt->StartTrace(1 << 12).ok());
  for (int step = 0; step < steps; ++step) {
    ASSERT_TRUE(rt->PlanDecode(two).ok());
    for (int l = 0; l < layers; ++l) {
      std::vector<float> out;
      Feeder::Step in = f.Make(2);
      ASSERT_TRUE(f.Decode(*rt, two, l, in, out).ok());
    }
  }
  ASSERT_TRUE(rt->WriteTrace(path).ok());
  EXPECT_EQ(rt->WriteTrace(path).code(), StatusCode::kFailedPrecondition);  // stopped
  std::string json = read();
  ASSERT_EQ(json.rfind("{\"displayTimeUnit\":\"ms\",\"otherData\":{\"dropped\":0},\"traceEvents\":[", 0), 0u)
      << json.substr(0, 200);
  EXPECT_EQ(json.substr(json.size() - 3), "]}\n");
  std::vector<Span> all = spans(json);
  std::vector<Span> selects, items;
  for (const Span& s : all) {
    EXPECT_GE(s.ts, 0.0);
    EXPECT_GE(s.dur, 0.0);
    if (s.name == "select") selects.push_back(s);
    if (s.name == "cpu_item") items.push_back(s);
  }
  EXPECT_EQ(selects.size(), static_cast<size_t>(steps * layers));
  EXPECT_EQ(items.size(), static_cast<size_t>(steps * layers * 2 * hkv));
  for (const Span& it : items) {
    bool inside = false;
    for (const Span& s : selects) {
      inside |= it.ts + 1e-3 >= s.ts && it.ts + it.dur <= s.ts + s.dur + 1e-3;
    }
    EXPECT_TRUE(inside) << "cpu_item at " << it.ts << " us outside every select stage";
  }
  // A buffer of 3 spans keeps the first 3 and counts the rest.
  ASSERT_TRUE(rt->StartTrace(3).ok());
  ASSERT_TRUE(rt->PlanDecode(two).ok());
  for (int l = 0; l < layers; ++l) {
    std::vector<float> out;
    Feeder::Step in = f.Make(2);
    ASSERT_TRUE(f.Decode(*rt, two, l, in, out).ok());
  }
  ASSERT_TRUE(rt->WriteTrace(path).ok());
  json = read();
  EXPECT_EQ(spans(json).size(), 3u);
  const std::smatch m = [&] {
    std::smatch r;
    std::regex_search(json, r, std::regex("\"dropped\":([0-9]+)"));
    return r;
  }();
  ASSERT_FALSE(m.empty());
  EXPECT_GT(std::stoi(m[1]), 0);
  std::remove(path.c_str());
}

TEST(PlannedStep, CpuPlacedPolicyRunsThePlannedStep) {
  // lfps selects on the host and covers the resident rows: its step is planned (PlanDecode
  // commits the token at every layer), the device attends the resident rows and the host the
  // selected offloaded ones. A runtime whose Decode plans itself gives the same bytes; the path
  // without a planned step (route gpu: host selection, every selected row gathered and attended
  // in one pass) selects the same positions and gives the same outputs to fp32 rounding.
  const RuntimeConfig c = PlanConfig("lfps", 2);
  RuntimeConfig unplanned_path = c;
  unplanned_path.route = Route::kGpu;
  auto rt = Make(c), twin = Make(c), legacy = Make(unplanned_path);
  ASSERT_TRUE(rt && twin && legacy);
  EXPECT_FALSE(rt->decode_is_capture_safe());
  Feeder f(c, 8);
  const std::vector<SequenceId> two = {3, 4};
  for (Runtime* r : {rt.get(), twin.get(), legacy.get()}) {
    ASSERT_TRUE(r->AddSequence(3).ok());
    ASSERT_TRUE(r->AddSequence(4).ok());
  }
  f.Prefill({rt.get(), twin.get(), legacy.get()}, 3, 120);
  f.Prefill({rt.get(), twin.get(), legacy.get()}, 4, 9);  // shorter than sinks + window
  double worst = 0.0;
  for (int step = 0; step < 6; ++step) {
    ASSERT_TRUE(rt->PlanDecode(two).ok());
    EXPECT_EQ(*rt->SequenceLength(3, 0), 121 + step);
    EXPECT_EQ(*rt->SequenceLength(3, 1), 121 + step);
    for (int l = 0; l < 2; ++l) {
      Feeder::Step s = f.Make(2);
      std::vector<float> a, b, ref;
      ASSERT_TRUE(f.Decode(*rt, two, l, s, a).ok());
      ASSERT_TRUE(f.Decode(*twin, two, l, s, b).ok());
      ASSERT_TRUE(f.Decode(*legacy, two, l, s, ref).ok());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
      for (SequenceId seq : two) {
        for (int h = 0; h < c.model.num_kv_heads; ++h) {
          EXPECT_EQ(*rt->LastSelection(seq, l, h), *legacy->LastSelection(seq, l, h));
        }
      }
      double diff = 0.0;
      for (size_t i = 0; i < a.size(); ++i) diff += (a[i] - ref[i]) * double{a[i] - ref[i]};
      worst = std::max(worst, std::sqrt(diff) / NormOf(ref));
      EXPECT_GT(NormOf(a), 0.1);
    }
  }
  EXPECT_LT(worst, 1e-5);
  EXPECT_EQ(*rt->SequenceLength(3, 1), 126);
  const Stats st = rt->GetStats();
  EXPECT_EQ(st.decode_planned, 12);
  EXPECT_GT(st.rows_cpu, 0);  // offloaded picks were attended on the CPU
  EXPECT_EQ(st.rows_fetched, 0);
  EXPECT_EQ(st.rows_resident + st.rows_cpu, st.rows_selected);
}

// The cost model's CPU rate checked against the steps (Stats::ms_cpu_attend_busy,
// cost_cpu_gbps_measured): the thread time of the CPU route's attention kernels, in the planned
// CPU step (lfps, serial and asynchronous part), the host path's split rows (oracle on route cpu)
// and the dense paged path (dense on route cpu); nothing where no row is attended on the CPU
// (lfps on route gpu); the measured rate is the K/V bytes of rows_cpu over that time times the
// pool's one thread, and ResetStats clears it.
TEST(CostModel, StatsCarryTheCpuRateTheStepsMeasured) {
  struct Run {
    std::string policy;
    Route route;
    int async;
    bool attends_on_cpu;
  };
  for (const Run& r : {Run{"lfps", Route::kAuto, 0, true}, Run{"lfps", Route::kAuto, 1, true},
                       Run{"oracle", Route::kCpu, 0, true}, Run{"dense", Route::kCpu, 0, true},
                       Run{"lfps", Route::kGpu, 0, false}}) {
    SCOPED_TRACE(r.policy + " route " + RouteName(r.route) + " async " + std::to_string(r.async));
    RuntimeConfig c = PlanConfig(r.policy, 2);
    c.route = r.route;
    c.async_cpu = r.async;
    c.cpu_threads = 1;
    if (r.policy == "dense") c.policy.budget_tokens = 0;
    auto rt = Make(c);
    ASSERT_TRUE(rt);
    Feeder f(c, 41);
    const std::vector<SequenceId> two = {1, 2};
    for (SequenceId s : two) ASSERT_TRUE(rt->AddSequence(s).ok());
    f.Prefill({rt.get()}, 1, 200);
    f.Prefill({rt.get()}, 2, 90);
    auto steps = [&](int n) {
      for (int t = 0; t < n; ++t) {
        ASSERT_TRUE(rt->PlanDecode(two).ok());
        for (int l = 0; l < 2; ++l) {
          Feeder::Step in = f.Make(2);
          std::vector<float> out;
          ASSERT_TRUE(f.Decode(*rt, two, l, in, out).ok());
        }
      }
    };
    steps(4);
    Stats s = rt->GetStats();
    EXPECT_GT(s.cost_cpu_gbps, 0.0);  // the model's defaults without the probe
    if (!r.attends_on_cpu) {
      EXPECT_EQ(s.rows_cpu, 0);
      EXPECT_EQ(s.ms_cpu_attend_busy, 0.0);
      EXPECT_EQ(s.cost_cpu_gbps_measured, 0.0);
      continue;
    }
    ASSERT_GT(s.rows_cpu, 0);
    ASSERT_GT(s.ms_cpu_attend_busy, 0.0);
    const double bytes = static_cast<double>(s.rows_cpu) * 2 * c.model.head_dim * 2;  // bf16 K and V
    EXPECT_NEAR(s.cost_cpu_gbps_measured, bytes / (s.ms_cpu_attend_busy * 1e-3) * 1e-9,
                1e-9 * s.cost_cpu_gbps_measured);
    EXPECT_GT(s.cost_cpu_gbps_measured, 1e-3);
    EXPECT_LT(s.cost_cpu_gbps_measured, 1e4);
    EXPECT_NE(s.ToJson().find("\"cost_cpu_gbps_measured\":"), std::string::npos);
    rt->ResetStats();
    s = rt->GetStats();
    EXPECT_EQ(s.ms_cpu_attend_busy, 0.0);
    EXPECT_EQ(s.cost_cpu_gbps_measured, 0.0);
    steps(1);
    EXPECT_GT(rt->GetStats().ms_cpu_attend_busy, 0.0);
  }
}

// The cost model's device rates checked against the timed calls (Runtime::TimeDeviceSelect):
// ms_attend_device times the step wherever the device attends every selected row (the device
// selections and streaming), not a CPU-placed step (lfps); cost_select_gbps_measured is the key
// bytes of the timed selections over ms_select_device, cost_attend_gbps_measured the K/V bytes
// of the rows the timed steps attended over ms_attend_device; the probed rates are the model's
// defaults without the probe; off, or after ResetStats, nothing is timed.
TEST(CostModel, StatsCarryTheDeviceRatesTheTimedCallsMeasured) {
  for (const char* policy : {"quest", "sparcas", "oracle", "streaming", "lfps"}) {
    SCOPED_TRACE(policy);
    const bool device_selects = std::string(policy) != "streaming" && std::string(policy) != "lfps";
    const bool device_attends = std::string(policy) != "lfps";
    RuntimeConfig c = PlanConfig(policy, 2);
    auto rt = Make(c);
    ASSERT_TRUE(rt);
    Feeder f(c, 43);
    const std::vector<SequenceId> two = {1, 2};
    for (SequenceId s : two) ASSERT_TRUE(rt->AddSequence(s).ok());
    f.Prefill({rt.get()}, 1, 170);
    f.Prefill({rt.get()}, 2, 60);
    auto steps = [&](int n) {
      for (int t = 0; t < n; ++t) {
        ASSERT_TRUE(rt->PlanDecode(two).ok());
        for (int l = 0; l < c.model.num_layers; ++l) {
          Feeder::Step in = f.Make(2);
          std::vector<float> out;
          ASSERT_TRUE(f.Decode(*rt, two, l, in, out).ok());
        }
      }
    };
    steps(1);
    Stats s = rt->GetStats();
    EXPECT_EQ(s.ms_attend_device, 0.0);
    EXPECT_EQ(s.cost_attend_gbps_measured, 0.0);
    EXPECT_EQ(s.cost_hbm_gbps, 3000.0);  // CostModel's defaults (no probe)
    EXPECT_EQ(s.cost_h2d_gbps, 52.0);
    ASSERT_TRUE(rt->TimeDeviceSelect(true).ok());
    rt->ResetStats();
    steps(6);  // more than the rings' 4 pairs a layer: read-back times and pending ones both count
    s = rt->GetStats();
    ASSERT_GT(s.rows_selected, 0);
    if (device_attends) {
      ASSERT_GT(s.ms_attend_device, 0.0);
      const double bytes = static_cast<double>(s.rows_selected) * 2 * c.model.head_dim * 2;  // bf16 K, V
      EXPECT_NEAR(s.cost_attend_gbps_measured, bytes / (s.ms_attend_device * 1e-3) * 1e-9,
                  1e-9 * s.cost_attend_gbps_measured);
      EXPECT_GT(s.cost_attend_gbps_measured, 0.0);
    } else {
      EXPECT_EQ(s.ms_attend_device, 0.0);
      EXPECT_EQ(s.cost_attend_gbps_measured, 0.0);
    }
    if (device_selects) {
      ASSERT_GT(s.ms_select_device, 0.0);
      ASSERT_GT(s.select_key_bytes, 0);
      EXPECT_NEAR(s.cost_select_gbps_measured,
                  static_cast<double>(s.select_key_bytes) / (s.ms_select_device * 1e-3) * 1e-9,
                  1e-9 * s.cost_select_gbps_measured);
    } else {
      EXPECT_EQ(s.cost_select_gbps_measured, 0.0);
    }
    const std::string json = s.ToJson();
    for (const char* key : {"\"ms_attend_device\":", "\"cost_hbm_gbps\":", "\"cost_h2d_gbps\":",
                            "\"cost_select_gbps_measured\":", "\"cost_attend_gbps_measured\":"}) {
      EXPECT_NE(json.find(key), std::string::npos) << key;
    }
    rt->ResetStats();
    s = rt->GetStats();
    EXPECT_EQ(s.ms_attend_device, 0.0);
    EXPECT_EQ(s.cost_select_gbps_measured, 0.0);
    EXPECT_EQ(s.cost_attend_gbps_measured, 0.0);
    ASSERT_TRUE(rt->TimeDeviceSelect(false).ok());
    steps(1);
    s = rt->GetStats();
    EXPECT_EQ(s.ms_attend_device, 0.0);
    EXPECT_EQ(s.ms_select_device, 0.0);
    EXPECT_EQ(s.cost_attend_gbps_measured, 0.0);
  }
}

// ---- the scheduler's split of a device selection's misses (route auto) ----

// Device::SplitStepList on fresh random lists (random lengths, sinks, windows and shares), on
// every device there is, against its rule written out here: the union of the two lists is the
// list, each in list order; the CPU's entries are the last SplitCpuRows(misses, q10) misses.
TEST(SplitStepList, EveryDeviceKeepsItsRuleOnRandomLists) {
  std::vector<std::unique_ptr<Device>> devices;
  devices.push_back(MakeHostDevice());
  if (CudaAvailable()) {
    auto cuda = MakeCudaDevice(0);
    ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
    devices.push_back(std::move(cuda).value());
  }
  std::mt19937 rng(20261203);
  for (auto& dev : devices) {
    SCOPED_TRACE(dev->name());
    for (int trial = 0; trial < 12; ++trial) {
      const int32_t batch = 1 + static_cast<int32_t>(rng() % 3), hkv = 1 + static_cast<int32_t>(rng() % 3);
      const int32_t layers = 2, layer = static_cast<int32_t>(rng() % 2);
      const int64_t cap = 1 + static_cast<int64_t>(rng() % 700);  // past one 256-thread chunk
      const int32_t sink = static_cast<int32_t>(rng() % 5), window = 1 + static_cast<int32_t>(rng() % 40);
      const int32_t q10 = trial == 0 ? 0 : trial == 1 ? 1024 : static_cast<int32_t>(rng() % 1025);
      const int64_t items = int64_t{batch} * hkv;
      std::vector<int64_t> positions(static_cast<size_t>(batch * layers));
      std::vector<int32_t> list(static_cast<size_t>(items * cap), -7), count(static_cast<size_t>(items));
      for (int32_t b = 0; b < batch; ++b) {
        const int64_t n = 1 + static_cast<int64_t>(rng() % 2000);
        positions[static_cast<size_t>(b * layers + layer)] = n - 1;
        for (int32_t h = 0; h < hkv; ++h) {
          const int64_t i = int64_t{b} * hkv + h;
          count[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % (cap + 1));
          for (int64_t j = 0; j < count[static_cast<size_t>(i)]; ++j) {
            list[static_cast<size_t>(i * cap + j)] = static_cast<int32_t>(rng() % static_cast<uint64_t>(n));
          }
        }
      }
      // Device buffers: positions, list, counts, the device's share; the CPU's share in host memory.
      auto alloc = [&](size_t bytes, bool host) {
        auto r = host ? dev->AllocHost(bytes) : dev->AllocDevice(bytes);
        EXPECT_TRUE(r.ok());
        return r.ok() ? r.value() : nullptr;
      };
      const size_t list_bytes = list.size() * 4, count_bytes = count.size() * 4;
      void* d_pos = alloc(positions.size() * 8, false);
      void* d_list = alloc(list_bytes, false);
      void* d_count = alloc(count_bytes, false);
      void* d_gpu = alloc(list_bytes, false);
      void* d_gpu_count = alloc(count_bytes, false);
      void* h_cpu = alloc(list_bytes, true);
      void* h_cpu_count = alloc(count_bytes, true);
      ASSERT_TRUE(d_pos && d_list && d_count && d_gpu && d_gpu_count && h_cpu && h_cpu_count);
      StreamHandle s = dev->default_stream();
      ASSERT_TRUE(dev->CopyAsync(d_pos, positions.data(), positions.size() * 8, s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_list, list.data(), list_bytes, s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_count, count.data(), count_bytes, s).ok());
      DecodeStepArgs a;
      a.batch = batch;
      a.num_kv_heads = hkv;
      a.num_layers = layers;
      a.layer = layer;
      a.sink = sink;
      a.window = window;
      a.positions = static_cast<const int64_t*>(d_pos);
      a.list = static_cast<int32_t*>(d_list);
      a.list_count = static_cast<int32_t*>(d_count);
      a.list_cap = cap;
      const SplitListArgs sp{q10, static_cast<int32_t*>(d_gpu), static_cast<int32_t*>(d_gpu_count),
                             static_cast<int32_t*>(h_cpu), static_cast<int32_t*>(h_cpu_count)};
      ASSERT_TRUE(dev->SplitStepList(a, sp, s).ok());
      std::vector<int32_t> gpu(list.size()), gpu_count(count.size());
      ASSERT_TRUE(dev->CopyAsync(gpu.data(), d_gpu, list_bytes, s).ok());
      ASSERT_TRUE(dev->CopyAsync(gpu_count.data(), d_gpu_count, count_bytes, s).ok());
      ASSERT_TRUE(dev->SynchronizeStream(s).ok());
      const int32_t* cpu = static_cast<const int32_t*>(h_cpu);
      const int32_t* cpu_count = static_cast<const int32_t*>(h_cpu_count);
      for (int64_t i = 0; i < items; ++i) {
        const int64_t n = positions[static_cast<size_t>((i / hkv) * layers + layer)] + 1;
        std::vector<int32_t> want_gpu, want_cpu;
        const int32_t* l = list.data() + i * cap;
        int64_t misses = 0;
        for (int64_t j = 0; j < count[static_cast<size_t>(i)]; ++j) {
          misses += !(l[j] < sink || l[j] >= n - window);
        }
        const int64_t to_cpu = (misses * q10) / 1024;
        int64_t seen = 0;
        for (int64_t j = 0; j < count[static_cast<size_t>(i)]; ++j) {
          const bool miss = !(l[j] < sink || l[j] >= n - window);
          (miss && seen++ >= misses - to_cpu ? want_cpu : want_gpu).push_back(l[j]);
        }
        ASSERT_EQ(gpu_count[static_cast<size_t>(i)], static_cast<int32_t>(want_gpu.size())) << "item " << i;
        ASSERT_EQ(cpu_count[i], static_cast<int32_t>(want_cpu.size())) << "item " << i;
        EXPECT_EQ(std::vector<int32_t>(gpu.begin() + i * cap, gpu.begin() + i * cap + gpu_count[static_cast<size_t>(i)]), want_gpu);
        EXPECT_EQ(std::vector<int32_t>(cpu + i * cap, cpu + i * cap + cpu_count[i]), want_cpu);
      }
      for (void* p : {d_pos, d_list, d_count, d_gpu, d_gpu_count}) dev->FreeDevice(p);
      for (void* p : {h_cpu, h_cpu_count}) dev->FreeHost(p);
    }
  }
}

// ---- the scheduler's cross-layer prefetch (xl+, the device token bank) ----

// Device::PrefetchListRows on fresh random lists, host stores and bank tables (vector maps and
// hash maps with tombstones, random hits), on every device there is, against its rule written
// out here: an entry neither resident (sinks, window) nor in the bank's table of (slot, layer,
// head) has its K and V rows from the host store at its list index in the stage; every other
// stage byte is as it was.
TEST(PrefetchListRows, EveryDeviceStagesTheMissesOnRandomLists) {
  std::vector<std::unique_ptr<Device>> devices;
  devices.push_back(MakeHostDevice());
  if (CudaAvailable()) {
    auto cuda = MakeCudaDevice(0);
    ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
    devices.push_back(std::move(cuda).value());
  }
  std::mt19937 rng(20261204);
  for (auto& dev : devices) {
    SCOPED_TRACE(dev->name());
    for (int trial = 0; trial < 10; ++trial) {
      const bool hash = trial % 2 == 1;
      const int32_t batch = 1 + static_cast<int32_t>(rng() % 3), hkv = 1 + static_cast<int32_t>(rng() % 3);
      const int32_t layers = 3, layer = static_cast<int32_t>(rng() % 3), max_slots = 4;
      const int head_dim = trial % 3 == 0 ? 64 : 128;
      const size_t row_bytes = static_cast<size_t>(head_dim) * 2;  // bf16
      const int32_t page_tokens = 16 << (rng() % 3);
      const int64_t max_n = 1 + static_cast<int64_t>(rng() % 1500);
      const int64_t max_pages = (max_n + page_tokens - 1) / page_tokens;
      const int64_t cap = 1 + static_cast<int64_t>(rng() % 600);
      const int32_t sink = static_cast<int32_t>(rng() % 5), window = 1 + static_cast<int32_t>(rng() % 40);
      const int64_t items = int64_t{batch} * hkv;
      const int64_t tables = int64_t{max_slots} * layers * hkv;
      const int hash_log2 = 11;
      auto alloc = [&](size_t bytes, bool host) {
        auto r = host ? dev->AllocHost(bytes) : dev->AllocDevice(bytes);
        EXPECT_TRUE(r.ok());
        return r.ok() ? r.value() : nullptr;
      };
      // Distinct slots, positions, lists; the store's pages (host memory), random bytes.
      std::vector<int32_t> slots(static_cast<size_t>(batch));
      std::vector<int32_t> all_slots(max_slots);
      for (int i = 0; i < max_slots; ++i) all_slots[i] = i;
      std::shuffle(all_slots.begin(), all_slots.end(), rng);
      for (int32_t b = 0; b < batch; ++b) slots[b] = all_slots[b];
      std::vector<int64_t> positions(static_cast<size_t>(batch * layers));
      std::vector<int32_t> list(static_cast<size_t>(items * cap), 0), count(static_cast<size_t>(items));
      std::vector<void*> pages(static_cast<size_t>(tables * max_pages), nullptr);
      std::vector<void*> owned;
      std::vector<uint16_t> vmap(static_cast<size_t>(tables * max_n), 0xffff);
      std::vector<unsigned long long> hmap(static_cast<size_t>(tables) << hash_log2, ~0ull);
      for (int32_t b = 0; b < batch; ++b) {
        const int64_t n = 1 + static_cast<int64_t>(rng() % max_n);
        positions[static_cast<size_t>(b * layers + layer)] = n - 1;
        for (int32_t h = 0; h < hkv; ++h) {
          const int64_t i = int64_t{b} * hkv + h;
          const int64_t t = (int64_t{slots[b]} * layers + layer) * hkv + h;
          count[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % (cap + 1));
          for (int64_t j = 0; j < count[static_cast<size_t>(i)]; ++j) {
            list[static_cast<size_t>(i * cap + j)] = static_cast<int32_t>(rng() % static_cast<uint64_t>(n));
          }
          for (int64_t p = 0; p < (n + page_tokens - 1) / page_tokens; ++p) {
            void* page = alloc(2 * page_tokens * row_bytes, true);
            ASSERT_NE(page, nullptr);
            owned.push_back(page);
            auto* bytes = static_cast<uint8_t*>(page);
            for (size_t x = 0; x < 2 * page_tokens * row_bytes; ++x) bytes[x] = static_cast<uint8_t>(rng());
            pages[static_cast<size_t>(t * max_pages + p)] = page;
          }
          // A third of the positions banked; in a hash map, a tombstone or two on the way.
          for (int64_t pos = 0; pos < n; ++pos) {
            if (rng() % 3 != 0) continue;
            if (!hash) {
              vmap[static_cast<size_t>(t * max_n + pos)] = static_cast<uint16_t>(rng() % 1000);
              continue;
            }
            unsigned long long* table = hmap.data() + (t << hash_log2);
            const uint32_t mask = (1u << hash_log2) - 1;
            uint32_t e = HashPageMap::Bucket(static_cast<int32_t>(pos), hash_log2);
            while (table[e] != ~0ull) e = (e + 1) & mask;
            if (rng() % 8 == 0) {  // a tombstone on the probe's way: the lookup goes past it
              table[e] = 0xFFFFFFFEFFFFFFFFull;
              while (table[e] != ~0ull) e = (e + 1) & mask;
            }
            table[e] = (static_cast<unsigned long long>(pos) << 32) | (rng() % 1000);
          }
        }
      }
      const size_t stage_bytes = static_cast<size_t>(items * cap) * 2 * row_bytes;
      std::vector<uint8_t> stage0(stage_bytes);
      for (auto& x : stage0) x = static_cast<uint8_t>(rng());
      void* d_slots = alloc(slots.size() * 4, false);
      void* d_pos = alloc(positions.size() * 8, false);
      void* d_list = alloc(list.size() * 4, false);
      void* d_count = alloc(count.size() * 4, false);
      void* d_pages = alloc(pages.size() * sizeof(void*), false);
      void* d_vmap = alloc(vmap.size() * 2, false);
      void* d_hmap = alloc(hmap.size() * 8, false);
      void* d_stage = alloc(stage_bytes, false);
      ASSERT_TRUE(d_slots && d_pos && d_list && d_count && d_pages && d_vmap && d_hmap && d_stage);
      StreamHandle s = dev->default_stream();
      ASSERT_TRUE(dev->CopyAsync(d_slots, slots.data(), slots.size() * 4, s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_pos, positions.data(), positions.size() * 8, s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_list, list.data(), list.size() * 4, s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_count, count.data(), count.size() * 4, s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_pages, pages.data(), pages.size() * sizeof(void*), s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_vmap, vmap.data(), vmap.size() * 2, s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_hmap, hmap.data(), hmap.size() * 8, s).ok());
      ASSERT_TRUE(dev->CopyAsync(d_stage, stage0.data(), stage_bytes, s).ok());
      DecodeStepArgs a;
      a.params = AttnParams{1, head_dim, DType::kBF16, 1.0f};
      a.batch = batch;
      a.num_kv_heads = hkv;
      a.num_layers = layers;
      a.layer = layer;
      a.sink = sink;
      a.window = window;
      a.mode = StepRowMode::kList;
      a.slots = static_cast<const int32_t*>(d_slots);
      a.positions = static_cast<const int64_t*>(d_pos);
      a.store.pages = static_cast<void* const*>(d_pages);
      a.store.max_pages = max_pages;
      a.store.page_tokens = page_tokens;
      a.list = static_cast<int32_t*>(d_list);
      a.list_count = static_cast<int32_t*>(d_count);
      a.list_cap = cap;
      if (hash) {
        a.bank.hmap = static_cast<const unsigned long long*>(d_hmap);
        a.bank.hash_log2 = hash_log2;
      } else {
        a.bank.vmap = static_cast<const uint16_t*>(d_vmap);
        a.bank.max_positions = max_n;
      }
      a.bank.stage = static_cast<char*>(d_stage);
      ASSERT_TRUE(dev->PrefetchListRows(a, s).ok());
      std::vector<uint8_t> stage(stage_bytes);
      ASSERT_TRUE(dev->CopyAsync(stage.data(), d_stage, stage_bytes, s).ok());
      ASSERT_TRUE(dev->SynchronizeStream(s).ok());
      // The rule.
      std::vector<uint8_t> want = stage0;
      int64_t misses = 0;
      for (int64_t i = 0; i < items; ++i) {
        const int32_t b = static_cast<int32_t>(i / hkv), h = static_cast<int32_t>(i % hkv);
        const int64_t n = positions[static_cast<size_t>(b * layers + layer)] + 1;
        const int64_t t = (int64_t{slots[b]} * layers + layer) * hkv + h;
        for (int64_t j = 0; j < count[static_cast<size_t>(i)]; ++j) {
          const int32_t pos = list[static_cast<size_t>(i * cap + j)];
          if (pos < sink || pos >= n - window) continue;
          bool hit = false;
          if (hash) {
            const unsigned long long* table = hmap.data() + (t << hash_log2);
            for (size_t e = 0; e < (size_t{1} << hash_log2); ++e) {
              hit = hit || (table[e] != ~0ull && static_cast<int32_t>(table[e] >> 32) == pos);
            }
          } else {
            hit = vmap[static_cast<size_t>(t * max_n + pos)] != 0xffff;
          }
          if (hit) continue;
          ++misses;
          const auto* page = static_cast<const uint8_t*>(pages[static_cast<size_t>(t * max_pages + pos / page_tokens)]);
          const size_t off = static_cast<size_t>(pos % page_tokens);
          uint8_t* dst = want.data() + static_cast<size_t>(i * cap + j) * 2 * row_bytes;
          std::memcpy(dst, page + off * row_bytes, row_bytes);
          std::memcpy(dst + row_bytes, page + (page_tokens + off) * row_bytes, row_bytes);
        }
      }
      if (trial > 1) EXPECT_GT(misses, 0);
      EXPECT_TRUE(stage == want) << "trial " << trial << (hash ? " (hash map)" : " (vector map)");
      for (void* p : {d_slots, d_pos, d_list, d_count, d_pages, d_vmap, d_hmap, d_stage}) dev->FreeDevice(p);
      for (void* p : owned) dev->FreeHost(p);
    }
  }
}

// Route auto splits a device selection's misses with the CPU (forced here: RuntimeConfig::split_share);
// the outputs equal route gpu's (every miss read by the device) to fp32 rounding, the selections
// are the same, every layer step counts as split, and the CPU attended exactly its rule's share
// of the misses (from LastSelection: the positions neither sinks nor in the window).
TEST(SchedulerSplit, OutputsEqualTheGpuRouteAndTheCpuTakesItsShare) {
  for (const char* policy : {"oracle", "quest", "sparcas", "kvpop", "hip"}) {
    for (const char* share : {"0.5", "1"}) {
      SCOPED_TRACE(std::string(policy) + " share " + share);
      RuntimeConfig c = PlanConfig(policy, 2);
      c.policy.budget_tokens = 64;
      c.cpu_threads = 2;
      RuntimeConfig g = c;
      g.route = Route::kGpu;
      std::unique_ptr<Runtime> split, gpu;
      {
        RuntimeConfig s = c;
        s.split_share = std::stod(share);
        split = Make(s);
      }
      gpu = Make(g);
      ASSERT_TRUE(split && gpu);
      Feeder f(c, 91);
      const std::vector<SequenceId> seqs = {3, 4};
      for (SequenceId s : seqs) {
        ASSERT_TRUE(split->AddSequence(s).ok());
        ASSERT_TRUE(gpu->AddSequence(s).ok());
      }
      f.Prefill({split.get(), gpu.get()}, 3, 250);
      f.Prefill({split.get(), gpu.get()}, 4, 170);
      const int32_t q10 = std::string(share) == "1" ? 1024 : 512;
      for (int t = 0; t < 3; ++t) {
        split->ResetStats();
        ASSERT_TRUE(split->PlanDecode(seqs).ok());
        ASSERT_TRUE(gpu->PlanDecode(seqs).ok());
        for (int l = 0; l < c.model.num_layers; ++l) {
          Feeder::Step in = f.Make(2);
          std::vector<float> out_split, out_gpu;
          ASSERT_TRUE(f.Decode(*split, seqs, l, in, out_split).ok());
          ASSERT_TRUE(f.Decode(*gpu, seqs, l, in, out_gpu).ok());
          double err = 0, ref = 0;
          for (size_t i = 0; i < out_gpu.size(); ++i) {
            err = std::max(err, static_cast<double>(std::fabs(out_split[i] - out_gpu[i])));
            ref = std::max(ref, static_cast<double>(std::fabs(out_gpu[i])));
          }
          EXPECT_LE(err, 1e-5 * std::max(1.0, ref)) << "step " << t << " layer " << l;
        }
        const Stats st = split->GetStats();
        EXPECT_EQ(st.decode_split, c.model.num_layers);
        int64_t want_cpu = 0;
        for (SequenceId s : seqs) {
          for (int l = 0; l < c.model.num_layers; ++l) {
            auto n = split->SequenceLength(s, l);
            ASSERT_TRUE(n.ok());
            for (int h = 0; h < c.model.num_kv_heads; ++h) {
              auto a = split->LastSelection(s, l, h), b = gpu->LastSelection(s, l, h);
              ASSERT_TRUE(a.ok() && b.ok());
              EXPECT_EQ(a.value(), b.value());
              int64_t misses = 0;
              for (int32_t p : a.value()) {
                misses += p >= c.tiers.sink_tokens && p < n.value() - c.tiers.window_tokens;
              }
              want_cpu += SplitCpuRows(misses, q10);
            }
          }
        }
        EXPECT_GT(want_cpu, 0);
        EXPECT_EQ(st.rows_cpu, want_cpu) << "step " << t;
      }
      EXPECT_EQ(gpu->GetStats().decode_split, 0);
    }
  }
}

// Without the override the cost model decides: no split where the CPU's share is too small to pay
// for its hand-over (RuntimeConfig::split_min_us, 30 us), the model's share (cpu / (cpu + pcie) of
// the misses) where it is not; route gpu and async_cpu 0 never split, nor does a bank.
TEST(SchedulerSplit, TheCostModelDecidesWhereTheShareIsWorthIt) {
  auto run = [&](RuntimeConfig c) -> Stats {
    auto rt = Make(c);
    EXPECT_TRUE(rt);
    if (!rt) return Stats{};
    Feeder f(c, 5);
    const std::vector<SequenceId> seqs = {1};
    EXPECT_TRUE(rt->AddSequence(1).ok());
    f.Prefill({rt.get()}, 1, 250);
    rt->ResetStats();
    EXPECT_TRUE(rt->PlanDecode(seqs).ok());
    for (int l = 0; l < c.model.num_layers; ++l) {
      Feeder::Step in = f.Make(1);
      std::vector<float> out;
      EXPECT_TRUE(f.Decode(*rt, seqs, l, in, out).ok());
    }
    return rt->GetStats();
  };
  RuntimeConfig c = PlanConfig("oracle", 2);
  c.policy.budget_tokens = 128;
  EXPECT_EQ(run(c).decode_split, 0);  // ~117 misses an item: under 1 us of CPU work
  {
    c.split_min_us = 0.0;
    const Stats s = run(c);
    EXPECT_EQ(s.decode_split, c.model.num_layers);
    EXPECT_GT(s.rows_cpu, 0);
    RuntimeConfig g = c;
    g.route = Route::kGpu;
    EXPECT_EQ(run(g).decode_split, 0);
    RuntimeConfig b = c;
    b.tiers.bank_slots = 256;
    EXPECT_EQ(run(b).decode_split, 0);
    RuntimeConfig off = c;
    off.async_cpu = 0;
    EXPECT_EQ(run(off).decode_split, 0);
  }
}

class DeviceSelected : public ::testing::TestWithParam<std::string> {};

TEST_P(DeviceSelected, EqualsTheHostPolicy) {
  // The selection runs inside the planned step (DeviceSelector::Select; quest's page bounds kept by
  // the device): the same positions as the policy's host Select (taken when a token bank is
  // configured) and the same outputs.
  // "hip": HiP's masks on the r_m clock alone (drift 0), a due one served from the next step
  // (lag 1, built beside the step); "X:lag0": each mask served from the step that builds it (the
  // default lag); "X:dense16": HiP's dense layers exact (the default: 4-bit);
  // "sparcas:raw": SparCas without its channel smoothing (smooth=0; the default smooths);
  // "hip:drift", "hip:drift_lag0": HiP's masks rebuilt when the query drifts (drift 0.75, no
  // interval within the test), the query moving as decoding's does (a cosine of 0.9 a step).
  const std::string param = GetParam();
  const size_t colon = param.find(':');
  const std::string name = param.substr(0, colon);
  const std::string variant = colon == std::string::npos ? "" : param.substr(colon + 1);
  RuntimeConfig c = PlanConfig(name, 2);
  // "kvpop:mlp": a scorer of random weights (the default kvpop has no weights file: recency).
  if (variant == "mlp") c.policy.name = testing_util::RegisterKvpopMlpTestPolicy();
  if (variant == "dense16") c.policy.params["dense_bits"] = 16;
  if (variant == "raw") c.policy.params["smooth"] = 0;  // SparCas's 4-bit rows of the raw keys
  const bool drift = variant.rfind("drift", 0) == 0;
  // "psaw+X": PrHS's depth window hides [sink, 0.16 n) at layer 1; the device filters its list.
  // "xl+X": layer 1 takes layer 0's list (xl.start 0.5 of 2 layers); the device copies it.
  const std::string base = name.substr(name.rfind('+') + 1);
  const bool psaw = name.rfind("psaw+", 0) == 0, xl = name.rfind("xl+", 0) == 0;
  if (psaw) c.policy.params["psaw.start"] = 0;
  if (base == "quest") c.policy.params["page"] = 4;  // several pages, some cut
  if (base == "sparcas") {
    c.policy.params["u"] = 3;  // dimensions re-chosen (and keys re-gathered) within the test
    c.policy.params["dense_layers"] = 1;
  }
  if (base == "hip") {
    c.policy.params["r_m"] = 3;  // masks kept, then rebuilt, within the test
    c.policy.params["dense_layers"] = 1;
    c.policy.params["bk"] = 3;  // blocks cut at the offloaded range's end
    c.policy.params["lag"] = variant == "lag0" || variant == "drift_lag0" ? 0 : 1;
    c.policy.params["drift"] = drift ? 0.75 : 0.0;
    if (drift) c.policy.params["r_m"] = 100;
  }
  c.route = Route::kGpu;
  RuntimeConfig host = c;
  host.tiers.bank_slots = 16;  // a bank keeps the runtime on its host-selecting path
  auto dev = Make(c), ref = Make(host);
  ASSERT_TRUE(dev && ref);
  EXPECT_TRUE(dev->decode_is_capture_safe());
  EXPECT_FALSE(ref->decode_is_capture_safe());
  Feeder f(c, 11);
  if (drift) f.carry = 0.9;
  // drift: the mask's part of layer 1's lists (positions of sequence 4's first offloaded range) at
  // the last step, and how often it changed from one step to the next.
  std::map<std::pair<SequenceId, int>, std::vector<int32_t>> masked;
  int mask_changes = 0, mask_steps = 0;
  const std::vector<SequenceId> seqs = {2, 6, 4};
  for (SequenceId s : seqs) {
    ASSERT_TRUE(dev->AddSequence(s).ok());
    ASSERT_TRUE(ref->AddSequence(s).ok());
  }
  f.Prefill({dev.get(), ref.get()}, 2, 97);
  f.Prefill({dev.get(), ref.get()}, 6, 17);  // fewer than the budget (24): every position
  f.Prefill({dev.get(), ref.get()}, 4, 250);
  for (int t = 0; t < 6; ++t) {
    ASSERT_TRUE(dev->PlanDecode(seqs).ok());
    for (int l = 0; l < c.model.num_layers; ++l) {
      Feeder::Step s = f.Make(3, l);
      std::vector<float> a, b;
      ASSERT_TRUE(f.Decode(*dev, seqs, l, s, a).ok());
      ASSERT_TRUE(f.Decode(*ref, seqs, l, s, b).ok());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5) << "step " << t << " at " << i;
      EXPECT_GT(NormOf(a), 0.0);
      for (SequenceId sq : seqs) {
        for (int h = 0; h < c.model.num_kv_heads; ++h) {
          auto x = dev->LastSelection(sq, l, h), y = ref->LastSelection(sq, l, h);
          ASSERT_TRUE(x.ok() && y.ok());
          EXPECT_EQ(*x, *y) << "sequence " << sq << " layer " << l << " head " << h;
          if (drift && l == 1 && sq == 4) {
            std::vector<int32_t> m;
            for (int32_t p : *x) {
              if (p >= c.tiers.sink_tokens && p < 250 - c.tiers.window_tokens) m.push_back(p);
            }
            auto [it, first] = masked.try_emplace({sq, h}, m);
            if (!first) {
              ++mask_steps;
              mask_changes += it->second != m;
              it->second = m;
            }
          }
          const int64_t n = *dev->SequenceLength(sq, l);
          if (base == "hip" && !psaw) {  // floor(k_off / bk) blocks, the last one maybe cut
            EXPECT_LE(static_cast<int64_t>(x->size()), std::min<int64_t>(n, c.policy.budget_tokens));
            EXPECT_GE(static_cast<int64_t>(x->size()), std::min<int64_t>(n, c.policy.budget_tokens - 2 * 3));
          } else {
            EXPECT_EQ(static_cast<int64_t>(x->size()), std::min<int64_t>(n, c.policy.budget_tokens));
          }
          EXPECT_TRUE(std::is_sorted(x->begin(), x->end()));
          if (xl && l == 1) {
            EXPECT_EQ(*x, *dev->LastSelection(sq, 0, h)) << "layer 1 shares layer 0's list";
          }
          if (psaw && l == 1) {  // nothing of [sink, floor((1 - 0.7^0.5) n))
            const auto hide = static_cast<int64_t>(std::floor((1.0 - std::pow(0.7, 0.5)) * n));
            for (int32_t p : *x) EXPECT_TRUE(p < c.tiers.sink_tokens || p >= hide) << p;
          }
        }
      }
    }
  }
  if (drift) {  // with r_m 100 only the drift rebuilds: some steps, not every one
    EXPECT_GT(mask_changes, 0);
    EXPECT_LT(mask_changes, mask_steps);
  }
  const Stats st = dev->GetStats();
  EXPECT_EQ(st.host_syncs, 0);
  EXPECT_EQ(st.decode_planned, 6 * c.model.num_layers);
  if (base == "hip") {
    // The host counts HiP's rows without reading the device's masks: up to bk - 1 more a list
    // where a mask holds the offloaded range's last block, cut short (policies/hip/mask.h).
    EXPECT_GE(st.rows_selected, ref->GetStats().rows_selected);
    EXPECT_LE(st.rows_selected, ref->GetStats().rows_selected + 2 * 6 * 3 * 2);
  } else {
    EXPECT_EQ(st.rows_selected, ref->GetStats().rows_selected);
  }
}

// KVpop's paper checks through the Runtime's device selection (host backend): the zero scorer
// (no weights) keeps the most recent eligible tokens, so its lists and outputs are streaming's at
// the same budget; with a scorer, every stored position is retained in the list or evicted for
// good (it never comes back), the retained are at most k, and the store keeps the evicted rows.
TEST(KvpopDevice, ZeroScorerIsStreamingAndEvictedNeverReturn) {
  RuntimeConfig c = PlanConfig("kvpop", 2);
  c.route = Route::kGpu;
  RuntimeConfig s = c;
  s.policy.name = "streaming";
  RuntimeConfig m = c;
  m.policy.name = testing_util::RegisterKvpopMlpTestPolicy();
  auto kv = Make(c), st = Make(s), mlp = Make(m);
  ASSERT_TRUE(kv && st && mlp);
  EXPECT_TRUE(kv->decode_is_capture_safe());
  Feeder f(c, 5);
  const std::vector<SequenceId> seqs = {1, 2};
  for (SequenceId q : seqs) {
    for (Runtime* r : {kv.get(), st.get(), mlp.get()}) ASSERT_TRUE(r->AddSequence(q).ok());
  }
  f.Prefill({kv.get(), st.get(), mlp.get()}, 1, 130);
  f.Prefill({kv.get(), st.get(), mlp.get()}, 2, 9);
  const int64_t k = c.policy.budget_tokens - c.tiers.sink_tokens - c.tiers.window_tokens;
  // Per (sequence, layer, head): every position that has ever left the window and is not retained.
  std::map<std::tuple<SequenceId, int, int>, std::set<int32_t>> gone;
  for (int t = 0; t < 40; ++t) {
    ASSERT_TRUE(kv->PlanDecode(seqs).ok());
    ASSERT_TRUE(mlp->PlanDecode(seqs).ok());
    for (int l = 0; l < c.model.num_layers; ++l) {
      Feeder::Step step = f.Make(2);
      std::vector<float> a, b, x;
      ASSERT_TRUE(f.Decode(*kv, seqs, l, step, a).ok());
      ASSERT_TRUE(f.Decode(*st, seqs, l, step, b).ok());
      ASSERT_TRUE(f.Decode(*mlp, seqs, l, step, x).ok());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5) << "step " << t;
      for (SequenceId q : seqs) {
        const int64_t n = *kv->SequenceLength(q, l);
        for (int h = 0; h < c.model.num_kv_heads; ++h) {
          EXPECT_EQ(*kv->LastSelection(q, l, h), *st->LastSelection(q, l, h)) << "step " << t;
          const std::vector<int32_t> sel = *mlp->LastSelection(q, l, h);
          const int64_t sink = c.tiers.sink_tokens, off_hi = std::max<int64_t>(sink, n - c.tiers.window_tokens);
          std::set<int32_t> retained;
          for (int32_t p : sel) {
            if (p >= sink && p < off_hi) retained.insert(p);
          }
          EXPECT_LE(static_cast<int64_t>(retained.size()), k);
          std::set<int32_t>& g = gone[{q, l, h}];
          for (int32_t p : retained) EXPECT_EQ(g.count(p), 0u) << "position " << p << " came back";
          for (int32_t p = static_cast<int32_t>(sink); p < off_hi; ++p) {
            if (retained.count(p) == 0) g.insert(p);
          }
          // Retained and evicted are every eligible position, each once.
          EXPECT_EQ(static_cast<int64_t>(retained.size() + g.size()), off_hi - sink);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, DeviceSelected,
                         ::testing::Values("oracle", "quest", "sparcas", "sparcas:raw", "hip", "hip:lag0",
                                           "hip:dense16", "hip:drift", "hip:drift_lag0", "kvpop", "kvpop:mlp",
                                           "psaw+oracle", "psaw+quest", "psaw+sparcas", "psaw+hip",
                                           "psaw+kvpop", "xl+oracle", "xl+quest", "xl+sparcas",
                                           "xl+hip", "xl+kvpop"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '+', '_');
                           std::replace(name.begin(), name.end(), ':', '_');
                           return name;
                         });

// Sixteen sequences of mixed lengths (shorter than the resident tiers, about the budget, many
// times it) share one planned step: every sequence's output and selection are what it gets
// decoded alone in a batch of one, step after step, for each placement's policies.
class Batch16 : public ::testing::TestWithParam<std::string> {};

TEST_P(Batch16, MixedLengthsEqualEachSequenceAlone) {
  RuntimeConfig c = PlanConfig(GetParam(), 2);
  c.capacity.max_sequences = 16;
  c.capacity.max_batch = 16;
  c.capacity.max_prefill_chunk = 512;  // each prompt in one call
  c.cpu_threads = 2;
  if (GetParam() == "lfps") c.route = Route::kAuto;  // the CPU-placed planned step
  if (GetParam() == "hip") c.policy.params["r_m"] = 2;  // masks rebuilt within the test
  auto batched = Make(c), alone = Make(c);
  ASSERT_TRUE(batched && alone);
  Feeder f(c, 23);
  std::vector<SequenceId> seqs;
  for (int i = 0; i < 16; ++i) {
    const SequenceId s = 100 + 7 * i;
    seqs.push_back(s);
    ASSERT_TRUE(batched->AddSequence(s).ok());
    ASSERT_TRUE(alone->AddSequence(s).ok());
    f.Prefill({batched.get(), alone.get()}, s, 3 + 29 * i);  // 3 .. 438 tokens
  }
  const ModelShape& m = c.model;
  const int64_t qrow = int64_t{m.num_q_heads} * m.head_dim, kvrow = int64_t{m.num_kv_heads} * m.head_dim;
  const auto row = [](const std::vector<float>& x, int64_t b, int64_t len) {
    return std::vector<float>(x.begin() + b * len, x.begin() + (b + 1) * len);
  };
  for (int t = 0; t < 4; ++t) {
    ASSERT_TRUE(batched->PlanDecode(seqs).ok());
    std::vector<Feeder::Step> in;
    std::vector<std::vector<float>> out(static_cast<size_t>(m.num_layers));
    for (int l = 0; l < m.num_layers; ++l) {
      in.push_back(f.Make(16));
      ASSERT_TRUE(f.Decode(*batched, seqs, l, in.back(), out[l]).ok()) << "step " << t << " layer " << l;
    }
    for (int b = 0; b < 16; ++b) {
      const std::vector<SequenceId> one = {seqs[b]};
      ASSERT_TRUE(alone->PlanDecode(one).ok());
      for (int l = 0; l < m.num_layers; ++l) {
        SCOPED_TRACE("step " + std::to_string(t) + " sequence " + std::to_string(b) + " layer " +
                     std::to_string(l));
        Feeder::Step s1{row(in[l].q, b, qrow), row(in[l].k, b, kvrow), row(in[l].v, b, kvrow)};
        std::vector<float> o1;
        ASSERT_TRUE(f.Decode(*alone, one, l, s1, o1).ok());
        const std::vector<float> want = row(out[l], b, qrow);
        for (int64_t i = 0; i < qrow; ++i) ASSERT_NEAR(o1[i], want[i], 1e-5) << "at " << i;
        EXPECT_GT(NormOf(o1), 0.0);
        for (int h = 0; h < m.num_kv_heads; ++h) {
          auto x = batched->LastSelection(seqs[b], l, h), y = alone->LastSelection(seqs[b], l, h);
          ASSERT_TRUE(x.ok() && y.ok());
          EXPECT_EQ(*x, *y) << "head " << h;
        }
      }
    }
  }
  for (int b = 0; b < 16; ++b) EXPECT_EQ(*batched->SequenceLength(seqs[b], 0), 3 + 29 * b + 4);
  EXPECT_EQ(batched->GetStats().decode_tokens, 4 * m.num_layers * 16);  // one call a layer and step
}

INSTANTIATE_TEST_SUITE_P(Policies, Batch16,
                         ::testing::Values("dense", "streaming", "oracle", "quest", "sparcas", "hip",
                                           "kvpop", "lfps"));

TEST(HostStore, BytesAtCreateAreReservedUpFrontAndServeThePrompt) {
  RuntimeConfig c = PlanConfig("dense", 2);
  const int64_t page_bytes = int64_t{2} * 256 * c.model.head_dim * 2;  // 256-token pages, bf16
  c.capacity.host_bytes_at_create = 40 * page_bytes + 1;
  auto rt = Make(c);
  ASSERT_TRUE(rt);
  const int64_t reserved = rt->GetStats().host_bytes_reserved;
  EXPECT_GE(reserved, 41 * page_bytes);
  Feeder f(c, 5);
  ASSERT_TRUE(rt->AddSequence(1).ok());
  f.Prefill({rt.get()}, 1, 250);  // 1 page per (layer, head): 4 pages, all from the reserve
  EXPECT_EQ(rt->GetStats().host_bytes_reserved, reserved);
  // Bad values are refused with the field named.
  RuntimeConfig bad = c;
  bad.capacity.host_bytes_at_create = -1;
  auto r = Runtime::Create(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("host_bytes_at_create"), std::string::npos);
  bad.capacity.host_bytes_at_create = 100;
  bad.capacity.max_host_bytes = 50;
  EXPECT_EQ(Runtime::Create(bad).status().code(), StatusCode::kInvalidArgument);
}

TEST(PlannedStep, BudgetSmallerThanTheResidentTiersStillDecodes) {
  // lfps always attends its sinks and window: a budget below them must not overflow the
  // runtime's per-item capacity (it used to fail at the first decode with an internal error).
  RuntimeConfig c = PlanConfig("lfps", 1);
  c.policy.budget_tokens = 4;  // sinks 3 + window 8 = 11 > 4
  auto rt = Make(c);
  ASSERT_TRUE(rt);
  Feeder f(c, 9);
  const std::vector<SequenceId> one = {2};
  ASSERT_TRUE(rt->AddSequence(2).ok());
  f.Prefill({rt.get()}, 2, 60);
  for (int step = 0; step < 3; ++step) {
    Feeder::Step s = f.Make(1);
    std::vector<float> out;
    const Status st = f.Decode(*rt, one, 0, s, out);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_GT(NormOf(out), 0.0);
  }
}

TEST(PlannedStep, SelectKeyBytesAreWhatTheDeviceSelectionReads) {
  // One layer of 2 KV heads, head_dim 32 in bf16 (a K row is 64 bytes), sinks 3, window 8; one
  // decode step after a 200-token prompt: n = 201, offloaded range [3, 193).
  struct Case {
    const char* policy;
    std::map<std::string, double> params;
    int64_t budget;
    int64_t want;  // bytes over both KV heads
  };
  constexpr int64_t kRow = 32 * 2, kHeads = 2, kN = 201;
  const std::vector<Case> cases = {
      {"oracle", {}, 24, kN * kRow * kHeads},                       // every key
      {"oracle", {}, 1000, kN * kRow * kHeads},                     // ranks even when all fit
      {"quest", {}, 24, 13 * 2 * kRow * kHeads},                    // pages 0..12: min and max rows
      {"quest", {{"page", 32}}, 24, 7 * 2 * kRow * kHeads},         // pages 0..6
      {"quest", {}, 1000, 0},                                       // nothing to rank
      {"sparcas", {{"d_b", 4}, {"dense_layers", 0}, {"bits", 16}}, 24, kN * 4 * 2 * kHeads},
      {"sparcas", {{"d_b", 4}, {"dense_layers", 1}, {"bits", 16}}, 24, kN * 32 * 2 * kHeads},  // every dimension
      {"sparcas", {{"d_b", 4}, {"dense_layers", 0}, {"bits", 16}}, 1000, 0},
      // 4-bit rows: d_b 16 is 2 words and the f32 scale, 12 bytes; the dense layer keeps the KV dtype.
      {"sparcas", {{"d_b", 16}, {"dense_layers", 0}}, 24, kN * 12 * kHeads},
      {"sparcas", {{"dense_layers", 1}}, 24, kN * 32 * 2 * kHeads},
      {"streaming", {}, 24, 0},                                     // no device selection
      {"dense", {}, 24, 0},
  };
  std::map<std::string, int64_t> got;  // policy -> bytes, budget 24, first case of each
  for (const Case& cs : cases) {
    RuntimeConfig c = PlanConfig(cs.policy, 1);
    c.policy.params = cs.params;
    c.policy.budget_tokens = cs.budget;
    auto rt = Make(c);
    ASSERT_TRUE(rt) << cs.policy;
    Feeder f(c, 3);
    ASSERT_TRUE(rt->AddSequence(2).ok());
    f.Prefill({rt.get()}, 2, kN - 1);
    const int64_t before = rt->GetStats().select_key_bytes;
    Feeder::Step s = f.Make(1);
    std::vector<float> out;
    ASSERT_TRUE(f.Decode(*rt, {2}, 0, s, out).ok()) << cs.policy;
    const int64_t bytes = rt->GetStats().select_key_bytes - before;
    EXPECT_EQ(bytes, cs.want) << cs.policy << " budget " << cs.budget << " params " << cs.params.size();
    if (cs.budget == 24) got.emplace(cs.policy, bytes);
  }
  // SparCas's paper check: its key scan reads head_dim / d_b = 32 / 4 times fewer bytes than the
  // oracle's full-key scan.
  EXPECT_EQ(got["oracle"], 8 * got["sparcas"]);
}

// xl+ (start 0.5 of 2 layers): layer 1 takes layer 0's list, so its device selection ranks
// nothing (DecodeStepArgs::select_skip_ranking, only quest's bounds and sparcas's compact rows kept
// current): a step reads layer 0's keys only, half of what the plain policy reads. Outputs and
// selections are the plain policy's at layer 0 and layer 0's at layer 1 (DeviceSelected checks
// them against the host wrapper).
TEST(PlannedStep, XlSharingLayersRankNothing) {
  for (const std::string inner : {"oracle", "quest", "sparcas"}) {
    int64_t bytes[2] = {0, 0};
    std::vector<int32_t> sel[2][2];  // [wrapped][layer]
    for (int w = 0; w < 2; ++w) {
      RuntimeConfig c = PlanConfig(w == 1 ? "xl+" + inner : inner, 2);
      c.policy.budget_tokens = 24;
      if (inner == "sparcas") c.policy.params["dense_layers"] = 0;
      auto rt = Make(c);
      ASSERT_TRUE(rt) << c.policy.name;
      Feeder f(c, 5);
      ASSERT_TRUE(rt->AddSequence(2).ok());
      f.Prefill({rt.get()}, 2, 200);
      const int64_t before = rt->GetStats().select_key_bytes;
      Feeder::Step st = f.Make(1);
      std::vector<float> out;
      for (int layer = 0; layer < 2; ++layer) {
        ASSERT_TRUE(f.Decode(*rt, {2}, layer, st, out).ok()) << c.policy.name << " layer " << layer;
        auto got = rt->LastSelection(2, layer, 0);
        ASSERT_TRUE(got.ok());
        sel[w][layer] = got.value();
      }
      bytes[w] = rt->GetStats().select_key_bytes - before;
    }
    EXPECT_GT(bytes[0], 0) << inner;
    EXPECT_EQ(2 * bytes[1], bytes[0]) << inner;
    EXPECT_EQ(sel[1][0], sel[0][0]) << inner;
    EXPECT_EQ(sel[1][1], sel[1][0]) << inner;
    EXPECT_EQ(static_cast<int64_t>(sel[1][1].size()), 24) << inner;
  }
}

TEST(PlannedStep, TimeDeviceSelectTimesOnlyDeviceSelections) {
  // Off at Create: nothing timed. On: every Decode of a device-selecting policy adds its
  // selection's time, a host-selecting one adds none; ResetStats clears it; off stops it.
  for (const char* policy : {"quest", "sparcas", "oracle", "streaming"}) {
    const bool device_selects = std::string(policy) != "streaming";
    RuntimeConfig c = PlanConfig(policy, 2);
    c.policy.budget_tokens = 24;
    auto rt = Make(c);
    ASSERT_TRUE(rt) << policy;
    Feeder f(c, 5);
    ASSERT_TRUE(rt->AddSequence(3).ok());
    f.Prefill({rt.get()}, 3, 150);
    auto step = [&] {
      ASSERT_TRUE(rt->PlanDecode(std::vector<SequenceId>{3}).ok());
      for (int l = 0; l < c.model.num_layers; ++l) {
        Feeder::Step s = f.Make(1);
        std::vector<float> out;
        ASSERT_TRUE(f.Decode(*rt, {3}, l, s, out).ok()) << policy;
      }
    };
    step();
    EXPECT_EQ(rt->GetStats().ms_select_device, 0.0) << policy;
    ASSERT_TRUE(rt->TimeDeviceSelect(true).ok());
    for (int i = 0; i < 3; ++i) step();
    const double timed = rt->GetStats().ms_select_device;
    if (device_selects) {
      EXPECT_GT(timed, 0.0) << policy;
    } else {
      EXPECT_EQ(timed, 0.0) << policy;
    }
    EXPECT_NE(rt->GetStats().ToJson().find("\"ms_select_device\":"), std::string::npos);
    rt->ResetStats();
    EXPECT_EQ(rt->GetStats().ms_select_device, 0.0) << policy;
    ASSERT_TRUE(rt->TimeDeviceSelect(false).ok());
    step();
    EXPECT_EQ(rt->GetStats().ms_select_device, 0.0) << policy;
  }
}

TEST(Append, StoresWhatPrefillStoresWithoutAttention) {
  for (const char* policy : {"dense", "streaming", "oracle"}) {
    const RuntimeConfig c = PlanConfig(policy, 2);
    auto appended = Make(c), prefilled = Make(c);
    Feeder f(c, 21);
    const ModelShape& m = c.model;
    const std::vector<SequenceId> one = {4};
    ASSERT_TRUE(appended->AddSequence(4).ok());
    ASSERT_TRUE(prefilled->AddSequence(4).ok());
    const int64_t t = 45;
    for (int l = 0; l < m.num_layers; ++l) {
      auto q = f.Random(t * m.num_q_heads * m.head_dim);
      auto k = f.Random(t * m.num_kv_heads * m.head_dim), v = f.Random(t * m.num_kv_heads * m.head_dim);
      std::vector<float> out(q.size());
      ASSERT_TRUE(appended->Append(4, l, f.View(k, t, m.num_kv_heads), f.View(v, t, m.num_kv_heads)).ok());
      ASSERT_TRUE(prefilled->Prefill(4, l, f.View(q, t, m.num_q_heads), f.View(k, t, m.num_kv_heads),
                                     f.View(v, t, m.num_kv_heads), f.View(out, t, m.num_q_heads)).ok());
      EXPECT_EQ(*appended->SequenceLength(4, l), t);
    }
    for (int step = 0; step < 12; ++step) {
      for (int l = 0; l < m.num_layers; ++l) {
        Feeder::Step s = f.Make(1);
        std::vector<float> a, b;
        ASSERT_TRUE(f.Decode(*appended, one, l, s, a).ok());
        ASSERT_TRUE(f.Decode(*prefilled, one, l, s, b).ok());
        ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << policy;
      }
    }
    // Bad input changes nothing.
    auto k = f.Random(3 * m.num_kv_heads * m.head_dim);
    EXPECT_EQ(appended->Append(4, 9, f.View(k, 3, m.num_kv_heads), f.View(k, 3, m.num_kv_heads)).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(appended->Append(99, 0, f.View(k, 3, m.num_kv_heads), f.View(k, 3, m.num_kv_heads)).code(),
              StatusCode::kNotFound);
    EXPECT_EQ(appended->Append(4, 0, f.View(k, 3, m.num_kv_heads), f.View(k, 1, m.num_kv_heads)).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(*appended->SequenceLength(4, 0), t + 12);
  }
}

// A CPU-placed policy that selects like streaming but fails while the switch is on. With
// covers_resident it declares that its selections hold every resident row (true at the budget the
// tests give it), which sends it down the planned step (runtime/cpu_step.cpp).
std::atomic<bool> g_fail{false};

class FailingPolicy final : public Policy {
 public:
  explicit FailingPolicy(bool covers_resident) : covers_resident_(covers_resident) {}
  std::string_view name() const override { return "test_failing"; }
  Placement placement() const override { return Placement::kCpu; }
  bool selection_covers_resident() const override { return covers_resident_; }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    if (g_fail.load()) return Internal("test_failing: injected failure");
    StreamingSelect(ctx.n, ctx.sink, ctx.budget, out);
    return Status::Ok();
  }

 private:
  bool covers_resident_;
};

Result<std::unique_ptr<Policy>> MakeFailing(const RuntimeConfig&) {
  return std::unique_ptr<Policy>(new FailingPolicy(false));
}
Result<std::unique_ptr<Policy>> MakeFailingCovering(const RuntimeConfig&) {
  return std::unique_ptr<Policy>(new FailingPolicy(true));
}

// name: the registered policy; planned: PlanDecode before each step; async: the CPU part on the
// runtime's thread (RuntimeConfig::async_cpu 1; on the host backend Decode still returns its
// status).
using FailingParam = std::tuple<std::string, bool, bool>;
class FailingPolicyTest : public ::testing::TestWithParam<FailingParam> {};

TEST_P(FailingPolicyTest, LeavesEverySequenceAsBeforeTheCall) {
  static const bool registered = RegisterPolicy("test_failing", MakeFailing) &&
                                 RegisterPolicy("test_failing_covering", MakeFailingCovering);
  (void)registered;
  EXPECT_FALSE(RegisterPolicy("streaming", MakeFailing));  // names are unique
  const auto& [name, planned, async] = GetParam();
  RuntimeConfig c = PlanConfig(name, 1);
  c.async_cpu = async ? 1 : 0;
  c.policy.budget_tokens = 16;  // larger than sinks + window: host rows are read too
  auto rt = Make(c), twin = Make(c);
  ASSERT_TRUE(rt && twin);
  EXPECT_FALSE(rt->decode_is_capture_safe());
  const std::vector<SequenceId> both_ids = {1, 2};
  auto plan = [&](Runtime& r) {
    if (planned) ASSERT_TRUE(r.PlanDecode(both_ids).ok());
  };
  Feeder f(c, 5);
  const std::vector<SequenceId> both = {1, 2};
  for (SequenceId s : both) {
    ASSERT_TRUE(rt->AddSequence(s).ok());
    ASSERT_TRUE(twin->AddSequence(s).ok());
  }
  f.Prefill({rt.get(), twin.get()}, 1, 40);
  f.Prefill({rt.get(), twin.get()}, 2, 23);
  std::vector<float> a, b;
  for (int t = 0; t < 3; ++t) {
    Feeder::Step s = f.Make(2);
    plan(*rt);
    plan(*twin);
    ASSERT_TRUE(f.Decode(*rt, both, 0, s, a).ok());
    ASSERT_TRUE(f.Decode(*twin, both, 0, s, b).ok());
  }
  // The failing call: only rt sees it.
  g_fail = true;
  Feeder::Step bad = f.Make(2);
  plan(*rt);
  const Status st = f.Decode(*rt, both, 0, bad, a);
  g_fail = false;
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_EQ(*rt->SequenceLength(1, 0), 43);
  EXPECT_EQ(*rt->SequenceLength(2, 0), 26);
  // Every later step attends the window rows the failed append had overwritten: outputs must
  // equal the twin's exactly.
  for (int t = 0; t < 10; ++t) {
    Feeder::Step s = f.Make(2);
    plan(*rt);
    plan(*twin);
    ASSERT_TRUE(f.Decode(*rt, both, 0, s, a).ok());
    ASSERT_TRUE(f.Decode(*twin, both, 0, s, b).ok());
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "step " << t;
    ASSERT_GT(NormOf(a), 0.1);
  }
  EXPECT_EQ(rt->GetStats().decode_planned > 0, planned && name == "test_failing_covering");
}

INSTANTIATE_TEST_SUITE_P(
    Paths, FailingPolicyTest,
    ::testing::Combine(::testing::Values("test_failing", "test_failing_covering"),
                       ::testing::Bool(), ::testing::Bool()),
    [](const ::testing::TestParamInfo<FailingParam>& info) {
      return std::get<0>(info.param) + (std::get<1>(info.param) ? "_planned" : "_unplanned") +
             (std::get<2>(info.param) ? "_async" : "");
    });

// The CPU part on the runtime's own thread (RuntimeConfig::async_cpu 1) equals the serial one
// (0) bit for bit on the host backend: lfps over planned and self-planned steps of three
// sequences of different lengths (one inside sinks + window), a sequence removed and one added
// mid-run, with the host timeline showing each layer's part as a "cpu_part" span on another
// thread than the caller's.
TEST(AsyncCpuPart, EqualsTheSerialPartExactly) {
  RuntimeConfig c = PlanConfig("lfps", 2);
  c.cpu_threads = 2;
  RuntimeConfig serial = c, async = c;
  serial.async_cpu = 0;
  async.async_cpu = 1;
  auto a = Make(async), b = Make(serial);
  ASSERT_TRUE(a && b);
  Feeder f(c, 21);
  std::vector<SequenceId> seqs = {3, 4, 5};
  for (Runtime* r : {a.get(), b.get()}) {
    for (SequenceId s : seqs) ASSERT_TRUE(r->AddSequence(s).ok());
  }
  f.Prefill({a.get(), b.get()}, 3, 150);
  f.Prefill({a.get(), b.get()}, 4, 9);
  f.Prefill({a.get(), b.get()}, 5, 70);
  const std::string path = ::testing::TempDir() + "kvferry_async_trace_test.json";
  ASSERT_TRUE(a->StartTrace(1 << 12).ok());
  for (int step = 0; step < 14; ++step) {
    if (step == 7) {  // 4 leaves, 6 comes
      for (Runtime* r : {a.get(), b.get()}) {
        ASSERT_TRUE(r->RemoveSequence(4).ok());
        ASSERT_TRUE(r->AddSequence(6).ok());
      }
      f.Prefill({a.get(), b.get()}, 6, 40);
      seqs = {3, 6, 5};
    }
    const bool planned = step % 4 != 3;
    if (planned) {
      ASSERT_TRUE(a->PlanDecode(seqs).ok());
      ASSERT_TRUE(b->PlanDecode(seqs).ok());
    }
    for (int l = 0; l < 2; ++l) {
      Feeder::Step in = f.Make(3);
      std::vector<float> oa, ob;
      ASSERT_TRUE(f.Decode(*a, seqs, l, in, oa).ok());
      ASSERT_TRUE(f.Decode(*b, seqs, l, in, ob).ok());
      ASSERT_EQ(0, std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float))) << "step " << step;
      ASSERT_GT(NormOf(oa), 0.1);
      for (SequenceId s : seqs) {
        for (int h = 0; h < c.model.num_kv_heads; ++h) {
          EXPECT_EQ(*a->LastSelection(s, l, h), *b->LastSelection(s, l, h));
        }
      }
    }
  }
  ASSERT_TRUE(a->WriteTrace(path).ok());
  const Stats sa = a->GetStats(), sb = b->GetStats();
  EXPECT_EQ(sa.decode_steps, sb.decode_steps);
  EXPECT_EQ(sa.decode_planned, sb.decode_planned);
  EXPECT_GT(sa.decode_planned, 0);
  EXPECT_EQ(sa.rows_cpu, sb.rows_cpu);
  EXPECT_GT(sa.rows_cpu, 0);
  EXPECT_EQ(sa.rows_selected, sb.rows_selected);
  EXPECT_EQ(sa.rows_resident, sb.rows_resident);
  EXPECT_EQ(sa.bytes_h2d, sb.bytes_h2d);
  EXPECT_EQ(sa.bytes_d2h, sb.bytes_d2h);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string json = ss.str();
  const std::regex re("\\{\"name\":\"(cpu_part|append)\",\"cat\":\"[a-z]+\",\"ph\":\"X\",\"pid\":1,\"tid\":([0-9]+)");
  std::set<int> part_tids, append_tids;
  int parts = 0;
  for (auto it = std::sregex_iterator(json.begin(), json.end(), re); it != std::sregex_iterator(); ++it) {
    if ((*it)[1] == "cpu_part") {
      part_tids.insert(std::stoi((*it)[2]));
      ++parts;
    } else {
      append_tids.insert(std::stoi((*it)[2]));
    }
  }
  EXPECT_GE(parts, 10 * 2);  // the planned steps' layers (self-planned ones run it too)
  ASSERT_EQ(part_tids.size(), 1u);
  ASSERT_FALSE(append_tids.empty());
  EXPECT_EQ(append_tids.count(*part_tids.begin()), 0u) << "the part ran on the caller's thread";
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvferry
