// Copyright kvferry authors. Apache-2.0.
// cuda::DeviceBank (the device-resident token bank) on a decode stream: every step's attention,
// in turn one kAll launch (hits from the bank, misses zero-copy from the pinned store),
// LaunchBankGather + kHits + kStaged merged by lse, and the host-staged flow (LaunchBankResolve,
// the per-position resolutions checked, the host writes the misses as one compact block, one
// kResolved launch, Admit from the compact block), against
// cpu::AttendRowsRef over all positions, the miss list against the device map before the step, and
// after each Admit the bank's invariants read back from the device: slot -> position and the map
// are inverse, no position twice, every banked row equals its store row, counters add up, and
// (slots >= 2x the selection) every position of the step is banked afterwards (CLOCK never evicts
// a slot the step read while zero-count slots remain). Vector map, hash map (tombstones and
// rebuilds), a hash map smaller than the bank (full-table rejections), ResetTables and bad input.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "gpu/cuda_device.h"
#include "gpu/device_bank.h"

namespace kvferry {
namespace {

constexpr int kHd = 128, kGroup = 4;
constexpr size_t kRow = kHd * 2;

struct Case {
  BankMapKind map;
  int slots;
  int64_t hash_capacity;
  int sel;
  bool expect_all_banked;
  const char* name;
};

class DeviceBankTest : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceBankTest, DecodeStreamKeepsInvariantsAndMatchesReference) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  const Case cs = GetParam();
  auto dev_r = cuda::CudaDevice::Create(0);
  ASSERT_TRUE(dev_r.ok()) << dev_r.status().ToString();
  auto dev = std::move(dev_r).value();
  constexpr int kTables = 3, kCtx = 3001, kSteps = 40, kMissCap = 1024;
  const int sel_n = cs.sel;
  std::mt19937 rng(5 + cs.slots + static_cast<int>(cs.hash_capacity));
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t store_bytes = static_cast<size_t>(kTables) * kCtx * 2 * kRow;
  auto* store = static_cast<uint16_t*>(dev->AllocHost(store_bytes).value());
  for (size_t i = 0; i < store_bytes / 2; ++i) store[i] = cpu::F32ToBf16(nd(rng));
  auto row_ptr = [&](int t, int32_t pos) {
    return reinterpret_cast<const char*>(store) + ((static_cast<size_t>(t) * kCtx + pos) * 2) * kRow;
  };
  cuda::DeviceBankConfig c;
  c.num_tables = kTables;
  c.slots = cs.slots;
  c.max_positions = kCtx;
  c.head_dim = kHd;
  c.map = cs.map;
  c.hash_capacity = cs.hash_capacity;
  c.max_admit_per_table = kMissCap;
  auto bank_r = cuda::DeviceBank::Create(dev.get(), c);
  ASSERT_TRUE(bank_r.ok()) << bank_r.status().ToString();
  auto bank = std::move(bank_r).value();

  const size_t qn = static_cast<size_t>(kTables) * kGroup * kHd;
  auto dalloc = [&](size_t bytes) { return dev->AllocDevice(bytes).value(); };
  float* dq = static_cast<float*>(dalloc(qn * 4));
  float* doo = static_cast<float*>(dalloc(qn * 4));
  float* dl = static_cast<float*>(dalloc(kTables * kGroup * 4));
  auto* dpos = static_cast<int32_t*>(dalloc(kTables * sel_n * 4));
  auto* dmiss = static_cast<int32_t*>(dalloc(kTables * (kMissCap + 1) * 4));
  char* stage = static_cast<char*>(dalloc(static_cast<size_t>(kTables) * sel_n * 2 * kRow));
  ASSERT_EQ(cudaMemset(dmiss, 0, kTables * (kMissCap + 1) * 4), cudaSuccess);
  float* dob = static_cast<float*>(dalloc(qn * 4));
  float* dlb = static_cast<float*>(dalloc(kTables * kGroup * 4));
  // items[0, kTables): kAll / kHits / gather; items[kTables, 2 kTables): kStaged into (ob, lb).
  auto* items = static_cast<cuda::BankAttnItem*>(
      dev->AllocHost(2 * kTables * sizeof(cuda::BankAttnItem)).value());
  auto* admit = static_cast<cuda::BankAdmitItem*>(
      dev->AllocHost(2 * kTables * sizeof(cuda::BankAdmitItem)).value());
  // The host-staged flow: LaunchBankResolve, the host reads the miss lists back and writes the
  // missed rows as one compact block (per-table first row in a header), one copy carries it, a
  // kResolved launch attends everything, Admit takes its rows from the compact block.
  auto* resolved = static_cast<int32_t*>(dalloc(kTables * sel_n * 4));
  auto* first_d = static_cast<int32_t*>(dalloc(kTables * 4));
  char* compact = static_cast<char*>(dalloc(static_cast<size_t>(kTables) * kMissCap * 2 * kRow));
  auto* items_r = static_cast<cuda::BankAttnItem*>(
      dev->AllocHost(kTables * sizeof(cuda::BankAttnItem)).value());
  for (int t = 0; t < kTables; ++t) {
    cuda::BankAttnItem it;
    it.q = dq + t * kGroup * kHd;
    it.o = doo + t * kGroup * kHd;
    it.lse = dl + t * kGroup;
    it.positions = dpos + t * sel_n;
    it.count = sel_n;
    it.store = row_ptr(t, 0);
    it.store_stride = 2 * kRow;
    it.stage = stage + static_cast<size_t>(t) * sel_n * 2 * kRow;
    it.miss_list = dmiss + t * (kMissCap + 1);
    it.miss_cap = kMissCap;
    bank->Describe(t, &it);
    items[t] = it;
    it.o = dob + t * kGroup * kHd;
    it.lse = dlb + t * kGroup;
    it.ref_bits = nullptr;
    items[kTables + t] = it;
    admit[t].table = t;
    admit[t].miss_cap = kMissCap;
    admit[t].positions = it.positions;
    admit[t].miss_list = it.miss_list;
    admit[t].stage = it.stage;
    it = items[t];
    it.resolved = resolved + t * sel_n;
    it.stage = compact;
    it.stage_first = first_d + t;
    items_r[t] = it;
    admit[kTables + t] = admit[t];
    admit[kTables + t].stage = compact;
    admit[kTables + t].stage_first = first_d + t;
  }
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  std::vector<std::vector<int32_t>> sel(kTables, std::vector<int32_t>(sel_n));
  for (auto& v : sel)
    for (auto& x : v) x = static_cast<int32_t>(rng() % kCtx);
  int64_t reported_total = 0;
  for (int step = 0; step < kSteps; ++step) {
    for (auto& v : sel) {  // 20% churn, plus a duplicate position now and then
      for (int j = 0; j < sel_n / 5; ++j) v[rng() % sel_n] = static_cast<int32_t>(rng() % kCtx);
      v[rng() % sel_n] = v[rng() % sel_n];
    }
    std::vector<float> q(qn);
    for (auto& x : q) x = nd(rng);
    std::vector<int32_t> flat;
    for (auto& v : sel) flat.insert(flat.end(), v.begin(), v.end());
    ASSERT_EQ(cudaMemcpy(dq, q.data(), qn * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dpos, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(doo, 0xff, qn * 4), cudaSuccess);  // poison
    // A copy from pageable memory may return before its DMA lands, and the device's calls below
    // run on its own non-blocking stream (nullptr): wait for the copies first.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<std::vector<int32_t>> before(kTables);
    for (int t = 0; t < kTables; ++t) before[t] = bank->FindAll(t, sel[t]).value();
    const int flow = step % 3;
    if (flow == 0) {  // one launch
      ASSERT_TRUE(dev->AttendBank(p, items, kTables, cuda::BankPass::kAll, nullptr, sel_n).ok());
    } else if (flow == 2) {  // resolve, host-staged compact misses, one kResolved launch
      ASSERT_EQ(cudaMemset(resolved, 0x7f, kTables * sel_n * 4), cudaSuccess);  // poison
      ASSERT_TRUE(dev->ResolveBank(items_r, kTables, sel_n, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<int32_t> ml(kTables * (kMissCap + 1)), res(kTables * sel_n);
      ASSERT_EQ(cudaMemcpy(ml.data(), dmiss, ml.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(res.data(), resolved, res.size() * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
      std::vector<int32_t> first(kTables);
      std::vector<char> block;
      for (int t = 0; t < kTables; ++t) {
        const int32_t* m = ml.data() + t * (kMissCap + 1);
        first[t] = static_cast<int32_t>(block.size() / (2 * kRow));
        std::vector<int32_t> want(sel_n, 0);
        for (int j = 0; j < sel_n; ++j) want[j] = before[t][j];
        for (int i = 0; i < m[0]; ++i) {
          const int32_t j = m[1 + i];
          ASSERT_LT(before[t][j], 0) << "a hit in the miss list";
          want[j] = -1 - i;
          const char* row = row_ptr(t, sel[t][j]);
          block.insert(block.end(), row, row + 2 * kRow);
        }
        for (int j = 0; j < sel_n; ++j) {
          ASSERT_EQ(res[t * sel_n + j], want[j]) << "resolved[" << j << "] table " << t;
        }
      }
      ASSERT_EQ(cudaMemcpy(first_d, first.data(), kTables * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(compact, block.data(), block.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the DMA has landed (see above)
      ASSERT_TRUE(
          dev->AttendBank(p, items_r, kTables, cuda::BankPass::kResolved, nullptr, sel_n).ok());
    } else {  // gather the misses, hits + staged misses, merged
      ASSERT_TRUE(dev->GatherBank(p, items, kTables, sel_n, nullptr).ok());
      ASSERT_TRUE(dev->AttendBank(p, items, kTables, cuda::BankPass::kHits, nullptr, sel_n).ok());
      ASSERT_TRUE(
          dev->AttendBank(p, items + kTables, kTables, cuda::BankPass::kStaged, nullptr, sel_n).ok());
      ASSERT_TRUE(
          dev->MergeLse(doo, dl, dob, dlb, kTables * kGroup, kHd, nullptr, DType::kF32, nullptr)
              .ok());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // Output vs the reference over every selected row.
    std::vector<float> o(qn), lse(kTables * kGroup), o_ref(qn), lse_ref(kTables * kGroup);
    ASSERT_EQ(cudaMemcpy(o.data(), doo, qn * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(lse.data(), dl, lse.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int t = 0; t < kTables; ++t) {
      std::vector<const void*> kr, vr;
      for (int32_t pos : sel[t]) {
        kr.push_back(row_ptr(t, pos));
        vr.push_back(row_ptr(t, pos) + kRow);
      }
      cpu::AttendRowsRef(p, RowAttnItem{q.data() + t * kGroup * kHd, o_ref.data() + t * kGroup * kHd,
                                        lse_ref.data() + t * kGroup, kr.data(), vr.data(), sel_n});
    }
    int bad = 0;
    for (size_t i = 0; i < qn; ++i) {
      if (!(std::abs(o[i] - o_ref[i]) <= 2e-3 + 2e-3 * std::abs(o_ref[i])) && bad++ < 5) {
        ADD_FAILURE() << "step " << step << " o[" << i << "] " << o[i] << " want " << o_ref[i];
      }
    }
    for (size_t i = 0; i < lse.size(); ++i) {
      EXPECT_NEAR(lse[i], lse_ref[i], 2e-3 + 2e-3 * std::abs(lse_ref[i])) << "step " << step;
    }
    // Miss lists: exactly the list indices whose position was not banked before the step.
    std::vector<int32_t> ml(kTables * (kMissCap + 1));
    ASSERT_EQ(cudaMemcpy(ml.data(), dmiss, ml.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int t = 0; t < kTables; ++t) {
      std::multiset<int32_t> want, got;
      for (int j = 0; j < sel_n; ++j) {
        if (before[t][j] < 0) want.insert(j);
      }
      const int32_t* m = ml.data() + t * (kMissCap + 1);
      ASSERT_EQ(m[0], static_cast<int32_t>(want.size())) << "step " << step << " table " << t;
      for (int j = 0; j < m[0]; ++j) got.insert(m[1 + j]);
      EXPECT_EQ(got, want) << "step " << step << " table " << t;
      reported_total += m[0];
    }
    ASSERT_TRUE(bank->Admit(admit + (flow == 2 ? kTables : 0), kTables, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ml.data(), dmiss, ml.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    // Invariants after admission.
    for (int t = 0; t < kTables; ++t) {
      EXPECT_EQ(ml[t * (kMissCap + 1)], 0) << "miss count reset";
      const std::vector<int32_t> spos = bank->SlotPositions(t).value();
      std::vector<int32_t> banked;
      std::vector<int32_t> slot_of;
      for (int s = 0; s < cs.slots; ++s) {
        if (spos[s] >= 0) {
          ASSERT_LT(spos[s], kCtx);
          banked.push_back(spos[s]);
          slot_of.push_back(s);
        }
      }
      std::set<int32_t> uniq(banked.begin(), banked.end());
      ASSERT_EQ(uniq.size(), banked.size()) << "a position banked twice, step " << step;
      const std::vector<int32_t> found = bank->FindAll(t, banked).value();
      for (size_t i = 0; i < banked.size(); ++i) {
        ASSERT_EQ(found[i], slot_of[i]) << "map and slot table disagree on " << banked[i];
      }
      // The map holds nothing else: probe every position.
      std::vector<int32_t> all(kCtx);
      for (int i = 0; i < kCtx; ++i) all[i] = i;
      const std::vector<int32_t> every = bank->FindAll(t, all).value();
      EXPECT_EQ(static_cast<size_t>(std::count_if(every.begin(), every.end(),
                                                  [](int32_t s) { return s >= 0; })),
                banked.size());
      std::vector<char> rows(static_cast<size_t>(cs.slots) * 2 * kRow);
      ASSERT_EQ(cudaMemcpy(rows.data(), bank->SlotK(t, 0), rows.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (size_t i = 0; i < banked.size(); ++i) {
        ASSERT_EQ(std::memcmp(rows.data() + static_cast<size_t>(slot_of[i]) * 2 * kRow,
                              row_ptr(t, banked[i]), 2 * kRow),
                  0)
            << "bank row of position " << banked[i];
      }
      if (cs.expect_all_banked) {
        for (int32_t pos : sel[t]) {
          EXPECT_TRUE(uniq.count(pos)) << "position " << pos << " of step " << step
                                       << " not banked";
        }
      }
    }
  }
  const cuda::DeviceBankCounters ctr = bank->Counters().value();
  EXPECT_EQ(ctr.misses, reported_total);
  EXPECT_EQ(ctr.admitted + ctr.rejected, ctr.misses);
  EXPECT_GT(ctr.admitted, 0);
  if (cs.map == BankMapKind::kHash && cs.hash_capacity > 0 && cs.hash_capacity < cs.slots) {
    EXPECT_GT(ctr.rejected, 0) << "a hash map smaller than the bank must fill up";
  }
  if (cs.map == BankMapKind::kHash && cs.hash_capacity == 0) {
    EXPECT_GT(ctr.rebuilds, 0) << "churn must leave enough tombstones for a rebuild";
  }
  // Reset empties the tables.
  ASSERT_TRUE(bank->ResetTables(1, 2, nullptr).ok());
  for (int t = 1; t < kTables; ++t) {
    const std::vector<int32_t> spos = bank->SlotPositions(t).value();
    EXPECT_TRUE(std::all_of(spos.begin(), spos.end(), [](int32_t x) { return x < 0; }));
    const std::vector<int32_t> f = bank->FindAll(t, sel[t]).value();
    EXPECT_TRUE(std::all_of(f.begin(), f.end(), [](int32_t x) { return x < 0; }));
  }
  const std::vector<int32_t> f0 = bank->FindAll(0, sel[0]).value();
  if (cs.expect_all_banked) {
    EXPECT_TRUE(std::all_of(f0.begin(), f0.end(), [](int32_t x) { return x >= 0; }))
        << "table 0 must survive the reset of tables 1-2";
  }
  dev->FreeHost(items);
  dev->FreeHost(items_r);
  dev->FreeHost(admit);
  for (void* ptr : {static_cast<void*>(resolved), static_cast<void*>(first_d),
                    static_cast<void*>(compact)}) {
    dev->FreeDevice(ptr);
  }
  for (void* ptr : {static_cast<void*>(dq), static_cast<void*>(doo), static_cast<void*>(dl),
                    static_cast<void*>(dob), static_cast<void*>(dlb),
                    static_cast<void*>(dpos), static_cast<void*>(dmiss), static_cast<void*>(stage)}) {
    dev->FreeDevice(ptr);
  }
  dev->FreeHost(store);
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, DeviceBankTest,
    ::testing::Values(Case{BankMapKind::kVector, 400, 0, 200, true, "vector"},
                      Case{BankMapKind::kHash, 400, 0, 200, true, "hash"},
                      Case{BankMapKind::kVector, 97, 0, 200, false, "vector_small_bank"},
                      Case{BankMapKind::kHash, 700, 0, 333, true, "hash_odd"},
                      Case{BankMapKind::kHash, 256, 64, 200, false, "hash_full_map"}),
    [](const auto& info) { return std::string(info.param.name); });

// kResolved with a miss list far smaller than the misses: the listed misses come from the compact
// stage, the rest (kResolvedFromStore) straight from the pinned store, hits from the bank; two
// steps, so the second has hits from the first step's admissions.
TEST(DeviceBankResolve, MissesPastTheListReadFromStore) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  auto dev = cuda::CudaDevice::Create(0).value();
  constexpr int kTables = 2, kCtx = 1000, kSel = 300, kCap = 10;
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t store_bytes = static_cast<size_t>(kTables) * kCtx * 2 * kRow;
  auto* store = static_cast<uint16_t*>(dev->AllocHost(store_bytes).value());
  for (size_t i = 0; i < store_bytes / 2; ++i) store[i] = cpu::F32ToBf16(nd(rng));
  auto row_ptr = [&](int t, int32_t pos) {
    return reinterpret_cast<const char*>(store) + ((static_cast<size_t>(t) * kCtx + pos) * 2) * kRow;
  };
  cuda::DeviceBankConfig c;
  c.num_tables = kTables;
  c.slots = 64;
  c.max_positions = kCtx;
  c.map = BankMapKind::kVector;
  auto bank = cuda::DeviceBank::Create(dev.get(), c).value();
  auto dalloc = [&](size_t bytes) { return dev->AllocDevice(bytes).value(); };
  const size_t qn = static_cast<size_t>(kTables) * kGroup * kHd;
  float* dq = static_cast<float*>(dalloc(qn * 4));
  float* doo = static_cast<float*>(dalloc(qn * 4));
  float* dl = static_cast<float*>(dalloc(kTables * kGroup * 4));
  auto* dpos = static_cast<int32_t*>(dalloc(kTables * kSel * 4));
  auto* dmiss = static_cast<int32_t*>(dalloc(kTables * (kCap + 1) * 4));
  auto* resolved = static_cast<int32_t*>(dalloc(kTables * kSel * 4));
  auto* first_d = static_cast<int32_t*>(dalloc(kTables * 4));
  char* compact = static_cast<char*>(dalloc(static_cast<size_t>(kTables) * kCap * 2 * kRow));
  ASSERT_EQ(cudaMemset(dmiss, 0, kTables * (kCap + 1) * 4), cudaSuccess);
  auto* items = static_cast<cuda::BankAttnItem*>(
      dev->AllocHost(kTables * sizeof(cuda::BankAttnItem)).value());
  auto* admit = static_cast<cuda::BankAdmitItem*>(
      dev->AllocHost(kTables * sizeof(cuda::BankAdmitItem)).value());
  for (int t = 0; t < kTables; ++t) {
    cuda::BankAttnItem it;
    it.q = dq + t * kGroup * kHd;
    it.o = doo + t * kGroup * kHd;
    it.lse = dl + t * kGroup;
    it.positions = dpos + t * kSel;
    it.count = kSel;
    it.store = row_ptr(t, 0);
    it.store_stride = 2 * kRow;
    it.stage = compact;
    it.stage_first = first_d + t;
    it.miss_list = dmiss + t * (kCap + 1);
    it.miss_cap = kCap;
    it.resolved = resolved + t * kSel;
    bank->Describe(t, &it);
    items[t] = it;
    admit[t] = cuda::BankAdmitItem{t, kCap, it.positions, it.miss_list, compact, first_d + t};
  }
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  std::vector<int32_t> flat(kTables * kSel);
  for (auto& x : flat) x = static_cast<int32_t>(rng() % kCtx);
  for (int step = 0; step < 2; ++step) {
    std::vector<float> q(qn);
    for (auto& x : q) x = nd(rng);
    ASSERT_EQ(cudaMemcpy(dq, q.data(), qn * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dpos, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(doo, 0xff, qn * 4), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the pageable copies' DMA has landed
    ASSERT_TRUE(dev->ResolveBank(items, kTables, kSel, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int32_t> ml(kTables * (kCap + 1)), res(kTables * kSel);
    ASSERT_EQ(cudaMemcpy(ml.data(), dmiss, ml.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(res.data(), resolved, res.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<int32_t> first(kTables);
    std::vector<char> block;
    int from_store = 0, hits = 0;
    for (int t = 0; t < kTables; ++t) {
      first[t] = static_cast<int32_t>(block.size() / (2 * kRow));
      const int32_t* m = ml.data() + t * (kCap + 1);
      ASSERT_GT(m[0], kCap) << "the test needs more misses than the list holds";
      for (int i = 0; i < kCap; ++i) {
        const char* row = row_ptr(t, flat[t * kSel + m[1 + i]]);
        block.insert(block.end(), row, row + 2 * kRow);
      }
      for (int j = 0; j < kSel; ++j) {
        from_store += res[t * kSel + j] == cuda::kResolvedFromStore;
        hits += res[t * kSel + j] >= 0;
      }
    }
    EXPECT_GT(from_store, 0);
    if (step == 1) EXPECT_GT(hits, 0) << "the first step's admissions must hit";
    ASSERT_EQ(cudaMemcpy(first_d, first.data(), kTables * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(compact, block.data(), block.size(), cudaMemcpyHostToDevice), cudaSuccess);
    // A pageable copy may return before its DMA lands; the device's stream does not wait for it.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(dev->AttendBank(p, items, kTables, cuda::BankPass::kResolved, nullptr, kSel).ok());
    ASSERT_TRUE(bank->Admit(admit, kTables, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> o(qn), o_ref(qn), lse_ref(kTables * kGroup);
    ASSERT_EQ(cudaMemcpy(o.data(), doo, qn * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int t = 0; t < kTables; ++t) {
      std::vector<const void*> kr, vr;
      for (int j = 0; j < kSel; ++j) {
        kr.push_back(row_ptr(t, flat[t * kSel + j]));
        vr.push_back(row_ptr(t, flat[t * kSel + j]) + kRow);
      }
      cpu::AttendRowsRef(p, RowAttnItem{q.data() + t * kGroup * kHd, o_ref.data() + t * kGroup * kHd,
                                        lse_ref.data() + t * kGroup, kr.data(), vr.data(), kSel});
    }
    for (size_t i = 0; i < qn; ++i) {
      ASSERT_NEAR(o[i], o_ref[i], 2e-3 + 2e-3 * std::abs(o_ref[i])) << "step " << step << " " << i;
    }
    // Banked rows equal their store rows (Admit read the compact block).
    const std::vector<int32_t> spos = bank->SlotPositions(0).value();
    std::vector<char> rows(static_cast<size_t>(c.slots) * 2 * kRow);
    ASSERT_EQ(cudaMemcpy(rows.data(), bank->SlotK(0, 0), rows.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    int banked = 0;
    for (int s = 0; s < c.slots; ++s) {
      if (spos[s] < 0) continue;
      ++banked;
      ASSERT_EQ(std::memcmp(rows.data() + static_cast<size_t>(s) * 2 * kRow, row_ptr(0, spos[s]),
                            2 * kRow),
                0);
    }
    EXPECT_GT(banked, 0);
  }
  dev->FreeHost(items);
  dev->FreeHost(admit);
  for (void* ptr : {static_cast<void*>(dq), static_cast<void*>(doo), static_cast<void*>(dl),
                    static_cast<void*>(dpos), static_cast<void*>(dmiss),
                    static_cast<void*>(resolved), static_cast<void*>(first_d),
                    static_cast<void*>(compact)}) {
    dev->FreeDevice(ptr);
  }
  dev->FreeHost(store);
}

TEST(DeviceBankErrors, BadConfigAndRanges) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  auto dev = cuda::CudaDevice::Create(0).value();
  cuda::DeviceBankConfig c;
  c.slots = 0;
  c.max_positions = 100;
  auto r = cuda::DeviceBank::Create(dev.get(), c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().ToString().find("slots 0"), std::string::npos) << r.status().ToString();
  c.slots = 16;
  c.max_admit_per_table = cuda::DeviceBank::kMaxAdmit + 1;
  EXPECT_FALSE(cuda::DeviceBank::Create(dev.get(), c).ok());
  c.max_admit_per_table = 0;
  c.max_positions = 0;
  EXPECT_FALSE(cuda::DeviceBank::Create(dev.get(), c).ok());
  c.max_positions = 100;
  c.num_tables = 2;
  auto bank = cuda::DeviceBank::Create(dev.get(), c).value();
  EXPECT_FALSE(bank->ResetTables(1, 2, nullptr).ok());
  EXPECT_FALSE(bank->SlotPositions(2).ok());
  EXPECT_FALSE(bank->FindAll(-1, {1}).ok());
  EXPECT_FALSE(bank->Admit(nullptr, 1, nullptr).ok());
}

}  // namespace
}  // namespace kvferry
