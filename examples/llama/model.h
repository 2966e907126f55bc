// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file model.h
/// \brief Weights of a Llama-family model (Llama, or Gemma 3's variant of it), dequantised to f32,
/// loaded from GGUF or llama2.c files.

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

/// The MLP's gate activation: SwiGLU (Llama) or GeGLU with tanh-approximated GELU (Gemma).
enum class Activation : uint8_t { kSilu = 0, kGeluTanh = 1 };

/// The architectures the engine runs.
enum class Arch : uint8_t { kLlama = 0, kGemma3 = 1 };

struct ModelConfig {
  std::string name;
  Arch arch = Arch::kLlama;
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
  // Gemma 3 (the Llama defaults leave a Llama model as it was):
  /// Softmax scale of attention; 0 means 1/sqrt(head_dim).
  float attn_scale = 0.0f;
  /// Multiplies the token embedding (Gemma: sqrt(dim)).
  float embed_scale = 1.0f;
  Activation activation = Activation::kSilu;
  /// Per layer: 0 = global (attends the whole context, RoPE base rope_theta), w > 0 = sliding
  /// window (attends its last w tokens, itself included; RoPE base rope_theta_sliding). Empty:
  /// every layer global.
  std::vector<int> layer_window;
  float rope_theta_sliding = 10000.0f;
  /// Linear RoPE scaling of the global layers (positions divided by it; Gemma 3 4B+ use 8).
  float rope_scale_global = 1.0f;
  [[nodiscard]] int window_of(int layer) const {
    return layer_window.empty() ? 0 : layer_window[static_cast<size_t>(layer)];
  }
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
  // Gemma 3 only (empty otherwise). Stored as the GGUF holds them, Gemma's (1 + w) already folded.
  std::vector<float> q_norm;          ///< [head_dim]: RMSNorm of every query head
  std::vector<float> k_norm;          ///< [head_dim]: RMSNorm of every key head
  std::vector<float> post_attn_norm;  ///< [dim]: RMSNorm of the attention's output
  std::vector<float> post_ffn_norm;   ///< [dim]: RMSNorm of the MLP's output
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

/// Loads a GGUF file of architecture "llama" or "gemma3" (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/
/// Q5_1/Q4_K/Q5_K/Q6_K tensors).
Result<Model> LoadGgufModel(const std::string& path);
/// Loads a GGUF image already in memory (used by the fuzz test).
Result<Model> LoadGgufModelFromBytes(std::span<const uint8_t> bytes);
/// Loads a llama2.c "legacy v0" checkpoint (header of 7 int32, then f32 arrays).
Result<Model> LoadLlama2cModel(const std::string& path);
Result<Model> LoadLlama2cModelFromBytes(std::span<const uint8_t> bytes);
/// Chooses the loader by the file's magic ("GGUF") or falls back to llama2.c.
Result<Model> LoadModel(const std::string& path);

}  // namespace kvferry::llama
