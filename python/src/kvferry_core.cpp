// Copyright kvferry authors. Apache-2.0.
// kvferry._core: the nanobind extension behind the `kvferry` Python package. It binds the public
// C++ API (include/kvferry/) one to one; the package's __init__.py adds the torch conveniences
// (allocating outputs, torch's current CUDA stream). Tensors arrive as DLPack / buffer-protocol
// arrays (torch, numpy, cupy, ...) and are passed to the runtime as TensorViews over the same
// memory: no copy. The GIL is released while the runtime works.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <limits>
#include <typeinfo>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/kvferry.h"

namespace nb = nanobind;

namespace kvferry::python {
namespace {

// Raises the Python exception that matches \p st: ValueError for the caller's mistakes,
// MemoryError for exhausted capacity, RuntimeError otherwise; the message is Status::ToString().
void Raise(const Status& st) {
  PyObject* type = PyExc_RuntimeError;
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kCorruptData:
      type = PyExc_ValueError;
      break;
    case StatusCode::kResourceExhausted:
      type = PyExc_MemoryError;
      break;
    default:
      break;
  }
  PyErr_SetString(type, st.ToString().c_str());
  throw nb::python_error();
}
void Check(const Status& st) {
  if (!st.ok()) Raise(st);
}

[[noreturn]] void BadTensor(const std::string& message) { throw nb::value_error(message.c_str()); }

std::string ShapeOf(const nb::ndarray<>& a) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < a.ndim(); ++i) os << (i ? ", " : "") << a.shape(i);
  os << (a.ndim() == 1 ? ",)" : ")");
  return os.str();
}

// The name torch and numpy give a DLPack dtype ("float64", "int32", "bool", ...).
std::string DTypeNameOf(const nb::dlpack::dtype& dt) {
  using Code = nb::dlpack::dtype_code;
  std::string base;
  switch (static_cast<Code>(dt.code)) {
    case Code::Int: base = "int"; break;
    case Code::UInt: base = "uint"; break;
    case Code::Float: base = "float"; break;
    case Code::Bfloat: base = "bfloat"; break;
    case Code::Complex: base = "complex"; break;
    case Code::Bool: return dt.lanes == 1 ? "bool" : "bool x" + std::to_string(dt.lanes);
    default:  // float8/float6/float4 formats and codes newer than this file
      return "of DLPack type code " + std::to_string(int(dt.code)) + " (" +
             std::to_string(int(dt.bits)) + " bits)";
  }
  std::string s = base + std::to_string(int(dt.bits));
  if (dt.lanes != 1) s += " x" + std::to_string(int(dt.lanes));
  return s;
}

// A TensorView over \p a, which must be [d0, d1, d2] with the dims named in \p dims, of f32, bf16
// or f16, on the CPU or a CUDA device, innermost dimension contiguous. \p name names the argument
// in errors.
TensorView ViewOf(const nb::ndarray<>& a, const char* name, const char* dims,
                  int64_t d1, int64_t d2) {
  if (a.ndim() != 3) {
    BadTensor(std::string(name) + ": expected 3 dimensions " + dims + ", got shape " + ShapeOf(a));
  }
  if (a.shape(1) != static_cast<size_t>(d1) || a.shape(2) != static_cast<size_t>(d2)) {
    std::ostringstream os;
    os << name << ": expected shape " << dims << " with " << d1 << " heads of " << d2
       << ", got " << ShapeOf(a);
    BadTensor(os.str());
  }
  TensorView v;
  const nb::dlpack::dtype dt = a.dtype();
  if (dt == nb::dtype<float>()) {
    v.dtype = DType::kF32;
  } else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16 &&
             dt.lanes == 1) {
    v.dtype = DType::kBF16;
  } else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16 &&
             dt.lanes == 1) {
    v.dtype = DType::kF16;
  } else {
    BadTensor(std::string(name) + ": dtype " + DTypeNameOf(dt) +
              " is not supported: use float32, float16 or bfloat16");
  }
  if (a.device_type() == nb::device::cpu::value) {
    v.where = MemoryKind::kHost;
  } else if (a.device_type() == nb::device::cuda::value) {
    v.where = MemoryKind::kDevice;
  } else {
    BadTensor(std::string(name) + ": tensor must be on the CPU or a CUDA device (got DLPack device "
              "type " + std::to_string(a.device_type()) + ")");
  }
  if (a.shape(2) > 1 && a.stride(2) != 1) {
    BadTensor(std::string(name) + ": the innermost dimension must be contiguous (stride 1), got " +
              std::to_string(a.stride(2)) + "; call .contiguous()");
  }
  v.data = a.data();
  v.ndim = 3;
  for (int i = 0; i < 3; ++i) {
    v.shape[i] = static_cast<int64_t>(a.shape(i));
    v.stride[i] = a.shape(i) > 1 ? static_cast<int64_t>(a.stride(i)) : 0;
  }
  v.stride[2] = 1;
  // Strides of size-1 dimensions are free in DLPack; give them the contiguous value.
  if (v.shape[1] <= 1) v.stride[1] = v.shape[2];
  if (v.shape[0] <= 1) v.stride[0] = v.shape[1] * v.stride[1];
  return v;
}

void RequireRows(const TensorView& v, const char* name, int64_t rows, const char* what) {
  if (v.shape[0] != rows) {
    std::ostringstream os;
    os << name << ": " << v.shape[0] << " rows, but " << what << " has " << rows;
    BadTensor(os.str());
  }
}

StreamHandle StreamOf(uintptr_t stream) { return reinterpret_cast<StreamHandle>(stream); }

// The fields of the package's RuntimeConfig dataclass, the one table of them: ConfigFromDict reads
// these and refuses any other name, and python/tests/test_binding.py checks that the dataclass has
// exactly these fields (config_fields()).
constexpr const char* kConfigFields[] = {
    "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "kv_dtype", "softmax_scale",
    "layer_window",
    "max_sequences", "max_tokens_per_sequence", "max_batch", "max_prefill_chunk",
    "max_host_bytes", "host_bytes_at_create", "gpu_bytes", "prefill_prefetch", "sink_tokens", "window_tokens",
    "bank_slots", "bank_map", "policy", "budget", "budget_fraction", "params", "weights_path",
    "route", "backend", "device_id", "cpu_threads", "probe_at_start", "async_cpu",
    "xl_prefetch", "xl_prefetch_gap_us", "split_share", "split_min_us", "cpu_spin_us",
    "prime_path", "prime_eager", "shadow_scan_path", "cuda_prefill_paged"};

// RuntimeConfig from the package's RuntimeConfig dataclass (as a dict of its fields).
RuntimeConfig ConfigFromDict(const nb::dict& d) {
  RuntimeConfig c;
  // A field of the wrong Python type is a TypeError naming it and the type wanted (nanobind's own
  // failure is a bare std::bad_cast).
  auto wrong_type = [&](const char* k, const char* want) {
    const std::string type = nb::cast<std::string>(nb::type_name(d[k].type()));
    const std::string value = nb::cast<std::string>(nb::repr(d[k]));
    const char* article = std::string_view("aeiou").find(type.empty() ? 'x' : type[0]) !=
                                  std::string_view::npos
                              ? "an "
                              : "a ";
    throw nb::type_error((std::string(k) + " must be " + want + " (got " + value + ", " + article +
                          type + ")")
                             .c_str());
  };
  // An int field; a value its C++ type cannot hold is a ValueError naming the field, the value and
  // the range (not a silent truncation).
  auto get_int = [&](const char* k, auto& field) {
    if (!d.contains(k)) return;
    using T = std::remove_reference_t<decltype(field)>;
    const nb::object h = d[k];
    // Python ints, bools and integer scalars (numpy's, via __index__); not floats.
    if (!PyIndex_Check(h.ptr())) wrong_type(k, "an int");
    const nb::object i = nb::steal(PyNumber_Index(h.ptr()));
    if (!i.is_valid()) throw nb::python_error();
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
    if (overflow != 0 || x < static_cast<long long>(std::numeric_limits<T>::min()) ||
        x > static_cast<long long>(std::numeric_limits<T>::max())) {
      const std::string got = nb::cast<std::string>(nb::str(h));
      std::ostringstream os;
      os << k << " must be in [" << static_cast<long long>(std::numeric_limits<T>::min()) << ", "
         << static_cast<long long>(std::numeric_limits<T>::max()) << "] (got " << got << ")";
      throw nb::value_error(os.str().c_str());
    }
    field = static_cast<T>(x);
  };
  // A float, bool or string field (want names the type).
  auto get_as = [&](const char* k, auto& field, const char* want) {
    if (!d.contains(k)) return false;
    try {
      field = nb::cast<std::remove_reference_t<decltype(field)>>(d[k]);
    } catch (const std::bad_cast&) {
      wrong_type(k, want);
    }
    return true;
  };
  auto get_dtype = [&](const char* k, DType& field) {
    std::string s;
    if (!get_as(k, s, "a str")) return;
    if (s == "bf16" || s == "bfloat16") {
      field = DType::kBF16;
    } else if (s == "f16" || s == "float16") {
      field = DType::kF16;
    } else {
      throw nb::value_error(("kv_dtype must be 'bf16' or 'f16' (got '" + s + "')").c_str());
    }
  };
  for (auto [key, value] : d) {
    const std::string k = nb::cast<std::string>(key);
    bool known = false;
    for (const char* n : kConfigFields) known |= k == n;
    if (!known) throw nb::value_error(("unknown configuration field '" + k + "'").c_str());
  }
  get_int("num_layers", c.model.num_layers);
  get_int("num_q_heads", c.model.num_q_heads);
  get_int("num_kv_heads", c.model.num_kv_heads);
  get_int("head_dim", c.model.head_dim);
  get_dtype("kv_dtype", c.model.kv_dtype);
  get_as("softmax_scale", c.model.softmax_scale, "a float");
  // Per-layer attention types: a list of ints (0 global, w > 0 a sliding window of w tokens),
  // one per layer, or empty / None (every layer global); the Runtime checks the values.
  if (d.contains("layer_window") && !d["layer_window"].is_none()) {
    const nb::object lw = d["layer_window"];
    if (!PySequence_Check(lw.ptr()) || nb::isinstance<nb::str>(lw)) {
      wrong_type("layer_window", "a list of int (0: global, w > 0: a sliding window of w tokens)");
    }
    const Py_ssize_t n = PySequence_Size(lw.ptr());
    if (n < 0) throw nb::python_error();
    for (Py_ssize_t i = 0; i < n; ++i) {
      const nb::object e = nb::steal(PySequence_GetItem(lw.ptr(), i));
      if (!e.is_valid()) throw nb::python_error();
      if (!PyIndex_Check(e.ptr()) || PyBool_Check(e.ptr())) {
        throw nb::type_error(("layer_window[" + std::to_string(i) + "] must be an int (got " +
                              nb::cast<std::string>(nb::repr(e)) + ")").c_str());
      }
      const long long w = PyLong_AsLongLong(e.ptr());
      if (PyErr_Occurred() != nullptr) throw nb::python_error();
      if (w < std::numeric_limits<int>::min() || w > std::numeric_limits<int>::max()) {
        throw nb::value_error(("layer_window[" + std::to_string(i) + "] = " + std::to_string(w) +
                               " is out of range").c_str());
      }
      c.model.layer_window.push_back(static_cast<int>(w));
    }
  }
  get_int("max_sequences", c.capacity.max_sequences);
  get_int("max_tokens_per_sequence", c.capacity.max_tokens_per_sequence);
  get_int("max_batch", c.capacity.max_batch);
  get_int("max_prefill_chunk", c.capacity.max_prefill_chunk);
  get_int("max_host_bytes", c.capacity.max_host_bytes);
  get_int("host_bytes_at_create", c.capacity.host_bytes_at_create);
  get_int("gpu_bytes", c.capacity.gpu_bytes);
  get_as("prefill_prefetch", c.capacity.prefill_prefetch, "a bool");
  get_int("sink_tokens", c.tiers.sink_tokens);
  get_int("window_tokens", c.tiers.window_tokens);
  get_int("bank_slots", c.tiers.bank_slots);
  get_as("bank_map", c.tiers.bank_map, "a str");
  get_as("policy", c.policy.name, "a str");
  get_int("budget", c.policy.budget_tokens);
  get_as("budget_fraction", c.policy.budget_fraction, "a float");
  // The same budget rules as RuntimeConfig's validation, checked here so that the messages name
  // the Python fields (budget, budget_fraction) rather than C++'s budget_tokens.
  if (c.policy.budget_tokens < 0) {
    throw nb::value_error(
        ("budget must be >= 0 (got " + std::to_string(c.policy.budget_tokens) + ")").c_str());
  }
  if (!(c.policy.budget_fraction >= 0.0 && c.policy.budget_fraction <= 1.0)) {
    std::ostringstream os;
    os << "budget_fraction must be in [0, 1] (got " << c.policy.budget_fraction << ")";
    throw nb::value_error(os.str().c_str());
  }
  if (c.policy.name != "dense" && c.policy.budget_tokens == 0 && c.policy.budget_fraction == 0.0) {
    throw nb::value_error(("budget must be >= 1 for policy '" + c.policy.name +
                           "' (got 0), or set budget_fraction in (0, 1]")
                              .c_str());
  }
  if (d.contains("params") && !d["params"].is_none()) {
    if (!nb::isinstance<nb::dict>(d["params"])) wrong_type("params", "a dict of str to float");
    for (auto [pk, pv] : nb::borrow<nb::dict>(d["params"])) {
      std::string name;
      double value = 0;
      try {
        name = nb::cast<std::string>(pk);
        value = nb::cast<double>(pv);
      } catch (const std::bad_cast&) {
        throw nb::type_error(("params must map str to float (got " +
                              nb::cast<std::string>(nb::repr(pk)) + ": " +
                              nb::cast<std::string>(nb::repr(pv)) + ")").c_str());
      }
      c.policy.params[name] = value;
    }
  }
  get_as("weights_path", c.policy.weights_path, "a str");
  if (std::string s; get_as("route", s, "a str")) {
    if (s == "auto") c.route = Route::kAuto;
    else if (s == "gpu") c.route = Route::kGpu;
    else if (s == "cpu") c.route = Route::kCpu;
    else throw nb::value_error(("route must be 'auto', 'gpu' or 'cpu' (got '" + s + "')").c_str());
  }
  if (std::string s; get_as("backend", s, "a str")) {
    if (s == "auto") c.backend = Backend::kAuto;
    else if (s == "cuda") c.backend = Backend::kCuda;
    else if (s == "host") c.backend = Backend::kHost;
    else throw nb::value_error(("backend must be 'auto', 'cuda' or 'host' (got '" + s + "')").c_str());
  }
  get_int("device_id", c.device_id);
  get_int("cpu_threads", c.cpu_threads);
  get_as("probe_at_start", c.probe_at_start, "a bool");
  get_int("async_cpu", c.async_cpu);
  get_int("xl_prefetch", c.xl_prefetch);
  get_as("xl_prefetch_gap_us", c.xl_prefetch_gap_us, "a float");
  get_as("split_share", c.split_share, "a float");
  get_as("split_min_us", c.split_min_us, "a float");
  get_int("cpu_spin_us", c.cpu_spin_us);
  // The reference paths (RuntimeConfig::paths; docs/runtime.md, "Reference paths").
  auto get_path = [&](const char* k, PathChoice& field) {
    std::string s;
    if (!get_as(k, s, "a str")) return;
    if (s == "auto") field = PathChoice::kAuto;
    else if (s == "host") field = PathChoice::kHost;
    else if (s == "device") field = PathChoice::kDevice;
    else throw nb::value_error((std::string(k) + " must be 'auto', 'host' or 'device' (got '" + s + "')").c_str());
  };
  get_path("prime_path", c.paths.prime);
  get_as("prime_eager", c.paths.prime_eager, "a bool");
  get_path("shadow_scan_path", c.paths.shadow_scan);
  get_as("cuda_prefill_paged", c.paths.cuda_prefill_paged, "a bool");
  return c;
}

nb::dict StatsDict(const Stats& s) {
  nb::dict d;
  s.ForEachField([&](const char* name, auto value) { d[name] = value; });
  return d;
}

// The runtime as Python sees it. Calls are checked here (shapes, dtypes, devices, with the
// argument named), then run without the GIL.
class PyRuntime {
 public:
  explicit PyRuntime(const nb::dict& config) {
    const RuntimeConfig c = ConfigFromDict(config);
    Result<std::unique_ptr<Runtime>> rt = [&] {
      nb::gil_scoped_release release;
      return Runtime::Create(c);
    }();
    if (!rt.ok()) Raise(rt.status());
    rt_ = std::move(rt).value();
  }

  void AddSequence(SequenceId seq) { Check(rt_->AddSequence(seq)); }
  void RemoveSequence(SequenceId seq) {
    nb::gil_scoped_release release;
    const Status st = rt_->RemoveSequence(seq);
    nb::gil_scoped_acquire acquire;
    Check(st);
  }
  int64_t SequenceLength(SequenceId seq, int layer) {
    Result<int64_t> n = rt_->SequenceLength(seq, layer);
    if (!n.ok()) Raise(n.status());
    return *n;
  }

  void Prefill(SequenceId seq, int layer, const nb::ndarray<>& q, const nb::ndarray<>& k,
               const nb::ndarray<>& v, const nb::ndarray<>& out, uintptr_t stream) {
    const ModelShape& m = rt_->config().model;
    const TensorView qv = ViewOf(q, "q", "[T, num_q_heads, head_dim]", m.num_q_heads, m.head_dim);
    const TensorView kv = ViewOf(k, "k", "[T, num_kv_heads, head_dim]", m.num_kv_heads, m.head_dim);
    const TensorView vv = ViewOf(v, "v", "[T, num_kv_heads, head_dim]", m.num_kv_heads, m.head_dim);
    const TensorView ov = ViewOf(out, "out", "[T, num_q_heads, head_dim]", m.num_q_heads, m.head_dim);
    RequireRows(kv, "k", qv.shape[0], "q");
    RequireRows(vv, "v", qv.shape[0], "q");
    RequireRows(ov, "out", qv.shape[0], "q");
    Status st;
    {
      nb::gil_scoped_release release;
      st = rt_->Prefill(seq, layer, qv, kv, vv, ov, StreamOf(stream));
    }
    Check(st);
  }

  void Append(SequenceId seq, int layer, const nb::ndarray<>& k, const nb::ndarray<>& v,
              uintptr_t stream) {
    const ModelShape& m = rt_->config().model;
    const TensorView kv = ViewOf(k, "k", "[T, num_kv_heads, head_dim]", m.num_kv_heads, m.head_dim);
    const TensorView vv = ViewOf(v, "v", "[T, num_kv_heads, head_dim]", m.num_kv_heads, m.head_dim);
    RequireRows(vv, "v", kv.shape[0], "k");
    Status st;
    {
      nb::gil_scoped_release release;
      st = rt_->Append(seq, layer, kv, vv, StreamOf(stream));
    }
    Check(st);
  }

  void Decode(const std::vector<SequenceId>& seqs, int layer, const nb::ndarray<>& q,
              const nb::ndarray<>& k, const nb::ndarray<>& v, const nb::ndarray<>& out,
              uintptr_t stream) {
    const ModelShape& m = rt_->config().model;
    const TensorView qv = ViewOf(q, "q", "[B, num_q_heads, head_dim]", m.num_q_heads, m.head_dim);
    const TensorView kv = ViewOf(k, "k", "[B, num_kv_heads, head_dim]", m.num_kv_heads, m.head_dim);
    const TensorView vv = ViewOf(v, "v", "[B, num_kv_heads, head_dim]", m.num_kv_heads, m.head_dim);
    const TensorView ov = ViewOf(out, "out", "[B, num_q_heads, head_dim]", m.num_q_heads, m.head_dim);
    const int64_t b = static_cast<int64_t>(seqs.size());
    RequireRows(qv, "q", b, "the batch of sequences");
    RequireRows(kv, "k", b, "the batch of sequences");
    RequireRows(vv, "v", b, "the batch of sequences");
    RequireRows(ov, "out", b, "the batch of sequences");
    Status st;
    {
      nb::gil_scoped_release release;
      st = rt_->Decode(seqs, layer, qv, kv, vv, ov, StreamOf(stream));
    }
    Check(st);
  }

  void PlanDecode(const std::vector<SequenceId>& seqs, uintptr_t stream) {
    Status st;
    {
      nb::gil_scoped_release release;
      st = rt_->PlanDecode(seqs, StreamOf(stream));
    }
    Check(st);
  }

  std::vector<int32_t> LastSelection(SequenceId seq, int layer, int kv_head) {
    Result<std::vector<int32_t>> r = [&] {
      nb::gil_scoped_release release;
      return rt_->LastSelection(seq, layer, kv_head);
    }();
    if (!r.ok()) Raise(r.status());
    return std::move(r).value();
  }

  void Synchronize() {
    Status st;
    {
      nb::gil_scoped_release release;
      st = rt_->Synchronize();
    }
    Check(st);
  }
  nb::dict GetStats() const { return StatsDict(rt_->GetStats()); }
  // Runtime::device_memory: {"parts": {name: bytes, ...} (largest first), "total_bytes",
  // "cap_bytes", "bank_slots", "layer_bytes": [bytes of each layer's K and V rows]}.
  nb::dict DeviceMemory() const {
    const DeviceMemoryPlan& plan = rt_->device_memory();
    nb::dict parts;
    for (const DeviceMemoryPlan::Part& p : plan.parts) parts[p.name.c_str()] = p.bytes;
    nb::dict d;
    d["parts"] = parts;
    d["total_bytes"] = plan.total_bytes;
    d["cap_bytes"] = plan.cap_bytes;
    d["bank_slots"] = plan.bank_slots;
    nb::list layer_bytes;
    for (int64_t b : plan.layer_bytes) layer_bytes.append(b);
    d["layer_bytes"] = layer_bytes;
    return d;
  }
  std::string StatsJson() const { return rt_->GetStats().ToJson(); }
  void ResetStats() { rt_->ResetStats(); }
  void TimeDeviceSelect(bool on) { Check(rt_->TimeDeviceSelect(on)); }
  std::string BackendName() const { return kvferry::BackendName(rt_->backend()); }
  bool CaptureSafe() const { return rt_->decode_is_capture_safe(); }

 private:
  std::unique_ptr<Runtime> rt_;
};

}  // namespace
}  // namespace kvferry::python

NB_MODULE(_core, m) {
  using kvferry::python::PyRuntime;
  m.doc() = "kvferry's compiled core: the C++ Runtime bound one to one (use the kvferry package).";
  m.def("cuda_available", &kvferry::CudaAvailable,
        "Whether this build has the CUDA backend and a usable GPU.");
  m.def("policy_names", &kvferry::PolicyNames, "Names of the selection policies.");
  m.def(
      "config_fields",
      [] { return std::vector<std::string>(std::begin(kvferry::python::kConfigFields), std::end(kvferry::python::kConfigFields)); },
      "The RuntimeConfig fields the core reads (the one table the dataclass is checked against).");
  nb::class_<PyRuntime>(m, "Runtime")
      .def(nb::init<const nb::dict&>(), nb::arg("config"),
           "Creates a runtime from a dict of RuntimeConfig fields (see kvferry.RuntimeConfig).")
      .def("add_sequence", &PyRuntime::AddSequence, nb::arg("seq"))
      .def("remove_sequence", &PyRuntime::RemoveSequence, nb::arg("seq"))
      .def("sequence_length", &PyRuntime::SequenceLength, nb::arg("seq"), nb::arg("layer"))
      .def("prefill", &PyRuntime::Prefill, nb::arg("seq"), nb::arg("layer"), nb::arg("q"),
           nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("stream") = 0)
      .def("append", &PyRuntime::Append, nb::arg("seq"), nb::arg("layer"), nb::arg("k"),
           nb::arg("v"), nb::arg("stream") = 0)
      .def("decode", &PyRuntime::Decode, nb::arg("seqs"), nb::arg("layer"), nb::arg("q"),
           nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("stream") = 0)
      .def("plan_decode", &PyRuntime::PlanDecode, nb::arg("seqs"), nb::arg("stream") = 0)
      .def("last_selection", &PyRuntime::LastSelection, nb::arg("seq"), nb::arg("layer"),
           nb::arg("kv_head"))
      .def("synchronize", &PyRuntime::Synchronize)
      .def("stats", &PyRuntime::GetStats)
      .def("stats_json", &PyRuntime::StatsJson)
      .def("device_memory", &PyRuntime::DeviceMemory,
           "The device memory reserved at creation, part by part (Runtime::device_memory).")
      .def("reset_stats", &PyRuntime::ResetStats)
      .def("time_device_select", &PyRuntime::TimeDeviceSelect, nb::arg("on"))
      .def_prop_ro("backend", &PyRuntime::BackendName)
      .def_prop_ro("decode_is_capture_safe", &PyRuntime::CaptureSafe);
}
