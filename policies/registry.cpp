// Copyright kvferry authors. Apache-2.0.
// Builds policies by name. Each policy family provides one factory; the registry is the only
// place that knows them all.
#include <string>
#include <vector>

#include "policies/basic.h"
#include "policies/policy.h"
#include "runtime/check.h"
#if __has_include("policies/lfps.h")
#include "policies/lfps.h"
#define KVF_HAVE_LFPS 1
#endif

namespace kvferry {

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names = {"dense", "streaming", "oracle"};
#ifdef KVF_HAVE_LFPS
  names.push_back("lfps");
#endif
  return names;
}

Result<std::unique_ptr<Policy>> MakePolicy(const RuntimeConfig& config) {
  const std::string& name = config.policy.name;
  if (name == "dense" || name == "streaming" || name == "oracle") return MakeBasicPolicy(config);
#ifdef KVF_HAVE_LFPS
  if (name == "lfps") return MakeLfpsPolicy(config);
#endif
  std::string known;
  for (const std::string& n : PolicyNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument(detail::StrCat("unknown policy '", name, "' (known: ", known, ")"));
}

}  // namespace kvferry
