// Copyright kvferry authors. Apache-2.0.
#pragma once
// Accuracy of a sparse attention step against dense attention, per (sequence, layer, KV head):
// recall of the oracle top-k, attention-mass recall and relative L2 output error.

#include <cstdint>
#include <vector>

namespace kvferry::bench {

struct StepAccuracy {
  double recall = 0;       ///< |selected ∩ top-k| / k, k = min(budget, n)
  double mass_recall = 0;  ///< mean over the group's query heads of the softmax mass selected
  double rel_err = 0;      ///< ||o - o_dense|| / ||o_dense|| over the group's heads
};

/// \p q: [group, d] f32; \p k, \p v: rows of this KV head, row j at k + j * row_stride (f32, the
/// values as stored, i.e. already rounded to the KV dtype); \p selected: positions attended;
/// \p out: the runtime's output [group, d].
StepAccuracy MeasureStep(const float* q, int group, int d, float scale, const float* k,
                         const float* v, int64_t row_stride, int64_t n,
                         const std::vector<int32_t>& selected, int64_t budget, const float* out);

}  // namespace kvferry::bench
