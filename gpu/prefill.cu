// Copyright kvferry authors. Apache-2.0.
// Launcher of the tensor-core prefill attention kernel (prefill.cuh): checks the shape, dispatches
// head_dim and KV dtype (DISPATCH_HEAD_DIM / DISPATCH_KV_DTYPE) and the output dtype to template
// instances, and opts each instance into the dynamic shared memory it needs on the current device.

#include <atomic>
#include <cstdint>

#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/prefill.cuh"
#include "base/check.h"

namespace kvferry::cuda {
namespace {

// Sets the dynamic shared-memory limit of \p Kernel on the current device, once per device (the
// attribute is per device; more than 64 devices just set it again every launch).
template <auto Kernel>
Status ConfigureOnce(size_t smem) {
  static std::atomic<uint64_t> configured{0};
  int dev = 0;
  KVF_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (configured.load(std::memory_order_relaxed) & bit) != 0) return Status::Ok();
  KVF_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  configured.fetch_or(bit, std::memory_order_relaxed);
  return Status::Ok();
}

template <int HD, typename T, typename OutT>
Status Launch(const AttnParams& p, const PrefillAttnItem* items, int64_t num_items,
              int32_t max_num_q, cudaStream_t stream) {
  using Tile = PrefillTile<HD>;
  constexpr auto kKernel = PrefillAttnKernel<HD, T, OutT>;
  KVF_RETURN_IF_ERROR(ConfigureOnce<kKernel>(Tile::kSmemBytes));
  const int64_t rows = static_cast<int64_t>(max_num_q) * p.group;
  const int64_t m_blocks = (rows + Tile::kBlockM - 1) / Tile::kBlockM;
  KVF_CHECK_ARG(m_blocks <= 65535, "CUDA prefill: ", max_num_q, " queries x group ", p.group,
                " exceed ", int64_t{65535} * Tile::kBlockM, " query rows per launch");
  PrefillArgs args;
  args.items = items;
  args.group = p.group;
  args.num_m_blocks = static_cast<int32_t>(m_blocks);
  args.scale_log2 = p.scale * 1.4426950408889634f;
  const dim3 grid(static_cast<unsigned>(num_items), static_cast<unsigned>(m_blocks));
  kKernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(args);
  KVF_CUDA_CHECK_LAUNCH(PrefillAttnKernel);
  return Status::Ok();
}

template <int HD, typename T>
Status DispatchOut(const AttnParams& p, DType out_dtype, const PrefillAttnItem* items,
                   int64_t num_items, int32_t max_num_q, cudaStream_t stream) {
  switch (out_dtype) {
    case DType::kF32:
      return Launch<HD, T, float>(p, items, num_items, max_num_q, stream);
    case DType::kBF16:
      return Launch<HD, T, __nv_bfloat16>(p, items, num_items, max_num_q, stream);
    case DType::kF16:
      return Launch<HD, T, __half>(p, items, num_items, max_num_q, stream);
  }
  return InvalidArgument("CUDA prefill: unknown output dtype");
}

}  // namespace

Status LaunchPrefillAttention(const AttnParams& p, DType q_dtype, DType out_dtype,
                              const PrefillAttnItem* items, int64_t num_items, int32_t max_num_q,
                              cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(CheckAttnShape(p));
  KVF_CHECK_ARG(q_dtype == p.kv_dtype, "CUDA prefill: q dtype ", DTypeName(q_dtype),
                " must equal the kv dtype ", DTypeName(p.kv_dtype));
  KVF_CHECK_ARG(out_dtype == DType::kF32 || out_dtype == DType::kBF16 || out_dtype == DType::kF16,
                "CUDA prefill: output dtype must be f32, bf16 or f16");
  KVF_CHECK_ARG(num_items >= 0 && num_items <= 0x7fffffff, "CUDA prefill: item count ", num_items,
                " out of range [0, 2^31)");
  KVF_CHECK_ARG(max_num_q >= 0, "CUDA prefill: max_num_q ", max_num_q, " < 0");
  if (num_items == 0 || max_num_q == 0) return Status::Ok();
  KVF_CHECK_ARG(items != nullptr, "CUDA prefill: null item array");
  return DISPATCH_HEAD_DIM(p.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(p.kv_dtype, T, [&] {
      return DispatchOut<HD, T>(p, out_dtype, items, num_items, max_num_q, stream);
    });
  });
}

}  // namespace kvferry::cuda
