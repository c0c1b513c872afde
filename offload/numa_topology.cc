#include "offload/numa_topology.h"

#include <hwloc.h>

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace kvtier {
namespace {

// Debian's abseil has its own string_view type; convert at the boundary.
absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr absl::string_view kBusIdForm =
    "expected a PCI bus id \"DDDD:BB:DD.F\" or \"BB:DD.F\" (hex; device <= 1f, "
    "function <= 7), e.g. \"0000:3b:00.0\"";

// A loaded hwloc topology with PCI devices kept; destroys itself.
class Topology {
 public:
  Topology() = default;
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;
  ~Topology() {
    if (initialised_) hwloc_topology_destroy(topology_);
  }

  absl::Status Load() {
    if (hwloc_topology_init(&topology_) != 0) {
      return absl::InternalError("hwloc_topology_init failed");
    }
    initialised_ = true;
    // PCI devices are dropped by default. Keep all of them, not only the "important"
    // classes, so every device in /sys/bus/pci can be looked up.
    hwloc_topology_set_io_types_filter(topology_, HWLOC_TYPE_FILTER_KEEP_ALL);
    if (hwloc_topology_load(topology_) != 0) {
      return absl::InternalError("hwloc_topology_load failed: cannot read the host topology");
    }
    return absl::OkStatus();
  }

  hwloc_topology_t get() const { return topology_; }

 private:
  hwloc_topology_t topology_ = nullptr;
  bool initialised_ = false;
};

// Parses `text` as 1..max_digits hex digits.
std::optional<unsigned> ParseHex(absl::string_view text, size_t max_digits) {
  if (text.empty() || text.size() > max_digits) return std::nullopt;
  unsigned value = 0;
  for (char c : text) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return std::nullopt;
    const unsigned digit = absl::ascii_isdigit(static_cast<unsigned char>(c))
                               ? static_cast<unsigned>(c - '0')
                               : static_cast<unsigned>(absl::ascii_tolower(c) - 'a' + 10);
    value = value * 16 + digit;
  }
  return value;
}

absl::Status Malformed(std::string_view bus_id) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed PCI bus id \"", AsAbsl(bus_id), "\": ", kBusIdForm));
}

// The single node in `nodeset`, or -1 when it holds none or several.
int SingleNode(hwloc_const_nodeset_t nodeset) {
  if (nodeset == nullptr || hwloc_bitmap_weight(nodeset) != 1) return -1;
  return hwloc_bitmap_first(nodeset);
}

std::string FormatBusId(const hwloc_obj_t pci) {
  const auto& a = pci->attr->pcidev;
  return absl::StrFormat("%04x:%02x:%02x.%x", a.domain, a.bus, a.dev, a.func);
}

}  // namespace

absl::StatusOr<PciBusId> ParsePciBusId(std::string_view bus_id) {
  const std::vector<absl::string_view> parts = absl::StrSplit(AsAbsl(bus_id), ':');
  if (parts.size() != 2 && parts.size() != 3) return Malformed(bus_id);
  const std::vector<absl::string_view> dev_fn = absl::StrSplit(parts.back(), '.');
  if (dev_fn.size() != 2) return Malformed(bus_id);
  const std::optional<unsigned> domain =
      parts.size() == 3 ? ParseHex(parts[0], 8) : std::optional<unsigned>(0);
  const std::optional<unsigned> bus = ParseHex(parts[parts.size() - 2], 2);
  const std::optional<unsigned> device = ParseHex(dev_fn[0], 2);
  const std::optional<unsigned> function = ParseHex(dev_fn[1], 1);
  if (!domain || !bus || !device || !function || *device > 0x1f || *function > 7) {
    return Malformed(bus_id);
  }
  return PciBusId{*domain, *bus, *device, *function};
}

int NumaNodeCount() {
  Topology topology;
  if (!topology.Load().ok()) return 1;
  const int count = hwloc_get_nbobjs_by_type(topology.get(), HWLOC_OBJ_NUMANODE);
  return count > 0 ? count : 1;
}

absl::StatusOr<int> NumaNodeOfPciDevice(std::string_view bus_id) {
  absl::StatusOr<PciBusId> id = ParsePciBusId(bus_id);
  if (!id.ok()) return id.status();
  Topology topology;
  if (absl::Status s = topology.Load(); !s.ok()) return s;
  hwloc_obj_t pci =
      hwloc_get_pcidev_by_busid(topology.get(), id->domain, id->bus, id->device, id->function);
  if (pci == nullptr) {
    return absl::NotFoundError(
        absl::StrFormat("no PCI device %04x:%02x:%02x.%x in the hwloc topology", id->domain,
                        id->bus, id->device, id->function));
  }
  hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(topology.get(), pci);
  return ancestor == nullptr ? -1 : SingleNode(ancestor->nodeset);
}

absl::StatusOr<std::vector<std::string>> ListPciBusIds() {
  Topology topology;
  if (absl::Status s = topology.Load(); !s.ok()) return s;
  std::vector<std::string> ids;
  for (hwloc_obj_t pci = hwloc_get_next_pcidev(topology.get(), nullptr); pci != nullptr;
       pci = hwloc_get_next_pcidev(topology.get(), pci)) {
    ids.push_back(FormatBusId(pci));
  }
  return ids;
}

}  // namespace kvtier
