// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/matmul.h"

#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <unordered_map>

#include "kvferry/status_macros.h"

#ifdef KVFERRY_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "examples/llama/device_floats.h"
#endif

namespace kvferry::llama {

struct Matmul::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // Shapes repeat (decode: m = 1; prefill: the chunk size), so primitives are built once.
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<dnnl::matmul, dnnl::matmul::primitive_desc>>
      cache;
#ifdef KVFERRY_WITH_CUDA
  bool gpu = false;
  cublasHandle_t handle = nullptr;
  cudaStream_t cuda_stream = nullptr;
  // Host weights -> device copy, uploaded at first use. Keyed by address and checked by size: a
  // matrix freed and another allocated at the same address with another shape is re-uploaded
  // (weights are assumed immutable while the Matmul uses them).
  struct DeviceWeights {
    float* dev = nullptr;
    size_t elems = 0;
  };
  std::unordered_map<const float*, DeviceWeights> weights;
  DeviceFloats dx, dy;  // Run's staging of x and y

  ~Impl() {
    for (auto& [host, dw] : weights) cudaFree(dw.dev);
    if (handle != nullptr) cublasDestroy(handle);
    if (cuda_stream != nullptr) cudaStreamDestroy(cuda_stream);
  }
  Status RunGpu(const float* x, int64_t m, const Matrix& w, float* y);
  Status DeviceWeightsOf(const Matrix& w, const float** dev);
  Status Gemm(const float* dx, int64_t m, const Matrix& w, const float* dw, float* dy);
#endif
};

#ifdef KVFERRY_WITH_CUDA
namespace {
Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return DeviceError(detail::StrCat("matmul: ", what, ": ", cudaGetErrorString(e)));
}
Status CublasStatus(cublasStatus_t e, const char* what) {
  if (e == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return DeviceError(detail::StrCat("matmul: ", what, " failed (cublas status ", static_cast<int>(e), ")"));
}
}  // namespace

Status Matmul::Impl::DeviceWeightsOf(const Matrix& w, const float** dev_out) {
  auto it = weights.find(w.data.data());
  if (it != weights.end() && it->second.elems != w.data.size()) {
    cudaFree(it->second.dev);
    weights.erase(it);
    it = weights.end();
  }
  if (it == weights.end()) {
    float* dev = nullptr;
    const size_t bytes = w.data.size() * sizeof(float);
    KVF_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&dev, bytes), "cudaMalloc weights"));
    // On the products' own stream: a cudaMemcpy from pageable memory returns once the bytes are
    // staged, before the DMA lands, and the non-blocking stream's GEMM is not ordered after the
    // legacy stream's copy (a loaded GPU then ran GEMMs over weights not yet written).
    KVF_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(dev, w.data.data(), bytes, cudaMemcpyHostToDevice, cuda_stream), "upload weights"));
    it = weights.emplace(w.data.data(), DeviceWeights{dev, w.data.size()}).first;
  }
  *dev_out = it->second.dev;
  return Status::Ok();
}

Status Matmul::Impl::Gemm(const float* dx, int64_t m, const Matrix& w, const float* dw, float* dy) {
  const int64_t k = w.cols, n = w.rows;
  // Row-major y[m,n] = x[m,k] W[n,k]^T is column-major y^T[n,m] = W^T^T x^T: W is a column-major
  // [k, n] matrix (ld k), used transposed; x is column-major [k, m] (ld k).
  const float one = 1.0f, zero = 0.0f;
  return CublasStatus(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                  static_cast<int>(k), &one, dw, static_cast<int>(k), dx, static_cast<int>(k),
                                  &zero, dy, static_cast<int>(n)),
                      "cublasSgemm");
}

Status Matmul::Impl::RunGpu(const float* x, int64_t m, const Matrix& w, float* y) {
  const int64_t k = w.cols, n = w.rows;
  const float* dw = nullptr;
  KVF_RETURN_IF_ERROR(DeviceWeightsOf(w, &dw));
  KVF_RETURN_IF_ERROR(dx.Reserve(static_cast<size_t>(m * k)));
  KVF_RETURN_IF_ERROR(dy.Reserve(static_cast<size_t>(m * n)));
  KVF_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(dx.p, x, m * k * sizeof(float), cudaMemcpyHostToDevice, cuda_stream), "copy x"));
  KVF_RETURN_IF_ERROR(Gemm(dx.p, m, w, dw, dy.p));
  KVF_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(y, dy.p, m * n * sizeof(float), cudaMemcpyDeviceToHost, cuda_stream), "copy y"));
  return CudaStatus(cudaStreamSynchronize(cuda_stream), "synchronize");
}
#endif

Status Matmul::EnableCuda(int device_id) {
#ifdef KVFERRY_WITH_CUDA
  KVF_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_id), "cudaSetDevice"));
  KVF_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&impl_->cuda_stream, cudaStreamNonBlocking),
                                 "cudaStreamCreate"));
  KVF_RETURN_IF_ERROR(CublasStatus(cublasCreate(&impl_->handle), "cublasCreate"));
  KVF_RETURN_IF_ERROR(CublasStatus(cublasSetStream(impl_->handle, impl_->cuda_stream), "cublasSetStream"));
  // Plain FP32 (no TF32), so that logits match the CPU path closely.
  KVF_RETURN_IF_ERROR(CublasStatus(cublasSetMathMode(impl_->handle, CUBLAS_PEDANTIC_MATH),
                                   "cublasSetMathMode"));
  impl_->gpu = true;
  return Status::Ok();
#else
  (void)device_id;
  return Unimplemented("matmul: built without CUDA");
#endif
}

Status Matmul::RunOnDevice(const float* x, int64_t m, const Matrix& w, float* y) {
  KVF_CHECK_ARG(m > 0 && w.cols > 0 && w.rows > 0, "matmul: empty shape ", m, "x", w.cols, "x", w.rows);
#ifdef KVFERRY_WITH_CUDA
  KVF_CHECK_CODE(impl_->gpu, StatusCode::kFailedPrecondition, "matmul: RunOnDevice before EnableCuda");
  const float* dw = nullptr;
  KVF_RETURN_IF_ERROR(impl_->DeviceWeightsOf(w, &dw));
  return impl_->Gemm(x, m, w, dw, y);
#else
  (void)x, (void)y;
  return Unimplemented("matmul: built without CUDA");
#endif
}

void* Matmul::cuda_stream() const {
#ifdef KVFERRY_WITH_CUDA
  return impl_->cuda_stream;
#else
  return nullptr;
#endif
}

bool Matmul::on_gpu() const {
#ifdef KVFERRY_WITH_CUDA
  return impl_->gpu;
#else
  return false;
#endif
}

Matmul::Matmul() : impl_(std::make_unique<Impl>()) {}
Matmul::~Matmul() = default;

Status Matmul::Run(const float* x, int64_t m, const Matrix& w, float* y) {
  using dnnl::memory;
  const int64_t k = w.cols;
  const int64_t n = w.rows;
  KVF_CHECK_ARG(m > 0 && k > 0 && n > 0, "matmul: empty shape ", m, "x", k, "x", n);
#ifdef KVFERRY_WITH_CUDA
  if (impl_->gpu) return impl_->RunGpu(x, m, w, y);
#endif
  try {
    auto key = std::make_tuple(m, k, n);
    auto it = impl_->cache.find(key);
    if (it == impl_->cache.end()) {
      memory::desc src_md({m, k}, memory::data_type::f32, memory::format_tag::ab);
      // W is [n, k] row-major, i.e. the [k, n] weights matrix in column-major ("ba") order.
      memory::desc wei_md({k, n}, memory::data_type::f32, memory::format_tag::ba);
      memory::desc dst_md({m, n}, memory::data_type::f32, memory::format_tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), impl_->engine);
      it = impl_->cache.emplace(key, std::make_pair(dnnl::matmul(pd), pd)).first;
    }
    const auto& pd = it->second.second;
    // oneDNN here runs on OpenMP, whose threads spin-wait against kvferry's TBB workers on the
    // same cores: a few-row product then costs a scheduler time slice (~8 ms on 2 cores)
    // instead of microseconds. Small products run on this thread alone.
    const bool small = m * k * n < (int64_t{1} << 22);
    const int threads = omp_get_max_threads();
    if (small) omp_set_num_threads(1);
    memory src(pd.src_desc(), impl_->engine, const_cast<float*>(x));
    memory wei(pd.weights_desc(), impl_->engine, const_cast<float*>(w.data.data()));
    memory dst(pd.dst_desc(), impl_->engine, y);
    it->second.first.execute(impl_->stream,
                             {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    impl_->stream.wait();
    if (small) omp_set_num_threads(threads);
  } catch (const dnnl::error& e) {
    return Internal(detail::StrCat("oneDNN matmul ", m, "x", k, "x", n, " failed: ", e.what()));
  }
  return Status::Ok();
}

}  // namespace kvferry::llama
