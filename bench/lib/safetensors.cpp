// Copyright kvferry authors. Apache-2.0.
#include "bench/lib/safetensors.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <variant>

#include "bench/lib/utf8.h"

namespace kvferry::bench {
namespace {

#define KVF_ST_RETURN_IF_ERROR(expr)        \
  do {                                      \
    ::kvferry::Status st_ = (expr);         \
    if (!st_.ok()) return st_;              \
  } while (0)

template <typename... Args>
std::string Cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// ---- a minimal JSON reader, enough for safetensors headers -----------------------------------

struct Json;
using JsonObject = std::map<std::string, Json>;
using JsonArray = std::vector<Json>;
struct Json {
  // null, bool, number (double), string, array, object
  std::variant<std::monostate, bool, double, std::string, std::shared_ptr<JsonArray>,
               std::shared_ptr<JsonObject>>
      v;
};

class JsonParser {
 public:
  explicit JsonParser(std::string_view s) : s_(s) {}

  Status Parse(Json* out) {
    KVF_ST_RETURN_IF_ERROR(Value(out, 0));
    SkipSpace();
    if (i_ != s_.size()) return Error("trailing characters");
    return Status::Ok();
  }

 private:
  Status Error(const char* what) const {
    return CorruptData(Cat("safetensors: bad JSON header (", what, " at byte ", i_, ")"));
  }
  void SkipSpace() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) {
      ++i_;
    }
  }
  Status Value(Json* out, int depth) {
    if (depth > 16) return Error("nesting too deep");
    SkipSpace();
    if (i_ >= s_.size()) return Error("unexpected end");
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      auto obj = std::make_shared<JsonObject>();
      SkipSpace();
      if (i_ < s_.size() && s_[i_] == '}') {
        ++i_;
        out->v = obj;
        return Status::Ok();
      }
      while (true) {
        SkipSpace();
        std::string key;
        KVF_ST_RETURN_IF_ERROR(String(&key));
        SkipSpace();
        if (i_ >= s_.size() || s_[i_] != ':') return Error("expected ':'");
        ++i_;
        Json val;
        KVF_ST_RETURN_IF_ERROR(Value(&val, depth + 1));
        (*obj)[key] = std::move(val);
        SkipSpace();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == '}') {
          ++i_;
          break;
        }
        return Error("expected ',' or '}'");
      }
      out->v = obj;
      return Status::Ok();
    }
    if (c == '[') {
      ++i_;
      auto arr = std::make_shared<JsonArray>();
      SkipSpace();
      if (i_ < s_.size() && s_[i_] == ']') {
        ++i_;
        out->v = arr;
        return Status::Ok();
      }
      while (true) {
        Json val;
        KVF_ST_RETURN_IF_ERROR(Value(&val, depth + 1));
        arr->push_back(std::move(val));
        SkipSpace();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == ']') {
          ++i_;
          break;
        }
        return Error("expected ',' or ']'");
      }
      out->v = arr;
      return Status::Ok();
    }
    if (c == '"') {
      std::string str;
      KVF_ST_RETURN_IF_ERROR(String(&str));
      out->v = std::move(str);
      return Status::Ok();
    }
    if (s_.compare(i_, 4, "true") == 0) {
      i_ += 4;
      out->v = true;
      return Status::Ok();
    }
    if (s_.compare(i_, 5, "false") == 0) {
      i_ += 5;
      out->v = false;
      return Status::Ok();
    }
    if (s_.compare(i_, 4, "null") == 0) {
      i_ += 4;
      out->v = std::monostate{};
      return Status::Ok();
    }
    const size_t start = i_;
    while (i_ < s_.size() && (std::strchr("+-0123456789.eE", s_[i_]) != nullptr) && s_[i_] != 0) {
      ++i_;
    }
    if (i_ == start) return Error("unexpected character");
    try {
      out->v = std::stod(std::string(s_.substr(start, i_ - start)));
    } catch (...) {
      return Error("bad number");
    }
    return Status::Ok();
  }
  Status String(std::string* out) {
    if (i_ >= s_.size() || s_[i_] != '"') return Error("expected string");
    ++i_;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (i_ >= s_.size()) return Error("unterminated escape");
      c = s_[i_++];
      switch (c) {
        case '"': case '\\': case '/': out->push_back(c); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          KVF_ST_RETURN_IF_ERROR(Hex4(&cp));
          if (cp >= 0xd800 && cp < 0xdc00 && s_.compare(i_, 2, "\\u") == 0) {
            i_ += 2;
            uint32_t lo = 0;
            KVF_ST_RETURN_IF_ERROR(Hex4(&lo));
            if (lo < 0xdc00 || lo >= 0xe000) return Error("bad low surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          AppendUtf8(cp, out);
          break;
        }
        default: return Error("bad escape");
      }
    }
    if (i_ >= s_.size()) return Error("unterminated string");
    ++i_;
    return Status::Ok();
  }
  Status Hex4(uint32_t* cp) {
    if (s_.size() - i_ < 4) return Error("short \\u escape");
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      *cp <<= 4;
      if (h >= '0' && h <= '9') *cp |= h - '0';
      else if (h >= 'a' && h <= 'f') *cp |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') *cp |= h - 'A' + 10;
      else return Error("bad hex digit");
    }
    return Status::Ok();
  }

  std::string_view s_;
  size_t i_ = 0;
};

void AppendJsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", u);
      out->append(buf);
    } else {
      out->push_back(c);
    }
  }
  out->push_back('"');
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t FloatToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int SafetensorsDTypeSize(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

Result<std::vector<float>> SafetensorsFile::GetFloat(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) return NotFound(Cat("safetensors: no tensor '", name, "'"));
  const SafetensorsTensor& t = it->second;
  const int64_t n = t.numel();
  std::vector<float> out(n);
  const uint8_t* p = t.bytes.data();
  if (t.dtype == "F32") {
    if (n > 0) std::memcpy(out.data(), p, n * 4);  // an empty vector's data() may be null
  } else if (t.dtype == "BF16" || t.dtype == "F16") {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
      out[i] = t.dtype == "BF16" ? std::bit_cast<float>(static_cast<uint32_t>(h) << 16)
                                 : HalfToFloat(h);
    }
  } else if (t.dtype == "I32") {
    for (int64_t i = 0; i < n; ++i) {
      int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      out[i] = static_cast<float>(v);
    }
  } else if (t.dtype == "I64") {
    for (int64_t i = 0; i < n; ++i) {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      out[i] = static_cast<float>(v);
    }
  } else {
    return InvalidArgument(Cat("safetensors: tensor '", name, "' of dtype ", t.dtype,
                               " cannot be read as float"));
  }
  return out;
}

Result<std::vector<int32_t>> SafetensorsFile::GetInt32(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) return NotFound(Cat("safetensors: no tensor '", name, "'"));
  const SafetensorsTensor& t = it->second;
  const int64_t n = t.numel();
  std::vector<int32_t> out(n);
  if (t.dtype == "I32") {
    if (n > 0) std::memcpy(out.data(), t.bytes.data(), n * 4);
  } else if (t.dtype == "I64") {
    for (int64_t i = 0; i < n; ++i) {
      int64_t v;
      std::memcpy(&v, t.bytes.data() + 8 * i, 8);
      out[i] = static_cast<int32_t>(v);
    }
  } else {
    return InvalidArgument(Cat("safetensors: tensor '", name, "' of dtype ", t.dtype,
                               " is not an integer tensor"));
  }
  return out;
}

Result<SafetensorsFile> ParseSafetensors(const std::vector<uint8_t>& bytes) {
  if (bytes.size() < 8) return CorruptData("safetensors: file shorter than its 8-byte header size");
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  if (header_len > bytes.size() - 8 || header_len > (uint64_t{100} << 20)) {
    return CorruptData(Cat("safetensors: header of ", header_len, " bytes does not fit the ",
                           bytes.size(), "-byte file"));
  }
  std::string_view header(reinterpret_cast<const char*>(bytes.data() + 8), header_len);
  Json root;
  KVF_ST_RETURN_IF_ERROR(JsonParser(header).Parse(&root));
  const auto* obj = std::get_if<std::shared_ptr<JsonObject>>(&root.v);
  if (obj == nullptr) return CorruptData("safetensors: header is not a JSON object");
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = bytes.size() - data_start;
  SafetensorsFile file;
  for (const auto& [name, val] : **obj) {
    const auto* entry = std::get_if<std::shared_ptr<JsonObject>>(&val.v);
    if (entry == nullptr) return CorruptData(Cat("safetensors: entry '", name, "' is not an object"));
    if (name == "__metadata__") {
      for (const auto& [k, mv] : **entry) {
        const auto* s = std::get_if<std::string>(&mv.v);
        if (s == nullptr) return CorruptData(Cat("safetensors: metadata '", k, "' is not a string"));
        file.metadata[k] = *s;
      }
      continue;
    }
    const JsonObject& e = **entry;
    auto dt = e.find("dtype");
    auto sh = e.find("shape");
    auto off = e.find("data_offsets");
    if (dt == e.end() || sh == e.end() || off == e.end() ||
        !std::holds_alternative<std::string>(dt->second.v) ||
        !std::holds_alternative<std::shared_ptr<JsonArray>>(sh->second.v) ||
        !std::holds_alternative<std::shared_ptr<JsonArray>>(off->second.v)) {
      return CorruptData(Cat("safetensors: tensor '", name, "' lacks dtype, shape or data_offsets"));
    }
    SafetensorsTensor t;
    t.dtype = std::get<std::string>(dt->second.v);
    const int elem = SafetensorsDTypeSize(t.dtype);
    if (elem == 0) return CorruptData(Cat("safetensors: tensor '", name, "' has dtype ", t.dtype));
    uint64_t numel = 1;
    for (const Json& d : *std::get<std::shared_ptr<JsonArray>>(sh->second.v)) {
      const auto* x = std::get_if<double>(&d.v);
      if (x == nullptr || *x < 0 || *x > 1e15 || *x != static_cast<double>(static_cast<int64_t>(*x))) {
        return CorruptData(Cat("safetensors: tensor '", name, "' has a bad shape"));
      }
      t.shape.push_back(static_cast<int64_t>(*x));
      if (t.shape.back() != 0 && numel > (uint64_t{1} << 50) / static_cast<uint64_t>(t.shape.back())) {
        return CorruptData(Cat("safetensors: tensor '", name, "' is too large"));
      }
      numel *= static_cast<uint64_t>(t.shape.back());
    }
    const JsonArray& offs = *std::get<std::shared_ptr<JsonArray>>(off->second.v);
    if (offs.size() != 2 || !std::holds_alternative<double>(offs[0].v) ||
        !std::holds_alternative<double>(offs[1].v)) {
      return CorruptData(Cat("safetensors: tensor '", name, "' has bad data_offsets"));
    }
    const double b = std::get<double>(offs[0].v);
    const double end = std::get<double>(offs[1].v);
    if (b < 0 || end < b || end > static_cast<double>(data_size) || b != std::floor(b) ||
        end != std::floor(end) ||
        static_cast<uint64_t>(end - b) != numel * static_cast<uint64_t>(elem)) {
      return CorruptData(Cat("safetensors: data of tensor '", name, "' [", b, ", ", end,
                             ") does not match its shape or lies outside the file"));
    }
    const uint8_t* src = bytes.data() + data_start + static_cast<uint64_t>(b);
    t.bytes.assign(src, src + static_cast<uint64_t>(end - b));
    file.tensors[name] = std::move(t);
  }
  return file;
}

Result<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return IoError(Cat("cannot open '", path, "'"));
  const std::streamoff size = in.tellg();
  if (size < 0) return IoError(Cat("cannot size '", path, "'"));
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) {
    return IoError(Cat("cannot read '", path, "'"));
  }
  auto file = ParseSafetensors(bytes);
  if (!file.ok()) return Status(file.status().code(), Cat(path, ": ", file.status().message()));
  return file;
}

Result<std::vector<uint8_t>> SerializeSafetensors(const SafetensorsFile& file) {
  std::string header = "{";
  bool first = true;
  if (!file.metadata.empty()) {
    header += "\"__metadata__\":{";
    for (const auto& [k, v] : file.metadata) {
      if (!first) header += ",";
      first = false;
      AppendJsonString(k, &header);
      header += ":";
      AppendJsonString(v, &header);
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    const int elem = SafetensorsDTypeSize(t.dtype);
    if (elem == 0) return InvalidArgument(Cat("safetensors: tensor '", name, "' dtype ", t.dtype));
    if (static_cast<uint64_t>(t.numel()) * elem != t.bytes.size()) {
      return InvalidArgument(Cat("safetensors: tensor '", name, "' has ", t.bytes.size(),
                                 " bytes for its shape"));
    }
    if (!file.metadata.empty() || name != file.tensors.begin()->first) header += ",";
    AppendJsonString(name, &header);
    header += Cat(":{\"dtype\":\"", t.dtype, "\",\"shape\":[");
    for (size_t i = 0; i < t.shape.size(); ++i) header += Cat(i ? "," : "", t.shape[i]);
    header += Cat("],\"data_offsets\":[", offset, ",", offset + t.bytes.size(), "]}");
    offset += t.bytes.size();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::vector<uint8_t> out(8 + header.size() + offset);
  const uint64_t len = header.size();
  std::memcpy(out.data(), &len, 8);
  std::memcpy(out.data() + 8, header.data(), header.size());
  uint8_t* dst = out.data() + 8 + header.size();
  for (const auto& [name, t] : file.tensors) {
    if (!t.bytes.empty()) std::memcpy(dst, t.bytes.data(), t.bytes.size());
    dst += t.bytes.size();
  }
  return out;
}

Status WriteSafetensors(const std::string& path, const SafetensorsFile& file) {
  auto bytes = SerializeSafetensors(file);
  if (!bytes.ok()) return bytes.status();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return IoError(Cat("cannot create '", path, "'"));
  out.write(reinterpret_cast<const char*>(bytes->data()), static_cast<std::streamsize>(bytes->size()));
  if (!out) return IoError(Cat("cannot write '", path, "'"));
  return Status::Ok();
}

void AddFloatTensor(SafetensorsFile& file, const std::string& name, std::vector<int64_t> shape,
                    const float* data, bool as_bf16) {
  SafetensorsTensor t;
  t.shape = std::move(shape);
  const int64_t n = t.numel();
  if (as_bf16) {
    t.dtype = "BF16";
    t.bytes.resize(n * 2);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = FloatToBf16(data[i]);
      t.bytes[2 * i] = static_cast<uint8_t>(h & 0xff);
      t.bytes[2 * i + 1] = static_cast<uint8_t>(h >> 8);
    }
  } else {
    t.dtype = "F32";
    t.bytes.resize(n * 4);
    if (n > 0) std::memcpy(t.bytes.data(), data, n * 4);
  }
  file.tensors[name] = std::move(t);
}

namespace {

// A trace from a parsed file; \p where prefixes messages (the path).
Result<Trace> TraceFrom(const SafetensorsFile& file, const std::string& where) {
  Trace trace;
  trace.metadata = file.metadata;
  std::map<int, TraceLayer> layers;
  constexpr int64_t kMaxHeads = 1 << 16;
  for (const auto& [name, t] : file.tensors) {
    // "layer.<l>.<q|k|v>"
    if (name.rfind("layer.", 0) != 0) continue;
    const size_t dot = name.find('.', 6);
    if (dot == std::string::npos || dot + 2 != name.size()) continue;
    const std::string num = name.substr(6, dot - 6);
    if (num.empty() || num.size() > 6 || num.find_first_not_of("0123456789") != std::string::npos) {
      continue;
    }
    const int l = std::stoi(num);
    const char kind = name.back();
    if (kind != 'q' && kind != 'k' && kind != 'v') continue;
    if (t.shape.size() != 3 || t.shape[1] < 1 || t.shape[1] > kMaxHeads || t.shape[2] < 1 ||
        t.shape[2] > kMaxHeads) {
      return CorruptData(Cat(where, ": tensor '", name, "' is not [T, heads, head_dim]"));
    }
    TraceLayer& tl = layers[l];
    tl.layer = l;
    auto data = file.GetFloat(name);
    if (!data.ok()) return data.status();
    if (kind == 'q') {
      tl.num_q_heads = static_cast<int>(t.shape[1]);
      tl.q = std::move(data.value());
    } else if (kind == 'k') {
      tl.num_kv_heads = static_cast<int>(t.shape[1]);
      tl.k = std::move(data.value());
    } else {
      if (tl.num_kv_heads != 0 && tl.num_kv_heads != t.shape[1]) {
        return CorruptData(Cat(where, ": layer ", l, " has k and v of different head counts"));
      }
      tl.num_kv_heads = static_cast<int>(t.shape[1]);
      tl.v = std::move(data.value());
    }
    if (tl.num_tokens != 0 && tl.num_tokens != t.shape[0]) {
      return CorruptData(Cat(where, ": layer ", l, " has q/k/v of different lengths"));
    }
    if (tl.head_dim != 0 && tl.head_dim != t.shape[2]) {
      return CorruptData(Cat(where, ": layer ", l, " has q/k/v of different head_dim"));
    }
    tl.num_tokens = t.shape[0];
    tl.head_dim = static_cast<int>(t.shape[2]);
  }
  if (layers.empty()) return CorruptData(Cat(where, ": no 'layer.<l>.q/k/v' tensors"));
  for (auto& [l, tl] : layers) {
    if (tl.q.empty() || tl.k.empty() || tl.v.empty()) {
      return CorruptData(Cat(where, ": layer ", l, " lacks one of q, k, v"));
    }
    if (tl.v.size() != tl.k.size() || tl.num_q_heads <= 0 || tl.num_kv_heads <= 0 ||
        tl.num_q_heads % tl.num_kv_heads != 0) {
      return CorruptData(Cat(where, ": layer ", l, " has inconsistent head counts"));
    }
    trace.layers.push_back(std::move(tl));
  }
  return trace;
}

}  // namespace

Result<Trace> LoadTrace(const std::string& path) {
  auto file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  return TraceFrom(file.value(), path);
}

Result<Trace> LoadTraceFromBytes(const std::vector<uint8_t>& bytes) {
  auto file = ParseSafetensors(bytes);
  if (!file.ok()) return file.status();
  return TraceFrom(file.value(), "trace");
}

}  // namespace kvferry::bench
