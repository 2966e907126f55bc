// Copyright kvferry authors. Apache-2.0.
// The engine's attention through kvferry's Runtime.
#include <algorithm>
#include <map>

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

Status RuntimeAttention::AddPart(const RuntimeConfig& config, int window) {
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> runtime, Runtime::Create(config));
  KVF_RETURN_IF_ERROR(runtime->AddSequence(seq_));
  parts_.push_back(Part{std::move(runtime), window});
  return Status::Ok();
}

Result<std::unique_ptr<RuntimeAttention>> RuntimeAttention::Create(const RuntimeConfig& config) {
  std::unique_ptr<RuntimeAttention> attn(new RuntimeAttention());
  attn->q_heads_ = config.model.num_q_heads;
  attn->kv_heads_ = config.model.num_kv_heads;
  attn->head_dim_ = config.model.head_dim;
  KVF_RETURN_IF_ERROR(attn->AddPart(config, 0));
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
  std::unique_ptr<RuntimeAttention> attn(new RuntimeAttention());
  attn->q_heads_ = config.model.num_q_heads;
  attn->kv_heads_ = config.model.num_kv_heads;
  attn->head_dim_ = config.model.head_dim;
  // Part 0: the global layers (created even when there are none, so that runtime() exists);
  // then one part per window width, in order of first appearance.
  std::map<int, int> part_of_window;
  std::vector<int> widths = {0};
  part_of_window[0] = 0;
  std::vector<int> count = {0};
  attn->part_of_.resize(model.num_layers);
  attn->local_of_.resize(model.num_layers);
  for (int l = 0; l < model.num_layers; ++l) {
    const int w = model.layer_window[l];
    KVF_CHECK_ARG(w >= 0, "layer ", l, " has window ", w);
    auto it = part_of_window.find(w);
    if (it == part_of_window.end()) {
      it = part_of_window.emplace(w, static_cast<int>(widths.size())).first;
      widths.push_back(w);
      count.push_back(0);
    }
    attn->part_of_[l] = it->second;
    attn->local_of_[l] = count[it->second]++;
  }
  attn->length_.assign(model.num_layers, 0);
  for (size_t p = 0; p < widths.size(); ++p) {
    RuntimeConfig rc = config;
    rc.model.num_layers = std::max(count[p], 1);
    if (widths[p] > 0) {
      rc.policy.name = "streaming";
      rc.policy.params.clear();
      rc.policy.budget_tokens = widths[p];
      rc.policy.budget_fraction = 0.0;
      rc.tiers.sink_tokens = 0;
      rc.tiers.window_tokens = widths[p];
      rc.tiers.bank_slots = 0;
    }
    Status st = attn->AddPart(rc, widths[p]);
    if (!st.ok()) {
      return Status(st.code(), detail::StrCat(widths[p] > 0 ? "sliding-window " : "global ",
                                              "layers' runtime: ", st.message()));
    }
  }
  return attn;
}

Runtime* RuntimeAttention::sliding_runtime(int window) {
  for (Part& p : parts_) {
    if (p.window == window && window > 0) return p.runtime.get();
  }
  return nullptr;
}

Status RuntimeAttention::Prefill(int layer, int64_t n, const float* q, const float* k,
                                 const float* v, float* out) {
  const auto view = [this](const float* p, int64_t rows, int heads) {
    return TensorView::Contiguous(const_cast<float*>(p), DType::kF32, MemoryKind::kHost,
                                  {rows, heads, head_dim_});
  };
  if (part_of_.empty()) {
    return parts_[0].runtime->Prefill(seq_, layer, view(q, n, q_heads_), view(k, n, kv_heads_),
                                      view(v, n, kv_heads_), view(out, n, q_heads_));
  }
  KVF_CHECK_ARG(layer >= 0 && layer < static_cast<int>(part_of_.size()), "layer ", layer,
                " out of range");
  Part& part = parts_[part_of_[layer]];
  const int local = local_of_[layer];
  int64_t& length = length_[layer];
  // Rows inside the first `window` positions: dense prefill is the window there.
  const int64_t dense_rows =
      part.window == 0 ? n : std::clamp<int64_t>(part.window - length, 0, n);
  if (dense_rows > 0) {
    KVF_RETURN_IF_ERROR(part.runtime->Prefill(seq_, local, view(q, dense_rows, q_heads_),
                                              view(k, dense_rows, kv_heads_),
                                              view(v, dense_rows, kv_heads_),
                                              view(out, dense_rows, q_heads_)));
    length += dense_rows;
  }
  const SequenceId seqs[1] = {seq_};
  const int64_t qs = static_cast<int64_t>(q_heads_) * head_dim_;
  const int64_t ks = static_cast<int64_t>(kv_heads_) * head_dim_;
  for (int64_t t = dense_rows; t < n; ++t) {  // sliding layer, past its first window: one by one
    KVF_RETURN_IF_ERROR(part.runtime->Decode(seqs, local, view(q + t * qs, 1, q_heads_),
                                             view(k + t * ks, 1, kv_heads_),
                                             view(v + t * ks, 1, kv_heads_),
                                             view(out + t * qs, 1, q_heads_)));
    ++length;
  }
  return Status::Ok();
}

Status RuntimeAttention::Decode(int layer, const float* q, const float* k, const float* v,
                                float* out) {
  const auto view = [this](const float* p, int heads) {
    return TensorView::Contiguous(const_cast<float*>(p), DType::kF32, MemoryKind::kHost,
                                  {1, heads, head_dim_});
  };
  const SequenceId seqs[1] = {seq_};
  if (part_of_.empty()) {
    return parts_[0].runtime->Decode(seqs, layer, view(q, q_heads_), view(k, kv_heads_),
                                     view(v, kv_heads_), view(out, q_heads_));
  }
  KVF_CHECK_ARG(layer >= 0 && layer < static_cast<int>(part_of_.size()), "layer ", layer,
                " out of range");
  KVF_RETURN_IF_ERROR(parts_[part_of_[layer]].runtime->Decode(
      seqs, local_of_[layer], view(q, q_heads_), view(k, kv_heads_), view(v, kv_heads_),
      view(out, q_heads_)));
  ++length_[layer];
  return Status::Ok();
}

Status RuntimeAttention::Append(int layer, int64_t n, const float* k, const float* v) {
  const auto view = [this, n](const float* p) {
    return TensorView::Contiguous(const_cast<float*>(p), DType::kF32, MemoryKind::kHost,
                                  {n, kv_heads_, head_dim_});
  };
  if (part_of_.empty()) return parts_[0].runtime->Append(seq_, layer, view(k), view(v));
  KVF_CHECK_ARG(layer >= 0 && layer < static_cast<int>(part_of_.size()), "layer ", layer,
                " out of range");
  KVF_RETURN_IF_ERROR(
      parts_[part_of_[layer]].runtime->Append(seq_, local_of_[layer], view(k), view(v)));
  length_[layer] += n;
  return Status::Ok();
}

Status RuntimeAttention::Reset() {
  for (Part& p : parts_) KVF_RETURN_IF_ERROR(p.runtime->RemoveSequence(seq_));
  ++seq_;
  for (Part& p : parts_) KVF_RETURN_IF_ERROR(p.runtime->AddSequence(seq_));
  std::fill(length_.begin(), length_.end(), 0);
  return Status::Ok();
}

}  // namespace kvferry::llama
