// Copyright kvferry authors. Apache-2.0.
#include "cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/kernels.h"

namespace kvferry::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float DotRow(const float* q, const void* row, DType dtype, int head_dim) {
  float acc = 0.0f;
  for (int d = 0; d < head_dim; ++d) acc += q[d] * LoadAsF32(row, dtype, d);
  return acc;
}

// Two-pass softmax over logits of one query, then o = sum p_j v_j.
void SoftmaxAccumulate(const float* logits, int64_t count, const void* const* v_rows,
                       const AttnParams& p, float* o, float* lse) {
  if (count == 0) {
    std::fill(o, o + p.head_dim, 0.0f);
    *lse = kNegInf;
    return;
  }
  float m = kNegInf;
  for (int64_t j = 0; j < count; ++j) m = std::max(m, logits[j]);
  double sum = 0.0;
  std::vector<double> acc(static_cast<size_t>(p.head_dim), 0.0);
  for (int64_t j = 0; j < count; ++j) {
    double w = std::exp(static_cast<double>(logits[j]) - m);
    sum += w;
    for (int d = 0; d < p.head_dim; ++d) acc[d] += w * LoadAsF32(v_rows[j], p.kv_dtype, d);
  }
  for (int d = 0; d < p.head_dim; ++d) o[d] = static_cast<float>(acc[d] / sum);
  *lse = static_cast<float>(m + std::log(sum));
}

}  // namespace

void ScoreRowsRef(const AttnParams& p, const float* q, const void* const* k_rows, int32_t count,
                  float* logits) {
  for (int g = 0; g < p.group; ++g) {
    for (int32_t j = 0; j < count; ++j) {
      logits[static_cast<int64_t>(g) * count + j] =
          p.scale * DotRow(q + static_cast<int64_t>(g) * p.head_dim, k_rows[j], p.kv_dtype, p.head_dim);
    }
  }
}

void AttendRowsRef(const AttnParams& p, const RowAttnItem& item) {
  std::vector<float> logits(static_cast<size_t>(item.count) * p.group);
  ScoreRowsRef(p, item.q, item.k_rows, item.count, logits.data());
  for (int g = 0; g < p.group; ++g) {
    SoftmaxAccumulate(logits.data() + static_cast<int64_t>(g) * item.count, item.count,
                      item.v_rows, p, item.o + static_cast<int64_t>(g) * p.head_dim, item.lse + g);
  }
}

void AttendPagedRef(const AttnParams& p, const PagedAttnItem& item) {
  const size_t elem = DTypeSize(p.kv_dtype);
  const int64_t n = item.q_pos0 + item.num_q;
  std::vector<const void*> k_rows(static_cast<size_t>(n)), v_rows(static_cast<size_t>(n));
  for (int64_t pos = 0; pos < n; ++pos) {
    k_rows[pos] = PagedKRow(item.kv, pos, p.head_dim, elem);
    v_rows[pos] = PagedVRow(item.kv, pos, p.head_dim, elem);
  }
  std::vector<float> logits(static_cast<size_t>(n));
  for (int32_t t = 0; t < item.num_q; ++t) {
    const int64_t len = item.q_pos0 + t + 1;
    for (int g = 0; g < p.group; ++g) {
      const int64_t row = static_cast<int64_t>(t) * p.group + g;
      const float* q = item.q + row * p.head_dim;
      for (int64_t j = 0; j < len; ++j) logits[j] = p.scale * DotRow(q, k_rows[j], p.kv_dtype, p.head_dim);
      SoftmaxAccumulate(logits.data(), len, v_rows.data(), p, item.o + row * p.head_dim,
                        item.lse + row);
    }
  }
}

void MergeLseRef(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows,
                 int head_dim) {
  for (int64_t r = 0; r < rows; ++r) {
    const float la = lse_a[r], lb = lse_b[r];
    if (lb == kNegInf) continue;
    if (la == kNegInf) {
      std::copy(o_b + r * head_dim, o_b + (r + 1) * head_dim, o_a + r * head_dim);
      lse_a[r] = lb;
      continue;
    }
    const float m = std::max(la, lb);
    const double wa = std::exp(static_cast<double>(la) - m);
    const double wb = std::exp(static_cast<double>(lb) - m);
    const double inv = 1.0 / (wa + wb);
    for (int d = 0; d < head_dim; ++d) {
      float* dst = o_a + r * head_dim + d;
      *dst = static_cast<float>((wa * *dst + wb * o_b[r * head_dim + d]) * inv);
    }
    lse_a[r] = static_cast<float>(m + std::log(wa + wb));
  }
}

void TopKRef(const float* scores, int64_t n, int64_t k, int32_t* out_indices) {
  k = std::clamp<int64_t>(k, 0, n);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto key = [&](int32_t i) {
    return std::isnan(scores[i]) ? -std::numeric_limits<float>::infinity() : scores[i];
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    const float sa = key(a), sb = key(b);
    if (sa != sb) return sa > sb;
    return a < b;
  });
  std::copy(idx.begin(), idx.begin() + k, out_indices);
}

void ShadowScanWeights(const float* q, const float* scale, int group, int head_dim, int r,
                     float* imp, int32_t* ch, int32_t* w) {
  const int hd = head_dim;
  for (int c = 0; c < hd; ++c) {
    float s = 0.0f;
    for (int g = 0; g < group; ++g) s += std::fabs(q[g * hd + c]);
    imp[c] = s * scale[c];
  }
  std::iota(ch, ch + hd, 0);
  std::partial_sort(ch, ch + r, ch + hd, [imp](int32_t x, int32_t y) {
    return imp[x] > imp[y] || (imp[x] == imp[y] && x < y);
  });
  float wmax = 0.0f;
  for (int c = 0; c < r; ++c) {
    for (int g = 0; g < group; ++g) wmax = std::max(wmax, std::fabs(q[g * hd + ch[c]] * scale[ch[c]]));
  }
  const float wscale = wmax > 0.0f && std::isfinite(wmax) ? 16384.0f / wmax : 0.0f;
  for (int c = 0; c < r; ++c) {
    for (int g = 0; g < group; ++g) {
      const float v = q[g * hd + ch[c]] * scale[ch[c]] * wscale;
      w[g * r + c] = static_cast<int32_t>(std::lrint(v == v ? v : 0.0f));
    }
  }
}

void ShadowScanRef(const ShadowScanArgs& a) {
  const int hd = a.head_dim, group = a.group;
  if (a.item_host != nullptr && a.item_host != a.item) {
    std::copy_n(a.item_host, a.items, a.item);
  }
  for (int64_t it = 0; it < a.items; ++it) {
    const ShadowScanItem& item = a.item[it];
    int8_t* shadow = a.shadow + item.shadow;
    const float* scale = a.scale + item.scale;
    if (item.new_pos >= 0) {  // 1. the new row, quantised as the host's shadow rows are
      for (int c = 0; c < hd; ++c) {
        float x = LoadAsF32(a.k, a.k_dtype, it * hd + c);
        if (a.kv_dtype == DType::kBF16) x = Bf16ToF32(F32ToBf16(x));
        if (a.kv_dtype == DType::kF16) x = F16ToF32(F32ToF16(x));
        float v = x * (127.0f / scale[c]);
        v = v == v ? v : 0.0f;
        v = std::min(std::max(v, -127.0f), 127.0f);
        shadow[c * a.cap + item.new_pos] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(v)));
      }
    }
    if (item.len <= 0 || item.picks <= 0) {
      a.counts[it] = 0;
      continue;
    }
    // 2. channels and integer weights.
    std::vector<float> q(static_cast<size_t>(group * hd)), imp(static_cast<size_t>(hd));
    for (int64_t i = 0; i < group * hd; ++i) q[i] = LoadAsF32(a.q, a.q_dtype, it * group * hd + i);
    const int r = std::min(a.channels, hd);
    std::vector<int32_t> ch(static_cast<size_t>(hd)), w(static_cast<size_t>(group * r));
    ShadowScanWeights(q.data(), scale, group, hd, r, imp.data(), ch.data(), w.data());
    // 3. logits, maxima, scores.
    const int64_t len = item.len;
    std::vector<int32_t> acc(static_cast<size_t>(group * len), 0);
    std::vector<int32_t> mx(static_cast<size_t>(group), std::numeric_limits<int32_t>::min());
    for (int g = 0; g < group; ++g) {
      for (int64_t j = 0; j < len; ++j) {
        int32_t s = 0;
        for (int c = 0; c < r; ++c) s += w[g * r + c] * shadow[ch[c] * a.cap + item.off_lo + j];
        acc[g * len + j] = s;
        mx[g] = std::max(mx[g], s);
      }
    }
    std::vector<uint32_t> key(static_cast<size_t>(len));
    for (int64_t j = 0; j < len; ++j) {
      int32_t s = acc[j] - mx[0];
      for (int g = 1; g < group; ++g) s = std::max(s, acc[g * len + j] - mx[g]);
      key[j] = ScanKey(s);
    }
    // 4. every key at or above the 16-bit bin of the picks-th largest, ascending j.
    const int64_t picks = std::min(item.picks, len);
    std::vector<uint32_t> sorted = key;
    std::nth_element(sorted.begin(), sorted.begin() + (picks - 1), sorted.end(), std::greater<uint32_t>());
    const uint32_t thr = sorted[picks - 1] & 0xffff0000u;
    int64_t count = 0;
    for (int64_t j = 0; j < len; ++j) count += key[j] >= thr;
    a.counts[it] = count <= a.max_picks ? static_cast<int32_t>(count) : -1;
    if (count > a.max_picks) continue;
    uint64_t* out = a.out + it * a.max_picks;
    for (int64_t j = 0; j < len; ++j) {
      if (key[j] >= thr) *out++ = (static_cast<uint64_t>(key[j]) << 32) | static_cast<uint32_t>(j);
    }
  }
}

void PrimeAttentionRef(const PrimeArgs& a) {
  const AttnParams& p = a.params;
  const int hd = p.head_dim, group = p.group;
  const size_t elem = DTypeSize(p.kv_dtype);
  const int64_t len = a.n - a.sink;
  std::vector<float> logits(static_cast<size_t>(std::max<int64_t>(len, 0)));
  for (int h = 0; h < a.num_kv_heads; ++h) {
    const KvPages kv{a.store.pages + h * a.store.max_pages, a.store.page_tokens};
    float* ver = a.tables + h * a.table_stride;
    float* sla = ver + a.n;
    std::fill(ver, ver + 2 * a.n, 0.0f);
    double* k_sum = a.stats + h * PrimeStatsCount(hd, group);
    double* v_sum = k_sum + hd;
    double* l_sum = v_sum + hd;
    double* l_sq = l_sum + group;
    double* q_sq = l_sq + group;
    std::fill(k_sum, k_sum + PrimeStatsCount(hd, group), 0.0);
    for (int64_t i = a.sink; i < a.n; ++i) {
      const void* k = PagedKRow(kv, i, hd, elem);
      const void* v = PagedVRow(kv, i, hd, elem);
      for (int d = 0; d < hd; ++d) {
        k_sum[d] += LoadAsF32(k, p.kv_dtype, d);
        v_sum[d] += LoadAsF32(v, p.kv_dtype, d);
      }
    }
    const float* q_head = a.q + h * a.q_head_stride;
    for (int32_t r = 0; r < a.rows; ++r) {
      const int64_t t = a.t_first + r;
      const bool last = r == a.rows - 1;
      const int64_t visible = std::max<int64_t>(0, std::min(a.off_hi, t + 1) - a.sink);
      const int64_t scored = last ? len : visible;  // the last row also feeds the logit spread
      for (int g = 0; g < group; ++g) {
        const float* q = q_head + (static_cast<int64_t>(r) * group + g) * hd;
        for (int64_t j = 0; j < scored; ++j) {
          logits[j] = p.scale * DotRow(q, PagedKRow(kv, a.sink + j, hd, elem), p.kv_dtype, hd);
        }
        if (visible > 0) {
          float m = kNegInf;
          for (int64_t j = 0; j < visible; ++j) m = std::max(m, logits[j]);
          double sum = 0.0;
          for (int64_t j = 0; j < visible; ++j) sum += std::exp(logits[j] - m);
          const float inv = static_cast<float>(1.0 / sum);
          for (int64_t j = 0; j < visible; ++j) {
            const float w = std::exp(logits[j] - m) * inv;
            ver[a.sink + j] += w;
            sla[t - (a.sink + j)] += w;
          }
        }
        if (last) {
          double s = 0.0, sq = 0.0, qq = 0.0;
          for (int64_t j = 0; j < len; ++j) s += logits[j];
          const double mean = len > 0 ? s / static_cast<double>(len) : 0.0;
          for (int64_t j = 0; j < len; ++j) sq += (logits[j] - mean) * (logits[j] - mean);
          for (int d = 0; d < hd; ++d) qq += static_cast<double>(q[d]) * q[d];
          l_sum[g] = s;
          l_sq[g] = sq;
          q_sq[g] = qq;
        }
      }
    }
  }
}

}  // namespace kvferry::cpu
