// Copyright kvferry authors. Apache-2.0.
// Sliding-window layers (ModelShape::layer_window; docs/runtime.md, "Per-layer attention types"):
// their rings on the device, their decode and their prefill. Only Device calls both backends
// implement (CopyRows, AttendRows, MergeLse), so the host and CUDA backends run the same code.
#include <algorithm>
#include <chrono>

#include "base/check.h"
#include "cpu/attention.h"
#include "runtime/runtime_impl.h"

namespace kvferry::detail {
namespace {

using Clock = std::chrono::steady_clock;

// Row j of KV head h's K (kv 0) or V (kv 1) block in a chunk's window staging of ld rows a block.
char* StageRow(char* stage, int64_t ld, size_t row_bytes, int h, int kv, int64_t j) {
  return stage + static_cast<size_t>((int64_t{h} * 2 + kv) * ld + j) * row_bytes;
}

}  // namespace

void RuntimeImpl::InitWindowLayout() {
  const ModelShape& m = config_.model;
  win_.widths.clear();
  win_.ring_off.clear();
  win_.max = 0;
  win_.ring_slot_rows = 0;
  win_.stage_rows = 0;
  if (std::none_of(m.layer_window.begin(), m.layer_window.end(), [](int w) { return w > 0; })) {
    return;  // every layer global: nothing of this file runs
  }
  win_.widths = m.layer_window;
  const int64_t tier = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  win_.ring_off.assign(static_cast<size_t>(m.num_layers), 0);
  for (int l = 0; l < m.num_layers; ++l) {
    win_.max = std::max(win_.max, win_.widths[l]);
    win_.ring_off[l] = win_.ring_slot_rows;
    if (win_.widths[l] > 0) {
      win_.ring_slot_rows += std::max<int64_t>(0, win_.widths[l] - tier) * 2 * m.num_kv_heads;
    }
  }
  win_.stage_rows = win_.max - 1 + config_.capacity.max_prefill_chunk;
}

void RuntimeImpl::SizeWindowBuffers(DeviceBufferSizes& z) const {
  const ModelShape& m = config_.model;
  const int64_t seqs = config_.capacity.max_sequences, hkv = m.num_kv_heads;
  const int64_t tier = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  if (win_.max > 0) {
    if (win_.ring_slot_rows > 0) {
      z.window_rings = AllocBytes(static_cast<size_t>(seqs * win_.ring_slot_rows) * dims_.row_bytes);
    }
    z.window_stage = AllocBytes(static_cast<size_t>(hkv * 2 * win_.stage_rows) * dims_.row_bytes);
  }
  z.layer_bytes.assign(static_cast<size_t>(m.num_layers), 0);
  for (int l = 0; l < m.num_layers; ++l) {
    const int64_t ring_rows = std::max<int64_t>(0, WindowOf(l) - tier);
    z.layer_bytes[l] = static_cast<int64_t>(
        static_cast<size_t>(seqs * hkv * 2 * (tier + ring_rows)) * dims_.row_bytes +
        z.bank_rows / static_cast<size_t>(m.num_layers));
  }
}

Status RuntimeImpl::InitWindowBuffers() {
  if (win_.max == 0) return Status::Ok();
  const Capacity& cap = config_.capacity;
  const int64_t hkv = config_.model.num_kv_heads;
  if (sizes_.window_rings > 0) {
    KVF_ASSIGN_OR_RETURN(win_.rings, AllocAs<char>(sizes_.window_rings, false));
  }
  KVF_ASSIGN_OR_RETURN(win_.stage, AllocAs<char>(sizes_.window_stage, false));
  // Pinned descriptors, one region per use in a call (WindowDecode: q, k, v; WindowChunk: the
  // history, the chunk's k and v, q and out, the ring, the history back).
  const int64_t hist = win_.max - 1, chunk = cap.max_prefill_chunk;
  win_.copy_cap = hkv * std::max<int64_t>(3 * int64_t{cap.max_batch}, 4 * hist + 6 * chunk);
  KVF_ASSIGN_OR_RETURN(win_.copies, AllocAs<RowCopy>(static_cast<size_t>(win_.copy_cap) * sizeof(RowCopy), true));
  KVF_ASSIGN_OR_RETURN(win_.items, AllocAs<RowAttnItem>(static_cast<size_t>(dims_.max_rows * hkv) * sizeof(RowAttnItem), true));
  // Row lists: a decode item's ring rows; a chunk's staging rows of each KV head.
  win_.row_cap = std::max<int64_t>(int64_t{cap.max_batch} * hkv * win_.max,
                                   hkv * win_.stage_rows);
  for (const void*** dst : {&win_.k_rows, &win_.v_rows}) {
    KVF_ASSIGN_OR_RETURN(*dst, AllocAs<const void*>(static_cast<size_t>(win_.row_cap) * sizeof(void*), true));
  }
  return Status::Ok();
}

char* RuntimeImpl::RingK(int slot, int layer, int h, int64_t row) const {
  const int64_t tier = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  if (row < tier) return ResidentK(slot, layer, h, row);
  const int64_t extra = WindowOf(layer) - tier;  // the ring's rows beyond the tier's, per head
  const int64_t r = static_cast<int64_t>(slot) * win_.ring_slot_rows + win_.ring_off[layer] +
                    int64_t{h} * 2 * extra + (row - tier);
  return win_.rings + static_cast<size_t>(r) * dims_.row_bytes;
}

char* RuntimeImpl::RingV(int slot, int layer, int h, int64_t row) const {
  const int64_t tier = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  if (row < tier) return ResidentV(slot, layer, h, row);
  return RingK(slot, layer, h, row) + static_cast<size_t>(WindowOf(layer) - tier) * dims_.row_bytes;
}

Status RuntimeImpl::WindowDecode(std::span<const SequenceId> seqs, std::span<const int> slot_of,
                                 int layer, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& out, StreamHandle stream) {
  const auto t0 = Clock::now();
  const ModelShape& m = config_.model;
  const int layers = m.num_layers, hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t batch = static_cast<int64_t>(seqs.size()), w = WindowOf(layer);
  const int64_t gd = int64_t{dims_.group} * d;
  if (stream == nullptr) stream = stream_;
  KVF_CHECK_CODE(!device_->IsCapturing(stream), StatusCode::kFailedPrecondition, "layer ", layer,
                 " is a sliding-window layer (", w, " tokens), whose decode the host describes at "
                 "every step: a CUDA graph cannot hold it (Runtime::decode_is_capture_safe() is "
                 "false with sliding-window layers)");
  // A step planned by PlanDecode has counted this layer's token already (as RunDecodeStep).
  const bool planned = plan_.active && plan_.layer_run[layer] == 0 &&
                       std::equal(seqs.begin(), seqs.end(), plan_.seqs.begin(), plan_.seqs.end());
  if (!planned) KVF_RETURN_IF_ERROR(CheckNextToken(seqs, slot_of, layer));
  std::vector<int64_t>& pos = scratch_.step_pos;  // reserved at set-up: no allocation
  pos.resize(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    pos[b] = planned ? plan_.positions[static_cast<size_t>(b * layers + layer)]
                     : lengths_[static_cast<size_t>(slot_of[b]) * layers + layer]++;
  }
  int64_t rows = 0;
  // The new token takes the ring row of position pos - w, which no later call attends (a decode
  // at pos or later, or a chunk from pos on, attends from pos - w + 1): a failure only takes the
  // token back.
  auto run = [&]() -> Status {
    // The global layers' side work (selector rebuilds, bank admissions) joins here, as at a step's
    // last layer: a sliding layer may be the last.
    KVF_RETURN_IF_ERROR(JoinSelectorSide(stream));
    KVF_RETURN_IF_ERROR(JoinAdmitSide(stream));
    KVF_RETURN_IF_ERROR(BeginCall());
    KVF_ASSIGN_OR_RETURN(const void* q_src, StageInput(q, io_.q_in, stream));
    KVF_ASSIGN_OR_RETURN(const void* k_src, StageInput(k, io_.k_in, stream));
    KVF_ASSIGN_OR_RETURN(const void* v_src, StageInput(v, io_.v_in, stream));
    RowCopy* qc = win_.copies;
    RowCopy* kc = qc + batch * hkv;
    RowCopy* vc = kc + batch * hkv;
    for (int64_t b = 0; b < batch; ++b) {
      for (int h = 0; h < hkv; ++h) {
        const int64_t i = b * hkv + h;
        qc[i] = RowCopy{io_.q_f32 + b * hq * d + h * gd,
                        static_cast<const char*>(q_src) + (b * hq + h * dims_.group) * d * DTypeSize(q.dtype)};
        kc[i] = RowCopy{RingK(slot_of[b], layer, h, pos[b] % w),
                        static_cast<const char*>(k_src) + i * d * DTypeSize(k.dtype)};
        vc[i] = RowCopy{RingV(slot_of[b], layer, h, pos[b] % w),
                        static_cast<const char*>(v_src) + i * d * DTypeSize(v.dtype)};
      }
    }
    KVF_RETURN_IF_ERROR(device_->CopyRows(qc, batch * hkv, static_cast<int>(gd), q.dtype,
                                          DType::kF32, stream));
    KVF_RETURN_IF_ERROR(device_->CopyRows(kc, batch * hkv, d, k.dtype, m.kv_dtype, stream));
    KVF_RETURN_IF_ERROR(device_->CopyRows(vc, batch * hkv, d, v.dtype, m.kv_dtype, stream));
    // Dense attention over the ring: positions [max(0, n - w), n), rows in any order.
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t count = std::min<int64_t>(pos[b] + 1, w);
      for (int h = 0; h < hkv; ++h) {
        const int64_t i = b * hkv + h;
        const void** kr = win_.k_rows + i * win_.max;
        const void** vr = win_.v_rows + i * win_.max;
        for (int64_t r = 0; r < count; ++r) {
          kr[r] = RingK(slot_of[b], layer, h, r);
          vr[r] = RingV(slot_of[b], layer, h, r);
        }
        const int64_t off = b * hq * d + h * gd;
        win_.items[i] = RowAttnItem{io_.q_f32 + off, io_.o_gpu + off, io_.lse_gpu + b * hq + h * dims_.group,
                                    kr, vr, static_cast<int32_t>(count)};
        rows += count;
      }
    }
    KVF_RETURN_IF_ERROR(device_->AttendRows(AttnParams{dims_.group, d, m.kv_dtype, dims_.scale},
                                            win_.items, batch * hkv, stream));
    return WriteOutput(nullptr, nullptr, batch * hq, out, stream);
  };
  Status st = run();
  if (planned) plan_.layer_run[layer] = 1;
  if (!st.ok()) {
    for (int64_t b = 0; b < batch; ++b) --lengths_[static_cast<size_t>(slot_of[b]) * layers + layer];
    return st;
  }
  stats_.decode_steps += 1;
  stats_.decode_tokens += batch;
  stats_.rows_window += rows;
  Stage(stats_.ms_attend_gpu, "attend_gpu", t0);
  return Status::Ok();
}

Status RuntimeImpl::WindowChunk(int slot, int layer, const TensorView* q, const TensorView& k,
                                const TensorView& v, const TensorView* out, StreamHandle stream,
                                int64_t pos0, int64_t new_len) {
  const ModelShape& m = config_.model;
  const int hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t w = WindowOf(layer), tokens = new_len - pos0, ld = win_.stage_rows;
  // Staging row j holds position base + j: the window's earlier rows [base, pos0) from the ring,
  // then the chunk, in the KV dtype.
  const int64_t base = std::max<int64_t>(0, pos0 - (w - 1)), hist = pos0 - base;
  auto stage = [&](int h, int kv, int64_t j) { return StageRow(win_.stage, ld, dims_.row_bytes, h, kv, j); };
  KVF_RETURN_IF_ERROR(BeginCall());
  KVF_ASSIGN_OR_RETURN(const void* k_src, StageInput(k, io_.k_in, stream));
  KVF_ASSIGN_OR_RETURN(const void* v_src, StageInput(v, io_.v_in, stream));
  RowCopy* hc = win_.copies;  // the history, K and V rows alike
  int64_t nh = 0;
  for (int h = 0; h < hkv; ++h) {
    for (int64_t j = 0; j < hist; ++j) {
      const int64_t row = (base + j) % w;
      hc[nh++] = RowCopy{stage(h, 0, j), RingK(slot, layer, h, row)};
      hc[nh++] = RowCopy{stage(h, 1, j), RingV(slot, layer, h, row)};
    }
  }
  RowCopy* kc = hc + nh;
  RowCopy* vc = kc + tokens * hkv;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < hkv; ++h) {
      const int64_t i = t * hkv + h;
      kc[i] = RowCopy{stage(h, 0, hist + t), static_cast<const char*>(k_src) + i * d * DTypeSize(k.dtype)};
      vc[i] = RowCopy{stage(h, 1, hist + t), static_cast<const char*>(v_src) + i * d * DTypeSize(v.dtype)};
    }
  }
  if (nh > 0) KVF_RETURN_IF_ERROR(device_->CopyRows(hc, nh, d, m.kv_dtype, m.kv_dtype, stream));
  KVF_RETURN_IF_ERROR(CopyRowsWide(kc, tokens * hkv, d, k.dtype, m.kv_dtype, stream));
  KVF_RETURN_IF_ERROR(CopyRowsWide(vc, tokens * hkv, d, v.dtype, m.kv_dtype, stream));
  RowCopy* next = vc + tokens * hkv;
  if (q != nullptr) {
    KVF_ASSIGN_OR_RETURN(const void* q_src, StageInput(*q, io_.q_in, stream));
    KVF_RETURN_IF_ERROR(WindowChunkAttend(*q, q_src, *out, w, base, pos0, tokens, next, stream));
    next += 2 * tokens * hkv;
  }
  // The ring last: the chunk's positions [max(pos0, new_len - w), new_len) take their rows. A
  // failure from here puts the window's earlier rows back from the staging (the row of position
  // pos0 - w, also overwritten, is attended by no later call).
  RowCopy* rc = next;
  int64_t nr = 0;
  for (int64_t p = std::max(pos0, new_len - w); p < new_len; ++p) {
    for (int h = 0; h < hkv; ++h) {
      rc[nr++] = RowCopy{RingK(slot, layer, h, p % w), stage(h, 0, p - base)};
      rc[nr++] = RowCopy{RingV(slot, layer, h, p % w), stage(h, 1, p - base)};
    }
  }
  RowCopy* back = rc + nr;
  for (int64_t i = 0; i < nh; ++i) back[i] = RowCopy{const_cast<void*>(hc[i].src), hc[i].dst};
  Status st = device_->CopyRows(rc, nr, d, m.kv_dtype, m.kv_dtype, stream);
  if (st.ok()) st = EndCall(stream);
  if (st.ok() && out != nullptr && out->where == MemoryKind::kHost) {
    st = device_->SynchronizeStream(stream);
  }
  if (st.ok() || nh == 0) return st;
  Status restored = device_->CopyRows(back, nh, d, m.kv_dtype, m.kv_dtype, stream);
  if (restored.ok()) restored = device_->SynchronizeStream(stream);
  return WithRestore(std::move(st), restored);
}

Status RuntimeImpl::WindowChunkAttend(const TensorView& q, const void* q_src, const TensorView& out,
                                      int64_t w, int64_t base, int64_t pos0, int64_t tokens,
                                      RowCopy* copies, StreamHandle stream) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t gd = int64_t{dims_.group} * d, ld = win_.stage_rows;
  const int64_t rows = pos0 - base + tokens;
  // q to f32, [Hkv, T, G, D] (each KV head's queries contiguous), as the dense prefill does.
  RowCopy* qc = copies;
  RowCopy* oc = copies + tokens * hkv;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < hkv; ++h) {
      qc[t * hkv + h] = RowCopy{io_.q_f32 + (h * tokens + t) * gd,
                                static_cast<const char*>(q_src) + (t * hq + h * dims_.group) * d * DTypeSize(q.dtype)};
    }
  }
  KVF_RETURN_IF_ERROR(CopyRowsWide(qc, tokens * hkv, static_cast<int>(gd), q.dtype, DType::kF32, stream));
  // One list of head h's staging rows; query t's window is a slice of it.
  for (int h = 0; h < hkv; ++h) {
    for (int64_t j = 0; j < rows; ++j) {
      win_.k_rows[h * ld + j] = StageRow(win_.stage, ld, dims_.row_bytes, h, 0, j);
      win_.v_rows[h * ld + j] = StageRow(win_.stage, ld, dims_.row_bytes, h, 1, j);
    }
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t p = pos0 + t, first = std::max(base, p - w + 1), i = h * tokens + t;
      win_.items[i] = RowAttnItem{io_.q_f32 + i * gd, io_.o_gpu + i * gd, io_.lse_gpu + i * dims_.group,
                                  win_.k_rows + h * ld + (first - base),
                                  win_.v_rows + h * ld + (first - base),
                                  static_cast<int32_t>(p - first + 1)};
    }
  }
  const AttnParams params{dims_.group, d, m.kv_dtype, dims_.scale};
  if (device_->backend() == Backend::kHost) {
    // The host device runs kernels on the calling thread: the items go over the pool.
    pool_->ParallelFor(tokens * hkv, [&](int64_t i) { cpu::AttendRows(params, &win_.items[i], 1); });
  } else {
    KVF_RETURN_IF_ERROR(device_->AttendRows(params, win_.items, tokens * hkv, stream));
  }
  const bool out_direct = out.where == MemoryKind::kDevice || device_->backend() == Backend::kHost;
  char* out_dst = static_cast<char*>(out_direct ? out.data : io_.out_stage);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < hkv; ++h) {
      oc[t * hkv + h] = RowCopy{out_dst + (t * hq + h * dims_.group) * d * DTypeSize(out.dtype),
                                io_.o_gpu + (h * tokens + t) * gd};
    }
  }
  KVF_RETURN_IF_ERROR(CopyRowsWide(oc, tokens * hkv, static_cast<int>(gd), DType::kF32, out.dtype, stream));
  if (!out_direct) {
    KVF_RETURN_IF_ERROR(device_->CopyAsync(out.data, io_.out_stage,
                                           static_cast<size_t>(tokens * hq * d) * DTypeSize(out.dtype),
                                           stream));
  }
  return Status::Ok();
}

}  // namespace kvferry::detail
