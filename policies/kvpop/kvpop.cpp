// Copyright kvferry authors. Apache-2.0.
#include "policies/kvpop/kvpop.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>

#include "base/check.h"
#include "cpu/attention.h"

namespace kvferry {
namespace {

// ---- a small JSON reader for the safetensors header (objects, arrays, strings, numbers) --------
// policies/ may not include examples/ (whose reader this mirrors in spirit, not in code).
struct Json {
  enum Kind { kNull, kNum, kStr, kArr, kObj } kind = kNull;
  double num = 0;
  std::string str;
  std::vector<Json> arr;
  std::vector<std::pair<std::string, Json>> obj;
  const Json* Find(const std::string& key) const {
    for (const auto& [k, v] : obj) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}
  bool Parse(Json& out, int depth = 0) {
    if (depth > 16) return false;
    Skip();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '{') {
      out.kind = Json::kObj;
      return ParseList('}', [&] {
        Json key, v;
        Skip();
        if (!ParseString(key.str)) return false;
        Skip();
        if (!Peek(':')) return false;
        ++i_;
        if (!Parse(v, depth + 1)) return false;
        out.obj.emplace_back(std::move(key.str), std::move(v));
        return true;
      });
    }
    if (c == '[') {
      out.kind = Json::kArr;
      return ParseList(']', [&] {
        Json v;
        if (!Parse(v, depth + 1)) return false;
        out.arr.push_back(std::move(v));
        return true;
      });
    }
    if (c == '"') {
      out.kind = Json::kStr;
      return ParseString(out.str);
    }
    const char* begin = s_.c_str() + i_;
    char* end = nullptr;
    out.num = std::strtod(begin, &end);
    if (end == begin) return false;
    out.kind = Json::kNum;
    i_ += static_cast<size_t>(end - begin);
    return true;
  }

 private:
  // The members of an object or array: at its opening bracket, \p item for each (it reads one
  // member), separated by commas, up to \p close.
  template <class Item>
  bool ParseList(char close, Item&& item) {
    ++i_;
    Skip();
    if (Peek(close)) return ++i_, true;
    for (;;) {
      if (!item()) return false;
      Skip();
      if (Peek(',')) {
        ++i_;
        continue;
      }
      if (Peek(close)) return ++i_, true;
      return false;
    }
  }
  void Skip() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  bool Peek(char c) const { return i_ < s_.size() && s_[i_] == c; }
  bool ParseString(std::string& out) {
    if (!Peek('"')) return false;
    ++i_;
    while (i_ < s_.size() && s_[i_] != '"') {
      if (s_[i_] == '\\') {
        if (++i_ >= s_.size()) return false;
        const char e = s_[i_];
        out.push_back(e == 'n' ? '\n' : e == 't' ? '\t' : e);  // names and numbers only
      } else {
        out.push_back(s_[i_]);
      }
      ++i_;
    }
    if (i_ >= s_.size()) return false;
    ++i_;
    return true;
  }
  const std::string& s_;
  size_t i_ = 0;
};

Status ReadTensor(const std::string& path, const Json& header, const std::string& data,
                  const char* name, const std::vector<int64_t>& shape, std::vector<float>& out) {
  const Json* t = header.Find(name);
  KVF_CHECK_CODE(t != nullptr && t->kind == Json::kObj, StatusCode::kCorruptData, path,
                 ": kvpop weights have no tensor '", name, "'");
  const Json* dtype = t->Find("dtype");
  const Json* shp = t->Find("shape");
  const Json* off = t->Find("data_offsets");
  KVF_CHECK_CODE(dtype != nullptr && dtype->str == "F32", StatusCode::kCorruptData, path,
                 ": tensor '", name, "' must be F32");
  KVF_CHECK_CODE(shp != nullptr && shp->kind == Json::kArr && shp->arr.size() == shape.size(),
                 StatusCode::kCorruptData, path, ": tensor '", name, "' has rank ",
                 shp == nullptr ? 0 : shp->arr.size(), ", expected ", shape.size());
  int64_t count = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    KVF_CHECK_CODE(static_cast<int64_t>(shp->arr[i].num) == shape[i], StatusCode::kCorruptData,
                   path, ": tensor '", name, "' dimension ", i, " is ", shp->arr[i].num,
                   ", expected ", shape[i]);
    count *= shape[i];
  }
  KVF_CHECK_CODE(off != nullptr && off->kind == Json::kArr && off->arr.size() == 2,
                 StatusCode::kCorruptData, path, ": tensor '", name, "' has no data_offsets");
  const double a = off->arr[0].num, b = off->arr[1].num;
  KVF_CHECK_CODE(a >= 0 && b >= a && b <= static_cast<double>(data.size()) &&
                     static_cast<int64_t>(b - a) == count * 4,
                 StatusCode::kCorruptData, path, ": tensor '", name, "' offsets [", a, ", ", b,
                 ") do not fit ", count, " floats in ", data.size(), " data bytes");
  out.resize(static_cast<size_t>(count));
  if (count > 0) std::memcpy(out.data(), data.data() + static_cast<size_t>(a), static_cast<size_t>(count) * 4);
  return Status::Ok();
}

int64_t Dim(const Json& header, const char* name, size_t i) {
  const Json* t = header.Find(name);
  if (t == nullptr) return -1;
  const Json* s = t->Find("shape");
  if (s == nullptr || s->arr.size() <= i) return -1;
  return static_cast<int64_t>(s->arr[i].num);
}

// The entry every other ranks above (lowest priority, then highest position) of count >= 1.
int64_t WorstSlot(const int32_t* slot_pos, const float* slot_prio, int64_t count) {
  int64_t w = 0;
  for (int64_t i = 1; i < count; ++i) {
    if (KvpopRanksAbove(slot_prio[w], slot_pos[w], slot_prio[i], slot_pos[i])) w = i;
  }
  return w;
}

}  // namespace

Result<KvpopScorerWeights> LoadKvpopWeights(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KVF_CHECK_CODE(f.good(), StatusCode::kIoError, "cannot open kvpop weights '", path, "'");
  uint64_t hlen = 0;
  f.read(reinterpret_cast<char*>(&hlen), 8);
  KVF_CHECK_CODE(f.good() && hlen > 1 && hlen < (64u << 20), StatusCode::kCorruptData, path,
                 ": not a safetensors file (header length ", hlen, ")");
  std::string head(static_cast<size_t>(hlen), '\0');
  f.read(head.data(), static_cast<std::streamsize>(hlen));
  KVF_CHECK_CODE(f.good(), StatusCode::kCorruptData, path, ": truncated header");
  std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  Json header;
  JsonParser parser(head);
  KVF_CHECK_CODE(parser.Parse(header) && header.kind == Json::kObj, StatusCode::kCorruptData,
                 path, ": header is not a JSON object");
  KvpopScorerWeights w;
  const int64_t layers = Dim(header, "w1", 0), heads = Dim(header, "w1", 1),
                hidden = Dim(header, "w1", 2), in_dim = Dim(header, "w1", 3);
  KVF_CHECK_CODE(layers >= 1 && heads >= 1 && hidden >= 1 && in_dim >= 2 && layers < 4096 &&
                     heads < 4096 && hidden < 65536 && in_dim <= 1024,
                 StatusCode::kCorruptData, path, ": tensor 'w1' must be [layers, kv_heads, hidden, 2 head_dim]");
  w.num_layers = static_cast<int>(layers);
  w.num_kv_heads = static_cast<int>(heads);
  w.hidden = static_cast<int>(hidden);
  w.in_dim = static_cast<int>(in_dim);
  KVF_RETURN_IF_ERROR(ReadTensor(path, header, data, "w1", {layers, heads, hidden, in_dim}, w.w1));
  KVF_RETURN_IF_ERROR(ReadTensor(path, header, data, "b1", {layers, heads, hidden}, w.b1));
  KVF_RETURN_IF_ERROR(ReadTensor(path, header, data, "w2", {layers, heads, hidden}, w.w2));
  KVF_RETURN_IF_ERROR(ReadTensor(path, header, data, "b2", {layers, heads}, w.b2));
  KVF_RETURN_IF_ERROR(ReadTensor(path, header, data, "alpha", {layers, heads}, w.alpha));
  if (const Json* meta = header.Find("__metadata__"); meta != nullptr) {
    if (const Json* g = meta->Find("gamma_min"); g != nullptr) w.gamma_min = std::strtof(g->str.c_str(), nullptr);
    if (const Json* g = meta->Find("gamma_max"); g != nullptr) w.gamma_max = std::strtof(g->str.c_str(), nullptr);
  }
  KVF_CHECK_CODE(w.gamma_min > 0 && w.gamma_min <= w.gamma_max && w.gamma_max < 1,
                 StatusCode::kCorruptData, path, ": gamma_min ", w.gamma_min, " / gamma_max ",
                 w.gamma_max, " must satisfy 0 < gamma_min <= gamma_max < 1");
  return w;
}

float KvpopLogGamma(float alpha, float gamma_min, float gamma_max) {
  const float lo = std::log(gamma_min), hi = std::log(gamma_max);
  const float sig = 1.0f / (1.0f + std::exp(-alpha));
  return lo + sig * (hi - lo);
}

int64_t KvpopAdmit(int32_t* slot_pos, float* slot_prio, int64_t* count, int64_t k, int32_t pos,
                   float prio) {
  if (*count < k) {
    slot_pos[*count] = pos;
    slot_prio[*count] = prio;
    ++*count;
    return -1;
  }
  if (k <= 0) return pos;
  const int64_t w = WorstSlot(slot_pos, slot_prio, *count);
  const bool beats = KvpopRanksAbove(prio, pos, slot_prio[w], slot_pos[w]);
  if (!beats) return pos;
  const int32_t out = slot_pos[w];
  slot_pos[w] = pos;
  slot_prio[w] = prio;
  return out;
}

namespace {
Status CheckKvpopCombination(const KvpopParams& kp) {
  KVF_CHECK_ARG(kp.scorer != 2 || kp.device != 1,
                "kvpop parameter 'device' = 1 with 'scorer' = 2: the attention-mass scorer reads "
                "each step's query on the host, so it selects on the host (device = 0)");
  KVF_CHECK_ARG(kp.decay != 1 || kp.device != 1,
                "kvpop parameter 'device' = 1 with 'decay' = 1: the decay chosen from the prompt's "
                "queries is the host selection's (device = 0)");
  return Status::Ok();
}
}  // namespace

Result<KvpopParams> ParseKvpopParams(const std::map<std::string, double>& params) {
  using K = KvpopParams;
  static const ParamSpec<K> kTable[] = {
      {"scorer", &K::scorer, -1, 2},
      {"gamma", &K::gamma, 0, 1, true},
      {"gamma_min", &K::gamma_min, 0, 1, true},
      {"gamma_max", &K::gamma_max, 0, 1, true},
      {"device", &K::device, 0, 1},
      {"decay", &K::decay, 0, 1},
  };
  KVF_ASSIGN_OR_RETURN(K kp, ParseParams<K>("kvpop", params, kTable));
  KVF_CHECK_ARG(kp.gamma_min <= kp.gamma_max, "kvpop parameter 'gamma_min' = ", kp.gamma_min,
                " exceeds 'gamma_max' = ", kp.gamma_max);
  KVF_RETURN_IF_ERROR(CheckKvpopCombination(kp));
  return kp;
}

float KvpopMassScore(const float* mass, int group, int window) {
  float m = 0.0f;
  for (int g = 0; g < group; ++g) m = std::max(m, mass[g]);
  return std::log(kKvpopMassEps + m / static_cast<float>(std::max(window, 1)));
}

void KvpopPolicy::CountQueries(HeadState* st, const KvPages& kv, const AttnParams& p, int sink,
                               int window, int64_t d, const float* q_d) {
  const int group = p.group, hd = p.head_dim;
  const float floor_score = std::log(kKvpopMassEps);
  const auto push = [&](int64_t pos, float r) {
    if (st->scores.empty()) st->score_base = pos;
    // Tokens leave the window in order, one a query: the scores stay contiguous.
    if (pos == st->score_base + static_cast<int64_t>(st->scores.size())) st->scores.push_back(r);
  };
  if (window <= 0) {  // every token leaves at once, never attended as the window
    for (int64_t e = st->mass_next; e <= d; ++e) {
      if (e >= sink) push(e, floor_score);
    }
    st->mass_next = std::max(st->mass_next, d + 1);
    return;
  }
  st->mass.resize(static_cast<size_t>(window) * group);
  thread_local std::vector<float> kbuf, logits, weights;
  kbuf.resize(static_cast<size_t>(hd));
  for (int64_t e = st->mass_next; e <= d; ++e) {
    // Query e: token e - window has had its window's queries [e - window, e); token e enters.
    const int64_t out = e - window;
    if (out >= sink) push(out, KvpopMassScore(&st->mass[static_cast<size_t>(out % window) * group], group, window));
    float* enter = &st->mass[static_cast<size_t>(e % window) * group];
    std::fill(enter, enter + group, 0.0f);
    if (e != d || q_d == nullptr) continue;  // a query not seen adds nothing
    // Its softmax over the sinks and the window [max(sink, e - window + 1), e] (the rows every
    // step attends), head by head; the window's tokens take their share.
    const int64_t s_end = std::min<int64_t>(sink, e + 1);
    const int64_t w_lo = std::max<int64_t>(sink, e - window + 1);
    const int64_t rows = s_end + std::max<int64_t>(e + 1 - w_lo, 0);
    logits.resize(static_cast<size_t>(rows) * group);
    int64_t r = 0;
    for (int64_t j = 0; j <= e; ++j) {
      if (j == s_end) j = w_lo;
      LoadRowF32(kv, p, j, false, kbuf.data());
      for (int g = 0; g < group; ++g) {
        const float* q = q_d + static_cast<size_t>(g) * hd;
        float dot = 0.0f;
        for (int i = 0; i < hd; ++i) dot += q[i] * kbuf[i];
        logits[static_cast<size_t>(g) * rows + r] = dot * p.scale;
      }
      ++r;
    }
    weights.resize(static_cast<size_t>(rows));
    for (int g = 0; g < group; ++g) {
      std::fill(weights.begin(), weights.end(), 0.0f);
      cpu::SoftmaxAccumulate(logits.data() + static_cast<size_t>(g) * rows, rows, 1.0f, weights.data());
      for (int64_t i = s_end; i < rows; ++i) {
        const int64_t t = w_lo + (i - s_end);
        st->mass[static_cast<size_t>(t % window) * group + g] += weights[static_cast<size_t>(i)];
      }
    }
  }
  st->mass_next = std::max(st->mass_next, d + 1);
}

Status KvpopPolicy::OnPrefill(const PrefillContext& ctx) {
  if ((params_.scorer != 2 && params_.decay != 1) || ctx.q == nullptr) return Status::Ok();
  KVF_ASSIGN_OR_RETURN(HeadState * st, states_.Get("kvpop", ctx.slot, ctx.layer, ctx.kv_head, true));
  const size_t row = static_cast<size_t>(ctx.params.group) * ctx.params.head_dim;
  const int64_t cal_end = st->cal_pos0 + static_cast<int64_t>(st->cal_q.size() / std::max<size_t>(row, 1));
  if (ctx.q_pos0 < st->mass_next || ctx.q_pos0 < st->next_u || (!st->cal_q.empty() && ctx.q_pos0 < cal_end)) {
    *st = HeadState{};  // a new sequence
  }
  if (params_.decay == 1 && !st->calibrated) {  // keep the last kKvpopCalibrationQueries queries
    if (st->cal_q.empty()) st->cal_pos0 = ctx.q_pos0;
    st->cal_q.insert(st->cal_q.end(), ctx.q, ctx.q + static_cast<size_t>(ctx.num_q) * row);
    const size_t keep = static_cast<size_t>(kKvpopCalibrationQueries) * row;
    if (st->cal_q.size() > keep) {
      const size_t drop = st->cal_q.size() - keep;
      st->cal_q.erase(st->cal_q.begin(), st->cal_q.begin() + static_cast<std::ptrdiff_t>(drop));
      st->cal_pos0 += static_cast<int64_t>(drop / row);
    }
  }
  if (params_.scorer != 2) return Status::Ok();
  for (int32_t i = 0; i < ctx.num_q; ++i) {
    CountQueries(st, ctx.kv, ctx.params, ctx.sink, ctx.window, ctx.q_pos0 + i, ctx.q + i * row);
  }
  return Status::Ok();
}

int KvpopChooseDecay(const float* r, const float* mass, int64_t lo, int64_t hi, int64_t k,
                     const std::vector<float>& grid) {
  const int64_t n = hi - lo;
  if (n <= k || k <= 0 || grid.size() <= 1) return 0;
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::vector<float> prio(static_cast<size_t>(n));
  int best = 0;
  double best_mass = -1.0;
  for (size_t gi = 0; gi < grid.size(); ++gi) {
    for (int64_t i = 0; i < n; ++i) {
      idx[static_cast<size_t>(i)] = i;
      prio[static_cast<size_t>(i)] = KvpopPriorityOf(r[i], lo + i, grid[gi]);
    }
    // The top k by priority, as the online admission keeps them (KvpopRanksAbove).
    std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), [&](int64_t a, int64_t b) {
      return KvpopRanksAbove(prio[static_cast<size_t>(a)], lo + a, prio[static_cast<size_t>(b)], lo + b);
    });
    double m = 0.0;
    for (int64_t i = 0; i < k; ++i) m += mass[idx[static_cast<size_t>(i)]];
    if (m > best_mass * (1.0 + 1e-6)) {
      best_mass = m;
      best = static_cast<int>(gi);
    }
  }
  return best;
}

float KvpopPolicy::CalibrateDecay(const SelectContext& ctx, HeadState* st, const std::vector<float>& r,
                                  int64_t lo, int64_t k, float own) const {
  const AttnParams& p = ctx.params;
  const size_t row = static_cast<size_t>(p.group) * p.head_dim;
  const int64_t rows = static_cast<int64_t>(st->cal_q.size() / row);
  // The set the first step keeps is chosen among the positions that left the window before the
  // calibration queries: their attention to those positions is the future the set must serve.
  const int64_t hi = std::min<int64_t>(lo + static_cast<int64_t>(r.size()), st->cal_pos0 - ctx.window);
  if (rows == 0 || hi - lo <= k || st->cal_pos0 + rows > ctx.n) return own;
  std::vector<float> mass(static_cast<size_t>(hi - lo), 0.0f), logits, w;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = st->cal_pos0 + i;  // the query of position t sees keys [0, t]
    logits.resize(static_cast<size_t>(t + 1) * p.group);
    cpu::ScorePaged(p, st->cal_q.data() + static_cast<size_t>(i) * row, ctx.kv, t + 1, logits.data());
    w.assign(static_cast<size_t>(t + 1), 0.0f);
    for (int g = 0; g < p.group; ++g) {
      cpu::SoftmaxAccumulate(logits.data() + static_cast<size_t>(g) * (t + 1), t + 1, 1.0f, w.data());
    }
    for (int64_t u = lo; u < hi; ++u) mass[static_cast<size_t>(u - lo)] += w[static_cast<size_t>(u)];
  }
  std::vector<float> grid{own};
  for (double g : kKvpopDecayGrid) grid.push_back(static_cast<float>(std::log(g)));
  return grid[static_cast<size_t>(KvpopChooseDecay(r.data(), mass.data(), lo, hi, k, grid))];
}

KvpopPolicy::KvpopPolicy(const KvpopParams& params,
                         std::shared_ptr<const KvpopScorerWeights> weights,
                         const RuntimeConfig& config)
    : params_(params), weights_(std::move(weights)) {
  use_mlp_ = weights_ != nullptr && (params_.scorer == 1 || params_.scorer == -1);
  if (params_.device < 0) params_.device = params_.scorer == 2 || params_.decay == 1 ? 0 : 1;
  states_.Init(config.capacity.max_sequences, config.model.num_layers, config.model.num_kv_heads);
}

Result<std::unique_ptr<KvpopPolicy>> KvpopPolicy::Create(
    const KvpopParams& params, std::shared_ptr<const KvpopScorerWeights> weights,
    const RuntimeConfig& config) {
  KVF_RETURN_IF_ERROR(CheckPolicyShape("kvpop", config));
  KVF_CHECK_ARG(params.scorer != 1 || weights != nullptr,
                "kvpop parameter 'scorer' = 1 needs trained weights (set policy.weights_path "
                "to a file written by scripts/kvpop_train.py)");
  KVF_RETURN_IF_ERROR(CheckKvpopCombination(params));
  // The weights' shape is checked at Select, not here: callers validate a configuration with a
  // placeholder model (kvferry-llama checks its policies on a one-layer model before loading).
  return std::unique_ptr<KvpopPolicy>(new KvpopPolicy(params, std::move(weights), config));
}

float KvpopPolicy::LogGamma(int layer, int kv_head) const {
  if (use_mlp_) {
    const KvpopScorerWeights& w = *weights_;
    return KvpopLogGamma(w.alpha[static_cast<size_t>(layer) * w.num_kv_heads + kv_head],
                         w.gamma_min, w.gamma_max);
  }
  if (params_.scorer == 2) return static_cast<float>(std::log(params_.gamma));
  return KvpopLogGamma(0.0f, static_cast<float>(params_.gamma_min),
                       static_cast<float>(params_.gamma_max));
}

int32_t KvpopPolicy::device_hidden() const { return use_mlp_ ? weights_->hidden : 0; }

Result<std::vector<float>> KvpopPolicy::device_select_table(const ModelShape& model) const {
  const KvpopScorerWeights* w = use_mlp_ ? weights_.get() : nullptr;
  if (w != nullptr) {
    KVF_CHECK_ARG(w->num_layers == model.num_layers && w->num_kv_heads == model.num_kv_heads &&
                      w->in_dim == 2 * model.head_dim,
                  "kvpop weights are for ", w->num_layers, " layers x ", w->num_kv_heads,
                  " KV heads x input ", w->in_dim, "; the model has ", model.num_layers,
                  " layers x ", model.num_kv_heads, " KV heads x input ", 2 * model.head_dim);
  }
  const int32_t hidden = w != nullptr ? w->hidden : 0;
  const int32_t in_dim = 2 * model.head_dim;
  const int64_t block = KvpopScorerFloats(hidden, in_dim);
  std::vector<float> table(static_cast<size_t>(block) * model.num_layers * model.num_kv_heads, 0.0f);
  for (int l = 0; l < model.num_layers; ++l) {
    for (int h = 0; h < model.num_kv_heads; ++h) {
      float* dst = table.data() + (static_cast<int64_t>(l) * model.num_kv_heads + h) * block;
      dst[0] = LogGamma(l, h);
      if (w == nullptr) continue;
      const size_t head = static_cast<size_t>(l) * w->num_kv_heads + h;
      const size_t hh = static_cast<size_t>(hidden);
      dst[1] = w->b2[head];
      std::copy_n(w->w1.data() + head * hh * in_dim, hh * in_dim, dst + 2);
      std::copy_n(w->b1.data() + head * hh, hh, dst + 2 + hh * in_dim);
      std::copy_n(w->w2.data() + head * hh, hh, dst + 2 + hh * in_dim + hh);
    }
  }
  return table;
}

Status KvpopPolicy::Select(const SelectContext& ctx, std::vector<int32_t>& out) {
  KVF_CHECK_ARG(ctx.n >= 1 && ctx.params.group >= 1, "kvpop select needs n >= 1");
  const AttnParams& p = ctx.params;
  // The weights' shape first: before any state changes, and before LogGamma reads the (layer,
  // KV head) entry of alpha (a model of another shape read past it).
  const KvpopScorerWeights* w = use_mlp_ ? weights_.get() : nullptr;
  if (w != nullptr) {
    KVF_CHECK_ARG(ctx.layer < w->num_layers && ctx.kv_head < w->num_kv_heads &&
                      w->in_dim == 2 * p.head_dim,
                  "kvpop weights are for ", w->num_layers, " layers x ", w->num_kv_heads,
                  " KV heads x input ", w->in_dim, "; asked for layer ", ctx.layer, ", KV head ",
                  ctx.kv_head, " with input ", 2 * p.head_dim);
  }
  KVF_ASSIGN_OR_RETURN(HeadState * st, states_.Get("kvpop", ctx.slot, ctx.layer, ctx.kv_head, true));
  const OffloadSplit s = SplitPositions(ctx.n, ctx.sink, ctx.window, ctx.budget);
  if (ctx.n < st->next_u || ctx.n < st->mass_next) *st = HeadState{};  // a new sequence in this slot
  const bool mass = params_.scorer == 2;
  // Scorer 2: this step's query (a retried step's was counted already).
  if (mass && st->mass_next < ctx.n) {
    CountQueries(st, ctx.kv, p, ctx.sink, ctx.window, ctx.n - 1, ctx.q);
  }
  const int64_t k = std::max<int64_t>(s.k_off, 0);
  if (static_cast<int64_t>(st->slot_pos.size()) < k) {
    st->slot_pos.resize(static_cast<size_t>(k));
    st->slot_prio.resize(static_cast<size_t>(k));
  }
  // A smaller budget evicts the lowest priorities first.
  while (st->count > k) {
    const int64_t w = WorstSlot(st->slot_pos.data(), st->slot_prio.data(), st->count);
    st->evicted.push_back(st->slot_pos[w]);
    --st->count;
    st->slot_pos[w] = st->slot_pos[st->count];
    st->slot_prio[w] = st->slot_prio[st->count];
  }
  // Tokens that left the window since the last call, in order (the decode kernel does one a step):
  // their scores, then (decay 1, the first step) the head's decay, then their admission.
  float log_gamma = st->calibrated ? st->log_gamma : LogGamma(ctx.layer, ctx.kv_head);
  thread_local std::vector<float> x, rs;
  x.resize(static_cast<size_t>(2 * p.head_dim));
  const size_t head = static_cast<size_t>(ctx.layer) * (w ? w->num_kv_heads : 0) + ctx.kv_head;
  const int64_t u0 = std::max<int64_t>(st->next_u, s.sink);
  rs.clear();
  for (int64_t u = u0; u < s.off_hi; ++u) {
    float r = 0.0f;
    if (mass) {
      const int64_t i = u - st->score_base;
      r = i >= 0 && i < static_cast<int64_t>(st->scores.size()) ? st->scores[static_cast<size_t>(i)]
                                                                  : std::log(kKvpopMassEps);
    } else if (w != nullptr) {
      LoadRowF32(ctx.kv, p, u, false, x.data());
      LoadRowF32(ctx.kv, p, u, true, x.data() + p.head_dim);
      const size_t h = static_cast<size_t>(w->hidden);
      r = KvpopMlp(x.data(), w->in_dim, w->hidden, w->w1.data() + head * h * w->in_dim,
                   w->b1.data() + head * h, w->w2.data() + head * h, w->b2[head]);
    }
    rs.push_back(r);
  }
  if (params_.decay == 1 && !st->calibrated) {
    if (u0 == s.sink && !st->cal_q.empty()) log_gamma = CalibrateDecay(ctx, st, rs, u0, k, log_gamma);
    st->calibrated = true;
    st->log_gamma = log_gamma;
    st->cal_q = {};
  }
  for (int64_t u = u0; u < s.off_hi; ++u) {
    const int64_t ev = KvpopAdmit(st->slot_pos.data(), st->slot_prio.data(), &st->count, k,
                                  static_cast<int32_t>(u), KvpopPriorityOf(rs[static_cast<size_t>(u - u0)], u, log_gamma));
    if (ev >= 0) st->evicted.push_back(static_cast<int32_t>(ev));
  }
  st->next_u = std::max(st->next_u, s.off_hi);
  if (mass && !st->scores.empty()) {  // drop the admitted scores (the buffer keeps its capacity)
    const int64_t used = std::min<int64_t>(st->next_u - st->score_base, static_cast<int64_t>(st->scores.size()));
    if (used >= static_cast<int64_t>(st->scores.size())) {
      st->scores.clear();
    } else if (used > 0) {
      st->scores.erase(st->scores.begin(), st->scores.begin() + used);
      st->score_base += used;
    }
  }
  if (s.all && st->count == s.n_off()) {
    SelectAll(ctx.n, out);
    return Status::Ok();
  }
  thread_local std::vector<int32_t> chosen;
  chosen.assign(st->slot_pos.begin(), st->slot_pos.begin() + st->count);
  std::sort(chosen.begin(), chosen.end());
  FinishSelection(s, chosen.data(), static_cast<int64_t>(chosen.size()), out);
  return Status::Ok();
}

std::vector<int32_t> KvpopPolicy::Retained(int slot, int layer, int kv_head) const {
  const HeadState* st = states_.Peek(slot, layer, kv_head);
  if (st == nullptr) return {};
  std::vector<int32_t> r(st->slot_pos.begin(), st->slot_pos.begin() + st->count);
  std::sort(r.begin(), r.end());
  return r;
}

std::vector<int32_t> KvpopPolicy::Evicted(int slot, int layer, int kv_head) const {
  const HeadState* st = states_.Peek(slot, layer, kv_head);
  if (st == nullptr) return {};
  std::vector<int32_t> e = st->evicted;
  std::sort(e.begin(), e.end());
  return e;
}

Result<std::unique_ptr<Policy>> MakeKvpopPolicy(const RuntimeConfig& config) {
  KVF_ASSIGN_OR_RETURN(KvpopParams params, ParseKvpopParams(config.policy.params));
  std::shared_ptr<const KvpopScorerWeights> weights;
  const std::string& path = config.policy.weights_path;
  if (params.scorer != 0 && !path.empty()) {
    Result<KvpopScorerWeights> w = LoadKvpopWeights(path);
    KVF_CHECK_ARG(w.ok(), "policy.weights_path '", path, "' is not a kvpop weights file: ",
                  w.status().message());
    weights = std::make_shared<const KvpopScorerWeights>(std::move(w).value());
  }
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<KvpopPolicy> policy,
                       KvpopPolicy::Create(params, std::move(weights), config));
  return std::unique_ptr<Policy>(std::move(policy));
}

}  // namespace kvferry
