// Copyright kvferry authors. Apache-2.0.
// Launchers of the decode attention kernels (attention.cuh): picks the split count, dispatches
// head_dim / dtype / head-group size to template instances, and merges the splits.

#include <algorithm>

#include "gpu/attention.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "runtime/check.h"

// Converts a run-time head_dim into the compile-time constant HEAD_DIM for the body.
#define DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...)                                  \
  [&]() -> ::kvferry::Status {                                                      \
    switch (head_dim) {                                                             \
      case 64: { constexpr int HEAD_DIM = 64; return __VA_ARGS__(); }               \
      case 128: { constexpr int HEAD_DIM = 128; return __VA_ARGS__(); }             \
      case 256: { constexpr int HEAD_DIM = 256; return __VA_ARGS__(); }             \
      default:                                                                      \
        return ::kvferry::InvalidArgument(::kvferry::detail::StrCat(                \
            "CUDA attention: head_dim ", head_dim, " not in {64, 128, 256}"));      \
    }                                                                               \
  }()

#define DISPATCH_KV_DTYPE(dtype, T, ...)                                            \
  [&]() -> ::kvferry::Status {                                                      \
    switch (dtype) {                                                                \
      case ::kvferry::DType::kBF16: { using T = __nv_bfloat16; return __VA_ARGS__(); } \
      case ::kvferry::DType::kF16: { using T = __half; return __VA_ARGS__(); }      \
      default:                                                                      \
        return ::kvferry::InvalidArgument("CUDA attention: kv dtype must be bf16 or f16"); \
    }                                                                               \
  }()

namespace kvferry::cuda {
namespace {

// Query heads a CTA handles: 4 covers GQA 1-4 with fewer registers, 8 covers 5-8; larger groups
// are cut into chunks of 8 along blockIdx.z.
template <int HD, typename T, typename Item>
Status LaunchDecode(const AttnParams& p, const Item* items, int64_t num_items,
                    const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream) {
  const int gmax = p.group <= 4 ? 4 : 8;
  const int gz = (p.group + gmax - 1) / gmax;
  // Enough CTAs for ~8 per SM; bounded by the workspace for the partial results.
  const int64_t ctas = static_cast<int64_t>(num_items) * gz;
  int64_t splits = std::clamp<int64_t>((8LL * info.num_sms + ctas - 1) / ctas, 1, info.max_splits);
  const size_t per_split = static_cast<size_t>(num_items) * p.group * (HD + 1) * sizeof(float);
  if (per_split > 0) splits = std::min<int64_t>(splits, static_cast<int64_t>(ws.bytes / per_split));
  splits = std::max<int64_t>(splits, 1);
  KVF_CHECK_CODE(num_items <= 0x7fffffff && gz <= 65535, StatusCode::kInvalidArgument,
                 "CUDA attention: too many items (", num_items, ")");

  DecodeAttnArgs args;
  args.items = items;
  args.num_items = static_cast<int32_t>(num_items);
  args.group = p.group;
  args.num_splits = static_cast<int32_t>(splits);
  args.min_chunk = info.min_chunk;
  args.scale_log2 = p.scale * kLog2e;
  if (splits > 1) {
    args.ws_o = ws.data;
    args.ws_lse = ws.data + static_cast<size_t>(num_items) * splits * p.group * HD;
  }
  const dim3 grid(static_cast<unsigned>(num_items), static_cast<unsigned>(splits),
                  static_cast<unsigned>(gz));
  if (gmax == 4) {
    const size_t smem = (kAttnWarps * 4 * (HD + 2) + 4 * HD + 8) * sizeof(float);
    DecodeAttnKernel<HD, T, 4, Item><<<grid, kAttnThreads, smem, stream>>>(args);
  } else {
    const size_t smem = (kAttnWarps * 8 * (HD + 2) + 8 * HD + 16) * sizeof(float);
    DecodeAttnKernel<HD, T, 8, Item><<<grid, kAttnThreads, smem, stream>>>(args);
  }
  KVF_CUDA_CHECK_LAUNCH(DecodeAttnKernel);
  if (splits > 1) {
    CombineSplitsKernel<Item><<<static_cast<unsigned>(num_items), kAttnThreads, 0, stream>>>(args,
                                                                                           HD);
    KVF_CUDA_CHECK_LAUNCH(CombineSplitsKernel);
  }
  return Status::Ok();
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
