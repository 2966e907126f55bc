// Copyright kvferry authors. Apache-2.0.
#pragma once
// Scalar reference kernels: the specification every fast path (AVX-512, oneDNN, CUDA) is tested
// against. fp32 accumulation, two-pass softmax; simple over fast.

#include <cstdint>

#include "base/attn_types.h"

namespace kvferry::cpu {

/// Sparse attention over a row list (see RowAttnItem).
void AttendRowsRef(const AttnParams& p, const RowAttnItem& item);

/// Causal paged attention (see PagedAttnItem); also dense decode attention with num_q = 1.
void AttendPagedRef(const AttnParams& p, const PagedAttnItem& item);

/// Exact merge of two partial attention results over disjoint key sets, in place into (o_a,
/// lse_a): o = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b).
/// rows results of head_dim each. Either side may be empty (lse = -inf).
void MergeLseRef(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows,
                 int head_dim);

/// Scaled logits of a GQA group against a row list: logits[g * count + j] = scale * q_g . k_j.
void ScoreRowsRef(const AttnParams& p, const float* q, const void* const* k_rows, int32_t count,
                  float* logits);

/// The prefill priming statistics of every head (see PrimeArgs), in the order written there:
/// logits and weights in fp32 (one softmax per row and head, sum in double), table sums in fp32,
/// stats in double. The host device's Device::PrimeAttention.
void PrimeAttentionRef(const PrimeArgs& a);

/// LFPS's scan weights (policies/lfps/lfps.cpp, step 3a; the GPU's ScanPrepKernel computes the same):
/// the r channels with the largest sum_g |q[g][c]| * scale[c] (ties: lower c) into ch[0, r) (ch
/// has room for head_dim: it is sorted in place, imp is head_dim floats of scratch), and
/// w[g * r + c] = lrint(q[g][ch[c]] * scale[ch[c]] * 16384 / wmax) with wmax the largest
/// |q[g][ch[c]] * scale[ch[c]]| (0 when wmax is 0 or not finite; NaN products give 0).
void ShadowScanWeights(const float* q, const float* scale, int group, int head_dim, int r,
                     float* imp, int32_t* ch, int32_t* w);

/// LFPS's scan on a device copy of its int8 shadow (see ShadowScanArgs): the host device's
/// Device::ShadowScan and the specification gpu/shadow_scan.cu is tested against.
void ShadowScanRef(const ShadowScanArgs& a);

/// Indices of the k largest scores, ordered by score descending, ties broken by lower index.
/// k is clamped to n. NaN scores rank lowest.
void TopKRef(const float* scores, int64_t n, int64_t k, int32_t* out_indices);

}  // namespace kvferry::cpu
