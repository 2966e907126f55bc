// Copyright kvferry authors. Apache-2.0.
// The engine's attention through kvferry's Runtime.
#include <algorithm>

#include "examples/llama/engine.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {

RuntimeConfig RuntimeConfigFor(const ModelConfig& model, RuntimeConfig base) {
  base.model.num_layers = model.num_layers;
  base.model.num_q_heads = model.num_q_heads;
  base.model.num_kv_heads = model.num_kv_heads;
  base.model.head_dim = model.head_dim;
  base.model.softmax_scale = model.attn_scale;  // 0: 1/sqrt(head_dim)
  return base;
}

Result<std::unique_ptr<RuntimeAttention>> RuntimeAttention::Create(const RuntimeConfig& config) {
  std::unique_ptr<RuntimeAttention> attn(new RuntimeAttention());
  attn->q_heads_ = config.model.num_q_heads;
  attn->kv_heads_ = config.model.num_kv_heads;
  attn->head_dim_ = config.model.head_dim;
  KVF_ASSIGN_OR_RETURN(attn->runtime_, Runtime::Create(config));
  KVF_RETURN_IF_ERROR(attn->runtime_->AddSequence(attn->seq_));
  return attn;
}

Result<std::unique_ptr<RuntimeAttention>> RuntimeAttention::Create(const RuntimeConfig& config,
                                                                   const ModelConfig& model) {
  const bool sliding = std::any_of(model.layer_window.begin(), model.layer_window.end(),
                                   [](int w) { return w > 0; });
  if (!sliding) return Create(config);
  KVF_CHECK_ARG(config.model.num_layers == model.num_layers &&
                    static_cast<int>(model.layer_window.size()) == model.num_layers,
                "runtime attention: a configuration of ", config.model.num_layers,
                " layers for a model of ", model.num_layers, " (shape it with RuntimeConfigFor)");
  RuntimeConfig rc = config;
  // A window at least the sequence's capacity attends every position: the same, clamped.
  rc.model.layer_window = model.layer_window;
  for (int& w : rc.model.layer_window) {
    w = static_cast<int>(std::min<int64_t>(w, rc.capacity.max_tokens_per_sequence));
  }
  return Create(rc);
}

TensorView RuntimeAttention::View(const float* p, int64_t rows, int heads, MemoryKind where) const {
  return TensorView::Contiguous(const_cast<float*>(p), DType::kF32, where, {rows, heads, head_dim_});
}

Status RuntimeAttention::Prefill(int layer, int64_t n, const float* q, const float* k,
                                 const float* v, float* out) {
  return runtime_->Prefill(seq_, layer, View(q, n, q_heads_), View(k, n, kv_heads_),
                           View(v, n, kv_heads_), View(out, n, q_heads_));
}

Status RuntimeAttention::Decode(int layer, const float* q, const float* k, const float* v,
                                float* out) {
  const SequenceId seqs[1] = {seq_};
  return runtime_->Decode(seqs, layer, View(q, 1, q_heads_), View(k, 1, kv_heads_),
                          View(v, 1, kv_heads_), View(out, 1, q_heads_));
}

bool RuntimeAttention::decodes_on_device() const { return runtime_->backend() == Backend::kCuda; }

bool RuntimeAttention::decode_capture_safe() const {
  return runtime_->backend() == Backend::kCuda && runtime_->decode_is_capture_safe();
}

Status RuntimeAttention::PlanDecodeOnDevice(void* stream) {
  const SequenceId seqs[1] = {seq_};
  return runtime_->PlanDecode(seqs, static_cast<StreamHandle>(stream));
}

Status RuntimeAttention::DecodeOnDevice(int layer, const float* q, const float* k, const float* v,
                                        float* out, void* stream) {
  const SequenceId seqs[1] = {seq_};
  constexpr MemoryKind kDev = MemoryKind::kDevice;
  return runtime_->Decode(seqs, layer, View(q, 1, q_heads_, kDev), View(k, 1, kv_heads_, kDev),
                          View(v, 1, kv_heads_, kDev), View(out, 1, q_heads_, kDev),
                          static_cast<StreamHandle>(stream));
}

Status RuntimeAttention::Append(int layer, int64_t n, const float* k, const float* v) {
  return runtime_->Append(seq_, layer, View(k, n, kv_heads_), View(v, n, kv_heads_));
}

Status RuntimeAttention::Reset() {
  KVF_RETURN_IF_ERROR(runtime_->RemoveSequence(seq_));
  ++seq_;
  return runtime_->AddSequence(seq_);
}

}  // namespace kvferry::llama
