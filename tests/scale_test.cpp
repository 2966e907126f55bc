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
//   - Runtime: a host-store page table of 2^32 + 2^27 entries (33 GiB, zeroed at Create, so
//     resident: run only with KVFERRY_TEST_BIG=1, on a machine with the memory), on the host and
//     the CUDA backend, routes gpu and cpu; sequences whose table entries lie either side of 2^31,
//     from 2^32 and up to the table's last entry prefill and decode like attention computed here,
//     and the sequence of slot 0, whose entries those from 2^32 on would overwrite under a 32-bit
//     index, still does after them. KVFERRY_TEST_BIG_ENTRIES=2^28 runs it on a 2 GiB table.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
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

// ---- runtime: a host-store page table past 2^32 entries -----------------------------------------

// The table has an entry per (slot, layer, KV head, page): ((slot * L + layer) * Hkv + head) * P +
// page, 8 bytes each. Slots 0..31 fill entries [0, B) and slot 32 holds [B, B + B / 32), so with
// B = 2^32 (the default) the last slot's entry of (layer, head, page) is slot 0's plus exactly
// 2^32: an index kept in 32 bits (int or uint32_t) would land on slot 0's entry, and slot 0's
// sequence would read the last slot's pages. Slot 15's last entries end at B / 2 = 2^31 and slot
// 16's begin there, where an index in int turns negative. KVFERRY_TEST_BIG_ENTRIES sets B (a
// multiple of 2^17, decimal or 2^N) to run the same sequences on a smaller table; the number of
// layers follows (B / 2^17), every other dimension stays.
constexpr int kPtKvHeads = 4;
constexpr int kPtQHeads = 8;
constexpr int kPtHeadDim = 64;  // the smallest head the CUDA kernels take
constexpr int64_t kPtMaxTokens = int64_t{1} << 18;  // 1024 pages per (slot, layer, head)
constexpr int64_t kPtPageTokens = 256;              // runtime/runtime_impl.h, kPageTokens
constexpr int64_t kPtPages = kPtMaxTokens / kPtPageTokens;
constexpr int kPtSlotsBelow = 32;  // slots below B; one more starts at B
// Entries of one layer over all slots (2^17); B is a multiple of it.
constexpr int64_t kPtQuantum = int64_t{kPtSlotsBelow} * kPtKvHeads * kPtPages;
constexpr int kPtSink = 4;
constexpr int kPtWindow = 8;

bool BigTestsOn() {
  const char* v = std::getenv("KVFERRY_TEST_BIG");
  return v != nullptr && std::string_view(v) == "1";
}

// B from KVFERRY_TEST_BIG_ENTRIES ("268435456" or "2^28"), default 2^32; -1 if unusable.
int64_t PageTableBoundary() {
  const char* v = std::getenv("KVFERRY_TEST_BIG_ENTRIES");
  if (v == nullptr || *v == '\0') return kTwo32;
  const std::string_view s(v);
  char* end = nullptr;
  int64_t b = -1;
  if (s.substr(0, 2) == "2^") {
    const long e = std::strtol(v + 2, &end, 10);
    if (*end == '\0' && e >= 0 && e < 48) b = int64_t{1} << e;
  } else {
    b = std::strtoll(v, &end, 10);
    if (*end != '\0') b = -1;
  }
  const bool ok = b >= 2 * kPtQuantum && b % kPtQuantum == 0 &&
                  b / kPtQuantum <= std::numeric_limits<int>::max();
  return ok ? b : -1;
}

// K and V of one (sequence, layer) as the runtime stores them: bf16, [n, Hkv, d], row after row.
struct StoredRows {
  std::vector<uint16_t> k, v;
  [[nodiscard]] int64_t n() const {
    return static_cast<int64_t>(k.size()) / (kPtKvHeads * kPtHeadDim);
  }
};

// Fast uniform values of unit variance (the long sequence takes 134 million).
struct UniformRng {
  uint64_t s;
  float operator()() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return (static_cast<float>(s >> 40) / 16777216.0f - 0.5f) * 3.4641016f;  // [-sqrt 3, sqrt 3)
  }
};

// Attention of the q heads of one token (q: [Hq, d]) over every stored row, in double; out
// [Hq, d] as the runtime gave it. Relative error of the worst head.
double WorstHeadError(const StoredRows& rows, const float* q, const float* out, double scale) {
  constexpr int kGroup = kPtQHeads / kPtKvHeads, d = kPtHeadDim;
  const int64_t n = rows.n();
  double worst = 0;
  for (int h = 0; h < kPtKvHeads; ++h) {
    std::vector<double> logits(static_cast<size_t>(n * kGroup));
    double m[kGroup];
    for (double& x : m) x = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* kr = &rows.k[static_cast<size_t>((j * kPtKvHeads + h) * d)];
      float kf[d];
      for (int e = 0; e < d; ++e) kf[e] = cpu::Bf16ToF32(kr[e]);
      for (int g = 0; g < kGroup; ++g) {
        const float* qh = q + static_cast<size_t>((h * kGroup + g) * d);
        double dot = 0;
        for (int e = 0; e < d; ++e) dot += static_cast<double>(qh[e]) * kf[e];
        logits[static_cast<size_t>(j * kGroup + g)] = dot * scale;
        m[g] = std::max(m[g], dot * scale);
      }
    }
    std::vector<double> o(static_cast<size_t>(kGroup * d), 0.0);
    double sum[kGroup] = {};
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* vr = &rows.v[static_cast<size_t>((j * kPtKvHeads + h) * d)];
      float vf[d];
      for (int e = 0; e < d; ++e) vf[e] = cpu::Bf16ToF32(vr[e]);
      for (int g = 0; g < kGroup; ++g) {
        const double w = std::exp(logits[static_cast<size_t>(j * kGroup + g)] - m[g]);
        sum[g] += w;
        for (int e = 0; e < d; ++e) o[static_cast<size_t>(g * d + e)] += w * vf[e];
      }
    }
    for (int g = 0; g < kGroup; ++g) {
      std::vector<double> want(o.begin() + g * d, o.begin() + (g + 1) * d);
      for (double& x : want) x /= sum[g];
      worst = std::max(worst, RelErr(out + static_cast<size_t>((h * kGroup + g) * d), want));
    }
  }
  return worst;
}

// Backend x route: route gpu decodes through the planned step, which reads the table's device copy
// (entries copied by HostStore::FlushTable); route cpu through the runtime's own row addressing,
// which reads the pinned table (HostStore::pages / k_row). Appends and prefills read and write
// the pinned table on both (and, on CUDA, prefill reads the device copy too).
class PageTablePast2Pow32Entries : public ::testing::TestWithParam<std::tuple<Backend, Route>> {};

TEST_P(PageTablePast2Pow32Entries, EverySequenceDecodesExactly) {
  const int64_t asked = PageTableBoundary();
  const int64_t boundary = asked > 0 ? asked : kTwo32;
  const int64_t per_slot = boundary / kPtSlotsBelow;
  const int64_t entries = boundary + per_slot;
  const int layers = static_cast<int>(boundary / kPtQuantum);
  const int64_t table_bytes = entries * static_cast<int64_t>(sizeof(void*));
  const int64_t resident_bytes = (entries / kPtPages) * (kPtSink + kPtWindow) * 2 * kPtHeadDim * 2;
  constexpr double kGiB = double{1 << 30};
  if (!BigTestsOn()) {
    GTEST_SKIP() << "set KVFERRY_TEST_BIG=1 to run: a host-store page table of " << entries
                 << " entries (" << table_bytes / kGiB << " GiB, zeroed at Create). Host backend: "
                 << 2 * table_bytes / kGiB << " GiB of RAM (the table and its 'device' copy); "
                 << "CUDA: " << table_bytes / kGiB << " GiB pinned, "
                 << (table_bytes + resident_bytes) / kGiB
                 << " GiB of GPU memory. KVFERRY_TEST_BIG_ENTRIES=2^28 runs the same sequences "
                    "on a table of 2^28 + 2^23 entries (no index past 2^31)";
  }
  ASSERT_GT(asked, 0) << "KVFERRY_TEST_BIG_ENTRIES must be a multiple of " << kPtQuantum
                      << " (2^17), at least 2^18 (decimal or 2^N)";
  const auto [backend, route] = GetParam();
  if (backend == Backend::kCuda && !CudaAvailable()) {
    GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  }
  const auto t_start = std::chrono::steady_clock::now();
  auto index = [&](int64_t slot, int64_t layer, int64_t head, int64_t page) {
    return ((slot * layers + layer) * kPtKvHeads + head) * kPtPages + page;
  };
  const int last = layers - 1, last_head = kPtKvHeads - 1;
  // Where the tested sequences' entries lie (with the default B: 2^31 - 1, 2^31, 2^32 and the end).
  ASSERT_EQ(index(15, last, last_head, kPtPages - 1), boundary / 2 - 1);
  ASSERT_EQ(index(16, 0, 0, 0), boundary / 2);
  ASSERT_EQ(index(32, 0, 0, 0), boundary);
  ASSERT_EQ(index(32, last, last_head, kPtPages - 1), entries - 1);
  for (int layer : {0, last}) {
    for (int64_t head : {int64_t{0}, int64_t{last_head}}) {
      ASSERT_EQ(index(32, layer, head, 5) - boundary, index(0, layer, head, 5));
    }
  }
  if (boundary == kTwo32) {
    ASSERT_GT(entries, kTwo32);
  }

  RuntimeConfig c;
  c.model.num_layers = layers;
  c.model.num_kv_heads = kPtKvHeads;
  c.model.num_q_heads = kPtQHeads;
  c.model.head_dim = kPtHeadDim;
  c.model.kv_dtype = DType::kBF16;
  c.capacity.max_sequences = kPtSlotsBelow + 1;
  c.capacity.max_batch = 4;
  c.capacity.max_tokens_per_sequence = kPtMaxTokens;
  c.capacity.max_prefill_chunk = 8192;
  c.capacity.prefill_prefetch = false;  // CUDA: one prefill staging (256 MiB), not two
  c.tiers.sink_tokens = kPtSink;
  c.tiers.window_tokens = kPtWindow;
  // Streaming with a budget of every position: dense attention, every row but the 12 resident
  // ones read from the host store through the page table.
  c.policy.name = "streaming";
  c.policy.budget_tokens = kPtMaxTokens;
  c.route = route;
  c.backend = backend;
  c.cpu_threads = 2;
  c.probe_at_start = false;
  auto rt_or = Runtime::Create(c);
  ASSERT_TRUE(rt_or.ok()) << rt_or.status().ToString();
  Runtime& rt = **rt_or;
  ASSERT_EQ(rt.backend(), backend);
  int64_t planned_table = -1;
  for (const DeviceMemoryPlan::Part& part : rt.device_memory().parts) {
    if (part.name == "host-store page table") planned_table = part.bytes;
  }
  ASSERT_EQ(planned_table, table_bytes);
  const double create_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

  // Sequence i + 1 takes slot i; the tested ones: slot 0, slots 15 and 16 (either side of B / 2)
  // and slot 32 (from B on, to the last entry).
  for (SequenceId s = 1; s <= kPtSlotsBelow + 1; ++s) ASSERT_TRUE(rt.AddSequence(s).ok());
  const std::vector<SequenceId> seqs = {1, 16, 17, 33};
  const std::vector<int> test_layers = {0, last};
  constexpr int kSteps = 3;
  constexpr int64_t kLongPrompt = 16;  // prefilled after the appended rows
  const int hkv = kPtKvHeads, hq = kPtQHeads, d = kPtHeadDim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  UniformRng rng{0x9e3779b97f4a7c15ull};
  auto random_f32 = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = rng();
    return x;
  };
  // Appends `rows` random bf16 rows of K and V to r; returns views of them ([rows, Hkv, d]).
  auto grow = [&](StoredRows& r, int64_t rows) {
    const size_t at = r.k.size();
    for (int64_t i = 0; i < rows * hkv * d; ++i) {
      r.k.push_back(cpu::F32ToBf16(rng()));
      r.v.push_back(cpu::F32ToBf16(rng()));
    }
    return std::pair{
        TensorView::Contiguous(&r.k[at], DType::kBF16, MemoryKind::kHost, {rows, hkv, d}),
        TensorView::Contiguous(&r.v[at], DType::kBF16, MemoryKind::kHost, {rows, hkv, d})};
  };
  auto f32_view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d});
  };
  // [sequence][tested layer]
  std::vector<std::vector<StoredRows>> stored(seqs.size(),
                                              std::vector<StoredRows>(test_layers.size()));
  // Room for CUDA's split softmax over 2^18 rows; one wrong page of them moves the output ~4%.
  const double decode_tol = 1e-4;
  int checks = 0;
  auto check = [&](size_t i, size_t li, const float* q, const float* out, double tol,
                   const char* what) {
    const double err = WorstHeadError(stored[i][li], q, out, scale);
    EXPECT_LT(err, tol) << what << " sequence " << seqs[i] << " layer " << test_layers[li]
                        << " n " << stored[i][li].n();
    ++checks;
  };

  // Prefill: slot 0 first, so that anything the later slots' entries overwrite is already there.
  // The last slot's last layer is filled to the end (2^18 positions, its every page) by appends,
  // then a short prefill; the rest get short prompts of 2 or 3 pages.
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (size_t li = 0; li < test_layers.size(); ++li) {
      const int layer = test_layers[li];
      StoredRows& r = stored[i][li];
      const bool long_one = seqs[i] == 33 && layer == last;
      const int64_t prompt = long_one ? kLongPrompt : 300 + 100 * static_cast<int64_t>(i);
      r.k.reserve(static_cast<size_t>((long_one ? kPtMaxTokens : prompt + kSteps + 1) * hkv * d));
      r.v.reserve(r.k.capacity());
      if (long_one) {
        for (int64_t left = kPtMaxTokens - kSteps - kLongPrompt; left > 0;) {
          const int64_t rows = std::min<int64_t>(left, c.capacity.max_prefill_chunk);
          auto [k, v] = grow(r, rows);
          const Status st = rt.Append(seqs[i], layer, k, v);
          ASSERT_TRUE(st.ok()) << st.ToString();
          left -= rows;
        }
      }
      auto q = random_f32(prompt * hq * d);
      std::vector<float> out(q.size(), NAN);
      auto [k, v] = grow(r, prompt);
      const Status st = rt.Prefill(seqs[i], layer, f32_view(q, prompt, hq), k, v,
                                   f32_view(out, prompt, hq));
      ASSERT_TRUE(st.ok()) << st.ToString();
      ASSERT_TRUE(rt.Synchronize().ok());
      const size_t row = static_cast<size_t>((prompt - 1) * hq * d);
      check(i, li, &q[row], &out[row], 2e-2, "prefill (last row)");
    }
  }

  // Batched decode of the four at both layers, each step checked.
  auto decode = [&](const std::vector<size_t>& which, const char* what) {
    std::vector<SequenceId> ids;
    for (size_t i : which) ids.push_back(seqs[i]);
    const int64_t b = static_cast<int64_t>(which.size());
    for (size_t li = 0; li < test_layers.size(); ++li) {
      auto q = random_f32(b * hq * d);
      std::vector<float> out(q.size(), NAN);
      std::vector<uint16_t> k(static_cast<size_t>(b * hkv * d)), v(k.size());
      for (size_t e = 0; e < k.size(); ++e) {
        k[e] = cpu::F32ToBf16(rng());
        v[e] = cpu::F32ToBf16(rng());
      }
      const Status st =
          rt.Decode(ids, test_layers[li], f32_view(q, b, hq),
                    TensorView::Contiguous(k.data(), DType::kBF16, MemoryKind::kHost, {b, hkv, d}),
                    TensorView::Contiguous(v.data(), DType::kBF16, MemoryKind::kHost, {b, hkv, d}),
                    f32_view(out, b, hq));
      ASSERT_TRUE(st.ok()) << what << ": " << st.ToString();
      ASSERT_TRUE(rt.Synchronize().ok());
      for (int64_t j = 0; j < b; ++j) {
        StoredRows& r = stored[which[static_cast<size_t>(j)]][li];
        const size_t row = static_cast<size_t>(j * hkv * d);
        r.k.insert(r.k.end(), k.begin() + row, k.begin() + row + hkv * d);
        r.v.insert(r.v.end(), v.begin() + row, v.begin() + row + hkv * d);
        const size_t qrow = static_cast<size_t>(j * hq * d);
        check(which[static_cast<size_t>(j)], li, &q[qrow], &out[qrow], decode_tol, what);
      }
    }
  };
  for (int step = 0; step < kSteps; ++step) {
    decode({0, 1, 2, 3}, "decode");
    if (HasFatalFailure()) return;
  }
  // The last slot's last layer now holds every position: its last page (the table's last entry)
  // is in use.
  Result<int64_t> long_len = rt.SequenceLength(33, last);
  ASSERT_TRUE(long_len.ok());
  EXPECT_EQ(*long_len, kPtMaxTokens);
  // Slot 0 after the last slot's pages were all entered (and again after they are released):
  // still its own rows.
  decode({0, 1}, "decode after the last slot filled");
  if (HasFatalFailure()) return;
  ASSERT_TRUE(rt.RemoveSequence(33).ok());
  decode({0, 1, 2}, "decode after the last slot released");
  EXPECT_EQ(checks, 2 * 4 + kSteps * 2 * 4 + 2 * 2 + 2 * 3);
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::printf("[ info ] %s, route %s: %lld entries (%.2f GiB of table, %d layers), Create %.1f s, "
              "all %.1f s\n",
              BackendName(backend), RouteName(route), static_cast<long long>(entries),
              table_bytes / kGiB, layers, create_s, total_s);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, PageTablePast2Pow32Entries,
    ::testing::Combine(::testing::Values(Backend::kHost, Backend::kCuda),
                       ::testing::Values(Route::kGpu, Route::kCpu)),
    [](const ::testing::TestParamInfo<std::tuple<Backend, Route>>& info) {
      return std::string(BackendName(std::get<0>(info.param))) + "_" +
             RouteName(std::get<1>(info.param));
    });

}  // namespace
}  // namespace kvferry
