// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/tokenizer.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <string>
#include <unordered_map>
#include <cstring>
#include <functional>
#include <limits>
#include <queue>

#include "bench/lib/utf8.h"
#include "examples/llama/gguf.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {
namespace {

using detail::StrCat;

using bench::AppendUtf8;

// Length in bytes of the UTF-8 sequence starting with \p lead, clamped to \p left; invalid lead
// bytes count as one byte.
size_t Utf8Length(uint8_t lead, size_t left) {
  size_t n = 1;
  if ((lead & 0xe0) == 0xc0) n = 2;
  else if ((lead & 0xf0) == 0xe0) n = 3;
  else if ((lead & 0xf8) == 0xf0) n = 4;
  return std::min(n, left);
}

// Character classes of the GPT-2 pre-tokenizer regex. Non-ASCII characters count as letters, which
// is right for the letters of other scripts and close enough for rare non-ASCII punctuation.
enum class CharClass { kLetter, kDigit, kSpace, kOther };

CharClass Classify(std::string_view s, size_t i) {
  const auto c = static_cast<uint8_t>(s[i]);
  if (c >= 0x80) return CharClass::kLetter;
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return CharClass::kLetter;
  if (c >= '0' && c <= '9') return CharClass::kDigit;
  if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f') {
    return CharClass::kSpace;
  }
  return CharClass::kOther;
}

// Splits \p text the way SmolLM2's pre-tokenizer does: every digit on its own (Digits with
// individual_digits), then GPT-2's pattern on the rest:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
std::vector<std::string_view> PreTokenize(std::string_view text) {
  std::vector<std::string_view> out;
  size_t seg_start = 0;
  const auto split_segment = [&out](std::string_view seg) {
    size_t i = 0;
    const size_t n = seg.size();
    const auto advance = [&seg, n](size_t j) { return j + Utf8Length(seg[j], n - j); };
    while (i < n) {
      const size_t start = i;
      if (seg[i] == '\'' && i + 1 < n) {
        const char a = seg[i + 1];
        const char b = i + 2 < n ? seg[i + 2] : '\0';
        size_t len = 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
        else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
        if (len > 0) {
          out.push_back(seg.substr(start, len));
          i += len;
          continue;
        }
      }
      // ' ?\p{L}+' and ' ?[^\s\p{L}\p{N}]+' (digits never reach here).
      size_t j = i;
      if (seg[i] == ' ' && i + 1 < n && Classify(seg, i + 1) != CharClass::kSpace) j = i + 1;
      const CharClass cls = Classify(seg, j);
      if (cls == CharClass::kLetter || cls == CharClass::kOther) {
        while (j < n && Classify(seg, j) == cls) j = advance(j);
        out.push_back(seg.substr(start, j - start));
        i = j;
        continue;
      }
      // Whitespace run: leave its last character to the following word unless the run ends
      // the segment.
      j = i;
      while (j < n && Classify(seg, j) == CharClass::kSpace) ++j;
      if (j > i) {
        if (j < n && j - i > 1) --j;
        out.push_back(seg.substr(start, j - start));
        i = j;
        continue;
      }
      // Lone character not covered above (cannot normally happen); keep it whole.
      j = advance(i);
      out.push_back(seg.substr(start, j - start));
      i = j;
    }
  };
  for (size_t i = 0; i < text.size(); ++i) {
    if (Classify(text, i) == CharClass::kDigit) {
      if (i > seg_start) split_segment(text.substr(seg_start, i - seg_start));
      out.push_back(text.substr(i, 1));
      seg_start = i + 1;
    }
  }
  if (seg_start < text.size()) split_segment(text.substr(seg_start));
  return out;
}

// Greedy pair merging, as GPT-2's BPE and llama2.c do it: repeatedly merge the adjacent pair of
// symbols with the lowest priority (the leftmost of equal ones) until no pair has one. A heap of
// candidate pairs makes it O(n log n); rescanning every pair after each merge was O(n^2) and took
// minutes on a long run of letters. \p priority(left, right, &p) returns false when the pair does
// not merge. A merged pair lives on in the left symbol; the returned mask says which symbols are
// left. Entries that a merge made stale are skipped when popped: a pair is current while both
// symbols are alive, still adjacent and as long as when it was pushed (symbols only grow).
template <typename PriorityFn>
std::vector<bool> MergeGreedily(std::vector<std::string>& symbols, PriorityFn priority) {
  const size_t n = symbols.size();
  std::vector<bool> alive(n, true);
  if (n < 2) return alive;
  constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<size_t> prev(n), next(n);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = i == 0 ? kNone : i - 1;
    next[i] = i + 1 == n ? kNone : i + 1;
  }
  struct Candidate {
    double priority;
    size_t left, right, size;
    bool operator>(const Candidate& o) const {
      return priority != o.priority ? priority > o.priority : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  const auto push = [&](size_t left, size_t right) {
    if (left == kNone || right == kNone) return;
    double p = 0;
    if (priority(symbols[left], symbols[right], &p)) {
      heap.push({p, left, right, symbols[left].size() + symbols[right].size()});
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) push(i, i + 1);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    std::string& left = symbols[c.left];
    std::string& right = symbols[c.right];
    if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right ||
        left.size() + right.size() != c.size) {
      continue;
    }
    left += right;
    right.clear();
    alive[c.right] = false;
    next[c.left] = next[c.right];
    if (next[c.right] != kNone) prev[next[c.right]] = c.left;
    push(prev[c.left], c.left);
    push(c.left, next[c.left]);
  }
  return alive;
}

// The special ids a GGUF tokenizer states: bos and eos (-1: none), checked against the
// vocabulary, and whether to prepend bos (\p add_bos_default when the file does not say).
struct SpecialIds {
  int bos = -1, eos = -1;
  bool add_bos = false;
};
Result<SpecialIds> ReadSpecialIds(const GgufFile& f, int64_t vocab, int64_t add_bos_default) {
  KVF_ASSIGN_OR_RETURN(int64_t bos, f.GetIntOr("tokenizer.ggml.bos_token_id", -1));
  KVF_ASSIGN_OR_RETURN(int64_t eos, f.GetIntOr("tokenizer.ggml.eos_token_id", -1));
  KVF_ASSIGN_OR_RETURN(int64_t add_bos, f.GetIntOr("tokenizer.ggml.add_bos_token", add_bos_default));
  if (bos < -1 || bos >= vocab || eos < -1 || eos >= vocab) {
    return CorruptData(StrCat("gguf: bos id ", bos, " or eos id ", eos, " outside the ", vocab,
                              "-token vocabulary"));
  }
  return SpecialIds{static_cast<int>(bos), static_cast<int>(eos), add_bos != 0 && bos >= 0};
}

class ByteBpeTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> Create(const GgufFile& f) {
    auto tok = std::make_unique<ByteBpeTokenizer>();
    KVF_ASSIGN_OR_RETURN(std::string model, f.GetString("tokenizer.ggml.model"));
    if (model != "gpt2") {
      return Unimplemented(StrCat("gguf: tokenizer model '", model, "' (only gpt2 BPE and llama SentencePiece)"));
    }
    KVF_ASSIGN_OR_RETURN(const GgufValue* tokens, f.Find("tokenizer.ggml.tokens"));
    KVF_ASSIGN_OR_RETURN(const GgufValue* merges, f.Find("tokenizer.ggml.merges"));
    if (tokens->type != GgufType::kArray || tokens->elem_type != GgufType::kString ||
        tokens->strs.empty() || merges->type != GgufType::kArray ||
        merges->elem_type != GgufType::kString) {
      return CorruptData("gguf: tokenizer tokens/merges are not string arrays");
    }
    tok->pieces_ = tokens->strs;
    tok->special_.assign(tok->pieces_.size(), false);
    auto types = f.Find("tokenizer.ggml.token_type");
    if (types.ok() && (*types)->nums.size() == tok->pieces_.size()) {
      for (size_t i = 0; i < tok->pieces_.size(); ++i) {
        const double t = (*types)->nums[i];
        // 3 = control, 4 = user defined: matched whole in the text, never merged into.
        if (t == 3 || t == 4) {
          tok->special_[i] = true;
          if (tok->pieces_[i].size() > 1) tok->special_ids_.push_back(static_cast<int32_t>(i));
        }
      }
    }
    for (size_t i = 0; i < tok->pieces_.size(); ++i) {
      tok->piece_to_id_.emplace(tok->pieces_[i], static_cast<int32_t>(i));
    }
    for (size_t r = 0; r < merges->strs.size(); ++r) {
      tok->merge_rank_.emplace(merges->strs[r], static_cast<int32_t>(r));
    }
    // GPT-2's byte <-> printable code point table.
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
      AppendUtf8(cp, &tok->byte_to_symbol_[b]);
      tok->symbol_to_byte_[cp] = static_cast<uint8_t>(b);
    }
    KVF_ASSIGN_OR_RETURN(const SpecialIds ids,
                         ReadSpecialIds(f, static_cast<int64_t>(tok->pieces_.size()), 0));
    tok->bos_id_ = ids.bos;
    tok->eos_id_ = ids.eos;
    tok->add_bos_ = ids.add_bos;
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

  std::vector<int32_t> Encode(std::string_view text, bool parse_special) const override {
    std::vector<int32_t> ids;
    size_t plain_start = 0;
    if (parse_special && !special_ids_.empty()) {
      for (size_t i = 0; i < text.size();) {
        int32_t match = -1;
        size_t match_len = 0;
        for (int32_t id : special_ids_) {
          const std::string& s = pieces_[id];
          if (s.size() > match_len && text.compare(i, s.size(), s) == 0) {
            match = id;
            match_len = s.size();
          }
        }
        if (match < 0) {
          ++i;
          continue;
        }
        EncodePlain(text.substr(plain_start, i - plain_start), &ids);
        ids.push_back(match);
        i += match_len;
        plain_start = i;
      }
    }
    EncodePlain(text.substr(plain_start), &ids);
    return ids;
  }

  std::string Decode(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return "";
    const std::string& piece = pieces_[id];
    if (special_[id]) return piece;
    std::string out;
    for (size_t i = 0; i < piece.size();) {
      const size_t len = Utf8Length(piece[i], piece.size() - i);
      uint32_t cp = static_cast<uint8_t>(piece[i]);
      if (len == 2) cp = ((cp & 0x1f) << 6) | (piece[i + 1] & 0x3f);
      auto it = symbol_to_byte_.find(cp);
      if (len <= 2 && it != symbol_to_byte_.end()) {
        out.push_back(static_cast<char>(it->second));
      } else {
        out.append(piece, i, len);
      }
      i += len;
    }
    return out;
  }

  int vocab_size() const override { return static_cast<int>(pieces_.size()); }

 private:
  void EncodePlain(std::string_view text, std::vector<int32_t>* ids) const {
    std::vector<std::string> symbols;
    for (std::string_view word : PreTokenize(text)) {
      symbols.clear();
      for (char c : word) symbols.push_back(byte_to_symbol_[static_cast<uint8_t>(c)]);
      // Merge the adjacent pair of lowest rank until none is in the merge table.
      std::string key;
      const std::vector<bool> alive =
          MergeGreedily(symbols, [&](const std::string& a, const std::string& b, double* rank) {
            key.assign(a).append(" ").append(b);
            auto it = merge_rank_.find(key);
            if (it == merge_rank_.end()) return false;
            *rank = static_cast<double>(it->second);
            return true;
          });
      for (size_t k = 0; k < symbols.size(); ++k) {
        if (!alive[k]) continue;
        const std::string& s = symbols[k];
        auto it = piece_to_id_.find(s);
        if (it != piece_to_id_.end()) {
          ids->push_back(it->second);
        } else {
          // A symbol outside the vocabulary: fall back to its single-byte symbols.
          for (size_t i = 0; i < s.size();) {
            const size_t len = Utf8Length(s[i], s.size() - i);
            auto b = piece_to_id_.find(s.substr(i, len));
            if (b != piece_to_id_.end()) ids->push_back(b->second);
            i += len;
          }
        }
      }
    }
  }

  std::vector<std::string> pieces_;
  std::vector<bool> special_;
  std::vector<int32_t> special_ids_;
  std::unordered_map<std::string, int32_t> piece_to_id_;
  std::unordered_map<std::string, int32_t> merge_rank_;
  std::string byte_to_symbol_[256];
  std::unordered_map<uint32_t, uint8_t> symbol_to_byte_;
};

// llama2.c's tokenizer.bin: int32 max_token_length, then per token: f32 score, int32 length,
// bytes. Encoding starts from UTF-8 characters (bytes as <0xXX> = id byte+3 when absent) and
// repeatedly merges the adjacent pair whose concatenation has the highest score.
class Llama2cTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> Create(std::span<const uint8_t> bytes,
                                                   const std::string& path, int vocab_size) {
    KVF_CHECK_ARG(vocab_size > 3 && vocab_size <= (1 << 22), "llama2.c tokenizer: vocabulary of ",
                  vocab_size);
    auto tok = std::make_unique<Llama2cTokenizer>();
    size_t pos = 4;
    if (bytes.size() < pos) return CorruptData(StrCat(path, ": truncated header"));
    // Each token takes at least 8 bytes (score and length): refuse before allocating for them.
    if ((bytes.size() - pos) / 8 < static_cast<size_t>(vocab_size)) {
      return CorruptData(StrCat(path, ": ", bytes.size(), " bytes cannot hold ", vocab_size,
                                " tokens"));
    }
    tok->pieces_.resize(vocab_size);
    tok->scores_.resize(vocab_size);
    for (int i = 0; i < vocab_size; ++i) {
      int32_t len = 0;
      if (bytes.size() - pos < 8) return CorruptData(StrCat(path, ": truncated at token ", i));
      std::memcpy(&tok->scores_[i], bytes.data() + pos, 4);
      std::memcpy(&len, bytes.data() + pos + 4, 4);
      pos += 8;
      if (len < 0 || static_cast<size_t>(len) > bytes.size() - pos) {
        return CorruptData(StrCat(path, ": token ", i, " of length ", len, " runs past the end"));
      }
      tok->pieces_[i].assign(reinterpret_cast<const char*>(bytes.data() + pos), len);
      pos += len;
      tok->piece_to_id_.emplace(tok->pieces_[i], i);
    }
    tok->bos_id_ = 1;
    tok->eos_id_ = 2;
    tok->add_bos_ = true;
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

  std::vector<int32_t> Encode(std::string_view text, bool /*parse_special*/) const override {
    std::vector<int32_t> ids;
    if (text.empty()) return ids;
    auto space = piece_to_id_.find(" ");
    if (space != piece_to_id_.end()) ids.push_back(space->second);  // SentencePiece's prefix
    for (size_t i = 0; i < text.size();) {
      const size_t len = Utf8Length(text[i], text.size() - i);
      auto it = piece_to_id_.find(std::string(text.substr(i, len)));
      if (it != piece_to_id_.end()) {
        ids.push_back(it->second);
      } else {
        // Byte fallback: <0xXX> is id byte + 3; a vocabulary too small to hold it gets <unk> (0).
        for (size_t b = 0; b < len; ++b) {
          const int32_t id = static_cast<uint8_t>(text[i + b]) + 3;
          ids.push_back(id < vocab_size() ? id : 0);
        }
      }
      i += len;
    }
    // Merge the adjacent pair whose concatenation is the token of highest score.
    std::vector<std::string> symbols;
    symbols.reserve(ids.size());
    for (int32_t id : ids) symbols.push_back(pieces_[id]);
    std::string merged;
    const std::vector<bool> alive =
        MergeGreedily(symbols, [&](const std::string& a, const std::string& b, double* priority) {
          merged.assign(a).append(b);
          auto it = piece_to_id_.find(merged);
          if (it == piece_to_id_.end()) return false;
          // As llama2.c: scores must beat -1e30 (NaN never does, which keeps the heap ordered).
          const float score = scores_[it->second];
          if (!(score > -1e30f)) return false;
          *priority = -static_cast<double>(score);
          return true;
        });
    std::vector<int32_t> out;
    for (size_t k = 0; k < symbols.size(); ++k) {
      if (!alive[k]) continue;
      // A symbol that never merged keeps its id (a vocabulary may hold a piece twice).
      out.push_back(symbols[k].size() == pieces_[ids[k]].size() ? ids[k]
                                                                : piece_to_id_.at(symbols[k]));
    }
    return out;
  }

  std::string Decode(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return "";
    const std::string& piece = pieces_[id];
    unsigned byte = 0;
    if (piece.size() == 6 && std::sscanf(piece.c_str(), "<0x%02X>", &byte) == 1) {
      return std::string(1, static_cast<char>(byte));
    }
    return piece;
  }

  int vocab_size() const override { return static_cast<int>(pieces_.size()); }

 private:
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t> piece_to_id_;
};

// SentencePiece-style tokenizer of a GGUF file with tokenizer.ggml.model "llama" (Llama 2, Gemma):
// spaces become U+2581, the text is split into UTF-8 characters, and adjacent symbols whose
// concatenation is a vocabulary piece are merged highest score first (ties: leftmost), as
// llama.cpp's SPM tokenizer does; characters outside the vocabulary fall back to their bytes'
// <0xXX> pieces. tokenizer.ggml.add_space_prefix (default true) prepends a space.
class SpmTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> Create(const GgufFile& f) {
    auto tok = std::make_unique<SpmTokenizer>();
    KVF_ASSIGN_OR_RETURN(const GgufValue* tokens, f.Find("tokenizer.ggml.tokens"));
    if (tokens->type != GgufType::kArray || tokens->elem_type != GgufType::kString ||
        tokens->strs.empty()) {
      return CorruptData("gguf: tokenizer tokens are not a string array");
    }
    tok->pieces_ = tokens->strs;
    const size_t n = tok->pieces_.size();
    tok->scores_.assign(n, 0.0f);
    auto scores = f.Find("tokenizer.ggml.scores");
    if (scores.ok() && (*scores)->nums.size() == n) {
      for (size_t i = 0; i < n; ++i) tok->scores_[i] = static_cast<float>((*scores)->nums[i]);
    }
    tok->type_.assign(n, 1);
    auto types = f.Find("tokenizer.ggml.token_type");
    if (types.ok() && (*types)->nums.size() == n) {
      for (size_t i = 0; i < n; ++i) tok->type_[i] = static_cast<int>((*types)->nums[i]);
    }
    tok->byte_id_.fill(-1);
    for (size_t i = 0; i < n; ++i) {
      const std::string& p = tok->pieces_[i];
      const int32_t id = static_cast<int32_t>(i);
      if (IsBytePiece(tok->type_[i], p)) {
        tok->byte_id_[static_cast<size_t>(std::stoi(p.substr(3, 2), nullptr, 16))] = id;
        continue;
      }
      // 3 = control: matched whole in the text with parse_special; 4 = user defined (Gemma's
      // "\n", "\n\n", runs of spaces, <start_of_image>...): always matched whole, before the
      // merges, as llama.cpp does.
      if (tok->type_[i] == 3 && !p.empty()) tok->special_ids_.push_back(id);
      if (tok->type_[i] == 4 && !p.empty()) tok->user_ids_.push_back(id);
      if (tok->type_[i] != 3) tok->piece_to_id_.emplace(p, id);
    }
    for (const auto* list : {&tok->special_ids_, &tok->user_ids_}) {
      for (int32_t id : *list) tok->first_byte_[static_cast<uint8_t>(tok->pieces_[id][0])] = true;
    }
    KVF_ASSIGN_OR_RETURN(const SpecialIds ids, ReadSpecialIds(f, static_cast<int64_t>(n), 1));
    KVF_ASSIGN_OR_RETURN(int64_t space, f.GetIntOr("tokenizer.ggml.add_space_prefix", 1));
    tok->bos_id_ = ids.bos;
    tok->eos_id_ = ids.eos;
    tok->add_bos_ = ids.add_bos;
    tok->space_prefix_ = space != 0;
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

  std::vector<int32_t> Encode(std::string_view text, bool parse_special) const override {
    std::vector<int32_t> ids;
    size_t plain_start = 0;
    bool first = true;
    if (!user_ids_.empty() || (parse_special && !special_ids_.empty())) {
      for (size_t i = 0; i < text.size();) {
        int32_t match = -1;
        size_t match_len = 0;
        const auto longest = [&](const std::vector<int32_t>& cands) {
          for (int32_t id : cands) {
            const std::string& s = pieces_[id];
            if (s.size() > match_len && text.compare(i, s.size(), s) == 0) {
              match = id;
              match_len = s.size();
            }
          }
        };
        // Only a byte that can start a piece is tried (the lists are long: 6,249 control
        // pieces, 165 user-defined in Gemma 3).
        const auto c = static_cast<uint8_t>(text[i]);
        if (first_byte_[c]) {
          longest(user_ids_);
          if (parse_special) longest(special_ids_);
        }
        if (match < 0) {
          ++i;
          continue;
        }
        EncodePlain(text.substr(plain_start, i - plain_start), first, &ids);
        first = false;
        ids.push_back(match);
        i += match_len;
        plain_start = i;
      }
    }
    EncodePlain(text.substr(plain_start), first, &ids);
    return ids;
  }

  std::string Decode(int32_t id) const override {
    if (id < 0 || id >= static_cast<int32_t>(pieces_.size())) return "";
    const std::string& p = pieces_[id];
    if (IsBytePiece(type_[id], p)) {
      return std::string(1, static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16)));
    }
    std::string out;
    for (size_t i = 0; i < p.size();) {
      if (p.compare(i, 3, "\xe2\x96\x81") == 0) {
        out += ' ';
        i += 3;
      } else {
        out += p[i++];
      }
    }
    return out;
  }

  int vocab_size() const override { return static_cast<int>(pieces_.size()); }

 private:
  static bool IsBytePiece(int type, const std::string& p) {
    return type == 6 && p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' &&
           std::isxdigit(static_cast<unsigned char>(p[3])) &&
           std::isxdigit(static_cast<unsigned char>(p[4]));
  }

  void EncodePlain(std::string_view text, bool first, std::vector<int32_t>* ids) const {
    if (text.empty()) return;
    std::string s;
    if (first && space_prefix_) s = "\xe2\x96\x81";
    for (char c : text) {
      if (c == ' ') {
        s += "\xe2\x96\x81";
      } else {
        s += c;
      }
    }
    // Symbols: byte ranges of s in a doubly linked list.
    struct Sym {
      size_t begin, len;
      int prev, next;
    };
    std::vector<Sym> sym;
    for (size_t i = 0; i < s.size();) {
      const size_t len = Utf8Length(static_cast<uint8_t>(s[i]), s.size() - i);
      const int k = static_cast<int>(sym.size());
      sym.push_back(Sym{i, len, k - 1, k + 1});
      i += len;
    }
    sym.back().next = -1;
    struct Bigram {
      float score;
      int left, right;
      size_t len;
      bool operator<(const Bigram& o) const {
        return score < o.score || (score == o.score && left > o.left);
      }
    };
    std::priority_queue<Bigram> heap;
    std::string piece;
    const auto add = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      piece.assign(s, sym[l].begin, sym[l].len + sym[r].len);
      auto it = piece_to_id_.find(piece);
      if (it == piece_to_id_.end()) return;
      heap.push(Bigram{scores_[it->second], l, r, piece.size()});
    };
    for (size_t i = 1; i < sym.size(); ++i) add(static_cast<int>(i) - 1, static_cast<int>(i));
    while (!heap.empty()) {
      const Bigram b = heap.top();
      heap.pop();
      Sym& l = sym[b.left];
      Sym& r = sym[b.right];
      if (l.len == 0 || r.len == 0 || l.len + r.len != b.len) continue;  // stale
      l.len += r.len;
      r.len = 0;
      l.next = r.next;
      if (r.next >= 0) sym[r.next].prev = b.left;
      add(l.prev, b.left);
      add(b.left, l.next);
    }
    for (int i = 0; i >= 0; i = sym[i].next) {
      piece.assign(s, sym[i].begin, sym[i].len);
      auto it = piece_to_id_.find(piece);
      if (it != piece_to_id_.end()) {
        ids->push_back(it->second);
        continue;
      }
      for (char c : piece) {  // byte fallback
        const int32_t id = byte_id_[static_cast<uint8_t>(c)];
        if (id >= 0) ids->push_back(id);
      }
    }
  }

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<int> type_;
  std::unordered_map<std::string, int32_t> piece_to_id_;
  std::vector<int32_t> special_ids_;  // control pieces, matched with parse_special
  std::vector<int32_t> user_ids_;     // user-defined pieces, always matched
  std::array<bool, 256> first_byte_{};  // first bytes of those pieces
  std::array<int32_t, 256> byte_id_{};
  bool space_prefix_ = true;
};

}  // namespace

std::string Tokenizer::DecodeAll(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) out += Decode(id);
  return out;
}

Result<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const GgufFile& file) {
  auto model = file.GetString("tokenizer.ggml.model");
  if (model.ok() && *model == "llama") return SpmTokenizer::Create(file);
  return ByteBpeTokenizer::Create(file);
}

Result<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const std::string& path) {
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path));
  KVF_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Parse(bytes));
  return LoadGgufTokenizer(f);
}

Result<std::unique_ptr<Tokenizer>> LoadLlama2cTokenizer(const std::string& path, int vocab_size) {
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path));
  return Llama2cTokenizer::Create(bytes, path, vocab_size);
}

Result<std::unique_ptr<Tokenizer>> LoadLlama2cTokenizerFromBytes(std::span<const uint8_t> bytes,
                                                                 int vocab_size) {
  return Llama2cTokenizer::Create(bytes, "llama2.c tokenizer", vocab_size);
}

}  // namespace kvferry::llama
