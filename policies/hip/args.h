// Copyright kvferry authors. Apache-2.0.
#pragma once
// HiP's device state and the arguments its selection kernels take (DecodeStepArgs::selector):
// SparCas's (its dense layers take SparCas's path over every dimension) and then its own.
#include <cstdint>

#include "base/attn_types.h"
#include "policies/sparcas/args.h"

namespace kvferry {

/// Per-item HiP mask state in device memory (HipStepArgs::state, one per t; all zero for a
/// new sequence).
struct HipState {
  int64_t n = 0;      ///< n at the last ranked step
  int64_t k_off = 0;  ///< k_off the mask was built for
  int64_t hi = 0;     ///< the offloaded range's end when it was built: its positions lie below
  int32_t since_refresh = 0;  ///< ranked steps since it was built
  int32_t count = 0;          ///< blocks in the mask (0: none: the next ranked step builds one)
  /// HiP's `lag` 1 (policies/hip/mask.h's HipStepAction): the mask in use is blocks buffer `cur` of
  /// the item's two; a due rebuild is requested (pending 1, with the split and n it is built
  /// for), built from that step's query into the other buffer (pending 2: p_count blocks), and
  /// takes over at the item's next ranked step.
  int32_t cur = 0;
  int32_t pending = 0;  ///< 0 none, 1 requested, 2 built
  int64_t p_n = 0, p_lo = 0, p_hi = 0, p_k_off = 0;
  int32_t p_count = 0;
  int32_t p_since = 0;  ///< since_refresh when it takes over
};

/// HiP's own arguments of a step (HipSelectArgs::hip): the mask state of item t at state + t and its two blocks
/// buffers at blocks + (2 t + i) * max_nodes, i = 0, 1 (HipState::cur; max_nodes >= budget_cap /
/// bk); tokens per block, refresh interval r_m, representative (HipRepresentative).
struct HipStepArgs {
  HipState* state = nullptr;
  int32_t* blocks = nullptr;
  int32_t max_nodes = 0, bk = 2, r_m = 8, rep = 0;
  int32_t align = 1;  ///< the first nodes aligned to a power of two blocks (policies/hip/mask.h)
  /// Layers below HipDenseOf (max(sparcas.dense_layers, dense_layers)) take kSparcas's path
  /// instead of the mask: its exact top-k below sparcas.dense_layers, its 4-bit top-k over every
  /// dimension from there (HiP's `dense_bits` 4: sparcas.dense_layers 0).
  int32_t dense_layers = 0;
  /// 1: a due rebuild is built beside the step (CUDA: HiP's deferred kernel on the selector's side stream) and
  /// used from the item's next ranked step; 0: built in the step that finds it due.
  int32_t lag = 0;
  /// HiP's `drift` (0: off): a ranked step whose query's cosine to the one the item's mask was
  /// built from falls below it, in any head, rebuilds (requests, with lag 1) the mask before its
  /// interval (policies/hip/mask.h's HipDriftedHead).
  float drift = 0.0f;
  /// Item t's query of its latest mask build or request, at query + t * HipQueryWords(group,
  /// head_dim): CUDA's packed int8 query (with lag 1 the side stream builds a requested mask from
  /// it), the host's int8 codes in dimension order; with drift the step's query is compared with
  /// it. Needed for CUDA's lag 1 and for drift; else null.
  uint32_t* query = nullptr;
};

/// What HiP's selector stores in DecodeStepArgs::selector: SparCas's arguments first (so
/// SparcasArgsOf reads them), then HiP's.
struct HipSelectArgs {
  SparcasStepArgs sparcas;
  HipStepArgs hip;
};

/// HiP's own arguments of step \p a.
KVF_HOST_DEVICE inline HipStepArgs HipArgsOf(const DecodeStepArgs& a) {
  return SelectorArgsOf<HipSelectArgs>(a).hip;
}

}  // namespace kvferry
