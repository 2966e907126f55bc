// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file device_selector.h
/// \brief A device-selecting policy's state on the device and everything the runtime does with
/// it, behind one interface (docs/design.md, "Device selection").
///
/// The planned decode step (runtime/decode_plan.cpp) ranks each item's positions on the device
/// with the kernels of the policy's selector (policies/<name>/select.cu, which call the building
/// blocks of gpu/decode_select.cu; the host backend's twins in policies/<name>/select_host.cpp). What a scoring keeps between steps (Quest's page bounds, SparCas's
/// compact keys and dimensions, HiP's masks, KVpop's slots and scorers) and how it is sized,
/// bound, reset, extended on each store, described to the kernels and accounted for lives in its
/// policy's folder (policies/<name>/device_selector.cpp), not in the runtime: the runtime asks
/// Policy::MakeDeviceSelector for the policy's selector and drives it through this interface.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/attn_types.h"
#include "gpu/device.h"
#include "kvferry/config.h"
#include "kvferry/status.h"
#include "kvferry/status_macros.h"
#include "policies/policy.h"

namespace kvferry::detail {

/// The shapes a selector serves (the runtime's configuration, as the selector needs it).
struct SelectorShape {
  ModelShape model;
  int max_sequences = 0;
  int64_t max_tokens = 0;  ///< positions a sequence holds at most (Capacity)
  int64_t item_cap = 0;    ///< the most positions an item's list holds (the largest budget)
  int group = 1;           ///< query heads per KV head
  float scale = 1.0f;      ///< softmax scale
  size_t kv_elem = 2;      ///< bytes of a K (or V) element
  size_t row_bytes = 0;    ///< bytes of a K (or V) row
  int sink = 0;            ///< resident sink tokens
  int window = 0;          ///< resident window tokens
  bool cuda = false;       ///< the CUDA backend (else the host backend's twin)
  /// Items (sequence slot, layer, KV head) the state covers.
  [[nodiscard]] size_t items() const {
    return static_cast<size_t>(max_sequences) * model.num_layers * model.num_kv_heads;
  }
};

/// One device buffer a selector needs: the memory plan's part it counts in, and its bytes.
struct SelectorBuffer {
  std::string part;
  size_t bytes = 0;
};


class DeviceSelector {
 public:
  virtual ~DeviceSelector() = default;
  // ---- sizing (once, at Create; const: ChooseBankSlots sizes several candidate plans) ----
  /// Checks the policy's parameters against the shape (kInvalidArgument naming them) and appends
  /// the buffers to allocate, in the order Bind receives them.
  virtual Status Size(std::vector<SelectorBuffer>& buffers) const = 0;
  /// The selection scratch the scoring uses: a list top-k workspace past 4096 picks, and the
  /// multi-CTA top-k over \p RankedCap(select_ld) scores of which an item needs at least
  /// \p MctaMinRanked() (0: none).
  [[nodiscard]] virtual bool uses_topk_ws() const { return true; }
  [[nodiscard]] virtual int64_t RankedCap(int64_t select_ld) const { return select_ld; }
  [[nodiscard]] virtual int64_t MctaMinRanked() const;
  /// Streams the selector creates (CUDA), for the stream scratch the device keeps.
  [[nodiscard]] virtual int extra_streams() const { return 0; }
  /// Its work runs beside the step on a stream of its own (HiP's rebuilds): the device bank then
  /// keeps one miss region, not two (the admissions' side stream would race it for the SMs).
  [[nodiscard]] virtual bool runs_beside_step() const { return false; }

  // ---- binding and state ----
  /// Takes the buffers Size asked for (device memory, same order), uploads what the policy
  /// computed on the host (KVpop's scorers), creates its streams and zeroes every item's state.
  virtual Status Bind(std::span<void* const> buffers, Device& device, StreamHandle stream) = 0;
  /// Waits for and destroys what Bind created (the runtime frees the buffers).
  virtual void Release() {}
  /// Zeroes the state of sequence slot \p slot (every slot for -1) and waits.
  virtual Status Reset(int slot, StreamHandle stream) { (void)slot, (void)stream; return Status::Ok(); }
  /// Whether the selector reads the host store at each store of rows (OnStored).
  [[nodiscard]] virtual bool tracks_store() const { return false; }
  /// Positions [pos0, new_len) of (slot, layer) were stored (prefill, append): extends what the
  /// selector derives from the keys (Quest's page bounds). The page table is flushed.
  virtual Status OnStored(int slot, int layer, int64_t pos0, int64_t new_len,
                          const StoreTable& store, StreamHandle stream) {
    (void)slot, (void)layer, (void)pos0, (void)new_len, (void)store, (void)stream;
    return Status::Ok();
  }

  // ---- the step ----
  /// Describes the state to the selection's kernels (its fields of DecodeStepArgs).
  virtual void Fill(DecodeStepArgs& a) const = 0;
  /// The kernel of the step's selection (policies/<name>/select.cu and its host twin): writes
  /// a.list and a.list_count of every item, for a DecodeStep in kList mode after it on the stream.
  /// Reads the step from device memory, never allocates, never synchronises (capture-safe).
  [[nodiscard]] virtual const DeviceKernel& select_kernel() const = 0;
  /// Enqueues the selection of step \p a (filled by Fill) on \p stream.
  Status Select(const DecodeStepArgs& a, StreamHandle stream) const {
    return device_->Run(select_kernel(), &a, stream);
  }
  /// Whether a layer that takes the previous layer's list (xl+) may skip ranking: yes where the
  /// ranking advances no state (the metadata is still kept current).
  [[nodiscard]] virtual bool ranking_skippable() const { return true; }
  /// Before the launch: what the host knows of this step's items (\p slots, \p positions of the
  /// new tokens) that speeds the selection up (KVpop's catch-up after a prompt).
  virtual void BeforeSelect(DecodeStepArgs& a, std::span<const int> slots,
                            std::span<const int64_t> positions, int layer) {
    (void)a, (void)slots, (void)positions, (void)layer;
  }
  /// After the selection was enqueued on \p stream: work the selection requested that may run
  /// beside the rest of the step (HiP's deferred mask rebuilds).
  virtual Status AfterSelect(const DecodeStepArgs& a, int layer, StreamHandle stream) {
    (void)a, (void)layer, (void)stream;
    return Status::Ok();
  }
  /// Joins work beside the step into \p stream before anything reads the state it writes: all of
  /// it (\p layer -1), or only where it covers \p layer or a layer after it.
  virtual Status Join(int layer, StreamHandle stream) { (void)layer, (void)stream; return Status::Ok(); }

  // ---- accounting (the host's view, without reading the device) ----
  /// Bytes of keys or metadata the selection reads to rank one KV head of \p n positions at
  /// \p layer with item budget \p budget (Stats::select_key_bytes).
  [[nodiscard]] virtual int64_t KeyBytes(int64_t n, int64_t budget, int layer) const = 0;
  /// > 0: the list of \p layer holds whole blocks of this many tokens (HiP's ranked layers).
  [[nodiscard]] virtual int32_t ListBlock(int layer) const { (void)layer; return 0; }

 protected:
  explicit DeviceSelector(const SelectorShape& shape) : shape_(shape) {}
  /// (first, count) of the items of sequence slot \p slot (-1: all): an item is (slot, layer, KV
  /// head), slot-major.
  [[nodiscard]] std::pair<size_t, size_t> ItemsOf(int slot) const;
  /// Zeroes the items of \p slot (-1: all) of \p state (\p per_item T an item, device memory)
  /// on \p stream, and waits for the stream when \p wait.
  template <typename T>
  Status ZeroItems(T* state, int slot, StreamHandle stream, bool wait, size_t per_item = 1) const {
    const auto [first, count] = ItemsOf(slot);
    const std::vector<T> zeros(count * per_item);
    KVF_RETURN_IF_ERROR(
        device_->CopyAsync(state + first * per_item, zeros.data(), zeros.size() * sizeof(T), stream));
    return wait ? device_->SynchronizeStream(stream) : Status::Ok();
  }
  SelectorShape shape_;
  Device* device_ = nullptr;  ///< set by Bind
};

/// A selector that keeps nothing between steps (the oracle's, knorm's): no buffers; each step its
/// kernel scores every key of the item (KeyBytes: n rows) and the shared top-k ranks \p ranks.
class StatelessSelector final : public DeviceSelector {
 public:
  StatelessSelector(const SelectorShape& shape, const DeviceKernel& kernel, SelectRanks ranks)
      : DeviceSelector(shape), kernel_(kernel), ranks_(ranks) {}
  Status Size(std::vector<SelectorBuffer>&) const override { return Status::Ok(); }
  Status Bind(std::span<void* const>, Device& device, StreamHandle) override {
    device_ = &device;
    return Status::Ok();
  }
  void Fill(DecodeStepArgs& a) const override { a.ranks = ranks_; }
  [[nodiscard]] const DeviceKernel& select_kernel() const override { return kernel_; }
  [[nodiscard]] int64_t KeyBytes(int64_t n, int64_t, int) const override {
    return n * static_cast<int64_t>(shape_.row_bytes);
  }

 private:
  const DeviceKernel& kernel_;
  SelectRanks ranks_;
};

/// Whether \p policy selects on the device inside a planned step (it has a DeviceSelector).
inline bool SelectsOnDevice(const Policy& policy) {
  return policy.MakeDeviceSelector(SelectorShape{}) != nullptr;
}

}  // namespace kvferry::detail
