// Copyright kvferry authors. Apache-2.0.
// The baseline kernel table: the scalar reference kernels behind the CpuKernels interface, plus
// the table lookup by ISA.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/kernels.h"
#include "cpu/reference.h"

namespace kvferry::cpu {
namespace {

void GatherRows(const AttnParams& p, const KvPages& kv, const int32_t* positions, int32_t count,
                std::vector<const void*>& k_rows, std::vector<const void*>* v_rows) {
  const size_t elem = DTypeSize(p.kv_dtype);
  k_rows.resize(static_cast<size_t>(count));
  if (v_rows != nullptr) v_rows->resize(static_cast<size_t>(count));
  for (int32_t j = 0; j < count; ++j) {
    k_rows[j] = PagedKRow(kv, positions[j], p.head_dim, elem);
    if (v_rows != nullptr) (*v_rows)[j] = PagedVRow(kv, positions[j], p.head_dim, elem);
  }
}

void AttendRowsScalar(const AttnParams& p, const RowAttnItem& item) { AttendRowsRef(p, item); }

void AttendPositionsScalar(const AttnParams& p, const PositionAttnItem& item) {
  thread_local std::vector<const void*> k_rows, v_rows;
  GatherRows(p, item.kv, item.positions, item.count, k_rows, &v_rows);
  RowAttnItem rows;
  rows.q = item.q;
  rows.o = item.o;
  rows.lse = item.lse;
  rows.k_rows = k_rows.data();
  rows.v_rows = v_rows.data();
  rows.count = item.count;
  AttendRowsRef(p, rows);
}

void ScorePositionsScalar(const AttnParams& p, const float* q, const KvPages& kv,
                          const int32_t* positions, int32_t count, float* logits, int64_t ld) {
  thread_local std::vector<const void*> k_rows;
  GatherRows(p, kv, positions, count, k_rows, nullptr);
  if (ld == count) {
    ScoreRowsRef(p, q, k_rows.data(), count, logits);
    return;
  }
  thread_local std::vector<float> dense;
  dense.resize(static_cast<size_t>(p.group) * count);
  ScoreRowsRef(p, q, k_rows.data(), count, dense.data());
  for (int g = 0; g < p.group; ++g) {
    std::copy_n(dense.data() + static_cast<int64_t>(g) * count, count, logits + g * ld);
  }
}

void ScoreRangeScalar(const AttnParams& p, const float* q, const KvPages& kv, int64_t begin,
                      int64_t end, float* logits, int64_t ld) {
  const size_t elem = DTypeSize(p.kv_dtype);
  for (int64_t j = begin; j < end; ++j) {
    const void* row = PagedKRow(kv, j, p.head_dim, elem);
    float tmp[1];
    for (int g = 0; g < p.group; ++g) {
      AttnParams one = p;
      one.group = 1;
      ScoreRowsRef(one, q + static_cast<int64_t>(g) * p.head_dim, &row, 1, tmp);
      logits[g * ld + (j - begin)] = tmp[0];
    }
  }
}

int64_t FilterGreaterScalar(const float* x, int64_t n, float thr, int32_t base, int32_t* out) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] > thr) out[c++] = base + static_cast<int32_t>(i);
  }
  return c;
}

// The reference: one block at a time, a block read only when its bound passes.
int64_t FilterGreaterBlockedScalar(const float* x, float* bound, int64_t lo, int64_t hi, float thr,
                                   int32_t* out) {
  int64_t c = 0;
  for (int64_t b = lo / kFilterBlock; b * kFilterBlock < hi; ++b) {
    if (!(bound[b] > thr)) continue;
    const int64_t b0 = b * kFilterBlock, b1 = b0 + kFilterBlock;
    const int64_t s = std::max(lo, b0), e = std::min(hi, b1);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = s; i < e; ++i) {
      if (x[i] > thr) out[c++] = static_cast<int32_t>(i);
      if (x[i] > mx) mx = x[i];
    }
    if (s == b0 && e == b1) bound[b] = mx;
  }
  return c;
}

void SoftmaxAccumulateScalar(const float* x, int64_t n, float weight, float* acc) {
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - m);
  const float w = static_cast<float>(weight / sum);
  for (int64_t i = 0; i < n; ++i) acc[i] += w * std::exp(x[i] - m);
}

// The reference of the prefill softmax step: std::exp per element, the rounded weight read back
// for the sum.
void PrefillSoftmaxScalar(const PrefillSoftmaxArgs& a) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const size_t elem = DTypeSize(a.p_dtype);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* s = a.s + r * a.ld_s;
    char* pl = static_cast<char*>(a.p) + static_cast<size_t>(r * a.ld_p) * elem;
    const int64_t allowed = std::clamp<int64_t>(a.allowed[r], 0, a.cols);
    float mx = kNegInf;
    for (int64_t j = 0; j < allowed; ++j) mx = std::max(mx, s[j] * a.scale);
    const float new_max = std::max(a.row_max[r], mx);
    if (allowed == 0 || new_max == kNegInf) {
      std::memset(pl, 0, static_cast<size_t>(a.cols) * elem);
      continue;
    }
    if (a.row_max[r] != new_max && a.row_max[r] != kNegInf) {
      const float corr = std::exp(a.row_max[r] - new_max);
      a.row_sum[r] *= corr;
      float* o = a.o + r * a.ld_o;
      for (int d = 0; d < a.head_dim; ++d) o[d] *= corr;
    }
    a.row_max[r] = new_max;
    double sum = 0.0;
    for (int64_t j = 0; j < allowed; ++j) {
      StoreFromF32(pl, a.p_dtype, j, std::exp(s[j] * a.scale - new_max));
      sum += LoadAsF32(pl, a.p_dtype, j);
    }
    std::memset(pl + static_cast<size_t>(allowed) * elem, 0,
                static_cast<size_t>(a.cols - allowed) * elem);
    a.row_sum[r] += sum;
  }
}

void ConvertScalar(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n) {
  ConvertSpan(dst, dst_dtype, src, src_dtype, n);
}

// The reference scan: channel by channel over chunks of tokens (the loops vectorise at the
// baseline ISA), modulo 2^32 (equal to the exact sum whenever that fits int32, which the caller
// guarantees).
void ScanInt8Scalar(const ScanInt8Args& a) {
  constexpr int64_t kChunk = 256;
  for (int g = 0; g < a.group; ++g) a.head_max[g] = std::numeric_limits<int32_t>::min();
  uint32_t acc[kChunk];
  for (int64_t j0 = a.begin; j0 < a.end; j0 += kChunk) {
    const int64_t cnt = std::min(kChunk, a.end - j0);
    for (int g = 0; g < a.group; ++g) {
      std::fill_n(acc, cnt, 0u);
      for (int c = 0; c < a.r; ++c) {
        const uint32_t w = static_cast<uint32_t>(a.w[g * a.r + c]);
        const int8_t* k = a.rows[c] + j0;
        for (int64_t j = 0; j < cnt; ++j) acc[j] += w * static_cast<uint32_t>(k[j]);
      }
      int32_t* dst = a.acc + g * a.ld + j0;
      int32_t mx = a.head_max[g];
      for (int64_t j = 0; j < cnt; ++j) {
        dst[j] = static_cast<int32_t>(acc[j]);
        mx = std::max(mx, dst[j]);
      }
      a.head_max[g] = mx;
    }
  }
}

int64_t ScanCollectScalar(const ScanCollectArgs& a) {
  int64_t c = 0;
  for (int64_t j = a.begin; j < a.end; ++j) {
    int32_t s = a.acc[j] - a.mx[0];
    for (int g = 1; g < a.group; ++g) s = std::max(s, a.acc[g * a.ld + j] - a.mx[g]);
    const uint32_t key = ScanKey(s);
    if (key >= a.thr) {
      a.idx[c] = static_cast<int32_t>(j);
      a.key[c++] = key;
    }
  }
  return c;
}

}  // namespace

int g_gather_prefetch_rows = 16;
int g_gather_prefetch_hint = 0;

const CpuKernels& ScalarKernels() {
  static const CpuKernels kernels{CpuIsa::kScalar,       "scalar",
                                  &AttendRowsScalar,     &AttendPositionsScalar,
                                  &ScorePositionsScalar, &ScoreRangeScalar,
                                  &FilterGreaterScalar,  &SoftmaxAccumulateScalar,
                                  &FilterGreaterBlockedScalar,
                                  &PrefillSoftmaxScalar,
                                  &ConvertScalar,
                                  &ScanInt8Scalar,
                                  &ScanCollectScalar};
  return kernels;
}

const CpuKernels* GetCpuKernels(CpuIsa isa) {
  if (!CpuSupports(isa)) return nullptr;
  switch (isa) {
    case CpuIsa::kScalar: return &ScalarKernels();
    case CpuIsa::kAvx2: return &Avx2Kernels();
    case CpuIsa::kAvx512F: return &Avx512Kernels();
    case CpuIsa::kAvx512Bf16: return &Avx512Bf16Kernels();
  }
  return nullptr;
}

const CpuKernels& BestCpuKernels() {
  static const CpuKernels* const best = GetCpuKernels(BestCpuIsa());
  return *best;
}

}  // namespace kvferry::cpu
