// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "examples/llama/gguf.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {
namespace {

using detail::StrCat;

Result<Matrix> LoadMatrix(const GgufFile& f, const std::string& name, int64_t rows, int64_t cols) {
  KVF_ASSIGN_OR_RETURN(const GgufTensorInfo* info, f.FindTensor(name));
  if (info->dims.size() != 2 || info->dims[0] != static_cast<uint64_t>(cols) ||
      info->dims[1] != static_cast<uint64_t>(rows)) {
    std::string dims;
    for (uint64_t d : info->dims) dims += StrCat(d, ",");
    return CorruptData(StrCat("gguf: tensor '", name, "' has dims {", dims, "}, expected {",
                              cols, ",", rows, ",}"));
  }
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  KVF_ASSIGN_OR_RETURN(m.data, f.Dequantize(name));
  return m;
}

Result<std::vector<float>> LoadVector(const GgufFile& f, const std::string& name, int64_t n) {
  KVF_ASSIGN_OR_RETURN(const GgufTensorInfo* info, f.FindTensor(name));
  if (info->dims.size() != 1 || info->dims[0] != static_cast<uint64_t>(n)) {
    return CorruptData(StrCat("gguf: tensor '", name, "' is not a vector of ", n));
  }
  return f.Dequantize(name);
}

// llama.cpp's converter permutes the rows of Q and K inside each head so that RoPE can rotate
// adjacent pairs (2i, 2i+1); Hugging Face rotates (i, i + d/2). Row 2i+s of a GGUF head is row
// s*d/2 + i of the Hugging Face head. Undo it so that Q/K (and traces) match Hugging Face.
void UnpermuteRopeRows(Matrix& m, int num_heads, int head_dim) {
  std::vector<float> src = m.data;
  const int64_t cols = m.cols;
  const int half = head_dim / 2;
  for (int h = 0; h < num_heads; ++h) {
    for (int i = 0; i < half; ++i) {
      for (int s = 0; s < 2; ++s) {
        const int64_t from = static_cast<int64_t>(h) * head_dim + 2 * i + s;
        const int64_t to = static_cast<int64_t>(h) * head_dim + s * half + i;
        std::memcpy(&m.data[to * cols], &src[from * cols], cols * sizeof(float));
      }
    }
  }
}

Status CheckConfig(const ModelConfig& c) {
  const auto bad = [](int v, int hi) { return v <= 0 || v > hi; };
  if (bad(c.dim, 1 << 16) || bad(c.hidden_dim, 1 << 18) || bad(c.num_layers, 1024) ||
      bad(c.num_q_heads, 1024) || bad(c.num_kv_heads, 1024) || bad(c.vocab_size, 1 << 22) ||
      bad(c.max_context, 1 << 24)) {
    return CorruptData(StrCat("model: implausible shape dim=", c.dim, " hidden=", c.hidden_dim,
                              " layers=", c.num_layers, " heads=", c.num_q_heads, "/",
                              c.num_kv_heads, " vocab=", c.vocab_size, " ctx=", c.max_context));
  }
  if (c.arch == Arch::kGemma3) {  // head_dim is its own (key_length), q_dim need not be dim
    if (c.num_q_heads % c.num_kv_heads != 0 || c.head_dim <= 0 || c.head_dim > 1024 ||
        (c.head_dim % 2) != 0) {
      return CorruptData(StrCat("model: ", c.num_q_heads, "/", c.num_kv_heads, " heads of ",
                                c.head_dim, " dims is not a valid Gemma 3 shape"));
    }
    return Status::Ok();
  }
  if (c.dim % c.num_q_heads != 0 || c.num_q_heads % c.num_kv_heads != 0 ||
      (c.head_dim % 2) != 0 || c.head_dim * c.num_q_heads != c.dim) {
    return CorruptData(StrCat("model: dim ", c.dim, " with ", c.num_q_heads, "/", c.num_kv_heads,
                              " heads is not a valid Llama shape"));
  }
  return Status::Ok();
}

// The shape every GGUF architecture states under its prefix \p a ("llama.", "gemma3."), clamped
// into \p c (a negative field fails CheckConfig); the vocabulary is token_embd's row count.
// Returns the embedding width as stored (for the embedding scale).
Result<int64_t> ReadGgufShape(const GgufFile& f, const std::string& a, int64_t default_context,
                              ModelConfig& c, int64_t* heads_out) {
  KVF_ASSIGN_OR_RETURN(int64_t dim, f.GetInt(a + "embedding_length"));
  KVF_ASSIGN_OR_RETURN(int64_t hidden, f.GetInt(a + "feed_forward_length"));
  KVF_ASSIGN_OR_RETURN(int64_t layers, f.GetInt(a + "block_count"));
  KVF_ASSIGN_OR_RETURN(int64_t heads, f.GetInt(a + "attention.head_count"));
  KVF_ASSIGN_OR_RETURN(int64_t kv_heads, f.GetIntOr(a + "attention.head_count_kv", heads));
  KVF_ASSIGN_OR_RETURN(int64_t ctx, f.GetIntOr(a + "context_length", default_context));
  KVF_ASSIGN_OR_RETURN(const GgufTensorInfo* emb, f.FindTensor("token_embd.weight"));
  if (emb->dims.size() != 2) return CorruptData("gguf: token_embd.weight is not a matrix");
  const auto clamp = [](int64_t v) { return v < 0 || v > (1 << 30) ? -1 : static_cast<int>(v); };
  c.dim = clamp(dim);
  c.hidden_dim = clamp(hidden);
  c.num_layers = clamp(layers);
  c.num_q_heads = clamp(heads);
  c.num_kv_heads = clamp(kv_heads);
  c.vocab_size = clamp(static_cast<int64_t>(std::min<uint64_t>(emb->dims[1], 1u << 30)));
  c.max_context = clamp(ctx);
  *heads_out = heads;
  return dim;
}

// The weights every architecture has: embedding, per layer the two pre-norms, attention and the
// gated MLP, the final norm and (untied models) the classifier. Architecture extras come after.
Status LoadCommonWeights(const GgufFile& f, Model& model) {
  const ModelConfig& c = model.config;
  const int64_t q_dim = static_cast<int64_t>(c.num_q_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  KVF_ASSIGN_OR_RETURN(model.token_embedding,
                       LoadMatrix(f, "token_embd.weight", c.vocab_size, c.dim));
  model.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& w = model.layers[l];
    const std::string p = StrCat("blk.", l, ".");
    KVF_ASSIGN_OR_RETURN(w.attn_norm, LoadVector(f, p + "attn_norm.weight", c.dim));
    KVF_ASSIGN_OR_RETURN(w.ffn_norm, LoadVector(f, p + "ffn_norm.weight", c.dim));
    KVF_ASSIGN_OR_RETURN(w.wq, LoadMatrix(f, p + "attn_q.weight", q_dim, c.dim));
    KVF_ASSIGN_OR_RETURN(w.wk, LoadMatrix(f, p + "attn_k.weight", kv_dim, c.dim));
    KVF_ASSIGN_OR_RETURN(w.wv, LoadMatrix(f, p + "attn_v.weight", kv_dim, c.dim));
    KVF_ASSIGN_OR_RETURN(w.wo, LoadMatrix(f, p + "attn_output.weight", c.dim, q_dim));
    KVF_ASSIGN_OR_RETURN(w.w_gate, LoadMatrix(f, p + "ffn_gate.weight", c.hidden_dim, c.dim));
    KVF_ASSIGN_OR_RETURN(w.w_up, LoadMatrix(f, p + "ffn_up.weight", c.hidden_dim, c.dim));
    KVF_ASSIGN_OR_RETURN(w.w_down, LoadMatrix(f, p + "ffn_down.weight", c.dim, c.hidden_dim));
  }
  KVF_ASSIGN_OR_RETURN(model.final_norm, LoadVector(f, "output_norm.weight", c.dim));
  if (f.FindTensor("output.weight").ok()) {
    KVF_ASSIGN_OR_RETURN(model.output, LoadMatrix(f, "output.weight", c.vocab_size, c.dim));
  }
  return Status::Ok();
}

// Gemma 3 (llama.cpp's converter, architecture "gemma3"): QK-norm, sandwich norms (post-attention
// and post-MLP RMSNorms), GeGLU, embedding scaled by sqrt(dim), tied classifier, every
// sliding_window_pattern-th layer global (RoPE base rope.freq_base) and the others sliding-window
// (RoPE base 10000). The converter stores every norm weight as Gemma's 1 + w, so the engine's
// x * rsqrt(mean(x^2) + eps) * w is Gemma's RMSNorm as it stands; Q and K are not permuted
// (llama.cpp rotates them NEOX-style, Hugging Face's rotate_half).
Result<Model> LoadGemma3(const GgufFile& f) {
  Model model;
  ModelConfig& c = model.config;
  c.arch = Arch::kGemma3;
  auto name = f.GetString("general.name");
  c.name = name.ok() ? *name : "gemma3";
  const std::string a = "gemma3.";
  int64_t heads = 0;
  KVF_ASSIGN_OR_RETURN(const int64_t dim, ReadGgufShape(f, a, 32768, c, &heads));
  KVF_ASSIGN_OR_RETURN(int64_t key_len,
                       f.GetIntOr(a + "attention.key_length", heads > 0 ? dim / heads : 0));
  KVF_ASSIGN_OR_RETURN(int64_t value_len, f.GetIntOr(a + "attention.value_length", key_len));
  KVF_ASSIGN_OR_RETURN(double theta, f.GetFloatOr(a + "rope.freq_base", 1000000.0));
  KVF_ASSIGN_OR_RETURN(double eps, f.GetFloatOr(a + "attention.layer_norm_rms_epsilon", 1e-6));
  KVF_ASSIGN_OR_RETURN(int64_t window, f.GetIntOr(a + "attention.sliding_window", 512));
  if (key_len != value_len) {
    return Unimplemented(StrCat("gguf: gemma3 key_length ", key_len, " != value_length ",
                                value_len));
  }
  c.head_dim = key_len < 0 || key_len > (1 << 30) ? -1 : static_cast<int>(key_len);
  c.rope_theta = static_cast<float>(theta);
  c.rope_theta_sliding = 10000.0f;
  c.rms_eps = static_cast<float>(eps);
  c.rope_style = RopeStyle::kHalves;
  c.activation = Activation::kGeluTanh;
  c.embed_scale = static_cast<float>(std::sqrt(static_cast<double>(dim)));
  // llama.cpp scales queries by 1/sqrt(key_length) (query_pre_attn_scalar = head_dim: 256 for
  // 270M to 12B; the 27B model, whose scalar is dim / heads, is not handled).
  c.attn_scale = c.head_dim > 0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)))
                                : 0.0f;
  KVF_RETURN_IF_ERROR(CheckConfig(c));
  if (!(theta > 0.0 && theta < 1e30) || !(eps >= 0.0 && eps < 1.0) || window <= 0 ||
      window > (int64_t{1} << 30)) {
    return CorruptData(StrCat("gguf: implausible gemma3 rope.freq_base ", theta, ", rms eps ",
                              eps, " or sliding_window ", window));
  }
  auto scaling = f.GetString(a + "rope.scaling.type");
  if (scaling.ok() && *scaling == "linear") {
    KVF_ASSIGN_OR_RETURN(double factor, f.GetFloatOr(a + "rope.scaling.factor", 1.0));
    if (!(factor >= 1.0 && factor < 1e6)) {
      return CorruptData(StrCat("gguf: implausible rope.scaling.factor ", factor));
    }
    c.rope_scale_global = static_cast<float>(factor);
  } else if (scaling.ok() && *scaling != "none") {
    return Unimplemented(StrCat("gguf: gemma3 rope scaling '", *scaling, "' is not supported"));
  }
  // Layer types: a per-layer bool array (true = sliding) if the file has one, else every
  // pattern-th layer (1-based) global, pattern 6 by default (llama.cpp's and Hugging Face's).
  c.layer_window.assign(c.num_layers, static_cast<int>(window));
  int64_t pattern = 6;
  auto pat = f.Find(a + "attention.sliding_window_pattern");
  if (pat.ok() && (*pat)->type == GgufType::kArray) {
    if ((*pat)->nums.size() != static_cast<size_t>(c.num_layers)) {
      return CorruptData(StrCat("gguf: sliding_window_pattern has ", (*pat)->nums.size(),
                                " entries for ", c.num_layers, " layers"));
    }
    for (int l = 0; l < c.num_layers; ++l) {
      if ((*pat)->nums[l] == 0) c.layer_window[l] = 0;
    }
  } else {
    if (pat.ok()) {
      KVF_ASSIGN_OR_RETURN(pattern, f.GetInt(a + "attention.sliding_window_pattern"));
    }
    if (pattern <= 0) return CorruptData(StrCat("gguf: sliding_window_pattern ", pattern));
    for (int l = 0; l < c.num_layers; ++l) {
      if ((l + 1) % pattern == 0) c.layer_window[l] = 0;
    }
  }

  KVF_RETURN_IF_ERROR(LoadCommonWeights(f, model));
  for (int l = 0; l < c.num_layers; ++l) {  // Gemma's extras: sandwich norms and QK-norm
    LayerWeights& w = model.layers[l];
    const std::string p = StrCat("blk.", l, ".");
    KVF_ASSIGN_OR_RETURN(w.post_attn_norm, LoadVector(f, p + "post_attention_norm.weight", c.dim));
    KVF_ASSIGN_OR_RETURN(w.post_ffn_norm, LoadVector(f, p + "post_ffw_norm.weight", c.dim));
    KVF_ASSIGN_OR_RETURN(w.q_norm, LoadVector(f, p + "attn_q_norm.weight", c.head_dim));
    KVF_ASSIGN_OR_RETURN(w.k_norm, LoadVector(f, p + "attn_k_norm.weight", c.head_dim));
  }
  return model;
}

}  // namespace

Result<Model> LoadGgufModelFromBytes(std::span<const uint8_t> bytes) {
  KVF_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Parse(bytes));
  KVF_ASSIGN_OR_RETURN(std::string arch, f.GetString("general.architecture"));
  if (arch == "gemma3") return LoadGemma3(f);
  if (arch != "llama") {
    return Unimplemented(StrCat("gguf: architecture '", arch,
                                "' is not supported (need llama or gemma3)"));
  }
  Model model;
  ModelConfig& c = model.config;
  auto name = f.GetString("general.name");
  c.name = name.ok() ? *name : "llama";
  int64_t heads = 0;
  KVF_RETURN_IF_ERROR(ReadGgufShape(f, "llama.", 2048, c, &heads).status());
  KVF_ASSIGN_OR_RETURN(double theta, f.GetFloatOr("llama.rope.freq_base", 10000.0));
  KVF_ASSIGN_OR_RETURN(double eps, f.GetFloatOr("llama.attention.layer_norm_rms_epsilon", 1e-5));
  c.head_dim = c.num_q_heads > 0 ? c.dim / c.num_q_heads : 0;
  c.rope_theta = static_cast<float>(theta);
  c.rms_eps = static_cast<float>(eps);
  c.rope_style = RopeStyle::kHalves;
  KVF_RETURN_IF_ERROR(CheckConfig(c));
  if (!(theta > 0.0 && theta < 1e30) || !(eps >= 0.0 && eps < 1.0)) {
    return CorruptData(StrCat("gguf: implausible llama.rope.freq_base ", theta,
                              " or layer_norm_rms_epsilon ", eps));
  }
  KVF_ASSIGN_OR_RETURN(int64_t rope_dims, f.GetIntOr("llama.rope.dimension_count", c.head_dim));
  if (rope_dims != c.head_dim) {
    return Unimplemented(StrCat("gguf: partial RoPE (", rope_dims, " of ", c.head_dim,
                                " dims) is not supported"));
  }

  KVF_RETURN_IF_ERROR(LoadCommonWeights(f, model));
  for (LayerWeights& w : model.layers) {  // llama.cpp's converter permutes Q and K for RoPE
    UnpermuteRopeRows(w.wq, c.num_q_heads, c.head_dim);
    UnpermuteRopeRows(w.wk, c.num_kv_heads, c.head_dim);
  }
  return model;
}

Result<Model> LoadGgufModel(const std::string& path) {
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path));
  auto model = LoadGgufModelFromBytes(bytes);
  if (!model.ok()) {
    return Status(model.status().code(), StrCat(path, ": ", model.status().message()));
  }
  return model;
}

Result<Model> LoadLlama2cModelFromBytes(std::span<const uint8_t> bytes) {
  int32_t header[7];
  if (bytes.size() < sizeof(header)) {
    return CorruptData(StrCat("not a GGUF file (no 'GGUF' magic) and, at ", bytes.size(),
                              " bytes, shorter than a llama2.c checkpoint's 28-byte header"));
  }
  std::memcpy(header, bytes.data(), sizeof(header));
  Model model;
  ModelConfig& c = model.config;
  c.name = "llama2.c";
  c.dim = header[0];
  c.hidden_dim = header[1];
  c.num_layers = header[2];
  c.num_q_heads = header[3];
  c.num_kv_heads = header[4];
  // A negative vocabulary size marks an untied classifier.
  const bool tied = header[5] > 0;
  c.vocab_size = header[5] == INT32_MIN ? -1 : (tied ? header[5] : -header[5]);
  c.max_context = header[6];
  c.head_dim = c.num_q_heads > 0 ? c.dim / c.num_q_heads : 0;
  c.rope_theta = 10000.0f;
  c.rms_eps = 1e-5f;
  c.rope_style = RopeStyle::kAdjacent;
  KVF_RETURN_IF_ERROR(CheckConfig(c));

  const int64_t dim = c.dim, hidden = c.hidden_dim, layers = c.num_layers;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  const int64_t rope_table = static_cast<int64_t>(c.max_context) * c.head_dim / 2;
  int64_t need = c.vocab_size * dim + layers * (2 * dim + dim * dim + 2 * kv_dim * dim +
                                                dim * dim + 3 * hidden * dim) +
                 dim + 2 * rope_table + (tied ? 0 : c.vocab_size * dim);
  need = need * 4 + static_cast<int64_t>(sizeof(header));
  if (static_cast<int64_t>(bytes.size()) < need) {
    return CorruptData(StrCat("llama2.c: file has ", bytes.size(), " bytes, its header needs ",
                              need));
  }
  const uint8_t* p = bytes.data() + sizeof(header);
  const auto take = [&p](int64_t n) {
    std::vector<float> v(n);
    std::memcpy(v.data(), p, n * sizeof(float));
    p += n * sizeof(float);
    return v;
  };
  const auto take_matrix = [&take](int64_t rows, int64_t cols) {
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.data = take(rows * cols);
    return m;
  };
  model.token_embedding = take_matrix(c.vocab_size, dim);
  model.layers.resize(c.num_layers);
  // Arrays are stored per kind for all layers at once.
  for (auto& w : model.layers) w.attn_norm = take(dim);
  for (auto& w : model.layers) w.wq = take_matrix(dim, dim);
  for (auto& w : model.layers) w.wk = take_matrix(kv_dim, dim);
  for (auto& w : model.layers) w.wv = take_matrix(kv_dim, dim);
  for (auto& w : model.layers) w.wo = take_matrix(dim, dim);
  for (auto& w : model.layers) w.ffn_norm = take(dim);
  for (auto& w : model.layers) w.w_gate = take_matrix(hidden, dim);
  for (auto& w : model.layers) w.w_down = take_matrix(dim, hidden);
  for (auto& w : model.layers) w.w_up = take_matrix(hidden, dim);
  model.final_norm = take(dim);
  p += 2 * rope_table * sizeof(float);  // precomputed RoPE tables; recomputed by the engine
  if (!tied) model.output = take_matrix(c.vocab_size, dim);
  return model;
}

Result<Model> LoadLlama2cModel(const std::string& path) {
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path));
  auto model = LoadLlama2cModelFromBytes(bytes);
  if (!model.ok()) {
    return Status(model.status().code(), StrCat(path, ": ", model.status().message()));
  }
  return model;
}

Result<Model> LoadModel(const std::string& path) {
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path));
  if (bytes.empty()) return CorruptData(StrCat(path, ": the file is empty (0 bytes)"));
  // A .gguf name is read as GGUF whatever its first bytes, so that a damaged GGUF file is
  // reported as one (bad magic, truncated header) rather than as a short llama2.c checkpoint.
  std::string ext = std::filesystem::path(path).extension().string();
  for (char& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const bool is_gguf = ext == ".gguf" ||
                       (bytes.size() >= 4 && std::memcmp(bytes.data(), "GGUF", 4) == 0);
  auto model = is_gguf ? LoadGgufModelFromBytes(bytes) : LoadLlama2cModelFromBytes(bytes);
  if (!model.ok()) {
    return Status(model.status().code(), StrCat(path, ": ", model.status().message()));
  }
  return model;
}

}  // namespace kvferry::llama
