// Copyright kvferry authors. Apache-2.0.
// The baseline kernel table: the scalar reference kernels behind the CpuKernels interface, plus
// the table lookup by ISA.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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
                          const int32_t* positions, int32_t count, float* logits) {
  thread_local std::vector<const void*> k_rows;
  GatherRows(p, kv, positions, count, k_rows, nullptr);
  ScoreRowsRef(p, q, k_rows.data(), count, logits);
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

}  // namespace

int g_gather_prefetch_rows = 16;
int g_gather_prefetch_hint = 0;

const CpuKernels& ScalarKernels() {
  static const CpuKernels kernels{CpuIsa::kScalar,       "scalar",
                                  &AttendRowsScalar,     &AttendPositionsScalar,
                                  &ScorePositionsScalar, &ScoreRangeScalar,
                                  &FilterGreaterScalar,  &SoftmaxAccumulateScalar,
                                  &FilterGreaterBlockedScalar};
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
