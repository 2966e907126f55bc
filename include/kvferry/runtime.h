// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file runtime.h
/// \brief The kvferry runtime: KV cache storage across GPU and host, sparse selection, and
/// attention for prefill and decode.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/stats.h"
#include "kvferry/status.h"
#include "kvferry/tensor.h"

namespace kvferry {

/// Identifies a sequence; chosen by the caller, unique among live sequences.
using SequenceId = uint64_t;

namespace detail {
class RuntimeImpl;
}

/// \brief The device memory a Runtime reserves at Create, part by part (Runtime::device_memory).
/// On the CUDA backend: its cudaMalloc blocks and the split-KV workspaces of the streams it
/// creates; on the host backend the same buffers, in host memory. Not included: the CUDA context,
/// the start-up bandwidth probe's buffers (freed before Create returns) and the workspace a
/// stream of the caller's gets on its first use (32 MiB on CUDA; Stats::device_bytes_reserved
/// counts it from then on). A plain value; the runtime's plan never changes after Create.
struct DeviceMemoryPlan {
  struct Part {
    std::string name;   ///< "resident tier", "bank rows", "quest page bounds", ...
    int64_t bytes = 0;
  };
  std::vector<Part> parts;   ///< the parts that hold memory, largest first
  int64_t total_bytes = 0;   ///< sum of the parts
  int64_t cap_bytes = 0;     ///< Capacity::gpu_bytes (0: no cap)
  int bank_slots = 0;        ///< token-bank slots it holds (Tiers::bank_slots, -1 resolved)
  /// Per layer, the device bytes of its K and V rows: its share of the resident tier and of the
  /// bank rows (both keep a layer's rows at every layer), and at a sliding-window layer
  /// (ModelShape::layer_window) its ring's rows beyond the tier's ("sliding-window rings": the
  /// ring takes the tier's rows first). Staging and plan buffers are not per layer.
  std::vector<int64_t> layer_bytes;
  /// "123456 bytes: resident tier 65536, bank rows 32768, ..."
  [[nodiscard]] std::string ToString() const;
};

/// \brief Owns the KV cache of up to Capacity::max_sequences sequences for all layers and computes
/// attention over it.
///
/// Calls for one layer of one sequence must come in order (prefill chunks, then decodes); layers
/// are independent. Work is ordered on the given stream (CUDA backend) or complete when the call
/// returns (host backend). With no stream given, the work runs on the runtime's own non-blocking
/// stream, which does not wait for the legacy default stream: device tensors must be complete
/// before the call (a cudaMemcpy from pageable memory returns before its DMA lands), or pass the
/// stream that produced them.
///
/// Threads: every call may come from any thread. The calls are serialised: each takes one mutex
/// of the runtime for its whole duration (uncontended, one lock and unlock per call), so calls
/// from different threads are ordered by who takes it first and never interleave. The intended
/// use is one engine thread issuing Prefill, Append, Decode, PlanDecode, LastSelection and
/// Synchronize, while other threads (a scheduler, a metrics exporter) call AddSequence,
/// RemoveSequence, SequenceLength, GetStats and ResetStats. A Decode sees the set of live
/// sequences as of its start; an AddSequence or RemoveSequence from another thread waits until a
/// running call returns, so a sequence is never removed under a running Decode (the Decode ran
/// with it, or ran after the removal and fails with kNotFound, changing nothing). A planned step
/// spans several calls (PlanDecode, then one Decode per layer): RemoveSequence of a sequence in
/// it fails with kFailedPrecondition after the step's first Decode and before its last (remove
/// it after the step; sequences outside the step can be removed at any time). The order of one
/// sequence's calls (prefill, then decodes, layer by layer) is still the caller's to keep;
/// device work is ordered on streams as above, and with the CUDA backend a thread that removes a
/// sequence waits for the work that reads it. config() and backend() never change. The
/// destructor must not run while any call is in progress or can still start.
///
/// Errors: on an error return every sequence's tokens and outputs are as before the call (a
/// failed Decode, Prefill or Append takes back what it appended and restores the GPU window of
/// the call's sequences from the host store), with these exceptions: a layer of a planned step
/// that already ran keeps its token (PlanDecode); selection policies that keep state between
/// steps may have advanced it in the rolled-back call (lfps' tables; sparcas' dimension-refresh
/// counter `u` and hip's mask-refresh counter `r_m`, on the host and device paths alike, so that a
/// later refresh comes one step early), which can change later selections (never a stored
/// token); the prhs wrappers' own state (cis+'s blocks and kept sets, xl+'s shared sets) is
/// restored; and if the device fails again while the
/// call is being rolled back, the message says so and the call's sequences are in an
/// unspecified state (remove them). A CUDA error that poisons the context (an illegal address)
/// fails every later call; the runtime must then be destroyed.
class Runtime {
 public:
  /// Validates \p config and allocates the resident tier, token bank and plan buffers.
  /// kResourceExhausted when they need more than Capacity::gpu_bytes (see device_memory).
  static Result<std::unique_ptr<Runtime>> Create(const RuntimeConfig& config);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// Registers a new, empty sequence. Fails if \p seq is live or max_sequences are live.
  Status AddSequence(SequenceId seq);
  /// Frees every tier's data of \p seq. kFailedPrecondition while \p seq is in a planned step
  /// that has run some but not all of its layers (see PlanDecode).
  Status RemoveSequence(SequenceId seq);
  /// Tokens stored for \p seq at \p layer.
  [[nodiscard]] Result<int64_t> SequenceLength(SequenceId seq, int layer) const;

  /// Appends a chunk of T prompt tokens of one sequence at \p layer and computes causal attention
  /// of the chunk over everything stored before it plus itself (dense); at a sliding-window layer
  /// (ModelShape::layer_window, w) each query at position p over positions [p - w + 1, p].
  /// q, out: [T, num_q_heads, head_dim]; k, v: [T, num_kv_heads, head_dim].
  /// q/k/v/out may be f32, bf16 or f16, on host or device memory (device only with CUDA).
  /// A policy that learns from the prompt's last queries (lfps) keeps the chunk's last rows of q
  /// (one asynchronous copy) and is primed by the first Decode of (seq, layer) after it, from
  /// the last chunk: once per prompt and layer, however many chunks (RuntimeConfig::paths.prime_eager primes
  /// after every chunk instead, with the same result). That first Decode waits for the device.
  /// CUDA, where the earlier positions are read from: a chunk continuing the call before it (same
  /// sequence and layer) finds them on the GPU; a prompt issued chunk-major (chunk c of every
  /// layer, then chunk c + 1) has each call's copied while the call before it computes
  /// (Capacity::prefill_prefetch, Stats::prefill_chunks_prefetched); any other order copies them
  /// during the chunk's own attention. Every order gives the same outputs.
  Status Prefill(SequenceId seq, int layer, const TensorView& q, const TensorView& k,
                 const TensorView& v, const TensorView& out, StreamHandle stream = nullptr);

  /// Stores a chunk of T tokens' K and V of one sequence at \p layer without computing attention:
  /// for engines that run prompt attention with their own kernel (or load a cache) and hand the
  /// KV to kvferry. k, v: [T, num_kv_heads, head_dim]. Policies that learn from the prompt's
  /// queries (lfps) get nothing from these tokens; a later Prefill chunk primes them.
  Status Append(SequenceId seq, int layer, const TensorView& k, const TensorView& v,
                StreamHandle stream = nullptr);
  /// Whether the policy learns from the prompt's queries (Prefill primes it from them; Append
  /// gives it nothing). Where false, Append leaves the same state as Prefill less its output: an
  /// engine that runs one prompt pass into several runtimes and keeps one output may Append into
  /// the others.
  [[nodiscard]] bool prefill_reads_queries() const;

  /// Appends one new token for each sequence of \p seqs at \p layer and computes attention of its
  /// query over the positions the policy selects, merging the resident, GPU and CPU parts exactly;
  /// at a sliding-window layer of w tokens, over its last w positions, dense (no policy).
  /// q, out: [B, num_q_heads, head_dim]; k, v: [B, num_kv_heads, head_dim]; B = seqs.size().
  Status Decode(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                const TensorView& k, const TensorView& v, const TensorView& out,
                StreamHandle stream = nullptr);

  /// Whether this runtime's decode step runs without the host (device-side selection: see
  /// PlanDecode), so that it can be captured in a CUDA graph. False for every policy that selects
  /// on the host, with or without a token bank: its step waits once per layer for q to reach the
  /// host (counted in Stats::host_syncs); false with sliding-window layers, whose decode the host
  /// describes at every step.
  [[nodiscard]] bool decode_is_capture_safe() const;

  /// Plans one decode token step of \p seqs (FlashInfer's plan/run split): checks the batch,
  /// reserves host-store pages for one more token at every layer, commits that token at every
  /// layer and copies the step's positions into device memory, ordered on \p stream. The
  /// Decode(seqs, layer, ...) calls of the step (one per layer, in any order) then only enqueue
  /// kernels: no host synchronisation, no allocation, nothing the host writes for the call.
  ///
  /// Optional for plain use: a Decode without a matching plan plans itself (its layer only).
  /// Required around CUDA graphs: capture PlanDecode's step outside the capture, capture the
  /// Decode calls of every layer, and before each replay call PlanDecode(seqs, stream) again; the
  /// replay then runs the planned step. Capture-safe policies (those whose selection runs on the
  /// device: "dense", "streaming" from the length, "oracle" by an exact top-k over the scores of
  /// every key, "quest" and "sparcas" from metadata in device memory) with route gpu or auto; with
  /// a token bank (bank_slots > 0) the device selecting policies keep it in device memory
  /// (cuda::DeviceBank: hits read from the bank, misses staged and admitted by a kernel after each
  /// layer's step), so the step stays capture-safe. The others need the host inside the step and
  /// return kFailedPrecondition while capturing: policies that select on the host ("hip",
  /// "kvpop", "lfps", the PrHS wrappers, and "streaming" with a bank). With a bank on route gpu
  /// they run this planned step too (the device bank, their lists from the host's Select, one
  /// host synchronisation per layer for q), so PlanDecode serves them as well; otherwise "lfps"
  /// on route cpu or auto runs the CPU-placed planned step and the rest plan inside each Decode.
  /// A layer of a planned
  /// step whose Decode fails, or that is not run before the next PlanDecode while other layers
  /// were, is rolled back (its token uncommitted). Synchronise before RemoveSequence after replays.
  Status PlanDecode(std::span<const SequenceId> seqs, StreamHandle stream = nullptr);

  /// Positions attended at the last Decode of (\p seq, \p layer, \p kv_head), ascending. For
  /// diagnostics and benchmarks; valid until the next Decode of that layer. Where the device
  /// selected them (see PlanDecode), waits for the last Decode and reads its list back; the last
  /// step of a replayed CUDA graph is not seen.
  [[nodiscard]] Result<std::vector<int32_t>> LastSelection(SequenceId seq, int layer,
                                                           int kv_head) const;

  /// Blocks until all work issued on the runtime's streams is complete.
  Status Synchronize();

  [[nodiscard]] Stats GetStats() const;
  /// Starts recording a timeline of the runtime's host-side work: every stage of each call on the
  /// caller's thread (append/plan, select, resolve, attend_gpu = the GPU work's enqueue and waits,
  /// attend_cpu, merge, admit, prefill) and every CPU task of the planned step ("cpu_item", one
  /// per sequence and KV head, on its pool thread), up to \p max_events spans (later ones are
  /// counted as dropped). Allocates here; recording then costs two clock reads a span.
  Status StartTrace(int64_t max_events = int64_t{1} << 20);
  /// Writes the spans recorded since StartTrace to \p path in the Chrome trace event format
  /// (chrome://tracing, ui.perfetto.dev) and stops recording; kFailedPrecondition when none runs.
  /// On CUDA the kernels run later on the stream: their time is not in this host timeline.
  Status WriteTrace(const std::string& path);
  void ResetStats();
  /// While on, every eager planned Decode of a policy that selects on the device times its
  /// selection into Stats::ms_select_device (CUDA: two timing events a layer on the stream, read
  /// back a few steps later, without a host wait on the step's path), and every planned Decode
  /// that attends all its rows on the device times that step into Stats::ms_attend_device. Stats
  /// then sets cost_select_gbps_measured and cost_attend_gbps_measured, the checks of the cost
  /// model's probed rates. For measuring; off at Create.
  Status TimeDeviceSelect(bool on);
  /// The configuration, as given to Create except Tiers::bank_slots = -1, replaced by the slots
  /// chosen.
  [[nodiscard]] const RuntimeConfig& config() const;
  /// The device memory reserved at Create, part by part (Capacity::gpu_bytes is checked against
  /// its total, before the allocations, and against the device's count after them).
  [[nodiscard]] const DeviceMemoryPlan& device_memory() const;
  /// The backend actually in use (kHost or kCuda).
  [[nodiscard]] Backend backend() const;

 private:
  explicit Runtime(std::unique_ptr<detail::RuntimeImpl> impl);
  std::unique_ptr<detail::RuntimeImpl> impl_;
};

/// Whether this build of kvferry has the CUDA backend and a usable GPU (what Backend::kAuto
/// resolves to kCuda on).
bool CudaAvailable();

/// Names of the selection policies Runtime::Create accepts in PolicyConfig::name.
std::vector<std::string> PolicyNames();

}  // namespace kvferry
