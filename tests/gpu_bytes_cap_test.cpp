// Copyright kvferry authors. Apache-2.0.
// The GPU memory cap (Capacity::gpu_bytes) and the device memory plan (Runtime::device_memory):
// the plan is what the device really holds, byte for byte, for every policy and bank form; the
// cap refuses one byte short of the plan and accepts it exactly; bank_slots = -1 takes the largest
// bank that fits and decodes exactly like that bank given explicitly. On the host backend (the
// host-emulated device counts its "device" blocks like the CUDA one), plus a CUDA check that
// skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "kvferry/kvferry.h"
#include "offload/host_store.h"
#include "offload/token_bank.h"

namespace kvferry {
namespace {

struct Shape {
  const char* name;
  ModelShape model;
  int max_sequences;
  int64_t max_tokens;
  int max_batch;
  int64_t max_prefill_chunk;
  int sink, window;
  int64_t budget;
  const char* bank_map;
};

// Odd sizes on purpose: GQA 2:1 and 1:1 and 8:1, head_dim 8 to 32, lengths that are not pages.
const Shape kShapes[] = {
    {"gqa2_d16", {.num_layers = 2, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 16,
                  .kv_dtype = DType::kBF16},
     2, 512, 2, 64, 4, 16, 32, "vector"},
    {"mha_d32_f16_hash", {.num_layers = 3, .num_q_heads = 3, .num_kv_heads = 3, .head_dim = 32,
                          .kv_dtype = DType::kF16},
     3, 777, 3, 100, 2, 9, 40, "hash"},
    {"gqa8_d8", {.num_layers = 1, .num_q_heads = 8, .num_kv_heads = 1, .head_dim = 8,
                 .kv_dtype = DType::kBF16},
     1, 97, 1, 97, 1, 4, 17, "vector"},
};

const char* const kPolicies[] = {"streaming", "oracle", "quest", "sparcas", "lfps", "hip", "dense"};

RuntimeConfig Config(const std::string& policy, const Shape& s, int bank_slots) {
  RuntimeConfig c;
  c.model = s.model;
  c.capacity.max_sequences = s.max_sequences;
  c.capacity.max_tokens_per_sequence = s.max_tokens;
  c.capacity.max_batch = s.max_batch;
  c.capacity.max_prefill_chunk = s.max_prefill_chunk;
  c.tiers.sink_tokens = s.sink;
  c.tiers.window_tokens = s.window;
  c.tiers.bank_slots = bank_slots;
  c.tiers.bank_map = s.bank_map;
  c.policy.name = policy;
  c.policy.budget_tokens = s.budget;
  if (policy == "quest") c.policy.params["page"] = 4;
  if (policy == "sparcas") c.policy.params["dense_layers"] = 1;
  c.backend = Backend::kHost;
  c.cpu_threads = 1;
  c.probe_at_start = false;
  return c;
}

std::unique_ptr<Runtime> Make(const RuntimeConfig& c) {
  auto r = Runtime::Create(c);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

// The plan of \p c, from a runtime created without a cap.
DeviceMemoryPlan PlanOf(RuntimeConfig c) {
  c.capacity.gpu_bytes = 0;
  std::unique_ptr<Runtime> rt = Make(c);
  return rt ? rt->device_memory() : DeviceMemoryPlan{};
}

// The plan is well formed: parts non-empty, largest first, summing to the total.
void ExpectWellFormed(const DeviceMemoryPlan& plan) {
  int64_t sum = 0;
  for (size_t i = 0; i < plan.parts.size(); ++i) {
    EXPECT_GT(plan.parts[i].bytes, 0) << plan.parts[i].name;
    if (i > 0) EXPECT_GE(plan.parts[i - 1].bytes, plan.parts[i].bytes) << plan.ToString();
    sum += plan.parts[i].bytes;
  }
  EXPECT_EQ(sum, plan.total_bytes);
  EXPECT_FALSE(plan.parts.empty());
}

std::string CaseName(const std::string& policy, const Shape& s, int bank) {
  return policy + "/" + s.name + "/bank" + std::to_string(bank);
}

TEST(GpuBytesCap, PlanTotalIsWhatTheDeviceHolds) {
  for (const char* policy : kPolicies) {
    for (const Shape& s : kShapes) {
      for (int bank : {0, 5}) {
        SCOPED_TRACE(CaseName(policy, s, bank));
        std::unique_ptr<Runtime> rt = Make(Config(policy, s, bank));
        ASSERT_TRUE(rt);
        const DeviceMemoryPlan& plan = rt->device_memory();
        ExpectWellFormed(plan);
        EXPECT_EQ(plan.total_bytes, rt->GetStats().device_bytes_reserved) << plan.ToString();
        EXPECT_EQ(plan.bank_slots, bank);
        EXPECT_EQ(plan.cap_bytes, 0);
        bool has_bank_rows = false;
        for (const auto& p : plan.parts) has_bank_rows |= p.name == "bank rows";
        EXPECT_EQ(has_bank_rows, bank > 0) << plan.ToString();
      }
    }
  }
}

TEST(GpuBytesCap, PolicyMetadataIsItsOwnPart) {
  const Shape& s = kShapes[0];
  auto has = [](const DeviceMemoryPlan& plan, const std::string& name) {
    for (const auto& p : plan.parts) {
      if (p.name == name) return true;
    }
    return false;
  };
  const DeviceMemoryPlan quest = PlanOf(Config("quest", s, 0));
  EXPECT_TRUE(has(quest, "quest page bounds")) << quest.ToString();
  EXPECT_TRUE(has(quest, "selection lists")) << quest.ToString();
  const DeviceMemoryPlan sparcas = PlanOf(Config("sparcas", s, 0));
  EXPECT_TRUE(has(sparcas, "sparcas compact keys")) << sparcas.ToString();
  EXPECT_TRUE(has(sparcas, "sparcas selection state")) << sparcas.ToString();
  const DeviceMemoryPlan streaming = PlanOf(Config("streaming", s, 0));
  EXPECT_TRUE(has(streaming, "step plan (slots, positions)")) << streaming.ToString();
  EXPECT_FALSE(has(streaming, "selection lists")) << streaming.ToString();
  EXPECT_TRUE(has(streaming, "host-store page table")) << streaming.ToString();
}

TEST(GpuBytesCap, OneByteShortIsRefusedExactlyEnoughIsAccepted) {
  for (const char* policy : kPolicies) {
    for (const Shape& s : kShapes) {
      for (int bank : {0, 5}) {
        SCOPED_TRACE(CaseName(policy, s, bank));
        const DeviceMemoryPlan need = PlanOf(Config(policy, s, bank));
        ASSERT_GT(need.total_bytes, 0);
        RuntimeConfig c = Config(policy, s, bank);
        c.capacity.gpu_bytes = need.total_bytes - 1;
        auto refused = Runtime::Create(c);
        ASSERT_FALSE(refused.ok());
        EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
        const std::string& msg = refused.status().message();
        EXPECT_NE(msg.find("gpu_bytes " + std::to_string(need.total_bytes - 1)), std::string::npos)
            << msg;
        EXPECT_NE(msg.find(std::to_string(need.total_bytes) + " bytes"), std::string::npos) << msg;
        // Every part, with its bytes, largest first.
        size_t at = 0;
        for (const auto& p : need.parts) {
          const size_t found = msg.find(p.name + " " + std::to_string(p.bytes), at);
          EXPECT_NE(found, std::string::npos) << p.name << " in " << msg;
          if (found != std::string::npos) at = found;
        }

        c.capacity.gpu_bytes = need.total_bytes;
        std::unique_ptr<Runtime> rt = Make(c);
        ASSERT_TRUE(rt);
        EXPECT_EQ(rt->GetStats().device_bytes_reserved, need.total_bytes);
        EXPECT_EQ(rt->device_memory().total_bytes, need.total_bytes);
        EXPECT_EQ(rt->device_memory().cap_bytes, need.total_bytes);
      }
    }
  }
}

TEST(GpuBytesCap, AutoBankIsTheLargestThatFits) {
  for (const char* policy : kPolicies) {
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(CaseName(policy, s, -1));
      // A cap between the plans of 9 and 10 explicit slots: auto must take 9.
      const int64_t t9 = PlanOf(Config(policy, s, 9)).total_bytes;
      const int64_t t10 = PlanOf(Config(policy, s, 10)).total_bytes;
      ASSERT_GT(t10, t9);
      for (const int64_t cap : {t9, (t9 + t10) / 2, t10 - 1}) {
        RuntimeConfig c = Config(policy, s, -1);
        c.capacity.gpu_bytes = cap;
        std::unique_ptr<Runtime> rt = Make(c);
        ASSERT_TRUE(rt);
        EXPECT_EQ(rt->config().tiers.bank_slots, 9) << "cap " << cap;
        EXPECT_EQ(rt->device_memory().bank_slots, 9);
        EXPECT_EQ(rt->device_memory().total_bytes, t9);
        EXPECT_EQ(rt->GetStats().device_bytes_reserved, t9);
      }
      // A larger cap: the slots chosen fit, one more would not.
      const int64_t cap = t10 + 7 * (t10 - t9) + 3;
      RuntimeConfig c = Config(policy, s, -1);
      c.capacity.gpu_bytes = cap;
      std::unique_ptr<Runtime> rt = Make(c);
      ASSERT_TRUE(rt);
      const int slots = rt->config().tiers.bank_slots;
      EXPECT_GE(slots, 17);
      EXPECT_LE(rt->device_memory().total_bytes, cap);
      EXPECT_EQ(rt->GetStats().device_bytes_reserved, rt->device_memory().total_bytes);
      EXPECT_GT(PlanOf(Config(policy, s, slots + 1)).total_bytes, cap);
    }
  }
}

TEST(GpuBytesCap, AutoBankIsBoundedByTheContext) {
  // No table can use more slots than a sequence has positions.
  const Shape& s = kShapes[2];
  RuntimeConfig c = Config("oracle", s, -1);
  c.capacity.gpu_bytes = int64_t{1} << 40;
  std::unique_ptr<Runtime> rt = Make(c);
  ASSERT_TRUE(rt);
  EXPECT_EQ(rt->config().tiers.bank_slots, s.max_tokens);
}

TEST(GpuBytesCap, AutoBankWithNoRoomForASlot) {
  // lfps: without a bank its planned CPU step needs a few small buffers, fewer than a slot.
  const Shape& s = kShapes[0];
  const int64_t t0 = PlanOf(Config("lfps", s, 0)).total_bytes;
  const int64_t t1 = PlanOf(Config("lfps", s, 1)).total_bytes;
  EXPECT_GT(t1, t0);
  RuntimeConfig c = Config("lfps", s, -1);
  if (t1 > t0) {
    // Room for no bank but not for one slot: no bank.
    c.capacity.gpu_bytes = t1 - 1;
    std::unique_ptr<Runtime> rt = Make(c);
    ASSERT_TRUE(rt);
    EXPECT_EQ(rt->config().tiers.bank_slots, 0);
    EXPECT_EQ(rt->GetStats().device_bytes_reserved, t0);
  }
  // Room for neither: refused, and the message says the bank was already at nothing.
  c.capacity.gpu_bytes = std::min(t0, t1) - 1;
  auto r = Runtime::Create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("not even one slot fits"), std::string::npos)
      << r.status().message();
}

TEST(GpuBytesCap, BadValuesAreClearErrors) {
  const Shape& s = kShapes[0];
  struct Case {
    int64_t gpu_bytes;
    int bank_slots;
    const char* says;
  };
  for (const Case& k : {Case{-1, 0, "gpu_bytes -1 must be >= 0"},
                        Case{-1, -1, "gpu_bytes -1 must be >= 0"},
                        Case{0, -2, "bank_slots -2 out of range [-1, 65534]"},
                        Case{1 << 30, -7, "bank_slots -7 out of range"},
                        Case{0, 65535, "bank_slots 65535 out of range"},
                        Case{0, -1, "bank_slots -1 (the largest bank that fits) needs "
                                    "capacity.gpu_bytes > 0"}}) {
    RuntimeConfig c = Config("streaming", s, k.bank_slots);
    c.capacity.gpu_bytes = k.gpu_bytes;
    auto r = Runtime::Create(c);
    ASSERT_FALSE(r.ok()) << k.says;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find(k.says), std::string::npos) << r.status().message();
  }
}

TEST(GpuBytesCap, ComponentsAllocateWhatTheirSizeFunctionsSay) {
  // The plan reads these functions instead of repeating their formulas; each must be what its
  // component then allocates, in every form (the runtime uses the host-managed bank without
  // device maps; the device-map forms are held to it too).
  std::unique_ptr<Device> device = MakeHostDevice();
  for (BankMapKind map : {BankMapKind::kVector, BankMapKind::kHash}) {
    for (bool device_map : {false, true}) {
      for (int slots : {1, 31, 33, 100}) {
        TokenBankConfig c;
        c.max_sequences = 2;
        c.num_layers = 3;
        c.num_kv_heads = 2;
        c.slots = slots;
        c.max_positions = 777;
        c.head_dim = 24;
        c.kv_dtype = DType::kF16;
        c.map = map;
        c.device_map = device_map;
        const int64_t before = device->device_bytes_held();
        auto bank = TokenBank::Create(device.get(), c);
        ASSERT_TRUE(bank.ok()) << bank.status().ToString();
        const TokenBank::DeviceSizes z = TokenBank::DeviceSizesFor(c);
        EXPECT_EQ(device->device_bytes_held() - before, static_cast<int64_t>(z.total()))
            << "slots " << slots << " device_map " << device_map;
        EXPECT_EQ(z.rows, bank.value()->bank_bytes());
        EXPECT_EQ(z.page_tables + z.ref_bits, bank.value()->device_map_bytes());
        bank.value().reset();
        EXPECT_EQ(device->device_bytes_held(), before);
      }
    }
  }
  HostStoreShape shape;
  shape.max_slots = 3;
  shape.num_layers = 2;
  shape.num_kv_heads = 5;
  shape.head_dim = 40;
  shape.max_tokens = 1000;
  {
    HostStore store(device.get(), shape);
    ASSERT_TRUE(store.Init().ok());
    EXPECT_EQ(device->device_bytes_held(), HostStore::DeviceTableBytes(shape));
    EXPECT_EQ(store.page_bytes(), HostStore::PageBytes(shape));
    EXPECT_EQ(store.max_pages(), HostStore::MaxPages(shape));
  }
  EXPECT_EQ(device->device_bytes_held(), 0);
}

// Feeds a seeded prompt (two chunks per layer) and six decode steps to \p rt; returns every
// decode output (bf16) and appends every LastSelection to \p selections.
std::vector<std::vector<uint16_t>> FeedAndDecode(Runtime& rt, const RuntimeConfig& c,
                                                 uint32_t seed,
                                                 std::vector<std::vector<int32_t>>* selections) {
  const int hq = c.model.num_q_heads, hkv = c.model.num_kv_heads, d = c.model.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  auto random = [&](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = nd(rng);
    return x;
  };
  auto view = [&](void* p, DType t, int64_t rows, int heads) {
    return TensorView::Contiguous(p, t, MemoryKind::kHost, {rows, heads, d});
  };
  const std::vector<SequenceId> seqs = {3, 8};
  const int64_t batch = std::min<int64_t>(c.capacity.max_batch, 2);
  const std::vector<SequenceId> batch_seqs(seqs.begin(), seqs.begin() + batch);
  std::vector<std::vector<uint16_t>> outs;
  for (SequenceId s : batch_seqs) {
    EXPECT_TRUE(rt.AddSequence(s).ok());
    for (int layer = 0; layer < c.model.num_layers; ++layer) {
      // Two chunks: a prompt past the resident tier and the chunk limit.
      for (int64_t n : {int64_t{60}, int64_t{45}}) {
        auto q = random(n * hq * d), k = random(n * hkv * d), v = random(n * hkv * d);
        std::vector<float> out(q.size());
        const Status st =
            rt.Prefill(s, layer, view(q.data(), DType::kF32, n, hq),
                       view(k.data(), DType::kF32, n, hkv), view(v.data(), DType::kF32, n, hkv),
                       view(out.data(), DType::kF32, n, hq));
        EXPECT_TRUE(st.ok()) << st.ToString();
      }
    }
  }
  for (int step = 0; step < 6; ++step) {
    for (int layer = 0; layer < c.model.num_layers; ++layer) {
      auto q = random(batch * hq * d), k = random(batch * hkv * d), v = random(batch * hkv * d);
      std::vector<uint16_t> out(q.size());
      const Status st = rt.Decode(batch_seqs, layer, view(q.data(), DType::kF32, batch, hq),
                                  view(k.data(), DType::kF32, batch, hkv),
                                  view(v.data(), DType::kF32, batch, hkv),
                                  view(out.data(), DType::kBF16, batch, hq));
      EXPECT_TRUE(st.ok()) << st.ToString();
      outs.push_back(std::move(out));
      for (SequenceId s : batch_seqs) {
        for (int h = 0; h < hkv; ++h) {
          auto sel = rt.LastSelection(s, layer, h);
          EXPECT_TRUE(sel.ok());
          if (sel.ok()) selections->push_back(sel.value());
        }
      }
    }
  }
  return outs;
}

TEST(GpuBytesCap, AutoBankDecodesBitForBitLikeTheSameSlotsGivenExplicitly) {
  for (const char* policy : {"streaming", "oracle", "quest", "lfps", "hip"}) {
    for (const Shape& s : {kShapes[0], kShapes[1]}) {
      SCOPED_TRACE(CaseName(policy, s, -1));
      const int64_t t12 = PlanOf(Config(policy, s, 12)).total_bytes;
      RuntimeConfig autoc = Config(policy, s, -1);
      autoc.capacity.gpu_bytes = t12;
      std::unique_ptr<Runtime> a = Make(autoc);
      ASSERT_TRUE(a);
      ASSERT_EQ(a->config().tiers.bank_slots, 12);
      RuntimeConfig explicitc = Config(policy, s, 12);
      std::unique_ptr<Runtime> b = Make(explicitc);
      ASSERT_TRUE(b);
      std::vector<std::vector<int32_t>> sel_a, sel_b;
      const auto out_a = FeedAndDecode(*a, a->config(), 77, &sel_a);
      const auto out_b = FeedAndDecode(*b, explicitc, 77, &sel_b);
      ASSERT_EQ(out_a.size(), out_b.size());
      bool nonzero = false;
      for (size_t i = 0; i < out_a.size(); ++i) {
        ASSERT_EQ(out_a[i].size(), out_b[i].size());
        EXPECT_EQ(std::memcmp(out_a[i].data(), out_b[i].data(), out_a[i].size() * 2), 0)
            << "decode output " << i;
        for (uint16_t x : out_a[i]) nonzero |= (x & 0x7fff) != 0;
      }
      EXPECT_TRUE(nonzero);
      EXPECT_EQ(sel_a, sel_b);
      const Stats st = a->GetStats();
      // The bank was in use (lfps attends its misses on the CPU: no fetches to admit).
      if (std::string(policy) != "lfps") EXPECT_GT(st.rows_bank_hit, 0);
      EXPECT_EQ(st.rows_bank_hit + st.rows_fetched + st.rows_cpu + st.rows_resident,
                st.rows_selected);
      // Decoding allocated nothing on the device.
      EXPECT_EQ(st.device_bytes_reserved, t12);
    }
  }
}

TEST(GpuBytesCapCuda, PlanIsWhatTheGpuHolds) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  struct Case {
    const char* policy;
    int bank;
    const char* map;
    Route route;
  };
  // No bank; the device bank (a device-selecting policy) with each map; the host-managed bank
  // (a host-selecting policy); lfps's planned CPU step.
  for (const Case& k : {Case{"streaming", 0, "vector", Route::kAuto},
                        Case{"quest", 64, "vector", Route::kGpu},
                        Case{"oracle", 32, "hash", Route::kAuto},
                        Case{"hip", 48, "vector", Route::kGpu},
                        Case{"lfps", 0, "vector", Route::kCpu}}) {
    SCOPED_TRACE(std::string(k.policy) + " bank " + std::to_string(k.bank));
    Shape s{"cuda", {.num_layers = 4, .num_q_heads = 8, .num_kv_heads = 2, .head_dim = 128,
                     .kv_dtype = DType::kBF16},
            2, 4096, 2, 512, 4, 64, 256, k.map};
    RuntimeConfig c = Config(k.policy, s, k.bank);
    c.backend = Backend::kCuda;
    c.route = k.route;
    std::unique_ptr<Runtime> rt = Make(c);
    ASSERT_TRUE(rt);
    DeviceMemoryPlan plan = rt->device_memory();
    ExpectWellFormed(plan);
    EXPECT_EQ(plan.total_bytes, rt->GetStats().device_bytes_reserved) << plan.ToString();
    // Prefill and decode on the runtime's own stream allocate nothing more.
    std::vector<std::vector<int32_t>> sel;
    FeedAndDecode(*rt, c, 5, &sel);
    ASSERT_TRUE(rt->Synchronize().ok());
    EXPECT_EQ(rt->GetStats().device_bytes_reserved, plan.total_bytes);
    rt.reset();

    // lfps: its scan's copy of the int8 shadow on the GPU is what gives way under a cap. One byte
    // short of the plan leaves it out (the host scans); the plan without it is then the one held.
    auto has_scan = [](const DeviceMemoryPlan& p) {
      return std::any_of(p.parts.begin(), p.parts.end(),
                         [](const DeviceMemoryPlan::Part& x) { return x.name.rfind("shadow scan", 0) == 0; });
    };
    EXPECT_EQ(has_scan(plan), std::string(k.policy) == "lfps") << plan.ToString();
    if (has_scan(plan)) {
      c.capacity.gpu_bytes = plan.total_bytes - 1;
      std::unique_ptr<Runtime> without = Make(c);
      ASSERT_TRUE(without);
      plan = without->device_memory();
      EXPECT_FALSE(has_scan(plan)) << plan.ToString();
      EXPECT_EQ(without->GetStats().device_bytes_reserved, plan.total_bytes);
      std::vector<std::vector<int32_t>> sel_without;
      FeedAndDecode(*without, c, 5, &sel_without);
      ASSERT_TRUE(without->Synchronize().ok());
      EXPECT_EQ(without->GetStats().scans_device, 0);
    }

    c.capacity.gpu_bytes = plan.total_bytes - 1;
    auto refused = Runtime::Create(c);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
    c.capacity.gpu_bytes = plan.total_bytes;
    std::unique_ptr<Runtime> exact = Make(c);
    ASSERT_TRUE(exact);
    EXPECT_EQ(exact->GetStats().device_bytes_reserved, plan.total_bytes);
    if (k.bank > 0) {
      exact.reset();
      RuntimeConfig autoc = c;
      autoc.tiers.bank_slots = -1;
      std::unique_ptr<Runtime> a = Make(autoc);
      ASSERT_TRUE(a);
      EXPECT_EQ(a->config().tiers.bank_slots, k.bank);
      EXPECT_EQ(a->GetStats().device_bytes_reserved, plan.total_bytes);
    }
  }
}

}  // namespace
}  // namespace kvferry
