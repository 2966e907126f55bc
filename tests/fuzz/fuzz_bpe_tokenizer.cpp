// Copyright kvferry authors. Apache-2.0.
// Fuzzes the byte-level BPE tokenizer (SmolLM2's) on arbitrary bytes: every id lies inside the
// vocabulary, and without control-token parsing decoding gives back exactly the input bytes, less
// the bytes the vocabulary has no symbol for (SmolLM2 lacks 21 of the 256, e.g. 0xc0, 0xff: they
// are dropped, there being no unknown token).
// Input: one flag byte (bit 0: parse control tokens), then the text. The vocabulary is SmolLM2's
// when data/SmolLM2-135M-Instruct.Q4_1.gguf is fetched (or $KVFERRY_FUZZ_GGUF names a GGUF file),
// else a small built-in one with GPT-2's 256 byte symbols, a few merges and control tokens.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bench/lib/utf8.h"
#include "examples/llama/gguf.h"
#include "examples/llama/tokenizer.h"

using namespace kvferry::llama;

namespace {

// GGUF v3 metadata writer (no tensors).
class MetaWriter {
 public:
  void Str(const std::string& key, const std::string& v) {
    Key(key, 8);
    Bytes(v);
  }
  void U32(const std::string& key, uint32_t v) {
    Key(key, 4);
    Put(v);
  }
  void Strs(const std::string& key, const std::vector<std::string>& v) {
    Key(key, 9);
    Put<uint32_t>(8);
    Put<uint64_t>(v.size());
    for (const std::string& s : v) Bytes(s);
  }
  void I32s(const std::string& key, const std::vector<int32_t>& v) {
    Key(key, 9);
    Put<uint32_t>(5);
    Put<uint64_t>(v.size());
    for (int32_t x : v) Put(x);
  }
  std::vector<uint8_t> Build() const {
    std::vector<uint8_t> out = {'G', 'G', 'U', 'F', 3, 0, 0, 0};
    for (int i = 0; i < 8; ++i) out.push_back(0);  // no tensors
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(count_ >> (8 * i)));
    out.insert(out.end(), body_.begin(), body_.end());
    return out;
  }

 private:
  template <typename T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    body_.insert(body_.end(), p, p + sizeof(T));
  }
  void Bytes(const std::string& s) {
    Put<uint64_t>(s.size());
    body_.insert(body_.end(), s.begin(), s.end());
  }
  void Key(const std::string& key, uint32_t type) {
    Bytes(key);
    Put(type);
    ++count_;
  }
  std::vector<uint8_t> body_;
  uint64_t count_ = 0;
};

std::vector<uint8_t> BuiltInVocabulary() {
  std::vector<std::string> tokens;
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    std::string s;
    kvferry::bench::AppendUtf8(printable ? b : 256 + extra++, &s);
    tokens.push_back(s);
  }
  const std::string g = "\xc4\xa0";  // the symbol of ' '
  const std::vector<std::string> merges = {g + " t", "h e", g + "t he", "i n", g + " a",
                                           "a n",   "an d", g + " an", "1 2"};
  for (const std::string& m : merges) {
    std::string piece = m;
    piece.erase(piece.find(' '), 1);
    tokens.push_back(piece);
  }
  std::vector<int32_t> types(tokens.size(), 1);
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    tokens.push_back(special);
    types.push_back(3);
  }
  MetaWriter w;
  w.Str("tokenizer.ggml.model", "gpt2");
  w.Strs("tokenizer.ggml.tokens", tokens);
  w.I32s("tokenizer.ggml.token_type", types);
  w.Strs("tokenizer.ggml.merges", merges);
  w.U32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(tokens.size() - 2));
  w.U32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(tokens.size() - 1));
  return w.Build();
}

std::unique_ptr<Tokenizer> g_tok;
bool g_lost[256];  // bytes without a symbol in the vocabulary

void FindLostBytes() {
  int lost = 0;
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    g_lost[b] = g_tok->DecodeAll(g_tok->Encode(one, false)) != one;
    lost += g_lost[b] ? 1 : 0;
  }
  std::fprintf(stderr, "fuzz_bpe_tokenizer: %d bytes have no symbol in the vocabulary\n", lost);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* env = std::getenv("KVFERRY_FUZZ_GGUF");
  const std::string path = env != nullptr ? env
                                          : std::string(KVFERRY_FUZZ_DATA_DIR) +
                                                "/SmolLM2-135M-Instruct.Q4_1.gguf";
  auto real = LoadGgufTokenizer(path);
  if (real.ok()) {
    g_tok = std::move(real.value());
    std::fprintf(stderr, "fuzz_bpe_tokenizer: vocabulary of %s (%d tokens)\n", path.c_str(),
                 g_tok->vocab_size());
    FindLostBytes();
    return 0;
  }
  const std::vector<uint8_t> bytes = BuiltInVocabulary();
  auto file = GgufFile::Parse(bytes);
  if (!file.ok()) std::abort();
  auto tok = LoadGgufTokenizer(*file);
  if (!tok.ok()) std::abort();
  g_tok = std::move(tok.value());
  std::fprintf(stderr, "fuzz_bpe_tokenizer: built-in vocabulary (%d tokens; %s)\n",
               g_tok->vocab_size(), real.status().message().c_str());
  FindLostBytes();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool special = (data[0] & 1) != 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::vector<int32_t> ids = g_tok->Encode(text, special);
  for (int32_t id : ids) {
    if (id < 0 || id >= g_tok->vocab_size()) std::abort();
  }
  const std::string back = g_tok->DecodeAll(ids);
  std::string want;
  for (char c : text) {
    if (!g_lost[static_cast<uint8_t>(c)]) want.push_back(c);
  }
  if (!special && back != want) {
    std::fprintf(stderr, "round trip changed %zu bytes into %zu bytes\n", text.size(), back.size());
    std::abort();
  }
  // Any id decodes to something or nothing.
  for (size_t i = 1; i + 1 < size && i < 64; i += 2) {
    (void)g_tok->Decode(static_cast<int32_t>(data[i] | (data[i + 1] << 8)) - 64);
  }
  return 0;
}
