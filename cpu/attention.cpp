// Copyright kvferry authors. Apache-2.0.
// Run-time dispatch of the CPU attention entry points, the exact top-k, and the dense paged
// attention through oneDNN matmul.
#include "cpu/attention.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
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
  KernelsFor(p).score_positions(p, q, kv, positions, count, logits, count);
}

void ScorePositions(const AttnParams& p, const float* q, const KvPages& kv,
                    const int32_t* positions, int32_t count, float* logits, int64_t ld) {
  KernelsFor(p).score_positions(p, q, kv, positions, count, logits, ld);
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

// The dtype the prefill matmuls run in for \p kv_dtype: the KV dtype where oneDNN has a native
// low-precision kernel for it (AMX, AVX-512 BF16/FP16: names like "brg:avx512_core_amx",
// "brg:avx512_core_bf16"), else f32, which every x86-64 CPU runs at full FMA rate (a bf16 or f16
// matmul without such hardware is emulated or missing: Debian's oneDNN 2.6 has no f16 matmul on a
// Zen 4 without AVX512-FP16).
DType PrefillMatmulDtype(DType kv_dtype, int head_dim) {
  if (kv_dtype == DType::kF32) return DType::kF32;
  const CachedMatmul& cm = GetMatmul(0, 64, 256, head_dim, kv_dtype);
  const bool native = cm.ok && cm.impl.find("ref") == std::string::npos &&
                      (cm.impl.find("amx") != std::string::npos ||
                       cm.impl.find("bf16") != std::string::npos ||
                       cm.impl.find("fp16") != std::string::npos);
  return native ? kv_dtype : DType::kF32;
}

// Flash-attention-style host prefill: for each block of at most kDenseQueryBlock queries and each
// block of at most kDenseKeyBlock keys, S = Q K^T (oneDNN), the causal mask and online softmax
// (the kernel table's prefill_softmax, vectorised), O += P V (oneDNN). K and V of a key block are
// gathered from their pages into one contiguous per-thread block (converted to the matmul dtype
// on the way), so each matmul covers several pages. Rows are (query t, head g), t-major.
//
// Shapes are padded so few primitives are made (each is JIT-compiled once per thread): the rows
// to a multiple of kPadQueries queries (zero q, never written out), the key block to a multiple
// of kPadKeys keys (zero K and V, masked). Where the matmuls run in the KV dtype, q and P are
// rounded to it (as GPU flash attention does); in f32 nothing is rounded.
constexpr int64_t kDenseQueryBlock = 64;
constexpr int64_t kDenseKeyBlock = 512;
constexpr int64_t kPadQueries = 16;
constexpr int64_t kPadKeys = 64;

int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// rows [begin, end) of the K (v = false) or V part of the pages, converted to \p dst_dtype.
void GatherRows(const CpuKernels& k, const AttnParams& p, const KvPages& kv, int64_t begin,
                int64_t end, bool v, DType dst_dtype, char* dst) {
  const int64_t pt = kv.page_tokens;
  const int64_t hd = p.head_dim;
  const size_t src_elem = DTypeSize(p.kv_dtype), dst_elem = DTypeSize(dst_dtype);
  for (int64_t pos = begin; pos < end;) {
    const int64_t pg = pos / pt;
    const int64_t run_end = std::min(end, (pg + 1) * pt);
    const int64_t row = pos - pg * pt + (v ? pt : 0);
    const char* src = static_cast<const char*>(kv.pages[pg]) + static_cast<size_t>(row * hd) * src_elem;
    k.convert(dst + static_cast<size_t>((pos - begin) * hd) * dst_elem, dst_dtype, src, p.kv_dtype,
              (run_end - pos) * hd);
    pos = run_end;
  }
}

bool AttendPagedDenseBlock(const CpuKernels& k, const AttnParams& p, const PagedAttnItem& item,
                           DType mm_dtype) {
  const int64_t hd = p.head_dim;
  const int64_t rows = static_cast<int64_t>(item.num_q) * p.group;
  const int64_t m = RoundUp(item.num_q, kPadQueries) * p.group;
  const int64_t n = item.q_pos0 + item.num_q;
  const size_t elem = DTypeSize(mm_dtype);
  thread_local std::vector<char> q_low, p_low, k_blk, v_blk;
  thread_local std::vector<float> s_buf, o_acc, row_max;
  thread_local std::vector<double> row_sum;
  thread_local std::vector<int32_t> allowed;
  q_low.resize(static_cast<size_t>(m * hd) * elem);
  k.convert(q_low.data(), mm_dtype, item.q, DType::kF32, rows * hd);
  std::memset(q_low.data() + static_cast<size_t>(rows * hd) * elem, 0,
              static_cast<size_t>((m - rows) * hd) * elem);
  const int64_t kb_max = std::min(kDenseKeyBlock, RoundUp(n, kPadKeys));
  s_buf.resize(static_cast<size_t>(m * kb_max));
  p_low.resize(static_cast<size_t>(m * kb_max) * elem);
  k_blk.resize(static_cast<size_t>(kb_max * hd) * elem);
  v_blk.resize(k_blk.size());
  o_acc.assign(static_cast<size_t>(m * hd), 0.0f);
  row_max.assign(static_cast<size_t>(m), kNegInf);
  row_sum.assign(static_cast<size_t>(m), 0.0);
  allowed.resize(static_cast<size_t>(m));
  for (int64_t base = 0; base < n; base += kDenseKeyBlock) {
    const int64_t valid = std::min(kDenseKeyBlock, n - base);
    const int64_t cols = RoundUp(valid, kPadKeys);
    CachedMatmul& qk = GetMatmul(0, m, cols, hd, mm_dtype);
    CachedMatmul& pv = GetMatmul(1, m, cols, hd, mm_dtype);
    if (!qk.ok || !pv.ok) return false;  // only before the first write (see the probe)
    GatherRows(k, p, item.kv, base, base + valid, false, mm_dtype, k_blk.data());
    GatherRows(k, p, item.kv, base, base + valid, true, mm_dtype, v_blk.data());
    if (cols > valid) {
      const size_t off = static_cast<size_t>(valid * hd) * elem;
      const size_t len = static_cast<size_t>((cols - valid) * hd) * elem;
      std::memset(k_blk.data() + off, 0, len);
      std::memset(v_blk.data() + off, 0, len);
    }
    RunMatmul(qk, q_low.data(), k_blk.data(), s_buf.data());
    for (int64_t r = 0; r < m; ++r) {
      const int64_t t = r / p.group;
      allowed[r] = r < rows ? static_cast<int32_t>(
                                  std::clamp<int64_t>(item.q_pos0 + t + 1 - base, 0, valid))
                            : 0;
    }
    PrefillSoftmaxArgs a;
    a.s = s_buf.data();
    a.ld_s = cols;
    a.p = p_low.data();
    a.ld_p = cols;
    a.p_dtype = mm_dtype;
    a.rows = m;
    a.cols = cols;
    a.allowed = allowed.data();
    a.scale = p.scale;
    a.row_max = row_max.data();
    a.row_sum = row_sum.data();
    a.o = o_acc.data();
    a.ld_o = hd;
    a.head_dim = static_cast<int>(hd);
    k.prefill_softmax(a);
    RunMatmul(pv, p_low.data(), v_blk.data(), o_acc.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (row_sum[r] > 0.0) {
      const float inv = static_cast<float>(1.0 / row_sum[r]);
      for (int64_t d = 0; d < hd; ++d) item.o[r * hd + d] = o_acc[r * hd + d] * inv;
      item.lse[r] = row_max[r] + static_cast<float>(std::log(row_sum[r]));
    } else {
      std::fill(item.o + r * hd, item.o + (r + 1) * hd, 0.0f);
      item.lse[r] = kNegInf;
    }
  }
  return true;
}

}  // namespace

bool AttendPagedDense(const CpuKernels& k, const AttnParams& p, const PagedAttnItem& item) {
  LimitOneDnnThreadsOnThisThread();
  const DType mm_dtype = PrefillMatmulDtype(p.kv_dtype, p.head_dim);
  // Probe the largest primitives first so an unsupported shape fails before any write.
  const int64_t qb = std::min<int64_t>(kDenseQueryBlock, RoundUp(item.num_q, kPadQueries));
  const int64_t kb = std::min(kDenseKeyBlock, RoundUp(item.q_pos0 + item.num_q, kPadKeys));
  if (!GetMatmul(0, qb * p.group, kb, p.head_dim, mm_dtype).ok ||
      !GetMatmul(1, qb * p.group, kb, p.head_dim, mm_dtype).ok) {
    return false;
  }
  for (int32_t t0 = 0; t0 < item.num_q; t0 += static_cast<int32_t>(kDenseQueryBlock)) {
    const int64_t row0 = static_cast<int64_t>(t0) * p.group;
    PagedAttnItem sub = item;
    sub.q += row0 * p.head_dim;
    sub.o += row0 * p.head_dim;
    sub.lse += row0;
    sub.q_pos0 += t0;
    sub.num_q = static_cast<int32_t>(std::min<int64_t>(kDenseQueryBlock, item.num_q - t0));
    if (!AttendPagedDenseBlock(k, p, sub, mm_dtype)) return false;
  }
  return true;
}

int64_t PrefillQueryBlock(int64_t tokens, int num_kv_heads, int threads) {
  // About 4 units per thread or more keep the causal imbalance (later queries attend more keys)
  // small; below 16 queries the matmuls get too thin to pay for their calls.
  int64_t block = kDenseQueryBlock;
  while (block > kPadQueries &&
         num_kv_heads * ((tokens + block - 1) / block) < 4 * static_cast<int64_t>(threads)) {
    block /= 2;
  }
  return block;
}

void Convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n) {
  if (n > 0) BestCpuKernels().convert(dst, dst_dtype, src, src_dtype, n);
}

namespace {

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
      return AttendPagedDense(BestCpuKernels(), p, item);
    case DenseImpl::kSimd:
      AttendPagedSimd(p, item);
      return true;
    case DenseImpl::kAuto:
      if (AttendPagedDense(BestCpuKernels(), p, item)) return true;
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
