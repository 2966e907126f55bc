// Copyright kvferry authors. Apache-2.0.
// The CPU half of a planned decode step for a CPU-placed policy (lfps), DESIGN.md's stages 2-5 on
// the host: select, resolve against the resident tier, attend the offloaded picks on the CPU next
// to the memory. The device half (runtime/decode_plan.cpp RunDecodeStep) has already enqueued the
// attention over the resident rows; this runs while it executes, and the two parts meet in the
// exact log-sum-exp merge on the device.
//
// One pool task per (sequence, KV head) does all three stages back to back, so the rows the
// policy's exact scoring just read are still in cache when the same task attends them, and the
// step pays one fork-join of the pool, not three.
//
// The same tasks serve a host-selecting policy with the device bank (host_lists_): there they stop
// after the select stage, writing each selection into the pinned list the device step reads
// (UploadHostLists copies it up), and the device attends every selected row.

#include <algorithm>
#include <limits>

#include "base/check.h"
#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "runtime/runtime_impl.h"

namespace kvferry::detail {

Status RuntimeImpl::SelectOnHost(std::span<const int> slot_of, int layer,
                                 std::span<const int64_t> positions, const TensorView& q,
                                 const TensorView& k, const TensorView& v, int32_t* lists,
                                 int32_t* counts) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t batch = static_cast<int64_t>(slot_of.size());
  const int64_t gd = static_cast<int64_t>(group_) * d;
  const int64_t items = batch * hkv;
  const AttnParams params{group_, d, m.kv_dtype, scale_};
  const size_t q_elem = DTypeSize(q.dtype), k_elem = DTypeSize(k.dtype), v_elem = DTypeSize(v.dtype);
  const auto* q_src = static_cast<const char*>(q.data);
  const auto* k_src = static_cast<const char*>(k.data);
  const auto* v_src = static_cast<const char*>(v.data);

  // Fewer items than pool threads: each Select may split its O(n) scan over the idle ones.
  const int select_threads = SelectThreads(items);
  pool_->ParallelFor(items, [&](int64_t i) {
    // One span per (sequence, KV head) task on its pool thread: append, select, CPU attention.
    struct ItemSpan {
      TraceRecorder& trace;
      int64_t item;
      TraceRecorder::Clock::time_point t0 = TraceRecorder::Clock::now();
      ~ItemSpan() { trace.Span("cpu_item", "cpu", t0, TraceRecorder::Clock::now(), item); }
    } span{trace_, i};
    const int64_t b = i / hkv;
    const int h = static_cast<int>(i % hkv);
    const int slot = slot_of[b];
    const int64_t pos = positions[b];
    const int64_t n = pos + 1;
    // 1 append (host half): the new token's store rows, which the policy may read below.
    const int64_t kv_off = (b * hkv + h) * d;
    cpu::ConvertSpan(store_->k_row(slot, layer, h, pos), m.kv_dtype, k_src + kv_off * k_elem,
                     k.dtype, d);
    cpu::ConvertSpan(store_->v_row(slot, layer, h, pos), m.kv_dtype, v_src + kv_off * v_elem,
                     v.dtype, d);
    float* q32 = q_host_ + b * hq * d + h * gd;
    cpu::ConvertSpan(q32, DType::kF32, q_src + (b * hq * d + h * gd) * q_elem, q.dtype, gd);
    // 2 select.
    item_status_[i] = SelectItem(i, slot, layer, h, n, q32, select_threads);
    const std::vector<int32_t>& sel = selections_[i];
    if (!item_status_[i].ok()) return;
    if (lists != nullptr) {
      // The device step reads every listed position's rows: one outside [0, n) would send it
      // past the page table, so the Select contract (ascending, unique, in range) is checked
      // here, where the host path would have read a wrong host row. The offloaded count is kept
      // for the stats only.
      int32_t offloaded = 0, prev = -1;
      for (const int32_t p : sel) {
        if (p <= prev || p >= n) {
          item_status_[i] = Internal(StrCat("policy '", policy_->name(), "' selected position ",
                                            p, " after ", prev, " of ", n, " (layer ", layer,
                                            ", KV head ", h, "): not ascending in [0, n)"));
          return;
        }
        prev = p;
        offloaded += ResidentRow(p, n) < 0 ? 1 : 0;
      }
      std::copy(sel.begin(), sel.end(), lists + i * list_cap_);
      counts[i] = static_cast<int32_t>(sel.size());
      cpu_items_[i].count = offloaded;
      return;
    }
    float* o = o_cpu_host_ + b * hq * d + h * gd;
    float* lse = lse_cpu_host_ + b * hq + h * group_;
    std::fill_n(lse, group_, -std::numeric_limits<float>::infinity());
    std::fill_n(o, gd, 0.0f);
    // 3 resolve: the resident positions are the device's part (the policy covers all of them);
    // 5 attend the others here, straight from the host store.
    const void** ck = cpu_k_rows_ + i * item_cap_;
    const void** cv = cpu_v_rows_ + i * item_cap_;
    int32_t n_cpu = 0;
    for (const int32_t p : sel) {
      if (ResidentRow(p, n) >= 0) continue;
      ck[n_cpu] = store_->k_row(slot, layer, h, p);
      cv[n_cpu++] = store_->v_row(slot, layer, h, p);
    }
    if (n_cpu > 0) {
      const RowAttnItem it{q32, o, lse, ck, cv, n_cpu};
      cpu::AttendRows(params, &it, 1);
    }
    cpu_items_[i].count = n_cpu;  // the stats below read the split back
  });
  // The next layer's items usually come within tens of microseconds (merge, append, the GPU's
  // launch, the wait for its q): KVFERRY_POOL_WARM_US keeps the workers spinning until then, so
  // that they start at once instead of waking one after another (off by default: runtime.cpp).
  pool_->KeepWarm(pool_->num_threads(), pool_warm_us_);

  for (int64_t i = 0; i < items; ++i) {
    if (!item_status_[i].ok()) return item_status_[i];
  }
  int64_t selected = 0, on_cpu = 0;
  for (int64_t i = 0; i < items; ++i) {
    const int64_t b = i / hkv;
    const int h = static_cast<int>(i % hkv);
    const std::vector<int32_t>& sel = selections_[i];
    last_selection_[(static_cast<size_t>(slot_of[b]) * m.num_layers + layer) * hkv + h].assign(
        sel.begin(), sel.end());
    selected += static_cast<int64_t>(sel.size());
    on_cpu += cpu_items_[i].count;  // lists: the offloaded rows
  }
  stats_.rows_selected += selected;
  stats_.rows_resident += selected - on_cpu;
  // The device's bank counters tell its offloaded rows apart (hits, fetched: RuntimeImpl::stats).
  if (lists == nullptr) stats_.rows_cpu += on_cpu;
  return Status::Ok();
}

}  // namespace kvferry::detail
