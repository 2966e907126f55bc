// Copyright kvferry authors. Apache-2.0.
// LFPS primed from device-computed statistics (Device::PrimeAttention, PrimeArgs, then
// LfpsPolicy::OnPrefillPrimed) leaves the tables and priors OnPrefill's host loop leaves, up to
// fp32 summation order:
//  - host device (CPU reference, runs everywhere): per-head tables, k_bar / v_bar and sigma_hat^2
//    equal OnPrefill's, and the decode steps after select the same positions; odd lengths
//    1/17/97/4099, sink 0/4, GQA 1/4, d64/d128, bf16/f16, chunks shorter than s;
//  - CUDA kernel (gpu/prime.cu) against the CPU reference on the same inputs, outputs poisoned,
//    with the GPU's split count and with a scratch that holds one split;
//  - through the Runtime: the host backend with paths.prime = kDevice equals its host loop; on
//    CUDA the GPU-primed runtime equals one primed by the host loop (paths.prime = kHost) bit for
//    bit in its selections, and the host backend within the existing CUDA-vs-host tolerance.
// Tolerance of the tables: |a - b| <= 1e-4 |b| + 1e-6 max|b| (fp32 sums of up to rows x group
// weights in another order, logits of another dot-product order); k_bar / v_bar 1e-5 absolute;
// sigma_hat^2 1e-4 relative. The CUDA tests skip without a GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/reference.h"
#include "gpu/device.h"
#include "kvferry/kvferry.h"
#include "policies/lfps/lfps.h"
#include "tests/policy_test_util.h"

namespace kvferry {
namespace {

using testing_util::PagedHead;

constexpr int kHeads = 2;  // KV heads of one (sequence, layer): strides between heads
constexpr int kWindow = 8;

// Tables match: |a - b| <= 1e-4 |b| + 1e-6 max|b|, first mismatches printed.
void ExpectTablesNear(const std::vector<float>& a, const std::vector<float>& b, int64_t n,
                      const char* what) {
  ASSERT_GE(static_cast<int64_t>(a.size()), n);
  ASSERT_GE(static_cast<int64_t>(b.size()), n);
  float mx = 0.0f;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, std::fabs(b[i]));
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float tol = 1e-4f * std::fabs(b[i]) + 1e-6f * mx;
    if (!(std::fabs(a[i] - b[i]) <= tol)) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "] = " << a[i] << ", expected " << b[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " entries differ";
}

// One (sequence, layer)'s KV heads, and the queries of a prefill chunk ending at n.
struct PrimeCase {
  int64_t n;
  int sink, group, head_dim;
  DType dtype;
  int32_t chunk;  // queries of the last chunk (its last min(s, chunk) rows prime)
};

std::string CaseName(const PrimeCase& c) {
  return "n" + std::to_string(c.n) + "_sink" + std::to_string(c.sink) + "_g" +
         std::to_string(c.group) + "_d" + std::to_string(c.head_dim) + "_" + DTypeName(c.dtype) +
         "_chunk" + std::to_string(c.chunk);
}

struct PrimeInputs {
  std::vector<std::unique_ptr<PagedHead>> heads;
  std::vector<void*> table;  // [kHeads][max_pages]
  int64_t max_pages = 0;
  std::vector<float> q;  // [kHeads][chunk][group][head_dim]
  PrimeInputs(const PrimeCase& c, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<float> k(static_cast<size_t>(c.head_dim)), v(k.size());
    for (int h = 0; h < kHeads; ++h) {
      heads.push_back(std::make_unique<PagedHead>(c.head_dim, c.dtype));
      for (int64_t i = 0; i < c.n; ++i) {
        // A shared offset per channel gives the column sums something to find.
        for (int d = 0; d < c.head_dim; ++d) {
          k[d] = nd(rng) + 0.3f * static_cast<float>(d % 5);
          v[d] = nd(rng) - 0.2f * static_cast<float>(d % 3);
        }
        heads[h]->Append(k.data(), v.data());
      }
    }
    max_pages = (c.n + 63) / 64;
    table.assign(static_cast<size_t>(kHeads * max_pages), nullptr);
    for (int h = 0; h < kHeads; ++h) {
      const KvPages kv = heads[h]->pages();
      for (int64_t p = 0; p < max_pages; ++p) table[h * max_pages + p] = kv.pages[p];
    }
    q.resize(static_cast<size_t>(kHeads) * c.chunk * c.group * c.head_dim);
    for (float& x : q) x = 1.5f * nd(rng);
  }
  const float* Q(const PrimeCase& c, int h) const {
    return q.data() + static_cast<int64_t>(h) * c.chunk * c.group * c.head_dim;
  }
  PrefillContext Context(const PrimeCase& c, int h) const {
    PrefillContext ctx;
    ctx.kv_head = h;
    ctx.q_pos0 = c.n - c.chunk;
    ctx.num_q = c.chunk;
    ctx.n = c.n;
    ctx.sink = c.sink;
    ctx.window = kWindow;
    ctx.q = Q(c, h);
    ctx.params = testing_util::Params(c.group, c.head_dim, c.dtype);
    ctx.kv = heads[h]->pages();
    return ctx;
  }
  // PrimeArgs over host memory (pages of the heads above), rows = min(s, chunk).
  PrimeArgs Args(const PrimeCase& c, int rows, float* tables, double* stats) const {
    PrimeArgs a;
    a.params = testing_util::Params(c.group, c.head_dim, c.dtype);
    a.num_kv_heads = kHeads;
    a.q = Q(c, 0) + static_cast<int64_t>(c.chunk - rows) * c.group * c.head_dim;
    a.q_head_stride = static_cast<int64_t>(c.chunk) * c.group * c.head_dim;
    a.rows = rows;
    a.t_first = c.n - rows;
    a.n = c.n;
    a.sink = std::min<int64_t>(c.sink, c.n);
    a.off_hi = std::max<int64_t>(a.sink, c.n - kWindow);
    a.store.pages = table.data();
    a.store.max_pages = max_pages;
    a.store.page_tokens = 64;
    a.tables = tables;
    a.table_stride = 2 * c.n;
    a.stats = stats;
    return a;
  }
};

LfpsPolicy MakeLfps() {
  LfpsParams lp;  // defaults: s = 32, scan on
  return LfpsPolicy(lp, 1, 1, kHeads, 8192);
}

// Primes a fresh policy with OnPrefillPrimed from the statistics in tables / stats.
void PrimeFrom(LfpsPolicy& policy, const PrimeInputs& in, const PrimeCase& c, int rows,
               const float* tables, const double* stats) {
  for (int h = 0; h < kHeads; ++h) {
    PrefillContext ctx = in.Context(c, h);
    ctx.q = nullptr;
    PrimedStats primed;
    primed.ver = tables + h * 2 * c.n;
    primed.sla = primed.ver + c.n;
    primed.stats = stats + h * PrimeStatsCount(c.head_dim, c.group);
    primed.rows = rows;
    const Status st = policy.OnPrefillPrimed(ctx, primed);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
}

void ExpectSamePriming(const LfpsPolicy& got, const LfpsPolicy& want, const PrimeCase& c) {
  for (int h = 0; h < kHeads; ++h) {
    SCOPED_TRACE(::testing::Message() << "kv head " << h);
    LfpsPolicy::PrimedState a, b;
    ASSERT_TRUE(got.GetPrimedState(0, 0, h, &a));
    ASSERT_TRUE(want.GetPrimedState(0, 0, h, &b));
    ExpectTablesNear(a.ver, b.ver, c.n, "ver");
    ExpectTablesNear(a.sla, b.sla, c.n, "sla");
    const int64_t off_hi = std::max<int64_t>(c.sink, c.n - kWindow);
    if (off_hi > c.sink) {  // a table that could pass on zeros must not be all zeros
      double sum = 0.0;
      for (int64_t i = 0; i < c.n; ++i) sum += b.ver[i];
      EXPECT_GT(sum, 0.0);
    }
    ASSERT_EQ(a.k_bar.size(), b.k_bar.size());
    for (size_t d = 0; d < a.k_bar.size(); ++d) {
      EXPECT_NEAR(a.k_bar[d], b.k_bar[d], 1e-5) << "k_bar " << d;
      EXPECT_NEAR(a.v_bar[d], b.v_bar[d], 1e-5) << "v_bar " << d;
    }
    EXPECT_NEAR(a.sigma2_hat, b.sigma2_hat, 1e-4 * std::fabs(b.sigma2_hat) + 1e-12);
  }
}

class LfpsPrimeTest : public ::testing::TestWithParam<PrimeCase> {};

// The host device's PrimeAttention (the CPU reference) and OnPrefillPrimed give OnPrefill's
// tables, and the decode steps after select the same positions.
TEST_P(LfpsPrimeTest, HostReferenceEqualsOnPrefill) {
  const PrimeCase c = GetParam();
  const PrimeInputs in(c, 17u + static_cast<uint32_t>(c.n));
  LfpsPolicy host = MakeLfps(), primed = MakeLfps();
  for (int h = 0; h < kHeads; ++h) {
    const Status st = host.OnPrefill(in.Context(c, h));
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  const int rows = std::min(host.params().s, c.chunk);
  std::vector<float> tables(static_cast<size_t>(kHeads * 2 * c.n), std::nanf(""));
  std::vector<double> stats(static_cast<size_t>(kHeads * PrimeStatsCount(c.head_dim, c.group)),
                            std::nan(""));
  const std::unique_ptr<Device> dev = MakeHostDevice();
  const Status st = dev->PrimeAttention(in.Args(c, rows, tables.data(), stats.data()), nullptr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  PrimeFrom(primed, in, c, rows, tables.data(), stats.data());
  ExpectSamePriming(primed, host, c);

  // The same decode steps on both: the same positions.
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(c.head_dim)), v(k.size()), q;
  std::vector<int32_t> out_a, out_b;
  for (int step = 0; step < 6; ++step) {
    for (int h = 0; h < kHeads; ++h) {
      for (int d = 0; d < c.head_dim; ++d) k[d] = nd(rng), v[d] = nd(rng);
      in.heads[h]->Append(k.data(), v.data());
      q.resize(static_cast<size_t>(c.group) * c.head_dim);
      for (float& x : q) x = 1.5f * nd(rng);
      SelectContext sc = testing_util::Context(*in.heads[h], q.data(), c.group, c.sink, kWindow,
                                               c.sink + kWindow + 24);
      sc.kv_head = h;
      out_a.clear();
      out_b.clear();
      ASSERT_TRUE(primed.Select(sc, out_a).ok());
      ASSERT_TRUE(host.Select(sc, out_b).ok());
      EXPECT_EQ(out_a, out_b) << "step " << step << " head " << h;
    }
  }
}

// Bad sizes are a clear error, never a crash.
TEST(LfpsPrime, BadArgumentsAreInvalidArgument) {
  const PrimeCase c{97, 4, 4, 64, DType::kBF16, 40};
  const PrimeInputs in(c, 3);
  std::vector<float> tables(static_cast<size_t>(kHeads * 2 * c.n));
  std::vector<double> stats(static_cast<size_t>(kHeads * PrimeStatsCount(c.head_dim, c.group)));
  const std::unique_ptr<Device> dev = MakeHostDevice();
  PrimeArgs a = in.Args(c, 32, tables.data(), stats.data());
  a.t_first = c.n - 31;  // rows past n
  EXPECT_EQ(dev->PrimeAttention(a, nullptr).code(), StatusCode::kInvalidArgument);
  a = in.Args(c, 32, tables.data(), stats.data());
  a.off_hi = c.n + 1;
  EXPECT_EQ(dev->PrimeAttention(a, nullptr).code(), StatusCode::kInvalidArgument);
  a = in.Args(c, 32, tables.data(), stats.data());
  a.table_stride = c.n;
  EXPECT_EQ(dev->PrimeAttention(a, nullptr).code(), StatusCode::kInvalidArgument);
  LfpsPolicy policy = MakeLfps();
  PrimedStats primed{tables.data(), tables.data() + c.n, stats.data(), 31};
  PrefillContext ctx = in.Context(c, 0);
  EXPECT_EQ(policy.OnPrefillPrimed(ctx, primed).code(), StatusCode::kInvalidArgument);  // rows
}

// The CUDA kernel against the CPU reference on the same inputs (pages, queries in device memory).
TEST_P(LfpsPrimeTest, CudaKernelEqualsReference) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  const PrimeCase c = GetParam();
  const PrimeInputs in(c, 91u + static_cast<uint32_t>(c.n));
  auto made = MakeCudaDevice(0);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  const std::unique_ptr<Device> dev = std::move(made).value();
  const StreamHandle s = dev->default_stream();
  const int rows = std::min(32, c.chunk);
  const int64_t stats_n = kHeads * PrimeStatsCount(c.head_dim, c.group);
  std::vector<float> want_tables(static_cast<size_t>(kHeads * 2 * c.n));
  std::vector<double> want_stats(static_cast<size_t>(stats_n));
  cpu::PrimeAttentionRef(in.Args(c, rows, want_tables.data(), want_stats.data()));

  // Device copies: every page, the page table, the queries; poisoned outputs.
  const size_t page_bytes = 2 * 64 * c.head_dim * DTypeSize(c.dtype);
  std::vector<void*> owned;
  auto alloc = [&](size_t bytes) {
    auto r = dev->AllocDevice(bytes);
    EXPECT_TRUE(r.ok());
    owned.push_back(r.ok() ? r.value() : nullptr);
    return owned.back();
  };
  std::vector<void*> dev_table(in.table.size());
  for (size_t i = 0; i < in.table.size(); ++i) {
    dev_table[i] = alloc(page_bytes);
    ASSERT_TRUE(dev->CopyAsync(dev_table[i], in.table[i], page_bytes, s).ok());
  }
  auto* d_table = static_cast<void**>(alloc(dev_table.size() * sizeof(void*)));
  ASSERT_TRUE(dev->CopyAsync(d_table, dev_table.data(), dev_table.size() * sizeof(void*), s).ok());
  auto* d_q = static_cast<float*>(alloc(in.q.size() * sizeof(float)));
  ASSERT_TRUE(dev->CopyAsync(d_q, in.q.data(), in.q.size() * sizeof(float), s).ok());
  const int64_t stride = 2 * c.n + 5;  // a stride past 2 n: the kernel must not rely on 2 n
  auto* d_tables = static_cast<float*>(alloc(static_cast<size_t>(kHeads * stride) * sizeof(float)));
  auto* d_stats = static_cast<double*>(alloc(static_cast<size_t>(stats_n) * sizeof(double)));
  const std::vector<float> poison(static_cast<size_t>(kHeads * stride), std::nanf(""));
  const std::vector<double> poison_stats(static_cast<size_t>(stats_n), std::nan(""));
  const size_t scratch_full = PrimeScratchBytes(kHeads, rows, c.group, 64);
  void* d_scratch = alloc(scratch_full);
  for (const size_t scratch : {scratch_full, PrimeScratchBytes(kHeads, rows, c.group, 1)}) {
    SCOPED_TRACE(::testing::Message() << "scratch " << scratch << " bytes");
    ASSERT_TRUE(dev->CopyAsync(d_tables, poison.data(), poison.size() * sizeof(float), s).ok());
    ASSERT_TRUE(dev->CopyAsync(d_stats, poison_stats.data(), poison_stats.size() * 8, s).ok());
    PrimeArgs a = in.Args(c, rows, d_tables, d_stats);
    a.q = d_q + static_cast<int64_t>(c.chunk - rows) * c.group * c.head_dim;
    a.store.pages = d_table;
    a.table_stride = stride;
    a.scratch = d_scratch;
    a.scratch_bytes = scratch;
    const Status st = dev->PrimeAttention(a, s);
    ASSERT_TRUE(st.ok()) << st.ToString();
    std::vector<float> got(static_cast<size_t>(kHeads * stride));
    std::vector<double> got_stats(static_cast<size_t>(stats_n));
    ASSERT_TRUE(dev->CopyAsync(got.data(), d_tables, got.size() * sizeof(float), s).ok());
    ASSERT_TRUE(dev->CopyAsync(got_stats.data(), d_stats, got_stats.size() * 8, s).ok());
    ASSERT_TRUE(dev->SynchronizeStream(s).ok());
    for (int h = 0; h < kHeads; ++h) {
      SCOPED_TRACE(::testing::Message() << "kv head " << h);
      const std::vector<float> gv(got.begin() + h * stride, got.begin() + h * stride + c.n),
          gs(got.begin() + h * stride + c.n, got.begin() + h * stride + 2 * c.n),
          wv(want_tables.begin() + h * 2 * c.n, want_tables.begin() + h * 2 * c.n + c.n),
          ws(want_tables.begin() + h * 2 * c.n + c.n, want_tables.begin() + (h + 1) * 2 * c.n);
      ExpectTablesNear(gv, wv, c.n, "ver");
      ExpectTablesNear(gs, ws, c.n, "sla");
      const int64_t base = h * PrimeStatsCount(c.head_dim, c.group);
      for (int64_t i = 0; i < PrimeStatsCount(c.head_dim, c.group); ++i) {
        const double w = want_stats[base + i];
        EXPECT_NEAR(got_stats[base + i], w, 1e-4 * std::fabs(w) + 1e-3) << "stats " << i;
      }
    }
  }
  for (void* p : owned) dev->FreeDevice(p);
}

std::vector<PrimeCase> Cases() {
  std::vector<PrimeCase> cases;
  for (int64_t n : {1, 17, 97, 4099}) {
    for (int sink : {0, 4}) {
      for (int group : {1, 4}) {
        const int hd = group == 1 ? 128 : 64;
        const DType dt = (sink / 4 + group) % 2 == 0 ? DType::kBF16 : DType::kF16;
        // The whole prompt in one chunk, and a last chunk shorter than s.
        cases.push_back({n, sink, group, hd, dt, static_cast<int32_t>(n)});
        if (n > 5) cases.push_back({n, sink, group, hd, dt, 5});
      }
    }
  }
  // d128 with GQA 4 and d64 without GQA, both dtypes.
  cases.push_back({97, 4, 4, 128, DType::kBF16, 40});
  cases.push_back({4099, 4, 1, 64, DType::kF16, 33});
  cases.push_back({4099, 0, 4, 128, DType::kF16, 1000});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, LfpsPrimeTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return CaseName(info.param); });

// ---- through the Runtime ------------------------------------------------------------------------

RuntimeConfig PrimeConfig(Backend backend, DType kv_dtype) {
  RuntimeConfig cfg;
  cfg.model.num_layers = 2;
  cfg.model.num_q_heads = 8;
  cfg.model.num_kv_heads = 2;
  cfg.model.head_dim = 64;
  cfg.model.kv_dtype = kv_dtype;
  cfg.capacity.max_sequences = 2;
  cfg.capacity.max_tokens_per_sequence = 2048;
  cfg.capacity.max_batch = 2;
  cfg.capacity.max_prefill_chunk = 512;
  cfg.tiers.sink_tokens = 4;
  cfg.tiers.window_tokens = 32;
  cfg.policy.name = "lfps";
  cfg.policy.budget_tokens = 96;
  cfg.route = Route::kAuto;
  cfg.backend = backend;
  cfg.cpu_threads = 2;
  cfg.probe_at_start = false;
  return cfg;
}

PathChoice PathNamed(const std::string& name) {
  if (name == "host") return PathChoice::kHost;
  if (name == "device") return PathChoice::kDevice;
  EXPECT_TRUE(name.empty()) << "path '" << name << "'";
  return PathChoice::kAuto;
}

// Creates a Runtime whose RuntimeConfig::paths.prime is \p prime ("host", "device"; "" the
// backend's own), and with \p path if given: "prime_eager", "cuda_prefill_paged",
// "shadow_scan=host" or "shadow_scan=device".
std::unique_ptr<Runtime> MakeRuntime(RuntimeConfig c, const char* prime, const char* path = nullptr) {
  c.paths.prime = PathNamed(prime);
  const std::string p = path == nullptr ? "" : path;
  if (p == "prime_eager") {
    c.paths.prime_eager = true;
  } else if (p == "cuda_prefill_paged") {
    c.paths.cuda_prefill_paged = true;
  } else if (p.rfind("shadow_scan=", 0) == 0) {
    c.paths.shadow_scan = PathNamed(p.substr(12));
  } else {
    EXPECT_TRUE(p.empty()) << "path '" << p << "'";
  }
  auto made = Runtime::Create(c);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  return made.ok() ? std::move(made).value() : nullptr;
}

// Feeds the same chunked prompt (the last chunk shorter than s) and decode steps to every
// runtime; runtime 0 is compared with each other one: decode outputs within tol[i] and
// (same_selection[i]) the same positions every step.
// Optionally (\p skew > 0) the second sequence gets one more chunk of skew tokens (the batch then
// decodes different lengths), and (\p mid_chunk > 0) the first one a chunk of that many tokens
// after step 5 (a prompt continued after decoding; the next decode primes again).
void RunAndCompare(std::vector<std::unique_ptr<Runtime>>& rts, const std::vector<int64_t>& chunks,
                   const std::vector<double>& tol, const std::vector<bool>& same_selection,
                   int64_t skew = 0, int64_t mid_chunk = 0) {
  const ModelShape& m = rts[0]->config().model;
  const std::vector<SequenceId> seqs = {3, 4};
  for (auto& rt : rts) {
    for (SequenceId s : seqs) ASSERT_TRUE(rt->AddSequence(s).ok());
  }
  std::mt19937 rng(77);
  std::normal_distribution<float> nd;
  auto fill = [&](std::vector<float>& v, float scale) {
    for (float& x : v) x = scale * nd(rng);
  };
  auto tv = [&](std::vector<float>& x, int64_t t, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {t, heads, m.head_dim});
  };
  auto prefill = [&](SequenceId s, int64_t chunk) {
    for (int layer = 0; layer < m.num_layers; ++layer) {
      std::vector<float> q(chunk * m.num_q_heads * m.head_dim),
          k(chunk * m.num_kv_heads * m.head_dim), v(k.size()), out(q.size());
      fill(q, 2.0f);
      fill(k, 1.0f);
      fill(v, 1.0f);
      for (auto& rt : rts) {
        const Status st =
            rt->Prefill(s, layer, tv(q, chunk, m.num_q_heads), tv(k, chunk, m.num_kv_heads),
                        tv(v, chunk, m.num_kv_heads), tv(out, chunk, m.num_q_heads));
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_TRUE(rt->Synchronize().ok());
      }
    }
  };
  for (const int64_t chunk : chunks) {
    for (SequenceId s : seqs) prefill(s, chunk);
  }
  if (skew > 0) prefill(seqs[1], skew);
  const int64_t batch = static_cast<int64_t>(seqs.size());
  for (int step = 0; step < 12; ++step) {
    if (step == 6 && mid_chunk > 0) prefill(seqs[0], mid_chunk);
    for (int layer = 0; layer < m.num_layers; ++layer) {
      std::vector<float> q(batch * m.num_q_heads * m.head_dim),
          k(batch * m.num_kv_heads * m.head_dim), v(k.size());
      fill(q, 2.0f);
      fill(k, 1.0f);
      fill(v, 1.0f);
      std::vector<std::vector<float>> out(rts.size(), std::vector<float>(q.size(), std::nanf("")));
      for (size_t r = 0; r < rts.size(); ++r) {
        const Status st =
            rts[r]->Decode(seqs, layer, tv(q, batch, m.num_q_heads), tv(k, batch, m.num_kv_heads),
                           tv(v, batch, m.num_kv_heads), tv(out[r], batch, m.num_q_heads));
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_TRUE(rts[r]->Synchronize().ok());
      }
      for (size_t r = 1; r < rts.size(); ++r) {
        double err = 0.0, norm = 0.0;
        for (size_t i = 0; i < q.size(); ++i) {
          ASSERT_FALSE(std::isnan(out[r][i])) << "unwritten output " << i;
          err = std::max(err, static_cast<double>(std::fabs(out[0][i] - out[r][i])));
          norm += static_cast<double>(out[0][i]) * out[0][i];
        }
        EXPECT_GT(norm, 0.0);
        EXPECT_LE(err, tol[r]) << "runtime " << r << " step " << step << " layer " << layer;
        if (!same_selection[r]) continue;
        for (SequenceId s : seqs) {
          for (int h = 0; h < m.num_kv_heads; ++h) {
            auto a = rts[0]->LastSelection(s, layer, h);
            auto b = rts[r]->LastSelection(s, layer, h);
            ASSERT_TRUE(a.ok() && b.ok());
            EXPECT_EQ(a.value(), b.value())
                << "runtime " << r << " step " << step << " layer " << layer << " head " << h;
          }
        }
      }
    }
  }
  const Stats s0 = rts[0]->GetStats();
  EXPECT_GT(s0.ms_prime, 0.0);
  for (size_t r = 1; r < rts.size(); ++r) {
    if (same_selection[r]) {
      EXPECT_EQ(rts[r]->GetStats().rows_selected, s0.rows_selected);
    }
  }
}

// The host backend with paths.prime = kDevice (the CPU reference of the device path) equals its
// host loop: the runtime wiring of the GPU path, run where there is no GPU.
TEST(LfpsPrimeRuntime, HostDevicePathEqualsHostLoop) {
  for (const DType dt : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dt));
    std::vector<std::unique_ptr<Runtime>> rts;
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kHost, dt), "device"));
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kHost, dt), ""));
    ASSERT_TRUE(rts[0] != nullptr && rts[1] != nullptr);
    RunAndCompare(rts, {300, 21}, {0.0, 1e-5}, {true, true});
  }
}

// Priming is deferred to the first Decode after the prompt (the last chunk's rows kept): it selects
// and attends exactly as priming after every chunk (paths.prime_eager), on the host loop and on
// the host backend's copy of the device path; a prefill alone primes nothing until then.
TEST(LfpsPrimeRuntime, DeferredToFirstDecodeEqualsEager) {
  for (const char* prime : {"", "device"}) {
    SCOPED_TRACE(*prime == '\0' ? "host loop" : "device path");
    std::vector<std::unique_ptr<Runtime>> rts;
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kHost, DType::kBF16), prime));
    rts.push_back(
        MakeRuntime(PrimeConfig(Backend::kHost, DType::kBF16), prime, "prime_eager"));
    ASSERT_TRUE(rts[0] != nullptr && rts[1] != nullptr);
    RunAndCompare(rts, {300, 21}, {0.0, 0.0}, {true, true});
  }
  // Deferred: nothing primed by the prefill itself; the eager runtime primed every chunk.
  std::vector<std::unique_ptr<Runtime>> rts;
  rts.push_back(MakeRuntime(PrimeConfig(Backend::kHost, DType::kBF16), ""));
  rts.push_back(MakeRuntime(PrimeConfig(Backend::kHost, DType::kBF16), "", "prime_eager"));
  ASSERT_TRUE(rts[0] != nullptr && rts[1] != nullptr);
  const ModelShape& m = rts[0]->config().model;
  std::vector<float> q(64 * m.num_q_heads * m.head_dim, 0.5f), k(64 * m.num_kv_heads * m.head_dim, 0.25f),
      v(k.size(), 1.0f), out(q.size());
  auto tv = [&](std::vector<float>& x, int64_t t, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {t, heads, m.head_dim});
  };
  for (auto& rt : rts) {
    ASSERT_TRUE(rt->AddSequence(9).ok());
    for (int c = 0; c < 2; ++c) {
      ASSERT_TRUE(rt->Prefill(9, 0, tv(q, 64, m.num_q_heads), tv(k, 64, m.num_kv_heads),
                              tv(v, 64, m.num_kv_heads), tv(out, 64, m.num_q_heads))
                      .ok());
    }
  }
  EXPECT_EQ(rts[0]->GetStats().ms_prime, 0.0);
  EXPECT_GT(rts[1]->GetStats().ms_prime, 0.0);
  const SequenceId seq = 9;
  ASSERT_TRUE(rts[0]->Decode({&seq, 1}, 0, tv(q, 1, m.num_q_heads), tv(k, 1, m.num_kv_heads),
                             tv(v, 1, m.num_kv_heads), tv(out, 1, m.num_q_heads))
                  .ok());
  EXPECT_GT(rts[0]->GetStats().ms_prime, 0.0);
}

// The PrHS wrappers forward the priming (prime_rows, OnPrefillPrimed): a wrapped LFPS primes once
// at the first decode like LFPS, and its device path equals its host loop.
TEST(LfpsPrimeRuntime, WrappedLfpsPrimesLikeLfps) {
  for (const char* name : {"cis+lfps", "psaw+lfps", "xl+lfps"}) {
    SCOPED_TRACE(name);
    RuntimeConfig c = PrimeConfig(Backend::kHost, DType::kBF16);
    c.policy.name = name;
    std::vector<std::unique_ptr<Runtime>> rts;
    rts.push_back(MakeRuntime(c, ""));
    rts.push_back(MakeRuntime(c, "device"));
    rts.push_back(MakeRuntime(c, "", "prime_eager"));
    for (const auto& rt : rts) ASSERT_TRUE(rt != nullptr);
    RunAndCompare(rts, {300, 21}, {0.0, 1e-5, 0.0}, {true, true, true});
  }
}

// On CUDA, LFPS primes on the GPU by default: its selections equal those of a CUDA runtime primed
// by the host loop (paths.prime = kHost), of one with the CUDA-core prefill
// (paths.cuda_prefill_paged), of the host backend and of one primed after every chunk; outputs within 1e-5 of the first
// and within the CUDA-vs-host decode tolerance (1e-4, tests/cuda_runtime_test.cpp) of the others.
TEST(LfpsPrimeRuntime, CudaGpuPrimedEqualsHostPrimed) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  for (const DType dt : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dt));
    std::vector<std::unique_ptr<Runtime>> rts;
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kCuda, dt), ""));
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kCuda, dt), "host"));
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kCuda, dt), "", "cuda_prefill_paged"));
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kHost, dt), ""));
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kCuda, dt), "", "prime_eager"));
    rts.push_back(MakeRuntime(PrimeConfig(Backend::kCuda, dt), "", "shadow_scan=host"));
    for (const auto& rt : rts) ASSERT_TRUE(rt != nullptr);
    // Chunks after the first read their history through the overlapped page copies (segments
    // from 2 pages of 256 tokens on); the deferred priming reads the host store over PCIe, the
    // eager one (the fifth runtime) after each chunk. The last scans on the host.
    RunAndCompare(rts, {512, 512, 512, 21}, {0.0, 1e-5, 1e-4, 1e-4, 0.0, 1e-5},
                  {true, true, true, true, true, true});
    // The CUDA runtimes rank the scan's keys on the GPU (gpu/shadow_scan.cu) unless told not to.
    EXPECT_GT(rts[0]->GetStats().scans_device, 0);
    EXPECT_EQ(rts[3]->GetStats().scans_device, 0);
    EXPECT_EQ(rts[5]->GetStats().scans_device, 0);
  }
}

// LFPS's scan on the device, on the host backend's copy of the path (paths.shadow_scan = kDevice:
// the policy's shadow copied at priming, each step's new row written by the "device", the keys
// ranked by cpu::ShadowScanRef, the host's Select taking the ranking): the same selections and
// outputs as the host's own scan, with either priming path. The window is shorter than the steps,
// so rows the device wrote get ranked too.
TEST(LfpsDeviceScanRuntime, HostDevicePathEqualsHostScan) {
  for (const char* prime : {"", "device"}) {
    SCOPED_TRACE(*prime == '\0' ? "host priming" : "device priming");
    RuntimeConfig c = PrimeConfig(Backend::kHost, DType::kBF16);
    c.tiers.window_tokens = 8;
    std::vector<std::unique_ptr<Runtime>> rts;
    rts.push_back(MakeRuntime(c, prime, "shadow_scan=device"));
    rts.push_back(MakeRuntime(c, prime));
    for (const auto& rt : rts) ASSERT_TRUE(rt != nullptr);
    RunAndCompare(rts, {512, 512, 512, 21}, {0.0, 0.0}, {true, true});
    EXPECT_GT(rts[0]->GetStats().scans_device, 0);
    EXPECT_EQ(rts[1]->GetStats().scans_device, 0);
  }
}

// The same with a batch of different lengths (one sequence 300 tokens longer) and a prompt
// continued after six decode steps (the device's copy of that sequence's shadow is dropped with
// the new chunk and made again at the next priming).
TEST(LfpsDeviceScanRuntime, MixedLengthsAndContinuedPromptsEqualHostScan) {
  RuntimeConfig c = PrimeConfig(Backend::kHost, DType::kBF16);
  c.tiers.window_tokens = 8;
  std::vector<std::unique_ptr<Runtime>> rts;
  rts.push_back(MakeRuntime(c, "device", "shadow_scan=device"));
  rts.push_back(MakeRuntime(c, "device"));
  for (const auto& rt : rts) ASSERT_TRUE(rt != nullptr);
  RunAndCompare(rts, {512, 512}, {0.0, 0.0}, {true, true}, /*skew=*/300, /*mid_chunk=*/40);
  EXPECT_GT(rts[0]->GetStats().scans_device, 0);
  EXPECT_EQ(rts[1]->GetStats().scans_device, 0);
}

// PrHS's wrappers around lfps run the planned CPU step (they keep every resident position, as
// lfps does) and take the device's ranking (they forward the scan's channels, picks and shadow,
// and pass their SelectContext to the inner Select): the same outputs and selections as the same
// wrapper scanning on the host, and as the unplanned host path (route gpu: the picks read by the
// device), and scans answered by the ranking.
TEST(LfpsDeviceScanRuntime, PrhsWrappersTakeTheDeviceRanking) {
  // Each wrapper made to act on these random queries and two layers: CIS shares on every step of
  // a block, PSAW hides most of layer 1's history, XL reuses layer 0's set in layer 1.
  const std::vector<std::pair<const char*, std::map<std::string, double>>> cases = {
      {"cis+lfps", {{"cis.tau", -1.0}}},
      {"psaw+lfps", {{"psaw.start", 0.0}, {"psaw.phi", 0.1}}},
      {"xl+lfps", {}}};
  for (const auto& [name, params] : cases) {
    SCOPED_TRACE(name);
    RuntimeConfig c = PrimeConfig(Backend::kHost, DType::kBF16);
    c.tiers.window_tokens = 8;
    c.policy.name = name;
    c.policy.params = params;
    std::vector<std::unique_ptr<Runtime>> rts;
    rts.push_back(MakeRuntime(c, "device", "shadow_scan=device"));
    rts.push_back(MakeRuntime(c, "device"));
    RuntimeConfig unplanned = c;
    unplanned.route = Route::kGpu;
    rts.push_back(MakeRuntime(unplanned, "device"));
    for (const auto& rt : rts) ASSERT_TRUE(rt != nullptr);
    RunAndCompare(rts, {512, 512, 21}, {0.0, 0.0, 2e-5}, {true, true, true});
    EXPECT_GT(rts[0]->GetStats().scans_device, 0);
    EXPECT_EQ(rts[0]->GetStats().scans_device_short, 0);
    EXPECT_EQ(rts[1]->GetStats().scans_device, 0);
    if (std::string_view(name) != "psaw+lfps") EXPECT_GT(rts[0]->GetStats().select_reused, 0);
  }
}

}  // namespace
}  // namespace kvferry
