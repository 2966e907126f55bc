// Copyright kvferry authors. Apache-2.0.
// The engine's attention through kvferry's Runtime.
#include "examples/llama/engine.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {

RuntimeConfig RuntimeConfigFor(const ModelConfig& model, RuntimeConfig base) {
  base.model.num_layers = model.num_layers;
  base.model.num_q_heads = model.num_q_heads;
  base.model.num_kv_heads = model.num_kv_heads;
  base.model.head_dim = model.head_dim;
  base.model.softmax_scale = 0.0f;
  return base;
}

Result<std::unique_ptr<RuntimeAttention>> RuntimeAttention::Create(const RuntimeConfig& config) {
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> runtime, Runtime::Create(config));
  std::unique_ptr<RuntimeAttention> attn(new RuntimeAttention(std::move(runtime)));
  attn->q_heads_ = config.model.num_q_heads;
  attn->kv_heads_ = config.model.num_kv_heads;
  attn->head_dim_ = config.model.head_dim;
  KVF_RETURN_IF_ERROR(attn->runtime_->AddSequence(attn->seq_));
  return attn;
}

Status RuntimeAttention::Prefill(int layer, int64_t n, const float* q, const float* k,
                                 const float* v, float* out) {
  const auto view = [this, n](const float* p, int heads) {
    return TensorView::Contiguous(const_cast<float*>(p), DType::kF32, MemoryKind::kHost,
                                  {n, heads, head_dim_});
  };
  return runtime_->Prefill(seq_, layer, view(q, q_heads_), view(k, kv_heads_),
                           view(v, kv_heads_), view(out, q_heads_));
}

Status RuntimeAttention::Decode(int layer, const float* q, const float* k, const float* v,
                                float* out) {
  const auto view = [this](const float* p, int heads) {
    return TensorView::Contiguous(const_cast<float*>(p), DType::kF32, MemoryKind::kHost,
                                  {1, heads, head_dim_});
  };
  const SequenceId seqs[1] = {seq_};
  return runtime_->Decode(seqs, layer, view(q, q_heads_), view(k, kv_heads_), view(v, kv_heads_),
                          view(out, q_heads_));
}

Status RuntimeAttention::Append(int layer, int64_t n, const float* k, const float* v) {
  const auto view = [this, n](const float* p) {
    return TensorView::Contiguous(const_cast<float*>(p), DType::kF32, MemoryKind::kHost,
                                  {n, kv_heads_, head_dim_});
  };
  return runtime_->Append(seq_, layer, view(k), view(v));
}

Status RuntimeAttention::Reset() {
  KVF_RETURN_IF_ERROR(runtime_->RemoveSequence(seq_));
  ++seq_;
  return runtime_->AddSequence(seq_);
}

}  // namespace kvferry::llama
