// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file engine.h
/// \brief The forward pass of a Llama-family model. Matrix products run through oneDNN; every
/// attention call goes through an Attention object (kvferry's Runtime in the engine proper, an
/// exact f32 reference in tests).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "examples/llama/matmul.h"
#include "examples/llama/model.h"
#include "kvferry/config.h"
#include "kvferry/runtime.h"
#include "kvferry/status.h"

namespace kvferry::llama {

/// \brief Attention over one sequence's KV cache, layer by layer.
/// All buffers are f32 host memory: q, out [T, num_q_heads, head_dim]; k, v [T, num_kv_heads,
/// head_dim]; q and k already rotated (RoPE).
class Attention {
 public:
  virtual ~Attention() = default;
  /// This object's number, unique in the process (never reused, unlike its address): what the
  /// engine's CUDA graphs of a lane set are keyed by.
  [[nodiscard]] uint64_t instance_id() const { return instance_id_; }
  /// Appends T tokens at \p layer and writes causal attention of them over the cache.
  virtual Status Prefill(int layer, int64_t num_tokens, const float* q, const float* k,
                         const float* v, float* out) = 0;
  /// Appends one token at \p layer and writes its attention over the cache.
  virtual Status Decode(int layer, const float* q, const float* k, const float* v,
                        float* out) = 0;
  /// Appends T tokens' K and V at \p layer with no attention (ETF's frozen prompt rows).
  virtual Status Append(int layer, int64_t num_tokens, const float* k, const float* v) = 0;
  /// Whether Prefill's queries change this cache's state. Where false, Append leaves the state
  /// Prefill would, so a prefill whose output is not kept (every attention but the first of
  /// Engine::Prefill) appends instead and skips the attention.
  [[nodiscard]] virtual bool prefill_reads_queries() const { return true; }
  /// Forgets the sequence, ready for a new one.
  virtual Status Reset() = 0;

  /// Whether DecodeOnDevice works here (q, k, v and out in GPU memory).
  [[nodiscard]] virtual bool decodes_on_device() const { return false; }
  /// Whether DecodeOnDevice's work, once its step is planned, can be captured in a CUDA graph and
  /// replayed after the next PlanDecodeOnDevice (no host work inside the step).
  [[nodiscard]] virtual bool decode_capture_safe() const { return false; }
  /// Plans the decode token step whose DecodeOnDevice calls (one a layer) follow, ordered on the
  /// CUDA stream \p stream (a cudaStream_t).
  virtual Status PlanDecodeOnDevice(void* stream) {
    (void)stream;
    return Unimplemented("this attention does not decode on the device");
  }
  /// Decode with q [num_q_heads, head_dim], k and v [num_kv_heads, head_dim] and out f32 in GPU
  /// memory, ordered on \p stream: nothing is read back to the host.
  virtual Status DecodeOnDevice(int layer, const float* q, const float* k, const float* v, float* out,
                                void* stream) {
    (void)layer, (void)q, (void)k, (void)v, (void)out, (void)stream;
    return Unimplemented("this attention does not decode on the device");
  }

 private:
  static uint64_t NextInstanceId() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t instance_id_ = NextInstanceId();
};

/// Exact causal softmax attention in f32 (double accumulation for the softmax), over its own
/// cache, with the model's softmax scale and, on sliding-window layers (ModelConfig::layer_window),
/// only the last w positions. The independent reference that kvferry's results are compared with.
std::unique_ptr<Attention> MakeReferenceAttention(const ModelConfig& config);

/// \brief Attention through a kvferry Runtime that holds one sequence.
///
/// A model with sliding-window layers (Gemma 3) gets one Runtime whose per-layer attention types
/// (ModelShape::layer_window) are the model's: the global layers run the caller's configuration
/// (its policy, budget, tiers), each sliding layer attends exactly its last w tokens, kept in a
/// ring on the device (docs/runtime.md, "Per-layer attention types"). A window wider than
/// Capacity::max_tokens_per_sequence is the whole sequence and is clamped to it.
class RuntimeAttention final : public Attention {
 public:
  /// One Runtime of \p config (every layer global).
  static Result<std::unique_ptr<RuntimeAttention>> Create(const RuntimeConfig& config);
  /// The Runtime for \p model's layers: \p config (shaped by RuntimeConfigFor) with the model's
  /// sliding windows as its layer_window.
  static Result<std::unique_ptr<RuntimeAttention>> Create(const RuntimeConfig& config,
                                                          const ModelConfig& model);
  Status Prefill(int layer, int64_t num_tokens, const float* q, const float* k, const float* v,
                 float* out) override;
  Status Decode(int layer, const float* q, const float* k, const float* v, float* out) override;
  Status Append(int layer, int64_t num_tokens, const float* k, const float* v) override;
  [[nodiscard]] bool prefill_reads_queries() const override { return runtime_->prefill_reads_queries(); }
  Status Reset() override;
  /// On the CUDA backend: the Runtime's planned step (PlanDecode, then a Decode a layer with
  /// device tensors on the caller's stream).
  [[nodiscard]] bool decodes_on_device() const override;
  [[nodiscard]] bool decode_capture_safe() const override;
  Status PlanDecodeOnDevice(void* stream) override;
  Status DecodeOnDevice(int layer, const float* q, const float* k, const float* v, float* out,
                        void* stream) override;
  /// The Runtime (every layer, global and sliding-window).
  [[nodiscard]] Runtime& runtime() { return *runtime_; }

 private:
  RuntimeAttention() = default;
  TensorView View(const float* p, int64_t rows, int heads, MemoryKind where = MemoryKind::kHost) const;
  std::unique_ptr<Runtime> runtime_;
  SequenceId seq_ = 1;
  int q_heads_ = 0;
  int kv_heads_ = 0;
  int head_dim_ = 0;
};

/// The Runtime configuration for \p model: shape from the model, everything else from \p base.
RuntimeConfig RuntimeConfigFor(const ModelConfig& model, RuntimeConfig base);

/// \brief PrHS's early-token freezing at prefill (ETF, seed 000; notes/prhs.md, docs/prhs.md).
/// From layer start on, prompt positions [sink, E_l) are frozen at layer l, with
/// E_l = floor((1 - psi^(gamma (l - start) / (N - start))) T) and T the end of the prompt being
/// prefilled: a frozen row's hidden state passes layer l unchanged (its query, attention and MLP
/// skipped) and its K and V are stored with Attention::Append, no attention: by default projected
/// by layer l from that frozen hidden state (Sec. IV's "reuse previous-layer hidden states"), or
/// with copy_kv its K and V at layer l - 1 (App. D's k^l <- k^(l-1)). E grows with l, so a row
/// frozen at l stays frozen above. Decode is unchanged.
struct EtfOptions {
  bool on = false;
  bool copy_kv = false;
  double psi = 0.5;
  double gamma = 1.0;
  int start = -1;  ///< l_s; -1: floor(3 N / 4)
  int sink = 4;    ///< the first positions never frozen (the runtime's sink tokens)
};

/// l_s: EtfOptions::start, or floor(3 N / 4) when it is -1.
int EtfStartLayer(const EtfOptions& etf, int num_layers);
/// E_l for a prompt ending at \p prompt_end (0 below the start layer or with ETF off).
int64_t EtfFrozenEnd(const EtfOptions& etf, int num_layers, int layer, int64_t prompt_end);

/// Called after RoPE with the layer's q [T, Hq, D], k and v [T, Hkv, D] of positions
/// [pos, pos + T).
using QkvObserver = std::function<void(int layer, int64_t pos, int64_t num_tokens, const float* q,
                                       const float* k, const float* v)>;

/// \brief Runs the model. Holds scratch buffers and the oneDNN primitives; not thread-safe.
/// The model must outlive the engine.
class Engine {
 public:
  explicit Engine(const Model& model);

  /// Runs tokens at positions [pos, pos + n) as a prefill through every Attention of \p attns
  /// (they all receive the same q/k/v; the output of the first is used, so several caches can be
  /// filled by one pass; those after the first whose state takes no queries are given Append,
  /// which skips their attention). Processes at most \p chunk tokens per call to the attention.
  /// \p logits: if non-null, receives [n, vocab] (all_logits) or [vocab] (last position only).
  Status Prefill(std::span<const int32_t> tokens, int64_t pos, std::span<Attention* const> attns,
                 std::vector<float>* logits, bool all_logits = false, int64_t chunk = 512);
  /// Runs one token at position \p pos through \p attn's decode path; \p logits receives [vocab].
  Status Decode(int32_t token, int64_t pos, Attention& attn, std::vector<float>* logits);
  /// One decode step of several lanes at the same position \p pos: lane i feeds tokens[i] through
  /// its own attention lanes[i]. The matrix products take the lanes as the rows of one product, so
  /// the weights are read once per step instead of once per lane; each lane's result equals its
  /// Decode up to the products' summation order. \p logits receives [lanes, vocab]. Not with an
  /// observer set (it sees rows as consecutive positions).
  Status DecodeLanes(std::span<const int32_t> tokens, int64_t pos, std::span<Attention* const> lanes,
                     std::vector<float>* logits);

  void set_observer(QkvObserver observer) { observer_ = std::move(observer); }
  /// ETF for the prefills from now on (off by default). Invalid options are kInvalidArgument.
  Status set_etf(const EtfOptions& etf);
  [[nodiscard]] const EtfOptions& etf() const { return etf_; }
  /// Rows of the prefills so far that ETF froze, summed over layers (their attention and MLP
  /// skipped), and all rows summed over layers.
  [[nodiscard]] int64_t etf_frozen_rows() const { return etf_frozen_rows_; }
  [[nodiscard]] int64_t prefill_rows() const { return prefill_rows_; }
  /// Runs the matrix products on the GPU (cuBLAS) from now on; kUnimplemented without CUDA.
  Status UseGpuMatmul(int device_id = 0) { return matmul_.EnableCuda(device_id); }
  [[nodiscard]] bool gpu_matmul() const { return matmul_.on_gpu(); }
  /// Decode steps with every activation in GPU memory from now on (after UseGpuMatmul): the
  /// matrix products over the uploaded weights, the norms, RoPE, the activation and the residual
  /// adds as kernels, each lane's attention through Attention::DecodeOnDevice on the same stream
  /// (its step planned once a token), one copy of the logits back a step (examples/llama/
  /// engine_gpu.cu). A step whose lanes do not all decode on the device, or with an observer set,
  /// takes the host path. kUnimplemented without CUDA.
  /// Where every lane's attention is capture-safe (Attention::decode_capture_safe), the second
  /// step of a lane set is captured in a CUDA graph and later steps replay it: one launch a step
  /// instead of about 20 a layer.
  Status UseGpuDecode();
  [[nodiscard]] bool gpu_decode() const { return gpu_ != nullptr; }
  /// CUDA graphs for the decode steps (on by default with UseGpuDecode; off: every step launched
  /// kernel by kernel).
  void SetDecodeGraphs(bool on);
  /// Decode steps replayed from a CUDA graph, and graphs captured, so far.
  [[nodiscard]] int64_t decode_graph_steps() const;
  [[nodiscard]] int64_t decode_graph_captures() const;
  [[nodiscard]] const Model& model() const { return model_; }

 private:
  // decode: row t is the token of lane attns[t], every row at position pos (Decode, DecodeLanes);
  // else the tokens are consecutive positions from pos, stored in every attention (Prefill).
  Status Forward(std::span<const int32_t> tokens, int64_t pos, std::span<Attention* const> attns,
                 bool decode, float* logits, bool all_logits, int64_t prompt_end = 0);
  // One layer's attention and MLP over rows [r0, r1) of the current pass (prefill or decode).
  Status LayerRows(int layer, int64_t r0, int64_t r1, int64_t pos, std::span<Attention* const> attns,
                   bool decode);
  // RoPE of layer \p layer's table (global or sliding-window) on x [num_tokens, num_heads, D].
  void ApplyRope(float* x, int64_t num_tokens, int num_heads, int64_t pos, int layer) const;
  // Gemma's QK-norm: RMSNorm of each head of x [num_tokens, num_heads, D] with w [D].
  void HeadNorm(float* x, int64_t num_tokens, int num_heads, const std::vector<float>& w) const;
  void GrowRope(int64_t positions);
  // The decode step on the device (UseGpuDecode); logits [lanes, vocab] in host memory or null.
  Status DecodeOnDevice(std::span<const int32_t> tokens, int64_t pos, std::span<Attention* const> lanes,
                        float* logits);
  [[nodiscard]] bool CanDecodeOnDevice(std::span<Attention* const> lanes) const;
  // At least one token, each in the vocabulary, at a position >= 0 (every forward pass's check).
  Status CheckTokens(std::span<const int32_t> tokens, int64_t pos) const;
  // Enqueues the step's kernels, products and attention calls on the decode stream (captured or not).
  Status EnqueueDecodeStep(int64_t n, std::span<Attention* const> lanes);

  struct RopeTable {
    double theta = 10000.0;
    double scale = 1.0;             ///< positions divided by it (linear scaling)
    std::vector<float> cos, sin;    ///< [positions, head_dim / 2]
  };
  const Model& model_;
  Matmul matmul_;
  RopeTable rope_[2];  ///< [0]: global layers; [1]: sliding-window layers (Gemma 3)
  QkvObserver observer_;
  EtfOptions etf_;
  int64_t etf_frozen_rows_ = 0, prefill_rows_ = 0;
  // Scratch, grown on demand.
  std::vector<float> x_, xb_, q_, k_, v_, att_, gate_, up_, hb_;
  std::vector<float> prev_k_, prev_v_;  // ETF: the layer below's K and V of the pass's rows
  struct GpuDecode;  // engine_gpu.cu: the decode step's device copies and buffers
  struct GpuDecodeDeleter {
    void operator()(GpuDecode* g) const;
  };
  std::unique_ptr<GpuDecode, GpuDecodeDeleter> gpu_;
};

/// Index of the largest value.
int32_t Argmax(std::span<const float> v);
/// log softmax(logits)[target].
double LogProb(std::span<const float> logits, int32_t target);

}  // namespace kvferry::llama
