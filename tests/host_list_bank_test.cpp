// Copyright kvferry authors. Apache-2.0.
// The host half of the planned step that policies selecting on the host run with the device token
// bank on CUDA (route gpu, bank_slots > 0: runtime/decode_plan.cpp UploadHostLists,
// runtime/cpu_step.cpp SelectOnHost), tested without a GPU: the runtime runs on the host-emulated
// device posing as CUDA (what the runtime decides from Device::backend()), with a StepBank double
// that holds nothing, so the host step kernel reads every listed row from the resident tier or the
// store, as the CUDA kernel reads a bank miss. What this covers: which configurations take the
// path, the q/k/v copy to pinned memory (device tensors), the new token's store rows written on
// the host before Select, the per-layer list staging and upload, the kList step, the admission
// call after each layer, stats, LastSelection, PlanDecode, and the roll-back of a failing Select.
// The kernels and the bank itself are covered on the GPU (tests/cuda_runtime_test.cpp,
// CudaStepBank.*).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu/device.h"
#include "kvferry/kvferry.h"
#include "policies/basic.h"
#include "policies/policy.h"
#include "runtime/runtime_impl.h"

namespace kvferry {
namespace {

// What the runtimes of a test asked of their devices.
struct Seen {
  std::atomic<int64_t> admits{0};   // StepBank::Admit calls
  std::atomic<int64_t> selects{0};  // Device::Run calls (the oracle: its selection)
  std::atomic<int64_t> prefetches{0};  // Device::PrefetchListRows calls
};

// A StepBank that banks nothing: every row is a miss. Counts the admissions the runtime queues.
class EmptyStepBank final : public StepBank {
 public:
  explicit EmptyStepBank(std::shared_ptr<Seen> seen) : seen_(std::move(seen)) {}
  void View(StepBankView* view) const override {
    view->rows = dummy_;  // non-null: the runtime sets up and admits as for a real bank
    view->slots = 1;
  }
  [[nodiscard]] size_t admit_item_bytes() const override { return 64; }
  [[nodiscard]] int max_admit() const override { return 1024; }
  Status Admit(const void* items, int num_items, StreamHandle) override {
    if (items == nullptr || num_items <= 0) return Internal("admission without items");
    seen_->admits.fetch_add(1);
    return Status::Ok();
  }
  Status ResetTables(int, int, StreamHandle) override { return Status::Ok(); }
  Result<StepBankTotals> Totals() const override { return StepBankTotals{}; }
  [[nodiscard]] size_t bytes() const override { return 0; }

 private:
  std::shared_ptr<Seen> seen_;
  char dummy_[64] = {};
};

// The host-emulated device, reporting Backend::kCuda and making EmptyStepBanks. Its "device"
// memory is host memory, so device tensors are host pointers tagged kDevice.
class CudaPosingDevice final : public Device {
 public:
  CudaPosingDevice(std::unique_ptr<Device> inner, std::shared_ptr<Seen> seen)
      : inner_(std::move(inner)), seen_(std::move(seen)) {}
  Backend backend() const override { return Backend::kCuda; }
  std::string name() const override { return "cuda-posing(" + inner_->name() + ")"; }
  Result<void*> AllocDevice(size_t bytes) override { return inner_->AllocDevice(bytes); }
  void FreeDevice(void* ptr) override { inner_->FreeDevice(ptr); }
  Result<void*> AllocHost(size_t bytes) override { return inner_->AllocHost(bytes); }
  void FreeHost(void* ptr) override { inner_->FreeHost(ptr); }
  StreamHandle default_stream() const override { return inner_->default_stream(); }
  Result<StreamHandle> CreateStream() override { return inner_->CreateStream(); }
  void DestroyStream(StreamHandle s) override { inner_->DestroyStream(s); }
  Result<EventHandle> CreateEvent() override { return inner_->CreateEvent(); }
  Result<EventHandle> CreateTimingEvent() override { return inner_->CreateTimingEvent(); }
  Result<double> ElapsedMs(EventHandle a, EventHandle b) override { return inner_->ElapsedMs(a, b); }
  void DestroyEvent(EventHandle e) override { inner_->DestroyEvent(e); }
  Status RecordEvent(EventHandle e, StreamHandle s) override { return inner_->RecordEvent(e, s); }
  Status WaitEvent(StreamHandle s, EventHandle e) override { return inner_->WaitEvent(s, e); }
  Status SynchronizeEvent(EventHandle e) override { return inner_->SynchronizeEvent(e); }
  Status SynchronizeStream(StreamHandle s) override { return inner_->SynchronizeStream(s); }
  Status CopyAsync(void* dst, const void* src, size_t bytes, StreamHandle s) override {
    return inner_->CopyAsync(dst, src, bytes, s);
  }
  Status CopyRows(const RowCopy* rows, int64_t n, int elems, DType sd, DType dd,
                  StreamHandle s) override {
    return inner_->CopyRows(rows, n, elems, sd, dd, s);
  }
  Status AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t n,
                    StreamHandle s) override {
    return inner_->AttendRows(p, items, n, s);
  }
  Status AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t n,
                     StreamHandle s) override {
    return inner_->AttendPaged(p, items, n, s);
  }
  Status DecodeStep(const DecodeStepArgs& a, StreamHandle s) override {
    return inner_->DecodeStep(a, s);
  }
  Status Run(const DeviceKernel& k, const void* a, StreamHandle s) override {
    seen_->selects.fetch_add(1);
    return inner_->Run(k, a, s);
  }
  Result<std::unique_ptr<StepBank>> CreateStepBank(const StepBankConfig& config) override {
    if (config.slots <= 0 || config.num_tables <= 0) return InvalidArgument("bad bank config");
    return std::unique_ptr<StepBank>(new EmptyStepBank(seen_));
  }
  // The empty bank holds no device memory; its admission items are EmptyStepBank's.
  Result<StepBankSizes> StepBankSizesFor(const StepBankConfig& config) const override {
    if (config.slots <= 0 || config.num_tables <= 0) return InvalidArgument("bad bank config");
    StepBankSizes sizes;
    sizes.admit_item_bytes = 64;
    sizes.max_admit = 1024;
    return sizes;
  }
  int64_t device_bytes_held() const override { return inner_->device_bytes_held(); }
  int64_t total_device_bytes() const override { return inner_->total_device_bytes(); }
  Status PrimeAttention(const PrimeArgs& a, StreamHandle s) override {
    return inner_->PrimeAttention(a, s);
  }
  Status ShadowScan(const ShadowScanArgs& a, StreamHandle s) override { return inner_->ShadowScan(a, s); }
  Status SplitStepList(const DecodeStepArgs& a, const SplitListArgs& sp, StreamHandle s) override {
    return inner_->SplitStepList(a, sp, s);
  }
  Status PrefetchListRows(const DecodeStepArgs& a, StreamHandle s) override {
    seen_->prefetches.fetch_add(1);
    return inner_->PrefetchListRows(a, s);
  }
  size_t stream_scratch_bytes() const override { return inner_->stream_scratch_bytes(); }
  Status MergeLse(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows,
                  int head_dim, void* out, DType out_dtype, StreamHandle s) override {
    return inner_->MergeLse(o_a, lse_a, o_b, lse_b, rows, head_dim, out, out_dtype, s);
  }

 private:
  std::unique_ptr<Device> inner_;
  std::shared_ptr<Seen> seen_;
};

// Runtime::Create on a CudaPosingDevice, its calls counted in *seen.
std::unique_ptr<Runtime> MakePosing(const RuntimeConfig& config,
                                    const std::shared_ptr<Seen>& seen) {
  detail::ScopedDeviceDecorator scope([seen](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
    return std::make_unique<CudaPosingDevice>(std::move(d), seen);
  });
  auto r = Runtime::Create(config);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return nullptr;
  EXPECT_EQ(r.value()->backend(), Backend::kCuda);
  return std::move(r).value();
}

RuntimeConfig Config(const std::string& policy, int bank_slots, Route route = Route::kGpu) {
  RuntimeConfig c;
  c.model = {.num_layers = 3, .num_q_heads = 8, .num_kv_heads = 2, .head_dim = 64,
             .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = 3;
  c.capacity.max_tokens_per_sequence = 2048;
  c.capacity.max_batch = 2;
  c.capacity.max_prefill_chunk = 512;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 32;
  c.tiers.bank_slots = bank_slots;
  c.policy.name = policy;
  c.policy.budget_tokens = 96;
  if (policy == "hip") {  // bits 16: the host selects (its lists uploaded)
    c.policy.params["dense_layers"] = 1;
    c.policy.params["bits"] = 16;
  }
  if (policy == "kvpop") c.policy.params["device"] = 0;  // the host selects (default: the device)
  c.route = route;
  c.backend = Backend::kHost;  // the decorator makes it pose as CUDA
  c.cpu_threads = 2;
  c.probe_at_start = false;
  return c;
}

struct Inputs {
  explicit Inputs(uint32_t seed) : rng(seed) {}
  std::vector<float> Random(int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = nd(rng);
    return x;
  }
  std::mt19937 rng;
  std::normal_distribution<float> nd{0.f, 1.f};
};

TensorView View(std::vector<float>& x, int64_t rows, int heads, int d,
                MemoryKind where = MemoryKind::kHost) {
  return TensorView::Contiguous(x.data(), DType::kF32, where, {rows, heads, d});
}

double NormOf(const std::vector<float>& x) {
  double s = 0;
  for (float e : x) s += static_cast<double>(e) * e;
  return std::sqrt(s);
}

// The rule of RuntimeImpl::Init: which configurations take the host-list step (it plans, and is
// not capture-safe), which the device-selected one, and which the host path.
TEST(HostListBank, WhichConfigurationsTakeIt) {
  struct Expect {
    std::string policy;
    int bank;
    Route route;
    bool capture_safe;  // the device-selected step (fast path)
    bool plans;         // PlanDecode plans (decode_planned counts)
  };
  const std::vector<Expect> cases = {
      {"hip", 64, Route::kGpu, false, true},         // host lists with the device bank
      {"kvpop", 64, Route::kGpu, false, true},
      {"streaming", 64, Route::kGpu, false, true},   // Select on the host with a bank
      {"cis+oracle", 64, Route::kGpu, false, true},  // a wrapper selects on the host
      {"lfps", 64, Route::kGpu, false, true},
      {"hip", 0, Route::kGpu, false, false},         // no bank: the host path
      {"hip", 64, Route::kAuto, false, true},        // auto, GPU-placed: host lists too
      {"oracle", 64, Route::kGpu, true, true},       // device selection, device bank
      {"oracle", 64, Route::kCpu, false, false},     // cpu route: no bank, host path
      {"streaming", 0, Route::kGpu, true, true},     // fast path
      {"dense", 64, Route::kGpu, true, true},        // dense never reads a bank: as without one
  };
  for (const Expect& e : cases) {
    SCOPED_TRACE(e.policy + " bank " + std::to_string(e.bank) + " " + RouteName(e.route));
    RuntimeConfig c = Config(e.policy, e.bank, e.route);
    auto seen = std::make_shared<Seen>();
    auto rt = MakePosing(c, seen);
    ASSERT_NE(rt, nullptr);
    EXPECT_EQ(rt->decode_is_capture_safe(), e.capture_safe);
    Inputs in(3);
    const int d = c.model.head_dim;
    ASSERT_TRUE(rt->AddSequence(1).ok());
    for (int l = 0; l < c.model.num_layers; ++l) {
      auto k = in.Random(200 * 2 * d), v = in.Random(200 * 2 * d);
      ASSERT_TRUE(rt->Append(1, l, View(k, 200, 2, d), View(v, 200, 2, d)).ok());
    }
    const std::vector<SequenceId> one = {1};
    ASSERT_TRUE(rt->PlanDecode(one).ok());
    for (int l = 0; l < c.model.num_layers; ++l) {
      auto q = in.Random(8 * d), k = in.Random(2 * d), v = in.Random(2 * d);
      std::vector<float> out(q.size());
      const Status st = rt->Decode(one, l, View(q, 1, 8, d), View(k, 1, 2, d), View(v, 1, 2, d),
                                   View(out, 1, 8, d));
      ASSERT_TRUE(st.ok()) << st.ToString();
      EXPECT_GT(NormOf(out), 0.0);
    }
    EXPECT_EQ(rt->GetStats().decode_planned, e.plans ? c.model.num_layers : 0);
    // The device bank's admission follows each layer's step wherever there is one.
    const bool device_bank = e.bank > 0 && e.route != Route::kCpu && e.policy != "dense";
    EXPECT_EQ(seen->admits.load(), device_bank ? c.model.num_layers : 0);
    const bool device_selects = e.policy == "oracle" && e.route == Route::kGpu;
    EXPECT_EQ(seen->selects.load(), device_selects ? c.model.num_layers : 0);
  }
}

// Three runtimes posing as CUDA on the same inputs, 12 steps x 3 layers, the sequences removed and
// added again: A (bank, PlanDecode, host tensors) and B (bank, self-planned Decodes, device
// tensors: q, k, v copied to pinned memory first) run the host-list step and agree bit for bit; C
// (no bank) runs the host path: the same selections exactly, the same resident/selected counts,
// outputs to 1e-5 (the same rows and the same row kernel, attended in list order instead of
// resident rows first). Every layer's step queues one admission.
TEST(HostListBank, SameSelectionsAsTheHostPath) {
  for (const char* policy : {"hip", "kvpop", "streaming", "cis+oracle"}) {
    SCOPED_TRACE(policy);
    auto seen = std::make_shared<Seen>();
    auto others = std::make_shared<Seen>();
    std::unique_ptr<Runtime> a = MakePosing(Config(policy, 64), seen);
    std::unique_ptr<Runtime> b = MakePosing(Config(policy, 64), others);
    std::unique_ptr<Runtime> c = MakePosing(Config(policy, 0), others);
    ASSERT_TRUE(a && b && c);
    const RuntimeConfig& cfg = a->config();
    const int d = cfg.model.head_dim, hq = cfg.model.num_q_heads, hkv = cfg.model.num_kv_heads;
    const int layers = cfg.model.num_layers;
    Inputs in(17);
    const std::vector<SequenceId> seqs = {4, 7};
    const int64_t batch = 2;
    constexpr int kSteps = 12;
    for (int round = 0; round < 2; ++round) {
      SCOPED_TRACE(round);
      for (Runtime* rt : {a.get(), b.get(), c.get()}) {
        for (SequenceId s : seqs) ASSERT_TRUE(rt->AddSequence(s).ok());
      }
      for (SequenceId s : seqs) {
        const int64_t tokens = s == 4 ? 400 : 290;
        for (int l = 0; l < layers; ++l) {
          auto k = in.Random(tokens * hkv * d), v = in.Random(tokens * hkv * d);
          for (Runtime* rt : {a.get(), b.get(), c.get()}) {
            ASSERT_TRUE(rt->Append(s, l, View(k, tokens, hkv, d), View(v, tokens, hkv, d)).ok());
          }
        }
      }
      for (Runtime* rt : {a.get(), b.get(), c.get()}) rt->ResetStats();
      seen->admits.store(0);
      std::vector<std::vector<float>> q(static_cast<size_t>(layers));
      for (auto& x : q) x = in.Random(batch * hq * d);  // repeating queries, new keys
      for (int step = 0; step < kSteps; ++step) {
        ASSERT_TRUE(a->PlanDecode(seqs).ok());
        for (int l = 0; l < layers; ++l) {
          auto k = in.Random(batch * hkv * d), v = in.Random(batch * hkv * d);
          std::vector<float> out[3];
          for (int r = 0; r < 3; ++r) {
            Runtime* rt = r == 0 ? a.get() : r == 1 ? b.get() : c.get();
            out[r].assign(q[l].size(), std::nanf(""));
            const MemoryKind where = r == 1 ? MemoryKind::kDevice : MemoryKind::kHost;
            const Status st = rt->Decode(seqs, l, View(q[l], batch, hq, d, where),
                                         View(k, batch, hkv, d, where),
                                         View(v, batch, hkv, d, where),
                                         View(out[r], batch, hq, d, where));
            ASSERT_TRUE(st.ok()) << st.ToString();
          }
          double err = 0;
          for (size_t i = 0; i < out[0].size(); ++i) {
            ASSERT_EQ(0, std::memcmp(&out[0][i], &out[1][i], sizeof(float)))
                << "step " << step << " layer " << l << " element " << i;
            ASSERT_FALSE(std::isnan(out[2][i]));
            err = std::max(err, static_cast<double>(std::abs(out[0][i] - out[2][i])));
          }
          EXPECT_LT(err, 1e-5) << "step " << step << " layer " << l;
          EXPECT_GT(NormOf(out[0]), 0.1);
          for (SequenceId s : seqs) {
            for (int h = 0; h < hkv; ++h) {
              auto sa = a->LastSelection(s, l, h), sc = c->LastSelection(s, l, h);
              ASSERT_TRUE(sa.ok() && sc.ok());
              ASSERT_FALSE(sa.value().empty());
              EXPECT_EQ(sa.value(), sc.value()) << "step " << step << " layer " << l;
            }
          }
        }
      }
      const Stats sa = a->GetStats(), sb = b->GetStats(), sc = c->GetStats();
      EXPECT_EQ(sa.decode_planned, kSteps * layers);
      EXPECT_EQ(sb.decode_planned, 0);  // self-planned
      EXPECT_EQ(sc.decode_planned, 0);  // the host path
      EXPECT_EQ(sa.decode_steps, kSteps * layers);
      EXPECT_EQ(sa.rows_selected, sc.rows_selected);
      EXPECT_EQ(sa.rows_resident, sc.rows_resident);
      EXPECT_GT(sa.rows_selected, sa.rows_resident);  // offloaded rows were selected
      EXPECT_EQ(sa.rows_cpu, 0);
      EXPECT_GE(sa.host_syncs, kSteps * layers);  // q (and the store rows) once a layer
      EXPECT_EQ(seen->admits.load(), kSteps * layers);
      EXPECT_EQ(seen->selects.load() + others->selects.load(), 0);  // the host selected
      for (Runtime* rt : {a.get(), b.get(), c.get()}) {
        for (SequenceId s : seqs) ASSERT_TRUE(rt->RemoveSequence(s).ok());
      }
    }
  }
}

// A GPU-placed policy selecting on the host like streaming; fails (or returns a position past the
// context) while the switch says so.
std::atomic<int> g_mode{0};  // 0 ok, 1 fail, 2 out-of-range position

class SwitchedPolicy final : public Policy {
 public:
  std::string_view name() const override { return "test_host_list_switched"; }
  Placement placement() const override { return Placement::kGpu; }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    StreamingSelect(ctx.n, ctx.sink, ctx.budget, out);
    if (ctx.kv_head == 1 && g_mode.load() == 1) {
      return Internal("test_host_list_switched: injected");
    }
    if (ctx.kv_head == 1 && g_mode.load() == 2) out.back() = static_cast<int32_t>(ctx.n);
    return Status::Ok();
  }
};

// A failing Select (and a Select that breaks its contract) inside the host-list step: the call
// returns the error, the sequences keep their lengths, and every later step equals a twin's that
// never saw the call, bit for bit (the window rows the step would have overwritten are intact).
TEST(HostListBank, FailingSelectLeavesEverySequenceAsBefore) {
  static const bool registered =
      RegisterPolicy("test_host_list_switched", [](const RuntimeConfig&) {
        return Result<std::unique_ptr<Policy>>(std::unique_ptr<Policy>(new SwitchedPolicy));
      });
  ASSERT_TRUE(registered);
  for (const int mode : {1, 2}) {
    for (const bool planned : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "mode " << mode
                                        << (planned ? " planned" : " self-planned"));
      RuntimeConfig cfg = Config("test_host_list_switched", 64);
      cfg.model.num_layers = 1;
      auto seen = std::make_shared<Seen>();
      std::unique_ptr<Runtime> rt = MakePosing(cfg, seen), twin = MakePosing(cfg, seen);
      ASSERT_TRUE(rt && twin);
      EXPECT_FALSE(rt->decode_is_capture_safe());
      const int d = cfg.model.head_dim, hq = cfg.model.num_q_heads, hkv = cfg.model.num_kv_heads;
      Inputs in(23);
      const std::vector<SequenceId> seqs = {1, 2};
      const int64_t prompt[2] = {120, 77};
      for (size_t i = 0; i < seqs.size(); ++i) {
        auto k = in.Random(prompt[i] * hkv * d), v = in.Random(prompt[i] * hkv * d);
        for (Runtime* r : {rt.get(), twin.get()}) {
          ASSERT_TRUE(r->AddSequence(seqs[i]).ok());
          ASSERT_TRUE(
              r->Append(seqs[i], 0, View(k, prompt[i], hkv, d), View(v, prompt[i], hkv, d)).ok());
        }
      }
      auto step = [&](Runtime& r, std::vector<float>& q, std::vector<float>& k,
                      std::vector<float>& v, std::vector<float>& out) -> Status {
        if (planned) KVF_RETURN_IF_ERROR(r.PlanDecode(seqs));
        out.assign(q.size(), std::nanf(""));
        return r.Decode(seqs, 0, View(q, 2, hq, d), View(k, 2, hkv, d), View(v, 2, hkv, d),
                        View(out, 2, hq, d));
      };
      auto both = [&](int steps) {
        for (int t = 0; t < steps; ++t) {
          auto q = in.Random(2 * hq * d), k = in.Random(2 * hkv * d), v = in.Random(2 * hkv * d);
          std::vector<float> a, b;
          ASSERT_TRUE(step(*rt, q, k, v, a).ok());
          ASSERT_TRUE(step(*twin, q, k, v, b).ok());
          ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "step " << t;
          ASSERT_GT(NormOf(a), 0.1);
        }
      };
      both(3);
      {
        auto q = in.Random(2 * hq * d), k = in.Random(2 * hkv * d), v = in.Random(2 * hkv * d);
        std::vector<float> out;
        g_mode = mode;
        const Status st = step(*rt, q, k, v, out);
        g_mode = 0;
        EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
        EXPECT_NE(st.message().find(mode == 1 ? "injected" : "not ascending in [0, n)"),
                  std::string::npos)
            << st.ToString();
        EXPECT_EQ(st.message().find("unspecified state"), std::string::npos) << st.ToString();
      }
      for (size_t i = 0; i < seqs.size(); ++i) {
        EXPECT_EQ(*rt->SequenceLength(seqs[i], 0), prompt[i] + 3);
      }
      both(40);  // past the ring (32 rows) once: every row the failed call could have written
    }
  }
}

// The scheduler's cross-layer prefetch (xl+ over a device selection, the device bank's two
// regions): each planned layer whose next layer takes its list (xl+, layers 2 and 3 of 4 here)
// prefetches that layer's misses, which its step then reads from the stage. The host device's
// PrefetchListRows stages them as the CUDA kernel does (PrefetchListRows.* has the rule); its
// step reads the store itself, so what this covers is the runtime's part: which calls prefetch
// (planned ones, not the last layer, none with xl_prefetch = 0), that a prefetched step
// counts in decode_prefetched, that a plan left unfinished and a removed sequence join the
// prefetch in flight, and that the outputs equal those of a twin without the prefetch bit for bit.
TEST(HostListBank, XlPrefetchRunsForPlannedSharingLayers) {
  RuntimeConfig cfg = Config("xl+oracle", 64);
  cfg.model.num_layers = 4;
  auto seen = std::make_shared<Seen>();
  auto others = std::make_shared<Seen>();
  cfg.xl_prefetch = 1;  // always (auto decides by the time between layers: the next test)
  std::unique_ptr<Runtime> a = MakePosing(cfg, seen);
  cfg.xl_prefetch = 0;
  std::unique_ptr<Runtime> b = MakePosing(cfg, others);
  ASSERT_TRUE(a && b);
  EXPECT_TRUE(a->decode_is_capture_safe());
  const int d = cfg.model.head_dim, hq = cfg.model.num_q_heads, hkv = cfg.model.num_kv_heads;
  const int layers = cfg.model.num_layers;
  Inputs in(23);
  const std::vector<SequenceId> seqs = {2, 5};
  const int64_t batch = 2;
  auto add = [&](SequenceId s, int64_t tokens) {
    for (Runtime* rt : {a.get(), b.get()}) ASSERT_TRUE(rt->AddSequence(s).ok());
    for (int l = 0; l < layers; ++l) {
      auto k = in.Random(tokens * hkv * d), v = in.Random(tokens * hkv * d);
      for (Runtime* rt : {a.get(), b.get()}) {
        ASSERT_TRUE(rt->Append(s, l, View(k, tokens, hkv, d), View(v, tokens, hkv, d)).ok());
      }
    }
  };
  add(2, 410);
  add(5, 300);
  int64_t want_prefetches = 0;
  int shared_layers = 2;  // layers 2 and 3 take the previous layer's list
  for (int step = 0; step < 10; ++step) {
    SCOPED_TRACE(step);
    const bool planned = step % 3 != 2;
    if (step == 6) {  // out and in again: its tables emptied, the prefetches joined first
      for (Runtime* rt : {a.get(), b.get()}) ASSERT_TRUE(rt->RemoveSequence(5).ok());
      add(5, 280);
    }
    if (planned) {
      for (Runtime* rt : {a.get(), b.get()}) ASSERT_TRUE(rt->PlanDecode(seqs).ok());
    }
    // Step 4 stops after layer 2 (whose prefetch for layer 3 is then in flight) and plans again.
    const int run_layers = step == 4 ? 3 : layers;
    if (step == 4) {
      for (int l = 0; l < run_layers; ++l) {
        auto q = in.Random(batch * hq * d), k = in.Random(batch * hkv * d), v = in.Random(batch * hkv * d);
        std::vector<float> out[2];
        int r = 0;
        for (Runtime* rt : {a.get(), b.get()}) {
          out[r].assign(q.size(), std::nanf(""));
          ASSERT_TRUE(rt->Decode(seqs, l, View(q, batch, hq, d), View(k, batch, hkv, d), View(v, batch, hkv, d),
                                 View(out[r], batch, hq, d)).ok());
          ++r;
        }
        ASSERT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)));
      }
      want_prefetches += 2;  // layers 1 and 2 prefetched; layer 3's was not run
      for (Runtime* rt : {a.get(), b.get()}) ASSERT_TRUE(rt->PlanDecode(seqs).ok());
      // From here sequence 2's layer 3 holds a token fewer than its layer 2 (the plan gave that
      // token back), so layer 3 runs the inner policy (xl+ shares at equal lengths only) and
      // layer 2 prefetches nothing for it.
      shared_layers = 1;
    }
    for (int l = 0; l < layers; ++l) {
      auto q = in.Random(batch * hq * d), k = in.Random(batch * hkv * d), v = in.Random(batch * hkv * d);
      std::vector<float> out[2];
      int r = 0;
      for (Runtime* rt : {a.get(), b.get()}) {
        out[r].assign(q.size(), std::nanf(""));
        const Status st = rt->Decode(seqs, l, View(q, batch, hq, d), View(k, batch, hkv, d),
                                     View(v, batch, hkv, d), View(out[r], batch, hq, d));
        ASSERT_TRUE(st.ok()) << st.ToString();
        ++r;
      }
      ASSERT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float))) << "layer " << l;
      EXPECT_GT(NormOf(out[0]), 0.0);
    }
    if (planned || step == 4) want_prefetches += shared_layers;  // at layers 1 (and 2), for 2 (and 3)
    EXPECT_EQ(seen->prefetches.load(), want_prefetches);
  }
  EXPECT_EQ(others->prefetches.load(), 0);
  const Stats sa = a->GetStats(), sb = b->GetStats();
  // Every prefetch but the one whose layer step 4 left unrun served its layer's step.
  EXPECT_EQ(sa.decode_prefetched, want_prefetches - 1);
  EXPECT_EQ(sb.decode_prefetched, 0);
  EXPECT_EQ(sa.rows_selected, sb.rows_selected);
  for (SequenceId s : seqs) {
    for (int l = 0; l < layers; ++l) {
      for (int h = 0; h < hkv; ++h) EXPECT_EQ(a->LastSelection(s, l, h).value(), b->LastSelection(s, l, h).value());
    }
  }
}

// RuntimeConfig::xl_prefetch = -1 (auto): the runtime times the stream from the end of a layer's
// Decode to the start of the next sharing layer's (on the host device, the host clock where the
// work runs) and prefetches while that averages at least RuntimeConfig::xl_prefetch_gap_us (10 ms
// here, far above a loaded CI machine's back-to-back calls).
// Calls back to back: the prefetch stops once the first times arrive (kTimingRing steps later);
// 25 ms between the layers' calls (an engine's work): it starts again. Outputs equal a twin with
// the prefetch off throughout, bit for bit; a bad value of the field is refused.
TEST(HostListBank, XlPrefetchAutoFollowsTheTimeBetweenLayers) {
  RuntimeConfig cfg = Config("xl+oracle", 64);
  cfg.model.num_layers = 4;
  cfg.xl_prefetch = 2;
  {
    auto bad = Runtime::Create(cfg);
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("xl_prefetch 2"), std::string::npos) << bad.status().ToString();
  }
  auto seen = std::make_shared<Seen>();
  auto others = std::make_shared<Seen>();
  cfg.xl_prefetch = -1;
  cfg.xl_prefetch_gap_us = 10000.0;
  std::unique_ptr<Runtime> a = MakePosing(cfg, seen);
  cfg.xl_prefetch_gap_us = 100.0;
  cfg.xl_prefetch = 0;
  std::unique_ptr<Runtime> b = MakePosing(cfg, others);
  ASSERT_TRUE(a && b);
  const int d = cfg.model.head_dim, hq = cfg.model.num_q_heads, hkv = cfg.model.num_kv_heads;
  const int layers = cfg.model.num_layers;
  Inputs in(31);
  const std::vector<SequenceId> seqs = {2, 5};
  const int64_t batch = 2;
  for (SequenceId s : seqs) {
    for (Runtime* rt : {a.get(), b.get()}) ASSERT_TRUE(rt->AddSequence(s).ok());
    for (int l = 0; l < layers; ++l) {
      auto k = in.Random(300 * hkv * d), v = in.Random(300 * hkv * d);
      for (Runtime* rt : {a.get(), b.get()}) ASSERT_TRUE(rt->Append(s, l, View(k, 300, hkv, d), View(v, 300, hkv, d)).ok());
    }
  }
  EXPECT_LT(a->GetStats().xl_gap_us, 0.0);  // nothing measured yet
  // One token step on both, every layer's inputs made first; \p pause between a's layer calls.
  auto step = [&](std::chrono::microseconds pause) {
    std::vector<std::vector<float>> q(layers), k(layers), v(layers), out_a(layers), out_b(layers);
    for (int l = 0; l < layers; ++l) {
      q[l] = in.Random(batch * hq * d), k[l] = in.Random(batch * hkv * d), v[l] = in.Random(batch * hkv * d);
      out_a[l].assign(q[l].size(), std::nanf(""));
      out_b[l].assign(q[l].size(), std::nanf(""));
    }
    ASSERT_TRUE(a->PlanDecode(seqs).ok());
    for (int l = 0; l < layers; ++l) {
      if (l > 0 && pause.count() > 0) std::this_thread::sleep_for(pause);
      ASSERT_TRUE(a->Decode(seqs, l, View(q[l], batch, hq, d), View(k[l], batch, hkv, d), View(v[l], batch, hkv, d),
                            View(out_a[l], batch, hq, d)).ok());
    }
    ASSERT_TRUE(b->PlanDecode(seqs).ok());
    for (int l = 0; l < layers; ++l) {
      ASSERT_TRUE(b->Decode(seqs, l, View(q[l], batch, hq, d), View(k[l], batch, hkv, d), View(v[l], batch, hkv, d),
                            View(out_b[l], batch, hq, d)).ok());
      ASSERT_EQ(0, std::memcmp(out_a[l].data(), out_b[l].data(), out_a[l].size() * sizeof(float))) << "layer " << l;
    }
  };
  // Back to back: prefetched until the first times come back, then not.
  for (int s = 0; s < 8; ++s) step(std::chrono::microseconds(0));
  const int64_t early = seen->prefetches.load();
  EXPECT_GE(early, 4);  // layers 1 and 2 of the first steps, before any time was read
  const double fast = a->GetStats().xl_gap_us;
  EXPECT_GE(fast, 0.0);
  EXPECT_LT(fast, 10000.0);
  for (int s = 0; s < 4; ++s) step(std::chrono::microseconds(0));
  EXPECT_EQ(seen->prefetches.load(), early) << "prefetched with " << fast << " us between layers";
  // 25 ms between the calls: the average passes 10 ms within a few steps, and the prefetch returns.
  for (int s = 0; s < 10; ++s) step(std::chrono::microseconds(25000));
  EXPECT_GT(a->GetStats().xl_gap_us, 10000.0);
  EXPECT_GT(seen->prefetches.load(), early);
  EXPECT_GT(a->GetStats().decode_prefetched, 0);
  EXPECT_EQ(others->prefetches.load(), 0);
  EXPECT_EQ(b->GetStats().xl_gap_us, -1.0);  // off: never measured
}

}  // namespace
}  // namespace kvferry
