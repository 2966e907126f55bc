// Copyright kvferry authors. Apache-2.0.
#include "examples/llama/matmul.h"

#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include "runtime/check.h"

namespace kvferry::llama {

struct Matmul::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // Shapes repeat (decode: m = 1; prefill: the chunk size), so primitives are built once.
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<dnnl::matmul, dnnl::matmul::primitive_desc>>
      cache;
};

Matmul::Matmul() : impl_(std::make_unique<Impl>()) {}
Matmul::~Matmul() = default;

Status Matmul::Run(const float* x, int64_t m, const Matrix& w, float* y) {
  using dnnl::memory;
  const int64_t k = w.cols;
  const int64_t n = w.rows;
  KVF_CHECK_ARG(m > 0 && k > 0 && n > 0, "matmul: empty shape ", m, "x", k, "x", n);
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
