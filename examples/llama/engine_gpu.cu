// Copyright kvferry authors. Apache-2.0.
// Engine decode steps with every activation in GPU memory (Engine::UseGpuDecode): the matrix
// products on cuBLAS over weights uploaded once (Matmul::RunOnDevice), the norms, RoPE, the
// activation and the residual adds as the small kernels below, attention through each lane's
// Attention::DecodeOnDevice, and one copy of the logits back per step. The host path
// (Engine::Forward) is the reference: the same operations in the same order, in f32.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "examples/llama/device_floats.h"
#include "examples/llama/engine.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {
namespace {

using detail::StrCat;

Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return DeviceError(StrCat("gpu decode: ", what, ": ", cudaGetErrorString(e)));
}

constexpr int kThreads = 256;

__device__ float BlockSum(float x, float* red) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += red[w];
  __syncthreads();
  return s;
}

// x [rows, dim] = table[tokens[row]] * scale.
__global__ void EmbedKernel(const int32_t* tokens, const float* table, int64_t dim, float scale, float* x) {
  const int64_t row = blockIdx.x;
  const float* e = table + static_cast<int64_t>(tokens[row]) * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) x[row * dim + i] = e[i] * scale;
}

// out[row] = x[row] / rms(x[row]) * w, a block a row of dim (the host's RmsNorm, whose sum of
// squares is in double: here f32 partial sums, a rounding apart). In place when out == x.
__global__ void RmsNormKernel(const float* x, const float* w, int64_t dim, float eps, float* out) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  ss = BlockSum(ss, red);
  const float inv = rsqrtf(ss / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) out[row * dim + i] = xr[i] * inv * w[i];
}

// RoPE on x [rows, heads, head_dim] at position *pos_dev: (cos, sin) [head_dim / 2] from the table of
// the layer's kind; pairs (i, i + half) when halves, else (2i, 2i + 1).
__global__ void RopeKernel(float* x, int heads, int head_dim, const float* cos, const float* sin,
                           const int64_t* pos_dev, bool halves) {
  const int half = head_dim / 2;
  const int64_t pos = *pos_dev;
  float* xh = x + static_cast<int64_t>(blockIdx.x) * heads * head_dim + static_cast<int64_t>(blockIdx.y) * head_dim;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float c = cos[pos * half + i], s = sin[pos * half + i];
    const int a = halves ? i : 2 * i, b = halves ? i + half : 2 * i + 1;
    const float x0 = xh[a], x1 = xh[b];
    xh[a] = x0 * c - x1 * s;
    xh[b] = x1 * c + x0 * s;
  }
}

// gate = act(gate) * up over n values: SiLU, or GELU with the tanh approximation (in double, as
// the host's).
__global__ void ActKernel(float* gate, const float* up, int64_t n, bool gelu) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    if (gelu) {
      const double d = g;
      gate[i] = static_cast<float>(0.5 * d * (1.0 + tanh(0.7978845608028654 * (d + 0.044715 * d * d * d)))) * up[i];
    } else {
      gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
  }
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] += y[i];
  }
}

int Blocks(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1024)); }

}  // namespace

// The device copies the decode step needs beside the Matmul's weights: the embedding table, every
// norm's weights, the RoPE tables (re-uploaded when the host's grow), the activations.
struct Engine::GpuDecode {
  cudaStream_t stream = nullptr;
  DeviceFloats embed, final_norm;
  std::vector<DeviceFloats> attn_norm, ffn_norm, q_norm, k_norm, post_attn_norm, post_ffn_norm;
  DeviceFloats rope_cos[2], rope_sin[2];
  size_t rope_have[2] = {0, 0};
  DeviceFloats x, xb, q, k, v, att, gate, up, logits;
  // The step's inputs, one copy a step: [position (int64, read by RopeKernel), tokens (int32)];
  // staged in `inputs_host`, grown with the lanes.
  int32_t* inputs = nullptr;
  int64_t tokens_cap = 0;
  std::vector<int32_t> inputs_host;
  int32_t* tokens() const { return inputs + 2; }
  const int64_t* pos() const { return reinterpret_cast<const int64_t*>(inputs); }
  std::vector<uint64_t> key;  // the step's lane set (instance ids), reused
  // CUDA graphs of the step, one per lane set (the lanes' order as called): captured at the second
  // step of a set whose lanes are all capture-safe, replayed after their PlanDecode. A graph holds
  // the buffers' and RoPE tables' addresses: any of them moving (generation) drops them all.
  bool graphs_on = true;
  int64_t generation = 0;
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    int64_t generation = -1;
    int64_t pos = 0;  // the step it was captured at: its launch shapes were sized for that length
  };
  // Keyed by the lanes' instance ids (an address may be reused by a later attention object).
  std::map<std::vector<uint64_t>, Graph> graphs;
  std::map<std::vector<uint64_t>, int> plain_steps;  // steps of a set decoded without a graph
  int64_t graph_steps = 0, graph_captures = 0;
  void DropGraphs() {
    for (auto& [lanes, gr] : graphs) {
      if (gr.exec != nullptr) cudaGraphExecDestroy(gr.exec);
    }
    graphs.clear();
  }
  ~GpuDecode() {
    DropGraphs();
    if (inputs != nullptr) cudaFree(inputs);
  }
};

void Engine::GpuDecodeDeleter::operator()(GpuDecode* g) const { delete g; }

Status Engine::UseGpuDecode() {
  KVF_CHECK_CODE(matmul_.on_gpu(), StatusCode::kFailedPrecondition,
                 "gpu decode: the matrix products are on the CPU (UseGpuMatmul first)");
  if (gpu_) return Status::Ok();
  auto g = std::unique_ptr<GpuDecode, GpuDecodeDeleter>(new GpuDecode);
  g->stream = static_cast<cudaStream_t>(matmul_.cuda_stream());
  const ModelConfig& c = model_.config;
  KVF_RETURN_IF_ERROR(g->embed.Upload(model_.token_embedding.data, g->stream));
  KVF_RETURN_IF_ERROR(g->final_norm.Upload(model_.final_norm, g->stream));
  const size_t layers = static_cast<size_t>(c.num_layers);
  for (auto* v : {&g->attn_norm, &g->ffn_norm, &g->q_norm, &g->k_norm, &g->post_attn_norm, &g->post_ffn_norm}) {
    v->resize(layers);
  }
  for (size_t l = 0; l < layers; ++l) {
    const LayerWeights& w = model_.layers[l];
    KVF_RETURN_IF_ERROR(g->attn_norm[l].Upload(w.attn_norm, g->stream));
    KVF_RETURN_IF_ERROR(g->ffn_norm[l].Upload(w.ffn_norm, g->stream));
    if (!w.q_norm.empty()) KVF_RETURN_IF_ERROR(g->q_norm[l].Upload(w.q_norm, g->stream));
    if (!w.k_norm.empty()) KVF_RETURN_IF_ERROR(g->k_norm[l].Upload(w.k_norm, g->stream));
    if (!w.post_attn_norm.empty()) KVF_RETURN_IF_ERROR(g->post_attn_norm[l].Upload(w.post_attn_norm, g->stream));
    if (!w.post_ffn_norm.empty()) KVF_RETURN_IF_ERROR(g->post_ffn_norm[l].Upload(w.post_ffn_norm, g->stream));
  }
  KVF_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(g->stream), "upload"));
  gpu_ = std::move(g);
  return Status::Ok();
}

void Engine::SetDecodeGraphs(bool on) {
  if (!gpu_) return;
  gpu_->graphs_on = on;
  if (!on) gpu_->DropGraphs();
}

int64_t Engine::decode_graph_steps() const { return gpu_ ? gpu_->graph_steps : 0; }
int64_t Engine::decode_graph_captures() const { return gpu_ ? gpu_->graph_captures : 0; }

Status Engine::DecodeOnDevice(std::span<const int32_t> tokens, int64_t pos, std::span<Attention* const> lanes,
                              float* logits) {
  GpuDecode& g = *gpu_;
  const ModelConfig& c = model_.config;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t dim = c.dim;
  const int64_t q_dim = static_cast<int64_t>(c.num_q_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  cudaStream_t s = g.stream;
  const bool capture_safe = g.graphs_on && std::all_of(lanes.begin(), lanes.end(), [](const Attention* a) {
    return a->decode_capture_safe();
  });
  // With graphs the tables cover the model's trained context at once, so that they rarely move.
  GrowRope(capture_safe ? std::max<int64_t>(pos + 1, c.max_context) : pos + 1);
  for (int r = 0; r < 2; ++r) {  // the host tables grew: upload them again
    if (rope_[r].cos.size() != g.rope_have[r]) {
      KVF_RETURN_IF_ERROR(g.rope_cos[r].Upload(rope_[r].cos, s));
      KVF_RETURN_IF_ERROR(g.rope_sin[r].Upload(rope_[r].sin, s));
      g.rope_have[r] = rope_[r].cos.size();
      ++g.generation;
    }
  }
  if (n > g.tokens_cap) {
    if (g.inputs != nullptr) cudaFree(g.inputs);
    g.inputs = nullptr;
    g.tokens_cap = 0;
    KVF_RETURN_IF_ERROR(Cuda(cudaMalloc(&g.inputs, (2 + n) * sizeof(int32_t)), "cudaMalloc step inputs"));
    g.tokens_cap = n;
    g.inputs_host.resize(static_cast<size_t>(2 + n));
    ++g.generation;
  }
  const void* before[] = {g.x.p, g.xb.p, g.q.p, g.att.p, g.k.p, g.v.p, g.gate.p, g.up.p, g.logits.p};
  for (DeviceFloats* b : {&g.x, &g.xb}) KVF_RETURN_IF_ERROR(b->Reserve(n * dim));
  for (DeviceFloats* b : {&g.q, &g.att}) KVF_RETURN_IF_ERROR(b->Reserve(n * q_dim));
  for (DeviceFloats* b : {&g.k, &g.v}) KVF_RETURN_IF_ERROR(b->Reserve(n * kv_dim));
  for (DeviceFloats* b : {&g.gate, &g.up}) KVF_RETURN_IF_ERROR(b->Reserve(n * c.hidden_dim));
  KVF_RETURN_IF_ERROR(g.logits.Reserve(n * static_cast<int64_t>(c.vocab_size)));
  const void* after[] = {g.x.p, g.xb.p, g.q.p, g.att.p, g.k.p, g.v.p, g.gate.p, g.up.p, g.logits.p};
  if (!std::equal(std::begin(before), std::end(before), std::begin(after))) ++g.generation;
  // The step's inputs, then each lane's plan, outside any graph (a replay reads them).
  std::memcpy(g.inputs_host.data(), &pos, sizeof(int64_t));
  std::copy(tokens.begin(), tokens.end(), g.inputs_host.begin() + 2);
  KVF_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(g.inputs, g.inputs_host.data(), (2 + n) * sizeof(int32_t),
                                           cudaMemcpyHostToDevice, s), "upload the step's inputs"));
  for (Attention* a : lanes) KVF_RETURN_IF_ERROR(a->PlanDecodeOnDevice(s));
  std::vector<uint64_t>& key = g.key;
  key.resize(lanes.size());
  for (size_t i = 0; i < lanes.size(); ++i) key[i] = lanes[i]->instance_id();
  GpuDecode::Graph* graph = nullptr;
  if (capture_safe) {
    auto it = g.graphs.find(key);
    // Dropped when its addresses moved, when the lanes started over (a new sequence), or when the
    // context has doubled since (its launch shapes follow the length it was captured at).
    if (it != g.graphs.end() && (it->second.generation != g.generation || pos < it->second.pos ||
                                 pos > 2 * it->second.pos + 64)) {
      cudaGraphExecDestroy(it->second.exec);
      g.graphs.erase(it);
      it = g.graphs.end();
    }
    if (it != g.graphs.end()) graph = &it->second;
  }
  if (graph == nullptr && capture_safe && g.plain_steps[key] >= 1) {
    // Capture the step (the first one of the set ran plainly: every weight uploaded, cuBLAS's
    // workspace made, each policy caught up with the prompt), then replay it below.
    KVF_RETURN_IF_ERROR(Cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture"));
    const Status st = EnqueueDecodeStep(n, lanes);
    cudaGraph_t captured = nullptr;
    const cudaError_t end = cudaStreamEndCapture(s, &captured);
    GpuDecode::Graph made;
    const cudaError_t inst =
        st.ok() && end == cudaSuccess ? cudaGraphInstantiate(&made.exec, captured, 0) : cudaSuccess;
    if (captured != nullptr) cudaGraphDestroy(captured);
    if (!st.ok() || end != cudaSuccess || inst != cudaSuccess) {
      (void)cudaGetLastError();
      if (!st.ok()) return st;
      return end != cudaSuccess ? Cuda(end, "end capture") : Cuda(inst, "instantiate graph");
    }
    made.generation = g.generation;
    made.pos = pos;
    graph = &(g.graphs[key] = made);
    ++g.graph_captures;
  }
  if (graph != nullptr) {
    KVF_RETURN_IF_ERROR(Cuda(cudaGraphLaunch(graph->exec, s), "graph launch"));
    ++g.graph_steps;
  } else {
    KVF_RETURN_IF_ERROR(EnqueueDecodeStep(n, lanes));
    ++g.plain_steps[key];
  }
  if (logits != nullptr) {
    KVF_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(logits, g.logits.p, n * c.vocab_size * sizeof(float),
                                             cudaMemcpyDeviceToHost, s), "copy logits"));
  }
  return Cuda(cudaStreamSynchronize(s), "synchronize");
}

Status Engine::EnqueueDecodeStep(int64_t n, std::span<Attention* const> lanes) {
  GpuDecode& g = *gpu_;
  const ModelConfig& c = model_.config;
  const int64_t dim = c.dim;
  const int64_t q_dim = static_cast<int64_t>(c.num_q_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  cudaStream_t s = g.stream;
  const int rows = static_cast<int>(n);
  EmbedKernel<<<rows, kThreads, 0, s>>>(g.tokens(), g.embed.p, dim, c.embed_scale, g.x.p);
  const bool halves = c.rope_style == RopeStyle::kHalves;
  const bool gelu = c.activation == Activation::kGeluTanh;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = model_.layers[l];
    const int table = c.window_of(l) > 0 ? 1 : 0;
    RmsNormKernel<<<rows, kThreads, 0, s>>>(g.x.p, g.attn_norm[l].p, dim, c.rms_eps, g.xb.p);
    KVF_RETURN_IF_ERROR(matmul_.RunOnDevice(g.xb.p, n, w.wq, g.q.p));
    KVF_RETURN_IF_ERROR(matmul_.RunOnDevice(g.xb.p, n, w.wk, g.k.p));
    KVF_RETURN_IF_ERROR(matmul_.RunOnDevice(g.xb.p, n, w.wv, g.v.p));
    if (!w.q_norm.empty()) {
      RmsNormKernel<<<rows * c.num_q_heads, kThreads, 0, s>>>(g.q.p, g.q_norm[l].p, c.head_dim, c.rms_eps, g.q.p);
    }
    if (!w.k_norm.empty()) {
      RmsNormKernel<<<rows * c.num_kv_heads, kThreads, 0, s>>>(g.k.p, g.k_norm[l].p, c.head_dim, c.rms_eps, g.k.p);
    }
    RopeKernel<<<dim3(rows, c.num_q_heads), 64, 0, s>>>(g.q.p, c.num_q_heads, c.head_dim, g.rope_cos[table].p,
                                                         g.rope_sin[table].p, g.pos(), halves);
    RopeKernel<<<dim3(rows, c.num_kv_heads), 64, 0, s>>>(g.k.p, c.num_kv_heads, c.head_dim, g.rope_cos[table].p,
                                                          g.rope_sin[table].p, g.pos(), halves);
    for (int64_t t = 0; t < n; ++t) {
      KVF_RETURN_IF_ERROR(lanes[static_cast<size_t>(t)]->DecodeOnDevice(
          l, g.q.p + t * q_dim, g.k.p + t * kv_dim, g.v.p + t * kv_dim, g.att.p + t * q_dim, s));
    }
    KVF_RETURN_IF_ERROR(matmul_.RunOnDevice(g.att.p, n, w.wo, g.xb.p));
    if (!w.post_attn_norm.empty()) {
      RmsNormKernel<<<rows, kThreads, 0, s>>>(g.xb.p, g.post_attn_norm[l].p, dim, c.rms_eps, g.xb.p);
    }
    AddKernel<<<Blocks(n * dim), kThreads, 0, s>>>(g.x.p, g.xb.p, n * dim);
    RmsNormKernel<<<rows, kThreads, 0, s>>>(g.x.p, g.ffn_norm[l].p, dim, c.rms_eps, g.xb.p);
    KVF_RETURN_IF_ERROR(matmul_.RunOnDevice(g.xb.p, n, w.w_gate, g.gate.p));
    KVF_RETURN_IF_ERROR(matmul_.RunOnDevice(g.xb.p, n, w.w_up, g.up.p));
    ActKernel<<<Blocks(n * c.hidden_dim), kThreads, 0, s>>>(g.gate.p, g.up.p, n * c.hidden_dim, gelu);
    KVF_RETURN_IF_ERROR(matmul_.RunOnDevice(g.gate.p, n, w.w_down, g.xb.p));
    if (!w.post_ffn_norm.empty()) {
      RmsNormKernel<<<rows, kThreads, 0, s>>>(g.xb.p, g.post_ffn_norm[l].p, dim, c.rms_eps, g.xb.p);
    }
    AddKernel<<<Blocks(n * dim), kThreads, 0, s>>>(g.x.p, g.xb.p, n * dim);
    KVF_RETURN_IF_ERROR(Cuda(cudaGetLastError(), "launch"));
  }
  RmsNormKernel<<<rows, kThreads, 0, s>>>(g.x.p, g.final_norm.p, dim, c.rms_eps, g.xb.p);
  KVF_RETURN_IF_ERROR(matmul_.RunOnDevice(g.xb.p, n, model_.classifier(), g.logits.p));
  return Cuda(cudaGetLastError(), "launch");
}

}  // namespace kvferry::llama
