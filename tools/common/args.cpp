// Copyright kvferry authors. Apache-2.0.
#include "tools/common/args.h"

#include <dlfcn.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

namespace kvferry::tools {
namespace {

std::string Num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// Levenshtein distance, for "did you mean".
size_t Distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// "a, b or c".
std::string OneOf(const std::vector<std::string>& choices) {
  std::string out;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) out += i + 1 == choices.size() ? " or " : ", ";
    out += choices[i];
  }
  return out;
}

}  // namespace

std::string Shown(std::string_view v) {
  std::string out;
  for (char c : v.substr(0, 64)) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      out += "\\x";
      out += "0123456789abcdef"[u >> 4];
      out += "0123456789abcdef"[u & 15];
    } else {
      out += c;
    }
  }
  if (v.size() > 64) out += "...";
  if (out.empty() || out.find_first_of(" '\\") != std::string::npos) return "'" + out + "'";
  return out;
}

std::string BadValue(std::string_view flag, std::string_view value, std::string_view why) {
  std::string out(flag);
  out += " ";
  out += Shown(value);
  out += ": ";
  out += why;
  return out;
}

std::string RangeText(int64_t lo, int64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

std::string RangeText(double lo, double hi, bool lo_open) {
  std::string out = lo_open ? "(" : "[";
  out += Num(lo);
  out += ", ";
  out += Num(hi);
  out += "]";
  return out;
}

std::string WholeProblem(std::string_view text, int64_t lo, int64_t hi, int64_t* out) {
  const std::string want = "want a whole number in " + RangeText(lo, hi);
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(begin, end, v);
  if (ptr == end && ec == std::errc::result_out_of_range) {
    return std::string(text[0] == '-' ? "negative and " : "") + "out of range (" + want + ")";
  }
  if (ec != std::errc() || ptr != end) {
    // "1.5", "1e3", "1e400": numbers, but not whole ones written in plain digits.
    double d = 0;
    const auto [dptr, dec] = std::from_chars(begin, end, d);
    if (dptr == end && dec == std::errc::result_out_of_range) return "out of range (" + want + ")";
    if (dptr == end && dec == std::errc() && std::isfinite(d)) {
      return "not a whole number (" + want + ")";
    }
    return "not a number (" + want + ")";
  }
  if (v < lo || v > hi) return std::string(v < 0 ? "negative" : "out of range") + " (" + want + ")";
  *out = v;
  return "";
}

std::string RealProblem(std::string_view text, double lo, double hi, bool lo_open, double* out) {
  const std::string want = "want a number in " + RangeText(lo, hi, lo_open);
  const char* end = text.data() + text.size();
  double v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ptr == end && ec == std::errc::result_out_of_range) return "out of range (" + want + ")";
  if (ec != std::errc() || ptr != end) return "not a number (" + want + ")";
  if (!std::isfinite(v)) return "not a finite number (" + want + ")";
  if (v < lo || v > hi || (lo_open && v == lo)) {
    return std::string(v < 0 && lo >= 0 ? "negative" : "out of range") + " (" + want + ")";
  }
  *out = v;
  return "";
}

std::string SplitListProblem(std::string_view text, std::vector<std::string>* items,
                             size_t max_items) {
  items->clear();
  if (text.empty()) return "empty list";
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string_view item =
        text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (item.empty()) return "empty item in the comma-separated list";
    items->emplace_back(item);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  if (items->size() > max_items) return "more than " + std::to_string(max_items) + " items";
  return "";
}

std::string ListItemProblem(std::string_view flag, std::string_view text,
                            const std::function<std::string(const std::string& item)>& item) {
  std::vector<std::string> items;
  const std::string split = SplitListProblem(text, &items);
  if (!split.empty()) return BadValue(flag, text, split);
  for (const std::string& one : items) {
    const std::string problem = item(one);
    if (problem.empty()) continue;
    if (items.size() == 1) return BadValue(flag, text, problem);
    return BadValue(flag, text, "item " + Shown(one) + " " + problem);
  }
  return "";
}

std::string WritableFileProblem(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return "empty path";
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) return "is a folder, not a file";
  const fs::path parent = p.parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec)) {
    return "folder " + parent.string() + " does not exist";
  }
  const bool existed = fs::exists(fs::symlink_status(p, ec));
  std::FILE* f = std::fopen(path.c_str(), "a");  // appends nothing; never truncates
  if (f == nullptr) return std::string("cannot be written: ") + std::strerror(errno);
  std::fclose(f);
  if (!existed) fs::remove(p, ec);
  return "";
}

std::string ReadableFileProblem(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return "is a folder, not a file";
  std::ifstream in(path, std::ios::binary);
  if (!in) return "cannot open the file";
  return "";
}

std::string CudaDeviceProblem() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return "no CUDA device found: no NVIDIA driver on this machine (libcuda.so.1 does not load)";
  }
  // Left loaded: the CUDA runtime of the same process uses the same driver.
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  using ErrorFn = int (*)(int, const char**);
  const auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
  const auto count = reinterpret_cast<CountFn>(dlsym(lib, "cuDeviceGetCount"));
  const auto error = reinterpret_cast<ErrorFn>(dlsym(lib, "cuGetErrorString"));
  if (init == nullptr || count == nullptr) {
    return "no CUDA device found: libcuda.so.1 lacks cuInit (not an NVIDIA driver?)";
  }
  const auto why = [&](int rc) {
    const char* s = nullptr;
    if (error != nullptr) error(rc, &s);
    return std::string(s != nullptr ? s : "error") + " (CUDA driver error " + std::to_string(rc) + ")";
  };
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string visible_note =
      visible != nullptr ? std::string("; CUDA_VISIBLE_DEVICES is '") + visible + "'" : "";
  constexpr int kNoDevice = 100;  // CUDA_ERROR_NO_DEVICE
  const int rc = init(0);
  if (rc == kNoDevice) return "no CUDA device found: the NVIDIA driver sees no GPU" + visible_note;
  if (rc != 0) return "no CUDA device found: the NVIDIA driver did not start: " + why(rc);
  int n = 0;
  const int rc2 = count(&n);
  if (rc2 != 0) return "no CUDA device found: " + why(rc2);
  if (n <= 0) return "no CUDA device found: the NVIDIA driver sees no GPU" + visible_note;
  return "";
}

// ---- ArgParser ----------------------------------------------------------------------------------

ArgParser::ArgParser(std::string tool, std::string synopsis)
    : tool_(std::move(tool)), synopsis_(std::move(synopsis)) {}

ArgParser::Spec& ArgParser::Add(const std::string& name) {
  specs_.emplace_back();
  specs_.back().name = name;
  return specs_.back();
}

const ArgParser::Spec* ArgParser::Find(const std::string& name) const {
  for (const Spec& s : specs_) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

std::string ArgParser::Closest(const std::string& name) const {
  std::string best;
  size_t best_d = 3;  // at most 2 edits away
  for (const Spec& s : specs_) {
    const size_t d = Distance(name, s.name);
    if (d < best_d) {
      best_d = d;
      best = s.name;
    }
  }
  return best;
}

ArgParser& ArgParser::Switch(const std::string& name, const std::string& help, bool* out) {
  return Switch(name, help, [out](const std::string&) {
    *out = true;
    return std::string();
  });
}

ArgParser& ArgParser::Switch(const std::string& name, const std::string& help, SwitchHandler on) {
  Spec& s = Add(name);
  s.help = help;
  s.on_switch = std::move(on);
  return *this;
}

ArgParser& ArgParser::Value(const std::string& name, const std::string& meta,
                            const std::string& help, ValueHandler handler,
                            bool value_may_start_with_dashes, bool repeatable) {
  Spec& s = Add(name);
  s.meta = meta;
  s.help = help;
  s.takes_value = true;
  s.dashes_ok = value_may_start_with_dashes;
  s.repeatable = repeatable;
  s.on_value = std::move(handler);
  return *this;
}

ArgParser& ArgParser::Real(const std::string& name, const std::string& help, double* out, double lo,
                           double hi, bool lo_open, const std::string& meta) {
  const std::string default_value = Num(*out);
  Value(name, meta, help, [out, lo, hi, lo_open](const std::string& flag, const std::string& text) {
    double v = 0;
    const std::string problem = RealProblem(text, lo, hi, lo_open, &v);
    if (!problem.empty()) return BadValue(flag, text, problem);
    *out = v;
    return std::string();
  }, /*value_may_start_with_dashes=*/true);
  specs_.back().range = "number in " + RangeText(lo, hi, lo_open);
  specs_.back().default_value = default_value;
  return *this;
}

ArgParser& ArgParser::RealList(const std::string& name, const std::string& help,
                               std::vector<double>* out, double lo, double hi,
                               const std::string& meta) {
  std::string default_value;
  for (double v : *out) {
    if (!default_value.empty()) default_value += ",";
    default_value += Num(v);
  }
  Value(name, meta, help, [out, lo, hi](const std::string& flag, const std::string& text) {
    std::vector<double> values;
    const std::string problem = ListItemProblem(flag, text, [&](const std::string& item) {
      double v = 0;
      std::string p = RealProblem(item, lo, hi, false, &v);
      if (p.empty()) values.push_back(v);
      return p;
    });
    if (problem.empty()) *out = std::move(values);
    return problem;
  }, /*value_may_start_with_dashes=*/true);
  specs_.back().range = "numbers in " + RangeText(lo, hi, false);
  specs_.back().default_value = default_value;
  return *this;
}

ArgParser& ArgParser::Choice(const std::string& name, const std::string& help, std::string* out,
                             std::vector<std::string> choices) {
  std::string meta;
  for (const std::string& c : choices) {
    if (!meta.empty()) meta += "|";
    meta += c;
  }
  const std::string default_value = *out;
  Value(name, meta, help, [out, choices](const std::string& flag, const std::string& text) {
    if (std::find(choices.begin(), choices.end(), text) == choices.end()) {
      return BadValue(flag, text, "want " + OneOf(choices));
    }
    *out = text;
    return std::string();
  });
  specs_.back().default_value = default_value;
  return *this;
}

ArgParser& ArgParser::String(const std::string& name, const std::string& meta,
                             const std::string& help, std::string* out, bool may_start_with_dashes) {
  const std::string default_value = *out;
  Value(name, meta, help, [out](const std::string&, const std::string& text) {
    *out = text;
    return std::string();
  }, may_start_with_dashes);
  specs_.back().default_value = default_value;
  return *this;
}

ArgParser& ArgParser::OutputFile(const std::string& name, const std::string& help,
                                 std::string* out, const std::string& meta) {
  String(name, meta, help, out);
  specs_.back().after = [name, out]() {
    const std::string problem = WritableFileProblem(*out);
    return problem.empty() ? std::string() : BadValue(name, *out, problem);
  };
  return *this;
}

ArgParser& ArgParser::InputFile(const std::string& name, const std::string& help, std::string* out,
                                const std::string& meta) {
  String(name, meta, help, out);
  specs_.back().after = [name, out]() {
    const std::string problem = ReadableFileProblem(*out);
    return problem.empty() ? std::string() : BadValue(name, *out, problem);
  };
  return *this;
}

ArgParser& ArgParser::KeyReal(const std::string& name, const std::string& help,
                              std::function<void(const std::string& key, double value)> on) {
  return Value(name, "NAME=VALUE", help,
               [on = std::move(on)](const std::string& flag, const std::string& text) {
                 const size_t eq = text.find('=');
                 if (eq == std::string::npos || eq == 0) return BadValue(flag, text, "want name=value");
                 const std::string key = text.substr(0, eq);
                 double v = 0;
                 const std::string problem = RealProblem(text.substr(eq + 1), -1e300, 1e300, false, &v);
                 if (!problem.empty()) return BadValue(flag + " " + key, text.substr(eq + 1), problem);
                 on(key, v);
                 return std::string();
               },
               /*value_may_start_with_dashes=*/false, /*repeatable=*/true);
}

bool ArgParser::given(const std::string& name) const {
  return std::find(given_.begin(), given_.end(), name) != given_.end();
}

ParseResult ArgParser::Parse(int argc, const char* const* argv) {
  given_.clear();
  const auto error = [](std::string m) {
    ParseResult r;
    r.kind = ParseResult::Kind::kError;
    r.message = std::move(m);
    return r;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i] != nullptr ? argv[i] : "";
    if (a == "-h" || a == "--help") {
      ParseResult r;
      r.kind = ParseResult::Kind::kHelp;
      return r;
    }
    if (a.size() < 2 || a[0] != '-') {
      return error("unexpected argument " + Shown(a) + " (options start with --)");
    }
    std::string name = a, inline_value;
    bool has_inline = false;
    if (a.rfind("--", 0) == 0) {
      const size_t eq = a.find('=');
      if (eq != std::string::npos) {
        name = a.substr(0, eq);
        inline_value = a.substr(eq + 1);
        has_inline = true;
      }
    }
    const Spec* spec = Find(name);
    if (spec == nullptr) {
      const std::string close = Closest(name);
      return error("unknown option " + Shown(name) +
                   (close.empty() ? "" : " (did you mean " + close + "?)"));
    }
    if (!allow_repeats_ && !spec->repeatable && given(name)) return error(name + " given twice");
    given_.push_back(name);
    if (!spec->takes_value) {
      if (has_inline) return error(name + " takes no value (got " + Shown(a) + ")");
      std::string m = spec->on_switch(name);
      if (!m.empty()) return error(std::move(m));
      continue;
    }
    std::string value;
    if (has_inline) {
      value = inline_value;
    } else {
      if (i + 1 >= argc || argv[i + 1] == nullptr) return error(name + " needs a value");
      value = argv[i + 1];
      if (!spec->dashes_ok && value.rfind("--", 0) == 0) {
        return error(name + " needs a value (got the flag " + Shown(value) + ")");
      }
      ++i;
    }
    std::string m = spec->on_value(name, value);
    if (!m.empty()) return error(std::move(m));
  }
  for (const Spec& s : specs_) {
    if (!s.after || !given(s.name)) continue;
    std::string m = s.after();
    if (!m.empty()) return error(std::move(m));
  }
  return {};
}

std::string ArgParser::Usage() const {
  if (!custom_usage_.empty()) return custom_usage_;
  std::string out = "usage: " + tool_;
  if (!synopsis_.empty() && synopsis_[0] != '\n') out += " ";
  out += synopsis_;
  if (!out.empty() && out.back() != '\n') out += "\n";
  out += "options:\n";
  const auto line = [&out](const std::string& left, const std::string& text) {
    constexpr size_t kColumn = 30;
    out += "  " + left;
    if (left.size() + 2 >= kColumn) {
      out += "\n" + std::string(kColumn, ' ');
    } else {
      out += std::string(kColumn - 2 - left.size(), ' ');
    }
    // Words wrapped at 100 columns, continued under the column.
    constexpr size_t kWidth = 100;
    size_t col = kColumn;
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find(' ', start);
      if (end == std::string::npos) end = text.size();
      const std::string word = text.substr(start, end - start);
      if (col > kColumn && col + 1 + word.size() > kWidth) {
        out += "\n" + std::string(kColumn, ' ');
        col = kColumn;
      } else if (col > kColumn) {
        out += " ";
        ++col;
      }
      out += word;
      col += word.size();
      start = end + 1;
    }
    out += "\n";
  };
  for (const Spec& s : specs_) {
    std::string text = s.help;
    std::string extra = s.range;
    const auto add = [&extra](const std::string& part) {
      if (!extra.empty()) extra += "; ";
      extra += part;
    };
    if (!s.default_value.empty()) add("default " + s.default_value);
    if (s.repeatable) add("repeatable");
    if (!extra.empty()) {
      if (!text.empty()) text += " ";
      text += "(" + extra + ")";
    }
    line(s.takes_value ? s.name + " " + s.meta : s.name, text);
  }
  line("-h, --help", "print this help and exit");
  if (!epilog_.empty()) {
    out += epilog_;
    if (out.back() != '\n') out += "\n";
  }
  out += "exit codes: 0 done, 1 the run failed or measured nothing, 2 usage error (found before any "
         "work)\n";
  return out;
}

int ArgParser::ReportUsageError(const std::string& message, std::FILE* err) const {
  std::fprintf(err, "%s: %s\n(%s --help lists the options)\n", tool_.c_str(), message.c_str(),
               tool_.c_str());
  return kExitUsage;
}

int ArgParser::ParseAndReport(int argc, const char* const* argv, std::FILE* out, std::FILE* err) {
  const ParseResult r = Parse(argc, argv);
  if (r.help()) {
    std::fputs(Usage().c_str(), out);
    return kExitOk;
  }
  if (!r.ok()) return ReportUsageError(r.message, err);
  return -1;
}

}  // namespace kvferry::tools
