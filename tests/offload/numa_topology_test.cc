#include "offload/numa_topology.h"

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;

// /sys/bus/pci/devices/<id>/numa_node, or nullopt when unreadable.
std::optional<int> SysfsNumaNode(const std::string& bus_id) {
  const std::string path = "/sys/bus/pci/devices/" + bus_id + "/numa_node";
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return std::nullopt;
  int node = -1;
  const bool ok = std::fscanf(f, "%d", &node) == 1;
  std::fclose(f);
  return ok ? std::optional<int>(node) : std::nullopt;
}

TEST(NumaTopologyTest, HostHasAtLeastOneNode) { EXPECT_GE(NumaNodeCount(), 1); }

TEST(NumaTopologyTest, ParsesBothBusIdForms) {
  absl::StatusOr<PciBusId> full = ParsePciBusId("0000:3b:00.0");
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->domain, 0u);
  EXPECT_EQ(full->bus, 0x3bu);
  EXPECT_EQ(full->device, 0u);
  EXPECT_EQ(full->function, 0u);

  absl::StatusOr<PciBusId> short_form = ParsePciBusId("3B:1f.7");
  ASSERT_TRUE(short_form.ok()) << short_form.status();
  EXPECT_EQ(short_form->domain, 0u);
  EXPECT_EQ(short_form->bus, 0x3bu);
  EXPECT_EQ(short_form->device, 0x1fu);
  EXPECT_EQ(short_form->function, 7u);

  // cudaDeviceGetPCIBusId's form: an 8-digit domain, upper case.
  absl::StatusOr<PciBusId> cuda_form = ParsePciBusId("00010000:C1:00.0");
  ASSERT_TRUE(cuda_form.ok()) << cuda_form.status();
  EXPECT_EQ(cuda_form->domain, 0x10000u);
  EXPECT_EQ(cuda_form->bus, 0xc1u);
}

TEST(NumaTopologyTest, MalformedIdsAreInvalidArgumentNamingTheForm) {
  for (const char* bad :
       {"", "3b", "3b:00", "3b:00:0", "0000:3b:00.0.1", "x0:00.0", "3b:20.0", "3b:00.8", "3b:000.0",
        "123:00.0", "000000000:3b:00.0", "0000:3b:00.", ":3b:00.0", "3b:00.0 "}) {
    absl::StatusOr<int> node = NumaNodeOfPciDevice(bad);
    ASSERT_FALSE(node.ok()) << "'" << bad << "'";
    EXPECT_EQ(node.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(node.status().message(), HasSubstr("DDDD:BB:DD.F")) << "'" << bad << "'";
  }
}

TEST(NumaTopologyTest, UnknownDeviceIsNotFound) {
  // Domain ffff is not used by real hosts.
  absl::StatusOr<int> node = NumaNodeOfPciDevice("ffff:ff:1f.7");
  ASSERT_FALSE(node.ok());
  EXPECT_EQ(node.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(node.status().message(), HasSubstr("ffff:ff:1f.7"));
}

TEST(NumaTopologyTest, ListedDevicesAreFoundInBothForms) {
  absl::StatusOr<std::vector<std::string>> ids = ListPciBusIds();
  ASSERT_TRUE(ids.ok()) << ids.status();
  for (const std::string& id : *ids) {
    absl::StatusOr<int> node = NumaNodeOfPciDevice(id);
    ASSERT_TRUE(node.ok()) << id << ": " << node.status();
    EXPECT_GE(*node, -1) << id;
    EXPECT_LT(*node, 1 << 16) << id;
    if (id.rfind("0000:", 0) == 0) {
      absl::StatusOr<int> short_node = NumaNodeOfPciDevice(id.substr(5));
      ASSERT_TRUE(short_node.ok()) << id << ": " << short_node.status();
      EXPECT_EQ(*short_node, *node) << id;
    }
  }
}

TEST(NumaTopologyTest, AgreesWithSysfsForEveryKnownDevice) {
  const std::filesystem::path root = "/sys/bus/pci/devices";
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) GTEST_SKIP() << "no " << root;
  int compared = 0;
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    const std::string id = entry.path().filename().string();
    absl::StatusOr<int> node = NumaNodeOfPciDevice(id);
    if (!node.ok() && node.status().code() == absl::StatusCode::kNotFound) continue;
    ASSERT_TRUE(node.ok()) << id << ": " << node.status();
    const std::optional<int> sysfs = SysfsNumaNode(id);
    if (!sysfs || *sysfs < 0) continue;  // the kernel reports no locality: nothing to compare
    EXPECT_EQ(*node, *sysfs) << id;
    ++compared;
  }
  RecordProperty("devices_compared", compared);
}

}  // namespace
}  // namespace kvtier
