// Copyright kvferry authors. Apache-2.0.
// The planned decode step on CUDA: captured in a CUDA graph (a whole 4-layer step, device tensors)
// and replayed step after step with PlanDecode before each replay, it gives the outputs of the
// same steps run call by call, with no host synchronisation; device and host tensors give the
// same outputs. Skips without a GPU.

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "gpu/device.h"
#include "kvferry/kvferry.h"

namespace kvferry {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// "name:bank" is policy name with a device token bank of 128 slots per (sequence, layer, head).
// "name:long": capacity 8192 tokens, so that the selection's multi-CTA top-k is captured too.
// "...:lag1": HiP's paper cadence (drift 0: masks rebuilt every r_m steps, a due one built on the
// side stream and served from the next step) instead of its default (rebuilt in the step whose
// query turned).
RuntimeConfig GraphConfig(std::string policy, int window) {
  RuntimeConfig c;
  bool long_ctx = false;
  bool lag1 = false;
  if (const size_t at = policy.find(":lag1"); at != std::string::npos) {
    policy.resize(at);
    lag1 = true;
  }
  if (const size_t colon = policy.find(":bank"); colon != std::string::npos) {
    policy.resize(colon);
    c.tiers.bank_slots = 128;
  } else if (const size_t at = policy.find(":long"); at != std::string::npos) {
    policy.resize(at);
    long_ctx = true;
  }
  c.model = {.num_layers = 4, .num_q_heads = 8, .num_kv_heads = 2, .head_dim = 128,
             .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = 2;
  c.capacity.max_tokens_per_sequence = long_ctx ? 8192 : 2048;
  c.capacity.max_batch = 2;
  c.capacity.max_prefill_chunk = long_ctx ? 8192 : 1024;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = window;
  c.policy.name = policy;
  c.policy.budget_tokens = 200;
  if (lag1) c.policy.params = {{"lag", 1}, {"drift", 0}};
  // PrHS's depth window from layer 1 on (layers 2 and 3 hide [sink, f n)): filtered on the device.
  if (policy.rfind("psaw+", 0) == 0) c.policy.params["psaw.start"] = 0.25;
  c.route = Route::kGpu;
  c.backend = Backend::kCuda;
  c.cpu_threads = 1;
  c.probe_at_start = false;
  return c;
}

struct DeviceBuf {
  void* p = nullptr;
  explicit DeviceBuf(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuf() { cudaFree(p); }
};

class CudaGraph : public ::testing::TestWithParam<std::tuple<std::string, int, DType>> {};

TEST_P(CudaGraph, CapturedStepReplaysToTheSameOutputs) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  const auto [policy, window, in_dtype] = GetParam();
  const size_t in_elem = DTypeSize(in_dtype);
  const RuntimeConfig c = GraphConfig(policy, window);
  const ModelShape& m = c.model;
  std::unique_ptr<Runtime> rt[2];  // 0: graph, 1: call by call
  for (auto& r : rt) {
    auto made = Runtime::Create(c);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    r = std::move(made).value();
  }
  ASSERT_TRUE(rt[0]->decode_is_capture_safe());
  const std::vector<SequenceId> seqs = {3, 4};
  // Long: one sequence past the multi-CTA threshold (kSelectMctaMinKeys) for every policy, the
  // other below it for sparcas (its ranked range leaves out the sinks and the window).
  const bool long_ctx = c.capacity.max_tokens_per_sequence > 2048;
  const int64_t batch = 2, prompt[2] = {long_ctx ? 4300 : 700, long_ctx ? 4150 : 301};
  std::mt19937 rng(99);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto random = [&](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = nd(rng);
    return x;
  };
  auto host_view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, m.head_dim});
  };
  for (int i = 0; i < 2; ++i) {
    for (auto& r : rt) ASSERT_TRUE(r->AddSequence(seqs[i]).ok());
    for (int l = 0; l < m.num_layers; ++l) {
      const int64_t t = prompt[i];
      auto q = random(t * m.num_q_heads * m.head_dim), k = random(t * m.num_kv_heads * m.head_dim),
           v = random(t * m.num_kv_heads * m.head_dim);
      std::vector<float> out(q.size());
      for (auto& r : rt) {
        ASSERT_TRUE(r->Prefill(seqs[i], l, host_view(q, t, m.num_q_heads), host_view(k, t, m.num_kv_heads),
                               host_view(v, t, m.num_kv_heads), host_view(out, t, m.num_q_heads))
                        .ok());
      }
    }
  }
  // Static device inputs and outputs per layer, as an engine's graph would own them.
  const size_t nq = batch * m.num_q_heads * m.head_dim, nkv = batch * m.num_kv_heads * m.head_dim;
  std::vector<std::unique_ptr<DeviceBuf>> dq, dk, dv, dout[2];
  for (int l = 0; l < m.num_layers; ++l) {
    dq.emplace_back(new DeviceBuf(nq * in_elem));
    dk.emplace_back(new DeviceBuf(nkv * in_elem));
    dv.emplace_back(new DeviceBuf(nkv * in_elem));
    for (auto& o : dout) o.emplace_back(new DeviceBuf(nq * 4));
  }
  auto dev_view = [&](void* p, int heads, DType dt) {
    return TensorView::Contiguous(p, dt, MemoryKind::kDevice, {batch, heads, m.head_dim});
  };
  // Upload in the input dtype (k/v in the cache's dtype take the one-launch path).
  auto upload = [&](void* dst, const std::vector<float>& x) {
    if (in_dtype == DType::kF32) {
      ASSERT_EQ(cudaMemcpy(dst, x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      return;
    }
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = cpu::F32ToBf16(x[i]);
    ASSERT_EQ(cudaMemcpy(dst, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  };
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto new_inputs = [&] {
    for (int l = 0; l < m.num_layers; ++l) {
      auto q = random(static_cast<int64_t>(nq)), k = random(static_cast<int64_t>(nkv)),
           v = random(static_cast<int64_t>(nkv));
      upload(dq[l]->p, q);
      upload(dk[l]->p, k);
      upload(dv[l]->p, v);
    }
    // Pageable copies may return before their DMA lands; the decode stream is non-blocking.
    CUDA_OK(cudaDeviceSynchronize());
  };
  auto run_layers = [&](int which) {
    for (int l = 0; l < m.num_layers; ++l) {
      const Status st = rt[which]->Decode(seqs, l, dev_view(dq[l]->p, m.num_q_heads, in_dtype),
                                          dev_view(dk[l]->p, m.num_kv_heads, in_dtype),
                                          dev_view(dv[l]->p, m.num_kv_heads, in_dtype),
                                          dev_view(dout[which][l]->p, m.num_q_heads, DType::kF32), stream);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  };
  auto compare = [&](int step) {
    CUDA_OK(cudaStreamSynchronize(stream));
    for (int l = 0; l < m.num_layers; ++l) {
      std::vector<float> a(nq), b(nq);
      CUDA_OK(cudaMemcpy(a.data(), dout[0][l]->p, nq * 4, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(b.data(), dout[1][l]->p, nq * 4, cudaMemcpyDeviceToHost));
      double err = 0, norm = 0;
      for (size_t i = 0; i < nq; ++i) {
        ASSERT_TRUE(std::isfinite(a[i])) << "step " << step << " layer " << l << " i " << i;
        err = std::max(err, static_cast<double>(std::fabs(a[i] - b[i])));
        norm += static_cast<double>(b[i]) * b[i];
      }
      EXPECT_LT(err, 1e-4) << "step " << step << " layer " << l;
      EXPECT_GT(norm, 0.0);
    }
  };

  // Warm-up step, call by call on both (kernel set-up happens outside the capture).
  new_inputs();
  for (int which = 0; which < 2; ++which) {
    ASSERT_TRUE(rt[which]->PlanDecode(seqs, stream).ok());
    run_layers(which);
  }
  compare(-1);

  // Capture one step of runtime 0.
  new_inputs();
  ASSERT_TRUE(rt[0]->PlanDecode(seqs, stream).ok());
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  run_layers(0);
  // Outside a plan, a captured Decode is refused (it would need host work inside the graph).
  EXPECT_EQ(rt[0]->Decode(seqs, 0, dev_view(dq[0]->p, m.num_q_heads, in_dtype),
                          dev_view(dk[0]->p, m.num_kv_heads, in_dtype),
                          dev_view(dv[0]->p, m.num_kv_heads, in_dtype),
                          dev_view(dout[0][0]->p, m.num_q_heads, DType::kF32), stream)
                .code(),
            StatusCode::kFailedPrecondition);
  cudaGraph_t graph;
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  const Stats before = rt[0]->GetStats();
  CUDA_OK(cudaGraphLaunch(exec, stream));
  ASSERT_TRUE(rt[1]->PlanDecode(seqs, stream).ok());
  run_layers(1);
  compare(0);
  const int steps = 40;  // crosses the window ring and page boundaries
  for (int t = 1; t <= steps; ++t) {
    new_inputs();
    ASSERT_TRUE(rt[0]->PlanDecode(seqs, stream).ok());
    CUDA_OK(cudaGraphLaunch(exec, stream));
    run_layers(1);
    compare(t);
  }
  const Stats after = rt[0]->GetStats();
  EXPECT_EQ(after.host_syncs, before.host_syncs);
  for (int l = 0; l < m.num_layers; ++l) {
    EXPECT_EQ(*rt[0]->SequenceLength(3, l), prompt[0] + steps + 2);
    EXPECT_EQ(*rt[0]->SequenceLength(3, l), *rt[1]->SequenceLength(3, l));
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  ASSERT_TRUE(rt[0]->Synchronize().ok());
  CUDA_OK(cudaStreamDestroy(stream));
}

// streaming (rows beyond the window read zero-copy), dense over everything (rows from host memory
// past the window), dense with every row resident (the cp.async path) and the oracle (its
// top-k selected inside the captured step), quest (page bounds kept and scored on the device) and
// sparcas (compact keys kept, re-gathered and scored on the device), hip (its masks kept and
// rebuilt on the device inside the replays: when the query turns, and every 8 steps on the side
// stream).
// The device-selecting policies again with the device token bank: the step reads hits from the
// bank, stages misses and queues their admission inside the graph; and quest inside PrHS's depth
// window (psaw+), whose lists the device filters inside the graph, and with cross-layer sharing
// (xl+: layers 2 and 3 take layer 1's list, copied inside the graph, their misses prefetched beside
// layers 1 and 2 on the admissions' stream, inside the graph too).
INSTANTIATE_TEST_SUITE_P(
    Bank, CudaGraph,
    ::testing::Combine(::testing::Values(std::string("oracle:bank"), std::string("quest:bank"),
                                         std::string("sparcas:bank"), std::string("hip:bank"),
                                         std::string("hip:bank:lag1"), std::string("kvpop:bank"),
                                         std::string("psaw+quest:bank"), std::string("xl+quest:bank"),
                                         std::string("xl+sparcas:bank"), std::string("xl+kvpop:bank")),
                       ::testing::Values(64), ::testing::Values(DType::kBF16)),
    [](const auto& info) {
      std::string name = std::get<0>(info.param);
      std::replace(name.begin(), name.end(), ':', '_');
      std::replace(name.begin(), name.end(), '+', '_');
      return name;
    });

// The device-selecting policies past the multi-CTA top-k threshold: its launches are captured.
INSTANTIATE_TEST_SUITE_P(
    Long, CudaGraph,
    ::testing::Combine(::testing::Values(std::string("oracle:long"), std::string("sparcas:long"),
                                         std::string("hip:long"), std::string("hip:long:lag1"),
                                         std::string("kvpop:long")),
                       ::testing::Values(64), ::testing::Values(DType::kBF16)),
    [](const auto& info) {
      std::string name = std::get<0>(info.param);
      std::replace(name.begin(), name.end(), ':', '_');
      return name;
    });

INSTANTIATE_TEST_SUITE_P(
    Policies, CudaGraph,
    ::testing::Combine(::testing::Values(std::string("streaming"), std::string("dense"),
                                         std::string("oracle"), std::string("quest"),
                                         std::string("sparcas")),
                       ::testing::Values(64, 2048 - 4), ::testing::Values(DType::kF32, DType::kBF16)));

TEST(CudaPlannedStep, DeviceAndHostTensorsAgree) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  for (const char* policy : {"streaming", "dense"}) {
    const RuntimeConfig c = GraphConfig(policy, 64);
    const ModelShape& m = c.model;
    auto a = Runtime::Create(c), b = Runtime::Create(c);
    ASSERT_TRUE(a.ok() && b.ok());
    Runtime* rts[2] = {a->get(), b->get()};
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto random = [&](int64_t n) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& e : x) e = nd(rng);
      return x;
    };
    const int64_t t = 500;
    for (Runtime* r : rts) ASSERT_TRUE(r->AddSequence(1).ok());
    for (int l = 0; l < m.num_layers; ++l) {
      auto k = random(t * m.num_kv_heads * m.head_dim), v = random(t * m.num_kv_heads * m.head_dim);
      for (Runtime* r : rts) {
        ASSERT_TRUE(r->Append(1, l,
                              TensorView::Contiguous(k.data(), DType::kF32, MemoryKind::kHost, {t, m.num_kv_heads, m.head_dim}),
                              TensorView::Contiguous(v.data(), DType::kF32, MemoryKind::kHost, {t, m.num_kv_heads, m.head_dim}))
                        .ok());
      }
    }
    // The appends above took host tensors: a call may wait for the previous one's copies (how
    // often depends on how fast the GPU drains them; under compute-sanitizer it does). Only the
    // decode calls with device tensors below must never wait.
    for (Runtime* r : rts) ASSERT_TRUE(r->Synchronize().ok());
    const int64_t syncs_before = rts[1]->GetStats().host_syncs;
    const size_t nq = m.num_q_heads * m.head_dim, nkv = m.num_kv_heads * m.head_dim;
    DeviceBuf dq(nq * 2), dk(nkv * 2), dv(nkv * 2), dout(nq * 2);
    const std::vector<SequenceId> one = {1};
    for (int step = 0; step < 5; ++step) {
      for (int l = 0; l < m.num_layers; ++l) {
        std::vector<uint16_t> q(nq), k(nkv), v(nkv), out_host(nq), out_dev(nq, 0xffff);
        for (auto* x : {&q, &k, &v}) {
          for (auto& e : *x) e = static_cast<uint16_t>(0x3c00 + (rng() % 0x300) - 0x180);  // small positive bf16
        }
        auto hv = [&](std::vector<uint16_t>& x, int heads) {
          return TensorView::Contiguous(x.data(), DType::kBF16, MemoryKind::kHost, {1, heads, m.head_dim});
        };
        auto dvw = [&](DeviceBuf& x, int heads) {
          return TensorView::Contiguous(x.p, DType::kBF16, MemoryKind::kDevice, {1, heads, m.head_dim});
        };
        CUDA_OK(cudaMemcpy(dq.p, q.data(), nq * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dk.p, k.data(), nkv * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dv.p, v.data(), nkv * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaDeviceSynchronize());  // pageable copies may return before their DMA lands
        ASSERT_TRUE(rts[0]->Decode(one, l, hv(q, m.num_q_heads), hv(k, m.num_kv_heads), hv(v, m.num_kv_heads),
                                   hv(out_host, m.num_q_heads)).ok());
        ASSERT_TRUE(rts[1]->Decode(one, l, dvw(dq, m.num_q_heads), dvw(dk, m.num_kv_heads),
                                   dvw(dv, m.num_kv_heads), dvw(dout, m.num_q_heads)).ok());
        ASSERT_TRUE(rts[1]->Synchronize().ok());
        CUDA_OK(cudaMemcpy(out_dev.data(), dout.p, nq * 2, cudaMemcpyDeviceToHost));
        EXPECT_EQ(out_host, out_dev) << policy << " step " << step << " layer " << l;
      }
    }
    EXPECT_EQ(rts[1]->GetStats().host_syncs - syncs_before, 0) << policy;  // device tensors: no host wait
    EXPECT_GT(rts[0]->GetStats().host_syncs, 0) << policy;  // host output: waited for
  }
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// Chunked prefill on CUDA (tensor-core kernel, earlier chunks staged from the host store) equals
// the host backend, chunk by chunk and in the decode steps after it; for the policy that learns
// from the prompt's queries too (lfps).
class CudaPrefill : public ::testing::TestWithParam<std::tuple<std::string, DType>> {};

TEST_P(CudaPrefill, ChunkedEqualsHost) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  const auto [policy, in_dtype] = GetParam();
  std::unique_ptr<Runtime> rt[2];
  for (int b = 0; b < 2; ++b) {
    RuntimeConfig c = GraphConfig(policy, 64);
    c.backend = b == 0 ? Backend::kCuda : Backend::kHost;
    c.route = policy == "lfps" ? Route::kAuto : Route::kGpu;
    auto made = Runtime::Create(c);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    rt[b] = std::move(made).value();
  }
  const ModelShape& m = rt[0]->config().model;
  for (auto& r : rt) ASSERT_TRUE(r->AddSequence(8).ok());
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto tensor = [&](int64_t rows, int heads, std::vector<float>& f32, std::vector<uint16_t>& b16) {
    f32.resize(static_cast<size_t>(rows * heads * m.head_dim));
    for (float& e : f32) e = nd(rng);
    b16.resize(f32.size());
    for (size_t i = 0; i < f32.size(); ++i) {
      b16[i] = cpu::F32ToBf16(f32[i]);
      if (in_dtype == DType::kBF16) f32[i] = cpu::Bf16ToF32(b16[i]);
    }
    void* p = in_dtype == DType::kBF16 ? static_cast<void*>(b16.data()) : static_cast<void*>(f32.data());
    return TensorView::Contiguous(p, in_dtype, MemoryKind::kHost, {rows, heads, m.head_dim});
  };
  const int64_t chunks[] = {700, 301, 45};
  for (int64_t t : chunks) {
    for (int l = 0; l < m.num_layers; ++l) {
      std::vector<float> qf, kf, vf;
      std::vector<uint16_t> qb, kb, vb;
      const TensorView q = tensor(t, m.num_q_heads, qf, qb), k = tensor(t, m.num_kv_heads, kf, kb),
                       v = tensor(t, m.num_kv_heads, vf, vb);
      std::vector<float> out[2];
      for (int b = 0; b < 2; ++b) {
        out[b].assign(static_cast<size_t>(t * m.num_q_heads * m.head_dim), std::nanf(""));
        const Status st = rt[b]->Prefill(8, l, q, k, v,
                                         TensorView::Contiguous(out[b].data(), DType::kF32, MemoryKind::kHost,
                                                                {t, m.num_q_heads, m.head_dim}));
        ASSERT_TRUE(st.ok()) << st.ToString();
      }
      double err = 0, ref_max = 0;
      for (size_t i = 0; i < out[0].size(); ++i) {
        ASSERT_TRUE(std::isfinite(out[0][i])) << "chunk " << t << " layer " << l << " i " << i;
        err = std::max(err, static_cast<double>(std::fabs(out[0][i] - out[1][i])));
        ref_max = std::max(ref_max, static_cast<double>(std::fabs(out[1][i])));
      }
      // Tensor cores take q and P in bf16: errors of a few parts in a thousand of the outputs.
      EXPECT_GT(ref_max, 0.0);
      EXPECT_LT(err, 3e-2 * ref_max) << "chunk " << t << " layer " << l;
    }
  }
  const std::vector<SequenceId> one = {8};
  for (int step = 0; step < 6; ++step) {
    for (int l = 0; l < m.num_layers; ++l) {
      std::vector<float> qf, kf, vf;
      std::vector<uint16_t> qb, kb, vb;
      const TensorView q = tensor(1, m.num_q_heads, qf, qb), k = tensor(1, m.num_kv_heads, kf, kb),
                       v = tensor(1, m.num_kv_heads, vf, vb);
      std::vector<float> out[2];
      for (int b = 0; b < 2; ++b) {
        out[b].assign(static_cast<size_t>(m.num_q_heads * m.head_dim), std::nanf(""));
        ASSERT_TRUE(rt[b]->Decode(one, l, q, k, v,
                                  TensorView::Contiguous(out[b].data(), DType::kF32, MemoryKind::kHost,
                                                         {1, m.num_q_heads, m.head_dim}))
                        .ok());
      }
      double err = 0;
      for (size_t i = 0; i < out[0].size(); ++i) {
        err = std::max(err, static_cast<double>(std::fabs(out[0][i] - out[1][i])));
      }
      EXPECT_LT(err, 1e-3) << "decode step " << step << " layer " << l;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, CudaPrefill,
                         ::testing::Combine(::testing::Values(std::string("streaming"), std::string("dense"),
                                                              std::string("lfps")),
                                            ::testing::Values(DType::kF32, DType::kBF16)));


// A policy that selects on the host runs its planned step with the device bank (route gpu), but
// the step waits for q on the host: Decode refuses a capture with kFailedPrecondition before
// enqueuing anything, and the same step then runs outside the capture.
TEST(CudaGraphHostLists, HostSelectingPolicyWithBankRefusesCapture) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  for (const char* policy : {"hip:bank", "lfps:bank"}) {
    SCOPED_TRACE(policy);
    RuntimeConfig c = GraphConfig(policy, 64);
    if (c.policy.name == "hip") c.policy.params["bits"] = 16;  // the host selects (at 4 bits the device)
    const ModelShape& m = c.model;
    auto made = Runtime::Create(c);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    std::unique_ptr<Runtime> rt = std::move(made).value();
    EXPECT_FALSE(rt->decode_is_capture_safe());
    const std::vector<SequenceId> seqs = {3};
    const int64_t prompt = 500;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto random = [&](int64_t n) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& e : x) e = nd(rng);
      return x;
    };
    auto host_view = [&](std::vector<float>& x, int64_t rows, int heads) {
      return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, m.head_dim});
    };
    ASSERT_TRUE(rt->AddSequence(seqs[0]).ok());
    for (int l = 0; l < m.num_layers; ++l) {
      auto q = random(prompt * m.num_q_heads * m.head_dim), k = random(prompt * m.num_kv_heads * m.head_dim),
           v = random(prompt * m.num_kv_heads * m.head_dim);
      std::vector<float> out(q.size());
      ASSERT_TRUE(rt->Prefill(seqs[0], l, host_view(q, prompt, m.num_q_heads), host_view(k, prompt, m.num_kv_heads),
                              host_view(v, prompt, m.num_kv_heads), host_view(out, prompt, m.num_q_heads))
                      .ok());
    }
    const size_t nq = static_cast<size_t>(m.num_q_heads) * m.head_dim;
    const size_t nkv = static_cast<size_t>(m.num_kv_heads) * m.head_dim;
    DeviceBuf dq(nq * 4), dk(nkv * 4), dv(nkv * 4), dout(nq * 4);
    const std::vector<float> q = random(static_cast<int64_t>(nq)), k = random(static_cast<int64_t>(nkv)),
                             v = random(static_cast<int64_t>(nkv));
    CUDA_OK(cudaMemcpy(dq.p, q.data(), nq * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dk.p, k.data(), nkv * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dv.p, v.data(), nkv * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());  // pageable copies may return before their DMA lands
    auto dev_view = [&](void* p, int heads) {
      return TensorView::Contiguous(p, DType::kF32, MemoryKind::kDevice, {1, heads, m.head_dim});
    };
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ASSERT_TRUE(rt->PlanDecode(seqs, stream).ok());
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status st = rt->Decode(seqs, 0, dev_view(dq.p, m.num_q_heads), dev_view(dk.p, m.num_kv_heads),
                                 dev_view(dv.p, m.num_kv_heads), dev_view(dout.p, m.num_q_heads), stream);
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    if (graph != nullptr) CUDA_OK(cudaGraphDestroy(graph));
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("selects on the host"), std::string::npos) << st.ToString();
    // Outside the capture the planned step runs every layer.
    for (int l = 0; l < m.num_layers; ++l) {
      const Status run = rt->Decode(seqs, l, dev_view(dq.p, m.num_q_heads), dev_view(dk.p, m.num_kv_heads),
                                    dev_view(dv.p, m.num_kv_heads), dev_view(dout.p, m.num_q_heads), stream);
      ASSERT_TRUE(run.ok()) << run.ToString();
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    for (int l = 0; l < m.num_layers; ++l) EXPECT_EQ(*rt->SequenceLength(seqs[0], l), prompt + 1);
    const Stats s = rt->GetStats();
    EXPECT_EQ(s.decode_planned, m.num_layers);
    EXPECT_GT(s.rows_fetched + s.rows_bank_hit, 0);
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace kvferry
