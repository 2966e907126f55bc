// Copyright kvferry authors. Apache-2.0.
// PrHS/CPE's pre-hoc selectors (CIS, PSAW) and cross-layer sharing as wrappers of another policy.
// Decisions where the paper is ambiguous are in docs/prhs.md.
#include "policies/prhs/prhs.h"

#include "policies/device_selector.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/psaw.h"
#include "policies/select_util.h"

namespace kvferry {
namespace {

// ---- shared by the three wrappers -----------------------------------------------------------

/// Holds the inner policy and forwards everything but Select to it.
class WrapperBase : public Policy {
 public:
  WrapperBase(std::string name, std::unique_ptr<Policy> inner)
      : name_(std::move(name)), inner_(std::move(inner)) {}
  std::string_view name() const override { return name_; }
  Placement placement() const override { return inner_->placement(); }
  bool wants_prefill_queries() const override { return inner_->wants_prefill_queries(); }
  Status OnPrefill(const PrefillContext& ctx) override { return inner_->OnPrefill(ctx); }
  int prime_rows() const override { return inner_->prime_rows(); }
  Status OnPrefillPrimed(const PrefillContext& ctx, const PrimedStats& primed) override {
    return inner_->OnPrefillPrimed(ctx, primed);
  }
  void OnSequenceRemoved(int slot) override {
    DropSlot(slot);
    inner_->OnSequenceRemoved(slot);
  }
  void OnDecodeRolledBack(int slot, int layer) override {
    ForgetLayer(slot, layer);
    inner_->OnDecodeRolledBack(slot, layer);
  }
  // Each wrapper keeps every resident position when its inner policy does (the planned CPU step
  // attends them on the device whatever the list says): CIS's shared set takes them all whatever
  // the budget, PSAW never hides them, XL reuses a set the inner chose at the same length.
  bool selection_covers_resident() const override { return inner_->selection_covers_resident(); }
  // The inner policy's device scan (LFPS): the wrappers pass their SelectContext, with the
  // device's ranking in it, to the inner Select whenever they run it.
  int device_scan_channels() const override { return inner_->device_scan_channels(); }
  int64_t device_scan_picks(int64_t k) const override { return inner_->device_scan_picks(k); }
  bool ScanShadow(int slot, int layer, int kv_head, ScanShadowView* out) const override {
    return inner_->ScanShadow(slot, layer, kv_head, out);
  }
  PolicyCounters counters() const override {
    PolicyCounters c = inner_->counters();
    c.select_calls += calls_.load(std::memory_order_relaxed);
    c.select_reused += reused_.load(std::memory_order_relaxed);
    return c;
  }

 protected:
  virtual void DropSlot(int slot) = 0;
  // What a rolled-back Decode of (slot, layer) kept for a later call (OnDecodeRolledBack).
  virtual void ForgetLayer(int slot, int layer) {
    (void)slot;
    (void)layer;
  }
  void CountCall() { calls_.fetch_add(1, std::memory_order_relaxed); }
  void CountReuse() { reused_.fetch_add(1, std::memory_order_relaxed); }
  Policy& inner() { return *inner_; }
  const Policy& inner_policy() const { return *inner_; }

 private:
  std::string name_;
  std::unique_ptr<Policy> inner_;
  std::atomic<int64_t> calls_{0}, reused_{0};
};

bool IsResident(int64_t p, int64_t n, int sink, int window) {
  return p < sink || p >= n - window;
}

// ---- CIS ------------------------------------------------------------------------------------

struct CisParams {
  int64_t s = 16;
  double tau = 0.8;
  int r = 1;
  double m_frac = 1.0 / 3.0;
  bool mean_cos = false;  // cis.group_mean: the group's mean cosine instead of its minimum
};

struct CisRef {
  std::vector<float> q;         // [group * head_dim]
  std::vector<int32_t> ranked;  // kept non-resident positions, best first
};

struct CisState {
  int64_t steps = 0;         // decode steps seen (counted where the budget does not cover n)
  std::vector<CisRef> refs;  // [0, num_refs): the current block's retrievals, oldest first; the
  size_t num_refs = 0;       // elements past it keep their buffers (no allocation once s were seen)
  // The undo of the last Select, taken by the next one when a roll-back came in between and that
  // Select was the rolled-back call's (ForgetLayer): its length, the counts it replaced and, when
  // it overwrote a live ref (a block's first retrieval), that ref (swapped out, no allocation).
  int64_t undo_n = -1;
  int64_t undo_steps = 0;
  size_t undo_num_refs = 0;
  bool undo_ref_live = false;  // undo_ref holds refs[0] as it was
  CisRef undo_ref;
  bool rolled_back = false;    // a Decode of this (slot, layer) was rolled back since undo_n's
};

/// min (or mean) over the group's heads of cos(q_g, ref_g); 0 when a norm is 0.
double GroupCos(const float* q, const std::vector<float>& ref, int group, int d, bool mean) {
  double worst = 1.0, sum = 0;
  for (int g = 0; g < group; ++g) {
    double dot = 0, a = 0, b = 0;
    for (int i = 0; i < d; ++i) {
      const double x = q[g * d + i], y = ref[static_cast<size_t>(g) * d + i];
      dot += x * y;
      a += x * x;
      b += y * y;
    }
    const double c = (a > 0 && b > 0) ? dot / std::sqrt(a * b) : 0.0;
    worst = std::min(worst, c);
    sum += c;
  }
  return mean ? sum / group : worst;
}

class CisPolicy final : public WrapperBase {
 public:
  CisPolicy(std::string name, std::unique_ptr<Policy> inner, CisParams p, const RuntimeConfig& c)
      : WrapperBase(std::move(name), std::move(inner)), p_(p) {
    states_.Init(c.capacity.max_sequences, c.model.num_layers, c.model.num_kv_heads);
  }

  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    const OffloadSplit split = SplitPositions(ctx.n, ctx.sink, ctx.window, ctx.budget);
    if (split.all || split.k_off <= 0) return inner().Select(ctx, out);  // nothing to choose
    KVF_ASSIGN_OR_RETURN(CisState * st, states_.Get("cis", ctx.slot, ctx.layer, ctx.kv_head, true));
    if (st->rolled_back) {
      // A call of this (slot, layer) was rolled back. The length is back where it was, so this
      // call has the rolled-back one's n: the last Select was that call exactly when it had this
      // n (an earlier call that stood had a smaller one). Undo it, as a twin never made it.
      st->rolled_back = false;
      if (st->undo_n == ctx.n) Undo(*st);
    }
    const int group = ctx.params.group, d = ctx.params.head_dim;
    const bool block_start = st->steps % p_.s == 0;
    st->undo_n = ctx.n;
    st->undo_steps = st->steps;
    st->undo_num_refs = st->num_refs;
    st->undo_ref_live = false;
    ++st->steps;
    if (block_start) st->num_refs = 0;
    const CisRef* share = nullptr;
    for (size_t i = st->num_refs; i > 0 && share == nullptr; --i) {
      const CisRef& ref = st->refs[i - 1];
      if (GroupCos(ctx.q, ref.q, group, d, p_.mean_cos) > p_.tau) share = &ref;
    }
    if (share != nullptr) {
      CountReuse();
      const int64_t k = split.k_off;
      const int64_t m = std::max<int64_t>(1, static_cast<int64_t>(std::floor(p_.m_frac * k)));
      CisShareSet(ctx.n, ctx.sink, ctx.window, ctx.budget, share->ranked, m, p_.r, out,
                  inner_policy().selection_covers_resident());
      return Status::Ok();
    }
    CountCall();
    KVF_RETURN_IF_ERROR(inner().Select(ctx, out));
    if (st->num_refs == st->refs.size()) st->refs.emplace_back();
    if (st->num_refs < st->undo_num_refs) {
      // A block's first retrieval overwrites the last block's first ref: keep it for Undo.
      st->refs[st->num_refs].q.swap(st->undo_ref.q);
      st->refs[st->num_refs].ranked.swap(st->undo_ref.ranked);
      st->undo_ref_live = true;
    }
    CisRef& ref = st->refs[st->num_refs++];
    ref.q.assign(ctx.q, ctx.q + static_cast<size_t>(group) * d);
    ref.ranked.clear();
    for (int32_t pos : out) {
      if (!IsResident(pos, ctx.n, ctx.sink, ctx.window)) ref.ranked.push_back(pos);
    }
    RankByWeight(ctx, ref.ranked);
    return Status::Ok();
  }

 private:
  /// Orders \p pos by the group's summed softmax weight over the set (best first; ties: lower
  /// position). The inner policy gives no ranking, so the kept set is scored once here: |S| rows.
  static void RankByWeight(const SelectContext& ctx, std::vector<int32_t>& pos) {
    const int group = ctx.params.group, d = ctx.params.head_dim;
    const int64_t count = static_cast<int64_t>(pos.size());
    if (count == 0) return;
    thread_local std::vector<float> logits, weights, krow;
    thread_local std::vector<int64_t> order;
    thread_local std::vector<int32_t> ranked;
    logits.resize(static_cast<size_t>(count) * group);
    weights.resize(static_cast<size_t>(count));
    krow.resize(static_cast<size_t>(d));
    for (int64_t j = 0; j < count; ++j) {
      LoadRowF32(ctx.kv, ctx.params, pos[j], false, krow.data());
      for (int g = 0; g < group; ++g) {
        float acc = 0;
        for (int i = 0; i < d; ++i) acc += ctx.q[g * d + i] * krow[i];
        logits[static_cast<size_t>(g) * count + j] = acc * ctx.params.scale;
      }
    }
    GroupSoftmaxSum(logits.data(), group, count, count, weights.data());
    order.resize(static_cast<size_t>(count));
    for (int64_t j = 0; j < count; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return weights[a] > weights[b];
    });
    ranked.resize(static_cast<size_t>(count));
    for (int64_t j = 0; j < count; ++j) ranked[j] = pos[order[j]];
    std::copy(ranked.begin(), ranked.end(), pos.begin());
  }

  /// Back to the state before the last Select (its undo record).
  static void Undo(CisState& st) {
    if (st.undo_ref_live) {
      st.refs[0].q.swap(st.undo_ref.q);
      st.refs[0].ranked.swap(st.undo_ref.ranked);
      st.undo_ref_live = false;
    }
    st.steps = st.undo_steps;
    st.num_refs = st.undo_num_refs;
    st.undo_n = -1;
  }

  void DropSlot(int slot) override { states_.RemoveSlot(slot); }
  // The undo waits for the next Select of each head (above), which knows the call's length.
  void ForgetLayer(int slot, int layer) override {
    for (int h = 0; h < states_.num_kv_heads(); ++h) {
      Result<CisState*> st = states_.Get("cis", slot, layer, h, false);
      if (st.ok() && st.value() != nullptr) st.value()->rolled_back = true;
    }
  }

  CisParams p_;
  HeadStateTable<CisState> states_;
};

// ---- PSAW -----------------------------------------------------------------------------------

class PsawPolicy final : public WrapperBase {
 public:
  PsawPolicy(std::string name, std::unique_ptr<Policy> inner, double phi, int l_s, int num_layers)
      : WrapperBase(std::move(name), std::move(inner)),
        phi_(phi),
        l_s_(l_s),
        num_layers_(num_layers) {}

  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    int64_t hide_end = PsawHiddenEnd(ctx.layer, num_layers_, l_s_, phi_, ctx.n);
    // Around an inner that keeps the resident rows, the window is never hidden (those rows are on
    // the GPU: hiding them would save no transfer, and the planned step attends them anyway).
    if (inner_policy().selection_covers_resident()) {
      hide_end = std::min<int64_t>(hide_end, std::max<int64_t>(ctx.sink, ctx.n - ctx.window));
    }
    KVF_RETURN_IF_ERROR(inner().Select(ctx, out));
    // Filter the inner's set, then refill the budget from the visible positions, most recent
    // first, then the sinks (the inner cannot be run on a restricted view: positions are
    // absolute). base/psaw.h, shared with the device's selection.
    const int64_t count = static_cast<int64_t>(out.size());
    out.resize(static_cast<size_t>(std::max<int64_t>(count, std::min(ctx.budget, ctx.n))));
    out.resize(static_cast<size_t>(
        PsawFilterList(out.data(), count, ctx.n, ctx.sink, ctx.budget, hide_end)));
    return Status::Ok();
  }

  // A device-selecting inner policy keeps its device selection: the device filters its list the
  // same way (DecodeStepArgs::hide_fraction), so the step stays on the GPU (and capture-safe).
  // Not around an inner that reuses the previous layer's list (psaw+xl+...): the device's list
  // of that layer would be the filtered one, where the host's xl+ keeps its own unfiltered set.
  std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(const detail::SelectorShape& shape) const override {
    for (int l = 0; l < num_layers_; ++l) {
      if (inner_policy().device_reuses_previous_layer(l)) return nullptr;
    }
    return inner_policy().MakeDeviceSelector(shape);
  }
  double device_hide_fraction(int layer) const override {
    return PsawHiddenFraction(layer, num_layers_, l_s_, phi_);
  }

 private:
  void DropSlot(int) override {}  // stateless

  double phi_;
  int l_s_, num_layers_;
};

// ---- cross-layer sharing --------------------------------------------------------------------

struct XlState {
  int layer = -1;   // layer of the kept set
  int64_t n = -1;   // its length (one step of one sequence has one n in every layer)
  std::vector<int32_t> set;
  // What the last Select replaced (prev_layer -1: nothing to restore), so that rolling that call
  // back restores it (ForgetLayer). The two sets swap buffers: no allocation in steady state.
  int prev_layer = -1;
  int64_t prev_n = -1;
  std::vector<int32_t> prev_set;
};

class XlPolicy final : public WrapperBase, public XlPredictor {
 public:
  XlPolicy(std::string name, std::unique_ptr<Policy> inner, int start, const RuntimeConfig& c)
      : WrapperBase(std::move(name), std::move(inner)), start_(start),
        num_layers_(c.model.num_layers), kv_heads_(c.model.num_kv_heads) {
    states_.Init(c.capacity.max_sequences, 1, c.model.num_kv_heads);
  }

  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    KVF_ASSIGN_OR_RETURN(XlState * st, states_.Get("xl", ctx.slot, 0, ctx.kv_head, true));
    if (Reuses(*st, ctx.layer, ctx.n)) {
      CountReuse();
      out.assign(st->set.begin(), st->set.end());
      // A set the inner chose at this length is within its budget, but for the resident rows an
      // inner that keeps them all adds past a budget too small for them.
      if (!inner_policy().selection_covers_resident()) ClipToBudget(ctx, out);
    } else {
      CountCall();
      KVF_RETURN_IF_ERROR(inner().Select(ctx, out));
    }
    st->prev_layer = st->layer;
    st->prev_n = st->n;
    st->set.swap(st->prev_set);
    st->layer = ctx.layer;
    st->n = ctx.n;
    st->set.assign(out.begin(), out.end());
    return Status::Ok();
  }

  // Around a device-selecting policy the device shares the list itself (RuntimeImpl's decode
  // step copies layer l - 1's list of the same step), so the step stays on the GPU.
  std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(const detail::SelectorShape& shape) const override {
    return inner_policy().MakeDeviceSelector(shape);
  }
  double device_hide_fraction(int layer) const override {
    return inner_policy().device_hide_fraction(layer);
  }
  bool device_reuses_previous_layer(int layer) const override {
    return (layer >= start_ && layer >= 1 && layer < num_layers_) ||
           inner_policy().device_reuses_previous_layer(layer);
  }

  std::vector<int32_t> PredictNext(int slot, int layer, int kv_head) const override {
    const XlState* st = states_.Peek(slot, 0, kv_head);
    if (st == nullptr || st->layer != layer || !Reuses(*st, layer + 1, st->n)) return {};
    return st->set;
  }

 private:
  bool Reuses(const XlState& st, int layer, int64_t n) const {
    return layer >= start_ && layer < num_layers_ && st.layer == layer - 1 && st.n == n;
  }
  /// A budget is a function of n alone, so the kept set fits; kept for safety: the most recent
  /// positions go last.
  static void ClipToBudget(const SelectContext& ctx, std::vector<int32_t>& out) {
    if (static_cast<int64_t>(out.size()) > ctx.budget) out.resize(static_cast<size_t>(ctx.budget));
  }
  void DropSlot(int slot) override { states_.RemoveSlot(slot); }
  // A rolled-back call of this layer: its set goes (the next layer must not reuse it), and the set
  // it replaced comes back, so that the state is a twin's that never made the call: the retried
  // call reuses the previous layer's set where the twin does (forgetting both would make it run
  // the inner instead). A layer whose last Select is not this layer's (the call failed before
  // selecting) keeps its state. Exact when the rolled-back call selected; when it failed before
  // selecting and the slot's last Select was this layer's at an earlier step (no other layer
  // selected for the slot since), the set that goes has a past length that no in-order call at the
  // next layer matches, and the one that comes back is older still.
  void ForgetLayer(int slot, int layer) override {
    for (int h = 0; h < kv_heads_; ++h) {
      Result<XlState*> got = states_.Get("xl", slot, 0, h, false);
      if (!got.ok() || got.value() == nullptr || got.value()->layer != layer) continue;
      XlState& st = *got.value();
      st.layer = st.prev_layer;
      st.n = st.prev_n;
      st.set.swap(st.prev_set);
      st.prev_layer = -1;  // restored once: a roll-back before the next Select restores nothing
      st.prev_n = -1;
    }
  }

  int start_, num_layers_, kv_heads_;
  HeadStateTable<XlState> states_;
};

// ---- construction ---------------------------------------------------------------------------

struct WrapperSpec {
  const char* prefix;  // "cis+"
  const char* ns;      // "cis."
  Result<std::unique_ptr<Policy>> (*make)(const std::string& name, std::unique_ptr<Policy> inner,
                                          const std::map<std::string, double>& own,
                                          const RuntimeConfig& config);
};

Result<double> FiniteParam(const char* key, double v) {
  KVF_CHECK_ARG(std::isfinite(v), "parameter '", key, "' = ", v, " must be finite");
  return v;
}

Result<std::unique_ptr<Policy>> MakeCis(const std::string& name, std::unique_ptr<Policy> inner,
                                        const std::map<std::string, double>& own,
                                        const RuntimeConfig& config) {
  CisParams p;
  for (const auto& [key, value] : own) {
    if (key == "cis.s") {
      KVF_ASSIGN_OR_RETURN(p.s, IntParam("cis", key, value, 1, int64_t{1} << 30));
    } else if (key == "cis.tau") {
      KVF_ASSIGN_OR_RETURN(p.tau, FiniteParam("cis.tau", value));
    } else if (key == "cis.r") {
      KVF_ASSIGN_OR_RETURN(int64_t r, IntParam("cis", key, value, 0, 1 << 20));
      p.r = static_cast<int>(r);
    } else if (key == "cis.m_frac") {
      KVF_CHECK_ARG(std::isfinite(value) && value > 0 && value <= 1,
                    "cis parameter 'cis.m_frac' = ", value, " must be in (0, 1]");
      p.m_frac = value;
    } else if (key == "cis.group_mean") {
      KVF_ASSIGN_OR_RETURN(int64_t g, IntParam("cis", key, value, 0, 1));
      p.mean_cos = g == 1;
    } else {
      return InvalidArgument(
          detail::StrCat("cis: unknown parameter '", key,
                         "' (known: cis.s, cis.tau, cis.r, cis.m_frac, cis.group_mean)"));
    }
  }
  return std::unique_ptr<Policy>(new CisPolicy(name, std::move(inner), p, config));
}

Result<std::unique_ptr<Policy>> MakePsaw(const std::string& name, std::unique_ptr<Policy> inner,
                                         const std::map<std::string, double>& own,
                                         const RuntimeConfig& config) {
  double phi = 0.7, start = 0.75;
  for (const auto& [key, value] : own) {
    if (key == "psaw.phi") {
      KVF_CHECK_ARG(std::isfinite(value) && value > 0 && value < 1,
                    "psaw parameter 'psaw.phi' = ", value, " must be in (0, 1)");
      phi = value;
    } else if (key == "psaw.start") {
      KVF_CHECK_ARG(std::isfinite(value) && value >= 0 && value < 1,
                    "psaw parameter 'psaw.start' = ", value, " must be in [0, 1)");
      start = value;
    } else {
      return InvalidArgument(detail::StrCat("psaw: unknown parameter '", key,
                                            "' (known: psaw.phi, psaw.start)"));
    }
  }
  const int n_layers = config.model.num_layers;
  const int l_s = static_cast<int>(std::floor(start * n_layers));
  return std::unique_ptr<Policy>(new PsawPolicy(name, std::move(inner), phi, l_s, n_layers));
}

Result<std::unique_ptr<Policy>> MakeXl(const std::string& name, std::unique_ptr<Policy> inner,
                                       const std::map<std::string, double>& own,
                                       const RuntimeConfig& config) {
  double start = 0.5;
  for (const auto& [key, value] : own) {
    if (key == "xl.start") {
      KVF_CHECK_ARG(std::isfinite(value) && value >= 0 && value <= 1,
                    "xl parameter 'xl.start' = ", value, " must be in [0, 1]");
      start = value;
    } else {
      return InvalidArgument(
          detail::StrCat("xl: unknown parameter '", key, "' (known: xl.start)"));
    }
  }
  // Layer 0 has no previous layer: the first reusing layer is at least 1.
  const int first = std::max(1, static_cast<int>(std::floor(start * config.model.num_layers)));
  return std::unique_ptr<Policy>(new XlPolicy(name, std::move(inner), first, config));
}

const WrapperSpec kWrappers[] = {
    {"cis+", "cis.", MakeCis},
    {"psaw+", "psaw.", MakePsaw},
    {"xl+", "xl.", MakeXl},
};

const WrapperSpec* FindWrapper(const std::string& name) {
  for (const WrapperSpec& w : kWrappers) {
    if (name.rfind(w.prefix, 0) == 0) return &w;
  }
  return nullptr;
}

}  // namespace

const std::vector<std::string>& PrhsWrapperPrefixes() {
  static const std::vector<std::string> p = [] {
    std::vector<std::string> v;
    for (const WrapperSpec& w : kWrappers) v.emplace_back(w.prefix);
    return v;
  }();
  return p;
}

int64_t PsawHiddenEnd(int layer, int num_layers, int l_s, double phi, int64_t n) {
  return PsawHiddenEndOf(PsawHiddenFraction(layer, num_layers, l_s, phi), n);
}

void CisShareSet(int64_t n, int sink, int window, int64_t budget,
                 const std::vector<int32_t>& ranked, int64_t m, int r, std::vector<int32_t>& out,
                 bool all_resident) {
  out.clear();
  const int64_t s = std::clamp<int64_t>(sink, 0, n);
  const int64_t w_lo = std::max(s, n - std::max(window, 0));
  thread_local std::vector<uint8_t> mark;
  mark.assign(static_cast<size_t>(n), 0);
  auto add_within = [&](int64_t p, int64_t cap) {
    if (p < 0 || p >= n || mark[p] || static_cast<int64_t>(out.size()) >= cap) return;
    mark[p] = 1;
    out.push_back(static_cast<int32_t>(p));
  };
  auto add = [&](int64_t p) { add_within(p, budget); };
  // The resident positions: all of them (all_resident), or newest first when the budget is short.
  const int64_t resident_cap = all_resident ? n : budget;
  for (int64_t p = 0; p < s; ++p) add_within(p, resident_cap);
  for (int64_t p = n - 1; p >= w_lo; --p) add_within(p, resident_cap);
  const int64_t top = std::min<int64_t>(m, static_cast<int64_t>(ranked.size()));
  for (int64_t i = 0; i < top; ++i) add(ranked[i]);
  for (int64_t i = 0; i < top; ++i) {
    for (int dr = 1; dr <= r; ++dr) {
      add(int64_t{ranked[i]} - dr);
      add(int64_t{ranked[i]} + dr);
    }
  }
  for (size_t i = static_cast<size_t>(top); i < ranked.size(); ++i) add(ranked[i]);
  std::sort(out.begin(), out.end());
}

Result<std::unique_ptr<Policy>> MakePrhsPolicy(const RuntimeConfig& config) {
  const std::string& name = config.policy.name;
  const WrapperSpec* w = FindWrapper(name);
  if (w == nullptr) return NotFound(detail::StrCat("no wrapper prefix in '", name, "'"));
  const std::string inner_name = name.substr(std::string(w->prefix).size());
  KVF_CHECK_ARG(!inner_name.empty(), "policy '", name, "' names no inner policy (e.g. '",
                w->prefix, "oracle')");
  std::map<std::string, double> own, rest;
  for (const auto& [key, value] : config.policy.params) {
    (key.rfind(w->ns, 0) == 0 ? own : rest)[key] = value;
  }
  if (FindWrapper(inner_name) == nullptr) {
    // The base policy: a namespaced parameter left over names a wrapper missing from the stack.
    for (const auto& [key, value] : rest) {
      for (const WrapperSpec& o : kWrappers) {
        KVF_CHECK_ARG(key.rfind(o.ns, 0) != 0, "parameter '", key, "' is for the ", o.prefix,
                      " wrapper, which policy '", name, "' does not contain");
      }
    }
  }
  RuntimeConfig inner_config = config;
  inner_config.policy.name = inner_name;
  inner_config.policy.params = std::move(rest);
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Policy> inner, MakePolicy(inner_config));
  // A dense inner (Policy::is_dense(): every token, every step) leaves a pre-hoc selector nothing
  // to select, and no wrapper is dense itself (cis+ shares sets of the budget, psaw+ hides a range,
  // xl+ would only copy "everything"): the runtime would size the step's lists by the budget while
  // the inner returns all n positions, and every step longer than that would fail. Refused here.
  KVF_CHECK_ARG(!inner->is_dense(), "policy '", name, "': the ", w->prefix,
                " wrapper cannot wrap '", inner_name,
                "', a dense policy (it attends every token at every step): a pre-hoc selector "
                "over it has nothing to select; use '", inner_name, "' itself");
  return w->make(name, std::move(inner), own, config);
}

}  // namespace kvferry
