// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file status.h
/// \brief Error values returned by every kvferry API call. Nothing in kvferry throws across the API.

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvferry {

/// \brief Error codes, grouped in ranges: 1-99 caller errors, 100-199 resource errors,
/// 200-299 device/runtime errors.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  ///< wrong shape, dtype, value out of range
  kNotFound = 2,         ///< unknown or removed sequence
  kFailedPrecondition = 3,  ///< e.g. decode before prefill
  kCorruptData = 4,      ///< malformed file
  kUnimplemented = 5,    ///< feature absent in this build (e.g. CUDA backend without CUDA)
  kResourceExhausted = 100,  ///< capacity or memory exhausted
  kIoError = 101,
  kDeviceError = 200,    ///< CUDA or driver failure; message names the call and file:line
  kInternal = 201,
};

/// \brief Human-readable name of a status code ("invalid argument", ...).
std::string_view StatusCodeName(StatusCode code);

/// \brief The result of an operation: ok, or a code and a message naming the offending value.
/// Cheap to copy when ok. Thread-compatible.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  [[nodiscard]] bool ok() const { return code_ == StatusCode::kOk; }
  [[nodiscard]] StatusCode code() const { return code_; }
  [[nodiscard]] const std::string& message() const { return message_; }
  /// "invalid argument: layer 40 out of range [0, 32)"
  [[nodiscard]] std::string ToString() const;
  /// Marks an intentionally ignored status.
  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status FailedPrecondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status CorruptData(std::string m) { return {StatusCode::kCorruptData, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status DeviceError(std::string m) { return {StatusCode::kDeviceError, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

/// \brief A value or an error Status. Holds exactly one of them.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) v_ = Status(StatusCode::kInternal, "Result built from ok Status");
  }
  [[nodiscard]] bool ok() const { return std::holds_alternative<T>(v_); }
  [[nodiscard]] const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  const T* operator->() const { return &std::get<T>(v_); }
  T& operator*() & { return std::get<T>(v_); }
  const T& operator*() const& { return std::get<T>(v_); }
  T&& operator*() && { return std::get<T>(std::move(v_)); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kvferry
