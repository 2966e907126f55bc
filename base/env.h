// Copyright kvferry authors. Apache-2.0.
#pragma once
// Integer (and decimal) settings read from the environment: the measuring knobs (KVFERRY_MCTA_PER_SM,
// KVFERRY_STEP_MIN_CHUNK, ...) that let a benchmark change a default without a rebuild. Callers
// read each once (a function-local static), so a knob set after the first use has no effect.

#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace kvferry {

/// The value of the environment variable \p name as a base-10 integer, raised to \p lo when below
/// it; \p fallback when the variable is unset, empty or not wholly an integer.
inline int64_t EnvInt(const char* name, int64_t fallback, int64_t lo) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0') return fallback;
  return x < lo ? lo : static_cast<int64_t>(x);
}

/// The value of \p name as a decimal number; \p fallback when unset, empty, not wholly a number
/// or not finite.
inline double EnvDouble(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v, &end);
  if (errno != 0 || end == v || *end != '\0' || !(x - x == 0.0)) return fallback;
  return x;
}

}  // namespace kvferry
