// Copyright kvferry authors. Apache-2.0.
// The CUDA Device's kernels against the scalar reference (cpu/reference.h): sparse row attention
// (rows in device memory or read zero-copy from pinned host memory), causal paged attention
// (dense decode and prefill), the exact LSE merge and converting row copies. Fresh random inputs
// per case, outputs poisoned with NaN before every launch, odd sizes, GQA 1/3/4/8, head_dim
// 64/128/256, bf16/fp16. Skips where there is no GPU.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "gpu/device.h"

namespace kvferry {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define GPU_TEST_PRELUDE()                                                   \
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)"; \
  auto dev_r = MakeCudaDevice(0);                                            \
  ASSERT_TRUE(dev_r.ok()) << dev_r.status().ToString();                      \
  std::unique_ptr<Device> dev = std::move(dev_r).value()

// Device (or pinned host) buffer that frees itself.
struct Buf {
  Device* dev = nullptr;
  void* ptr = nullptr;
  bool host = false;
  size_t bytes = 0;
  Buf(Device* d, size_t n, bool on_host) : dev(d), host(on_host), bytes(n) {
    auto r = on_host ? d->AllocHost(std::max<size_t>(n, 16)) : d->AllocDevice(std::max<size_t>(n, 16));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    ptr = r.value();
  }
  ~Buf() { host ? dev->FreeHost(ptr) : dev->FreeDevice(ptr); }
  Buf(const Buf&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
  void Upload(const void* src, size_t n) {
    ASSERT_TRUE(dev->CopyAsync(ptr, src, n, nullptr).ok());
    ASSERT_TRUE(dev->SynchronizeStream(nullptr).ok());
  }
  template <typename T>
  std::vector<T> Download(size_t count) {
    std::vector<T> out(count);
    EXPECT_TRUE(dev->CopyAsync(out.data(), ptr, count * sizeof(T), nullptr).ok());
    EXPECT_TRUE(dev->SynchronizeStream(nullptr).ok());
    return out;
  }
  void Poison(size_t floats) {
    std::vector<float> nan(floats, kNaN);
    Upload(nan.data(), floats * sizeof(float));
  }
};

std::vector<uint16_t> RandomRows(std::mt19937& rng, int64_t rows, int head_dim, DType dtype) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> out(static_cast<size_t>(rows) * head_dim);
  for (auto& x : out) {
    const float f = nd(rng);
    x = dtype == DType::kBF16 ? cpu::F32ToBf16(f) : cpu::F32ToF16(f);
  }
  return out;
}

std::vector<float> RandomFloats(std::mt19937& rng, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> out(n);
  for (auto& x : out) x = nd(rng);
  return out;
}

// Compares and prints the first mismatches; also requires a non-zero reference norm when
// expect_nonzero.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double atol,
                 double rtol, const std::string& what, bool expect_nonzero = true) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  double norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = want[i], g = got[i];
    if (std::isfinite(w)) norm += w * w;
    const bool ok = (std::isinf(w) && g == w) ||
                    (std::isfinite(g) && std::abs(g - w) <= atol + rtol * std::abs(w));
    if (!ok && bad++ < 5) ADD_FAILURE() << what << "[" << i << "]: got " << g << " want " << w;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " mismatched";
  if (expect_nonzero) EXPECT_GT(norm, 0.0) << what << " reference is all zero";
}

std::string DTypeStr(DType d) { return d == DType::kBF16 ? "bf16" : "f16"; }

// ---- sparse row attention -------------------------------------------------------------------

using RowsParam = std::tuple<int /*head_dim*/, DType, int /*group*/, int /*count*/, bool /*host rows*/>;

class GpuAttendRowsTest : public ::testing::TestWithParam<RowsParam> {};

TEST_P(GpuAttendRowsTest, MatchesReference) {
  GPU_TEST_PRELUDE();
  const auto [head_dim, dtype, group, count, host_rows] = GetParam();
  std::mt19937 rng(1000 + head_dim * 7 + group * 131 + count + (host_rows ? 5 : 0) +
                   (dtype == DType::kF16 ? 3 : 0));
  // Three items: the count under test, a short list, and an empty one (o = 0, lse = -inf).
  const std::vector<int> counts = {count, 5, 0};
  const int num_items = static_cast<int>(counts.size());
  const int64_t pool = count + 64;  // rows to pick from, in scrambled order
  const size_t row_bytes = static_cast<size_t>(head_dim) * 2;
  auto k_host = RandomRows(rng, pool, head_dim, dtype);
  auto v_host = RandomRows(rng, pool, head_dim, dtype);
  Buf k_buf(dev.get(), pool * row_bytes, host_rows), v_buf(dev.get(), pool * row_bytes, host_rows);
  k_buf.Upload(k_host.data(), pool * row_bytes);
  v_buf.Upload(v_host.data(), pool * row_bytes);

  AttnParams p;
  p.group = group;
  p.head_dim = head_dim;
  p.kv_dtype = dtype;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  const size_t qo = static_cast<size_t>(group) * head_dim;
  auto q_host = RandomFloats(rng, qo * num_items);
  Buf q_buf(dev.get(), q_host.size() * 4, false), o_buf(dev.get(), q_host.size() * 4, false),
      lse_buf(dev.get(), static_cast<size_t>(group) * num_items * 4, false);
  q_buf.Upload(q_host.data(), q_host.size() * 4);
  o_buf.Poison(q_host.size());
  lse_buf.Poison(static_cast<size_t>(group) * num_items);

  // Row-address lists (device addresses) in device memory; reference lists in host addresses.
  std::vector<const void*> k_dev, v_dev, k_ref, v_ref;
  std::vector<RowAttnItem> items(num_items), ref_items(num_items);
  std::vector<size_t> offsets;
  for (int i = 0; i < num_items; ++i) {
    offsets.push_back(k_dev.size());
    std::vector<int64_t> perm(pool);
    for (int64_t j = 0; j < pool; ++j) perm[j] = j;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < counts[i]; ++j) {
      k_dev.push_back(k_buf.as<char>() + perm[j] * row_bytes);
      v_dev.push_back(v_buf.as<char>() + perm[j] * row_bytes);
      k_ref.push_back(reinterpret_cast<const char*>(k_host.data()) + perm[j] * row_bytes);
      v_ref.push_back(reinterpret_cast<const char*>(v_host.data()) + perm[j] * row_bytes);
    }
  }
  Buf k_list(dev.get(), std::max<size_t>(k_dev.size(), 1) * 8, false),
      v_list(dev.get(), std::max<size_t>(v_dev.size(), 1) * 8, false);
  if (!k_dev.empty()) {
    k_list.Upload(k_dev.data(), k_dev.size() * 8);
    v_list.Upload(v_dev.data(), v_dev.size() * 8);
  }
  std::vector<float> o_ref(q_host.size()), lse_ref(static_cast<size_t>(group) * num_items);
  for (int i = 0; i < num_items; ++i) {
    items[i].q = q_buf.as<float>() + i * qo;
    items[i].o = o_buf.as<float>() + i * qo;
    items[i].lse = lse_buf.as<float>() + i * group;
    items[i].k_rows = k_list.as<const void*>() + offsets[i];
    items[i].v_rows = v_list.as<const void*>() + offsets[i];
    items[i].count = counts[i];
    ref_items[i] = RowAttnItem{q_host.data() + i * qo, o_ref.data() + i * qo,
                               lse_ref.data() + i * group, k_ref.data() + offsets[i],
                               v_ref.data() + offsets[i], counts[i]};
    cpu::AttendRowsRef(p, ref_items[i]);
  }
  // Items in pinned mapped host memory (as the runtime's plan buffers are).
  Buf item_buf(dev.get(), sizeof(RowAttnItem) * num_items, true);
  std::memcpy(item_buf.ptr, items.data(), sizeof(RowAttnItem) * num_items);
  ASSERT_TRUE(dev->AttendRows(p, item_buf.as<RowAttnItem>(), num_items, nullptr).ok());
  auto o = o_buf.Download<float>(q_host.size());
  auto lse = lse_buf.Download<float>(lse_ref.size());
  ExpectClose(o, o_ref, 2e-5, 2e-4, "o", count > 0);
  ExpectClose(lse, lse_ref, 1e-4, 1e-5, "lse", false);
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, GpuAttendRowsTest,
    ::testing::Combine(::testing::Values(64, 128, 256), ::testing::Values(DType::kBF16, DType::kF16),
                       ::testing::Values(1, 3, 4, 8), ::testing::Values(1, 17, 97, 4099),
                       ::testing::Bool()),
    [](const auto& info) {
      return "d" + std::to_string(std::get<0>(info.param)) + "_" + DTypeStr(std::get<1>(info.param)) +
             "_g" + std::to_string(std::get<2>(info.param)) + "_n" +
             std::to_string(std::get<3>(info.param)) + (std::get<4>(info.param) ? "_host" : "_dev");
    });

// ---- causal paged attention -----------------------------------------------------------------

using PagedParam = std::tuple<int /*head_dim*/, DType, int /*group*/, int /*len*/, int /*num_q*/>;

class GpuAttendPagedTest : public ::testing::TestWithParam<PagedParam> {};

TEST_P(GpuAttendPagedTest, MatchesReference) {
  GPU_TEST_PRELUDE();
  const auto [head_dim, dtype, group, len, num_q] = GetParam();
  std::mt19937 rng(77 + head_dim + group * 11 + len * 3 + num_q + (dtype == DType::kF16 ? 1 : 0));
  const int page_tokens = 64;
  const int num_items = 2;  // two KV heads
  const int64_t n = static_cast<int64_t>(len) + num_q - 1;  // tokens stored (causal: last query sees all)
  const int pages = static_cast<int>((n + page_tokens - 1) / page_tokens);
  const size_t row_bytes = static_cast<size_t>(head_dim) * 2;
  const size_t page_bytes = 2 * page_tokens * row_bytes;
  AttnParams p;
  p.group = group;
  p.head_dim = head_dim;
  p.kv_dtype = dtype;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  std::vector<std::vector<uint16_t>> host_pages;
  std::vector<std::unique_ptr<Buf>> dev_pages;
  std::vector<void*> dev_ptrs, host_ptrs;
  for (int i = 0; i < num_items * pages; ++i) {
    host_pages.push_back(RandomRows(rng, 2 * page_tokens, head_dim, dtype));
    dev_pages.push_back(std::make_unique<Buf>(dev.get(), page_bytes, false));
    dev_pages.back()->Upload(host_pages.back().data(), page_bytes);
    dev_ptrs.push_back(dev_pages.back()->ptr);
    host_ptrs.push_back(host_pages.back().data());
  }
  Buf page_table(dev.get(), dev_ptrs.size() * 8, false);
  page_table.Upload(dev_ptrs.data(), dev_ptrs.size() * 8);

  const size_t qo = static_cast<size_t>(num_q) * group * head_dim;
  auto q_host = RandomFloats(rng, qo * num_items);
  Buf q_buf(dev.get(), q_host.size() * 4, false), o_buf(dev.get(), q_host.size() * 4, false),
      lse_buf(dev.get(), static_cast<size_t>(num_q) * group * num_items * 4, false);
  q_buf.Upload(q_host.data(), q_host.size() * 4);
  o_buf.Poison(q_host.size());
  lse_buf.Poison(static_cast<size_t>(num_q) * group * num_items);
  std::vector<float> o_ref(q_host.size()), lse_ref(static_cast<size_t>(num_q) * group * num_items);
  std::vector<PagedAttnItem> items(num_items);
  for (int i = 0; i < num_items; ++i) {
    const size_t lq = static_cast<size_t>(num_q) * group;
    items[i].q = q_buf.as<float>() + i * qo;
    items[i].o = o_buf.as<float>() + i * qo;
    items[i].lse = lse_buf.as<float>() + i * lq;
    items[i].kv = KvPages{page_table.as<void* const>() + i * pages, page_tokens};
    items[i].q_pos0 = len - 1;
    items[i].num_q = num_q;
    PagedAttnItem ref{q_host.data() + i * qo, o_ref.data() + i * qo, lse_ref.data() + i * lq,
                      KvPages{host_ptrs.data() + i * pages, page_tokens}, len - 1, num_q};
    cpu::AttendPagedRef(p, ref);
  }
  Buf item_buf(dev.get(), sizeof(PagedAttnItem) * num_items, false);
  item_buf.Upload(items.data(), sizeof(PagedAttnItem) * num_items);
  ASSERT_TRUE(dev->AttendPaged(p, item_buf.as<PagedAttnItem>(), num_items, nullptr).ok());
  ExpectClose(o_buf.Download<float>(q_host.size()), o_ref, 2e-5, 2e-4, "o");
  ExpectClose(lse_buf.Download<float>(lse_ref.size()), lse_ref, 1e-4, 1e-5, "lse", false);
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, GpuAttendPagedTest,
    ::testing::Combine(::testing::Values(64, 128, 256), ::testing::Values(DType::kBF16, DType::kF16),
                       ::testing::Values(1, 3, 4, 8), ::testing::Values(1, 17, 97, 4099),
                       ::testing::Values(1, 5)),
    [](const auto& info) {
      return "d" + std::to_string(std::get<0>(info.param)) + "_" + DTypeStr(std::get<1>(info.param)) +
             "_g" + std::to_string(std::get<2>(info.param)) + "_len" +
             std::to_string(std::get<3>(info.param)) + "_q" + std::to_string(std::get<4>(info.param));
    });

TEST(GpuAttendShape, RejectsHeadDim8AndGroupZero) {
  GPU_TEST_PRELUDE();
  AttnParams p;
  p.head_dim = 8;
  EXPECT_EQ(dev->AttendRows(p, nullptr, 0, nullptr).code(), StatusCode::kInvalidArgument);
  p.head_dim = 128;
  p.group = 0;
  EXPECT_EQ(dev->AttendPaged(p, nullptr, 0, nullptr).code(), StatusCode::kInvalidArgument);
}

// ---- merge and row copies -------------------------------------------------------------------

class GpuMergeLseTest : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(GpuMergeLseTest, MatchesReferenceIncludingEmptySides) {
  GPU_TEST_PRELUDE();
  const auto [rows, out_dtype] = GetParam();
  const int head_dim = 128;
  std::mt19937 rng(rows * 3 + static_cast<int>(out_dtype));
  auto oa = RandomFloats(rng, static_cast<size_t>(rows) * head_dim);
  auto ob = RandomFloats(rng, static_cast<size_t>(rows) * head_dim);
  auto la = RandomFloats(rng, rows, 3.0f), lb = RandomFloats(rng, rows, 3.0f);
  for (int r = 0; r < rows; r += 5) la[r] = kNegInf;
  for (int r = 2; r < rows; r += 7) lb[r] = kNegInf;
  Buf oa_b(dev.get(), oa.size() * 4, false), ob_b(dev.get(), ob.size() * 4, false),
      la_b(dev.get(), rows * 4, false), lb_b(dev.get(), rows * 4, false),
      out_b(dev.get(), oa.size() * 4, false);
  oa_b.Upload(oa.data(), oa.size() * 4);
  ob_b.Upload(ob.data(), ob.size() * 4);
  la_b.Upload(la.data(), rows * 4);
  lb_b.Upload(lb.data(), rows * 4);
  out_b.Poison(oa.size());
  ASSERT_TRUE(dev->MergeLse(oa_b.as<float>(), la_b.as<float>(), ob_b.as<float>(), lb_b.as<float>(),
                            rows, head_dim, out_b.ptr, out_dtype, nullptr)
                  .ok());
  cpu::MergeLseRef(oa.data(), la.data(), ob.data(), lb.data(), rows, head_dim);
  ExpectClose(oa_b.Download<float>(oa.size()), oa, 1e-5, 1e-5, "o_a");
  ExpectClose(la_b.Download<float>(rows), la, 1e-5, 1e-5, "lse_a", false);
  // Output conversion: compare after converting the reference the same way.
  const size_t es = DTypeSize(out_dtype);
  std::vector<uint8_t> raw(oa.size() * es);
  ASSERT_TRUE(dev->CopyAsync(raw.data(), out_b.ptr, raw.size(), nullptr).ok());
  ASSERT_TRUE(dev->SynchronizeStream(nullptr).ok());
  std::vector<float> got(oa.size()), want(oa.size());
  for (size_t i = 0; i < oa.size(); ++i) {
    got[i] = cpu::LoadAsF32(raw.data(), out_dtype, static_cast<int64_t>(i));
    want[i] = out_dtype == DType::kF32 ? oa[i]
              : out_dtype == DType::kBF16 ? cpu::Bf16ToF32(cpu::F32ToBf16(oa[i]))
                                          : cpu::F16ToF32(cpu::F32ToF16(oa[i]));
  }
  // One rounding step apart at most (the merge itself differs from the reference in fp32 ulps).
  ExpectClose(got, want, 1e-5, out_dtype == DType::kF32 ? 1e-5 : 8e-3, "out");
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuMergeLseTest,
                         ::testing::Combine(::testing::Values(1, 17, 97, 4099),
                                            ::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16)));

TEST(GpuCopyRows, ConvertsAndScattersRows) {
  GPU_TEST_PRELUDE();
  std::mt19937 rng(5);
  for (int elems : {1, 17, 64, 128, 4099}) {
    for (auto [src_t, dst_t] : {std::pair{DType::kF32, DType::kBF16}, {DType::kBF16, DType::kF32},
                                {DType::kF16, DType::kF16}, {DType::kBF16, DType::kBF16},
                                {DType::kF32, DType::kF16}}) {
      const int rows = 37;
      auto src = RandomFloats(rng, static_cast<size_t>(rows) * elems);
      std::vector<uint8_t> src_raw(src.size() * DTypeSize(src_t));
      for (size_t i = 0; i < src.size(); ++i) cpu::StoreFromF32(src_raw.data(), src_t, i, src[i]);
      Buf s(dev.get(), src_raw.size(), true);  // source rows in pinned host memory
      std::memcpy(s.ptr, src_raw.data(), src_raw.size());
      const size_t dst_row = static_cast<size_t>(elems) * DTypeSize(dst_t);
      Buf d(dev.get(), rows * dst_row, false);
      std::vector<uint8_t> nan(rows * dst_row, 0xff);
      d.Upload(nan.data(), nan.size());
      std::vector<RowCopy> rc(rows);
      for (int r = 0; r < rows; ++r) {  // reversed scatter
        rc[r].src = s.as<char>() + static_cast<size_t>(r) * elems * DTypeSize(src_t);
        rc[r].dst = d.as<char>() + static_cast<size_t>(rows - 1 - r) * dst_row;
      }
      Buf rc_buf(dev.get(), rows * sizeof(RowCopy), true);
      std::memcpy(rc_buf.ptr, rc.data(), rows * sizeof(RowCopy));
      ASSERT_TRUE(dev->CopyRows(rc_buf.as<RowCopy>(), rows, elems, src_t, dst_t, nullptr).ok());
      auto out = d.Download<uint8_t>(rows * dst_row);
      int bad = 0;
      for (int r = 0; r < rows; ++r) {
        for (int e = 0; e < elems; ++e) {
          std::vector<uint8_t> want(DTypeSize(dst_t));
          cpu::StoreFromF32(want.data(), dst_t, 0,
                            cpu::LoadAsF32(src_raw.data(), src_t, static_cast<int64_t>(r) * elems + e));
          bad += std::memcmp(want.data(),
                             out.data() + (rows - 1 - r) * dst_row + e * DTypeSize(dst_t),
                             DTypeSize(dst_t)) != 0;
        }
      }
      EXPECT_EQ(bad, 0) << "elems " << elems << " " << DTypeName(src_t) << "->" << DTypeName(dst_t);
    }
  }
}

TEST(GpuDevice, NameStreamsEventsAndHostMemoryIsMapped) {
  GPU_TEST_PRELUDE();
  EXPECT_EQ(dev->backend(), Backend::kCuda);
  EXPECT_NE(dev->name().find("cuda:0"), std::string::npos) << dev->name();
  auto s = dev->CreateStream();
  ASSERT_TRUE(s.ok());
  auto e = dev->CreateEvent();
  ASSERT_TRUE(e.ok());
  Buf h(dev.get(), 1 << 20, true), d(dev.get(), 1 << 20, false);
  std::memset(h.ptr, 0x5a, 1 << 20);
  ASSERT_TRUE(dev->CopyAsync(d.ptr, h.ptr, 1 << 20, s.value()).ok());
  ASSERT_TRUE(dev->RecordEvent(e.value(), s.value()).ok());
  ASSERT_TRUE(dev->WaitEvent(nullptr, e.value()).ok());
  auto back = d.Download<uint8_t>(1 << 20);
  EXPECT_EQ(back[12345], 0x5a);
  ASSERT_TRUE(dev->SynchronizeEvent(e.value()).ok());
  dev->DestroyEvent(e.value());
  dev->DestroyStream(s.value());
  auto huge = dev->AllocDevice(size_t{1} << 50);
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvferry
