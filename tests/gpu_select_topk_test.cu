// Copyright kvferry authors. Apache-2.0.
// The ranking stage of the device selection (cuda::LaunchSelectTopK) on both top-k paths, the
// one-CTA kernels and the multi-CTA radix select, and the automatic choice between them, against
// the host reference of each scoring: the oracle's and SparCas's group-summed softmax top k
// (cpu::TopKRef: weight descending, lower position first), Quest's page walk (as
// cpu::DecodeStep's QuestSelect). Large n (70,000 and 131,072 scores), batch 1-4, GQA 1/3/4/8,
// k from 1 to n, odd small n for the chunk edges. Lists must be identical, position for position.
//
// The logits are levels (quantised) so that the reference is exact: an item's logit of query
// head g at position j is c_g * level_j + d_g (c_g > 0), which makes every weight a strictly
// increasing function of level_j whatever the rounding of the softmax sums. Equal levels give
// bit-equal weights on both sides (heavy ties when the levels are coarse); adjacent levels differ
// by far more than fp32 rounding. Skips without a GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "base/attn_types.h"
#include "cpu/reference.h"
#include "gpu/cuda_kernels.h"
#include "kvferry/runtime.h"

namespace kvferry {
namespace {

struct TopKCase {
  SelectRanks ranks;
  int batch;
  int group;
  int64_t n;       // tokens of batch element 0; element b has n - 1013 b (at least 1)
  int64_t picks;   // offloaded positions (pages: positions too) the budget leaves to rank
  int sink;
  int window;
  int levels;      // distinct logit levels (few: many ties)
};

std::string CaseName(const TopKCase& c) {
  const char* s = c.ranks == SelectRanks::kPositions ? "oracle"
                  : c.ranks == SelectRanks::kOffloaded  ? "sparcas"
                                                          : "quest";
  return std::string(s) + "_b" + std::to_string(c.batch) + "_g" + std::to_string(c.group) + "_n" +
         std::to_string(c.n) + "_k" + std::to_string(c.picks) + "_lv" + std::to_string(c.levels);
}

void PrintTo(const TopKCase& c, std::ostream* os) { *os << CaseName(c); }

constexpr int kHeads = 2;   // KV heads per sequence
constexpr int kPage = 16;   // Quest tokens per page

struct Split {  // as policies/select_util's SplitPositions
  int64_t sinks, off_lo, off_hi, k_off;
  bool all;
};

Split SplitOf(int64_t n, int sink, int window, int64_t budget) {
  Split s;
  s.sinks = std::clamp<int64_t>(sink, 0, n);
  s.off_lo = s.sinks;
  s.off_hi = std::max(s.sinks, n - std::max(window, 0));
  s.k_off = budget - (s.sinks + (n - s.off_hi));
  s.all = s.k_off >= s.off_hi - s.off_lo;
  return s;
}

// The host reference list of one item whose rows of scores are l[g * ld + j].
std::vector<int32_t> ReferenceList(const TopKCase& c, const std::vector<float>& l, int64_t ld,
                                   int64_t n, int64_t budget) {
  std::vector<int32_t> out;
  const int group = c.group;
  if (c.ranks == SelectRanks::kPositions) {
    const int64_t k = std::min(budget, n);
    // Group-summed softmax in the log2 domain, in double; rounded to fp32 it keeps every tie and
    // every order (the levels are far apart).
    std::vector<double> w(static_cast<size_t>(n), 0.0);
    for (int g = 0; g < group; ++g) {
      const float* lg = l.data() + g * ld;
      const double m = *std::max_element(lg, lg + n);
      double s = 0;
      for (int64_t j = 0; j < n; ++j) s += std::exp2(lg[j] - m);
      for (int64_t j = 0; j < n; ++j) w[j] += std::exp2(lg[j] - m) / s;
    }
    std::vector<float> wf(w.begin(), w.end());
    out.resize(static_cast<size_t>(k));
    cpu::TopKRef(wf.data(), n, k, out.data());
    std::sort(out.begin(), out.end());
    return out;
  }
  const Split s = SplitOf(n, c.sink, c.window, budget);
  if (s.all) {
    for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(i));
    return out;
  }
  for (int64_t i = 0; i < s.sinks; ++i) out.push_back(static_cast<int32_t>(i));
  if (s.k_off > 0 && c.ranks == SelectRanks::kOffloaded) {
    std::vector<double> w(static_cast<size_t>(n), 0.0);
    for (int g = 0; g < group; ++g) {
      const float* lg = l.data() + g * ld;
      const double m = *std::max_element(lg, lg + n);
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += std::exp2(lg[j] - m);
      for (int64_t j = 0; j < n; ++j) w[j] += std::exp2(lg[j] - m) / sum;
    }
    std::vector<float> wf(w.begin() + s.off_lo, w.begin() + s.off_hi);
    std::vector<int32_t> chosen(static_cast<size_t>(s.k_off));
    cpu::TopKRef(wf.data(), s.off_hi - s.off_lo, s.k_off, chosen.data());
    std::sort(chosen.begin(), chosen.end());
    for (int32_t x : chosen) out.push_back(static_cast<int32_t>(s.off_lo + x));
  } else if (s.k_off > 0) {  // Quest: page scores in fp32 exactly as the kernels form them
    const int64_t p_lo = s.off_lo / kPage, np = (s.off_hi - 1) / kPage + 1 - p_lo;
    std::vector<float> score(static_cast<size_t>(np), -INFINITY);
    for (int g = 0; g < group; ++g) {
      const float* u = l.data() + g * ld;
      const float mx = *std::max_element(u, u + np);
      for (int64_t i = 0; i < np; ++i) score[i] = std::max(score[i], u[i] - mx);
    }
    const int64_t want = std::min<int64_t>(np, s.k_off / kPage + 3);
    std::vector<int32_t> best(static_cast<size_t>(want));
    cpu::TopKRef(score.data(), np, want, best.data());
    std::vector<std::pair<int64_t, int64_t>> takes;
    int64_t left = s.k_off;
    for (int64_t i = 0; i < want && left > 0; ++i) {
      const int64_t pg = p_lo + best[i];
      const int64_t take =
          std::min(std::min((pg + 1) * kPage, s.off_hi) - std::max(pg * kPage, s.off_lo), left);
      takes.emplace_back(pg, take);
      left -= take;
    }
    std::sort(takes.begin(), takes.end());
    for (const auto& [pg, take] : takes) {
      const int64_t a = std::max(pg * kPage, s.off_lo);
      for (int64_t pos = a; pos < a + take; ++pos) out.push_back(static_cast<int32_t>(pos));
    }
  }
  for (int64_t i = s.off_hi; i < n; ++i) out.push_back(static_cast<int32_t>(i));
  return out;
}

class GpuSelectTopKTest : public ::testing::TestWithParam<TopKCase> {};

TEST_P(GpuSelectTopKTest, BothPathsEqualTheHostReference) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  const TopKCase c = GetParam();
  const int64_t items = int64_t{c.batch} * kHeads;
  // select_ld, the capacity: past every n, and at least 16K so that a short item's CTAs (sized by
  // the capacity) include empty chunks.
  const int64_t ld = std::max<int64_t>(c.n + 5, 16384);
  std::vector<int64_t> ns(static_cast<size_t>(c.batch));
  for (int b = 0; b < c.batch; ++b) ns[b] = std::max<int64_t>(1, c.n - 1013 * b);
  // The budget in tokens: the picks plus what the sinks and the window take of the longest item.
  const int64_t budget =
      c.ranks == SelectRanks::kPositions ? c.picks : c.picks + c.sink + c.window;

  // Scores: item i, head g, position (Quest: page) j = c_g * level + d_g.
  std::mt19937 rng(static_cast<uint32_t>(c.n * 7 + c.picks * 3 + c.group * 11 + c.batch));
  std::uniform_int_distribution<int> lv(0, c.levels - 1);
  std::uniform_real_distribution<float> cg(0.5f, 1.5f), dg(-3.f, 3.f);
  std::vector<float> scores(static_cast<size_t>(items * c.group * ld), 0.0f);
  for (int64_t i = 0; i < items; ++i) {
    std::vector<float> cs(c.group), ds(c.group);
    for (int g = 0; g < c.group; ++g) {
      cs[g] = cg(rng);
      ds[g] = dg(rng);
    }
    for (int64_t j = 0; j < ld; ++j) {
      // Levels over [-8, 8) in the log2 domain (positions of weight up to 2^16 apart).
      const float level = -8.0f + 16.0f * static_cast<float>(lv(rng)) / static_cast<float>(c.levels);
      for (int g = 0; g < c.group; ++g) {
        scores[(i * c.group + g) * ld + j] = cs[g] * level + ds[g];
      }
    }
  }

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  cuda::LaunchInfo info;
  info.num_sms = sms;

  std::vector<int64_t> positions(static_cast<size_t>(c.batch));
  for (int b = 0; b < c.batch; ++b) positions[b] = ns[b] - 1;  // one layer
  std::vector<int32_t> slots(static_cast<size_t>(c.batch));
  for (int b = 0; b < c.batch; ++b) slots[b] = b;
  const int64_t list_cap = std::max<int64_t>(budget, 1) + 8;
  int64_t sort_cap = 1;
  while (sort_cap < budget) sort_cap <<= 1;

  float* d_ws = nullptr;
  int64_t* d_pos = nullptr;
  int32_t *d_slots = nullptr, *d_list = nullptr, *d_count = nullptr;
  unsigned long long* d_topk = nullptr;
  uint32_t* d_mcta = nullptr;
  const size_t mcta_bytes = static_cast<size_t>(items * SelectMctaItemWords(c.group)) * 4;
  ASSERT_EQ(cudaMalloc(&d_ws, scores.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_pos, positions.size() * 8), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_slots, slots.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_list, static_cast<size_t>(items * list_cap) * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_count, static_cast<size_t>(items) * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_topk, static_cast<size_t>(items * sort_cap) * 8), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_mcta, mcta_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_pos, positions.data(), positions.size() * 8, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);

  DecodeStepArgs a;
  a.params = AttnParams{c.group, 128, DType::kBF16, 1.0f};
  a.batch = c.batch;
  a.num_kv_heads = kHeads;
  a.num_layers = 1;
  a.layer = 0;
  a.sink = c.sink;
  a.window = c.window;
  a.mode = StepRowMode::kList;
  a.budget_tokens = budget;
  a.budget_cap = budget;
  a.slots = d_slots;
  a.positions = d_pos;
  a.ranks = c.ranks;
  a.list = d_list;
  a.list_count = d_count;
  a.list_cap = list_cap;
  a.select_ws = d_ws;
  a.select_ld = ld;
  a.topk_ws = d_topk;
  a.select_mcta_ws = d_mcta;
  a.meta_page = kPage;

  // The reference lists (Quest ranks the pages of the offloaded range: row j = page p_lo + j).
  std::vector<std::vector<int32_t>> want(static_cast<size_t>(items));
  for (int64_t i = 0; i < items; ++i) {
    const int64_t n = ns[i / kHeads];
    std::vector<float> rows(scores.begin() + i * c.group * ld,
                            scores.begin() + (i + 1) * c.group * ld);
    want[i] = ReferenceList(c, rows, ld, n, StepBudget(budget, 0.0, budget, n));
  }
  // Paths 0-2 as named; 3: kAuto with a length hint below the threshold (too low for the long
  // items: every item then takes the one-CTA kernel, whatever its true length); 4: the multi-CTA
  // top-k a launch a pass (1 and 2 take the fused kernel wherever its grid fits).
  for (int variant = 0; variant < 5; ++variant) {
    const cuda::SelectTopKPath path = variant == 0   ? cuda::SelectTopKPath::kOneCta
                                      : variant == 1 ? cuda::SelectTopKPath::kMultiCta
                                      : variant == 4 ? cuda::SelectTopKPath::kMultiCtaPerPass
                                                     : cuda::SelectTopKPath::kAuto;
    a.max_len_hint = variant == 3 ? 100 : 0;
    ASSERT_EQ(cudaMemcpy(d_ws, scores.data(), scores.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_list, 0x7f, static_cast<size_t>(items * list_cap) * 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_count, 0xff, static_cast<size_t>(items) * 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_mcta, 0x5a, mcta_bytes), cudaSuccess);  // stale scratch
    const Status st = cuda::LaunchSelectTopK(a, info, path, stream);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<int32_t> list(static_cast<size_t>(items * list_cap)), count(static_cast<size_t>(items));
    ASSERT_EQ(cudaMemcpy(list.data(), d_list, list.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(count.data(), d_count, count.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int64_t i = 0; i < items; ++i) {
      ASSERT_EQ(count[i], static_cast<int32_t>(want[i].size()))
          << "path " << variant << " item " << i;
      ASSERT_GT(count[i], 0);
      int bad = 0;
      for (size_t j = 0; j < want[i].size(); ++j) {
        const int32_t got = list[i * list_cap + static_cast<int64_t>(j)];
        if (got != want[i][j] && bad++ < 5) {
          ADD_FAILURE() << "path " << variant << " item " << i << " index " << j
                        << ": got " << got << " want " << want[i][j];
        }
      }
      EXPECT_EQ(bad, 0) << "path " << variant << " item " << i;
    }
  }
  cudaFree(d_ws);
  cudaFree(d_pos);
  cudaFree(d_slots);
  cudaFree(d_list);
  cudaFree(d_count);
  cudaFree(d_topk);
  cudaFree(d_mcta);
  cudaStreamDestroy(stream);
}

constexpr auto kOracle = SelectRanks::kPositions;
constexpr auto kSparcas = SelectRanks::kOffloaded;
constexpr auto kPaged = SelectRanks::kPages;

INSTANTIATE_TEST_SUITE_P(
    Gpu, GpuSelectTopKTest,
    ::testing::Values(
        // Large n, the 2% budget, GQA 1/3/4/8, batch 1-4; coarse levels (ties) and fine ones.
        TopKCase{kOracle, 1, 4, 131072, 2622, 0, 0, 64},
        TopKCase{kOracle, 2, 8, 131072, 2622, 0, 0, 16384},
        TopKCase{kOracle, 4, 1, 70000, 1400, 0, 0, 64},
        TopKCase{kOracle, 3, 3, 70000, 1400, 0, 0, 16384},
        // The fused kernel's two finishes: the k-th key's 12-bit bucket listed (up to 2048 keys:
        // fine levels, or 256 levels with ties at the threshold) or crowded (32 levels: 4096 keys
        // a level; one level: every key ties).
        TopKCase{kOracle, 2, 4, 131072, 2622, 0, 0, 256},
        TopKCase{kOracle, 1, 4, 131072, 2622, 0, 0, 32},
        TopKCase{kOracle, 1, 3, 131072, 2622, 0, 0, 1},
        // k near 1 and near n (k > 4096: the one-CTA path's workspace sort).
        TopKCase{kOracle, 2, 4, 131072, 1, 0, 0, 64},
        TopKCase{kOracle, 2, 4, 131072, 2, 0, 0, 16384},
        TopKCase{kOracle, 2, 4, 70000, 69990, 0, 0, 64},
        TopKCase{kOracle, 1, 1, 131072, 131072, 0, 0, 16384},
        // Small and odd n: CTAs with empty chunks, a chunk of one tile.
        TopKCase{kOracle, 2, 4, 1, 1, 0, 0, 64},
        TopKCase{kOracle, 2, 4, 17, 5, 0, 0, 4},
        TopKCase{kOracle, 2, 3, 4099, 97, 0, 0, 64},
        TopKCase{kOracle, 2, 8, 9000, 4000, 0, 0, 16384},
        // SparCas: sinks and a window around the ranked range.
        TopKCase{kSparcas, 1, 4, 131072, 2558, 4, 64, 64},
        TopKCase{kSparcas, 4, 4, 131072, 2558, 4, 64, 16384},
        TopKCase{kSparcas, 2, 8, 70000, 1, 4, 64, 64},
        TopKCase{kSparcas, 2, 1, 70000, 69000, 4, 64, 16384},
        TopKCase{kSparcas, 3, 3, 9000, 170, 4, 64, 64},
        TopKCase{kSparcas, 2, 4, 300, 50, 4, 64, 16},
        TopKCase{kSparcas, 2, 4, 131072, 2558, 4, 64, 16},
        // Quest: pages of 16 (8192 pages at 128K), budgets to 4096 pages.
        TopKCase{kPaged, 1, 4, 131072, 2558, 4, 64, 64},
        TopKCase{kPaged, 4, 8, 131072, 2558, 4, 64, 16384},
        TopKCase{kPaged, 2, 1, 131072, 1, 4, 64, 64},
        TopKCase{kPaged, 2, 4, 131072, 60000, 4, 64, 16384},
        TopKCase{kPaged, 3, 3, 70000, 1400, 4, 64, 64},
        TopKCase{kPaged, 2, 4, 4099, 100, 4, 64, 16},
        TopKCase{kPaged, 1, 4, 131072, 2558, 4, 64, 1}),
    [](const auto& info) { return CaseName(info.param); });

// Bad arguments are errors, not launches.
TEST(GpuSelectTopK, MultiCtaWithoutScratchIsAnError) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  DecodeStepArgs a;
  a.params = AttnParams{4, 128, DType::kBF16, 1.0f};
  a.batch = 1;
  a.num_kv_heads = 1;
  a.num_layers = 1;
  a.ranks = SelectRanks::kPositions;
  a.budget_tokens = 16;
  a.budget_cap = 16;
  a.list_cap = 16;
  int32_t dummy[4];
  int64_t pos = 0;
  float ws = 0;
  a.list = dummy;
  a.list_count = dummy;
  a.slots = dummy;
  a.positions = &pos;
  a.select_ws = &ws;
  a.select_ld = 1;
  const Status st = cuda::LaunchSelectTopK(a, cuda::LaunchInfo{}, cuda::SelectTopKPath::kMultiCta,
                                           nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("scratch"), std::string::npos) << st.ToString();
  a.params.group = 65;
  const Status st2 = cuda::LaunchSelectTopK(a, cuda::LaunchInfo{}, cuda::SelectTopKPath::kOneCta,
                                            nullptr);
  EXPECT_FALSE(st2.ok());
}

}  // namespace
}  // namespace kvferry
