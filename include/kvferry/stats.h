// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file stats.h
/// \brief Counters a Runtime keeps. All byte counts are what crosses (or on the host backend,
/// would cross) PCIe.

#include <cstdint>
#include <string>

namespace kvferry {

/// \brief Cumulative counters since Create (or the last ResetStats).
struct Stats {
  int64_t prefill_tokens = 0;    ///< tokens prefilled, summed over layers
  /// Prefill chunks (CUDA) whose history the call before them had copied to the GPU while it
  /// computed: chunk-major order, chunk c of every layer before chunk c + 1 (Runtime::Prefill).
  int64_t prefill_chunks_prefetched = 0;
  int64_t decode_steps = 0;      ///< Decode calls (one layer of a batch each)
  int64_t decode_tokens = 0;     ///< sequence-layer decodes (batch size summed)
  int64_t decode_planned = 0;    ///< Decode calls that ran a planned step (no host work but launches)
  /// Planned layer steps whose misses the scheduler split between PCIe and the CPU cores (route
  /// auto, a device selection without a token bank; their CPU share counts in rows_cpu)
  int64_t decode_split = 0;
  /// Planned layer steps of a cross-layer policy (xl+, the device token bank on) whose misses the
  /// previous layer's call had already copied into the step's staging while it ran (the
  /// scheduler's cross-layer prefetch, RuntimeConfig::xl_prefetch)
  int64_t decode_prefetched = 0;
  /// The stream time between a layer's Decode and the next layer's, in microseconds: the running
  /// average that RuntimeConfig::xl_prefetch = -1 decides by (measured on planned eager steps of
  /// layers that take the previous layer's list; -1 before the first measurement or when not
  /// measured). Not reset by ResetStats.
  double xl_gap_us = -1;
  int64_t decode_plans = 0;      ///< plans built: PlanDecode calls and Decode calls that planned themselves
  /// Times a Decode or PlanDecode call made the host wait for the device (stream or event
  /// synchronisation). Zero in a steady planned step of a device-selecting policy with device
  /// tensors. With the CPU part on the runtime's own thread (RuntimeConfig::async_cpu) its wait
  /// for q counts here too, though the caller's thread does not wait.
  int64_t host_syncs = 0;

  int64_t bytes_h2d = 0;         ///< host -> device: fetched KV rows, CPU results (o, lse)
  int64_t bytes_d2h = 0;         ///< device -> host: K/V write-through, q for the CPU route

  int64_t rows_resident = 0;     ///< (position, KV head) rows attended from sinks or window
  int64_t rows_bank_hit = 0;     ///< rows attended from the token bank
  int64_t rows_fetched = 0;      ///< host-only rows fetched to the GPU route
  int64_t rows_cpu = 0;          ///< host-only rows attended on the CPU route
  int64_t rows_selected = 0;     ///< sum of the above
  /// Rows attended by the decodes of sliding-window layers (ModelShape::layer_window), every row
  /// of each one's ring on the device: not selected, not in rows_selected, no PCIe bytes.
  int64_t rows_window = 0;
  int64_t bank_admitted = 0;
  int64_t bank_evicted = 0;
  /// Decode steps whose bank admission failed (a copy or event error): the step's output stands,
  /// the bank kept none of that step's rows and later steps fetch them from the host again.
  int64_t bank_admit_failures = 0;
  /// Selection wrappers (cis+, xl+): Select calls that ran the inner (base) selection and calls
  /// answered from a kept set; rho = select_calls / (select_calls + select_reused).
  int64_t select_calls = 0;
  int64_t select_reused = 0;
  /// LFPS's scan (policy param "scan"): scans answered from the ranking the device computed over
  /// its copy of the int8 shadow of K (CUDA; RuntimeConfig::paths.shadow_scan = kHost turns it off), and those
  /// where too few of its picks lay outside the tables' candidates, so the host scanned.
  int64_t scans_device = 0;
  int64_t scans_device_short = 0;
  /// Bytes a device selection (policies whose device_scoring is not kNone, in the planned step)
  /// read to rank positions, summed over KV heads and layers: the oracle's keys (every position's
  /// K row), Quest's page bounds (two rows a page of the offloaded range), SparCas's compact keys
  /// (d_b elements a position; every dimension at its first dense_layers layers). Computed from
  /// the lengths as the kernels read them; host selections count 0.
  int64_t select_key_bytes = 0;

  double ms_append = 0;          ///< time per stage, summed (wall clock on the host)
  double ms_select = 0;
  double ms_resolve = 0;
  double ms_attend_gpu = 0;
  double ms_attend_cpu = 0;
  double ms_merge = 0;
  double ms_admit = 0;           ///< planning token-bank admissions (copies run on a side stream)
  double ms_prefill = 0;
  /// A device selection's own time (Runtime::TimeDeviceSelect on): per planned Decode of a policy
  /// that selects on the device, from before its selection launches to after them on the stream
  /// (timing events: the device's clock on CUDA, the host's on the host backend, where the
  /// selection runs inside the call). Captured Decodes, and graph replays, are not timed.
  double ms_select_device = 0;
  /// The device step's own time over the selected rows, timed as ms_select_device (same switch):
  /// per planned Decode whose rows are all attended on the device (not a CPU-placed policy's
  /// step, not host lists), from before the step's launch to after it.
  double ms_attend_device = 0;
  /// The policy learning from the prompt (LFPS's tables), from the kept queries' upload (or the
  /// device's priming statistics) to the end of the policy's update; part of the first Decode
  /// after a prompt (part of ms_prefill with RuntimeConfig::paths.prime_eager), see Runtime::Prefill.
  double ms_prime = 0;

  double cost_pcie_gbps = 0;     ///< scheduler's GPU-route rate: zero-copy gather GB/s (probed on CUDA)
  /// The CPU's share of a split step's misses (route auto's split inside the planned step) the
  /// last split step used: the cost model's first, then moved by the steps on CUDA, a step down
  /// when the device's part had finished before the CPU's, up when not. 0 before any split.
  double split_share = 0;
  double cost_cpu_gbps = 0;      ///< scheduler's CPU-route rate: sparse attention GB/s (probed)
  /// Thread-milliseconds the CPU route's attention kernels took over the rows_cpu rows (summed
  /// over the pool's threads; each kernel call timed on its thread), in every decode path.
  double ms_cpu_attend_busy = 0;
  /// The CPU-route rate the steps measured, the check of cost_cpu_gbps: the K and V bytes of
  /// rows_cpu over ms_cpu_attend_busy, times the pool's threads (the rate the pool reaches with
  /// every thread attending as the steps' kernels did). 0 before any CPU attention.
  double cost_cpu_gbps_measured = 0;
  double cost_h2d_gbps = 0;  ///< contiguous pinned-host to device copies GB/s (probed on CUDA)
  /// Device-memory rate (a device-to-device copy, read plus write; probed on CUDA): the model's
  /// rate for a device selection's key reads and for attending resident and bank rows.
  double cost_hbm_gbps = 0;
  /// The checks of cost_hbm_gbps against the timed calls (Runtime::TimeDeviceSelect), 0 until
  /// something is timed: the key bytes the timed selections read (select_key_bytes' count) over
  /// ms_select_device, and the K and V bytes of the rows the timed steps attended over
  /// ms_attend_device (bank misses among them crossed PCIe, at cost_pcie_gbps in the model).
  double cost_select_gbps_measured = 0;
  double cost_attend_gbps_measured = 0;

  int64_t host_bytes_reserved = 0;  ///< host-store bytes held now
  /// Device bytes held now, by the device's own count: Runtime::device_memory's total from Create
  /// on, plus the workspace of each caller's stream the CUDA kernels ran on (32 MiB each).
  int64_t device_bytes_reserved = 0;

  /// Calls \p f(name, field) for every field above, in order: what ToJson and the Python
  /// binding's stats() write (tests/config_fields_test.cpp checks that it visits every field).
  template <class F>
  void ForEachField(F&& f) const { VisitFields(*this, f); }
  template <class F>
  void ForEachField(F&& f) { VisitFields(*this, f); }
  template <class S, class F>
  static void VisitFields(S& s, F& f) {
    f("prefill_tokens", s.prefill_tokens);
    f("prefill_chunks_prefetched", s.prefill_chunks_prefetched);
    f("decode_steps", s.decode_steps);
    f("decode_tokens", s.decode_tokens);
    f("decode_planned", s.decode_planned);
    f("decode_split", s.decode_split);
    f("decode_prefetched", s.decode_prefetched);
    f("xl_gap_us", s.xl_gap_us);
    f("decode_plans", s.decode_plans);
    f("host_syncs", s.host_syncs);
    f("bytes_h2d", s.bytes_h2d);
    f("bytes_d2h", s.bytes_d2h);
    f("rows_resident", s.rows_resident);
    f("rows_bank_hit", s.rows_bank_hit);
    f("rows_fetched", s.rows_fetched);
    f("rows_cpu", s.rows_cpu);
    f("rows_selected", s.rows_selected);
    f("rows_window", s.rows_window);
    f("bank_admitted", s.bank_admitted);
    f("bank_evicted", s.bank_evicted);
    f("bank_admit_failures", s.bank_admit_failures);
    f("select_calls", s.select_calls);
    f("select_reused", s.select_reused);
    f("scans_device", s.scans_device);
    f("scans_device_short", s.scans_device_short);
    f("select_key_bytes", s.select_key_bytes);
    f("ms_append", s.ms_append);
    f("ms_select", s.ms_select);
    f("ms_resolve", s.ms_resolve);
    f("ms_attend_gpu", s.ms_attend_gpu);
    f("ms_attend_cpu", s.ms_attend_cpu);
    f("ms_merge", s.ms_merge);
    f("ms_admit", s.ms_admit);
    f("ms_prefill", s.ms_prefill);
    f("ms_select_device", s.ms_select_device);
    f("ms_attend_device", s.ms_attend_device);
    f("ms_prime", s.ms_prime);
    f("cost_pcie_gbps", s.cost_pcie_gbps);
    f("split_share", s.split_share);
    f("cost_cpu_gbps", s.cost_cpu_gbps);
    f("ms_cpu_attend_busy", s.ms_cpu_attend_busy);
    f("cost_cpu_gbps_measured", s.cost_cpu_gbps_measured);
    f("cost_h2d_gbps", s.cost_h2d_gbps);
    f("cost_hbm_gbps", s.cost_hbm_gbps);
    f("cost_select_gbps_measured", s.cost_select_gbps_measured);
    f("cost_attend_gbps_measured", s.cost_attend_gbps_measured);
    f("host_bytes_reserved", s.host_bytes_reserved);
    f("device_bytes_reserved", s.device_bytes_reserved);
  }
  /// One JSON object with every field above (ForEachField).
  [[nodiscard]] std::string ToJson() const;
};

}  // namespace kvferry
