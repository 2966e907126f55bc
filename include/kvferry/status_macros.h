// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file status_macros.h
/// \brief Early-return helpers for code built on Status / Result<T> (kvferry's own sources, and
/// engines or examples that propagate kvferry's errors the same way).
#include <sstream>
#include <string>
#include <utility>

#include "kvferry/status.h"

namespace kvferry::detail {
/// Streams every argument into one string ("layer ", 3, " of ", 32).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace kvferry::detail

#define KVF_CONCAT_INNER(a, b) a##b
#define KVF_CONCAT(a, b) KVF_CONCAT_INNER(a, b)

/// Returns the Status of \p expr if it is an error.
#define KVF_RETURN_IF_ERROR(expr)                     \
  do {                                                \
    ::kvferry::Status kvf_status_ = (expr);           \
    if (!kvf_status_.ok()) return kvf_status_;        \
  } while (0)

/// Returns InvalidArgument("<message>") unless \p cond holds. Message parts are streamed.
#define KVF_CHECK_ARG(cond, ...)                                                    \
  do {                                                                              \
    if (!(cond)) return ::kvferry::InvalidArgument(::kvferry::detail::StrCat(__VA_ARGS__)); \
  } while (0)

/// Returns a Status of \p code unless \p cond holds.
#define KVF_CHECK_CODE(cond, code, ...)                                                  \
  do {                                                                                   \
    if (!(cond)) return ::kvferry::Status(code, ::kvferry::detail::StrCat(__VA_ARGS__)); \
  } while (0)

/// `KVF_ASSIGN_OR_RETURN(auto x, MakeX());`
#define KVF_ASSIGN_OR_RETURN(lhs, expr)                                  \
  auto KVF_CONCAT(kvf_result_, __LINE__) = (expr);                       \
  if (!KVF_CONCAT(kvf_result_, __LINE__).ok())                           \
    return KVF_CONCAT(kvf_result_, __LINE__).status();                   \
  lhs = std::move(KVF_CONCAT(kvf_result_, __LINE__)).value()
