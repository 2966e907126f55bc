// Copyright kvferry authors. Apache-2.0.
// The tiny llama2.c model (stories260K, 5 layers, 8/4 heads, head_dim 8) end to end through
// kvferry: greedy text, kvferry dense vs the f32 reference attention, sparse policies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "examples/llama/engine.h"
#include "examples/llama/eval.h"
#include "examples/llama/gguf.h"
#include "examples/llama/model.h"
#include "examples/llama/tokenizer.h"

namespace kvferry::llama {
namespace {

std::string Data(const std::string& name) { return std::string(KVFERRY_TEST_DATA_DIR) + "/" + name; }

class LlamaStories : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto model = LoadModel(Data("stories260K.bin"));
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = new Model(std::move(model.value()));
    auto tok = LoadLlama2cTokenizer(Data("tok512.bin"), model_->config.vocab_size);
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tok_ = tok.value().release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tok_;
  }
  static std::unique_ptr<RuntimeAttention> MakeRuntime(const std::string& policy, int64_t budget,
                                                       DType kv = DType::kF16) {
    RuntimeConfig rc;
    rc.backend = Backend::kHost;
    rc.policy.name = policy;
    rc.policy.budget_tokens = budget;
    rc.model.kv_dtype = kv;
    rc.capacity.max_sequences = 2;
    rc.capacity.max_batch = 1;
    rc.capacity.max_tokens_per_sequence = 512;
    rc.capacity.max_prefill_chunk = 64;
    rc.tiers.sink_tokens = 4;
    rc.tiers.window_tokens = 16;
    auto attn = RuntimeAttention::Create(RuntimeConfigFor(model_->config, rc));
    EXPECT_TRUE(attn.ok()) << attn.status().ToString();
    return attn.ok() ? std::move(attn.value()) : nullptr;
  }
  static Model* model_;
  static Tokenizer* tok_;
};
Model* LlamaStories::model_ = nullptr;
Tokenizer* LlamaStories::tok_ = nullptr;

TEST_F(LlamaStories, ShapeFromHeader) {
  const ModelConfig& c = model_->config;
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.num_layers, 5);
  EXPECT_EQ(c.num_q_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.rope_style, RopeStyle::kAdjacent);
}

TEST_F(LlamaStories, TokenizerRoundTrips) {
  const std::string text = "Once upon a time, there was a little girl named Lily.";
  const std::vector<int32_t> ids = tok_->Encode(text, false);
  ASSERT_FALSE(ids.empty());
  EXPECT_LT(ids.size(), text.size());  // merges happened
  std::string back = tok_->DecodeAll(ids);
  EXPECT_EQ(back, " " + text);  // SentencePiece's dummy prefix
}

TEST_F(LlamaStories, GreedyFromBosThroughKvferryTellsTheKnownStory) {
  auto attn = MakeRuntime("dense", 512);
  ASSERT_NE(attn, nullptr);
  Engine engine(*model_);
  std::vector<Attention*> lanes{attn.get()};
  // Prompt: BOS only; GenerateGreedy needs two tokens, so start from BOS and decode directly.
  // The runtime wants a prefill before the first decode: prefill BOS, then decode.
  std::vector<float> logits;
  std::vector<int32_t> out;
  const std::vector<int32_t> bos{tok_->bos_id()};
  ASSERT_TRUE(engine.Prefill(bos, 0, lanes, &logits).ok());
  int32_t token = Argmax(logits);
  out.push_back(token);
  for (int pos = 1; pos < 40; ++pos) {
    const Status st = engine.Decode(token, pos, *attn, &logits);
    ASSERT_TRUE(st.ok()) << st.ToString();
    token = Argmax(logits);
    out.push_back(token);
  }
  const std::string text = tok_->DecodeAll(out);
  EXPECT_EQ(text.rfind(" Once upon a time, there was a little girl named Lily. She loved to play "
                       "outside in the park.", 0), 0u)
      << text;
}

TEST_F(LlamaStories, KvferryDenseMatchesReferenceAttention) {
  std::vector<int32_t> tokens{tok_->bos_id()};
  for (int32_t id : tok_->Encode("One day, a little dog named Max went to the big park with "
                                 "his friend Sue. They played with a red ball all day long.",
                                 false)) {
    tokens.push_back(id);
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (DType kv : {DType::kF16, DType::kBF16}) {
    auto rt = MakeRuntime("dense", 512, kv);
    ASSERT_NE(rt, nullptr);
    auto ref = MakeReferenceAttention(model_->config);
    Engine engine(*model_);
    std::vector<float> want, got, step;
    std::vector<Attention*> ref_lane{ref.get()};
    std::vector<Attention*> rt_lane{rt.get()};
    ASSERT_TRUE(engine.Prefill(tokens, 0, ref_lane, &want, true).ok());
    // Runtime: prefill 5 tokens in chunks of 3, decode the rest.
    ASSERT_TRUE(engine.Prefill(std::span<const int32_t>(tokens.data(), 5), 0, rt_lane, &got, true, 3)
                    .ok());
    for (int64_t p = 5; p < n; ++p) {
      const Status st = engine.Decode(tokens[p], p, *rt, &step);
      ASSERT_TRUE(st.ok()) << st.ToString();
      got.insert(got.end(), step.begin(), step.end());
    }
    ASSERT_EQ(got.size(), want.size());
    const int vocab = model_->config.vocab_size;
    double max_err = 0, norm = 0;
    int agree = 0;
    for (int64_t p = 0; p < n; ++p) {
      std::span<const float> a(&want[p * vocab], vocab), b(&got[p * vocab], vocab);
      agree += Argmax(a) == Argmax(b) ? 1 : 0;
      for (int v = 0; v < vocab; ++v) {
        max_err = std::max(max_err, static_cast<double>(std::abs(a[v] - b[v])));
        norm += static_cast<double>(a[v]) * a[v];
      }
    }
    EXPECT_GT(norm, 1.0);
    EXPECT_EQ(agree, n) << DTypeName(kv);
    EXPECT_LT(max_err, kv == DType::kF16 ? 0.05 : 0.3) << DTypeName(kv);
  }
}

// PrHS's early-token freezing at prefill (EtfOptions): E_l's shape; a frozen row's K and V at
// layer l are its K and V at l - 1, its query is not computed, and neither are its later layers;
// psi = 1 freezes nothing and leaves every logit as ETF off does, bit for bit; chunked and whole
// prefills freeze the same rows (E depends on the prompt's end, not the chunk's); and through
// kvferry's Runtime the stored rows serve the decode steps next to the reference attention.
TEST(LlamaEtf, FrozenEndGrowsWithDepthFromTheStartLayer) {
  EtfOptions e;
  e.on = true;  // psi 0.5, gamma 1, start floor(3 N / 4)
  EXPECT_EQ(EtfFrozenEnd(e, 30, 21, 8000), 0);
  EXPECT_EQ(EtfFrozenEnd(e, 30, 22, 8000), 0);  // the start layer itself freezes nothing
  int64_t last = 0;
  for (int l = 23; l < 30; ++l) {
    const int64_t end = EtfFrozenEnd(e, 30, l, 8000);
    EXPECT_GT(end, last) << l;
    EXPECT_EQ(end, static_cast<int64_t>(std::floor((1.0 - std::pow(0.5, (l - 22) / 8.0)) * 8000)));
    last = end;
  }
  e.on = false;
  EXPECT_EQ(EtfFrozenEnd(e, 30, 29, 8000), 0);
  e.on = true;
  e.start = 1;
  e.psi = 0.25;
  e.gamma = 2;
  EXPECT_EQ(EtfFrozenEnd(e, 5, 3, 100), static_cast<int64_t>(std::floor((1.0 - std::pow(0.25, 2.0 * 2 / 4)) * 100)));
  Model empty;  // set_etf's checks need no weights
  Engine engine(empty);
  EtfOptions bad = e;
  bad.psi = 0;
  EXPECT_EQ(engine.set_etf(bad).code(), StatusCode::kInvalidArgument);
  bad = e;
  bad.gamma = -1;
  EXPECT_EQ(engine.set_etf(bad).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(engine.set_etf(e).ok());
}

TEST_F(LlamaStories, EtfFreezesEarlyRowsAtPrefill) {
  std::vector<int32_t> tokens{tok_->bos_id()};
  for (int32_t id : tok_->Encode("Once upon a time, there was a little girl named Lily. She loved to "
                                 "play outside in the sun with her big red ball and her dog.",
                                 false)) {
    tokens.push_back(id);
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  const ModelConfig& c = model_->config;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  const int64_t q_dim = static_cast<int64_t>(c.num_q_heads) * c.head_dim;
  EtfOptions etf;
  etf.on = true;
  etf.start = 1;  // 5 layers: layers 2, 3 and 4 freeze
  etf.psi = 0.3;
  etf.sink = 2;
  etf.copy_kv = true;  // App. D's semantics first: a frozen row's K is the layer below's
  // Runs a prefill, recording each layer's q and K.
  struct Seen {
    std::vector<std::vector<float>> q, k;
  };
  const auto run = [&](const EtfOptions& e, int64_t chunk, std::vector<float>* logits, Seen* seen) {
    auto ref = MakeReferenceAttention(c);
    Engine engine(*model_);
    EXPECT_TRUE(engine.set_etf(e).ok());
    if (seen != nullptr) {
      seen->q.assign(c.num_layers, {});
      seen->k.assign(c.num_layers, {});
      engine.set_observer([&](int l, int64_t, int64_t rows, const float* q, const float* k, const float*) {
        seen->q[l].insert(seen->q[l].end(), q, q + rows * q_dim);
        seen->k[l].insert(seen->k[l].end(), k, k + rows * kv_dim);
      });
    }
    std::vector<Attention*> lane{ref.get()};
    EXPECT_TRUE(engine.Prefill(tokens, 0, lane, logits, true, chunk).ok());
    return std::make_pair(engine.etf_frozen_rows(), engine.prefill_rows());
  };
  std::vector<float> off_logits, one_logits, a_logits, b_logits;
  EtfOptions off;
  run(off, 512, &off_logits, nullptr);
  EtfOptions psi1 = etf;
  psi1.psi = 1.0;
  const auto none = run(psi1, 512, &one_logits, nullptr);
  EXPECT_EQ(none.first, 0);
  EXPECT_EQ(one_logits, off_logits);  // nothing frozen: bit for bit
  Seen sa, sb;
  const auto fa = run(etf, 512, &a_logits, &sa);
  const auto fb = run(etf, 7, &b_logits, &sb);
  EXPECT_EQ(fa, fb);
  int64_t want_frozen = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    want_frozen += std::max<int64_t>(0, std::min(n, EtfFrozenEnd(etf, c.num_layers, l, n)) - etf.sink);
  }
  EXPECT_EQ(fa.first, want_frozen);
  EXPECT_GT(fa.first, 0);
  EXPECT_EQ(fa.second, n * c.num_layers);
  // The same rows frozen in chunks of 7 (the matrix products may round otherwise for other row
  // counts: the K rows agree to rounding).
  for (int l = 0; l < c.num_layers; ++l) {
    ASSERT_EQ(sa.k[l].size(), sb.k[l].size());
    for (size_t i = 0; i < sa.k[l].size(); ++i) ASSERT_NEAR(sa.k[l][i], sb.k[l][i], 1e-3) << l << " " << i;
  }
  for (int l = 1; l < c.num_layers; ++l) {
    const int64_t end = std::min(n, EtfFrozenEnd(etf, c.num_layers, l, n));
    for (int64_t t = 0; t < n; ++t) {
      const bool frozen = t >= etf.sink && t < end;
      const float* k = &sa.k[l][t * kv_dim];
      const float* k_below = &sa.k[l - 1][t * kv_dim];
      const bool same = std::equal(k, k + kv_dim, k_below);
      if (frozen) {
        EXPECT_TRUE(same) << "layer " << l << " row " << t;
        for (int64_t i = 0; i < q_dim; ++i) ASSERT_EQ(sa.q[l][t * q_dim + i], 0.0f);
      } else {
        EXPECT_FALSE(same) << "layer " << l << " row " << t;
      }
    }
  }
  // The default semantics: a frozen row's K and V are projected by each layer from its frozen
  // hidden state, so they are not the layer below's, and its query is still not computed.
  EtfOptions proj = etf;
  proj.copy_kv = false;
  Seen sp;
  std::vector<float> p_logits;
  EXPECT_EQ(run(proj, 512, &p_logits, &sp), fa);
  for (int l = 1; l < c.num_layers; ++l) {
    const int64_t end = std::min(n, EtfFrozenEnd(proj, c.num_layers, l, n));
    for (int64_t t = etf.sink; t < end; ++t) {
      const float* k = &sp.k[l][t * kv_dim];
      EXPECT_FALSE(std::equal(k, k + kv_dim, &sp.k[l - 1][t * kv_dim])) << "layer " << l << " row " << t;
      EXPECT_FALSE(std::equal(k, k + kv_dim, &sa.k[l][t * kv_dim])) << "layer " << l << " row " << t;
      for (int64_t i = 0; i < q_dim; ++i) ASSERT_EQ(sp.q[l][t * q_dim + i], 0.0f);
    }
  }
  // Frozen rows change the later rows' attention at the freezing layers: other logits.
  const int vocab = c.vocab_size;
  EXPECT_NE(std::vector<float>(a_logits.end() - vocab, a_logits.end()),
            std::vector<float>(off_logits.end() - vocab, off_logits.end()));
  // Through kvferry's Runtime (Append for the frozen rows): its decode steps follow the reference
  // attention that was filled the same way.
  auto rt = MakeRuntime("dense", 512);
  ASSERT_NE(rt, nullptr);
  auto ref = MakeReferenceAttention(c);
  Engine engine(*model_);
  ASSERT_TRUE(engine.set_etf(etf).ok());
  std::vector<Attention*> lanes{rt.get(), ref.get()};
  std::vector<float> logits;
  ASSERT_TRUE(engine.Prefill(tokens, 0, lanes, &logits, false, 16).ok());
  std::vector<float> x, y;
  int32_t next = Argmax(logits);
  for (int64_t p = n; p < n + 8; ++p) {
    ASSERT_TRUE(engine.Decode(next, p, *rt, &x).ok());
    ASSERT_TRUE(engine.Decode(next, p, *ref, &y).ok());
    double err = 0;
    for (int v = 0; v < vocab; ++v) err = std::max(err, static_cast<double>(std::abs(x[v] - y[v])));
    EXPECT_LT(err, 0.05) << "step " << p;
    next = Argmax(y);
  }
}

TEST_F(LlamaStories, SparsePoliciesEvaluateNextToDense) {
  // 300 tokens of generated story text, the last 100 scored; every lane shares one prefill.
  std::vector<int32_t> tokens{tok_->bos_id()};
  {
    auto dense = MakeRuntime("dense", 512);
    Engine engine(*model_);
    std::vector<float> logits;
    std::vector<Attention*> lane{dense.get()};
    ASSERT_TRUE(engine.Prefill(tokens, 0, lane, &logits).ok());
    std::mt19937_64 rng(7);
    for (int pos = 1; pos < 300; ++pos) {
      const int32_t token = SampleToken(logits, 1.0f, 0.95f, rng);
      tokens.push_back(token);
      if (pos + 1 < 300) ASSERT_TRUE(engine.Decode(token, pos, *dense, &logits).ok());
    }
  }
  auto dense = MakeRuntime("dense", 512);
  auto streaming = MakeRuntime("streaming", 32);
  auto oracle = MakeRuntime("oracle", 32);
  auto big = MakeRuntime("streaming", 400);
  std::vector<Attention*> lanes{dense.get(), streaming.get(), oracle.get(), big.get()};
  Engine engine(*model_);
  double prefill_s = 0;
  auto r = EvalPerplexity(engine, tokens, 100, lanes, 64, &prefill_s);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 4u);
  for (const auto& x : *r) {
    EXPECT_EQ(x.scored, 100);
    EXPECT_TRUE(std::isfinite(x.perplexity));
    EXPECT_GT(x.perplexity, 1.0);
  }
  std::printf("stories260K ppl: dense %.3f streaming@32 %.3f oracle@32 %.3f streaming@400 %.3f\n",
              (*r)[0].perplexity, (*r)[1].perplexity, (*r)[2].perplexity, (*r)[3].perplexity);
  // A budget above the context is dense.
  EXPECT_NEAR((*r)[3].perplexity, (*r)[0].perplexity, 1e-3 * (*r)[0].perplexity);
  EXPECT_EQ((*r)[3].argmax_agree, 100);
  // The oracle's top-k is at least as close to dense as a blind recent window, within noise.
  EXPECT_LE(std::abs((*r)[2].perplexity - (*r)[0].perplexity),
            std::abs((*r)[1].perplexity - (*r)[0].perplexity) + 0.05 * (*r)[0].perplexity);
}

TEST_F(LlamaStories, TruncatedCheckpointIsAnErrorNotACrash) {
  auto bytes = ReadFileBytes(Data("stories260K.bin"));
  ASSERT_TRUE(bytes.ok());
  std::mt19937_64 rng(3);
  for (int i = 0; i < 40; ++i) {
    const size_t len = i < 8 ? static_cast<size_t>(i * 4) : rng() % bytes->size();
    auto model = LoadLlama2cModelFromBytes(std::span<const uint8_t>(bytes->data(), len));
    EXPECT_FALSE(model.ok()) << "length " << len;
    if (!model.ok()) EXPECT_EQ(model.status().code(), StatusCode::kCorruptData);
  }
  // A corrupted header (negative layer count, huge dims) is rejected.
  std::vector<uint8_t> bad = *bytes;
  const int32_t huge = 1 << 30;
  std::memcpy(bad.data() + 8, &huge, 4);
  EXPECT_FALSE(LoadLlama2cModelFromBytes(bad).ok());
}

}  // namespace
}  // namespace kvferry::llama
