// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file config.h
/// \brief Everything a Runtime is created with. Plain values; validated by Runtime::Create.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvferry/tensor.h"

namespace kvferry {

/// \brief Attention shape of the model. head_dim must be 64, 128 or 256 (or 8..256, a multiple of
/// 8, on the host backend, for tiny test models); num_q_heads a multiple of num_kv_heads (GQA).
struct ModelShape {
  int num_layers = 32;
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
  DType kv_dtype = DType::kBF16;  ///< storage type of K and V (kBF16 or kF16)
  /// Softmax scale; 0 means 1/sqrt(head_dim).
  float softmax_scale = 0.0f;
  /// Attention type of each layer (Gemma 2/3, Mistral, GPT-OSS): 0 = global (the tiers, the host
  /// store, the policy's selection), w > 0 = sliding window of w tokens, the new one included (a
  /// decode attends positions [n - w, n), a prefill query at p attends [p - w + 1, p]; its rows
  /// live only in a ring of w rows on the device, never offloaded; docs/runtime.md, "Per-layer
  /// attention types"). Empty: every layer global; else num_layers entries, each in
  /// [0, max_tokens_per_sequence].
  std::vector<int> layer_window;
};

/// \brief How much the runtime may hold. Memory for the resident tier, token bank and plan
/// buffers is allocated at Create; host-store pages are allocated as sequences grow.
struct Capacity {
  int max_sequences = 8;
  int64_t max_tokens_per_sequence = 131072;
  int max_batch = 8;               ///< most sequences in one Decode call
  int64_t max_prefill_chunk = 8192;  ///< most tokens in one Prefill call
  /// Upper bound on host-store bytes (0 = unlimited); exceeding it is kResourceExhausted.
  int64_t max_host_bytes = 0;
  /// Host-store bytes allocated (and, on CUDA, pinned) at Create rather than as sequences grow
  /// (0 = none). Pinning costs about as much as the prefill of the tokens it holds, once; a
  /// serving engine that knows its working set pays it at start-up. At most max_host_bytes.
  int64_t host_bytes_at_create = 0;
  /// Cap on the device memory the runtime reserves at Create (0 = no cap): the resident tier, the
  /// token bank, policy metadata, staging and plan buffers, the host store's page table and the
  /// device's per-stream scratch (Runtime::device_memory lists them). A configuration that needs
  /// more is refused with kResourceExhausted, naming the cap, the total and each part; with
  /// Tiers::bank_slots = -1 the bank takes what the rest leaves. Bytes as requested from the
  /// allocator (cudaMalloc rounds each block up, large ones to 2 MiB); not counted: the CUDA
  /// context and what the engine allocates. On the host backend the same buffers live in host
  /// memory and are counted alike, so a configuration can be sized on a machine without a GPU.
  int64_t gpu_bytes = 0;
  /// CUDA: a second prefill staging, the size of the first (one layer's prompt of one sequence,
  /// max_tokens_per_sequence rows of every KV head), so that a prompt prefilled chunk-major (chunk
  /// c of every layer before chunk c + 1, as an engine runs a model) has each call's history
  /// copied to the GPU while the call before it computes. false saves its device memory; chunks
  /// then copy their history during their own attention. Layer-by-layer prefill never needs it.
  bool prefill_prefetch = true;
};

/// \brief GPU-resident tiers, per (sequence, layer, KV head).
struct Tiers {
  int sink_tokens = 4;        ///< first tokens, always attended, always resident
  int window_tokens = 256;    ///< ring of the most recent tokens, always resident
  /// Token-bank slots of offloaded rows per table (0 = no bank, at most 65534). -1 = the largest
  /// bank that fits Capacity::gpu_bytes (which must then be set), at most max_tokens_per_sequence
  /// slots; 0 when not even one slot fits. Runtime::config() reports the slots chosen.
  int bank_slots = 0;
  std::string bank_map = "vector";  ///< "vector" (position -> slot array) or "hash"
};

/// \brief The selection policy and its budget.
struct PolicyConfig {
  /// "dense", "streaming", "oracle" (and, when built, "lfps", "hip", "sparcas", "quest", "kvpop").
  std::string name = "streaming";
  /// Tokens attended per (sequence, KV head) per step, resident tokens included. 0 means use
  /// budget_fraction. Ignored by "dense".
  int64_t budget_tokens = 256;
  /// Fraction of the current context used when budget_tokens == 0 (e.g. 0.02).
  double budget_fraction = 0.0;
  /// Policy-specific parameters by name ("r" -> 0.95, "eps" -> 0.85, ...); unknown names are an
  /// error at Create.
  std::map<std::string, double> params;
  /// A file of trained weights for a policy that takes them ("kvpop": a safetensors file written
  /// by scripts/kvpop_train.py, read at Create; its parameter "scorer" 1 needs one). Empty: none.
  /// Any other policy refuses a path.
  std::string weights_path;
};

/// \brief Where offloaded (host-only) rows are attended.
enum class Route : uint8_t {
  kAuto = 0,  ///< the scheduler splits misses between the two routes by its cost model
  kGpu = 1,   ///< rows cross PCIe and are attended on the device
  kCpu = 2,   ///< rows are attended by the CPU cores; only q and (o, lse) cross PCIe
};

/// \brief Which Device implementation runs the plan.
enum class Backend : uint8_t {
  kAuto = 0,  ///< CUDA when built with it and a GPU is present, else host
  kCuda = 1,
  kHost = 2,  ///< host-emulated device: same plan, CPU reference kernels; no GPU needed
};

/// \brief Where a stage that has a device path and a host path runs (ReferencePaths).
enum class PathChoice : uint8_t {
  kAuto = 0,    ///< the backend's own: the device path on CUDA, the host loop on the host backend
  kHost = 1,    ///< the host loop (on CUDA: the reference the device path is compared with)
  kDevice = 2,  ///< the device path (on the host backend: its CPU reference, for machines without a GPU)
};

/// \brief The reference paths the fast ones are tested and measured against. The defaults take
/// the fast paths; a user never needs to change them (docs/runtime.md, "Reference paths").
struct ReferencePaths {
  /// LFPS-style priming after a prompt (a policy with Policy::prime_rows() > 0).
  PathChoice prime = PathChoice::kAuto;
  /// Prime after every prefill chunk instead of once, at the first Decode after the prompt (the
  /// same selections; Stats::ms_prime then counts inside ms_prefill).
  bool prime_eager = false;
  /// LFPS's candidate scan over its int8 shadow of K. kAuto on CUDA: on the device unless its
  /// buffers would take more than a quarter of an uncapped GPU; kDevice there takes them anyway.
  PathChoice shadow_scan = PathChoice::kAuto;
  /// CUDA prefill with the CUDA-core paged kernel (the reference) instead of the tensor cores.
  bool cuda_prefill_paged = false;
};

const char* RouteName(Route route);
const char* BackendName(Backend backend);

/// \brief The whole configuration of a Runtime.
struct RuntimeConfig {
  ModelShape model;
  Capacity capacity;
  Tiers tiers;
  PolicyConfig policy;
  Route route = Route::kAuto;
  Backend backend = Backend::kAuto;
  int device_id = 0;
  /// CPU worker threads for the CPU route (0 = the cores of the GPU's NUMA node, or all cores; above
  /// two cores one of them is left to the calling thread, which enqueues the GPU's work).
  int cpu_threads = 0;
  /// Measure the CPU-route and PCIe gather rates at Create for the auto route's split (a few ms on
  /// the host, ~0.1 s with CUDA); false keeps the defaults (52 and 20 GB/s).
  bool probe_at_start = true;
  /// The CPU part of a CPU-placed policy's planned step (its Select and its attention over the
  /// offloaded picks, on the pool) runs on the runtime's own thread: Decode returns once the
  /// device's work is enqueued, and the stream waits for the CPU's (o, lse) on the device, so the
  /// caller's thread goes on (to the engine's next launches) while the CPU works. -1: on with
  /// CUDA, off on the host backend (where the caller would only wait for it); 0: off; 1: on (on
  /// the host backend Decode then still returns when the part is done). With it, a failure in the
  /// CPU part of a call on CUDA is returned by the runtime's next call (the next layer's Decode,
  /// Synchronize, ...), which rolls that layer back as the failed Decode would have. Taken on
  /// CUDA only when q, k, v and out are in device memory (host tensors are read / written before
  /// Decode returns).
  /// The same thread runs the CPU share of route auto's split (a policy that selects on the
  /// device, without a token bank): 0 turns the split off, every miss read over PCIe.
  int async_cpu = -1;
  /// The scheduler's cross-layer prefetch (a policy wrapped by xl+, with the device token bank):
  /// while layer l runs, the rows layer l + 1 will miss in the bank (it takes l's list) are copied
  /// from pinned host memory into its staging beside the step, so that they travel over PCIe while
  /// the engine's own work between the two layers' Decode calls runs. -1 (auto): prefetch while
  /// the measured stream time between one layer's Decode and the next one's (the engine's GPU work
  /// there, and any idle time) averages at least xl_prefetch_gap_us, and before
  /// the first measurement; with nothing in between the prefetch only races the step for PCIe
  /// (docs/runtime.md, "Cross-layer prefetch"). 0: off; 1: always. Stats::xl_gap_us reports the
  /// measured time.
  int xl_prefetch = -1;
  /// The stream time between layers (microseconds, >= 0) from which xl_prefetch = -1 prefetches.
  double xl_prefetch_gap_us = 100.0;
  /// Route auto's split of a device selection's misses (async_cpu not 0): the CPU's share of each
  /// split step's misses. -1: the cost model's (from the measured CPU and PCIe rates, balanced by
  /// the steps on CUDA; no split where the share is worth less than split_min_us); a value in
  /// [0, 1]: that share on every such step, whatever the model says (to measure or pin the split).
  double split_share = -1.0;
  /// Least CPU work (estimated microseconds, >= 0) a split step gives the CPU: below it the step
  /// reads every miss over PCIe, as the hand-over (the pool's fork-join, the device's wait) costs
  /// about 20 us a layer. Used with split_share = -1.
  double split_min_us = 30.0;
  /// Microseconds (0 to 1000000) the CPU pool's workers keep spinning after a CPU step's work for
  /// the next layer's, so that they start at once rather than waking one after another. 0: they
  /// sleep at once. Spinning takes the cores from anything else (the engine's own threads, a
  /// longer item beside them); it pays where the next layer's CPU work comes within tens of
  /// microseconds and the cores are otherwise idle.
  int64_t cpu_spin_us = 0;
  /// The reference paths (tests and comparisons); the defaults are the fast paths.
  ReferencePaths paths;
};

}  // namespace kvferry
