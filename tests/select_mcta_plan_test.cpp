// Copyright kvferry authors. Apache-2.0.
// Host-side planning of the multi-CTA selection top-k (base/attn_types.h): the scratch size the
// Runtime allocates at set-up and the CTAs per item the launcher picks. Runs without a GPU.

#include <gtest/gtest.h>

#include <cstdint>

#include "base/attn_types.h"

namespace kvferry {
namespace {

TEST(SelectMctaPlan, ScratchOnlyWhenAnItemCanReachTheThreshold) {
  EXPECT_EQ(SelectMctaWorkspaceBytes(8, 4, kSelectMctaMinKeys - 1), 0u);
  EXPECT_EQ(SelectMctaWorkspaceBytes(0, 4, 1 << 17), 0u);
  // Quest ranks pages against its own threshold.
  EXPECT_EQ(SelectMctaWorkspaceBytes(8, 4, kSelectMctaMinPages - 1, kSelectMctaMinPages), 0u);
  EXPECT_GT(SelectMctaWorkspaceBytes(8, 4, kSelectMctaMinPages, kSelectMctaMinPages), 0u);
  EXPECT_EQ(SelectMctaWorkspaceBytes(8, 0, 1 << 17), 0u);
  const size_t one = SelectMctaWorkspaceBytes(1, 4, kSelectMctaMinKeys);
  // Histograms, per-CTA counts, per-head per-CTA (max, sum) pairs, Quest's picks, the 12-bit
  // histogram, the candidate count and list, and the fused kernel's barrier counter, the count and
  // the counter each with a word of padding.
  EXPECT_EQ(one, static_cast<size_t>(4 * 256 + 2 * kSelectMctaMaxCtas + 2 * 4 * kSelectMctaStatsSlots +
                                     kSelectMctaMaxPicks + 4096 + 2 + 2 * kSelectMctaCandCap + 2) * 4);
  EXPECT_EQ((one / 4 - 2 - 2 * kSelectMctaCandCap) % 2, 0u);  // the candidates (uint2) 8-byte aligned
  EXPECT_EQ(one % 8, 0u);  // every item's (max, sum) pairs stay 8-byte aligned
  EXPECT_EQ(SelectMctaWorkspaceBytes(32, 4, 1 << 20), 32 * one);  // independent of the length
  EXPECT_GT(SelectMctaWorkspaceBytes(1, 8, 1 << 17), one);        // grows with the group
  // The Quest picks hold every page a one-CTA Quest top-k could sort.
  EXPECT_GE(kSelectMctaMaxPicks, 4096);
}

TEST(SelectMctaPlan, CtasFillTheGpuWithinBounds) {
  // Batch 1 of the Llama-3.1-8B shape at 128K on an H100: 8 items, about 2 CTAs per SM in all.
  EXPECT_EQ(SelectMctaCtas(8, 131072, 132), 33);
  EXPECT_EQ(SelectMctaCtas(8, 131072, 132, 4), 64);  // 4 per SM: 66, at most kSelectMctaMaxCtas
  // Batch 4: 32 items share the SMs (rounded down: one wave of 256 CTAs).
  EXPECT_EQ(SelectMctaCtas(32, 131072, 132), 8);
  // Short capacities: at least kSelectMctaMinChunk scores a CTA.
  EXPECT_EQ(SelectMctaCtas(8, 4096, 132), 2);
  EXPECT_EQ(SelectMctaCtas(8, 4097, 132), 3);
  EXPECT_EQ(SelectMctaCtas(1, 1, 132), 1);
  // Degenerate inputs still give a launchable grid.
  EXPECT_EQ(SelectMctaCtas(0, 131072, 132), 1);
  EXPECT_EQ(SelectMctaCtas(8, 131072, 0), 1);
  for (int64_t items : {1, 3, 8, 24, 64, 1000}) {
    for (int64_t ld : {1, 2048, 8191, 65536, 1 << 20}) {
      const int32_t c = SelectMctaCtas(items, ld, 132);
      EXPECT_GE(c, 1);
      EXPECT_LE(c, kSelectMctaMaxCtas);
      EXPECT_LE((c - 1) * kSelectMctaMinChunk, ld) << items << " items, ld " << ld;
    }
  }
}

}  // namespace
}  // namespace kvferry
