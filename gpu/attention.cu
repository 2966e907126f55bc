// Copyright kvferry authors. Apache-2.0.
// Launchers of the decode attention kernels (attention.cuh): picks the split count, dispatches
// head_dim / dtype / head-group size to template instances, and merges the splits.

#include <algorithm>
#include <type_traits>
#include <utility>

#include "gpu/attention.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "base/check.h"

namespace kvferry::cuda {
namespace {

// Dynamic shared memory and resident CTAs per SM of one kernel instance (computed once).
template <int HD, typename T, int G, typename Item, bool kPipe>
struct KernelConfig {
  static size_t Smem() {
    const size_t red =
        (static_cast<size_t>(kAttnWarps) * G * (HD + 2) + G * HD + 2 * G) * sizeof(float);
    return kPipe ? std::max(red, kPipeSmemBytes<HD, T>) : red;
  }
  /// Sets the shared-memory limit and returns CTAs per SM.
  static Result<int> Prepare() {
    return PrepareAttnKernel<DecodeAttnKernel<HD, T, G, Item, kPipe>>(Smem(), "DecodeAttnKernel");
  }
};

// Query heads a CTA handles: 4 covers GQA 1-4 with fewer registers, 8 covers 5-8; larger groups
// are cut into chunks of 8 along blockIdx.z. Paged single-query items (dense decode) use the
// cp.async pipeline with one wave of CTAs: splits = resident CTAs / (items x head chunks), so at
// batch 1 every SM streams a share of each KV head; row lists keep the register-load kernel (their
// rows may be mapped host memory).
template <int HD, typename T, int G, typename Item>
Status LaunchDecodeG(const AttnParams& p, const Item* items, int64_t num_items,
                     const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream) {
  constexpr bool kPipe = std::is_same_v<Item, PagedAttnItem>;
  using Config = KernelConfig<HD, T, G, Item, kPipe>;
  KVF_ASSIGN_OR_RETURN(const int per_sm, Config::Prepare());
  const int gz = (p.group + G - 1) / G;
  KVF_CHECK_CODE(num_items <= 0x7fffffff && gz <= 65535, StatusCode::kInvalidArgument,
                 "CUDA attention: too many items (", num_items, ")");
  const int64_t ctas = static_cast<int64_t>(num_items) * gz;
  const int64_t slots = static_cast<int64_t>(info.num_sms) * (kPipe ? per_sm : 8);
  int64_t splits = kPipe ? std::max<int64_t>(slots / ctas, 1) : (slots + ctas - 1) / ctas;
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(info.max_splits, kAttnThreads));
  const size_t per_split = static_cast<size_t>(num_items) * p.group * (HD + 1) * sizeof(float);
  if (per_split > 0) splits = std::min<int64_t>(splits, static_cast<int64_t>(ws.bytes / per_split));
  splits = std::max<int64_t>(splits, 1);

  DecodeAttnArgs args;
  args.items = items;
  args.num_items = static_cast<int32_t>(num_items);
  args.group = p.group;
  args.num_splits = static_cast<int32_t>(splits);
  args.min_chunk = kPipe ? 4 * kPipeTileRows<HD> : info.min_chunk;
  args.scale_log2 = p.scale * kLog2e;
  if (splits > 1) {
    args.ws_o = ws.data;
    args.ws_lse = ws.data + static_cast<size_t>(num_items) * splits * p.group * HD;
  }
  const dim3 grid(static_cast<unsigned>(num_items), static_cast<unsigned>(splits),
                  static_cast<unsigned>(gz));
  DecodeAttnKernel<HD, T, G, Item, kPipe><<<grid, kAttnThreads, Config::Smem(), stream>>>(args);
  KVF_CUDA_CHECK_LAUNCH(DecodeAttnKernel);
  if (splits > 1) {
    const dim3 cgrid(static_cast<unsigned>(num_items), static_cast<unsigned>(p.group));
    CombineSplitsKernel<Item><<<cgrid, kAttnThreads, 0, stream>>>(args, HD);
    KVF_CUDA_CHECK_LAUNCH(CombineSplitsKernel);
  }
  return Status::Ok();
}

template <int HD, typename T, typename Item>
Status LaunchDecode(const AttnParams& p, const Item* items, int64_t num_items,
                    const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream) {
  KVF_CHECK_CODE(p.group <= 65535, StatusCode::kInvalidArgument, "CUDA attention: group ",
                 p.group, " too large");
  if (p.group <= 4) return LaunchDecodeG<HD, T, 4, Item>(p, items, num_items, info, ws, stream);
  return LaunchDecodeG<HD, T, 8, Item>(p, items, num_items, info, ws, stream);
}

template <typename Item>
Status Dispatch(const AttnParams& p, const Item* items, int64_t num_items, const LaunchInfo& info,
                AttnWorkspace ws, cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(CheckAttnShape(p));
  if (num_items == 0) return Status::Ok();
  KVF_CHECK_ARG(items != nullptr, "CUDA attention: null item array");
  return DISPATCH_HEAD_DIM(p.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(p.kv_dtype, T, [&] {
      return LaunchDecode<HD, T, Item>(p, items, num_items, info, ws, stream);
    });
  });
}

}  // namespace

Status CheckAttnShape(const AttnParams& p) {
  KVF_CHECK_ARG(p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256,
                "CUDA attention: head_dim ", p.head_dim,
                " not in {64, 128, 256} (the host backend handles other sizes)");
  KVF_CHECK_ARG(p.kv_dtype == DType::kBF16 || p.kv_dtype == DType::kF16,
                "CUDA attention: kv dtype must be bf16 or f16, got ", DTypeName(p.kv_dtype));
  KVF_CHECK_ARG(p.group >= 1, "CUDA attention: group ", p.group, " < 1");
  return Status::Ok();
}

Status LaunchAttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items,
                        const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream) {
  return Dispatch(p, items, num_items, info, ws, stream);
}

Status LaunchAttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items,
                         const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream) {
  return Dispatch(p, items, num_items, info, ws, stream);
}

}  // namespace kvferry::cuda
