// Copyright kvferry authors. Apache-2.0.
// kvferry_soak: a long soak of the runtime (tests/soak.h): decode steps with
// sequences added and removed throughout; writes steps, wall time and the
// memory samples as JSON.
//   kvferry_soak [--steps N] [--warmup N] [--policy NAME] [--route
//   auto|gpu|cpu]
//                [--backend host|cuda] [--out FILE]
// Exit status 0 when memory stayed flat after the warm-up (RSS within 4 MiB,
// host-store and device bytes unchanged), 1 when it grew, 2 on a usage or
// runtime error.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "soak.h"

int main(int argc, char **argv) {
  using kvferry::Backend;
  using kvferry::Route;
  kvferry::testing::SoakOptions o;
  o.steps = 1000000;
  o.warmup_steps = 100000;
  std::string out_path = "bench/results/soak.json";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", a.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--steps") {
      o.steps = std::atoll(v.c_str());
    } else if (a == "--warmup") {
      o.warmup_steps = std::atoll(v.c_str());
    } else if (a == "--policy") {
      o.policy = v;
    } else if (a == "--route") {
      o.route = v == "cpu" ? Route::kCpu : v == "gpu" ? Route::kGpu : Route::kAuto;
    } else if (a == "--backend") {
      o.backend = v == "cuda" ? Backend::kCuda : Backend::kHost;
    } else if (a == "--out") {
      out_path = v;
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (o.steps < 1 || o.warmup_steps < 1 || o.warmup_steps >= o.steps) {
    std::fprintf(stderr, "want 1 <= --warmup < --steps\n");
    return 2;
  }
  const kvferry::Result<kvferry::testing::SoakReport> r = kvferry::testing::RunSoak(o);
  if (!r.ok()) {
    std::fprintf(stderr, "soak failed: %s\n", r.status().ToString().c_str());
    return 2;
  }
  const kvferry::testing::SoakReport &s = r.value();
  const std::string json = s.ToJson();
  std::printf("%s\n", json.c_str());
  std::ofstream(out_path) << json << "\n";
  const bool flat = s.end.rss_bytes - s.warm.rss_bytes < (int64_t{4} << 20) &&
                    s.end.host_bytes == s.warm.host_bytes &&
                    s.max.host_bytes == s.warm.host_bytes &&
                    s.end.device_bytes == s.warm.device_bytes && s.output_norm > 0;
  std::fprintf(stderr, "%s\n", flat ? "memory flat after warm-up" : "MEMORY GREW after warm-up");
  return flat ? 0 : 1;
}
