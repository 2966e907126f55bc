// Copyright kvferry authors. Apache-2.0.
#include "gpu/cuda_device.h"

#include <hwloc.h>

#include <cstdio>
#include <utility>

#include "gpu/cuda_check.h"
#include "gpu/device_bank.h"
#include "base/check.h"

namespace kvferry {
namespace cuda {
namespace {

// Finds the NUMA node of the GPU with PCI bus id \p bus_id. Returns -1 when the machine has one
// node or hwloc cannot place the device; fills *topo / *nodeset (caller owns) otherwise.
int FindGpuNumaNode(const char* bus_id, hwloc_topology_t* topo_out, hwloc_nodeset_t* nodeset_out) {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return -1;
  hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo) != 0 ||
      hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE) < 2) {
    hwloc_topology_destroy(topo);
    return -1;
  }
  hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(topo, bus_id);
  hwloc_obj_t anc = pci != nullptr ? hwloc_get_non_io_ancestor_obj(topo, pci) : nullptr;
  if (anc == nullptr || anc->nodeset == nullptr || hwloc_bitmap_weight(anc->nodeset) != 1) {
    hwloc_topology_destroy(topo);
    return -1;
  }
  *topo_out = topo;
  *nodeset_out = hwloc_bitmap_dup(anc->nodeset);
  return hwloc_bitmap_first(anc->nodeset);
}

}  // namespace

Result<std::unique_ptr<CudaDevice>> CudaDevice::Create(int device_id) {
  int count = 0;
  KVF_CUDA_CHECK(cudaGetDeviceCount(&count));
  KVF_CHECK_ARG(device_id >= 0 && device_id < count, "CUDA device ", device_id,
                " out of range [0, ", count, ")");
  std::unique_ptr<CudaDevice> dev(new CudaDevice(device_id));
  KVF_RETURN_IF_ERROR(dev->Init());
  return Result<std::unique_ptr<CudaDevice>>(std::move(dev));
}

Status CudaDevice::Init() {
  KVF_CUDA_CHECK(cudaSetDevice(device_id_));
  KVF_CUDA_CHECK(cudaGetDeviceProperties(&props_, device_id_));
  KVF_CHECK_CODE(props_.major >= 7, StatusCode::kUnimplemented, "CUDA device ", device_id_, " (",
                 props_.name, ") has compute capability ", props_.major, ".", props_.minor,
                 "; kvferry needs 7.0+");
  KVF_CHECK_CODE(props_.canMapHostMemory && props_.unifiedAddressing, StatusCode::kUnimplemented,
                 "CUDA device ", device_id_, " cannot map host memory with unified addressing");
  info_.num_sms = props_.multiProcessorCount;
  KVF_CUDA_CHECK(cudaStreamCreateWithFlags(&default_stream_, cudaStreamNonBlocking));
  void* ws = nullptr;
  KVF_CUDA_CHECK(cudaMalloc(&ws, kWorkspaceBytes));
  workspaces_[default_stream_] = static_cast<float*>(ws);

  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_id_) == cudaSuccess) {
    hwloc_topology_t topo = nullptr;
    hwloc_nodeset_t nodeset = nullptr;
    numa_node_ = FindGpuNumaNode(bus_id, &topo, &nodeset);
    if (numa_node_ >= 0) {
      topology_ = topo;
      nodeset_ = nodeset;
    }
  }
  name_ = detail::StrCat("cuda:", device_id_, " ", props_.name, " (sm_", props_.major,
                         props_.minor, ", ", props_.multiProcessorCount, " SMs, ",
                         props_.totalGlobalMem >> 20, " MiB",
                         numa_node_ >= 0 ? detail::StrCat(", NUMA node ", numa_node_) : "", ")");
  return Status::Ok();
}

CudaDevice::~CudaDevice() {
  if (cudaSetDevice(device_id_) != cudaSuccess) return;
  if (default_stream_ != nullptr) KVF_CUDA_WARN(cudaStreamSynchronize(default_stream_));
  for (auto& [stream, ws] : workspaces_) KVF_CUDA_WARN(cudaFree(ws));
  for (auto& [ptr, block] : host_blocks_) {
    if (block.registered) {
      KVF_CUDA_WARN(cudaHostUnregister(ptr));
      hwloc_free(static_cast<hwloc_topology_t>(topology_), ptr, block.bytes);
    } else {
      KVF_CUDA_WARN(cudaFreeHost(ptr));
    }
  }
  if (default_stream_ != nullptr) KVF_CUDA_WARN(cudaStreamDestroy(default_stream_));
  if (nodeset_ != nullptr) hwloc_bitmap_free(static_cast<hwloc_nodeset_t>(nodeset_));
  if (topology_ != nullptr) hwloc_topology_destroy(static_cast<hwloc_topology_t>(topology_));
}

Status CudaDevice::Activate() const {
  KVF_CUDA_CHECK(cudaSetDevice(device_id_));
  return Status::Ok();
}

Result<void*> CudaDevice::AllocDevice(size_t bytes) {
  KVF_RETURN_IF_ERROR(Activate());
  void* p = nullptr;
  if (bytes == 0) return p;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free allocation error
    return Status(StatusCode::kResourceExhausted,
                  detail::StrCat("cudaMalloc(", bytes, " bytes) on ", name_, " failed: ",
                                 cudaGetErrorString(err)));
  }
  std::lock_guard<std::mutex> lock(mu_);
  device_blocks_.Add(p, bytes);
  return p;
}

void CudaDevice::FreeDevice(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    device_blocks_.Remove(ptr);
  }
  KVF_CUDA_WARN(cudaSetDevice(device_id_));
  KVF_CUDA_WARN(cudaFree(ptr));
}

int64_t CudaDevice::device_bytes_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return device_blocks_.bytes() +
         static_cast<int64_t>(workspaces_.size()) * static_cast<int64_t>(kWorkspaceBytes);
}

Result<void*> CudaDevice::AllocHost(size_t bytes) {
  KVF_RETURN_IF_ERROR(Activate());
  void* p = nullptr;
  if (bytes == 0) return p;
  // On a multi-node machine: bind the pages to the GPU's node first, then pin and map them. The
  // mapped address must equal the host address (true on 64-bit Linux with UVA); otherwise fall
  // back to cudaHostAlloc.
  if (topology_ != nullptr) {
    auto topo = static_cast<hwloc_topology_t>(topology_);
    p = hwloc_alloc_membind(topo, bytes, static_cast<hwloc_nodeset_t>(nodeset_),
                            HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET);
    if (p != nullptr) {
      void* dev_ptr = nullptr;
      if (cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) ==
              cudaSuccess &&
          cudaHostGetDevicePointer(&dev_ptr, p, 0) == cudaSuccess && dev_ptr == p) {
        std::lock_guard<std::mutex> lock(mu_);
        host_blocks_[p] = HostBlock{bytes, true};
        return p;
      }
      (void)cudaGetLastError();
      (void)cudaHostUnregister(p);
      (void)cudaGetLastError();
      hwloc_free(topo, p, bytes);
      p = nullptr;
    }
  }
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(StatusCode::kResourceExhausted,
                  detail::StrCat("cudaHostAlloc(", bytes, " bytes, mapped) failed: ",
                                 cudaGetErrorString(err)));
  }
  std::lock_guard<std::mutex> lock(mu_);
  host_blocks_[p] = HostBlock{bytes, false};
  return p;
}

void CudaDevice::FreeHost(void* ptr) {
  if (ptr == nullptr) return;
  HostBlock block;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = host_blocks_.find(ptr);
    if (it == host_blocks_.end()) {
      std::fprintf(stderr, "kvferry: FreeHost(%p): not allocated by this device\n", ptr);
      return;
    }
    block = it->second;
    host_blocks_.erase(it);
  }
  KVF_CUDA_WARN(cudaSetDevice(device_id_));
  if (block.registered) {
    KVF_CUDA_WARN(cudaHostUnregister(ptr));
    hwloc_free(static_cast<hwloc_topology_t>(topology_), ptr, block.bytes);
  } else {
    KVF_CUDA_WARN(cudaFreeHost(ptr));
  }
}

Result<StreamHandle> CudaDevice::CreateStream() {
  KVF_RETURN_IF_ERROR(Activate());
  cudaStream_t s = nullptr;
  KVF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto ws = Workspace(s);  // allocate its scratch now, not in the first step
  if (!ws.ok()) {
    KVF_CUDA_WARN(cudaStreamDestroy(s));
    return ws.status();
  }
  return static_cast<StreamHandle>(s);
}

void CudaDevice::DestroyStream(StreamHandle stream) {
  if (stream == nullptr || stream == default_stream_) return;
  auto s = static_cast<cudaStream_t>(stream);
  KVF_CUDA_WARN(cudaSetDevice(device_id_));
  KVF_CUDA_WARN(cudaStreamSynchronize(s));
  float* ws = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = workspaces_.find(s);
    if (it != workspaces_.end()) {
      ws = it->second;
      workspaces_.erase(it);
    }
  }
  if (ws != nullptr) KVF_CUDA_WARN(cudaFree(ws));
  KVF_CUDA_WARN(cudaStreamDestroy(s));
}

Result<AttnWorkspace> CudaDevice::Workspace(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = workspaces_.find(stream);
  if (it != workspaces_.end()) return AttnWorkspace{it->second, kWorkspaceBytes};
  // A stream the caller created: allocate once, keep until the device goes.
  void* ws = nullptr;
  KVF_CUDA_CHECK(cudaMalloc(&ws, kWorkspaceBytes));
  workspaces_[stream] = static_cast<float*>(ws);
  return AttnWorkspace{static_cast<float*>(ws), kWorkspaceBytes};
}

Result<EventHandle> CudaDevice::CreateEvent() {
  KVF_RETURN_IF_ERROR(Activate());
  cudaEvent_t e = nullptr;
  KVF_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return static_cast<EventHandle>(e);
}

Result<EventHandle> CudaDevice::CreateTimingEvent() {
  KVF_RETURN_IF_ERROR(Activate());
  cudaEvent_t e = nullptr;
  KVF_CUDA_CHECK(cudaEventCreate(&e));
  return static_cast<EventHandle>(e);
}

Result<double> CudaDevice::ElapsedMs(EventHandle start, EventHandle end) {
  KVF_CHECK_ARG(start != nullptr && end != nullptr, "ElapsedMs: null event");
  float ms = 0;
  KVF_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start),
                                      static_cast<cudaEvent_t>(end)));
  return static_cast<double>(ms);
}

void CudaDevice::DestroyEvent(EventHandle event) {
  if (event == nullptr) return;
  KVF_CUDA_WARN(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
}

Status CudaDevice::RecordEvent(EventHandle event, StreamHandle stream) {
  KVF_CHECK_ARG(event != nullptr, "RecordEvent: null event");
  KVF_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), Resolve(stream)));
  return Status::Ok();
}

Status CudaDevice::WaitEvent(StreamHandle stream, EventHandle event) {
  KVF_CHECK_ARG(event != nullptr, "WaitEvent: null event");
  KVF_CUDA_CHECK(cudaStreamWaitEvent(Resolve(stream), static_cast<cudaEvent_t>(event), 0));
  return Status::Ok();
}

Status CudaDevice::SynchronizeEvent(EventHandle event) {
  KVF_CHECK_ARG(event != nullptr, "SynchronizeEvent: null event");
  KVF_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return Status::Ok();
}

Status CudaDevice::SynchronizeStream(StreamHandle stream) {
  KVF_CUDA_CHECK(cudaStreamSynchronize(Resolve(stream)));
  return Status::Ok();
}

Status CudaDevice::CopyAsync(void* dst, const void* src, size_t bytes, StreamHandle stream) {
  if (bytes == 0) return Status::Ok();
  KVF_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, Resolve(stream)));
  return Status::Ok();
}

Status CudaDevice::CopyRows(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                            DType dst_dtype, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  return LaunchCopyRows(rows, num_rows, elems, src_dtype, dst_dtype, Resolve(stream));
}

Result<std::pair<cudaStream_t, AttnWorkspace>> CudaDevice::AttendOn(StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  const cudaStream_t s = Resolve(stream);
  KVF_ASSIGN_OR_RETURN(AttnWorkspace ws, Workspace(s));
  return std::make_pair(s, ws);
}

Status CudaDevice::AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items,
                              StreamHandle stream) {
  KVF_ASSIGN_OR_RETURN(const auto on, AttendOn(stream));
  return LaunchAttendRows(p, items, num_items, info_, on.second, on.first);
}

Status CudaDevice::AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items,
                               StreamHandle stream) {
  KVF_ASSIGN_OR_RETURN(const auto on, AttendOn(stream));
  return LaunchAttendPaged(p, items, num_items, info_, on.second, on.first);
}

Status CudaDevice::DecodeStep(const DecodeStepArgs& args, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  return LaunchDecodeStep(args, info_, Resolve(stream));
}

Status CudaDevice::SplitStepList(const DecodeStepArgs& step, const SplitListArgs& split,
                                 StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  return LaunchSplitStepList(step, split, Resolve(stream));
}

Status CudaDevice::PrefetchListRows(const DecodeStepArgs& next, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  return LaunchPrefetchListRows(next, info_, Resolve(stream));
}

Status CudaDevice::Run(const DeviceKernel& kernel, const void* args, StreamHandle stream) {
  KVF_CHECK_ARG(kernel.cuda != nullptr, kernel.name, ": no CUDA launcher");
  KVF_RETURN_IF_ERROR(Activate());
  return kernel.cuda(args, info_, Resolve(stream));
}

Status CudaDevice::PrimeAttention(const PrimeArgs& args, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(CheckPrimeArgs(args));
  KVF_RETURN_IF_ERROR(Activate());
  return LaunchPrimeAttention(args, info_.num_sms, Resolve(stream));
}

Status CudaDevice::ShadowScan(const ShadowScanArgs& args, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  return LaunchShadowScan(args, Resolve(stream));
}

Status CudaDevice::CopyBatchAsync(void** dst, const void** src, size_t* bytes, int64_t count,
                                  StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  return EnqueuePageCopies(dst, src, bytes, count, Resolve(stream));
}

Status CudaDevice::EnqueuePageCopies(void** dst, const void** src, size_t* bytes, int64_t count,
                                     cudaStream_t stream) {
  if (count == 0) return Status::Ok();
#if CUDART_VERSION >= 12080
  // One call for the segment's copies (tens to thousands of page runs): far less host time than a
  // cudaMemcpyAsync each. Source order is the stream's (the pages were written before the fork).
  if (batch_copies_.load(std::memory_order_relaxed)) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_index = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t err = cudaMemcpyBatchAsync(dst, src, bytes, static_cast<size_t>(count), &attr,
                                                 &attr_index, 1, stream);
#else
    size_t fail_index = 0;
    const cudaError_t err =
        cudaMemcpyBatchAsync(dst, const_cast<void**>(src), bytes, static_cast<size_t>(count), &attr,
                             &attr_index, 1, &fail_index, stream);
#endif
    if (err == cudaSuccess) return Status::Ok();
    // A driver without batched copies: one copy each from now on (copies the batch may have
    // enqueued are made again, in stream order, with the same bytes).
    (void)cudaGetLastError();
    batch_copies_.store(false, std::memory_order_relaxed);
  }
#endif
  for (int64_t i = 0; i < count; ++i) {
    KVF_CUDA_CHECK(cudaMemcpyAsync(dst[i], src[i], bytes[i], cudaMemcpyDefault, stream));
  }
  return Status::Ok();
}

// The items of one prefill launch (a KV head each): the chunk's queries from q, the staged KV
// pages from page0 on, the output to out (final_out) or to the running (o_acc, lse_acc), merged
// with them first (merge).
struct PrefillItemsOf {
  const PrefillChunkArgs& a;
  const void* q;
  int64_t staging_pages;
  int page_shift;
  void operator()(PrefillAttnItem* its, int64_t page0, int64_t q_pos0, int64_t kv_limit, bool merge,
                  bool final_out) const {
    const PrefillStageArgs& st = a.stage;
    const int64_t pt = st.store.page_tokens, d = st.head_dim, group = a.params.group, tokens = st.tokens;
    const size_t elem = DTypeSize(st.kv_dtype), out_elem = DTypeSize(a.out_dtype);
    const int64_t page_elems = 2 * pt * d;  // one staging page: K rows then V rows
    for (int h = 0; h < st.num_kv_heads; ++h) {
      PrefillAttnItem& it = its[h];
      it = PrefillAttnItem{};
      it.q = static_cast<const char*>(q) + static_cast<size_t>(h * group * d) * elem;
      it.q_stride_tok = a.num_q_heads * d;
      if (final_out) {
        it.o = static_cast<char*>(a.out) + static_cast<size_t>(h * group * d) * out_elem;
      } else {
        it.o = a.o_acc + h * group * d;
        it.lse = a.lse_acc + h * tokens * group;
      }
      const char* base =
          st.staging + static_cast<size_t>((h * staging_pages + page0) * page_elems) * elem;
      it.k = base;
      it.v = base + static_cast<size_t>(pt * d) * elem;
      it.kv_stride = d;
      it.kv_page_shift = page_shift;
      it.num_q = static_cast<int32_t>(tokens);
      it.q_pos0 = q_pos0;
      it.kv_limit = kv_limit;
      if (merge) {
        it.o_in = a.o_acc + h * group * d;
        it.lse_in = a.lse_acc + h * tokens * group;
      }
    }
  }
};

Status CudaDevice::PrefillChunk(const PrefillChunkArgs& a, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  const cudaStream_t s = Resolve(stream);
  PrefillStageArgs st = a.stage;
  KVF_CHECK_ARG(a.items != nullptr && st.staging != nullptr, "PrefillChunk: no items or staging");
  const int64_t pt = st.store.page_tokens;
  KVF_CHECK_ARG(pt >= 32 && (pt & (pt - 1)) == 0 && st.staging_cap % pt == 0,
                "PrefillChunk: page of ", pt, " tokens is not a power of two >= 32");
  int page_shift = 0;
  while ((int64_t{1} << page_shift) < pt) ++page_shift;
  const int hkv = st.num_kv_heads;
  const int64_t hq = a.num_q_heads, d = st.head_dim, tokens = st.tokens;
  const size_t elem = DTypeSize(st.kv_dtype);
  const int64_t staging_pages = st.staging_cap / pt;
  const int64_t page_elems = 2 * pt * d;  // one staging page: K rows then V rows
  auto* items = static_cast<PrefillAttnItem*>(a.items);
  const int64_t item_cap = static_cast<int64_t>(a.items_bytes / sizeof(PrefillAttnItem));

  // Overlapped history: whole pages [0, history_pages) by the copy engines, segment by segment;
  // the rest of the page that holds pos0 is staged with the chunk (zero-copy, < 1 page a head).
  const int64_t history_pages = st.pos0 / pt;
  int64_t seg_begin[kPrefillMaxSegments + 1];
  int num_segs = 0;
  if (a.copy_stream != nullptr && history_pages >= kPrefillSegmentMinPages && !st.history_staged) {
    KVF_CHECK_ARG(a.fork_done != nullptr && a.segment_done != nullptr && a.host_pages != nullptr &&
                      a.copy_scratch != nullptr && a.o_acc != nullptr && a.lse_acc != nullptr,
                  "PrefillChunk: overlapped history without its events or scratch");
    num_segs = PlanPrefillSegments(history_pages, tokens, pt, seg_begin);
  }
  KVF_CHECK_ARG(item_cap >= (1 + num_segs) * hkv, "PrefillChunk: room for ", item_cap, " items, ",
                (1 + num_segs) * hkv, " needed");
  st.history_begin = st.history_staged ? st.pos0 : num_segs > 0 ? history_pages * pt : 0;

  // The copies of segment j + 1 are enqueued before the attention of segment j, so that the GPU
  // starts early and the host's enqueueing hides behind it; every wait is on an event (nothing
  // spins on the device), so any order of enqueueing is free of deadlock.
  const auto copy = static_cast<cudaStream_t>(a.copy_stream);
  const auto fork = static_cast<cudaEvent_t>(a.fork_done);
  bool forked = false;
  // On an error after the fork: the caller's stream waits for whatever reached the copy stream,
  // so that no copy into the staging outlives the call unordered.
  auto fail = [&](Status status) {
    if (!status.ok() && forked) {
      (void)cudaGetLastError();
      if (cudaEventRecord(fork, copy) == cudaSuccess) (void)cudaStreamWaitEvent(s, fork, 0);
    }
    return status;
  };
  const int64_t cap = static_cast<int64_t>(hkv) * st.store.max_pages;
  auto** copy_dst = static_cast<void**>(a.copy_scratch);
  auto** copy_src = const_cast<const void**>(copy_dst + cap);
  auto* copy_bytes = reinterpret_cast<size_t*>(copy_dst + 2 * cap);
  int64_t copies_used = 0;  // each segment its own entries: none is rewritten while enqueued
  auto enqueue_segment = [&](int j) -> Status {
    const int64_t n =
        ListPageCopies(a.host_pages, st.store.max_pages, hkv, seg_begin[j], seg_begin[j + 1], st.staging,
                       staging_pages, page_elems * static_cast<int64_t>(elem),
                       copy_dst + copies_used, copy_src + copies_used, copy_bytes + copies_used);
    KVF_RETURN_IF_ERROR(EnqueuePageCopies(copy_dst + copies_used, copy_src + copies_used,
                                          copy_bytes + copies_used, n, copy));
    copies_used += n;
    KVF_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(a.segment_done[j]), copy));
    return Status::Ok();
  };
  if (num_segs > 0) {
    // The copies start after the caller's earlier work (the earlier chunks' write-through).
    KVF_CUDA_CHECK(cudaEventRecord(fork, s));
    KVF_CUDA_CHECK(cudaStreamWaitEvent(copy, fork, 0));
    forked = true;
    KVF_RETURN_IF_ERROR(fail(enqueue_segment(0)));
  }

  // Write-through on the copy engines: the stage kernel leaves the host store alone, and the
  // chunk's rows go from the staging to it page by page on write_stream while the chunk is
  // attended (the zero-copy stores were 8 MB over PCIe before every 2K chunk's attention).
  const bool async_write = a.write_stream != nullptr && st.staging != nullptr && tokens > 0;
  st.write_through = !async_write;
  KVF_CHECK_ARG(!async_write || (a.write_ready != nullptr && a.write_done != nullptr &&
                                 a.write_scratch != nullptr && a.host_pages != nullptr),
                "PrefillChunk: write-through on write_stream without its events, lists or pages");
  const auto wstream = static_cast<cudaStream_t>(a.write_stream);
  bool write_forked = false;
  auto fail_all = [&](Status status) {
    if (!status.ok() && write_forked) {
      (void)cudaGetLastError();
      const auto done = static_cast<cudaEvent_t>(a.write_done);
      if (cudaEventRecord(done, wstream) == cudaSuccess) (void)cudaStreamWaitEvent(s, done, 0);
    }
    return fail(std::move(status));
  };
  KVF_RETURN_IF_ERROR(fail(LaunchPrefillStage(st, s)));
  if (async_write) {
    KVF_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(a.write_ready), s));
    KVF_CUDA_CHECK(cudaStreamWaitEvent(wstream, static_cast<cudaEvent_t>(a.write_ready), 0));
    write_forked = true;
    // Two copies (K rows, V rows) per head and page the chunk touches: write_scratch holds
    // 2 * num_kv_heads * max_pages entries of each list.
    const int64_t wcap = 2 * static_cast<int64_t>(hkv) * st.store.max_pages;
    auto** wdst = static_cast<void**>(a.write_scratch);
    auto** wsrc = const_cast<const void**>(wdst + wcap);
    auto* wbytes = reinterpret_cast<size_t*>(wdst + 2 * wcap);
    const int64_t n = ListWriteThroughCopies(st, a.host_pages, staging_pages, wdst, wsrc, wbytes);
    KVF_RETURN_IF_ERROR(fail_all(EnqueuePageCopies(wdst, wsrc, wbytes, n, wstream)));
    const cudaError_t err = cudaEventRecord(static_cast<cudaEvent_t>(a.write_done), wstream);
    if (err != cudaSuccess) return fail_all(CudaStatus(err, "cudaEventRecord(write_done)", __FILE__, __LINE__));
  }
  const void* q = a.q;
  if (a.q_dtype != st.kv_dtype) {
    if (a.q_scratch == nullptr) {
      return fail_all(InvalidArgument(
          detail::StrCat("PrefillChunk: q in ", DTypeName(a.q_dtype), " needs q_scratch")));
    }
    KVF_RETURN_IF_ERROR(
        fail_all(LaunchConvert(a.q, a.q_dtype, a.q_scratch, st.kv_dtype, tokens * hq * d, s)));
    q = a.q_scratch;
  }
  // Launch 0: the chunk's own causal block (with the history before it when nothing is
  // overlapped), from staging page first_page on. Launch 1 + j: segment j, merged into the
  // running (o_acc, lse_acc) in place; the last one writes out.
  const int64_t first_page = num_segs > 0 ? history_pages : 0;
  const PrefillItemsOf fill{a, q, staging_pages, page_shift};
  fill(items, first_page, st.pos0 - first_page * pt, 0, false, num_segs == 0);
  KVF_RETURN_IF_ERROR(
      fail_all(LaunchPrefillAttention(a.params, st.kv_dtype, num_segs == 0 ? a.out_dtype : DType::kF32,
                                  items, hkv, static_cast<int32_t>(tokens), s)));
  for (int j = 0; j < num_segs; ++j) {
    if (j + 1 < num_segs) KVF_RETURN_IF_ERROR(fail_all(enqueue_segment(j + 1)));
    const bool last = j == num_segs - 1;
    const int64_t len = (seg_begin[j + 1] - seg_begin[j]) * pt;
    PrefillAttnItem* its = items + (1 + j) * hkv;
    fill(its, seg_begin[j], len - 1, len, true, last);
    const cudaError_t err = cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(a.segment_done[j]), 0);
    if (err != cudaSuccess) {
      return fail_all(CudaStatus(err, "cudaStreamWaitEvent(segment_done)", __FILE__, __LINE__));
    }
    KVF_RETURN_IF_ERROR(
        fail_all(LaunchPrefillAttention(a.params, st.kv_dtype, last ? a.out_dtype : DType::kF32, its,
                                    hkv, static_cast<int32_t>(tokens), s)));
  }
  // The last launch waited for the last segment's copies, hence for everything on copy_stream;
  // the caller's stream then waits for the write-through.
  if (async_write) {
    KVF_CUDA_CHECK(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(a.write_done), 0));
  }
  return Status::Ok();
}

Result<std::unique_ptr<StepBank>> CudaDevice::CreateStepBank(const StepBankConfig& config) {
  return MakeCudaStepBank(this, config);
}

Result<StepBankSizes> CudaDevice::StepBankSizesFor(const StepBankConfig& config) const {
  return CudaStepBankSizes(config);
}

bool CudaDevice::IsCapturing(StreamHandle stream) const {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(Resolve(stream), &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return st != cudaStreamCaptureStatusNone;
}

bool CudaDevice::EventDone(EventHandle event) const {
  if (event == nullptr) return true;
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

Status CudaDevice::MergeLse(float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                            int64_t rows, int head_dim, void* out, DType out_dtype,
                            StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  return LaunchMergeLse(o_a, lse_a, o_b, lse_b, rows, head_dim, out, out_dtype, Resolve(stream));
}

Status CudaDevice::WaitHostValue(const uint32_t* word, uint32_t value, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(Activate());
  return LaunchWaitHostValue(word, value, kHostValueTimeoutS, Resolve(stream));
}

}  // namespace cuda

bool CudaAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

Result<std::unique_ptr<Device>> MakeCudaDevice(int device_id) {
  auto dev = cuda::CudaDevice::Create(device_id);
  if (!dev.ok()) return dev.status();
  return std::unique_ptr<Device>(std::move(dev).value());
}

}  // namespace kvferry
