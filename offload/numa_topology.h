// NUMA topology queries through hwloc: how many NUMA nodes the host has and which node a
// PCI device (a GPU, a NIC) is attached to, so the host tier can bind a tenant's arena to
// the node nearest its GPU (docs/architecture.md#processes).
//
// Each call loads the topology afresh (milliseconds: call at start-up, not per request), so
// the functions share no state and are thread-safe. Node numbers are OS indexes, the ones
// libnuma, numactl and /sys/devices/system/node use.
#ifndef KVTIER_OFFLOAD_NUMA_TOPOLOGY_H_
#define KVTIER_OFFLOAD_NUMA_TOPOLOGY_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier {

// Number of NUMA nodes hwloc sees; at least 1 (a host without NUMA has one node, and a
// topology that cannot be loaded counts as one node).
int NumaNodeCount();

// The NUMA node of the PCI device `bus_id`, written "DDDD:BB:DD.F" (domain of 1 to 8 hex
// digits, as lspci and cudaDeviceGetPCIBusId print it) or "BB:DD.F" (domain 0); hex digits
// in either case. Returns
//   - the node when the device's nearest non-IO ancestor covers exactly one node;
//   - -1 when the device has no NUMA locality (its ancestor spans several nodes or none);
//   - INVALID_ARGUMENT for a malformed id, naming the expected form;
//   - NOT_FOUND when hwloc knows no such device;
//   - INTERNAL when the topology cannot be loaded.
absl::StatusOr<int> NumaNodeOfPciDevice(std::string_view bus_id);

// Bus ids ("dddd:bb:dd.f", lower case) of every PCI device hwloc knows, in topology order.
// INTERNAL when the topology cannot be loaded.
absl::StatusOr<std::vector<std::string>> ListPciBusIds();

// The parts of a PCI bus id. Exposed for tests.
struct PciBusId {
  unsigned domain = 0;
  unsigned bus = 0;
  unsigned device = 0;
  unsigned function = 0;
};

// Parses `bus_id` as NumaNodeOfPciDevice describes; INVALID_ARGUMENT when malformed.
absl::StatusOr<PciBusId> ParsePciBusId(std::string_view bus_id);

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_NUMA_TOPOLOGY_H_
