// Copyright kvferry authors. Apache-2.0.
// CUDA-only kernel APIs against the scalar reference. Exact top-k against cpu::TopKRef: ties
// (quantised scores), NaN and -inf, odd sizes, the shared-memory (k <= 4096) and workspace sort
// paths, several rows per launch. The token bank's position-list attention (LaunchAttendBank via
// CudaDevice::AttendBank) with the bank's device page tables: direct, hits + misses merged by lse
// against cpu::AttendRowsRef over all positions, the miss list and the staged miss rows.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_kernels.h"
#include "gpu/device.h"
#include "offload/token_bank.h"

namespace kvferry {
namespace {

class GpuTopKTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, bool>> {};

TEST_P(GpuTopKTest, MatchesReferenceWithDeterministicTies) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  const auto [n, k, ties] = GetParam();
  const int64_t rows = 3;
  std::mt19937 rng(static_cast<uint32_t>(n * 31 + k + ties));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> scores(rows * n);
  for (auto& x : scores) x = ties ? std::round(nd(rng) * 4.f) / 4.f : nd(rng);
  for (int64_t i = 0; i < rows * n; i += 13) scores[i] = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 5; i < rows * n; i += 17) scores[i] = -std::numeric_limits<float>::infinity();
  const int64_t kk = std::min(k, n);
  float* d_scores = nullptr;
  int32_t* d_out = nullptr;
  void* ws = nullptr;
  const size_t ws_bytes = cuda::TopKWorkspaceBytes(rows, k);
  ASSERT_EQ(cudaMalloc(&d_scores, scores.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, rows * kk * 4 + 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&ws, ws_bytes + 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_scores, scores.data(), scores.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(d_out, 0xff, rows * kk * 4 + 4), cudaSuccess);  // poison
  const Status st = cuda::LaunchTopK(d_scores, n, n, rows, k, d_out, ws, ws_bytes, nullptr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<int32_t> got(rows * kk);
  ASSERT_EQ(cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> want(kk);
    cpu::TopKRef(scores.data() + r * n, n, k, want.data());
    int bad = 0;
    for (int64_t i = 0; i < kk; ++i) {
      if (got[r * kk + i] != want[i] && bad++ < 5) {
        ADD_FAILURE() << "row " << r << " rank " << i << ": got " << got[r * kk + i] << " want "
                      << want[i];
      }
    }
    EXPECT_EQ(bad, 0);
  }
  cudaFree(d_scores);
  cudaFree(d_out);
  cudaFree(ws);
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuTopKTest,
                         ::testing::Combine(::testing::Values(1, 17, 97, 4099, 131072),
                                            ::testing::Values(1, 17, 1000, 5000),
                                            ::testing::Bool()));

// ---- token bank position-list attention ---------------------------------------------------------

class GpuBankAttendTest : public ::testing::TestWithParam<BankMapKind> {};

TEST_P(GpuBankAttendTest, HitsPlusMissesMatchReferenceAndMissesAreStaged) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  auto dev_r = cuda::CudaDevice::Create(0);
  ASSERT_TRUE(dev_r.ok()) << dev_r.status().ToString();
  auto dev = std::move(dev_r).value();
  constexpr int kHd = 128, kGroup = 4, kItems = 3, kCtx = 1000, kSel = 333;
  const size_t row = kHd * 2;
  std::mt19937 rng(11 + static_cast<int>(GetParam()));
  std::normal_distribution<float> nd(0.f, 1.f);
  // Host store (pinned, mapped): item i, position p: K at ((i * ctx + p) * 2) rows, V next.
  const size_t store_bytes = static_cast<size_t>(kItems) * kCtx * 2 * row;
  auto* store = static_cast<uint16_t*>(dev->AllocHost(store_bytes).value());
  for (size_t i = 0; i < store_bytes / 2; ++i) store[i] = cpu::F32ToBf16(nd(rng));
  auto row_ptr = [&](int item, int32_t pos) {
    return reinterpret_cast<const char*>(store) +
           ((static_cast<size_t>(item) * kCtx + pos) * 2) * row;
  };
  TokenBankConfig c;
  c.num_kv_heads = kItems;
  c.slots = 200;
  c.max_positions = kCtx;
  c.head_dim = kHd;
  c.map = GetParam();
  c.max_admit_per_table = 200;
  c.device_map = true;
  auto bank_r = TokenBank::Create(dev.get(), c);
  ASSERT_TRUE(bank_r.ok()) << bank_r.status().ToString();
  auto bank = std::move(bank_r).value();
  std::vector<std::vector<int32_t>> sel(kItems);
  ASSERT_TRUE(bank->BeginAdmit(nullptr, nullptr).ok());
  for (int i = 0; i < kItems; ++i) {
    for (int j = 0; j < kSel; ++j) sel[i].push_back(static_cast<int32_t>(rng() % kCtx));
    // Bank about half of the selection (and some unselected positions).
    std::vector<int32_t> adm;
    std::vector<const void*> k, v;
    for (int j = 0; j < kSel; j += 2) adm.push_back(sel[i][j]);
    for (int j = 0; j < 20; ++j) adm.push_back(static_cast<int32_t>(rng() % kCtx));
    for (int32_t p : adm) {
      k.push_back(row_ptr(i, p));
      v.push_back(row_ptr(i, p) + row);
    }
    bank->Admit(i, adm, k.data(), v.data());
  }
  ASSERT_TRUE(bank->CommitAdmit().ok());
  ASSERT_TRUE(bank->WaitReady(nullptr).ok());

  const size_t qn = static_cast<size_t>(kItems) * kGroup * kHd;
  std::vector<float> q(qn);
  for (auto& x : q) x = nd(rng);
  auto dalloc = [&](size_t bytes) { return dev->AllocDevice(bytes).value(); };
  float* dq = static_cast<float*>(dalloc(qn * 4));
  float* oa = static_cast<float*>(dalloc(qn * 4));
  float* ob = static_cast<float*>(dalloc(qn * 4));
  float* la = static_cast<float*>(dalloc(kItems * kGroup * 4));
  float* lb = static_cast<float*>(dalloc(kItems * kGroup * 4));
  auto* dpos = static_cast<int32_t*>(dalloc(kItems * kSel * 4));
  auto* dmiss = static_cast<int32_t*>(dalloc(kItems * (kSel + 1) * 4));
  char* stage = static_cast<char*>(dalloc(static_cast<size_t>(kItems) * kSel * 2 * row));
  std::vector<int32_t> flat;
  for (auto& v : sel) flat.insert(flat.end(), v.begin(), v.end());
  ASSERT_TRUE(dev->CopyAsync(dq, q.data(), qn * 4, nullptr).ok());
  ASSERT_TRUE(dev->CopyAsync(dpos, flat.data(), flat.size() * 4, nullptr).ok());
  ASSERT_EQ(cudaMemset(dmiss, 0, kItems * (kSel + 1) * 4), cudaSuccess);
  auto* items = static_cast<cuda::BankAttnItem*>(
      dev->AllocHost(2 * kItems * sizeof(cuda::BankAttnItem)).value());
  for (int i = 0; i < kItems; ++i) {
    const auto t = bank->device_table(i);
    cuda::BankAttnItem it;
    it.q = dq + i * kGroup * kHd;
    it.o = oa + i * kGroup * kHd;
    it.lse = la + i * kGroup;
    it.positions = dpos + i * kSel;
    it.count = kSel;
    it.vector_map = t.vector_map;
    it.vector_len = t.vector_len;
    it.hash_map = t.hash_map;
    it.hash_log2 = t.hash_log2;
    it.bank_rows = t.bank_rows;
    it.ref_bits = t.ref_bits;
    it.store = row_ptr(i, 0);
    it.store_stride = 2 * row;
    items[i] = it;
    it.o = ob + i * kGroup * kHd;
    it.lse = lb + i * kGroup;
    it.stage = stage + static_cast<size_t>(i) * kSel * 2 * row;
    it.miss_list = dmiss + i * (kSel + 1);
    it.miss_cap = kSel;
    items[kItems + i] = it;
  }
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  // Reference over all positions (rows straight from the store).
  std::vector<float> o_ref(qn), lse_ref(kItems * kGroup);
  for (int i = 0; i < kItems; ++i) {
    std::vector<const void*> kr, vr;
    for (int32_t pos : sel[i]) {
      kr.push_back(row_ptr(i, pos));
      vr.push_back(row_ptr(i, pos) + row);
    }
    cpu::AttendRowsRef(p, RowAttnItem{q.data() + i * kGroup * kHd, o_ref.data() + i * kGroup * kHd,
                                      lse_ref.data() + i * kGroup, kr.data(), vr.data(), kSel});
  }
  auto download = [&](const float* d, size_t n) {
    std::vector<float> h(n);
    EXPECT_TRUE(dev->CopyAsync(h.data(), d, n * 4, nullptr).ok());
    EXPECT_TRUE(dev->SynchronizeStream(nullptr).ok());
    return h;
  };
  auto expect_close = [&](const std::vector<float>& got, const std::vector<float>& want,
                          const char* what) {
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!(std::abs(got[i] - want[i]) <= 2e-3 + 2e-3 * std::abs(want[i])) && bad++ < 5) {
        ADD_FAILURE() << what << "[" << i << "] got " << got[i] << " want " << want[i];
      }
    }
    EXPECT_EQ(bad, 0) << what;
  };
  // Direct: every position from the store read zero-copy, then from a device copy of it.
  ASSERT_TRUE(dev->AttendBank(p, items, kItems, cuda::BankPass::kDirectZeroCopy, nullptr).ok());
  expect_close(download(oa, qn), o_ref, "zero-copy direct o");
  expect_close(download(la, kItems * kGroup), lse_ref, "zero-copy direct lse");
  char* dstore = static_cast<char*>(dalloc(store_bytes));
  ASSERT_TRUE(dev->CopyAsync(dstore, store, store_bytes, nullptr).ok());
  for (int i = 0; i < kItems; ++i)
    items[i].store = dstore + (static_cast<size_t>(i) * kCtx * 2) * row;
  ASSERT_TRUE(dev->AttendBank(p, items, kItems, cuda::BankPass::kDirect, nullptr, kSel).ok());
  expect_close(download(oa, qn), o_ref, "device direct o");
  expect_close(download(la, kItems * kGroup), lse_ref, "device direct lse");
  for (int i = 0; i < kItems; ++i) items[i].store = row_ptr(i, 0);
  // Hits from the bank + misses from the store, merged.
  ASSERT_TRUE(dev->AttendBank(p, items, kItems, cuda::BankPass::kHits, nullptr).ok());
  ASSERT_TRUE(dev->AttendBank(p, items + kItems, kItems, cuda::BankPass::kMisses, nullptr).ok());
  ASSERT_TRUE(
      dev->MergeLse(oa, la, ob, lb, kItems * kGroup, kHd, nullptr, DType::kF32, nullptr).ok());
  expect_close(download(oa, qn), o_ref, "merged o");
  expect_close(download(la, kItems * kGroup), lse_ref, "merged lse");
  // Miss list and staged rows; reference bits of the hit slots.
  std::vector<int32_t> miss(kItems * (kSel + 1));
  ASSERT_EQ(cudaMemcpy(miss.data(), dmiss, miss.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<char> st(static_cast<size_t>(kItems) * kSel * 2 * row);
  ASSERT_EQ(cudaMemcpy(st.data(), stage, st.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < kItems; ++i) {
    std::multiset<int32_t> want, got;
    for (int j = 0; j < kSel; ++j) {
      if (bank->Find(i, sel[i][j]) < 0) want.insert(j);
    }
    const int32_t* ml = miss.data() + i * (kSel + 1);
    ASSERT_EQ(ml[0], static_cast<int32_t>(want.size())) << "item " << i;
    for (int j = 0; j < ml[0]; ++j) {
      got.insert(ml[1 + j]);
      const char* srow = st.data() + (static_cast<size_t>(i) * kSel + ml[1 + j]) * 2 * row;
      EXPECT_EQ(std::memcmp(srow, row_ptr(i, sel[i][ml[1 + j]]), 2 * row), 0)
          << "staged row " << ml[1 + j];
    }
    EXPECT_EQ(got, want) << "item " << i;
  }
  std::vector<uint32_t> refs((c.slots + 31) / 32);
  ASSERT_EQ(cudaMemcpy(refs.data(), bank->device_table(0).ref_bits, refs.size() * 4,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int j = 0; j < kSel; ++j) {
    const int32_t s = bank->Find(0, sel[0][j]);
    if (s >= 0) EXPECT_TRUE(refs[s >> 5] & (1u << (s & 31))) << "slot " << s;
  }
  dev->FreeHost(items);
  for (void* ptr :
       {static_cast<void*>(dq), static_cast<void*>(oa), static_cast<void*>(ob),
        static_cast<void*>(la), static_cast<void*>(lb), static_cast<void*>(dpos),
        static_cast<void*>(dmiss), static_cast<void*>(stage), static_cast<void*>(dstore)}) {
    dev->FreeDevice(ptr);
  }
  dev->FreeHost(store);
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuBankAttendTest,
                         ::testing::Values(BankMapKind::kVector, BankMapKind::kHash),
                         [](const auto& info) {
                           return info.param == BankMapKind::kVector ? "Vector" : "Hash";
                         });

}  // namespace
}  // namespace kvferry
