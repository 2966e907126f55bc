// Copyright kvferry authors. Apache-2.0.
#include "bench/lib/metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvferry::bench {

StepAccuracy MeasureStep(const float* q, int group, int d, float scale, const float* k,
                         const float* v, int64_t row_stride, int64_t n,
                         const std::vector<int32_t>& selected, int64_t budget, const float* out) {
  std::vector<double> mass(static_cast<size_t>(n), 0.0), p(static_cast<size_t>(n));
  double mass_sel = 0, err_num = 0, err_den = 0;
  for (int g = 0; g < group; ++g) {
    const float* qg = q + static_cast<int64_t>(g) * d;
    double m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float* kr = k + j * row_stride;
      double dot = 0;
      for (int e = 0; e < d; ++e) dot += static_cast<double>(qg[e]) * kr[e];
      p[j] = dot * scale;
      m = std::max(m, p[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - m));
    std::vector<double> o(static_cast<size_t>(d), 0.0);
    for (int64_t j = 0; j < n; ++j) {
      p[j] /= sum;
      mass[j] += p[j];
      const float* vr = v + j * row_stride;
      for (int e = 0; e < d; ++e) o[e] += p[j] * vr[e];
    }
    for (int32_t s : selected) mass_sel += p[s];
    for (int e = 0; e < d; ++e) {
      const double diff = out[static_cast<int64_t>(g) * d + e] - o[e];
      err_num += diff * diff;
      err_den += o[e] * o[e];
    }
  }
  const int64_t kk = std::min(budget, n);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + kk, idx.end(), [&](int32_t a, int32_t b) {
    return mass[a] != mass[b] ? mass[a] > mass[b] : a < b;
  });
  std::vector<char> in_top(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < kk; ++i) in_top[idx[i]] = 1;
  int64_t hits = 0;
  for (int32_t s : selected) hits += in_top[s];
  StepAccuracy acc;
  acc.recall = kk > 0 ? static_cast<double>(hits) / static_cast<double>(kk) : 1.0;
  acc.mass_recall = mass_sel / group;
  acc.rel_err = err_den > 0 ? std::sqrt(err_num / err_den) : 0.0;
  return acc;
}

}  // namespace kvferry::bench
