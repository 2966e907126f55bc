// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tools/common/progress.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {
namespace {

using detail::StrCat;

void RmsNorm(const float* x, const std::vector<float>& w, int64_t dim, float eps, float* out) {
  double ss = 0;
  for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inv * w[i];
}

class ReferenceAttention final : public Attention {
 public:
  explicit ReferenceAttention(const ModelConfig& c)
      : q_heads_(c.num_q_heads), kv_heads_(c.num_kv_heads), head_dim_(c.head_dim),
        scale_(c.attn_scale > 0 ? c.attn_scale : 1.0 / std::sqrt(static_cast<double>(c.head_dim))),
        window_(c.layer_window), k_(c.num_layers), v_(c.num_layers) {
    window_.resize(c.num_layers, 0);
  }

  Status Prefill(int layer, int64_t n, const float* q, const float* k, const float* v,
                 float* out) override {
    return Append(layer, n, q, k, v, out);
  }
  Status Decode(int layer, const float* q, const float* k, const float* v, float* out) override {
    return Append(layer, 1, q, k, v, out);
  }
  Status Append(int layer, int64_t n, const float* k, const float* v) override {
    return Append(layer, n, nullptr, k, v, nullptr);
  }
  Status Reset() override {
    for (auto& x : k_) x.clear();
    for (auto& x : v_) x.clear();
    return Status::Ok();
  }

 private:
  Status Append(int layer, int64_t n, const float* q, const float* k, const float* v,
                float* out) {
    KVF_CHECK_ARG(layer >= 0 && layer < static_cast<int>(k_.size()), "layer ", layer,
                  " out of range");
    const int64_t row = static_cast<int64_t>(kv_heads_) * head_dim_;
    const int64_t past = static_cast<int64_t>(k_[layer].size()) / row;
    k_[layer].insert(k_[layer].end(), k, k + n * row);
    v_[layer].insert(v_[layer].end(), v, v + n * row);
    if (q == nullptr) return Status::Ok();  // stored, not attended
    const float* kc0 = k_[layer].data();
    const float* vc0 = v_[layer].data();
    const double scale = scale_;
    const int group = q_heads_ / kv_heads_;
    const int64_t window = window_[layer];
    std::vector<double> scores;
    std::vector<double> acc(head_dim_);
    for (int64_t t = 0; t < n; ++t) {
      // A sliding-window layer attends positions [end - window, end) of the first end.
      const int64_t end = past + t + 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      const int64_t len = end - first;
      const float* kc = kc0 + first * row;
      const float* vc = vc0 + first * row;
      scores.resize(len);
      for (int h = 0; h < q_heads_; ++h) {
        const float* qh = q + (t * q_heads_ + h) * head_dim_;
        const int kvh = h / group;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < len; ++j) {
          const float* kj = kc + j * row + kvh * head_dim_;
          double s = 0;
          for (int d = 0; d < head_dim_; ++d) s += static_cast<double>(qh[d]) * kj[d];
          scores[j] = s * scale;
          mx = std::max(mx, scores[j]);
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < len; ++j) {
          const double p = std::exp(scores[j] - mx);
          sum += p;
          const float* vj = vc + j * row + kvh * head_dim_;
          for (int d = 0; d < head_dim_; ++d) acc[d] += p * vj[d];
        }
        float* oh = out + (t * q_heads_ + h) * head_dim_;
        for (int d = 0; d < head_dim_; ++d) oh[d] = static_cast<float>(acc[d] / sum);
      }
    }
    return Status::Ok();
  }

  int q_heads_, kv_heads_, head_dim_;
  double scale_;
  std::vector<int> window_;  // per layer: 0 = global, w = sliding window of w tokens
  std::vector<std::vector<float>> k_, v_;  // per layer: [pos, kv_heads, head_dim]
};

}  // namespace

std::unique_ptr<Attention> MakeReferenceAttention(const ModelConfig& config) {
  return std::make_unique<ReferenceAttention>(config);
}

Engine::Engine(const Model& model) : model_(model) {
  const ModelConfig& c = model.config;
  rope_[0].theta = c.rope_theta;
  rope_[0].scale = c.rope_scale_global;
  rope_[1].theta = c.rope_theta_sliding;
}

void Engine::GrowRope(int64_t positions) {
  // Tables grow with the longest position seen; angles in double, as a table of f32.
  const ModelConfig& c = model_.config;
  const int half = c.head_dim / 2;
  const bool sliding = std::any_of(c.layer_window.begin(), c.layer_window.end(),
                                   [](int w) { return w > 0; });
  for (int k = 0; k < (sliding ? 2 : 1); ++k) {
    RopeTable& r = rope_[k];
    const int64_t have = static_cast<int64_t>(r.cos.size()) / half;
    if (positions <= have) continue;
    const int64_t want = std::max<int64_t>(positions, 2 * have);
    r.cos.resize(want * half);
    r.sin.resize(want * half);
    for (int64_t p = have; p < want; ++p) {
      for (int i = 0; i < half; ++i) {
        const float inv_freq =
            static_cast<float>(1.0 / std::pow(r.theta, 2.0 * i / c.head_dim));
        const double angle = static_cast<double>(p) / r.scale * inv_freq;
        r.cos[p * half + i] = static_cast<float>(std::cos(angle));
        r.sin[p * half + i] = static_cast<float>(std::sin(angle));
      }
    }
  }
}

void Engine::HeadNorm(float* x, int64_t n, int num_heads, const std::vector<float>& w) const {
  const ModelConfig& c = model_.config;
  for (int64_t i = 0; i < n * num_heads; ++i) {
    float* h = x + i * c.head_dim;
    RmsNorm(h, w, c.head_dim, c.rms_eps, h);
  }
}

void Engine::ApplyRope(float* x, int64_t n, int num_heads, int64_t pos, int layer) const {
  const ModelConfig& c = model_.config;
  const int half = c.head_dim / 2;
  const RopeTable& table = rope_[c.window_of(layer) > 0 ? 1 : 0];
  for (int64_t t = 0; t < n; ++t) {
    const float* cs = &table.cos[(pos + t) * half];
    const float* sn = &table.sin[(pos + t) * half];
    for (int h = 0; h < num_heads; ++h) {
      float* xh = x + (t * num_heads + h) * c.head_dim;
      for (int i = 0; i < half; ++i) {
        // kHalves pairs (i, i + half); kAdjacent pairs (2i, 2i + 1).
        const int a = c.rope_style == RopeStyle::kHalves ? i : 2 * i;
        const int b = c.rope_style == RopeStyle::kHalves ? i + half : 2 * i + 1;
        const float x0 = xh[a];
        const float x1 = xh[b];
        xh[a] = x0 * cs[i] - x1 * sn[i];
        xh[b] = x1 * cs[i] + x0 * sn[i];
      }
    }
  }
}

Status Engine::Prefill(std::span<const int32_t> tokens, int64_t pos,
                       std::span<Attention* const> attns, std::vector<float>* logits,
                       bool all_logits, int64_t chunk) {
  KVF_CHECK_ARG(!attns.empty(), "prefill: no attention");
  KVF_CHECK_ARG(chunk > 0, "prefill: chunk ", chunk);
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t vocab = model_.config.vocab_size;
  if (logits != nullptr) logits->assign(all_logits ? n * vocab : vocab, 0.0f);
  tools::Progress progress("prefill", n, "tokens", stderr, -1, nullptr, 5.0, chunk + 1);
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    float* dst = nullptr;
    bool all = false;
    if (logits != nullptr && all_logits) {
      dst = logits->data() + start * vocab;
      all = true;
    } else if (logits != nullptr && start + len == n) {
      dst = logits->data();
    }
    KVF_RETURN_IF_ERROR(
        Forward(tokens.subspan(start, len), pos + start, attns, false, dst, all, pos + n));
    progress.Update(start + len);
  }
  return Status::Ok();
}

Status Engine::CheckTokens(std::span<const int32_t> tokens, int64_t pos) const {
  const int64_t n = static_cast<int64_t>(tokens.size());
  KVF_CHECK_ARG(n > 0 && pos >= 0, "forward: ", n, " tokens at position ", pos);
  for (int32_t t : tokens) {
    KVF_CHECK_ARG(t >= 0 && t < model_.config.vocab_size, "token ", t, " out of range [0, ",
                  model_.config.vocab_size, ")");
  }
  return Status::Ok();
}

bool Engine::CanDecodeOnDevice(std::span<Attention* const> lanes) const {
  return gpu_ != nullptr && !observer_ &&
         std::all_of(lanes.begin(), lanes.end(), [](const Attention* a) { return a->decodes_on_device(); });
}

Status Engine::Decode(int32_t token, int64_t pos, Attention& attn, std::vector<float>* logits) {
  Attention* attns[1] = {&attn};
  if (logits != nullptr) logits->resize(model_.config.vocab_size);
  if (CanDecodeOnDevice(attns)) {
    const std::span<const int32_t> tokens(&token, 1);
    KVF_RETURN_IF_ERROR(CheckTokens(tokens, pos));
    return DecodeOnDevice(tokens, pos, attns, logits != nullptr ? logits->data() : nullptr);
  }
  return Forward(std::span<const int32_t>(&token, 1), pos, attns, true,
                 logits != nullptr ? logits->data() : nullptr, false);
}

Status Engine::DecodeLanes(std::span<const int32_t> tokens, int64_t pos,
                           std::span<Attention* const> lanes, std::vector<float>* logits) {
  KVF_CHECK_ARG(!lanes.empty() && tokens.size() == lanes.size(), "decode: ", tokens.size(),
                " tokens for ", lanes.size(), " lanes (one token a lane, at least one lane)");
  KVF_CHECK_ARG(!observer_ || lanes.size() == 1, "decode: ", lanes.size(),
                " lanes at once with an observer set (it reads rows as consecutive positions)");
  if (logits != nullptr) logits->resize(lanes.size() * static_cast<size_t>(model_.config.vocab_size));
  if (CanDecodeOnDevice(lanes)) {
    KVF_RETURN_IF_ERROR(CheckTokens(tokens, pos));
    return DecodeOnDevice(tokens, pos, lanes, logits != nullptr ? logits->data() : nullptr);
  }
  return Forward(tokens, pos, lanes, true, logits != nullptr ? logits->data() : nullptr, true);
}

Status Engine::Forward(std::span<const int32_t> tokens, int64_t pos,
                       std::span<Attention* const> attns, bool decode, float* logits,
                       bool all_logits, int64_t prompt_end) {
  const ModelConfig& c = model_.config;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t dim = c.dim;
  const int64_t q_dim = static_cast<int64_t>(c.num_q_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  KVF_RETURN_IF_ERROR(CheckTokens(tokens, pos));
  GrowRope(pos + n);
  x_.resize(n * dim);
  xb_.resize(n * dim);
  q_.resize(n * q_dim);
  k_.resize(n * kv_dim);
  v_.resize(n * kv_dim);
  att_.resize(n * q_dim);
  gate_.resize(n * c.hidden_dim);
  up_.resize(n * c.hidden_dim);
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(&model_.token_embedding.data[static_cast<int64_t>(tokens[t]) * dim], dim,
                &x_[t * dim]);
  }
  if (c.embed_scale != 1.0f) {
    for (int64_t i = 0; i < n * dim; ++i) x_[i] *= c.embed_scale;
  }
  const bool etf = !decode && etf_.on;
  if (etf && etf_.copy_kv) {
    prev_k_.resize(n * kv_dim);
    prev_v_.resize(n * kv_dim);
  }
  for (int l = 0; l < c.num_layers; ++l) {
    // ETF: rows [f0, f1) of this pass are frozen at layer l; the others run as usual.
    int64_t f0 = 0, f1 = 0;
    if (etf) {
      f0 = std::clamp<int64_t>(etf_.sink - pos, 0, n);
      f1 = std::clamp<int64_t>(EtfFrozenEnd(etf_, c.num_layers, l, prompt_end) - pos, f0, n);
    }
    if (!decode) {
      prefill_rows_ += n;
      etf_frozen_rows_ += f1 - f0;
    }
    if (f1 > f0) {
      const int64_t rows = f1 - f0;
      if (etf_.copy_kv) {
        std::copy_n(prev_k_.data() + f0 * kv_dim, rows * kv_dim, k_.data() + f0 * kv_dim);
        std::copy_n(prev_v_.data() + f0 * kv_dim, rows * kv_dim, v_.data() + f0 * kv_dim);
      } else {  // this layer's K and V of the frozen hidden states
        const LayerWeights& w = model_.layers[l];
        for (int64_t t = f0; t < f1; ++t) RmsNorm(&x_[t * dim], w.attn_norm, dim, c.rms_eps, &xb_[t * dim]);
        KVF_RETURN_IF_ERROR(matmul_.Run(xb_.data() + f0 * dim, rows, w.wk, k_.data() + f0 * kv_dim));
        KVF_RETURN_IF_ERROR(matmul_.Run(xb_.data() + f0 * dim, rows, w.wv, v_.data() + f0 * kv_dim));
        if (!w.k_norm.empty()) HeadNorm(k_.data() + f0 * kv_dim, rows, c.num_kv_heads, w.k_norm);
        ApplyRope(k_.data() + f0 * kv_dim, rows, c.num_kv_heads, pos + f0, l);
      }
      std::fill_n(q_.data() + f0 * q_dim, rows * q_dim, 0.0f);  // what the observer sees
    }
    if (f1 > f0) {
      KVF_RETURN_IF_ERROR(LayerRows(l, 0, f0, pos, attns, decode));
      for (size_t a = attns.size(); a-- > 0;) {
        KVF_RETURN_IF_ERROR(attns[a]->Append(l, f1 - f0, k_.data() + f0 * kv_dim, v_.data() + f0 * kv_dim));
      }
      KVF_RETURN_IF_ERROR(LayerRows(l, f1, n, pos, attns, decode));
    } else {
      // Nothing frozen at this layer: the rows run as one pass, exactly as without ETF (split at
      // the sinks, the matmuls' shapes differed, and with them oneDNN's summation order).
      KVF_RETURN_IF_ERROR(LayerRows(l, 0, n, pos, attns, decode));
    }
    if (observer_) observer_(l, pos, n, q_.data(), k_.data(), v_.data());
    if (etf && etf_.copy_kv) {
      std::copy_n(k_.data(), n * kv_dim, prev_k_.data());
      std::copy_n(v_.data(), n * kv_dim, prev_v_.data());
    }
  }
  if (logits == nullptr) return Status::Ok();
  const int64_t first = all_logits ? 0 : n - 1;
  const int64_t rows = n - first;
  for (int64_t t = first; t < n; ++t) {
    RmsNorm(&x_[t * dim], model_.final_norm, dim, c.rms_eps, &xb_[(t - first) * dim]);
  }
  return matmul_.Run(xb_.data(), rows, model_.classifier(), logits);
}

Status Engine::LayerRows(int l, int64_t r0, int64_t r1, int64_t pos,
                         std::span<Attention* const> attns, bool decode) {
  if (r1 <= r0) return Status::Ok();
  const ModelConfig& c = model_.config;
  const LayerWeights& w = model_.layers[l];
  const int64_t n = r1 - r0;
  const int64_t dim = c.dim;
  const int64_t q_dim = static_cast<int64_t>(c.num_q_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  float* x = x_.data() + r0 * dim;
  float* xb = xb_.data() + r0 * dim;
  float* q = q_.data() + r0 * q_dim;
  float* k = k_.data() + r0 * kv_dim;
  float* v = v_.data() + r0 * kv_dim;
  float* att = att_.data() + r0 * q_dim;
  float* gate = gate_.data() + r0 * c.hidden_dim;
  float* up = up_.data() + r0 * c.hidden_dim;
  for (int64_t t = 0; t < n; ++t) RmsNorm(&x[t * dim], w.attn_norm, dim, c.rms_eps, &xb[t * dim]);
  KVF_RETURN_IF_ERROR(matmul_.Run(xb, n, w.wq, q));
  KVF_RETURN_IF_ERROR(matmul_.Run(xb, n, w.wk, k));
  KVF_RETURN_IF_ERROR(matmul_.Run(xb, n, w.wv, v));
  if (!w.q_norm.empty()) HeadNorm(q, n, c.num_q_heads, w.q_norm);
  if (!w.k_norm.empty()) HeadNorm(k, n, c.num_kv_heads, w.k_norm);
  if (decode) {  // row t: lane t's token at position pos
    for (int64_t t = 0; t < n; ++t) {
      ApplyRope(q + t * q_dim, 1, c.num_q_heads, pos, l);
      ApplyRope(k + t * kv_dim, 1, c.num_kv_heads, pos, l);
      KVF_RETURN_IF_ERROR(attns[static_cast<size_t>(r0 + t)]->Decode(
          l, q + t * q_dim, k + t * kv_dim, v + t * kv_dim, att + t * q_dim));
    }
  } else {
    ApplyRope(q, n, c.num_q_heads, pos + r0, l);
    ApplyRope(k, n, c.num_kv_heads, pos + r0, l);
    for (size_t a = attns.size(); a-- > 0;) {
      // Every cache gets the same rows; the first attention's output is the one kept, so the
      // others whose state does not depend on the queries only store the rows.
      if (a > 0 && !attns[a]->prefill_reads_queries()) {
        KVF_RETURN_IF_ERROR(attns[a]->Append(l, n, k, v));
      } else {
        KVF_RETURN_IF_ERROR(attns[a]->Prefill(l, n, q, k, v, att));
      }
    }
  }
  KVF_RETURN_IF_ERROR(matmul_.Run(att, n, w.wo, xb));
  if (!w.post_attn_norm.empty()) {
    for (int64_t t = 0; t < n; ++t) RmsNorm(&xb[t * dim], w.post_attn_norm, dim, c.rms_eps, &xb[t * dim]);
  }
  for (int64_t i = 0; i < n * dim; ++i) x[i] += xb[i];
  for (int64_t t = 0; t < n; ++t) RmsNorm(&x[t * dim], w.ffn_norm, dim, c.rms_eps, &xb[t * dim]);
  KVF_RETURN_IF_ERROR(matmul_.Run(xb, n, w.w_gate, gate));
  KVF_RETURN_IF_ERROR(matmul_.Run(xb, n, w.w_up, up));
  if (c.activation == Activation::kGeluTanh) {
    // GELU, tanh approximation (Hugging Face's gelu_pytorch_tanh), computed in double.
    constexpr double kC = 0.7978845608028654;  // sqrt(2 / pi)
    for (int64_t i = 0; i < n * c.hidden_dim; ++i) {
      const double g = gate[i];
      gate[i] = static_cast<float>(0.5 * g * (1.0 + std::tanh(kC * (g + 0.044715 * g * g * g)))) * up[i];
    }
  } else {
    for (int64_t i = 0; i < n * c.hidden_dim; ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
  }
  KVF_RETURN_IF_ERROR(matmul_.Run(gate, n, w.w_down, xb));
  if (!w.post_ffn_norm.empty()) {
    for (int64_t t = 0; t < n; ++t) RmsNorm(&xb[t * dim], w.post_ffn_norm, dim, c.rms_eps, &xb[t * dim]);
  }
  for (int64_t i = 0; i < n * dim; ++i) x[i] += xb[i];
  return Status::Ok();
}

int EtfStartLayer(const EtfOptions& etf, int num_layers) {
  return etf.start >= 0 ? etf.start : 3 * num_layers / 4;
}

int64_t EtfFrozenEnd(const EtfOptions& etf, int num_layers, int layer, int64_t prompt_end) {
  if (!etf.on || num_layers <= 0) return 0;
  const int start = EtfStartLayer(etf, num_layers);
  if (layer <= start || start >= num_layers) return 0;
  const double x = etf.gamma * static_cast<double>(layer - start) / static_cast<double>(num_layers - start);
  return static_cast<int64_t>(std::floor((1.0 - std::pow(etf.psi, x)) * static_cast<double>(prompt_end)));
}

Status Engine::set_etf(const EtfOptions& etf) {
  KVF_CHECK_ARG(!etf.on || (etf.psi > 0 && etf.psi <= 1 && etf.gamma > 0 && etf.sink >= 0 &&
                            etf.start >= -1),
                "ETF: psi ", etf.psi, " must be in (0, 1], gamma ", etf.gamma, " > 0, sink ",
                etf.sink, " >= 0, start ", etf.start, " >= -1");
  etf_ = etf;
  return Status::Ok();
}

int32_t Argmax(std::span<const float> v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

double LogProb(std::span<const float> logits, int32_t target) {
  double mx = -std::numeric_limits<double>::infinity();
  for (float x : logits) mx = std::max(mx, static_cast<double>(x));
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  return static_cast<double>(logits[target]) - mx - std::log(sum);
}

}  // namespace kvferry::llama
