// Copyright kvferry authors. Apache-2.0.
// Builds policies by name from one table: each policy family provides a factory, and extensions
// (or tests) may add entries with RegisterPolicy. The registry is the only place that knows them.
#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "policies/basic.h"
#include "policies/hip.h"
#include "policies/kvpop.h"
#include "policies/lfps.h"
#include "policies/policy.h"
#include "policies/quest.h"
#include "policies/sparcas.h"
#include "base/check.h"

namespace kvferry {
namespace {

struct Entry {
  std::string name;
  PolicyFactory factory;
};

struct Registry {
  std::mutex mu;
  std::vector<Entry> entries = {
      {"dense", MakeBasicPolicy},
      {"streaming", MakeBasicPolicy},
      {"oracle", MakeBasicPolicy},
      {"lfps", MakeLfpsPolicy},
      {"quest", MakeQuestPolicy},
      {"sparcas", MakeSparcasPolicy},
      {"hip", MakeHipPolicy},
      {"kvpop", MakeKvpopPolicy},
  };
};

Registry& GetRegistry() {
  static Registry r;
  return r;
}

}  // namespace

std::vector<std::string> PolicyNames() {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const Entry& e : r.entries) names.push_back(e.name);
  return names;
}

bool RegisterPolicy(std::string name, PolicyFactory factory) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (name.empty() || factory == nullptr) return false;
  const bool taken = std::any_of(r.entries.begin(), r.entries.end(),
                                 [&](const Entry& e) { return e.name == name; });
  if (taken) return false;
  r.entries.push_back(Entry{std::move(name), factory});
  return true;
}

Result<std::unique_ptr<Policy>> MakePolicy(const RuntimeConfig& config) {
  const std::string& name = config.policy.name;
  PolicyFactory factory = nullptr;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const Entry& e : r.entries) {
      if (e.name == name) factory = e.factory;
    }
  }
  if (factory != nullptr) return factory(config);
  std::string known;
  for (const std::string& n : PolicyNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument(detail::StrCat("unknown policy '", name, "' (known: ", known, ")"));
}

}  // namespace kvferry
