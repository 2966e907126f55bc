// Copyright kvferry authors. Apache-2.0.
// Builds policies by name. Each policy family provides one factory; the registry is the only
// place that knows them all.
#include <string>
#include <vector>

#include "policies/basic.h"
#include "policies/policy.h"
#include "runtime/check.h"
#include "policies/lfps.h"

namespace kvferry {

std::vector<std::string> PolicyNames() {
  return {"dense", "streaming", "oracle", "lfps"};
}

Result<std::unique_ptr<Policy>> MakePolicy(const RuntimeConfig& config) {
  const std::string& name = config.policy.name;
  if (name == "dense" || name == "streaming" || name == "oracle") return MakeBasicPolicy(config);
  if (name == "lfps") return MakeLfpsPolicy(config);
  std::string known;
  for (const std::string& n : PolicyNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument(detail::StrCat("unknown policy '", name, "' (known: ", known, ")"));
}

}  // namespace kvferry
