// Copyright kvferry authors. Apache-2.0.
// Engine::UseGpuDecode without CUDA: kUnimplemented (engine_gpu.cu is the CUDA build's).
#include "examples/llama/engine.h"

namespace kvferry::llama {

struct Engine::GpuDecode {};

void Engine::GpuDecodeDeleter::operator()(GpuDecode* g) const { delete g; }

Status Engine::UseGpuDecode() { return Unimplemented("gpu decode: built without CUDA"); }

void Engine::SetDecodeGraphs(bool) {}
int64_t Engine::decode_graph_steps() const { return 0; }
int64_t Engine::decode_graph_captures() const { return 0; }

Status Engine::EnqueueDecodeStep(int64_t, std::span<Attention* const>) {
  return Unimplemented("gpu decode: built without CUDA");
}

Status Engine::DecodeOnDevice(std::span<const int32_t>, int64_t, std::span<Attention* const>, float*) {
  return Unimplemented("gpu decode: built without CUDA");
}

}  // namespace kvferry::llama
