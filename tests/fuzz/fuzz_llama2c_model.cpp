// Copyright kvferry authors. Apache-2.0.
// Fuzzes the llama2.c checkpoint reader ("legacy v0": 7 int32 then f32 arrays): any input gives a
// model whose arrays match its header, or an error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "examples/llama/model.h"

using namespace kvferry::llama;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto model = LoadLlama2cModelFromBytes(std::span<const uint8_t>(data, size));
  if (!model.ok()) {
    if (model.status().message().empty()) std::abort();
    return 0;
  }
  const ModelConfig& c = model->config;
  const size_t dim = static_cast<size_t>(c.dim);
  if (model->layers.size() != static_cast<size_t>(c.num_layers)) std::abort();
  if (model->token_embedding.data.size() != static_cast<size_t>(c.vocab_size) * dim) std::abort();
  if (model->final_norm.size() != dim) std::abort();
  for (const LayerWeights& w : model->layers) {
    if (w.wq.data.size() != dim * dim || w.attn_norm.size() != dim) std::abort();
    if (w.w_down.data.size() != dim * static_cast<size_t>(c.hidden_dim)) std::abort();
  }
  return 0;
}
