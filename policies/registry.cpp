// Copyright kvferry authors. Apache-2.0.
// Builds policies by name from one table: each policy family provides a factory, and extensions
// (or tests) may add entries with RegisterPolicy (kvferry/policy.h). The registry is the only
// place that knows them. The table is a function-local static, so a registration from another
// translation unit's static initialiser finds it built.
#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "policies/basic.h"
#include "policies/hip/hip.h"
#include "policies/knorm/knorm.h"
#include "policies/kvpop/kvpop.h"
#include "policies/lfps/lfps.h"
#include "policies/policy.h"
#include "policies/prhs/prhs.h"
#include "policies/quest/quest.h"
#include "policies/sparcas/sparcas.h"
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
      {"knorm", MakeKnormPolicy},
  };
};

// Wrappers built by name composition ("cis+oracle", "psaw+cis+oracle"): a prefix and the factory
// that builds the stack (it calls MakePolicy for the rest of the name). Plain function pointers:
// the table is constant-initialised, so it is usable from any static initialiser.
struct WrapperEntry {
  const char* prefix;
  Result<std::unique_ptr<Policy>> (*factory)(const RuntimeConfig& config);
  const char* example;  // a composed name PolicyNames lists
};
const WrapperEntry kWrapperEntries[] = {
    {"cis+", MakePrhsPolicy, "cis+oracle"},
    {"psaw+", MakePrhsPolicy, "psaw+lfps"},
    {"xl+", MakePrhsPolicy, "xl+quest"},
    {"psaw+", MakePrhsPolicy, "psaw+cis+oracle"},
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
  for (const WrapperEntry& w : kWrapperEntries) names.emplace_back(w.example);
  return names;
}

bool RegisterPolicy(std::string name, PolicyFactory factory) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (name.empty() || factory == nullptr) return false;
  for (const WrapperEntry& w : kWrapperEntries) {
    if (name.rfind(w.prefix, 0) == 0) return false;  // the wrappers' composed names
  }
  const bool taken = std::any_of(r.entries.begin(), r.entries.end(),
                                 [&](const Entry& e) { return e.name == name; });
  if (taken) return false;
  r.entries.push_back(Entry{std::move(name), std::move(factory)});
  return true;
}

Result<std::unique_ptr<Policy>> MakePolicy(const RuntimeConfig& config) {
  const std::string& name = config.policy.name;
  PolicyFactory factory;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const Entry& e : r.entries) {
      if (e.name == name) factory = e.factory;
    }
  }
  if (factory) return factory(config);
  for (const WrapperEntry& w : kWrapperEntries) {
    if (name.rfind(w.prefix, 0) == 0) return w.factory(config);
  }
  std::string known, wrappers;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const Entry& e : r.entries) known += (known.empty() ? "" : ", ") + e.name;
  }
  for (const WrapperEntry& w : kWrapperEntries) {
    if (wrappers.find(w.prefix) == std::string::npos) {
      wrappers += (wrappers.empty() ? "" : ", ") + std::string(w.prefix);
    }
  }
  return InvalidArgument(detail::StrCat("unknown policy '", name, "' (known: ", known,
                                        "; wrappers: ", wrappers, " e.g. 'cis+oracle')"));
}

}  // namespace kvferry
