// Copyright kvferry authors. Apache-2.0.
#pragma once
// One lock around every hwloc topology load in the process. hwloc's Linux backend reads the I/O
// devices through libudev, whose lazily initialised global state (random bytes it fills with
// getrandom on first use) has no lock of its own: two threads loading topologies at once (two
// runtimes created at once, each with its CPU pool) write it concurrently. Found by the
// ThreadSanitizer stage (tests/concurrency_test.cpp). Loads are rare (one per pool and one for
// the process's NUMA queries), so serialising them costs nothing that matters.

#include <mutex>

namespace kvferry::detail {

inline std::mutex& HwlocLoadMutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace kvferry::detail
