// Copyright kvferry authors. Apache-2.0.
// The tensor-core prefill attention kernel (LaunchPrefillAttention) against a scalar reference
// (fp32 logits, fp64 softmax and P V) on fresh random inputs: odd query counts, a context longer
// than the queries (q_pos0 > 0), GQA 1/3/4/8, head_dim 64/128/256, bf16 and f16 inputs, f32 / bf16
// / f16 outputs. Every launch carries three items: two KV heads of one sequence inside engine-
// shaped tensors (q/o [T, 2 group, D], K/V [ctx, 2, D]: strided tokens and rows) and a shorter
// second sequence, so that items of different lengths share a grid. Outputs are poisoned with NaN
// before the launch, K/V rows past each context are NaN (the kernel must not read them), and the
// bytes after the outputs must stay untouched.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/dtype.h"
#include "gpu/cuda_kernels.h"
#include "gpu/device.h"

namespace kvferry {
namespace {

constexpr uint16_t kNaN16 = 0xffff;  // NaN in bf16 and in f16
constexpr int kGuardBytes = 256;     // poisoned bytes after each output that must stay untouched

float ToF32(uint16_t x, DType dtype) {
  return dtype == DType::kBF16 ? cpu::Bf16ToF32(x) : cpu::F16ToF32(x);
}
uint16_t FromF32(float x, DType dtype) {
  return dtype == DType::kBF16 ? cpu::F32ToBf16(x) : cpu::F32ToF16(x);
}

// One sequence: num_q queries at positions q_pos0.. over a context of q_pos0 + num_q positions,
// heads KV heads (items). q/o: [num_q, heads * group, hd]; K/V: [ctx + pad, heads, hd], the pad
// rows NaN. Host copies hold the 16-bit bits and their fp32 values.
struct Seq {
  int32_t num_q = 0;
  int64_t q_pos0 = 0;
  int heads = 1;
  int group = 1;
  int hd = 64;
  std::vector<uint16_t> q, k, v;
  std::vector<float> qf, kf, vf;

  int64_t ctx() const { return q_pos0 + num_q; }
  int64_t q_stride() const { return static_cast<int64_t>(heads) * group * hd; }
  int64_t kv_stride() const { return static_cast<int64_t>(heads) * hd; }
  size_t q_elems() const { return static_cast<size_t>(num_q) * q_stride(); }
  size_t kv_elems() const { return static_cast<size_t>(ctx() + 70) * kv_stride(); }
  size_t lse_elems() const { return static_cast<size_t>(heads) * num_q * group; }
};

void Fill(Seq& s, DType dtype, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  auto gen = [&](std::vector<uint16_t>& bits, std::vector<float>& vals, size_t n, size_t valid) {
    bits.resize(n);
    vals.resize(n);
    for (size_t i = 0; i < n; ++i) {
      bits[i] = i < valid ? FromF32(nd(rng), dtype) : kNaN16;
      vals[i] = ToF32(bits[i], dtype);
    }
  };
  gen(s.q, s.qf, s.q_elems(), s.q_elems());
  const size_t kv_valid = static_cast<size_t>(s.ctx()) * s.kv_stride();
  gen(s.k, s.kf, s.kv_elems(), kv_valid);
  gen(s.v, s.vf, s.kv_elems(), kv_valid);
}

// Reference o [num_q, heads * group, hd] and lse [heads][num_q * group] of one sequence.
void Reference(const Seq& s, float scale, std::vector<double>& o, std::vector<double>& lse) {
  o.assign(s.q_elems(), 0.0);
  lse.assign(s.lse_elems(), 0.0);
  std::vector<float> logits(static_cast<size_t>(s.ctx()));
  std::vector<double> acc(static_cast<size_t>(s.hd));
  for (int h = 0; h < s.heads; ++h) {
    for (int32_t t = 0; t < s.num_q; ++t) {
      for (int g = 0; g < s.group; ++g) {
        const size_t qo = static_cast<size_t>(t) * s.q_stride() + (h * s.group + g) * s.hd;
        const float* q = s.qf.data() + qo;
        const int64_t len = s.q_pos0 + t + 1;
        float m = -INFINITY;
        for (int64_t j = 0; j < len; ++j) {
          const float* k = s.kf.data() + j * s.kv_stride() + h * s.hd;
          float part[8] = {};
          for (int d = 0; d < s.hd; d += 8) {
            for (int u = 0; u < 8; ++u) part[u] += q[d + u] * k[d + u];
          }
          float dot = 0.f;
          for (float x : part) dot += x;
          logits[j] = dot * scale;
          m = std::max(m, logits[j]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = 0.0;
        for (int64_t j = 0; j < len; ++j) {
          const double w = std::exp(static_cast<double>(logits[j]) - m);
          sum += w;
          const float* v = s.vf.data() + j * s.kv_stride() + h * s.hd;
          for (int d = 0; d < s.hd; ++d) acc[d] += w * v[d];
        }
        for (int d = 0; d < s.hd; ++d) o[qo + d] = acc[d] / sum;
        lse[static_cast<size_t>(h) * s.num_q * s.group + static_cast<size_t>(t) * s.group + g] =
            m + std::log(sum);
      }
    }
  }
}

// Device buffers of one sequence.
struct DevSeq {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  size_t o_bytes = 0, lse_bytes = 0;
  ~DevSeq() {
    for (void* p : {q, k, v, o, static_cast<void*>(lse)}) cudaFree(p);
  }
};

double OutValue(const std::vector<unsigned char>& raw, size_t i, DType dtype) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, raw.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, raw.data() + 2 * i, 2);
  return ToF32(h, dtype);
}

// (num_q, q_pos0, group, head_dim)
using PrefillCase = std::tuple<int32_t, int64_t, int, int>;

class GpuPrefillTest : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(GpuPrefillTest, MatchesScalarReference) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  const auto [num_q, q_pos0, group, hd] = GetParam();
  for (DType kv_dtype : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(std::string("kv ") + DTypeName(kv_dtype));
    std::mt19937 rng(static_cast<uint32_t>(num_q * 7919 + q_pos0 * 31 + group * 7 + hd +
                                           (kv_dtype == DType::kF16 ? 100003 : 0)));
    // Sequence A: two KV heads in engine-shaped tensors; sequence B: one head, shorter.
    Seq seqs[2];
    seqs[0].num_q = num_q;
    seqs[0].q_pos0 = q_pos0;
    seqs[0].heads = 2;
    seqs[1].num_q = num_q / 3 + 1;
    seqs[1].q_pos0 = q_pos0 / 2 + 5;
    seqs[1].heads = 1;
    AttnParams p;
    p.group = group;
    p.head_dim = hd;
    p.kv_dtype = kv_dtype;
    p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    std::vector<double> ref_o[2], ref_lse[2];
    DevSeq dev[2];
    for (int i = 0; i < 2; ++i) {
      Seq& s = seqs[i];
      s.group = group;
      s.hd = hd;
      Fill(s, kv_dtype, rng);
      Reference(s, p.scale, ref_o[i], ref_lse[i]);
      DevSeq& d = dev[i];
      ASSERT_EQ(cudaMalloc(&d.q, s.q.size() * 2), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d.k, s.k.size() * 2), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d.v, s.v.size() * 2), cudaSuccess);
      d.o_bytes = s.q_elems() * 4 + kGuardBytes;  // room for f32 outputs
      d.lse_bytes = s.lse_elems() * 4 + kGuardBytes;
      ASSERT_EQ(cudaMalloc(&d.o, d.o_bytes), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d.lse, d.lse_bytes), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d.q, s.q.data(), s.q.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d.k, s.k.data(), s.k.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d.v, s.v.data(), s.v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    }
    std::vector<cuda::PrefillAttnItem> items;
    for (int i = 0; i < 2; ++i) {
      const Seq& s = seqs[i];
      for (int h = 0; h < s.heads; ++h) {
        cuda::PrefillAttnItem it;
        it.q = static_cast<const uint16_t*>(dev[i].q) + h * group * hd;
        it.q_stride_tok = s.q_stride();
        it.lse = dev[i].lse + static_cast<size_t>(h) * s.num_q * group;
        it.k = static_cast<const uint16_t*>(dev[i].k) + h * hd;
        it.v = static_cast<const uint16_t*>(dev[i].v) + h * hd;
        it.kv_stride = s.kv_stride();
        it.q_pos0 = s.q_pos0;
        it.num_q = s.num_q;
        items.push_back(it);
      }
    }
    cuda::PrefillAttnItem* d_items = nullptr;
    ASSERT_EQ(cudaMalloc(&d_items, items.size() * sizeof(items[0])), cudaSuccess);

    for (DType out_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(std::string("out ") + DTypeName(out_dtype));
      const size_t out_elem = DTypeSize(out_dtype);
      size_t idx = 0;
      for (int i = 0; i < 2; ++i) {
        ASSERT_EQ(cudaMemset(dev[i].o, 0xff, dev[i].o_bytes), cudaSuccess);
        ASSERT_EQ(cudaMemset(dev[i].lse, 0xff, dev[i].lse_bytes), cudaSuccess);
        for (int h = 0; h < seqs[i].heads; ++h, ++idx) {
          items[idx].o =
              static_cast<char*>(dev[i].o) + static_cast<size_t>(h) * group * hd * out_elem;
        }
      }
      ASSERT_EQ(cudaMemcpy(d_items, items.data(), items.size() * sizeof(items[0]),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      const Status st = cuda::LaunchPrefillAttention(
          p, kv_dtype, out_dtype, d_items, static_cast<int64_t>(items.size()),
          std::max(seqs[0].num_q, seqs[1].num_q), nullptr);
      ASSERT_TRUE(st.ok()) << st.ToString();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

      // Tolerances: P is rounded to the input dtype before P V (bf16: 2^-9 relative, f16: 2^-12),
      // and a 16-bit output adds its own rounding.
      const double atol = kv_dtype == DType::kBF16 ? 4e-3 : 1e-3;
      const double rtol = (kv_dtype == DType::kBF16 || out_dtype == DType::kBF16) ? 2e-2 : 4e-3;
      for (int i = 0; i < 2; ++i) {
        const Seq& s = seqs[i];
        SCOPED_TRACE("sequence " + std::to_string(i));
        std::vector<unsigned char> o_raw(dev[i].o_bytes);
        std::vector<float> lse(dev[i].lse_bytes / 4);
        ASSERT_EQ(cudaMemcpy(o_raw.data(), dev[i].o, o_raw.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(lse.data(), dev[i].lse, dev[i].lse_bytes, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        int bad = 0;
        double norm2 = 0.0;
        for (size_t e = 0; e < s.q_elems(); ++e) {
          const double got = OutValue(o_raw, e, out_dtype);
          const double want = ref_o[i][e];
          norm2 += got * got;
          if (!(std::abs(got - want) <= atol + rtol * std::abs(want)) && bad++ < 5) {
            const size_t tok = e / s.q_stride(), rem = e % s.q_stride();
            ADD_FAILURE() << "o token " << tok << " head " << rem / hd << " dim " << rem % hd
                          << ": got " << got << " want " << want;
          }
        }
        EXPECT_EQ(bad, 0) << bad << " mismatches in o";
        EXPECT_GT(norm2, 0.0) << "all-zero output";
        int bad_lse = 0;
        for (size_t e = 0; e < s.lse_elems(); ++e) {
          const double want = ref_lse[i][e];
          if (!(std::abs(lse[e] - want) <= 2e-3 + 1e-4 * std::abs(want)) && bad_lse++ < 5) {
            ADD_FAILURE() << "lse row " << e << ": got " << lse[e] << " want " << want;
          }
        }
        EXPECT_EQ(bad_lse, 0) << bad_lse << " mismatches in lse";
        // Nothing past the outputs was written.
        const size_t o_used = s.q_elems() * out_elem;
        for (size_t b = o_used; b < o_raw.size(); ++b) {
          if (o_raw[b] != 0xff) {
            ADD_FAILURE() << "o written past its end at byte " << b - o_used;
            break;
          }
        }
        for (size_t e = s.lse_elems(); e < lse.size(); ++e) {
          uint32_t bits;
          std::memcpy(&bits, &lse[e], 4);
          if (bits != 0xffffffffu) {
            ADD_FAILURE() << "lse written past its end at " << e - s.lse_elems();
            break;
          }
        }
      }
    }
    cudaFree(d_items);
  }
}

std::string CaseName(const ::testing::TestParamInfo<PrefillCase>& info) {
  const auto [num_q, q_pos0, group, hd] = info.param;
  char name[64];
  std::snprintf(name, sizeof(name), "q%d_pos%lld_g%d_d%d", num_q, static_cast<long long>(q_pos0),
                group, hd);
  return name;
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuPrefillTest,
                         ::testing::Combine(::testing::Values(1, 17, 97, 300, 1100),
                                            ::testing::Values<int64_t>(0, 257),
                                            ::testing::Values(1, 3, 4, 8),
                                            ::testing::Values(64, 128)),
                         CaseName);

// head_dim 256 (4 warps, Q fragments from shared memory) on fewer shapes.
INSTANTIATE_TEST_SUITE_P(GpuD256, GpuPrefillTest,
                         ::testing::Combine(::testing::Values(17, 300),
                                            ::testing::Values<int64_t>(0, 257),
                                            ::testing::Values(1, 4), ::testing::Values(256)),
                         CaseName);

// The split the CUDA runtime makes of a chunk whose history is copied while it is attended: K/V
// in the host store's page layout (kv_page_shift), the chunk's own causal block from the page that
// holds q_pos0, then every earlier segment of whole pages (kv_limit) merged exactly into it in the
// kernel's epilogue (o_in / lse_in, in place in f32), the last launch writing the output dtype and
// the merged lse. Equals the scalar reference of the whole causal attention. Segments are single
// pages and then two-page runs, so that a few launches merge into each output.
// (num_q, q_pos0, group, head_dim, page_tokens)
using SplitCase = std::tuple<int32_t, int64_t, int, int, int>;

class GpuPrefillSplitTest : public ::testing::TestWithParam<SplitCase> {};

TEST_P(GpuPrefillSplitTest, PagedSegmentsMergeToTheWholeAttention) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  const auto [num_q, q_pos0, group, hd, pt] = GetParam();
  int page_shift = 0;
  while ((1 << page_shift) < pt) ++page_shift;
  for (DType kv_dtype : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(std::string("kv ") + DTypeName(kv_dtype));
    std::mt19937 rng(static_cast<uint32_t>(num_q * 131 + q_pos0 * 17 + group * 5 + hd + pt +
                                           (kv_dtype == DType::kF16 ? 7777 : 0)));
    Seq s;
    s.num_q = num_q;
    s.q_pos0 = q_pos0;
    s.heads = 2;
    s.group = group;
    s.hd = hd;
    Fill(s, kv_dtype, rng);
    AttnParams p;
    p.group = group;
    p.head_dim = hd;
    p.kv_dtype = kv_dtype;
    p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    std::vector<double> ref_o, ref_lse;
    Reference(s, p.scale, ref_o, ref_lse);

    // Paged K/V per head: pages [K rows pt][V rows pt]; rows past the context NaN.
    const int64_t num_pages = (s.ctx() + pt - 1) / pt;
    const size_t head_elems = static_cast<size_t>(num_pages) * 2 * pt * hd;
    std::vector<uint16_t> paged(head_elems * s.heads, kNaN16);
    for (int h = 0; h < s.heads; ++h) {
      for (int64_t pos = 0; pos < s.ctx(); ++pos) {
        for (int which = 0; which < 2; ++which) {
          const std::vector<uint16_t>& src = which == 0 ? s.k : s.v;
          const size_t dst = h * head_elems + ((pos / pt) * 2 * pt + which * pt + pos % pt) * hd;
          std::copy_n(src.begin() + pos * s.kv_stride() + h * hd, hd, paged.begin() + dst);
        }
      }
    }
    // Launch 0: own block from page q_pos0 / pt; then segments [0, 1), [1, 2), [2, 4), [4, 6)...
    const int64_t history_pages = q_pos0 / pt;
    std::vector<int64_t> seg = {0};
    while (seg.back() < history_pages) {
      seg.push_back(std::min(history_pages, seg.back() + (seg.size() <= 2 ? 1 : 2)));
    }
    const int launches = static_cast<int>(seg.size());  // own block + seg.size() - 1 segments
    void *d_q = nullptr, *d_kv = nullptr, *d_o = nullptr;
    float *d_acc = nullptr, *d_lse = nullptr;
    cuda::PrefillAttnItem* d_items = nullptr;
    ASSERT_EQ(cudaMalloc(&d_q, s.q.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_kv, paged.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_o, s.q_elems() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_acc, s.q_elems() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_lse, s.lse_elems() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_items, launches * s.heads * sizeof(cuda::PrefillAttnItem)),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_q, s.q.data(), s.q.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_kv, paged.data(), paged.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(d_acc, 0xff, s.q_elems() * 4), cudaSuccess);  // NaN until written
    ASSERT_EQ(cudaMemset(d_lse, 0xff, s.lse_elems() * 4), cudaSuccess);

    for (DType out_dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::string("out ") + DTypeName(out_dtype));
      ASSERT_EQ(cudaMemset(d_o, 0xff, s.q_elems() * 4), cudaSuccess);
      std::vector<cuda::PrefillAttnItem> items(static_cast<size_t>(launches * s.heads));
      for (int l = 0; l < launches; ++l) {
        const bool last = l == launches - 1;
        const int64_t page0 = l == 0 ? history_pages : seg[l - 1];
        for (int h = 0; h < s.heads; ++h) {
          cuda::PrefillAttnItem& it = items[static_cast<size_t>(l * s.heads + h)];
          it.q = static_cast<const uint16_t*>(d_q) + h * group * hd;
          it.q_stride_tok = s.q_stride();
          const size_t o_off = static_cast<size_t>(h) * group * hd;
          it.o = last ? static_cast<void*>(static_cast<char*>(d_o) + o_off * DTypeSize(out_dtype))
                      : static_cast<void*>(d_acc + o_off);
          it.lse = d_lse + static_cast<size_t>(h) * s.num_q * group;
          const uint16_t* base =
              static_cast<const uint16_t*>(d_kv) + h * head_elems + page0 * 2 * pt * hd;
          it.k = base;
          it.v = base + static_cast<size_t>(pt) * hd;
          it.kv_stride = hd;
          it.kv_page_shift = page_shift;
          it.num_q = num_q;
          if (l == 0) {
            it.q_pos0 = q_pos0 - history_pages * pt;
          } else {
            it.kv_limit = (seg[l] - seg[l - 1]) * pt;
            it.q_pos0 = it.kv_limit - 1;
            it.o_in = d_acc + o_off;
            it.lse_in = it.lse;
          }
        }
      }
      ASSERT_EQ(cudaMemcpy(d_items, items.data(), items.size() * sizeof(items[0]),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      for (int l = 0; l < launches; ++l) {
        const DType launch_out = l == launches - 1 ? out_dtype : DType::kF32;
        const Status st = cuda::LaunchPrefillAttention(
            p, kv_dtype, launch_out, d_items + l * s.heads, s.heads, num_q, nullptr);
        ASSERT_TRUE(st.ok()) << st.ToString();
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<unsigned char> o_raw(s.q_elems() * 4);
      std::vector<float> lse(s.lse_elems());
      ASSERT_EQ(cudaMemcpy(o_raw.data(), d_o, o_raw.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      const double atol = kv_dtype == DType::kBF16 ? 4e-3 : 1e-3;
      const double rtol = (kv_dtype == DType::kBF16 || out_dtype == DType::kBF16) ? 2e-2 : 4e-3;
      int bad = 0;
      double norm2 = 0.0;
      for (size_t e = 0; e < s.q_elems(); ++e) {
        const double got = OutValue(o_raw, e, out_dtype);
        const double want = ref_o[e];
        norm2 += got * got;
        if (!(std::abs(got - want) <= atol + rtol * std::abs(want)) && bad++ < 5) {
          const size_t tok = e / s.q_stride(), rem = e % s.q_stride();
          ADD_FAILURE() << "o token " << tok << " head " << rem / hd << " dim " << rem % hd
                        << ": got " << got << " want " << want;
        }
      }
      EXPECT_EQ(bad, 0) << bad << " mismatches in o over " << launches << " launches";
      EXPECT_GT(norm2, 0.0) << "all-zero output";
      int bad_lse = 0;
      for (size_t e = 0; e < s.lse_elems(); ++e) {
        if (!(std::abs(lse[e] - ref_lse[e]) <= 2e-3 + 1e-4 * std::abs(ref_lse[e])) &&
            bad_lse++ < 5) {
          ADD_FAILURE() << "lse row " << e << ": got " << lse[e] << " want " << ref_lse[e];
        }
      }
      EXPECT_EQ(bad_lse, 0) << bad_lse << " mismatches in the merged lse";
    }
    for (void* ptr : {d_q, d_kv, d_o, static_cast<void*>(d_acc), static_cast<void*>(d_lse),
                      static_cast<void*>(d_items)}) {
      cudaFree(ptr);
    }
  }
}

std::string SplitName(const ::testing::TestParamInfo<SplitCase>& info) {
  const auto [num_q, q_pos0, group, hd, pt] = info.param;
  char name[80];
  std::snprintf(name, sizeof(name), "q%d_pos%lld_g%d_d%d_page%d", num_q,
                static_cast<long long>(q_pos0), group, hd, pt);
  return name;
}

// q_pos0 on and off page boundaries (0: no segment, the own block alone, paged), pages of 32
// (one K/V tile) and 256 (the runtime's) positions.
INSTANTIATE_TEST_SUITE_P(Gpu, GpuPrefillSplitTest,
                         ::testing::Combine(::testing::Values(17, 300),
                                            ::testing::Values<int64_t>(0, 512, 1100),
                                            ::testing::Values(1, 4, 8), ::testing::Values(64, 128),
                                            ::testing::Values(32, 256)),
                         SplitName);
INSTANTIATE_TEST_SUITE_P(GpuD256, GpuPrefillSplitTest,
                         ::testing::Combine(::testing::Values(97), ::testing::Values<int64_t>(700),
                                            ::testing::Values(1, 4), ::testing::Values(256),
                                            ::testing::Values(64)),
                         SplitName);

// The runtime's segment plan: contiguous, covering, first about half the chunk's own block in
// pages (2 at least), growing by half, 32 pages at most, no short tail, at most
// kPrefillMaxSegments. Host-only: runs without a GPU.
TEST(GpuPrefillPlan, SegmentsCoverTheHistoryInGrowingRuns) {
  int64_t begin[kPrefillMaxSegments + 1];
  EXPECT_EQ(cuda::PlanPrefillSegments(0, 2048, 256, begin), 0);
  // 2K-token chunks at 32K context: the last chunk's 120 pages.
  ASSERT_EQ(cuda::PlanPrefillSegments(120, 2048, 256, begin), 7);
  const int64_t want[] = {0, 4, 10, 19, 33, 54, 86, 120};
  for (int j = 0; j <= 7; ++j) EXPECT_EQ(begin[j], want[j]) << j;
  EXPECT_EQ(cuda::PlanPrefillSegments(3, 300, 256, begin), 1);  // a tail of 1 joins the first
  EXPECT_EQ(begin[1], 3);
  for (int64_t pages : {1, 2, 5, 17, 97, 128, 4099}) {
    for (int64_t chunk : {1, 17, 1000, 2048, 8192, 65536}) {
      const int n = cuda::PlanPrefillSegments(pages, chunk, 256, begin);
      ASSERT_GE(n, 1);
      ASSERT_LE(n, kPrefillMaxSegments);
      EXPECT_EQ(begin[0], 0);
      EXPECT_EQ(begin[n], pages);
      for (int j = 0; j < n; ++j) {
        EXPECT_LT(begin[j], begin[j + 1])
            << pages << " pages, chunk " << chunk << ", segment " << j;
        if (j + 1 < n) EXPECT_LE(begin[j + 1] - begin[j], cuda::kPrefillSegmentMaxPages);
      }
    }
  }
}

// Copies of whole pages: one per run of pages consecutive in the host store and in the staging.
TEST(GpuPrefillPlan, PageCopiesJoinConsecutivePages) {
  constexpr int64_t kPageBytes = 1024, kMaxPages = 6, kStagingPages = 8;
  std::vector<char> host(20 * kPageBytes), staging(2 * kStagingPages * kPageBytes);
  auto page = [&](int i) { return static_cast<void*>(host.data() + i * kPageBytes); };
  // Head 0: pages 0-2 consecutive, 3 elsewhere, 4 right after 3; head 1: descending.
  void* table[2 * kMaxPages] = {page(0), page(1), page(2), page(10), page(11), nullptr,
                                page(9), page(8), page(7), page(6),  page(5),  nullptr};
  void* dst[10];
  const void* src[10];
  size_t bytes[10];
  const int64_t n = cuda::ListPageCopies(table, kMaxPages, 2, 1, 5, staging.data(), kStagingPages,
                                         kPageBytes, dst, src, bytes);
  ASSERT_EQ(n, 2 + 4);
  EXPECT_EQ(src[0], page(1));
  EXPECT_EQ(bytes[0], 2u * kPageBytes);  // pages 1-2
  EXPECT_EQ(dst[0], staging.data() + 1 * kPageBytes);
  EXPECT_EQ(src[1], page(10));
  EXPECT_EQ(bytes[1], 2u * kPageBytes);  // pages 3-4
  EXPECT_EQ(dst[1], staging.data() + 3 * kPageBytes);
  for (int i = 0; i < 4; ++i) {  // head 1: one copy a page
    EXPECT_EQ(src[2 + i], page(8 - i));
    EXPECT_EQ(bytes[2 + i], static_cast<size_t>(kPageBytes));
    EXPECT_EQ(dst[2 + i], staging.data() + (kStagingPages + 1 + i) * kPageBytes);
  }
}

// Argument checks answer before any CUDA call, so they run without a GPU too.
TEST(GpuPrefillArgs, RejectsUnsupportedShapes) {
  AttnParams p;
  p.group = 4;
  p.head_dim = 96;
  p.kv_dtype = DType::kBF16;
  p.scale = 0.1f;
  cuda::PrefillAttnItem* items = nullptr;
  EXPECT_EQ(cuda::LaunchPrefillAttention(p, DType::kBF16, DType::kF32, items, 1, 4, nullptr).code(),
            StatusCode::kInvalidArgument);
  p.head_dim = 128;
  EXPECT_EQ(cuda::LaunchPrefillAttention(p, DType::kF16, DType::kF32, items, 1, 4, nullptr).code(),
            StatusCode::kInvalidArgument);
  p.kv_dtype = DType::kF32;
  EXPECT_EQ(cuda::LaunchPrefillAttention(p, DType::kF32, DType::kF32, items, 1, 4, nullptr).code(),
            StatusCode::kInvalidArgument);
  p.kv_dtype = DType::kBF16;
  EXPECT_EQ(cuda::LaunchPrefillAttention(p, DType::kBF16, DType::kF32, items, 1, 4, nullptr).code(),
            StatusCode::kInvalidArgument);  // null items
  EXPECT_TRUE(
      cuda::LaunchPrefillAttention(p, DType::kBF16, DType::kF32, items, 0, 4, nullptr).ok());
  EXPECT_TRUE(
      cuda::LaunchPrefillAttention(p, DType::kBF16, DType::kF32, items, 3, 0, nullptr).ok());
}

}  // namespace
}  // namespace kvferry
