// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file args.h
/// \brief The command line of every kvferry tool (kvferry-e2e, kvferry-bench, kvferry-llama,
/// kvferry-embed): one parser, so that every tool answers a bad value, an unknown flag, --help or
/// an unwritable output path the same way.
///
///  - A bad value is a usage error (exit 2) naming the flag, the value and the accepted range:
///    "--steps abc: not a number (want a whole number in [1, 1000000])". Never an exception.
///  - "-h" / "--help" prints the usage on stdout and exits 0.
///  - An unknown flag is a usage error naming it (and the closest known flag, if one is close).
///  - Output paths are checked writable when the command line is parsed, before any work.
///  - A run that measured nothing exits 1 and says why (the tools' own job; CudaDeviceProblem
///    names the missing GPU or driver).
///
/// Depends on the C++ standard library only (and libdl for the CUDA driver probe): bench/,
/// examples/ and tests/ all link it (tools/common/tools_common.cmake).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvferry::tools {

/// Exit codes of every tool: 0 done, 1 the run failed or measured nothing, 2 usage error (found
/// before any work).
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// ---- values -----------------------------------------------------------------------------------

/// \p v as the user typed it for a message: control bytes escaped, cut at 64 characters, quoted
/// when it would not read as one word ("" -> '').
std::string Shown(std::string_view v);

/// "<flag> <shown value>: <why>".
std::string BadValue(std::string_view flag, std::string_view value, std::string_view why);

/// Why \p text is not a whole number in [lo, hi] (decimal digits, optional '-'), or "" if it is
/// (then *out is set). The problem starts with "not a number", "not a whole number",
/// "negative" or "out of range" and ends with the accepted range in parentheses.
std::string WholeProblem(std::string_view text, int64_t lo, int64_t hi, int64_t* out);

/// Why \p text is not a finite real in [lo, hi] (open at lo when \p lo_open), or "" if it is.
std::string RealProblem(std::string_view text, double lo, double hi, bool lo_open, double* out);

/// Splits a comma-separated list; "" and a list with an empty item or more than \p max_items
/// items are problems ("empty list", "empty item in the comma-separated list").
std::string SplitListProblem(std::string_view text, std::vector<std::string>* items,
                             size_t max_items = 64);

/// Why \p path cannot be written as an output file, or "": a folder, a missing folder, or a file
/// that does not open for writing (tried without truncating it; a file that did not exist is
/// created and removed again).
std::string WritableFileProblem(const std::string& path);

/// Why \p path cannot be read as an input file, or "".
std::string ReadableFileProblem(const std::string& path);

/// Why this machine has no usable CUDA device, or "" when the driver sees at least one. Asks the
/// driver itself (libcuda.so.1, loaded at run time), so that a machine without an NVIDIA driver
/// is told "no CUDA device found: no NVIDIA driver ..." rather than the CUDA runtime's "CUDA
/// driver version is insufficient". Every problem starts with "no CUDA device found".
std::string CudaDeviceProblem();

// ---- the parser -------------------------------------------------------------------------------

/// \brief What ArgParser::Parse found.
struct ParseResult {
  enum class Kind { kOk, kHelp, kError };
  Kind kind = Kind::kOk;
  std::string message;  ///< kError: the problem, naming the flag
  [[nodiscard]] bool ok() const { return kind == Kind::kOk; }
  [[nodiscard]] bool help() const { return kind == Kind::kHelp; }
};

/// \brief Flags declared once with their type, range, default and help; Parse checks them all.
///
/// A flag takes a value ("--steps 20" or "--steps=20") or none (a switch). A value flag's handler
/// gets the flag and the text and returns "" or the whole error message (BadValue). The typed
/// helpers (Whole, Real, WholeList, Choice, OutputFile, ...) write into the caller's variables and
/// show the variable's value at declaration as the default in the usage.
class ArgParser {
 public:
  using ValueHandler = std::function<std::string(const std::string& flag, const std::string& value)>;
  using SwitchHandler = std::function<std::string(const std::string& flag)>;

  /// \p tool: the program's name in messages ("kvferry-bench"); \p synopsis: the usage's first
  /// lines after "usage: <tool>" (e.g. "[options]\nAttention-level experiments ...").
  ArgParser(std::string tool, std::string synopsis);

  /// When false (kvferry-llama), a flag given twice is a usage error ("--context given twice");
  /// when true (the default) the last one wins. Flags declared repeatable always may repeat.
  void set_allow_repeats(bool allow) { allow_repeats_ = allow; }
  /// Replaces the generated usage text (a tool that groups its flags by hand).
  void set_usage(std::string text) { custom_usage_ = std::move(text); }
  /// Text printed after the flags in the generated usage (examples, exit codes).
  void set_epilog(std::string text) { epilog_ = std::move(text); }

  // Declarations. \p meta names the value in the usage ("N", "PATH"), \p help says what it does.
  ArgParser& Switch(const std::string& name, const std::string& help, bool* out);
  ArgParser& Switch(const std::string& name, const std::string& help, SwitchHandler on);
  /// A value flag with its own handler. \p value_may_start_with_dashes: a value such as "--x" is
  /// taken as the value (numbers, free text) rather than reported as a forgotten value.
  ArgParser& Value(const std::string& name, const std::string& meta, const std::string& help,
                   ValueHandler handler, bool value_may_start_with_dashes = false,
                   bool repeatable = false);
  /// A whole number in [lo, hi] into *out (int, int64_t, ...).
  template <typename T>
  ArgParser& Whole(const std::string& name, const std::string& help, T* out, int64_t lo, int64_t hi,
                   const std::string& meta = "N");
  /// A finite real in [lo, hi] ((lo, hi] when \p lo_open) into *out.
  ArgParser& Real(const std::string& name, const std::string& help, double* out, double lo,
                  double hi, bool lo_open = false, const std::string& meta = "X");
  /// Comma-separated whole numbers in [lo, hi] (at least one) into *out.
  template <typename T>
  ArgParser& WholeList(const std::string& name, const std::string& help, std::vector<T>* out,
                       int64_t lo, int64_t hi, const std::string& meta = "N[,N...]");
  /// Comma-separated reals in [lo, hi] into *out.
  ArgParser& RealList(const std::string& name, const std::string& help, std::vector<double>* out,
                      double lo, double hi, const std::string& meta = "X[,X...]");
  /// One of \p choices into *out.
  ArgParser& Choice(const std::string& name, const std::string& help, std::string* out,
                    std::vector<std::string> choices);
  /// Any text into *out (\p may_start_with_dashes: see Value).
  ArgParser& String(const std::string& name, const std::string& meta, const std::string& help,
                    std::string* out, bool may_start_with_dashes = false);
  /// An output file into *out, checked writable (WritableFileProblem) once the whole command
  /// line parsed, before the tool does any work.
  ArgParser& OutputFile(const std::string& name, const std::string& help, std::string* out,
                        const std::string& meta = "PATH");
  /// An input file into *out, checked readable once the whole command line parsed.
  ArgParser& InputFile(const std::string& name, const std::string& help, std::string* out,
                       const std::string& meta = "PATH");
  /// "NAME=VALUE" (repeatable), VALUE a finite real; \p on gets each pair.
  ArgParser& KeyReal(const std::string& name, const std::string& help,
                     std::function<void(const std::string& key, double value)> on);

  /// Parses argv[1, argc). Stops at the first problem; "-h"/"--help" ends the parse at once.
  ParseResult Parse(int argc, const char* const* argv);
  /// Whether \p name was on the command line of the last Parse.
  [[nodiscard]] bool given(const std::string& name) const;

  /// The usage text (generated from the declarations unless set_usage replaced it).
  [[nodiscard]] std::string Usage() const;
  /// Parse, then: help -> usage on \p out, returns kExitOk; error -> "<tool>: <message>" and a hint
  /// on \p err, returns kExitUsage; ok -> returns -1 (go on).
  int ParseAndReport(int argc, const char* const* argv, std::FILE* out = stdout,
                     std::FILE* err = stderr);
  /// "<tool>: <message>\n(<tool> --help lists the options)\n" on \p err; returns kExitUsage.
  int ReportUsageError(const std::string& message, std::FILE* err = stderr) const;
  [[nodiscard]] const std::string& tool() const { return tool_; }

 private:
  struct Spec {
    std::string name, meta, help, range, default_value;
    bool takes_value = false;
    bool dashes_ok = false;
    bool repeatable = false;
    ValueHandler on_value;
    SwitchHandler on_switch;
    std::function<std::string()> after;  // a check once the whole command line parsed
  };
  Spec& Add(const std::string& name);
  [[nodiscard]] const Spec* Find(const std::string& name) const;
  [[nodiscard]] std::string Closest(const std::string& name) const;

  std::string tool_, synopsis_, custom_usage_, epilog_;
  bool allow_repeats_ = true;
  std::vector<Spec> specs_;
  std::vector<std::string> given_;
};

/// The range as the usage and the messages write it: "[1, 1000000]".
std::string RangeText(int64_t lo, int64_t hi);
std::string RangeText(double lo, double hi, bool lo_open);

template <typename T>
ArgParser& ArgParser::Whole(const std::string& name, const std::string& help, T* out, int64_t lo,
                            int64_t hi, const std::string& meta) {
  static_assert(std::is_integral_v<T>);
  if constexpr (std::cmp_less(std::numeric_limits<T>::max(), std::numeric_limits<int64_t>::max())) {
    hi = std::min<int64_t>(hi, static_cast<int64_t>(std::numeric_limits<T>::max()));
  }
  if constexpr (std::is_signed_v<T>) {
    lo = std::max<int64_t>(lo, static_cast<int64_t>(std::numeric_limits<T>::lowest()));
  } else {
    lo = std::max<int64_t>(lo, 0);
  }
  const std::string default_value = std::to_string(*out);
  Value(name, meta, help, [out, lo, hi](const std::string& flag, const std::string& text) {
    int64_t v = 0;
    const std::string problem = WholeProblem(text, lo, hi, &v);
    if (!problem.empty()) return BadValue(flag, text, problem);
    *out = static_cast<T>(v);
    return std::string();
  }, /*value_may_start_with_dashes=*/true);
  specs_.back().range = "whole number in " + RangeText(lo, hi);
  specs_.back().default_value = default_value;
  return *this;
}

/// Items of a list value, each checked by \p item (returns a problem or ""); the message names
/// the whole value and, for lists of several, the item.
std::string ListItemProblem(std::string_view flag, std::string_view text,
                            const std::function<std::string(const std::string& item)>& item);

template <typename T>
ArgParser& ArgParser::WholeList(const std::string& name, const std::string& help,
                                std::vector<T>* out, int64_t lo, int64_t hi,
                                const std::string& meta) {
  std::string default_value;
  for (const T& v : *out) {
    if (!default_value.empty()) default_value += ",";
    default_value += std::to_string(v);
  }
  Value(name, meta, help, [out, lo, hi](const std::string& flag, const std::string& text) {
    std::vector<T> values;
    const std::string problem = ListItemProblem(flag, text, [&](const std::string& item) {
      int64_t v = 0;
      std::string p = WholeProblem(item, lo, hi, &v);
      if (p.empty()) values.push_back(static_cast<T>(v));
      return p;
    });
    if (problem.empty()) *out = std::move(values);
    return problem;
  }, /*value_may_start_with_dashes=*/true);
  specs_.back().range = "whole numbers in " + RangeText(lo, hi);
  specs_.back().default_value = default_value;
  return *this;
}

}  // namespace kvferry::tools
