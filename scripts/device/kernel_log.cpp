// Copyright kvferry authors. Apache-2.0.
// A CUPTI injection library that records every kernel a process launches (graph nodes included):
// one line per distinct launch shape, "name block=XxYxZ smem=S", appended to $KVF_KERNEL_LOG at
// exit. scripts/device/kernel_cover.sh loads it into each GPU test (CUDA_INJECTION64_PATH) to
// find the tests that together launch every kernel shape of the suite. Build (on the GPU machine):
//   g++ -O2 -shared -fPIC scripts/device/kernel_log.cpp -I$CUDA/include -L$CUDA/lib64 -lcupti
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

namespace {

std::mutex g_mu;
std::set<std::string>* g_keys = nullptr;  // leaked on purpose: read by the exit handler
constexpr size_t kBufferBytes = 8 << 20;

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) {
      continue;
    }
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    char line[96];
    std::snprintf(line, sizeof line, " block=%dx%dx%d smem=%d", k->blockX, k->blockY, k->blockZ,
                  k->staticSharedMemory + k->dynamicSharedMemory);
    g_keys->insert(std::string(k->name ? k->name : "?") + line);
  }
  std::free(buffer);
}

void AtExit() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char* path = std::getenv("KVF_KERNEL_LOG");
  if (path == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mu);
  if (FILE* f = std::fopen(path, "a")) {
    for (const std::string& k : *g_keys) std::fprintf(f, "%s\n", k.c_str());
    std::fclose(f);
  }
}

}  // namespace

extern "C" int InitializeInjection() {
  g_keys = new std::set<std::string>();
  if (cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted) != CUPTI_SUCCESS) return 0;
  if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return 0;
  std::atexit(AtExit);
  return 1;
}
