// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file eval.h
/// \brief Evaluation on real text: perplexity, passkey retrieval, attention traces, sampling.

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "examples/llama/engine.h"
#include "examples/llama/tokenizer.h"
#include "kvferry/status.h"

namespace kvferry::llama {

/// \brief Scores of one attention (lane) over the same window.
struct PerplexityResult {
  double nll_sum = 0;          ///< summed negative log-likelihood (nats)
  int64_t scored = 0;          ///< tokens scored
  double perplexity = 0;       ///< exp(nll_sum / scored)
  double decode_seconds = 0;   ///< wall time of the scored decode steps
  int64_t argmax_agree = 0;    ///< steps whose argmax equals lane 0's (lane 0: itself)
};

/// Perplexity of \p tokens[N - scored, N) given everything before them: tokens[0, N - scored - 1)
/// are prefilled once into every lane (prefill is dense in every policy), then each lane decodes
/// tokens N - scored - 1 .. N - 2 one by one, feeding the true token and scoring the next, so the
/// scored predictions are exactly what each lane's sparse decode produces. Resets every lane first.
/// \p prefill_seconds receives the shared prefill's wall time. \p around_decode, if set, is called
/// with (lane, false) just before a lane's scored decode steps and (lane, true) just after them,
/// so that a caller can take counters around decode alone.
/// \p together: the lanes decode each step at once (Engine::DecodeLanes: the weights read once a
/// step for every lane, for quality runs of many lanes); each lane's decode_seconds is then the
/// shared time of all of them, and around_decode is called for every lane before the first step
/// and after the last.
Result<std::vector<PerplexityResult>> EvalPerplexity(
    Engine& engine, const std::vector<int32_t>& tokens, int64_t scored,
    const std::vector<Attention*>& lanes, int64_t chunk, double* prefill_seconds,
    const std::function<void(size_t lane, bool after)>& around_decode = {}, bool together = false);

/// \brief A passkey prompt: a pass key sentence hidden at \p depth of filler text.
struct PasskeyPrompt {
  std::vector<int32_t> tokens;
  std::string key;        ///< the 5 digits
  int64_t needle_pos = 0;  ///< token position of the needle sentence
};

/// Builds a prompt of about \p length tokens from \p filler_lines (e.g. KJV verses, used in order
/// from \p line_offset), with the key at fractional \p depth in [0, 1].
Result<PasskeyPrompt> BuildPasskeyPrompt(const Tokenizer& tok,
                                         const std::vector<std::string>& filler_lines,
                                         int64_t line_offset, int64_t length, double depth,
                                         const std::string& key, bool chat);

/// Greedy continuation of \p prompt (prefilled once into every lane) for \p max_new tokens per
/// lane. Resets every lane first. Returns the generated ids per lane. \p together: the lanes
/// decode each step at once (Engine::DecodeLanes), as in EvalPerplexity.
Result<std::vector<std::vector<int32_t>>> GenerateGreedy(Engine& engine,
                                                         const std::vector<int32_t>& prompt,
                                                         int max_new,
                                                         const std::vector<Attention*>& lanes,
                                                         int64_t chunk, int32_t stop_token,
                                                         bool together = false);

/// Samples from \p logits: greedy when \p temperature <= 0, else nucleus (top-p) sampling.
int32_t SampleToken(std::vector<float> logits, float temperature, float top_p, std::mt19937_64& rng);

/// The first run of \p n digits in \p text, or "" if none.
std::string FirstDigits(const std::string& text, size_t n);

/// Splits \p text into non-empty lines.
std::vector<std::string> SplitLines(const std::string& text);

}  // namespace kvferry::llama
