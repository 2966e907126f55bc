// Copyright kvferry authors. Apache-2.0.
#pragma once
// NUMA placement of host memory with hwloc. Optional at run time: on a single-node machine, or if
// hwloc cannot load the topology, placement is a no-op.

#include <cstddef>
#include <string>

namespace kvferry {

/// NUMA nodes hwloc sees (1 when it sees none or fails).
int NumaNodeCount();

/// Binds [ptr, ptr + bytes) to NUMA node \p node (-1: the node of the calling thread's CPU).
/// Returns false when nothing was bound (single node, unknown node, or hwloc refused).
bool BindToNumaNode(void* ptr, size_t bytes, int node);

/// The NUMA node of the PCI device with bus id \p pci_bus_id ("0000:3b:00.0"), or -1.
int NumaNodeOfPci(const std::string& pci_bus_id);

}  // namespace kvferry
