// Copyright kvferry authors. Apache-2.0.
#pragma once
// Pieces the sparse selection policies (quest, sparcas, hip, kvpop) share: the split of a head's
// positions into resident (sinks, window) and offloaded ones, deterministic top-k, row loading and
// a table of per-(slot, layer, KV head) state that concurrent Select calls may use safely.
//
// Selection convention (as LFPS): the resident sinks [0, sink) and window [n - window, n) are
// always returned; the policy picks k_off = budget - sink - window positions of the offloaded range
// [sink, n - window). When k_off covers the whole range the selection is [0, n) (so a full budget
// is dense attention); when k_off <= 0 only the resident positions are returned.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "base/attn_types.h"
#include "base/offload_split.h"
#include "cpu/dtype.h"
#include "kvferry/config.h"
#include "kvferry/status.h"
#include "kvferry/status_macros.h"
#include "policies/policy.h"

namespace kvferry {

/// out = sinks, then \p chosen (ascending, inside the offloaded range), then the window.
inline void FinishSelection(const OffloadSplit& s, const int32_t* chosen, int64_t count,
                            std::vector<int32_t>& out) {
  out.clear();
  for (int64_t i = 0; i < s.sink; ++i) out.push_back(static_cast<int32_t>(i));
  out.insert(out.end(), chosen, chosen + count);
  for (int64_t i = s.off_hi; i < s.n; ++i) out.push_back(static_cast<int32_t>(i));
}

/// Every position [0, n).
inline void SelectAll(int64_t n, std::vector<int32_t>& out) {
  out.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(i);
}

/// Indices of the k largest of scores[0, count) (ties: lower index; NaN ranks last), written
/// ascending to out[0, min(k, count)) plus \p base; returns the count.
int64_t TopKAscendingIndices(const float* scores, int64_t count, int64_t k, int32_t base,
                             int32_t* out);

/// Row \p pos of K (or V when \p value) of a paged KV head as fp32 into dst[0, head_dim).
inline void LoadRowF32(const KvPages& kv, const AttnParams& p, int64_t pos, bool value,
                       float* dst) {
  const size_t elem = DTypeSize(p.kv_dtype);
  const void* row = value ? PagedVRow(kv, pos, p.head_dim, elem) : PagedKRow(kv, pos, p.head_dim, elem);
  for (int d = 0; d < p.head_dim; ++d) dst[d] = cpu::LoadAsF32(row, p.kv_dtype, d);
}

/// Group-summed softmax of logits[g * ld + j], j in [0, count), into weights[0, count) (each
/// head's softmax over the count entries; weights[j] in [0, group]). The oracle's aggregation.
void GroupSoftmaxSum(const float* logits, int group, int64_t count, int64_t ld, float* weights);

/// Per-(slot, layer, KV head) state, created on first use. Different keys may be used
/// concurrently (each has its own element); one key must not be used by two threads at once (the
/// runtime never does that).
template <typename State>
class HeadStateTable {
 public:
  HeadStateTable() = default;
  HeadStateTable(int max_sequences, int num_layers, int num_kv_heads) {
    Init(max_sequences, num_layers, num_kv_heads);
  }
  void Init(int max_sequences, int num_layers, int num_kv_heads) {
    max_sequences_ = max_sequences;
    num_layers_ = num_layers;
    num_kv_heads_ = num_kv_heads;
    states_.clear();
    states_.resize(static_cast<size_t>(max_sequences) * num_layers * num_kv_heads);
  }
  /// The state of (slot, layer, kv_head), created (default-constructed) if \p create.
  Result<State*> Get(const char* policy, int slot, int layer, int kv_head, bool create) {
    if (slot < 0 || slot >= max_sequences_ || layer < 0 || layer >= num_layers_ || kv_head < 0 ||
        kv_head >= num_kv_heads_) {
      return InvalidArgument(std::string(policy) + ": slot " + std::to_string(slot) + ", layer " +
                             std::to_string(layer) + " or kv_head " + std::to_string(kv_head) +
                             " out of range [0, " + std::to_string(max_sequences_) + ") x [0, " +
                             std::to_string(num_layers_) + ") x [0, " +
                             std::to_string(num_kv_heads_) + ")");
    }
    auto& st = states_[Index(slot, layer, kv_head)];
    if (st == nullptr && create) st = std::make_unique<State>();
    return st.get();
  }
  /// The state of the head a Select is for (created), once the context has a position, a group and
  /// a query: what every query-reading policy checks first.
  Result<State*> ForSelect(const char* policy, const SelectContext& ctx) {
    KVF_CHECK_ARG(ctx.n >= 1 && ctx.q != nullptr && ctx.params.group >= 1, policy,
                  " select needs n >= 1 and a query");
    return Get(policy, ctx.slot, ctx.layer, ctx.kv_head, true);
  }
  const State* Peek(int slot, int layer, int kv_head) const {
    if (slot < 0 || slot >= max_sequences_ || layer < 0 || layer >= num_layers_ || kv_head < 0 ||
        kv_head >= num_kv_heads_) {
      return nullptr;
    }
    return states_[Index(slot, layer, kv_head)].get();
  }
  void RemoveSlot(int slot) {
    if (slot < 0 || slot >= max_sequences_) return;
    const size_t per_slot = static_cast<size_t>(num_layers_) * num_kv_heads_;
    for (size_t i = 0; i < per_slot; ++i) states_[slot * per_slot + i].reset();
  }
  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }

 private:
  size_t Index(int slot, int layer, int kv_head) const {
    return (static_cast<size_t>(slot) * num_layers_ + layer) * num_kv_heads_ + kv_head;
  }
  int max_sequences_ = 0, num_layers_ = 0, num_kv_heads_ = 0;
  std::vector<std::unique_ptr<State>> states_;
};

/// Common checks of a policy factory's configuration.
/// The bits a quantised-scoring policy keeps a key dimension in: \p bits when set (4 or 16), else 4
/// where head_dim is a multiple of 8 (two dimensions a byte, whole 8-byte rows) and 16 otherwise.
inline int ScoreBitsFor(int bits, int head_dim) {
  if (bits != 0) return bits;
  return head_dim % 8 == 0 ? 4 : 16;
}

Status CheckPolicyShape(const char* policy, const RuntimeConfig& config);

/// A policy parameter that must be an integer in [lo, hi]; the error names it.
Result<int64_t> IntParam(const char* policy, const std::string& key, double value, int64_t lo,
                         int64_t hi);

/// One parameter of a policy's table (ParseParams): its name, the member it sets and the values it
/// takes. An int, int64_t or bool member takes integers in [lo, hi] (a bool: 0 or 1); a double
/// member takes reals in [lo, hi], or in (lo, hi) when \p open. \p only, when set, lists the
/// values allowed (e.g. bits 4 or 16).
template <class P>
struct ParamSpec {
  const char* name;
  std::variant<int P::*, int64_t P::*, double P::*, bool P::*> field;
  double lo = 0, hi = 1;
  bool open = false;
  std::vector<double> only = {};
};

/// The named parameters into \p p (the defaults) by the policy's table; a name not in it, or a
/// value out of its range, is kInvalidArgument naming the policy, the parameter, the value and
/// what it takes (the known names for an unknown one).
template <class P>
Result<P> ParseParams(const char* policy, const std::map<std::string, double>& params,
                      std::span<const ParamSpec<P>> table, P p = {}) {
  for (const auto& [key, value] : params) {
    const ParamSpec<P>* spec = nullptr;
    for (const ParamSpec<P>& s : table) {
      if (key == s.name) spec = &s;
    }
    if (spec == nullptr) {
      std::string known;
      for (const ParamSpec<P>& s : table) known += (known.empty() ? "" : ", ") + std::string(s.name);
      return InvalidArgument(detail::StrCat("unknown ", policy, " parameter '", key, "' (known: ",
                                            known, ")"));
    }
    const bool real = std::holds_alternative<double P::*>(spec->field);
    bool ok = real ? std::isfinite(value) && (spec->open ? value > spec->lo && value < spec->hi
                                                         : value >= spec->lo && value <= spec->hi)
                   : std::isfinite(value) && value == std::floor(value) && value >= spec->lo &&
                         value <= spec->hi;
    if (!spec->only.empty()) {
      ok = std::find(spec->only.begin(), spec->only.end(), value) != spec->only.end();
    }
    if (!ok) {
      std::string takes;
      if (!spec->only.empty()) {
        for (const double v : spec->only) takes += (takes.empty() ? "one of " : ", ") + detail::StrCat(v);
      } else {
        takes = detail::StrCat(real ? "in " : "an integer in ", spec->open ? "(" : "[", spec->lo, ", ",
                               spec->hi, spec->open ? ")" : "]");
      }
      return InvalidArgument(detail::StrCat(policy, " parameter '", key, "' = ", value, " must be ", takes));
    }
    // Each alternative's store is compiled for every P; GCC then warns that a double's store could
    // not fit a P without double members (as QuestParams), though only the member's own type runs.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#endif
    std::visit([&](auto member) { p.*member = static_cast<std::remove_reference_t<decltype(p.*member)>>(value); },
               spec->field);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  }
  return p;
}

}  // namespace kvferry

namespace kvferry {

/// The exact top-k_off of the offloaded range by the group's summed softmax weight over all n
/// positions (the oracle's ranking with the resident positions forced in), ascending into
/// \p chosen; returns the count. For layers a policy keeps exact.
int64_t ExactOffloadedTopK(const SelectContext& ctx, const OffloadSplit& s,
                           std::vector<int32_t>& chosen);

}  // namespace kvferry
