// Copyright kvferry authors. Apache-2.0.
// LFPS's scan on the GPU (cuda::LaunchShadowScan, gpu/shadow_scan.cu) against cpu::ShadowScanRef, bit
// for bit: the new rows it quantises into the shadow and the ranked picks (keys and positions), on
// random shadows made to tie (few key values), every activation dtype, GQA groups 1-8, head_dim 64
// and 128, channel counts 1-128, items of different lengths in one launch (one with nothing to
// rank, one only writing its row), picks from 1 to the whole range; the table, list and counts in
// device memory and in mapped host memory.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_kernels.h"

namespace kvferry {
namespace {

struct ScanCase {
  int group, head_dim, channels;
  DType act, kv;
  int64_t len;  // the longest item's range
  bool ties;
};

class GpuShadowScanTest : public ::testing::TestWithParam<ScanCase> {};

template <typename T>
T* DeviceCopy(const std::vector<T>& v) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

TEST_P(GpuShadowScanTest, MatchesTheReferenceBitForBit) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  const ScanCase c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.group * 7 + c.head_dim + c.channels * 3 + c.len));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int hd = c.head_dim, group = c.group;
  const int64_t items = 5, cap = c.len + 64;
  // Items: full length, two shorter ones, one that only writes its row, one with few picks.
  std::vector<ShadowScanItem> item(items);
  const int64_t lens[] = {c.len, c.len / 2 + 3, c.len / 3 + 1, 0, c.len};
  for (int64_t i = 0; i < items; ++i) {
    item[i].shadow = i * hd * cap;
    item[i].scale = i * hd;
    item[i].off_lo = static_cast<int64_t>(rng() % 7);
    item[i].len = lens[i];
    item[i].new_pos = item[i].off_lo + lens[i] + static_cast<int64_t>(rng() % 5);
    item[i].picks = i == 4 ? 1 : i == 2 ? (c.ties ? lens[i] / 4 + 1 : lens[i]) : std::max<int64_t>(1, lens[i] / 9);
  }
  std::vector<int8_t> shadow(static_cast<size_t>(items * hd * cap));
  for (auto& x : shadow) x = static_cast<int8_t>(c.ties ? static_cast<int>(rng() % 5) - 2 : static_cast<int>(rng() % 255) - 127);
  std::vector<float> scale(static_cast<size_t>(items * hd));
  for (auto& x : scale) x = 0.25f + std::fabs(nd(rng));
  const size_t act = DTypeSize(c.act);
  std::vector<char> q(static_cast<size_t>(items * group * hd) * act), k(static_cast<size_t>(items * hd) * act);
  for (int64_t i = 0; i < items * group * hd; ++i) cpu::StoreFromF32(q.data(), c.act, i, nd(rng));
  for (int64_t i = 0; i < items * hd; ++i) cpu::StoreFromF32(k.data(), c.act, i, 3.0f * nd(rng));
  const int64_t max_len = *std::max_element(lens, lens + items);
  // Room for every key; with ties, for an eighth of them (lists of a crowded threshold bin may
  // overflow: count -1).
  const int64_t max_picks = c.ties ? 1 + max_len / 8 : 1 + max_len;

  ShadowScanArgs a;
  a.items = items;
  a.group = group;
  a.head_dim = hd;
  a.channels = c.channels;
  a.cap = cap;
  a.q_dtype = c.act;
  a.k_dtype = c.act;
  a.kv_dtype = c.kv;
  a.max_len = max_len;
  a.max_picks = max_picks;
  // The reference on host copies.
  std::vector<int8_t> want_shadow = shadow;
  std::vector<uint32_t> keys(static_cast<size_t>(items * max_len));
  std::vector<int32_t> ints(static_cast<size_t>(ShadowScanInts(items, group, c.channels)));
  std::vector<uint64_t> want(static_cast<size_t>(items * max_picks), ~0ull);
  std::vector<int32_t> want_counts(static_cast<size_t>(items), -7);
  std::vector<uint32_t> hist(static_cast<size_t>(ShadowScanHistWords(items)), 0u);
  const int64_t blocks = (max_len + kShadowScanBlockKeys - 1) / kShadowScanBlockKeys;
  std::vector<int32_t> block_counts(static_cast<size_t>(items * (blocks + 1)), 0);
  ShadowScanArgs h = a;
  h.item = item.data();
  h.shadow = want_shadow.data();
  h.scale = scale.data();
  h.q = q.data();
  h.k = k.data();
  h.keys = keys.data();
  h.ints = ints.data();
  h.out = want.data();
  h.counts = want_counts.data();
  cpu::ShadowScanRef(h);
  // The device, twice: the table, the list and its counts in device memory; then the table read
  // from and the ranking written straight into mapped host memory (the runtime's way on CUDA).
  for (const bool mapped : {false, true}) {
    SCOPED_TRACE(mapped ? "mapped host memory" : "device memory");
    ShadowScanArgs g = a;
    std::vector<ShadowScanItem> junk(item.size());
    for (auto& j : junk) j.len = j.picks = 12345;  // the first pass must overwrite it
    g.item = DeviceCopy(mapped ? junk : item);
    g.shadow = DeviceCopy(shadow);
    g.scale = DeviceCopy(scale);
    g.q = DeviceCopy(q);
    g.k = DeviceCopy(k);
    g.keys = DeviceCopy(keys);
    g.ints = DeviceCopy(ints);
    g.hist = DeviceCopy(hist);
    g.block_counts = DeviceCopy(block_counts);
    std::vector<uint64_t> got(want.size(), ~0ull);
    std::vector<int32_t> got_counts(static_cast<size_t>(items), -7);
    ShadowScanItem* item_host = nullptr;
    if (mapped) {
      void* p = nullptr;
      ASSERT_EQ(cudaHostAlloc(&p, item.size() * sizeof(ShadowScanItem), cudaHostAllocMapped), cudaSuccess);
      item_host = static_cast<ShadowScanItem*>(p);
      std::copy(item.begin(), item.end(), item_host);
      g.item_host = item_host;
      ASSERT_EQ(cudaHostAlloc(&p, got.size() * 8, cudaHostAllocMapped), cudaSuccess);
      g.out = static_cast<uint64_t*>(p);
      std::fill_n(g.out, got.size(), ~0ull);
      ASSERT_EQ(cudaHostAlloc(&p, got_counts.size() * 4, cudaHostAllocMapped), cudaSuccess);
      g.counts = static_cast<int32_t*>(p);
      std::fill_n(g.counts, got_counts.size(), -7);
    } else {
      g.out = DeviceCopy(got);
      g.counts = DeviceCopy(got_counts);
    }
    const Status st = cuda::LaunchShadowScan(g, nullptr);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int8_t> got_shadow(shadow.size());
    ASSERT_EQ(cudaMemcpy(got_shadow.data(), g.shadow, shadow.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), g.out, got.size() * 8, cudaMemcpyDefault), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_counts.data(), g.counts, items * 4, cudaMemcpyDefault), cudaSuccess);
    std::vector<uint32_t> hist_after(hist.size(), 1u);
    ASSERT_EQ(cudaMemcpy(hist_after.data(), g.hist, hist.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<ShadowScanItem> item_after(item.size());
    ASSERT_EQ(cudaMemcpy(item_after.data(), g.item, item.size() * sizeof(ShadowScanItem),
                         cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(item_after.data(), item.data(), item.size() * sizeof(ShadowScanItem)), 0)
        << "the device table is not the host's";
    EXPECT_EQ(hist_after, hist) << "the histograms are not left at zero";
    EXPECT_EQ(got_shadow, want_shadow) << "the new rows differ";
    EXPECT_EQ(got_counts, want_counts);
    int overflow = 0, listed = 0;
    for (int64_t i = 0; i < items; ++i) {
      overflow += want_counts[i] == -1;
      listed += want_counts[i] > 0;
      for (int64_t p = 0; p < std::max(want_counts[i], 0); ++p) {
        ASSERT_EQ(got[i * max_picks + p], want[i * max_picks + p])
            << "item " << i << " pick " << p << " of " << item[i].picks << " (len " << item[i].len
            << "): position " << (got[i * max_picks + p] & 0xffffffffu) << " vs "
            << (want[i * max_picks + p] & 0xffffffffu);
      }
    }
    EXPECT_GT(listed, 0);
    std::printf("[          ] %s: %d items listed, %d overflowed\n", mapped ? "mapped" : "device",
                listed, overflow);
    for (void* p : {static_cast<void*>(g.item), static_cast<void*>(g.shadow),
                    static_cast<void*>(const_cast<float*>(g.scale)), const_cast<void*>(g.q),
                    const_cast<void*>(g.k), static_cast<void*>(g.keys), static_cast<void*>(g.ints),
                    static_cast<void*>(g.hist), static_cast<void*>(g.block_counts)}) {
      cudaFree(p);
    }
    if (mapped) {
      cudaFreeHost(item_host);
      cudaFreeHost(g.out);
      cudaFreeHost(g.counts);
    } else {
      cudaFree(g.out);
      cudaFree(g.counts);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuShadowScanTest,
    ::testing::Values(ScanCase{4, 128, 16, DType::kBF16, DType::kBF16, 40000, false},
                      ScanCase{4, 128, 16, DType::kF32, DType::kBF16, 5000, true},
                      ScanCase{3, 64, 16, DType::kF16, DType::kF16, 4099, false},
                      ScanCase{1, 64, 1, DType::kF32, DType::kF32, 3000, true},
                      ScanCase{8, 128, 128, DType::kBF16, DType::kBF16, 9000, false},
                      ScanCase{5, 128, 8, DType::kF32, DType::kF16, 777, true},
                      ScanCase{2, 64, 64, DType::kBF16, DType::kBF16, 1, false}));

}  // namespace
}  // namespace kvferry
