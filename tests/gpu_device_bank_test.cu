// Copyright kvferry authors. Apache-2.0.
// cuda::DeviceBank (the device-resident token bank behind the planned step's StepBank on CUDA)
// over a decode stream. Each step does on the host what the planned step's kernel does before
// its admission (gpu/decode_step.cu): the reference bit of every hit slot, each miss's list index
// appended to its table's miss list (in any order, as the kernel's atomics leave it) and its K
// and V rows staged, either at the list index or (every other step) as one compact block
// (BankAdmitItem::stage_first). After each Admit the bank's invariants are read back from the
// device: slot -> position and the map are inverse, no position twice, every banked row equals
// its store row, counters add up, and (slots >= 2x the selection) every position of the step is
// banked afterwards (CLOCK never evicts a slot the step read while zero-count slots remain).
// Vector map, hash map (tombstones and rebuilds), a hash map smaller than the bank (full-table
// rejections), a miss count past the list's capacity, ResetTables and bad input.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "cpu/dtype.h"
#include "gpu/cuda_device.h"
#include "gpu/device_bank.h"

namespace kvferry {
namespace {

constexpr int kHd = 128;
constexpr size_t kRow = kHd * 2;

struct Case {
  BankMapKind map;
  int slots;
  int64_t hash_capacity;
  int sel;
  bool expect_all_banked;
  const char* name;
};

// One step's bank reads, as the planned step leaves them for the admission: \p before[t][j] is
// the slot of position sel[t][j] before the step (-1: a miss). Sets the hits' reference bits in
// \p refs (ref_words per table), writes each table's miss list into \p ml (count, then up to
// \p cap list indices) and stages the listed rows: at their list index in \p at_index
// (per_table rows per table) or, when \p block is set, appended to it with each table's first
// row in \p first. Returns the misses reported over all tables.
template <class RowPtr>
int64_t StageStep(const std::vector<std::vector<int32_t>>& sel,
                  const std::vector<std::vector<int32_t>>& before, RowPtr row_ptr, int cap,
                  int64_t ref_words, std::mt19937& rng, std::vector<uint32_t>* refs,
                  std::vector<int32_t>* ml, std::vector<char>* at_index, size_t per_table,
                  std::vector<char>* block, std::vector<int32_t>* first) {
  int64_t reported = 0;
  for (size_t t = 0; t < sel.size(); ++t) {
    std::vector<int32_t> misses;
    for (size_t j = 0; j < sel[t].size(); ++j) {
      const int32_t s = before[t][j];
      if (s >= 0) {
        (*refs)[t * ref_words + (s >> 5)] |= 1u << (s & 31);
      } else {
        misses.push_back(static_cast<int32_t>(j));
      }
    }
    std::shuffle(misses.begin(), misses.end(), rng);
    int32_t* m = ml->data() + t * (cap + 1);
    m[0] = static_cast<int32_t>(misses.size());
    reported += m[0];
    if (block != nullptr) (*first)[t] = static_cast<int32_t>(block->size() / (2 * kRow));
    for (int i = 0; i < std::min<int>(cap, static_cast<int>(misses.size())); ++i) {
      const int32_t j = misses[i];
      m[1 + i] = j;
      const char* row = row_ptr(static_cast<int>(t), sel[t][j]);
      if (block != nullptr) {
        block->insert(block->end(), row, row + 2 * kRow);
      } else {
        std::memcpy(at_index->data() + (t * per_table + j) * 2 * kRow, row, 2 * kRow);
      }
    }
  }
  return reported;
}

class DeviceBankTest : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceBankTest, DecodeStreamKeepsInvariants) {
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
  StepBankView view;
  bank->ViewAll(&view);
  ASSERT_NE(view.refs, nullptr);

  auto dalloc = [&](size_t bytes) { return dev->AllocDevice(bytes).value(); };
  auto* dpos = static_cast<int32_t*>(dalloc(kTables * sel_n * 4));
  auto* dmiss = static_cast<int32_t*>(dalloc(kTables * (kMissCap + 1) * 4));
  char* stage = static_cast<char*>(dalloc(static_cast<size_t>(kTables) * sel_n * 2 * kRow));
  auto* first_d = static_cast<int32_t*>(dalloc(kTables * 4));
  char* compact = static_cast<char*>(dalloc(static_cast<size_t>(kTables) * kMissCap * 2 * kRow));
  // admit[0, kTables): rows at their list index in stage; admit[kTables, 2 kTables): the compact
  // block (per-table first row at first_d).
  auto* admit = static_cast<cuda::BankAdmitItem*>(
      dev->AllocHost(2 * kTables * sizeof(cuda::BankAdmitItem)).value());
  for (int t = 0; t < kTables; ++t) {
    admit[t].table = t;
    admit[t].miss_cap = kMissCap;
    admit[t].positions = dpos + t * sel_n;
    admit[t].miss_list = dmiss + t * (kMissCap + 1);
    admit[t].stage = stage + static_cast<size_t>(t) * sel_n * 2 * kRow;
    admit[kTables + t] = admit[t];
    admit[kTables + t].stage = compact;
    admit[kTables + t].stage_first = first_d + t;
  }
  std::vector<std::vector<int32_t>> sel(kTables, std::vector<int32_t>(sel_n));
  for (auto& v : sel)
    for (auto& x : v) x = static_cast<int32_t>(rng() % kCtx);
  int64_t reported_total = 0;
  std::vector<int32_t> ml(kTables * (kMissCap + 1));
  std::vector<uint32_t> refs(kTables * view.ref_words);
  std::vector<char> at_index(static_cast<size_t>(kTables) * sel_n * 2 * kRow);
  for (int step = 0; step < kSteps; ++step) {
    for (auto& v : sel) {  // 20% churn, plus a duplicate position now and then
      for (int j = 0; j < sel_n / 5; ++j) v[rng() % sel_n] = static_cast<int32_t>(rng() % kCtx);
      v[rng() % sel_n] = v[rng() % sel_n];
    }
    std::vector<int32_t> flat;
    for (auto& v : sel) flat.insert(flat.end(), v.begin(), v.end());
    ASSERT_EQ(cudaMemcpy(dpos, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<std::vector<int32_t>> before(kTables);
    for (int t = 0; t < kTables; ++t) before[t] = bank->FindAll(t, sel[t]).value();
    const bool use_compact = step % 2 == 1;
    ASSERT_EQ(cudaMemcpy(refs.data(), view.refs, refs.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<char> block;
    std::vector<int32_t> first(kTables);
    reported_total += StageStep(sel, before, row_ptr, kMissCap, view.ref_words, rng, &refs, &ml,
                                &at_index, sel_n, use_compact ? &block : nullptr, &first);
    ASSERT_EQ(cudaMemcpy(view.refs, refs.data(), refs.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dmiss, ml.data(), ml.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    if (use_compact) {
      ASSERT_EQ(cudaMemcpy(first_d, first.data(), kTables * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(compact, block.data(), block.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
    } else {
      ASSERT_EQ(cudaMemcpy(stage, at_index.data(), at_index.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    // A copy from pageable memory may return before its DMA lands, and the bank's calls run on
    // the device's own non-blocking stream (nullptr): wait for the copies first.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(bank->Admit(admit + (use_compact ? kTables : 0), kTables, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ml.data(), dmiss, ml.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(refs.data(), view.refs, refs.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_TRUE(std::all_of(refs.begin(), refs.end(), [](uint32_t w) { return w == 0; }))
        << "Admit folds and clears the reference bits, step " << step;
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
  dev->FreeHost(admit);
  for (void* ptr : {static_cast<void*>(dpos), static_cast<void*>(dmiss), static_cast<void*>(stage),
                    static_cast<void*>(first_d), static_cast<void*>(compact)}) {
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

// The step counts every miss but lists only miss_cap of them: Admit admits the listed rows from
// the compact block, counts the rest as rejected, and the next step hits what it admitted.
TEST(DeviceBankAdmit, MissCountPastTheListAdmitsTheListedRows) {
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
  StepBankView view;
  bank->ViewAll(&view);
  auto dalloc = [&](size_t bytes) { return dev->AllocDevice(bytes).value(); };
  auto* dpos = static_cast<int32_t*>(dalloc(kTables * kSel * 4));
  auto* dmiss = static_cast<int32_t*>(dalloc(kTables * (kCap + 1) * 4));
  auto* first_d = static_cast<int32_t*>(dalloc(kTables * 4));
  char* compact = static_cast<char*>(dalloc(static_cast<size_t>(kTables) * kCap * 2 * kRow));
  auto* admit = static_cast<cuda::BankAdmitItem*>(
      dev->AllocHost(kTables * sizeof(cuda::BankAdmitItem)).value());
  for (int t = 0; t < kTables; ++t) {
    admit[t] = cuda::BankAdmitItem{t, kCap, dpos + t * kSel, dmiss + t * (kCap + 1), compact,
                                   first_d + t};
  }
  std::vector<std::vector<int32_t>> sel(kTables, std::vector<int32_t>(kSel));
  std::vector<int32_t> flat;
  for (auto& v : sel) {
    for (auto& x : v) x = static_cast<int32_t>(rng() % kCtx);
    flat.insert(flat.end(), v.begin(), v.end());
  }
  ASSERT_EQ(cudaMemcpy(dpos, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<std::set<int32_t>> listed(kTables);
  int64_t reported_total = 0;
  for (int step = 0; step < 2; ++step) {
    std::vector<std::vector<int32_t>> before(kTables);
    int hits = 0;
    for (int t = 0; t < kTables; ++t) {
      before[t] = bank->FindAll(t, sel[t]).value();
      hits += static_cast<int>(std::count_if(before[t].begin(), before[t].end(),
                                             [](int32_t s) { return s >= 0; }));
    }
    if (step == 1) EXPECT_GT(hits, 0) << "the first step's admissions must hit";
    std::vector<int32_t> ml(kTables * (kCap + 1)), first(kTables);
    std::vector<uint32_t> refs(kTables * view.ref_words);
    ASSERT_EQ(cudaMemcpy(refs.data(), view.refs, refs.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<char> block;
    reported_total += StageStep(sel, before, row_ptr, kCap, view.ref_words, rng, &refs, &ml,
                                nullptr, 0, &block, &first);
    for (int t = 0; t < kTables; ++t) {
      const int32_t* m = ml.data() + t * (kCap + 1);
      ASSERT_GT(m[0], kCap) << "the test needs more misses than the list holds";
      for (int i = 0; i < kCap; ++i) listed[t].insert(sel[t][m[1 + i]]);
    }
    ASSERT_EQ(cudaMemcpy(view.refs, refs.data(), refs.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dmiss, ml.data(), ml.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(first_d, first.data(), kTables * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(compact, block.data(), block.size(), cudaMemcpyHostToDevice), cudaSuccess);
    // A pageable copy may return before its DMA lands; the device's stream does not wait for it.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(bank->Admit(admit, kTables, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int t = 0; t < kTables; ++t) {
      // 64 slots hold every listed position of both steps: the bank is exactly those.
      const std::vector<int32_t> spos = bank->SlotPositions(t).value();
      std::set<int32_t> banked;
      std::vector<char> rows(static_cast<size_t>(c.slots) * 2 * kRow);
      ASSERT_EQ(cudaMemcpy(rows.data(), bank->SlotK(t, 0), rows.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (int s = 0; s < c.slots; ++s) {
        if (spos[s] < 0) continue;
        banked.insert(spos[s]);
        ASSERT_EQ(std::memcmp(rows.data() + static_cast<size_t>(s) * 2 * kRow,
                              row_ptr(t, spos[s]), 2 * kRow),
                  0)
            << "bank row of position " << spos[s];
      }
      EXPECT_EQ(banked, listed[t]) << "step " << step << " table " << t;
    }
  }
  const cuda::DeviceBankCounters ctr = bank->Counters().value();
  EXPECT_EQ(ctr.misses, reported_total);
  EXPECT_EQ(ctr.admitted + ctr.rejected, ctr.misses);
  EXPECT_EQ(ctr.admitted, static_cast<int64_t>(listed[0].size() + listed[1].size()));
  dev->FreeHost(admit);
  for (void* ptr : {static_cast<void*>(dpos), static_cast<void*>(dmiss),
                    static_cast<void*>(first_d), static_cast<void*>(compact)}) {
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
