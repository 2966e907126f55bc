// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file gguf.h
/// \brief A reader for GGUF v2/v3 files: metadata, tensor directory and dequantisation to f32.
///
/// The reader parses a byte span that the caller owns and keeps alive (the whole file in memory).
/// Every length, count, offset and shape is checked against the span before it is used, so a
/// truncated or corrupted file yields kCorruptData and never reads out of bounds.

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::llama {

/// GGUF metadata value types (the file's numbering).
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

/// ggml tensor types this reader can dequantise (the file's numbering).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,  ///< super-blocks of 256: f16 d, dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
  kQ5_K = 13,  ///< as Q4_K plus 32 bytes of fifth bits
  kQ6_K = 14,  ///< super-blocks of 256: 128 bytes low nibbles, 64 of high 2 bits, 16 int8 scales, f16 d
  kBF16 = 30,
};

/// "F32", "Q4_1", ...; "type N" for types the reader does not know.
std::string GgmlTypeName(uint32_t type);

/// \brief One metadata value. Scalars live in `num` (integers are exact up to 2^53) or `str`;
/// arrays of strings in `strs`, arrays of numbers and bools in `nums`. Arrays of arrays are
/// validated and skipped (none of the keys the engine reads uses them).
struct GgufValue {
  GgufType type = GgufType::kUint8;
  GgufType elem_type = GgufType::kUint8;  ///< for kArray
  double num = 0;
  std::string str;
  std::vector<std::string> strs;
  std::vector<double> nums;
};

/// \brief One entry of the tensor directory. dims[0] is the innermost (contiguous) dimension, as
/// in ggml: a weight of shape [out, in] in PyTorch has dims {in, out}.
struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> dims;
  uint32_t type = 0;
  uint64_t offset = 0;   ///< from the start of the data section
  uint64_t num_bytes = 0;
  [[nodiscard]] uint64_t numel() const;
};

/// \brief A parsed GGUF file: a view over the caller's bytes plus the decoded directory.
class GgufFile {
 public:
  /// Parses header, metadata and tensor directory of \p bytes; checks that every tensor's data
  /// lies inside \p bytes and that its type is one this reader can dequantise.
  static Result<GgufFile> Parse(std::span<const uint8_t> bytes);

  [[nodiscard]] uint32_t version() const { return version_; }
  [[nodiscard]] const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  [[nodiscard]] const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  /// Metadata lookups; kNotFound if the key is absent, kCorruptData if it has the wrong kind.
  [[nodiscard]] Result<const GgufValue*> Find(const std::string& key) const;
  [[nodiscard]] Result<int64_t> GetInt(const std::string& key) const;
  [[nodiscard]] Result<double> GetFloat(const std::string& key) const;
  [[nodiscard]] Result<std::string> GetString(const std::string& key) const;
  /// GetInt, or \p fallback if the key is absent (a key of the wrong kind is still an error).
  [[nodiscard]] Result<int64_t> GetIntOr(const std::string& key, int64_t fallback) const;
  [[nodiscard]] Result<double> GetFloatOr(const std::string& key, double fallback) const;

  [[nodiscard]] Result<const GgufTensorInfo*> FindTensor(const std::string& name) const;
  /// Dequantises tensor \p name to f32, row-major with dims[0] innermost.
  [[nodiscard]] Result<std::vector<float>> Dequantize(const std::string& name) const;

 private:
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
  std::span<const uint8_t> data_;  ///< the data section
};

/// IEEE half and bfloat16 to float.
float HalfToFloat(uint16_t h);
float Bf16ToFloat(uint16_t h);

/// Dequantises \p count elements of ggml \p type from \p src (which holds exactly the bytes of
/// those elements) into \p dst. \p count must be a multiple of the type's block size.
Status DequantizeRow(uint32_t type, std::span<const uint8_t> src, int64_t count, float* dst);

/// Bytes that \p count elements of ggml \p type occupy, or an error for unknown types and counts
/// that are not a multiple of the block size.
Result<uint64_t> GgmlBytes(uint32_t type, uint64_t count);

/// Reads a whole file into memory.
Result<std::vector<uint8_t>> ReadFileBytes(const std::string& path);

}  // namespace kvferry::llama
