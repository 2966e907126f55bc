// Copyright kvferry authors. Apache-2.0.
#include "cpu/numa.h"

#include <hwloc.h>

#include <cstdio>
#include <mutex>

#include "base/hwloc_lock.h"

namespace kvferry {
namespace {

// One topology for the process, loaded on first use (with I/O devices, for PCI lookups).
hwloc_topology_t Topology() {
  static hwloc_topology_t topo = [] {
    std::lock_guard<std::mutex> lock(detail::HwlocLoadMutex());  // see base/hwloc_lock.h
    hwloc_topology_t t = nullptr;
    if (hwloc_topology_init(&t) != 0) return static_cast<hwloc_topology_t>(nullptr);
    hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(t) != 0) {
      hwloc_topology_destroy(t);
      return static_cast<hwloc_topology_t>(nullptr);
    }
    return t;
  }();
  return topo;
}

}  // namespace

int NumaNodeCount() {
  hwloc_topology_t t = Topology();
  if (t == nullptr) return 1;
  const int n = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  return n > 0 ? n : 1;
}

bool BindToNumaNode(void* ptr, size_t bytes, int node) {
  hwloc_topology_t t = Topology();
  if (t == nullptr || NumaNodeCount() < 2 || ptr == nullptr || bytes == 0) return false;
  hwloc_nodeset_t set = hwloc_bitmap_alloc();
  bool ok = false;
  if (node >= 0) {
    hwloc_obj_t obj = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
    if (obj != nullptr) hwloc_bitmap_copy(set, obj->nodeset);
  } else {
    hwloc_cpuset_t cpus = hwloc_bitmap_alloc();
    if (hwloc_get_last_cpu_location(t, cpus, HWLOC_CPUBIND_THREAD) == 0) {
      hwloc_cpuset_to_nodeset(t, cpus, set);
    }
    hwloc_bitmap_free(cpus);
  }
  if (!hwloc_bitmap_iszero(set)) {
    ok = hwloc_set_area_membind(t, ptr, bytes, set, HWLOC_MEMBIND_BIND,
                                HWLOC_MEMBIND_BYNODESET) == 0;
  }
  hwloc_bitmap_free(set);
  return ok;
}

int NumaNodeOfPci(const std::string& pci_bus_id) {
  hwloc_topology_t t = Topology();
  if (t == nullptr) return -1;
  unsigned domain = 0, bus = 0, dev = 0, func = 0;
  if (std::sscanf(pci_bus_id.c_str(), "%x:%x:%x.%x", &domain, &bus, &dev, &func) != 4) return -1;
  hwloc_obj_t pci = hwloc_get_pcidev_by_busid(t, domain, bus, dev, func);
  if (pci == nullptr) return -1;
  hwloc_obj_t parent = hwloc_get_non_io_ancestor_obj(t, pci);
  if (parent == nullptr || parent->nodeset == nullptr) return -1;
  const int first = hwloc_bitmap_first(parent->nodeset);
  return first;
}

}  // namespace kvferry
