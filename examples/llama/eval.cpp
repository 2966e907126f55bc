// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "tools/common/progress.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

Status ResetAll(const std::vector<Attention*>& lanes) {
  for (Attention* a : lanes) KVF_RETURN_IF_ERROR(a->Reset());
  return Status::Ok();
}

}  // namespace

Result<std::vector<PerplexityResult>> EvalPerplexity(
    Engine& engine, const std::vector<int32_t>& tokens, int64_t scored,
    const std::vector<Attention*>& lanes, int64_t chunk, double* prefill_seconds,
    const std::function<void(size_t lane, bool after)>& around_decode, bool together) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  KVF_CHECK_ARG(!lanes.empty(), "perplexity: no lanes");
  KVF_CHECK_ARG(scored >= 1 && scored + 2 <= n, "perplexity: ", scored, " scored tokens of a ", n,
                "-token window: need 1 <= scored <= window - 2");
  KVF_RETURN_IF_ERROR(ResetAll(lanes));
  const int64_t prefix = n - scored - 1;
  auto t0 = std::chrono::steady_clock::now();
  KVF_RETURN_IF_ERROR(engine.Prefill(std::span<const int32_t>(tokens.data(), prefix), 0, lanes,
                                     nullptr, false, chunk));
  if (prefill_seconds != nullptr) *prefill_seconds = Seconds(t0);
  std::vector<PerplexityResult> results(lanes.size());
  std::vector<int32_t> lane0_argmax;
  std::vector<float> logits;
  const int64_t vocab = engine.model().config.vocab_size;
  // Scores step p of lanes [l0, l0 + count) from logits [count, vocab].
  const auto score = [&](size_t l0, size_t count, int64_t p) {
    for (size_t i = 0; i < count; ++i) {
      const std::span<const float> row(logits.data() + static_cast<int64_t>(i) * vocab, vocab);
      PerplexityResult& r = results[l0 + i];
      r.nll_sum -= LogProb(row, tokens[p + 1]);
      const int32_t top = Argmax(row);
      if (l0 + i == 0) lane0_argmax.push_back(top);
      if (top == lane0_argmax[p - prefix]) ++r.argmax_agree;
      ++r.scored;
    }
  };
  const size_t groups = together ? 1 : lanes.size();
  const size_t per = together ? lanes.size() : 1;
  for (size_t g = 0; g < groups; ++g) {
    const size_t l0 = g * per;
    for (size_t i = 0; i < per; ++i) {
      if (around_decode) around_decode(l0 + i, false);
    }
    t0 = std::chrono::steady_clock::now();
    tools::Progress progress(together ? "perplexity, " + std::to_string(per) + " lanes together"
                                      : "perplexity, lane " + std::to_string(l0 + 1) + " of " +
                                            std::to_string(lanes.size()),
                             n - 1 - prefix, "tokens");
    const std::span<Attention* const> group(lanes.data() + l0, per);
    std::vector<int32_t> fed(per);
    for (int64_t p = prefix; p < n - 1; ++p) {
      std::fill(fed.begin(), fed.end(), tokens[p]);
      KVF_RETURN_IF_ERROR(engine.DecodeLanes(fed, p, group, &logits));
      score(l0, per, p);
      progress.Update(p - prefix + 1);
    }
    progress.Finish();
    const double secs = Seconds(t0);
    for (size_t i = 0; i < per; ++i) {
      PerplexityResult& r = results[l0 + i];
      r.decode_seconds = secs;
      if (around_decode) around_decode(l0 + i, true);
      r.perplexity = std::exp(r.nll_sum / static_cast<double>(r.scored));
    }
  }
  return results;
}

Result<PasskeyPrompt> BuildPasskeyPrompt(const Tokenizer& tok,
                                         const std::vector<std::string>& filler_lines,
                                         int64_t line_offset, int64_t length, double depth,
                                         const std::string& key, bool chat) {
  KVF_CHECK_ARG(!filler_lines.empty(), "passkey: no filler text");
  KVF_CHECK_ARG(depth >= 0.0 && depth <= 1.0, "passkey: depth ", depth, " outside [0, 1]");
  const std::string intro =
      "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
      "I will quiz you about the pass key.\n";
  const std::string needle =
      "\nThe pass key is " + key + ". Remember it. " + key + " is the pass key.\n";
  const std::string question = "\nWhat is the pass key? The pass key is";
  const std::string open = chat ? "<|im_start|>user\n" : "";
  const std::string close_q =
      chat ? "\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is" : question;
  std::vector<int32_t> head;
  if (tok.add_bos() && tok.bos_id() >= 0) head.push_back(tok.bos_id());
  for (int32_t id : tok.Encode(open + intro, chat)) head.push_back(id);
  const std::vector<int32_t> needle_ids = tok.Encode(needle, false);
  const std::vector<int32_t> tail_ids = tok.Encode(close_q, chat);
  const int64_t filler_budget = length - static_cast<int64_t>(head.size() + needle_ids.size() +
                                                              tail_ids.size());
  KVF_CHECK_ARG(filler_budget > 16, "passkey: length ", length, " too short for the prompt");
  // Whole lines of filler (each with its newline) until the budget is met.
  std::vector<std::vector<int32_t>> lines;
  int64_t total = 0;
  for (int64_t i = 0; total < filler_budget; ++i) {
    const std::string& line =
        filler_lines[static_cast<size_t>((line_offset + i) % static_cast<int64_t>(filler_lines.size()))];
    std::vector<int32_t> ids = tok.Encode(line + "\n", false);
    if (total + static_cast<int64_t>(ids.size()) > filler_budget) {
      ids.resize(static_cast<size_t>(filler_budget - total));
    }
    total += static_cast<int64_t>(ids.size());
    lines.push_back(std::move(ids));
  }
  const int64_t insert_at = static_cast<int64_t>(std::llround(depth * static_cast<double>(total)));
  PasskeyPrompt out;
  out.key = key;
  out.tokens = head;
  int64_t filled = 0;
  bool placed = false;
  for (const auto& ids : lines) {
    if (!placed && filled >= insert_at) {
      out.needle_pos = static_cast<int64_t>(out.tokens.size());
      out.tokens.insert(out.tokens.end(), needle_ids.begin(), needle_ids.end());
      placed = true;
    }
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    filled += static_cast<int64_t>(ids.size());
  }
  if (!placed) {
    out.needle_pos = static_cast<int64_t>(out.tokens.size());
    out.tokens.insert(out.tokens.end(), needle_ids.begin(), needle_ids.end());
  }
  out.tokens.insert(out.tokens.end(), tail_ids.begin(), tail_ids.end());
  return out;
}

Result<std::vector<std::vector<int32_t>>> GenerateGreedy(Engine& engine,
                                                         const std::vector<int32_t>& prompt,
                                                         int max_new,
                                                         const std::vector<Attention*>& lanes,
                                                         int64_t chunk, int32_t stop_token,
                                                         bool together) {
  KVF_CHECK_ARG(prompt.size() >= 2, "generate: prompt of ", prompt.size(), " tokens");
  KVF_RETURN_IF_ERROR(ResetAll(lanes));
  const int64_t prefix = static_cast<int64_t>(prompt.size()) - 1;
  KVF_RETURN_IF_ERROR(engine.Prefill(std::span<const int32_t>(prompt.data(), prefix), 0, lanes,
                                     nullptr, false, chunk));
  std::vector<std::vector<int32_t>> out(lanes.size());
  std::vector<float> logits;
  const int64_t vocab = engine.model().config.vocab_size;
  const size_t per = together ? lanes.size() : 1;
  for (size_t l0 = 0; l0 < lanes.size(); l0 += per) {
    // The last prompt token goes through decode, so the first answer token is already sparse.
    std::vector<int32_t> token(per, prompt.back());
    std::vector<bool> done(per, false);
    const std::span<Attention* const> group(lanes.data() + l0, per);
    for (int i = 0; i < max_new; ++i) {
      KVF_RETURN_IF_ERROR(engine.DecodeLanes(token, prefix + i, group, &logits));
      bool all_done = true;
      for (size_t j = 0; j < per; ++j) {
        // A lane that has stopped keeps decoding its last token with the others; its answer is kept.
        if (done[j]) continue;
        token[j] = Argmax(std::span<const float>(logits.data() + static_cast<int64_t>(j) * vocab, vocab));
        done[j] = token[j] == stop_token;
        if (!done[j]) out[l0 + j].push_back(token[j]);
        all_done = all_done && done[j];
      }
      if (all_done) break;
    }
  }
  return out;
}

int32_t SampleToken(std::vector<float> logits, float temperature, float top_p,
                    std::mt19937_64& rng) {
  if (temperature <= 0.0f) return Argmax(logits);
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float& x : logits) {
    x = std::exp((x - mx) / temperature);
    sum += x;
  }
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  // Smallest prefix of the sorted distribution whose mass reaches top_p.
  double mass = 0;
  size_t keep = 0;
  while (keep < order.size()) {
    mass += logits[order[keep]] / sum;
    ++keep;
    if (mass >= top_p) break;
  }
  std::uniform_real_distribution<double> uni(0.0, mass);
  double r = uni(rng);
  for (size_t i = 0; i < keep; ++i) {
    r -= logits[order[i]] / sum;
    if (r <= 0) return order[i];
  }
  return order[keep - 1];
}

std::string FirstDigits(const std::string& text, size_t n) {
  std::string run;
  for (char c : text) {
    if (c >= '0' && c <= '9') {
      run.push_back(c);
      if (run.size() == n) return run;
    } else if (!run.empty()) {
      run.clear();
    }
  }
  return "";
}

std::vector<std::string> SplitLines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    if (end > start) lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

}  // namespace kvferry::llama
