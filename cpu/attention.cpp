// Copyright kvferry authors. Apache-2.0.
// Run-time dispatch of the CPU attention entry points, the exact top-k, and the dense paged
// attention through oneDNN matmul.
#include "cpu/attention.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/kernels.h"
#include "cpu/reference.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace kvferry::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

const CpuKernels& KernelsFor(const AttnParams& p) {
  return SimdShapeOk(p) ? BestCpuKernels() : ScalarKernels();
}

}  // namespace

void AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items) {
  const CpuKernels& k = KernelsFor(p);
  for (int64_t i = 0; i < num_items; ++i) k.attend_rows(p, items[i]);
}

void AttendPositions(const AttnParams& p, const PositionAttnItem* items, int64_t num_items) {
  const CpuKernels& k = KernelsFor(p);
  for (int64_t i = 0; i < num_items; ++i) k.attend_positions(p, items[i]);
}

void ScorePositions(const AttnParams& p, const float* q, const KvPages& kv,
                    const int32_t* positions, int32_t count, float* logits) {
  KernelsFor(p).score_positions(p, q, kv, positions, count, logits);
}

void ScoreRange(const AttnParams& p, const float* q, const KvPages& kv, int64_t begin,
                int64_t end, float* logits, int64_t ld) {
  KernelsFor(p).score_range(p, q, kv, begin, end, logits, ld);
}

void ScorePaged(const AttnParams& p, const float* q, const KvPages& kv, int64_t n, float* logits) {
  ScoreRange(p, q, kv, 0, n, logits, n);
}

int64_t FilterGreater(const float* x, int64_t n, float thr, int32_t base, int32_t* out) {
  return BestCpuKernels().filter_greater(x, n, thr, base, out);
}

int64_t FilterGreaterBlocked(const float* x, float* bound, int64_t lo, int64_t hi, float thr,
                             int32_t* out) {
  return BestCpuKernels().filter_greater_blocked(x, bound, lo, hi, thr, out);
}

const char* AttendRowsImplName() { return BestCpuKernels().name; }

void SoftmaxAccumulate(const float* x, int64_t n, float weight, float* acc) {
  if (n <= 0) return;
  BestCpuKernels().softmax_accumulate(x, n, weight, acc);
}

void SetGatherPrefetch(int rows, int hint) {
  g_gather_prefetch_rows = std::clamp(rows, 0, 256);
  g_gather_prefetch_hint = hint != 0 ? 1 : 0;
}

// ---- exact top-k ---------------------------------------------------------------------------------
// One streaming pass: a vectorised filter keeps only scores above the running k-th best (strictly
// above: an equal score seen later has a higher index and loses the tie), candidates collect in a
// buffer of 2k that is cut back to the best k with nth_element whenever it fills. For the oracle
// (k ~ 2% of n) almost every block of scores is rejected by one compare. Inputs where fewer than k
// scores are above -inf (NaN, -inf) take the reference path, which defines their order.
void TopK(const float* scores, int64_t n, int64_t k, int32_t* out_indices) {
  k = std::clamp<int64_t>(k, 0, n);
  if (k == 0) return;
  if (n < 1024 || k * 4 > n) {
    TopKRef(scores, n, k, out_indices);
    return;
  }
  constexpr int64_t kChunk = 2048;
  thread_local std::vector<int32_t> cand;
  cand.resize(static_cast<size_t>(2 * k + kChunk));
  auto better = [scores](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  const auto filter = BestCpuKernels().filter_greater;
  int64_t size = 0;
  float thr = kNegInf;
  for (int64_t off = 0; off < n; off += kChunk) {
    const int64_t len = std::min(kChunk, n - off);
    size += filter(scores + off, len, thr, static_cast<int32_t>(off), cand.data() + size);
    if (size >= 2 * k) {
      std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.begin() + size, better);
      size = k;
      thr = scores[cand[k - 1]];
    }
  }
  if (size < k) {
    TopKRef(scores, n, k, out_indices);
    return;
  }
  std::partial_sort(cand.begin(), cand.begin() + k, cand.begin() + size, better);
  std::copy(cand.begin(), cand.begin() + k, out_indices);
}

// ---- dense attention through oneDNN --------------------------------------------------------------
void LimitOneDnnThreadsOnThisThread() {
  // Debian's oneDNN is built on OpenMP; each calling thread would otherwise start a team of
  // omp_get_max_threads() threads inside a TBB worker. The symbol comes from the OpenMP runtime
  // oneDNN pulls in, looked up at run time so kvferry does not link OpenMP itself.
  using SetFn = void (*)(int);
  static const SetFn set_threads =
      reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  thread_local bool done = false;
  if (!done && set_threads != nullptr) set_threads(1);
  done = true;
}

namespace {

using dnnl::memory;

dnnl::engine& DnnlEngine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::data_type DnnlType(DType t) {
  switch (t) {
    case DType::kF32: return memory::data_type::f32;
    case DType::kF16: return memory::data_type::f16;
    case DType::kBF16: return memory::data_type::bf16;
  }
  return memory::data_type::undef;
}

// One cached matmul. kind 0: S[M,N] = Q[M,D] K^T (K rows of a page, [N,D] row-major).
// kind 1: O[M,D] += P[M,N] V ([N,D] row-major), accumulated through a sum post-op.
struct CachedMatmul {
  bool ok = false;
  std::string impl;
  dnnl::matmul prim;
  memory a, b, c;
};

CachedMatmul& GetMatmul(int kind, int64_t m, int64_t n, int64_t d, DType dtype) {
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int>;
  thread_local std::map<Key, CachedMatmul> cache;
  const Key key{kind, m, n, d, static_cast<int>(dtype)};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  // Decode over a growing last page needs one primitive per fill level; bound the cache.
  if (cache.size() > 2048) cache.clear();
  CachedMatmul& cm = cache[key];
  const memory::data_type lowp = DnnlType(dtype);
  try {
    dnnl::primitive_attr attr;
    memory::desc a_md, b_md, c_md;
    if (kind == 0) {
      a_md = memory::desc({m, d}, lowp, memory::dims{d, 1});
      b_md = memory::desc({d, n}, lowp, memory::dims{1, d});  // K^T: element (k, j) at j*d + k
      c_md = memory::desc({m, n}, memory::data_type::f32, memory::dims{n, 1});
    } else {
      a_md = memory::desc({m, n}, lowp, memory::dims{n, 1});
      b_md = memory::desc({n, d}, lowp, memory::dims{d, 1});
      c_md = memory::desc({m, d}, memory::data_type::f32, memory::dims{d, 1});
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    const dnnl::matmul::desc desc(a_md, b_md, c_md);
    const dnnl::matmul::primitive_desc pd(desc, attr, DnnlEngine());
    cm.impl = pd.impl_info_str();
    cm.prim = dnnl::matmul(pd);
    cm.a = memory(a_md, DnnlEngine(), DNNL_MEMORY_NONE);
    cm.b = memory(b_md, DnnlEngine(), DNNL_MEMORY_NONE);
    cm.c = memory(c_md, DnnlEngine(), DNNL_MEMORY_NONE);
    cm.ok = true;
  } catch (const dnnl::error& e) {
    cm.ok = false;
    cm.impl = "unavailable";
  }
  return cm;
}

void RunMatmul(CachedMatmul& cm, const void* a, const void* b, float* c) {
  thread_local dnnl::stream stream(DnnlEngine());
  cm.a.set_data_handle(const_cast<void*>(a));
  cm.b.set_data_handle(const_cast<void*>(b));
  cm.c.set_data_handle(c);
  cm.prim.execute(stream, {{DNNL_ARG_SRC, cm.a}, {DNNL_ARG_WEIGHTS, cm.b}, {DNNL_ARG_DST, cm.c}});
  stream.wait();
}

// Flash-attention-style loop over pages: S = Q K_page^T (oneDNN), causal mask, online softmax in
// fp32, O += P V_page (oneDNN, P rounded to the KV dtype). Rows are (query t, head g), t-major.
bool AttendPagedOneDnn(const AttnParams& p, const PagedAttnItem& item) {
  LimitOneDnnThreadsOnThisThread();
  const int64_t hd = p.head_dim;
  const int64_t m = static_cast<int64_t>(item.num_q) * p.group;
  const int64_t n = item.q_pos0 + item.num_q;
  const int64_t pt = item.kv.page_tokens;
  const size_t elem = DTypeSize(p.kv_dtype);
  // Probe the full-page primitives first so an unsupported dtype fails before any write.
  if (!GetMatmul(0, m, std::min(pt, n), hd, p.kv_dtype).ok ||
      !GetMatmul(1, m, std::min(pt, n), hd, p.kv_dtype).ok) {
    return false;
  }
  // q and P in the KV dtype (f32 KV is accepted too: it exercises this path on CPUs where oneDNN
  // has no bf16/f16 matmul).
  thread_local std::vector<char> q_low, p_low;
  thread_local std::vector<float> s_buf, o_acc, row_max;
  thread_local std::vector<double> row_sum;
  q_low.resize(static_cast<size_t>(m * hd) * elem);
  ConvertSpan(q_low.data(), p.kv_dtype, item.q, DType::kF32, m * hd);
  s_buf.resize(static_cast<size_t>(m * pt));
  p_low.resize(static_cast<size_t>(m * pt) * elem);
  o_acc.assign(static_cast<size_t>(m * hd), 0.0f);
  row_max.assign(static_cast<size_t>(m), kNegInf);
  row_sum.assign(static_cast<size_t>(m), 0.0);
  for (int64_t base = 0; base < n; base += pt) {
    const int64_t valid = std::min(pt, n - base);
    CachedMatmul& qk = GetMatmul(0, m, valid, hd, p.kv_dtype);
    CachedMatmul& pv = GetMatmul(1, m, valid, hd, p.kv_dtype);
    if (!qk.ok || !pv.ok) return false;  // cannot happen after the probe unless memory ran out
    const char* page = static_cast<const char*>(item.kv.pages[base / pt]);
    RunMatmul(qk, q_low.data(), page, s_buf.data());
    for (int64_t r = 0; r < m; ++r) {
      const int64_t t = r / p.group;
      const int64_t allowed = std::min(valid, item.q_pos0 + t - base + 1);
      float* s = s_buf.data() + r * valid;
      char* pl = p_low.data() + static_cast<size_t>(r * valid) * elem;
      if (allowed <= 0) {
        std::memset(pl, 0, static_cast<size_t>(valid) * elem);
        continue;
      }
      float mx = kNegInf;
      for (int64_t j = 0; j < allowed; ++j) mx = std::max(mx, s[j] * p.scale);
      const float new_max = std::max(row_max[r], mx);
      if (new_max == kNegInf) {
        std::memset(pl, 0, static_cast<size_t>(valid) * elem);
        continue;
      }
      if (row_max[r] != new_max && row_max[r] != kNegInf) {
        const float corr = std::exp(row_max[r] - new_max);
        row_sum[r] *= corr;
        for (int64_t d = 0; d < hd; ++d) o_acc[r * hd + d] *= corr;
      }
      row_max[r] = new_max;
      double sum = 0.0;
      for (int64_t j = 0; j < allowed; ++j) {
        // Sum the rounded weights: they are what multiplies V.
        StoreFromF32(pl, p.kv_dtype, j, std::exp(s[j] * p.scale - new_max));
        sum += LoadAsF32(pl, p.kv_dtype, j);
      }
      std::memset(pl + static_cast<size_t>(allowed) * elem, 0,
                  static_cast<size_t>(valid - allowed) * elem);
      row_sum[r] += sum;
    }
    RunMatmul(pv, p_low.data(), page + static_cast<size_t>(pt) * hd * elem, o_acc.data());
  }
  for (int64_t r = 0; r < m; ++r) {
    if (row_sum[r] > 0.0) {
      const double inv = 1.0 / row_sum[r];
      for (int64_t d = 0; d < hd; ++d) item.o[r * hd + d] = static_cast<float>(o_acc[r * hd + d] * inv);
      item.lse[r] = row_max[r] + static_cast<float>(std::log(row_sum[r]));
    } else {
      std::fill(item.o + r * hd, item.o + (r + 1) * hd, 0.0f);
      item.lse[r] = kNegInf;
    }
  }
  return true;
}

// The SIMD route: one position-list attention per query (positions [0, q_pos0 + t]).
void AttendPagedSimd(const AttnParams& p, const PagedAttnItem& item) {
  const CpuKernels& k = KernelsFor(p);
  thread_local std::vector<int32_t> iota;
  const int64_t n = item.q_pos0 + item.num_q;
  if (static_cast<int64_t>(iota.size()) < n) {
    const size_t old = iota.size();
    iota.resize(static_cast<size_t>(n));
    std::iota(iota.begin() + static_cast<int64_t>(old), iota.end(), static_cast<int32_t>(old));
  }
  for (int32_t t = 0; t < item.num_q; ++t) {
    const int64_t row = static_cast<int64_t>(t) * p.group;
    PositionAttnItem pi;
    pi.q = item.q + row * p.head_dim;
    pi.o = item.o + row * p.head_dim;
    pi.lse = item.lse + row;
    pi.kv = item.kv;
    pi.positions = iota.data();
    pi.count = static_cast<int32_t>(item.q_pos0 + t + 1);
    k.attend_positions(p, pi);
  }
}

}  // namespace

bool AttendPagedWith(DenseImpl impl, const AttnParams& p, const PagedAttnItem& item) {
  switch (impl) {
    case DenseImpl::kOneDnn:
      return AttendPagedOneDnn(p, item);
    case DenseImpl::kSimd:
      AttendPagedSimd(p, item);
      return true;
    case DenseImpl::kAuto:
      if (AttendPagedOneDnn(p, item)) return true;
      AttendPagedSimd(p, item);
      return true;
  }
  return false;
}

void AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items) {
  // Decode-sized work keeps fp32 q and weights (the CPU route must equal dense attention to fp32
  // rounding); prefill-sized chunks go through oneDNN, whose matmuls round q and P to the KV dtype
  // like a GPU flash-attention kernel does.
  constexpr int64_t kMinOneDnnRows = 32;
  for (int64_t i = 0; i < num_items; ++i) {
    const bool big = static_cast<int64_t>(items[i].num_q) * p.group >= kMinOneDnnRows;
    AttendPagedWith(big ? DenseImpl::kAuto : DenseImpl::kSimd, p, items[i]);
  }
}

const char* OneDnnMatmulImplName(const AttnParams& p) {
  thread_local std::string name;
  const CachedMatmul& cm = GetMatmul(0, p.group, 256, p.head_dim, p.kv_dtype);
  name = cm.ok ? cm.impl : "unavailable";
  return name.c_str();
}

}  // namespace kvferry::cpu
