// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file model.h
/// \brief Weights of a Llama-family model, dequantised to f32, loaded from GGUF or llama2.c files.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::llama {

/// How RoPE pairs the dimensions of a head.
enum class RopeStyle : uint8_t {
  /// Dimension i pairs with i + head_dim/2 (Hugging Face "rotate_half"). GGUF Llama weights are
  /// un-permuted to this layout at load, so Q and K match Hugging Face's element for element.
  kHalves = 0,
  /// Dimension 2i pairs with 2i+1 (llama2.c, Meta's original checkpoints).
  kAdjacent = 1,
};

struct ModelConfig {
  std::string name;
  int dim = 0;
  int hidden_dim = 0;
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int max_context = 0;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  RopeStyle rope_style = RopeStyle::kHalves;
};

/// A row-major [rows, cols] matrix; a linear layer y = W x has W of [out, in].
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> data;
};

struct LayerWeights {
  std::vector<float> attn_norm;  ///< [dim]
  std::vector<float> ffn_norm;   ///< [dim]
  Matrix wq;                     ///< [num_q_heads * head_dim, dim]
  Matrix wk;                     ///< [num_kv_heads * head_dim, dim]
  Matrix wv;                     ///< [num_kv_heads * head_dim, dim]
  Matrix wo;                     ///< [dim, num_q_heads * head_dim]
  Matrix w_gate;                 ///< [hidden, dim]
  Matrix w_up;                   ///< [hidden, dim]
  Matrix w_down;                 ///< [dim, hidden]
};

/// \brief A loaded model. Immutable after load; safe to share between threads and engines.
struct Model {
  ModelConfig config;
  Matrix token_embedding;  ///< [vocab, dim]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  ///< [dim]
  Matrix output;                  ///< [vocab, dim]; empty when tied to token_embedding
  [[nodiscard]] const Matrix& classifier() const {
    return output.data.empty() ? token_embedding : output;
  }
};

/// Loads a GGUF file of architecture "llama" (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors).
Result<Model> LoadGgufModel(const std::string& path);
/// Loads a GGUF image already in memory (used by the fuzz test).
Result<Model> LoadGgufModelFromBytes(std::span<const uint8_t> bytes);
/// Loads a llama2.c "legacy v0" checkpoint (header of 7 int32, then f32 arrays).
Result<Model> LoadLlama2cModel(const std::string& path);
Result<Model> LoadLlama2cModelFromBytes(std::span<const uint8_t> bytes);
/// Chooses the loader by the file's magic ("GGUF") or falls back to llama2.c.
Result<Model> LoadModel(const std::string& path);

}  // namespace kvferry::llama
