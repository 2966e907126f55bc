// Copyright kvferry authors. Apache-2.0.
#pragma once
// The host backend's frame for a policy's device selection (the twins in policies/*/select_host.cpp
// of the CUDA selections): the items of a step, each item's split of its positions, and the
// ranked list's head and tail.

#include <cstdint>
#include <functional>

#include "base/attn_types.h"
#include "base/offload_split.h"
#include "cpu/reference.h"
#include "kvferry/status.h"

namespace kvferry::cpu {

/// One item (sequence of the batch, KV head) of a step's selection.
struct SelectItem {
  int64_t item = 0;  ///< index in the step: b * num_kv_heads + h
  int64_t t = 0;     ///< index of (slot, layer, KV head) in the policy's per-item state
  int64_t pos = 0;   ///< the new token's position
  int64_t n = 0;     ///< positions, the new token's included
  int64_t k = 0;     ///< the step's budget, at most n
  const float* q = nullptr;  ///< [group, head_dim] fp32
  KvPages kv;                ///< the item's rows in the host store
  int32_t* out = nullptr;    ///< its list (list_cap entries)
};

/// A policy's ranking of one item: writes its list to it.out and returns the count.
using RankItem = std::function<int64_t(const DecodeStepArgs& a, const SelectItem& it)>;

/// A host twin's frame (DeviceKernel::host over \p args, a DecodeStepArgs): for each item of the
/// step, writes the new token's K through to its host-store row (as the step's append will),
/// converts q to fp32, calls \p rank, stores the count, and applies PrHS's depth window
/// (a.hide_fraction).
Status ForEachSelectItem(const void* args, const RankItem& rank);

/// An item's split at this step (base/offload_split.h; gpu/select_kernels.cuh's ItemSplitOf on the GPU).
inline OffloadSplit ItemSplitOf(const DecodeStepArgs& a, int64_t n) {
  return SplitPositions(n, a.sink, a.window, StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n));
}
/// The list's head: every position when the split takes all, else the sinks; returns the count.
inline int64_t WriteListHead(const OffloadSplit& sp, int64_t n, int32_t* out) {
  const int64_t count = sp.all ? n : sp.sink;
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(i);
  return count;
}
/// A ranked list: the head, then, when the split offloads positions and takes some, rank(sp, c)
/// appends its k_off picks at out[c] and returns the new count; then the window.
template <typename Rank>
int64_t WriteRankedList(const DecodeStepArgs& a, int64_t n, int32_t* out, const Rank& rank) {
  const OffloadSplit sp = ItemSplitOf(a, n);
  int64_t c = WriteListHead(sp, n, out);
  if (sp.all) return c;
  if (sp.k_off > 0) c = rank(sp, c);
  for (int64_t i = sp.off_hi; i < n; ++i) out[c++] = static_cast<int32_t>(i);
  return c;
}

}  // namespace kvferry::cpu
