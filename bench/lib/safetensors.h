// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file safetensors.h
/// \brief A small reader and writer of the safetensors format, and the attention-trace layout that
/// kvferry-llama --dump-trace writes and kvferry-bench --trace reads.
///
/// Format: u64 little-endian header length N, N bytes of JSON
/// ({"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
///   "__metadata__": {"key": "value", ...}}), then the tensor bytes (offsets relative to them).
/// Only the standard library and kvferry's public headers are used.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::bench {

/// \brief One tensor: its safetensors dtype ("F32", "BF16", "F16", "I32", "I64", "U8", ...),
/// shape and raw little-endian bytes.
struct SafetensorsTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  [[nodiscard]] int64_t numel() const;
};

/// \brief A whole safetensors file in memory.
struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, SafetensorsTensor> tensors;

  /// The tensor \p name converted to f32 (from F32, F16, BF16, I32 or I64); kNotFound if absent.
  [[nodiscard]] Result<std::vector<float>> GetFloat(const std::string& name) const;
  /// The tensor \p name as int32 (from I32 or I64).
  [[nodiscard]] Result<std::vector<int32_t>> GetInt32(const std::string& name) const;
};

/// Bytes per element of a safetensors dtype, or 0 if unknown.
int SafetensorsDTypeSize(const std::string& dtype);

/// Parses a safetensors image; every offset and shape is checked against the image.
Result<SafetensorsFile> ParseSafetensors(const std::vector<uint8_t>& bytes);
Result<SafetensorsFile> ReadSafetensors(const std::string& path);
/// Serialises \p file (tensors in name order, header padded to 8 bytes).
Result<std::vector<uint8_t>> SerializeSafetensors(const SafetensorsFile& file);
Status WriteSafetensors(const std::string& path, const SafetensorsFile& file);

/// Adds an f32 tensor, stored as "F32" or, with \p as_bf16, rounded to "BF16".
void AddFloatTensor(SafetensorsFile& file, const std::string& name, std::vector<int64_t> shape,
                    const float* data, bool as_bf16);

/// \brief Post-RoPE q, k and v of one layer over positions [0, num_tokens) of a trace.
struct TraceLayer {
  int layer = 0;
  int64_t num_tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  std::vector<float> q;  ///< [num_tokens, num_q_heads, head_dim]
  std::vector<float> k;  ///< [num_tokens, num_kv_heads, head_dim]
  std::vector<float> v;  ///< [num_tokens, num_kv_heads, head_dim]
};

/// \brief An attention trace: tensors "layer.<l>.q" [T, Hq, D], "layer.<l>.k" and "layer.<l>.v"
/// [T, Hkv, D] (F32, BF16 or F16) for each traced layer, plus free-form metadata (model, positions).
struct Trace {
  std::map<std::string, std::string> metadata;
  std::vector<TraceLayer> layers;  ///< ascending layer order
};

/// Loads a trace file into memory, converting every tensor to f32. Fails with a message naming
/// the tensor if a layer lacks q, k or v or their shapes disagree.
Result<Trace> LoadTrace(const std::string& path);
/// The same from a safetensors image in memory.
Result<Trace> LoadTraceFromBytes(const std::vector<uint8_t>& bytes);

}  // namespace kvferry::bench
