// Copyright kvferry authors. Apache-2.0.
// Addresses past 2^31 and 2^32 bytes: every place a K/V row address is formed must compute its
// offset in 64 bits. The tests reach those offsets on the CI machine (no GPU, 24 GB) with memory
// that is reserved but never touched: the host device's allocations are plain (lazily committed)
// mappings, and only the rows a test writes or reads become resident.
//   - HostStore: a head of 2^24 + 300 positions (bf16, head_dim 128: 256-byte rows, so the head's
//     rows span more than 2^32 bytes); rows at the far end are written, found where the page table
//     says, and attended by the CPU kernels.
//   - Runtime: a resident tier of 8 GiB (4 sequences x 2 layers x 8 KV heads x 2^18 rows of K and
//     of V), so the last two sequences' rows lie past 2^32 bytes into it, where a 32-bit offset
//     would land exactly on the first two's; prefill and batched decode of all four, through the
//     planned step (cpu/decode_step.cpp) and the runtime's own row addressing (CPU route), equal
//     attention computed here.
//   - Tiers whose row counts do not fit the position range are refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/kernels.h"
#include "gpu/device.h"
#include "kvferry/kvferry.h"
#include "offload/host_store.h"

namespace kvferry {
namespace {

constexpr int64_t kTwo31 = int64_t{1} << 31;
constexpr int64_t kTwo32 = int64_t{1} << 32;

float RoundBf16(float x) { return cpu::Bf16ToF32(cpu::F32ToBf16(x)); }

// Attention of one query head over explicit rows, in double.
std::vector<double> RefAttend(const float* q, const std::vector<std::vector<float>>& k,
                              const std::vector<std::vector<float>>& v, double scale) {
  const size_t d = v.empty() ? 0 : v[0].size();
  std::vector<double> logits(k.size());
  double m = -INFINITY;
  for (size_t j = 0; j < k.size(); ++j) {
    double dot = 0;
    for (size_t e = 0; e < d; ++e) dot += static_cast<double>(q[e]) * k[j][e];
    logits[j] = dot * scale;
    m = std::max(m, logits[j]);
  }
  std::vector<double> o(d, 0.0);
  double sum = 0;
  for (size_t j = 0; j < k.size(); ++j) {
    const double w = std::exp(logits[j] - m);
    sum += w;
    for (size_t e = 0; e < d; ++e) o[e] += w * v[j][e];
  }
  for (double& x : o) x /= sum;
  return o;
}

double RelErr(const float* got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    num += (got[e] - want[e]) * (got[e] - want[e]);
    den += want[e] * want[e];
  }
  EXPECT_GT(den, 0.0) << "reference output is all zero";
  return std::sqrt(num / den);
}

// ---- host store: one head longer than 2^32 bytes -------------------------------------------------

TEST(Scale, HostStoreRowsPast4GiBOfOneHeadAreAddressedAndAttended) {
  constexpr int kHd = 128;
  constexpr int kPage = 256;
  constexpr int64_t kLen = (int64_t{1} << 24) + 300;  // rows of 256 bytes: 4 GiB + 75 KiB
  std::unique_ptr<Device> device = MakeHostDevice();
  HostStoreShape shape;
  shape.max_slots = 2;
  shape.num_layers = 2;
  shape.num_kv_heads = 1;
  shape.head_dim = kHd;
  shape.kv_dtype = DType::kBF16;
  shape.page_tokens = kPage;
  shape.max_tokens = kLen;
  HostStore store(device.get(), shape);
  ASSERT_TRUE(store.Init().ok());
  // The last (slot, layer): 65,538 pages of 128 KiB, reserved, untouched.
  ASSERT_TRUE(store.Reserve(1, 1, kLen).ok());
  const size_t row_bytes = kHd * sizeof(uint16_t);
  ASSERT_GE(kLen * static_cast<int64_t>(row_bytes), kTwo32);

  // Positions whose byte offset within the head (pos * row_bytes) crosses 2^31 and 2^32, and the
  // first and last rows of pages around them.
  const std::vector<int32_t> positions = {0,
                                          1,
                                          kPage - 1,
                                          kPage,
                                          static_cast<int32_t>(kTwo31 / row_bytes) - 1,
                                          static_cast<int32_t>(kTwo31 / row_bytes),
                                          static_cast<int32_t>(kTwo31 / row_bytes) + 1,
                                          static_cast<int32_t>(kTwo32 / row_bytes) - 1,
                                          static_cast<int32_t>(kTwo32 / row_bytes),
                                          static_cast<int32_t>(kTwo32 / row_bytes) + 257,
                                          static_cast<int32_t>(kLen - 1)};
  std::mt19937 rng(24);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> k_ref, v_ref;
  const KvPages kv = store.pages(1, 1, 0);
  for (int32_t pos : positions) {
    // The address is the page's plus the row's offset inside it, K rows then V rows.
    const char* page = static_cast<const char*>(kv.pages[pos / kPage]);
    ASSERT_NE(page, nullptr) << "pos " << pos;
    EXPECT_EQ(store.k_row(1, 1, 0, pos), page + static_cast<size_t>(pos % kPage) * row_bytes);
    EXPECT_EQ(store.v_row(1, 1, 0, pos),
              page + static_cast<size_t>(kPage + pos % kPage) * row_bytes);
    std::vector<float> k(kHd), v(kHd);
    for (float& x : k) x = RoundBf16(normal(rng));
    for (float& x : v) x = RoundBf16(normal(rng));
    cpu::ConvertSpan(store.k_row(1, 1, 0, pos), DType::kBF16, k.data(), DType::kF32, kHd);
    cpu::ConvertSpan(store.v_row(1, 1, 0, pos), DType::kBF16, v.data(), DType::kF32, kHd);
    k_ref.push_back(k);
    v_ref.push_back(v);
  }
  // Every row reads back as written (no two positions share a row).
  for (size_t j = 0; j < positions.size(); ++j) {
    std::vector<float> k(kHd), v(kHd);
    cpu::ConvertSpan(k.data(), DType::kF32, store.k_row(1, 1, 0, positions[j]), DType::kBF16, kHd);
    cpu::ConvertSpan(v.data(), DType::kF32, store.v_row(1, 1, 0, positions[j]), DType::kBF16, kHd);
    EXPECT_EQ(k, k_ref[j]) << "pos " << positions[j];
    EXPECT_EQ(v, v_ref[j]) << "pos " << positions[j];
  }

  // The CPU kernels (fast path and scalar reference) attend those rows through the page table.
  constexpr int kGroup = 4;
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  std::vector<float> q(kGroup * kHd);
  for (float& x : q) x = normal(rng);
  // Every ISA this CPU has (and the scalar reference): attention over the list, and ScoreRange
  // over the two rows either side of byte 2^32 (positions[7] and [8]), one contiguous run.
  const int64_t begin = kTwo32 / static_cast<int64_t>(row_bytes) - 1;
  ASSERT_EQ(positions[7], begin);
  ASSERT_EQ(positions[8], begin + 1);
  int isas = 0;
  for (cpu::CpuIsa isa : {cpu::CpuIsa::kScalar, cpu::CpuIsa::kAvx2, cpu::CpuIsa::kAvx512F,
                          cpu::CpuIsa::kAvx512Bf16}) {
    const cpu::CpuKernels* kernels = cpu::GetCpuKernels(isa);
    if (kernels == nullptr) continue;  // not on this CPU
    ++isas;
    std::vector<float> o(kGroup * kHd, NAN), lse(kGroup, NAN);
    cpu::PositionAttnItem item;
    item.q = q.data();
    item.o = o.data();
    item.lse = lse.data();
    item.kv = kv;
    item.positions = positions.data();
    item.count = static_cast<int32_t>(positions.size());
    kernels->attend_positions(p, item);
    for (int g = 0; g < kGroup; ++g) {
      const std::vector<double> want = RefAttend(&q[g * kHd], k_ref, v_ref, p.scale);
      EXPECT_LT(RelErr(&o[g * kHd], want), 1e-5) << kernels->name << " head " << g;
    }
    std::vector<float> logits(kGroup * 2, NAN);
    kernels->score_range(p, q.data(), kv, begin, begin + 2, logits.data(), 2);
    for (int g = 0; g < kGroup; ++g) {
      for (int j = 0; j < 2; ++j) {
        double dot = 0;
        for (int e = 0; e < kHd; ++e) dot += static_cast<double>(q[g * kHd + e]) * k_ref[7 + j][e];
        EXPECT_NEAR(logits[g * 2 + j], dot * p.scale, 1e-4)
            << kernels->name << " head " << g << " pos " << begin + j;
      }
    }
  }
  EXPECT_GE(isas, 1);
}

// ---- runtime: a resident tier larger than 2^32 bytes ---------------------------------------------

class ResidentTierPast4GiB : public ::testing::TestWithParam<Route> {};

// Every item of the tier is 2^18 rows of K then 2^18 of V, 2^27 bytes, so an offset taken modulo
// 2^32 (or wrapped through a negative int) would put the items of sequences 3 and 4 (6.4 and
// 7.5 GB in) onto those of sequences 1 and 2, row for row: their outputs would be wrong.
TEST_P(ResidentTierPast4GiB, EverySequenceDecodesExactly) {
  RuntimeConfig c;
  c.model.num_layers = 2;
  c.model.num_kv_heads = 8;
  c.model.num_q_heads = 16;
  c.model.head_dim = 128;
  c.model.kv_dtype = DType::kBF16;
  c.capacity.max_sequences = 4;
  c.capacity.max_batch = 4;
  c.capacity.max_tokens_per_sequence = 1024;
  c.capacity.max_prefill_chunk = 64;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = (1 << 18) - 4;  // every position resident; 2^18 rows per item
  c.policy.name = "streaming";
  c.policy.budget_tokens = 1024;  // budget >= n: dense attention over the resident rows
  c.route = GetParam();
  c.backend = Backend::kHost;
  c.cpu_threads = 2;
  c.probe_at_start = false;
  const int64_t item_bytes = int64_t{2} * (1 << 18) * 256;
  const int64_t items = int64_t{c.capacity.max_sequences} * c.model.num_layers * c.model.num_kv_heads;
  ASSERT_EQ(items * item_bytes, 2 * kTwo32);  // 8 GiB of tier, reserved and never touched but
                                              // for the rows below
  auto rt_or = Runtime::Create(c);
  ASSERT_TRUE(rt_or.ok()) << rt_or.status().ToString();
  Runtime& rt = **rt_or;
  const std::vector<SequenceId> seqs = {1, 2, 3, 4};  // slots 0..3, in order
  for (SequenceId s : seqs) ASSERT_TRUE(rt.AddSequence(s).ok());
  const int hq = c.model.num_q_heads, hkv = c.model.num_kv_heads, d = c.model.head_dim;
  const int group = hq / hkv;
  const int64_t num_seqs = static_cast<int64_t>(seqs.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  auto random = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = normal(rng);
    return x;
  };
  auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d});
  };
  // [sequence][layer][KV head]: every stored row, rounded to bf16, row after row.
  std::vector<std::vector<std::vector<std::vector<float>>>> k_ref(
      seqs.size(), std::vector<std::vector<std::vector<float>>>(2, std::vector<std::vector<float>>(hkv)));
  auto v_ref = k_ref;
  // Rows t of k and v ([rows, hkv, d]) become the next rows of sequence i.
  auto record = [&](size_t i, int layer, const std::vector<float>& k, const std::vector<float>& v,
                    int64_t row0, int64_t rows) {
    for (int64_t t = row0; t < row0 + rows; ++t) {
      for (int h = 0; h < hkv; ++h) {
        for (int e = 0; e < d; ++e) {
          const size_t at = (static_cast<size_t>(t) * hkv + h) * d + e;
          k_ref[i][layer][h].push_back(RoundBf16(k[at]));
          v_ref[i][layer][h].push_back(RoundBf16(v[at]));
        }
      }
    }
  };
  // Output row `row` of out ([rows, hq, d]) against attention over all of sequence i's rows.
  auto check = [&](size_t i, int layer, const std::vector<float>& q, const std::vector<float>& out,
                   int64_t row, double tol, const char* what) {
    for (int qh = 0; qh < hq; ++qh) {
      const std::vector<float>& kh = k_ref[i][layer][qh / group];
      const std::vector<float>& vh = v_ref[i][layer][qh / group];
      std::vector<std::vector<float>> kr, vr;
      for (size_t j = 0; j < kh.size() / d; ++j) {
        kr.emplace_back(kh.begin() + j * d, kh.begin() + (j + 1) * d);
        vr.emplace_back(vh.begin() + j * d, vh.begin() + (j + 1) * d);
      }
      const size_t at = (static_cast<size_t>(row) * hq + qh) * d;
      EXPECT_LT(RelErr(&out[at], RefAttend(&q[at], kr, vr, scale)), tol)
          << what << " sequence " << seqs[i] << " layer " << layer << " q head " << qh << " n "
          << kr.size();
    }
  };
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t prompt = 30 + 7 * static_cast<int64_t>(i);
    for (int layer = 0; layer < 2; ++layer) {
      auto q = random(prompt * hq * d), k = random(prompt * hkv * d), v = random(prompt * hkv * d);
      std::vector<float> out(q.size(), NAN);
      const Status st = rt.Prefill(seqs[i], layer, view(q, prompt, hq), view(k, prompt, hkv),
                                   view(v, prompt, hkv), view(out, prompt, hq));
      ASSERT_TRUE(st.ok()) << st.ToString();
      record(i, layer, k, v, 0, prompt);
      check(i, layer, q, out, prompt - 1, 2e-2, "prefill");
    }
  }
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      auto q = random(num_seqs * hq * d), k = random(num_seqs * hkv * d),
           v = random(num_seqs * hkv * d);
      std::vector<float> out(q.size(), NAN);
      const Status st = rt.Decode(seqs, layer, view(q, num_seqs, hq), view(k, num_seqs, hkv),
                                  view(v, num_seqs, hkv), view(out, num_seqs, hq));
      ASSERT_TRUE(st.ok()) << st.ToString();
      for (size_t i = 0; i < seqs.size(); ++i) {
        record(i, layer, k, v, static_cast<int64_t>(i), 1);
        check(i, layer, q, out, static_cast<int64_t>(i), 1e-5, "decode");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Routes, ResidentTierPast4GiB, ::testing::Values(Route::kGpu, Route::kCpu),
                         [](const ::testing::TestParamInfo<Route>& info) {
                           return std::string(RouteName(info.param));
                         });

// ---- tiers beyond the position range ------------------------------------------------------------

// A position never reaches 2^30 (max_tokens_per_sequence), so sink and window rows past it can
// never be used; such counts used to reach the resident tier's arithmetic, where sink + window
// overflowed int.
TEST(Scale, TiersPastThePositionRangeAreRefusedByName) {
  for (auto [sink, window] : {std::pair{4, std::numeric_limits<int>::max()},
                              std::pair{std::numeric_limits<int>::max(), 16},
                              std::pair{(1 << 30) + 1, 1}, std::pair{0, (1 << 30) + 1}}) {
    RuntimeConfig c;
    c.model.num_layers = 1;
    c.model.num_kv_heads = 1;
    c.model.num_q_heads = 1;
    c.model.head_dim = 64;
    c.capacity.max_sequences = 1;
    c.capacity.max_batch = 1;
    c.capacity.max_tokens_per_sequence = 1024;
    c.tiers.sink_tokens = sink;
    c.tiers.window_tokens = window;
    c.backend = Backend::kHost;
    c.probe_at_start = false;
    auto rt = Runtime::Create(c);
    ASSERT_FALSE(rt.ok()) << "sink " << sink << " window " << window;
    EXPECT_EQ(rt.status().code(), StatusCode::kInvalidArgument) << rt.status().ToString();
    const std::string field = sink > (1 << 30) ? "sink_tokens" : "window_tokens";
    EXPECT_NE(rt.status().message().find(field), std::string::npos) << rt.status().ToString();
  }
}

}  // namespace
}  // namespace kvferry
