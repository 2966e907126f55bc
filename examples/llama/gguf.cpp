// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/gguf.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "kvferry/status_macros.h"

namespace kvferry::llama {
namespace {

using detail::StrCat;

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint64_t kMaxStringBytes = 1u << 24;
constexpr uint64_t kMaxDims = 4;
constexpr int kMaxArrayDepth = 4;

// Bounds-checked little-endian cursor over the file. Every read fails cleanly at the end.
class Cursor {
 public:
  explicit Cursor(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  [[nodiscard]] uint64_t pos() const { return pos_; }
  [[nodiscard]] uint64_t remaining() const { return bytes_.size() - pos_; }

  template <typename T>
  Status Read(T* out, const char* what) {
    if (remaining() < sizeof(T)) {
      return CorruptData(StrCat("gguf: truncated while reading ", what, " at byte ", pos_,
                                " (file has ", bytes_.size(), " bytes)"));
    }
    std::memcpy(out, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }

  Status ReadString(std::string* out, const char* what) {
    uint64_t len = 0;
    KVF_RETURN_IF_ERROR(Read(&len, what));
    if (len > kMaxStringBytes || len > remaining()) {
      return CorruptData(StrCat("gguf: ", what, " of length ", len, " at byte ", pos_ - 8,
                                " runs past the end of the file"));
    }
    out->assign(reinterpret_cast<const char*>(bytes_.data() + pos_), len);
    pos_ += len;
    return Status::Ok();
  }

  Status Skip(uint64_t n, const char* what) {
    if (n > remaining()) return CorruptData(StrCat("gguf: truncated in ", what));
    pos_ += n;
    return Status::Ok();
  }

 private:
  std::span<const uint8_t> bytes_;
  uint64_t pos_ = 0;
};

Result<uint64_t> ScalarBytes(GgufType type) {
  switch (type) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return uint64_t{1};
    case GgufType::kUint16:
    case GgufType::kInt16:
      return uint64_t{2};
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return uint64_t{4};
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return uint64_t{8};
    default:
      return CorruptData(StrCat("gguf: unknown metadata type ", static_cast<uint32_t>(type)));
  }
}

Result<double> ReadScalar(Cursor& c, GgufType type) {
  switch (type) {
#define KVF_GGUF_SCALAR(tag, ctype)                 \
  case GgufType::tag: {                             \
    ctype v{};                                      \
    KVF_RETURN_IF_ERROR(c.Read(&v, "metadata value")); \
    return static_cast<double>(v);                  \
  }
    KVF_GGUF_SCALAR(kUint8, uint8_t)
    KVF_GGUF_SCALAR(kInt8, int8_t)
    KVF_GGUF_SCALAR(kUint16, uint16_t)
    KVF_GGUF_SCALAR(kInt16, int16_t)
    KVF_GGUF_SCALAR(kUint32, uint32_t)
    KVF_GGUF_SCALAR(kInt32, int32_t)
    KVF_GGUF_SCALAR(kFloat32, float)
    KVF_GGUF_SCALAR(kUint64, uint64_t)
    KVF_GGUF_SCALAR(kInt64, int64_t)
    KVF_GGUF_SCALAR(kFloat64, double)
#undef KVF_GGUF_SCALAR
    case GgufType::kBool: {
      uint8_t v = 0;
      KVF_RETURN_IF_ERROR(c.Read(&v, "metadata bool"));
      return v != 0 ? 1.0 : 0.0;
    }
    default:
      return CorruptData(StrCat("gguf: unknown metadata type ", static_cast<uint32_t>(type)));
  }
}

Status ReadValue(Cursor& c, GgufType type, GgufValue* out, int depth) {
  out->type = type;
  if (type == GgufType::kString) return c.ReadString(&out->str, "metadata string");
  if (type != GgufType::kArray) {
    KVF_ASSIGN_OR_RETURN(out->num, ReadScalar(c, type));
    return Status::Ok();
  }
  if (depth >= kMaxArrayDepth) return CorruptData("gguf: metadata arrays nested too deeply");
  uint32_t elem = 0;
  uint64_t count = 0;
  KVF_RETURN_IF_ERROR(c.Read(&elem, "array element type"));
  KVF_RETURN_IF_ERROR(c.Read(&count, "array length"));
  out->elem_type = static_cast<GgufType>(elem);
  // Every element takes at least one byte, so a count beyond the remaining bytes is corrupt; this
  // also bounds the reservations below.
  if (count > c.remaining()) {
    return CorruptData(StrCat("gguf: array of ", count, " elements at byte ", c.pos(),
                              " runs past the end of the file"));
  }
  if (out->elem_type == GgufType::kString) {
    out->strs.resize(count);
    for (uint64_t i = 0; i < count; ++i) {
      KVF_RETURN_IF_ERROR(c.ReadString(&out->strs[i], "array string"));
    }
    return Status::Ok();
  }
  if (out->elem_type == GgufType::kArray) {
    for (uint64_t i = 0; i < count; ++i) {
      GgufValue nested;
      KVF_RETURN_IF_ERROR(ReadValue(c, GgufType::kArray, &nested, depth + 1));
    }
    return Status::Ok();
  }
  KVF_ASSIGN_OR_RETURN(uint64_t elem_bytes, ScalarBytes(out->elem_type));
  if (count > c.remaining() / elem_bytes) {
    return CorruptData(StrCat("gguf: array of ", count, " elements runs past the end of the file"));
  }
  out->nums.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    KVF_ASSIGN_OR_RETURN(out->nums[i], ReadScalar(c, out->elem_type));
  }
  return Status::Ok();
}

struct BlockLayout {
  uint64_t elems;  // elements per block
  uint64_t bytes;  // bytes per block
};

Result<BlockLayout> Layout(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      return BlockLayout{1, 4};
    case GgmlType::kF16:
    case GgmlType::kBF16:
      return BlockLayout{1, 2};
    case GgmlType::kQ4_0:
      return BlockLayout{32, 18};
    case GgmlType::kQ4_1:
      return BlockLayout{32, 20};
    case GgmlType::kQ5_0:
      return BlockLayout{32, 22};
    case GgmlType::kQ5_1:
      return BlockLayout{32, 24};
    case GgmlType::kQ8_0:
      return BlockLayout{32, 34};
    case GgmlType::kQ4_K:
      return BlockLayout{256, 144};
    case GgmlType::kQ5_K:
      return BlockLayout{256, 176};
    case GgmlType::kQ6_K:
      return BlockLayout{256, 210};
  }
  return Unimplemented(StrCat("gguf: tensor type ", GgmlTypeName(type), " is not supported"));
}

uint16_t LoadU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t LoadU32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block, packed in 12 bytes:
// bytes 0-3 hold the scales of sub-blocks 0-3 in their low 6 bits, bytes 4-7 the mins of 0-3;
// sub-blocks 4-7 take their low 4 bits from the nibbles of bytes 8-11 (scale low, min high) and
// their top 2 bits from the top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
void ScaleMinK4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q4_K (144 bytes per 256): f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles. Each
// 32 bytes of nibbles hold two sub-blocks of 32: the low nibbles sub-block 2i, the high 2i + 1.
// x = (d * scale) * q - (dmin * min). Q5_K (176 bytes) adds 32 bytes qh before the nibbles: bit
// s of qh[l] is the fifth bit of element l of sub-block s.
void DequantizeQ45K(const uint8_t* p, bool five, float* y) {
  const float d = HalfToFloat(LoadU16(p));
  const float dmin = HalfToFloat(LoadU16(p + 2));
  const uint8_t* scales = p + 4;
  const uint8_t* qh = p + 16;
  const uint8_t* ql = five ? p + 48 : p + 16;
  for (int j = 0; j < 4; ++j, ql += 32, y += 64) {
    uint8_t sc = 0, m = 0;
    ScaleMinK4(2 * j, scales, &sc, &m);
    const float d1 = d * static_cast<float>(sc);
    const float m1 = dmin * static_cast<float>(m);
    ScaleMinK4(2 * j + 1, scales, &sc, &m);
    const float d2 = d * static_cast<float>(sc);
    const float m2 = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) {
      int q1 = ql[l] & 0x0f;
      int q2 = ql[l] >> 4;
      if (five) {
        q1 += ((qh[l] >> (2 * j)) & 1) << 4;
        q2 += ((qh[l] >> (2 * j + 1)) & 1) << 4;
      }
      // Products stored before the subtraction, so that no compiler fuses them (the reference
      // rounds each).
      const volatile float a = d1 * static_cast<float>(q1);
      const volatile float b = d2 * static_cast<float>(q2);
      y[l] = a - m1;
      y[l + 32] = b - m2;
    }
  }
}

// Q6_K (210 bytes per 256): ql[128] low nibbles, qh[64] high 2 bits, 16 int8 scales (one per 16
// elements), f16 d. Each half of 128 elements uses 64 bytes of ql and 32 of qh: element l (0..31)
// of its four quarters takes ql[l] low / ql[l + 32] low / ql[l] high / ql[l + 32] high and bits
// 0-1 / 2-3 / 4-5 / 6-7 of qh[l]; x = (d * scale) * (q - 32).
void DequantizeQ6K(const uint8_t* p, float* y) {
  const uint8_t* ql = p;
  const uint8_t* qh = p + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
  const float d = HalfToFloat(LoadU16(p + 208));
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = (d * static_cast<float>(sc[is])) * static_cast<float>(q1);
      y[l + 32] = (d * static_cast<float>(sc[is + 2])) * static_cast<float>(q2);
      y[l + 64] = (d * static_cast<float>(sc[is + 4])) * static_cast<float>(q3);
      y[l + 96] = (d * static_cast<float>(sc[is + 6])) * static_cast<float>(q4);
    }
  }
}

}  // namespace

std::string GgmlTypeName(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: return "F32";
    case GgmlType::kF16: return "F16";
    case GgmlType::kBF16: return "BF16";
    case GgmlType::kQ4_0: return "Q4_0";
    case GgmlType::kQ4_1: return "Q4_1";
    case GgmlType::kQ5_0: return "Q5_0";
    case GgmlType::kQ5_1: return "Q5_1";
    case GgmlType::kQ8_0: return "Q8_0";
    case GgmlType::kQ4_K: return "Q4_K";
    case GgmlType::kQ5_K: return "Q5_K";
    case GgmlType::kQ6_K: return "Q6_K";
  }
  return StrCat("type ", type);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24.
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

float Bf16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

Result<uint64_t> GgmlBytes(uint32_t type, uint64_t count) {
  KVF_ASSIGN_OR_RETURN(BlockLayout layout, Layout(type));
  if (count % layout.elems != 0) {
    return CorruptData(StrCat("gguf: ", count, " elements of ", GgmlTypeName(type),
                              " are not a whole number of ", layout.elems, "-element blocks"));
  }
  return count / layout.elems * layout.bytes;
}

Status DequantizeRow(uint32_t type, std::span<const uint8_t> src, int64_t count, float* dst) {
  KVF_ASSIGN_OR_RETURN(uint64_t need, GgmlBytes(type, static_cast<uint64_t>(count)));
  KVF_CHECK_ARG(src.size() == need, "dequantize: ", src.size(), " bytes for ", count,
                " elements of ", GgmlTypeName(type), " (need ", need, ")");
  const uint8_t* p = src.data();
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      std::memcpy(dst, p, count * sizeof(float));
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < count; ++i) dst[i] = HalfToFloat(LoadU16(p + 2 * i));
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < count; ++i) dst[i] = Bf16ToFloat(LoadU16(p + 2 * i));
      break;
    case GgmlType::kQ4_0:
      // block: f16 scale d, 16 bytes of nibbles; low nibbles are elements 0..15, high 16..31.
      for (int64_t b = 0; b < count / 32; ++b, p += 18, dst += 32) {
        const float d = HalfToFloat(LoadU16(p));
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>((p[2 + j] & 0x0f) - 8) * d;
          dst[j + 16] = static_cast<float>((p[2 + j] >> 4) - 8) * d;
        }
      }
      break;
    case GgmlType::kQ4_1:
      // block: f16 scale d, f16 minimum m, 16 bytes of nibbles (same order as Q4_0).
      for (int64_t b = 0; b < count / 32; ++b, p += 20, dst += 32) {
        const float d = HalfToFloat(LoadU16(p));
        const float m = HalfToFloat(LoadU16(p + 2));
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>(p[4 + j] & 0x0f) * d + m;
          dst[j + 16] = static_cast<float>(p[4 + j] >> 4) * d + m;
        }
      }
      break;
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1: {
      // block: f16 scale d, (Q5_1: f16 minimum m,) 32 fifth bits (u32 LE), 16 bytes of nibbles;
      // element j < 16 is the low nibble of byte j plus bit j, j + 16 the high nibble plus bit
      // j + 16. Q5_0: x = (q - 16) d; Q5_1: x = q d + m.
      const bool one = static_cast<GgmlType>(type) == GgmlType::kQ5_1;
      const int bytes = one ? 24 : 22;
      for (int64_t b = 0; b < count / 32; ++b, p += bytes, dst += 32) {
        const float d = HalfToFloat(LoadU16(p));
        const float m = one ? HalfToFloat(LoadU16(p + 2)) : 0.0f;
        const uint8_t* q = p + (one ? 4 : 2);
        const uint32_t qh = LoadU32(q);
        q += 4;
        for (int j = 0; j < 16; ++j) {
          const int x0 = (q[j] & 0x0f) | static_cast<int>(((qh >> j) << 4) & 0x10);
          const int x1 = (q[j] >> 4) | static_cast<int>((qh >> (j + 12)) & 0x10);
          if (one) {
            const volatile float a = static_cast<float>(x0) * d;
            const volatile float c = static_cast<float>(x1) * d;
            dst[j] = a + m;
            dst[j + 16] = c + m;
          } else {
            dst[j] = static_cast<float>(x0 - 16) * d;
            dst[j + 16] = static_cast<float>(x1 - 16) * d;
          }
        }
      }
      break;
    }
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      const bool five = static_cast<GgmlType>(type) == GgmlType::kQ5_K;
      const int bytes = five ? 176 : 144;
      for (int64_t b = 0; b < count / 256; ++b, p += bytes, dst += 256) DequantizeQ45K(p, five, dst);
      break;
    }
    case GgmlType::kQ6_K:
      for (int64_t b = 0; b < count / 256; ++b, p += 210, dst += 256) DequantizeQ6K(p, dst);
      break;
    case GgmlType::kQ8_0:
      // block: f16 scale d, 32 int8.
      for (int64_t b = 0; b < count / 32; ++b, p += 34, dst += 32) {
        const float d = HalfToFloat(LoadU16(p));
        for (int j = 0; j < 32; ++j) dst[j] = static_cast<float>(static_cast<int8_t>(p[2 + j])) * d;
      }
      break;
  }
  return Status::Ok();
}

uint64_t GgufTensorInfo::numel() const {
  uint64_t n = 1;
  for (uint64_t d : dims) n *= d;
  return n;
}

Result<GgufFile> GgufFile::Parse(std::span<const uint8_t> bytes) {
  GgufFile file;
  Cursor c(bytes);
  uint32_t magic = 0;
  KVF_RETURN_IF_ERROR(c.Read(&magic, "magic"));
  if (magic != kGgufMagic) return CorruptData("gguf: bad magic (not a GGUF file)");
  KVF_RETURN_IF_ERROR(c.Read(&file.version_, "version"));
  if (file.version_ != 2 && file.version_ != 3) {
    return CorruptData(StrCat("gguf: unsupported version ", file.version_, " (need 2 or 3)"));
  }
  uint64_t num_tensors = 0;
  uint64_t num_kv = 0;
  KVF_RETURN_IF_ERROR(c.Read(&num_tensors, "tensor count"));
  KVF_RETURN_IF_ERROR(c.Read(&num_kv, "metadata count"));
  // Each entry needs well over 8 bytes; larger counts cannot fit in the file.
  if (num_tensors > c.remaining() / 8 || num_kv > c.remaining() / 8) {
    return CorruptData(StrCat("gguf: header claims ", num_tensors, " tensors and ", num_kv,
                              " metadata entries, more than the file can hold"));
  }
  for (uint64_t i = 0; i < num_kv; ++i) {
    std::string key;
    KVF_RETURN_IF_ERROR(c.ReadString(&key, "metadata key"));
    uint32_t type = 0;
    KVF_RETURN_IF_ERROR(c.Read(&type, "metadata type"));
    GgufValue value;
    KVF_RETURN_IF_ERROR(ReadValue(c, static_cast<GgufType>(type), &value, 0));
    file.metadata_[key] = std::move(value);
  }
  // Each directory entry takes at least 32 bytes (name length, rank, one dim, type, offset).
  file.tensors_.reserve(std::min<uint64_t>(num_tensors, c.remaining() / 32));
  for (uint64_t i = 0; i < num_tensors; ++i) {
    GgufTensorInfo info;
    KVF_RETURN_IF_ERROR(c.ReadString(&info.name, "tensor name"));
    uint32_t ndim = 0;
    KVF_RETURN_IF_ERROR(c.Read(&ndim, "tensor rank"));
    if (ndim == 0 || ndim > kMaxDims) {
      return CorruptData(StrCat("gguf: tensor '", info.name, "' has rank ", ndim));
    }
    info.dims.resize(ndim);
    uint64_t numel = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      KVF_RETURN_IF_ERROR(c.Read(&info.dims[d], "tensor dim"));
      if (info.dims[d] == 0 || info.dims[d] > (uint64_t{1} << 40) / numel) {
        return CorruptData(StrCat("gguf: tensor '", info.name, "' has bad dim ", info.dims[d]));
      }
      numel *= info.dims[d];
    }
    KVF_RETURN_IF_ERROR(c.Read(&info.type, "tensor type"));
    KVF_RETURN_IF_ERROR(c.Read(&info.offset, "tensor offset"));
    auto bytes_or = GgmlBytes(info.type, numel);
    if (!bytes_or.ok()) {
      return Status(bytes_or.status().code(),
                    StrCat("tensor '", info.name, "': ", bytes_or.status().message()));
    }
    info.num_bytes = *bytes_or;
    if (info.dims[0] % Layout(info.type).value().elems != 0) {
      return CorruptData(StrCat("gguf: tensor '", info.name, "' rows of ", info.dims[0],
                                " are not whole blocks of ", GgmlTypeName(info.type)));
    }
    if (file.tensor_index_.count(info.name) != 0) {
      return CorruptData(StrCat("gguf: duplicate tensor '", info.name, "'"));
    }
    file.tensor_index_[info.name] = file.tensors_.size();
    file.tensors_.push_back(std::move(info));
  }
  KVF_ASSIGN_OR_RETURN(int64_t alignment, file.GetIntOr("general.alignment", 32));
  if (alignment <= 0 || alignment > 65536 || (alignment & (alignment - 1)) != 0) {
    return CorruptData(StrCat("gguf: bad general.alignment ", alignment));
  }
  const uint64_t align = static_cast<uint64_t>(alignment);
  const uint64_t data_start = (c.pos() + align - 1) / align * align;
  if (data_start > bytes.size()) {
    // A file of metadata only (a tokenizer, say) may end without padding to its empty data.
    if (!file.tensors_.empty()) return CorruptData("gguf: file ends before its data section");
    return file;
  }
  file.data_ = bytes.subspan(data_start);
  for (const GgufTensorInfo& t : file.tensors_) {
    if (t.offset % align != 0 || t.offset > file.data_.size() ||
        t.num_bytes > file.data_.size() - t.offset) {
      return CorruptData(StrCat("gguf: data of tensor '", t.name, "' (offset ", t.offset, ", ",
                                t.num_bytes, " bytes) lies outside the file's ",
                                file.data_.size(), "-byte data section"));
    }
  }
  return file;
}

Result<const GgufValue*> GgufFile::Find(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return NotFound(StrCat("gguf: no metadata key '", key, "'"));
  return &it->second;
}

Result<int64_t> GgufFile::GetInt(const std::string& key) const {
  KVF_ASSIGN_OR_RETURN(const GgufValue* v, Find(key));
  if (v->type == GgufType::kString || v->type == GgufType::kArray ||
      v->type == GgufType::kFloat32 || v->type == GgufType::kFloat64) {
    return CorruptData(StrCat("gguf: metadata '", key, "' is not an integer"));
  }
  if (!(std::abs(v->num) < 9.0e15)) {
    return CorruptData(StrCat("gguf: metadata '", key, "' is out of range"));
  }
  return static_cast<int64_t>(v->num);
}

Result<double> GgufFile::GetFloat(const std::string& key) const {
  KVF_ASSIGN_OR_RETURN(const GgufValue* v, Find(key));
  if (v->type == GgufType::kString || v->type == GgufType::kArray) {
    return CorruptData(StrCat("gguf: metadata '", key, "' is not a number"));
  }
  return v->num;
}

Result<std::string> GgufFile::GetString(const std::string& key) const {
  KVF_ASSIGN_OR_RETURN(const GgufValue* v, Find(key));
  if (v->type != GgufType::kString) {
    return CorruptData(StrCat("gguf: metadata '", key, "' is not a string"));
  }
  return v->str;
}

Result<int64_t> GgufFile::GetIntOr(const std::string& key, int64_t fallback) const {
  if (metadata_.count(key) == 0) return fallback;
  return GetInt(key);
}

Result<double> GgufFile::GetFloatOr(const std::string& key, double fallback) const {
  if (metadata_.count(key) == 0) return fallback;
  return GetFloat(key);
}

Result<const GgufTensorInfo*> GgufFile::FindTensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) return NotFound(StrCat("gguf: no tensor '", name, "'"));
  return &tensors_[it->second];
}

Result<std::vector<float>> GgufFile::Dequantize(const std::string& name) const {
  KVF_ASSIGN_OR_RETURN(const GgufTensorInfo* t, FindTensor(name));
  std::vector<float> out(t->numel());
  KVF_RETURN_IF_ERROR(DequantizeRow(t->type, data_.subspan(t->offset, t->num_bytes),
                                    static_cast<int64_t>(out.size()), out.data()));
  return out;
}

Result<std::vector<uint8_t>> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return IoError(StrCat("cannot open '", path, "'"));
  const std::streamoff size = in.tellg();
  if (size < 0) return IoError(StrCat("cannot size '", path, "'"));
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) {
    return IoError(StrCat("cannot read '", path, "'"));
  }
  return bytes;
}

}  // namespace kvferry::llama
