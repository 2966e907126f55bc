// Copyright kvferry authors. Apache-2.0.
// Small out-of-line pieces of the public headers: names, Status formatting, TensorView, Stats JSON.
#include <sstream>

#include "kvferry/config.h"
#include "kvferry/stats.h"
#include "kvferry/status.h"
#include "kvferry/tensor.h"

namespace kvferry {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kFailedPrecondition: return "failed precondition";
    case StatusCode::kCorruptData: return "corrupt data";
    case StatusCode::kUnimplemented: return "unimplemented";
    case StatusCode::kResourceExhausted: return "resource exhausted";
    case StatusCode::kIoError: return "i/o error";
    case StatusCode::kDeviceError: return "device error";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string s(StatusCodeName(code_));
  s += ": ";
  s += message_;
  return s;
}

namespace {
// An enum's name from its table, the values in order from 0 (each enum above numbers them so);
// "?" for a value outside it (a cast from a bad integer).
template <class E, size_t N>
const char* NameIn(E value, const char* const (&names)[N]) {
  const auto i = static_cast<size_t>(value);
  return i < N ? names[i] : "?";
}
}  // namespace

const char* DTypeName(DType dtype) { return NameIn(dtype, {"f32", "bf16", "f16"}); }
const char* RouteName(Route route) { return NameIn(route, {"auto", "gpu", "cpu"}); }
const char* BackendName(Backend backend) { return NameIn(backend, {"auto", "cuda", "host"}); }

TensorView TensorView::Contiguous(void* data, DType dtype, MemoryKind where,
                                  std::initializer_list<int64_t> shape) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.where = where;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride_expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != stride_expected) return false;
    stride_expected *= shape[d];
  }
  return true;
}

std::string Stats::ToJson() const {
  std::ostringstream os;
  char sep = '{';
  ForEachField([&](const char* name, auto value) {
    os << sep << '"' << name << "\":" << value;
    sep = ',';
  });
  os << '}';
  return os.str();
}

}  // namespace kvferry
