// Copyright kvferry authors. Apache-2.0.
#pragma once
// KVpop's numeric core (seed 004, notes/kvpop.md), shared by its three implementations:
// policies/kvpop's host Select, the host backend's device-selection twin (policies/kvpop/select_host.cpp) and
// the CUDA kernel (policies/kvpop/select.cu, KvpopSelectKernel). Every operation below is one IEEE
// operation or an explicit fma, in a fixed order, so the host and the GPU compute the same
// priorities to the bit and keep the same tokens:
//  - the scorer's dot products in the order of a warp: lane l sums x[j] w[j] for j = l, l + 32,
//    ... (fmaf, ascending), then the 32 partials combine as a butterfly (offsets 16, 8, 4, 2, 1);
//  - SiLU(z) = z / (1 + exp(-z)) with KvpopExp, a range-reduced polynomial instead of the
//    library's expf (whose last bit differs between the host's libm and CUDA's);
//  - a NaN score counts as -inf (it ranks below every finite one, then by position).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "base/attn_types.h"

namespace kvferry {

/// Per-item KVpop state in device memory (KvpopStepArgs::state, one per t = (slot *
/// num_layers + layer) * num_kv_heads + h; all zero for a new sequence). The item's long-range
/// slots are KvpopStepArgs::pos / prio [t * cap, + count), ascending positions.
struct KvpopState {
  int64_t next_u = 0;  ///< positions below this have left the window (were scored)
  int64_t count = 0;   ///< live slots
};

/// KVpop's arguments of a step (DecodeStepArgs::selector): item t's state at state + t and its slots at pos / prio +
/// t * cap (cap >= budget_cap); the scorers' table (KvpopScorerFloats(hidden, 2 head_dim) floats
/// a (layer, KV head), device memory). A catch-up of more than one newcomer (the first step after
/// a prompt) scores them into DecodeStepArgs::select_ws (item * group * select_ld).
struct KvpopStepArgs {
  KvpopState* state = nullptr;
  int32_t* pos = nullptr;
  float* prio = nullptr;
  int64_t cap = 0;
  const float* scorer = nullptr;
  int32_t hidden = 0;
  /// CUDA: 1 when the runtime saw a catch-up coming (a prompt stored since the item's last step):
  /// a grid over the whole GPU scores the newcomers into select_ws first and the selection kernel
  /// reads them there; 0: the selection kernel scores any newcomers itself (correct either way; a
  /// captured graph keeps what it was captured with).
  int32_t catchup = 0;
};

/// KVpop's arguments of step \p a.
KVF_HOST_DEVICE inline KvpopStepArgs KvpopArgsOf(const DecodeStepArgs& a) {
  return SelectorArgsOf<KvpopStepArgs>(a);
}

/// The device selection's limits (the runtime refuses more at Create).
constexpr int32_t kKvpopMaxHidden = 256;
constexpr int32_t kKvpopMaxHeadDim = 256;

/// Floats of one (layer, KV head) scorer in the device table (KvpopStepArgs::scorer, block
/// (layer * num_kv_heads + h)): log gamma, b2, then w1 [hidden][in_dim], b1 [hidden], w2
/// [hidden]. hidden 0: the zero scorer (r = 0: recency).
KVF_HOST_DEVICE inline int64_t KvpopScorerFloats(int32_t hidden, int32_t in_dim) {
  return 2 + int64_t{hidden} * (in_dim + 2);
}

KVF_HOST_DEVICE inline float KvpopMul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);  // never contracted into an fma
#else
  return a * b;
#endif
}

KVF_HOST_DEVICE inline float KvpopAsFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

/// exp(x): 2^(x log2 e) as 2^i * p(f), i = rint, |f| <= 1/2, p the degree-6 Taylor polynomial of
/// 2^f (relative error < 2e-7); x clamped to about [-87, 87].
KVF_HOST_DEVICE inline float KvpopExp(float x) {
  float y = KvpopMul(x, 1.44269504f);
  y = y < -126.0f ? -126.0f : (y > 126.0f ? 126.0f : y);
  const float i = rintf(y);
  const float f = y - i;
  float p = 1.5403530e-4f;
  p = fmaf(p, f, 1.3333558e-3f);
  p = fmaf(p, f, 9.6181291e-3f);
  p = fmaf(p, f, 5.5504109e-2f);
  p = fmaf(p, f, 2.4022651e-1f);
  p = fmaf(p, f, 6.9314718e-1f);
  p = fmaf(p, f, 1.0f);
  const uint32_t e = static_cast<uint32_t>(static_cast<int32_t>(i) + 127) << 23;
  return KvpopMul(p, KvpopAsFloat(e));
}

/// SiLU(z) = z / (1 + exp(-z)).
KVF_HOST_DEVICE inline float KvpopSilu(float z) { return z / (1.0f + KvpopExp(-z)); }

/// The butterfly of 32 partials (the warp's __shfl_xor order): p is overwritten; returns the sum.
KVF_HOST_DEVICE inline float KvpopButterfly(float* p) {
  for (int off = 16; off > 0; off >>= 1) {
    for (int l = 0; l < off; ++l) p[l] = p[l] + p[l + off];
  }
  return p[0];
}

/// w . x over n elements in the warp's order (see the header).
KVF_HOST_DEVICE inline float KvpopDot(const float* w, const float* x, int n) {
  float p[32];
  for (int l = 0; l < 32; ++l) {
    float s = 0.0f;
    for (int j = l; j < n; j += 32) s = fmaf(w[j], x[j], s);
    p[l] = s;
  }
  return KvpopButterfly(p);
}

/// The MLP scorer on x = [k; v] (fp32, in_dim = 2 head_dim): r = b2 + sum_i w2[i] SiLU(b1[i] +
/// w1[i] . x), w1 [hidden][in_dim], the sum over i ascending by fmaf; a NaN result is -inf.
KVF_HOST_DEVICE inline float KvpopMlp(const float* x, int32_t in_dim, int32_t hidden,
                                      const float* w1, const float* b1, const float* w2,
                                      float b2) {
  float r = b2;
  for (int32_t i = 0; i < hidden; ++i) {
    const float z = KvpopDot(w1 + int64_t{i} * in_dim, x, in_dim) + b1[i];
    r = fmaf(w2[i], KvpopSilu(z), r);
  }
  return r != r ? -INFINITY : r;
}

/// KvpopMlp of one (layer, KV head) given its block of the table (KvpopScorerFloats); the zero
/// scorer (hidden 0) gives 0.
KVF_HOST_DEVICE inline float KvpopScore(const float* block, int32_t hidden, int32_t in_dim,
                                        const float* x) {
  if (hidden <= 0) return 0.0f;
  const float* w1 = block + 2;
  const float* b1 = w1 + int64_t{hidden} * in_dim;
  return KvpopMlp(x, in_dim, hidden, w1, b1, b1 + hidden, block[1]);
}

/// Static priority p = r - pos * log_gamma (log_gamma < 0: newer tokens rank higher).
KVF_HOST_DEVICE inline float KvpopPriorityOf(float r, int64_t pos, float log_gamma) {
  return fmaf(-static_cast<float>(pos), log_gamma, r);
}

/// True if (prio_a, pos_a) ranks above (prio_b, pos_b): higher priority, then lower position.
KVF_HOST_DEVICE inline bool KvpopRanksAbove(float prio_a, int64_t pos_a, float prio_b,
                                            int64_t pos_b) {
  return prio_a > prio_b || (prio_a == prio_b && pos_a < pos_b);
}

}  // namespace kvferry
