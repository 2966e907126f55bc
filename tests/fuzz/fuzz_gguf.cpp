// Copyright kvferry authors. Apache-2.0.
// Fuzzes the GGUF reader end to end: header, metadata, tensor directory, every metadata lookup,
// dequantisation of every (small) tensor, the BPE tokenizer built from the metadata, and the Llama
// model loader. Any input must give a value or an error, never a crash, a leak or UB.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "examples/llama/gguf.h"
#include "examples/llama/model.h"
#include "examples/llama/tokenizer.h"

using namespace kvferry::llama;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  auto file = GgufFile::Parse(bytes);
  if (!file.ok()) {
    if (file.status().message().empty()) std::abort();  // errors say what is wrong
    return 0;
  }
  for (const auto& [key, value] : file->metadata()) {
    (void)file->GetInt(key);
    (void)file->GetFloat(key);
    (void)file->GetString(key);
  }
  for (const GgufTensorInfo& t : file->tensors()) {
    if (t.num_bytes > (1u << 20)) continue;
    auto values = file->Dequantize(t.name);
    if (values.ok() && values->size() != t.numel()) std::abort();
  }
  auto tok = LoadGgufTokenizer(*file);
  if (tok.ok()) {
    for (bool special : {false, true}) {
      for (int32_t id : (*tok)->Encode("In the beginning 123 <|im_start|>user\n", special)) {
        if (id < 0 || id >= (*tok)->vocab_size()) std::abort();
        (void)(*tok)->Decode(id);
      }
    }
  }
  auto model = LoadGgufModelFromBytes(bytes);
  if (model.ok()) {
    const ModelConfig& c = model->config;
    if (static_cast<int>(model->layers.size()) != c.num_layers) std::abort();
    if (model->token_embedding.data.size() != static_cast<size_t>(c.vocab_size) * c.dim) std::abort();
  }
  return 0;
}
