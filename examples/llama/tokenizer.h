// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file tokenizer.h
/// \brief Tokenizers: GPT-2 style byte-level BPE from GGUF metadata (SmolLM2, Llama 3, ...),
/// SentencePiece-style score merges from GGUF metadata (model "llama": Gemma 3, Llama 2) and
/// llama2.c's score-driven BPE (tokenizer.bin).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::llama {

class GgufFile;

/// \brief Text <-> token ids. Immutable after construction; thread-safe for concurrent use.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// Token ids of \p text (no BOS added). With \p parse_special, control tokens written in the
  /// text (e.g. "<|im_start|>") become their ids; otherwise they are encoded as plain text.
  [[nodiscard]] virtual std::vector<int32_t> Encode(std::string_view text,
                                                    bool parse_special) const = 0;
  /// The bytes token \p id stands for (control tokens give their written form).
  [[nodiscard]] virtual std::string Decode(int32_t id) const = 0;
  [[nodiscard]] std::string DecodeAll(const std::vector<int32_t>& ids) const;
  [[nodiscard]] virtual int vocab_size() const = 0;
  [[nodiscard]] int bos_id() const { return bos_id_; }
  [[nodiscard]] int eos_id() const { return eos_id_; }
  /// Whether a prompt should start with BOS (GGUF tokenizer.ggml.add_bos_token; llama2.c: yes).
  [[nodiscard]] bool add_bos() const { return add_bos_; }

 protected:
  int bos_id_ = -1;
  int eos_id_ = -1;
  bool add_bos_ = false;
};

/// Byte-level BPE from a GGUF file's tokenizer.ggml.{tokens,merges,token_type} (model "gpt2"), or
/// SentencePiece-style merges by tokenizer.ggml.scores (model "llama").
Result<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const GgufFile& file);
/// Reads the GGUF file at \p path and builds its tokenizer.
Result<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const std::string& path);
/// llama2.c tokenizer.bin for a model of \p vocab_size tokens.
Result<std::unique_ptr<Tokenizer>> LoadLlama2cTokenizer(const std::string& path, int vocab_size);
/// The same from a tokenizer.bin image in memory (kCorruptData if it is short or inconsistent).
Result<std::unique_ptr<Tokenizer>> LoadLlama2cTokenizerFromBytes(std::span<const uint8_t> bytes,
                                                                 int vocab_size);

}  // namespace kvferry::llama
