// Copyright kvferry authors. Apache-2.0.
// Fuzzes llama2.c's tokenizer.bin reader and its encoder/decoder.
// Input: u16 vocabulary size (little-endian), u16 text length, the text, then tokenizer.bin bytes.
// Encoding any bytes with any loadable vocabulary gives ids inside the vocabulary.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string_view>

#include "examples/llama/tokenizer.h"

using namespace kvferry::llama;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const int vocab = data[0] | (data[1] << 8);
  size_t text_len = data[2] | (data[3] << 8);
  if (text_len > size - 4) text_len = size - 4;
  const std::string_view text(reinterpret_cast<const char*>(data + 4), text_len);
  const std::span<const uint8_t> file(data + 4 + text_len, size - 4 - text_len);
  auto tok = LoadLlama2cTokenizerFromBytes(file, vocab);
  if (!tok.ok()) {
    if (tok.status().message().empty()) std::abort();
    return 0;
  }
  if ((*tok)->vocab_size() != vocab) std::abort();
  for (int32_t id : (*tok)->Encode(text, false)) {
    if (id < 0 || id >= vocab) std::abort();
    (void)(*tok)->Decode(id);
  }
  (void)(*tok)->Decode(-1);
  (void)(*tok)->Decode(vocab);
  return 0;
}
