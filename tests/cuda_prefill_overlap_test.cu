// Copyright kvferry authors. Apache-2.0.
// Chunked prefill on CUDA with the history copied by the copy engines while the tensor-core kernel
// attends (PrefillChunkArgs::copy_stream): equals the host backend chunk by chunk, over histories
// of several segments, chunks that are no multiple of a page or of a segment, a chunk that starts
// mid-page, GQA 1/4/8, head_dim 64/128, bf16 and f16 KV; inputs and outputs alternate between host
// tensors (f32) and device tensors (the KV dtype) from chunk to chunk; two layers share the
// staging, chunk c of every layer before chunk c + 1 as an engine calls it. The decode steps after
// the prompt read the rows the prefill stored. Layer-by-layer chunks reuse the staged history.
// Skips without a GPU.

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/dtype.h"
#include "gpu/device.h"
#include "kvferry/kvferry.h"

namespace kvferry {
namespace {

RuntimeConfig OverlapConfig(int head_dim, int group, DType kv_dtype, Backend backend) {
  RuntimeConfig c;
  c.model = {.num_layers = 2,
             .num_q_heads = 2 * group,
             .num_kv_heads = 2,
             .head_dim = head_dim,
             .kv_dtype = kv_dtype};
  c.capacity.max_sequences = 1;
  c.capacity.max_tokens_per_sequence = 4608;
  c.capacity.max_batch = 1;
  c.capacity.max_prefill_chunk = 1024;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 64;
  c.policy.name = "dense";
  c.policy.budget_tokens = c.capacity.max_tokens_per_sequence;
  c.route = Route::kGpu;
  c.backend = backend;
  c.probe_at_start = false;
  return c;
}

// Creates a Runtime.
std::unique_ptr<Runtime> MakeRuntime(const RuntimeConfig& c) {
  auto made = Runtime::Create(c);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  return made.ok() ? std::move(made).value() : nullptr;
}

struct DeviceBuf {
  void* p = nullptr;
  explicit DeviceBuf(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuf() { cudaFree(p); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
};

uint16_t To16(float x, DType dtype) {
  return dtype == DType::kBF16 ? cpu::F32ToBf16(x) : cpu::F32ToF16(x);
}
float From16(uint16_t x, DType dtype) {
  return dtype == DType::kBF16 ? cpu::Bf16ToF32(x) : cpu::F16ToF32(x);
}

// One input tensor [rows, heads, head_dim]: random values rounded to the KV dtype, as f32 on the
// host and as 16-bit bits (copied to the device when a device tensor is asked for).
struct Input {
  std::vector<float> f32;
  std::vector<uint16_t> b16;
  std::unique_ptr<DeviceBuf> dev;
  int64_t rows = 0;
  int heads = 0;
  int head_dim = 0;

  Input(int64_t rows_, int heads_, int head_dim_, DType dtype, std::mt19937& rng)
      : rows(rows_), heads(heads_), head_dim(head_dim_) {
    std::normal_distribution<float> nd(0.f, 1.f);
    f32.resize(static_cast<size_t>(rows * heads * head_dim));
    b16.resize(f32.size());
    for (size_t i = 0; i < f32.size(); ++i) {
      b16[i] = To16(nd(rng), dtype);
      f32[i] = From16(b16[i], dtype);
    }
  }
  TensorView Host() {
    return TensorView::Contiguous(f32.data(), DType::kF32, MemoryKind::kHost,
                                  {rows, heads, head_dim});
  }
  TensorView Device(DType dtype) {
    dev = std::make_unique<DeviceBuf>(b16.size() * 2);
    EXPECT_EQ(cudaMemcpy(dev->p, b16.data(), b16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    // A copy from pageable memory returns once the bytes are in the driver's staging, before its
    // DMA lands, and the runtime's stream is non-blocking (it does not wait for the legacy
    // stream): without this wait a loaded GPU let the prefill read the previous contents of the
    // buffer (CudaPrefillStaged failed 1 in ~2,700 tests under two shards, difference 0.94).
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return TensorView::Contiguous(dev->p, dtype, MemoryKind::kDevice, {rows, heads, head_dim});
  }
};

// Runs one call on the CUDA runtime (host f32 tensors, or device tensors in the KV dtype when
// \p device) and returns its output as f32.
template <typename Call>
std::vector<float> RunCuda(Call call, Input& q, Input& k, Input& v, DType kv_dtype, bool device) {
  const size_t n = q.f32.size();
  std::vector<float> out(n, std::nanf(""));
  if (!device) {
    const TensorView o = TensorView::Contiguous(out.data(), DType::kF32, MemoryKind::kHost,
                                                {q.rows, q.heads, q.head_dim});
    const Status st = call(q.Host(), k.Host(), v.Host(), o);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return out;
  }
  DeviceBuf o_dev(n * 2);
  EXPECT_EQ(cudaMemset(o_dev.p, 0xff, n * 2), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the poison lands before the call's writes
  const TensorView o =
      TensorView::Contiguous(o_dev.p, kv_dtype, MemoryKind::kDevice, {q.rows, q.heads, q.head_dim});
  const Status st = call(q.Device(kv_dtype), k.Device(kv_dtype), v.Device(kv_dtype), o);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the runtime's stream is non-blocking
  std::vector<uint16_t> bits(n);
  EXPECT_EQ(cudaMemcpy(bits.data(), o_dev.p, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < n; ++i) out[i] = From16(bits[i], kv_dtype);
  return out;
}

// Max |got - want| over max |want|; the first non-finite output fails.
double RelErr(const std::vector<float>& got, const std::vector<float>& want,
              const std::string& what) {
  double err = 0, ref_max = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ADD_FAILURE() << what << ": output " << i << " is " << got[i];
      return 1e30;
    }
    err = std::max(err, static_cast<double>(std::fabs(got[i] - want[i])));
    ref_max = std::max(ref_max, static_cast<double>(std::fabs(want[i])));
  }
  EXPECT_GT(ref_max, 0.0) << what << ": all-zero reference";
  return ref_max > 0 ? err / ref_max : err;
}

// One prefill chunk of t fresh random tokens of (seq, layer) on both runtimes (device tensors on
// the CUDA one when \p device); the relative error of the CUDA output against the host backend's.
double PrefillBoth(Runtime* cuda_rt, Runtime* host_rt, SequenceId seq, int layer, int64_t t,
                   DType kv_dtype, bool device, std::mt19937& rng) {
  const ModelShape& m = cuda_rt->config().model;
  const int hd = m.head_dim;
  Input q(t, m.num_q_heads, hd, kv_dtype, rng), k(t, m.num_kv_heads, hd, kv_dtype, rng),
      v(t, m.num_kv_heads, hd, kv_dtype, rng);
  const std::vector<float> got =
      RunCuda([&](const TensorView& qv, const TensorView& kv, const TensorView& vv,
                  const TensorView& ov) { return cuda_rt->Prefill(seq, layer, qv, kv, vv, ov); },
              q, k, v, kv_dtype, device);
  std::vector<float> want(got.size(), std::nanf(""));
  const Status st = host_rt->Prefill(
      seq, layer, q.Host(), k.Host(), v.Host(),
      TensorView::Contiguous(want.data(), DType::kF32, MemoryKind::kHost, {t, m.num_q_heads, hd}));
  EXPECT_TRUE(st.ok()) << st.ToString();
  return RelErr(got, want, "sequence " + std::to_string(seq) + " layer " + std::to_string(layer));
}

// One decode step of sequence \p seq at \p layer on both runtimes (host tensors); the relative
// error of the CUDA output against the host backend's.
double DecodeBoth(Runtime* cuda_rt, Runtime* host_rt, SequenceId seq, int layer, DType kv_dtype,
                  std::mt19937& rng) {
  const ModelShape& m = cuda_rt->config().model;
  const int hd = m.head_dim;
  const std::vector<SequenceId> one = {seq};
  Input q(1, m.num_q_heads, hd, kv_dtype, rng), k(1, m.num_kv_heads, hd, kv_dtype, rng),
      v(1, m.num_kv_heads, hd, kv_dtype, rng);
  const std::vector<float> got =
      RunCuda([&](const TensorView& qv, const TensorView& kv, const TensorView& vv,
                  const TensorView& ov) { return cuda_rt->Decode(one, layer, qv, kv, vv, ov); },
              q, k, v, kv_dtype, false);
  std::vector<float> want(got.size(), std::nanf(""));
  const Status st = host_rt->Decode(
      one, layer, q.Host(), k.Host(), v.Host(),
      TensorView::Contiguous(want.data(), DType::kF32, MemoryKind::kHost, {1, m.num_q_heads, hd}));
  EXPECT_TRUE(st.ok()) << st.ToString();
  return RelErr(got, want, "decode of sequence " + std::to_string(seq));
}

// Chunk sizes of the prompt (4170 tokens, 16 whole pages before the last chunk): the second starts
// mid-page (1000), later ones are no multiple of a page; the last chunks' histories split into
// 3 to 4 segments.
constexpr int64_t kChunks[] = {1000, 256, 1024, 777, 513, 600};

// (head_dim, group, kv dtype)
class CudaPrefillOverlap : public ::testing::TestWithParam<std::tuple<int, int, DType>> {};

TEST_P(CudaPrefillOverlap, ChunkedEqualsHostThenDecodeReadsTheStoredRows) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  const auto [head_dim, group, kv_dtype] = GetParam();
  std::unique_ptr<Runtime> cuda_rt =
      MakeRuntime(OverlapConfig(head_dim, group, kv_dtype, Backend::kCuda));
  std::unique_ptr<Runtime> host_rt =
      MakeRuntime(OverlapConfig(head_dim, group, kv_dtype, Backend::kHost));
  ASSERT_TRUE(cuda_rt && host_rt);
  const ModelShape& m = cuda_rt->config().model;
  for (Runtime* r : {cuda_rt.get(), host_rt.get()}) ASSERT_TRUE(r->AddSequence(5).ok());
  std::mt19937 rng(static_cast<uint32_t>(head_dim * 31 + group * 7 + (kv_dtype == DType::kF16)));
  // 16-bit outputs and tensor cores (q and P in the KV dtype): a few parts in a thousand of the
  // outputs, f16 four times finer than bf16.
  const double tol = kv_dtype == DType::kBF16 ? 3e-2 : 1e-2;
  int64_t pos = 0;
  int call = 0;
  for (int64_t t : kChunks) {
    for (int l = 0; l < m.num_layers; ++l, ++call) {
      Input q(t, m.num_q_heads, head_dim, kv_dtype, rng),
          k(t, m.num_kv_heads, head_dim, kv_dtype, rng),
          v(t, m.num_kv_heads, head_dim, kv_dtype, rng);
      const bool device = call % 2 == 1;
      auto prefill = [&](Runtime* r) {
        return [&, r](const TensorView& qv, const TensorView& kv, const TensorView& vv,
                      const TensorView& ov) { return r->Prefill(5, l, qv, kv, vv, ov); };
      };
      const std::vector<float> got = RunCuda(prefill(cuda_rt.get()), q, k, v, kv_dtype, device);
      std::vector<float> want(got.size(), std::nanf(""));
      ASSERT_TRUE(host_rt
                      ->Prefill(5, l, q.Host(), k.Host(), v.Host(),
                                TensorView::Contiguous(want.data(), DType::kF32, MemoryKind::kHost,
                                                       {t, m.num_q_heads, head_dim}))
                      .ok());
      const std::string what = "chunk at " + std::to_string(pos) + " of " + std::to_string(t) +
                               " tokens, layer " + std::to_string(l) +
                               (device ? ", device" : ", host") + " tensors";
      EXPECT_LT(RelErr(got, want, what), tol) << what;
    }
    pos += t;
  }
  // Decode: every stored row (host store and resident tier) as the prefill wrote it.
  const std::vector<SequenceId> one = {5};
  for (int step = 0; step < 3; ++step) {
    for (int l = 0; l < m.num_layers; ++l, ++call) {
      Input q(1, m.num_q_heads, head_dim, kv_dtype, rng),
          k(1, m.num_kv_heads, head_dim, kv_dtype, rng),
          v(1, m.num_kv_heads, head_dim, kv_dtype, rng);
      auto decode = [&](const TensorView& qv, const TensorView& kv, const TensorView& vv,
                        const TensorView& ov) { return cuda_rt->Decode(one, l, qv, kv, vv, ov); };
      const std::vector<float> got = RunCuda(decode, q, k, v, kv_dtype, /*device=*/false);
      std::vector<float> want(got.size(), std::nanf(""));
      ASSERT_TRUE(host_rt
                      ->Decode(one, l, q.Host(), k.Host(), v.Host(),
                               TensorView::Contiguous(want.data(), DType::kF32, MemoryKind::kHost,
                                                      {1, m.num_q_heads, head_dim}))
                      .ok());
      const std::string what =
          "decode step " + std::to_string(step) + " layer " + std::to_string(l);
      EXPECT_LT(RelErr(got, want, what), 2e-3) << what;
    }
  }
}

std::string CaseName(const ::testing::TestParamInfo<std::tuple<int, int, DType>>& info) {
  const auto [head_dim, group, kv_dtype] = info.param;
  return "d" + std::to_string(head_dim) + "_g" + std::to_string(group) + "_" + DTypeName(kv_dtype);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaPrefillOverlap,
                         ::testing::Combine(::testing::Values(64, 128), ::testing::Values(1, 4, 8),
                                            ::testing::Values(DType::kBF16, DType::kF16)),
                         CaseName);

// A CUDA runtime and a host-backend one of the same configuration (two sequences, \p layers
// layers), each holding sequences 5 and 6.
struct RuntimePair {
  std::unique_ptr<Runtime> cuda, host;
};
RuntimePair MakeStagedPair(int head_dim, int group, DType kv_dtype, int layers) {
  RuntimeConfig c = OverlapConfig(head_dim, group, kv_dtype, Backend::kCuda);
  c.model.num_layers = layers;
  c.capacity.max_sequences = 2;
  c.capacity.max_batch = 2;
  RuntimePair p;
  p.cuda = MakeRuntime(c);
  c.backend = Backend::kHost;
  p.host = MakeRuntime(c);
  for (Runtime* r : {p.cuda.get(), p.host.get()}) {
    if (r == nullptr) continue;
    EXPECT_TRUE(r->AddSequence(5).ok());
    EXPECT_TRUE(r->AddSequence(6).ok());
  }
  return p;
}

// Layer by layer (every chunk of a layer before the next layer), a chunk finds its history in the
// staging the chunk before it left (no copy); any other call in between (another layer's chunk,
// another sequence's, a decode) makes the next chunk copy it again. Both equal the host backend,
// and so does the decode after. Two sequences: the first layer by layer, the second interleaved.
TEST(CudaPrefillStaged, LayerByLayerReusesTheStagedHistory) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  for (const auto& [head_dim, group, kv_dtype] :
       {std::tuple{128, 4, DType::kBF16}, std::tuple{64, 8, DType::kF16}}) {
    SCOPED_TRACE(std::to_string(head_dim) + " " + std::to_string(group));
    RuntimePair rp = MakeStagedPair(head_dim, group, kv_dtype, 2);
    ASSERT_TRUE(rp.cuda && rp.host);
    Runtime* cuda_rt = rp.cuda.get();
    Runtime* host_rt = rp.host.get();
    const ModelShape& m = cuda_rt->config().model;
    std::mt19937 rng(static_cast<uint32_t>(head_dim + group));
    const double tol = kv_dtype == DType::kBF16 ? 3e-2 : 1e-2;
    // (sequence, layer, chunk index into kChunks)
    std::vector<std::tuple<SequenceId, int, int>> order;
    for (int l = 0; l < m.num_layers; ++l) {
      for (int ci = 0; ci < 6; ++ci) order.emplace_back(5, l, ci);
    }
    for (const auto& [l, ci] : std::vector<std::pair<int, int>>{
             {0, 0}, {0, 1}, {1, 0}, {0, 2}, {0, 3}, {1, 1}, {1, 2}, {1, 3}, {0, 4}, {1, 4}}) {
      order.emplace_back(6, l, ci);
    }
    int call = 0;
    for (const auto& [seq, l, ci] : order) {
      EXPECT_LT(PrefillBoth(cuda_rt, host_rt, seq, l, kChunks[ci], kv_dtype,
                            call++ % 2 == 1, rng),
                tol)
          << "sequence " << seq << " layer " << l << " chunk " << ci;
    }
    // One decode step of sequence 5 (every layer), then sequence 6's last chunk of layer 0: its
    // staged history is stale (sequence 5 decoded in between).
    for (int l = 0; l < m.num_layers; ++l) {
      EXPECT_LT(DecodeBoth(cuda_rt, host_rt, 5, l, kv_dtype, rng), 2e-3)
          << "decode layer " << l;
    }
    for (int l = 0; l < m.num_layers; ++l) {
      EXPECT_LT(PrefillBoth(cuda_rt, host_rt, 6, l, kChunks[5], kv_dtype, true, rng), tol)
          << "sequence 6 last chunk, layer " << l;
    }
  }
}

// Chunk-major (chunk c of every layer, then chunk c + 1, as an engine runs a model over a prompt):
// each call copies the history of the call it predicts next into the second staging while it
// computes. Every chunk equals the host backend. Sequence 5: every chunk after the first finds its
// history prefetched (5 chunks x 3 layers). Sequence 6, 4 chunks: after (6, layer 0, chunk 2) a
// 100-token chunk of sequence 5 on every layer is not the call predicted (that prefetch is
// dropped; its own layer 2 is prefetched by its layer 1), so (6, 1, 2) and (6, 2, 2) copy their
// history themselves and the pattern restarts; a decode of sequence 5 after (6, 1, 3) leaves
// sequence 6's rows as they were, so (6, 2, 3) still takes its prefetch: 3 + 1 + 1 + 3 hits.
TEST(CudaPrefillStaged, ChunkMajorPrefetchesTheNextCallsHistory) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  for (const auto& [head_dim, group, kv_dtype] :
       {std::tuple{128, 4, DType::kBF16}, std::tuple{64, 8, DType::kF16}}) {
    SCOPED_TRACE(std::to_string(head_dim) + " " + std::to_string(group));
    RuntimePair rp = MakeStagedPair(head_dim, group, kv_dtype, 3);
    ASSERT_TRUE(rp.cuda && rp.host);
    Runtime* cuda_rt = rp.cuda.get();
    Runtime* host_rt = rp.host.get();
    const ModelShape& m = cuda_rt->config().model;
    std::mt19937 rng(static_cast<uint32_t>(7 * head_dim + group));
    const double tol = kv_dtype == DType::kBF16 ? 3e-2 : 1e-2;
    int call = 0;
    auto both = [&](SequenceId seq, int l, int64_t t) {
      EXPECT_LT(PrefillBoth(cuda_rt, host_rt, seq, l, t, kv_dtype, call++ % 2 == 1, rng),
                tol)
          << "sequence " << seq << " layer " << l << " tokens " << t;
    };
    for (int ci = 0; ci < 6; ++ci) {
      for (int l = 0; l < m.num_layers; ++l) both(5, l, kChunks[ci]);
    }
    EXPECT_EQ(cuda_rt->GetStats().prefill_chunks_prefetched, 5 * m.num_layers);
    for (int ci = 0; ci < 4; ++ci) {
      for (int l = 0; l < m.num_layers; ++l) {
        both(6, l, kChunks[ci]);
        if (ci == 2 && l == 0) {
          for (int l5 = 0; l5 < m.num_layers; ++l5) both(5, l5, 100);
        }
        if (ci == 3 && l == 1) {
          for (int dl = 0; dl < m.num_layers; ++dl) {
            EXPECT_LT(DecodeBoth(cuda_rt, host_rt, 5, dl, kv_dtype, rng), 2e-3)
                << "decode layer " << dl;
          }
        }
      }
    }
    EXPECT_EQ(cuda_rt->GetStats().prefill_chunks_prefetched, 5 * m.num_layers + 8);
  }
}

}  // namespace
}  // namespace kvferry
