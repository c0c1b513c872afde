#include "offload/host_arena.h"

#include <fcntl.h>
#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

using Chunks = std::vector<std::pair<size_t, size_t>>;

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));
constexpr size_t kMiB = size_t{1} << 20;

// The selected value of the shmem transparent-hugepage knob, e.g. "never".
std::string ShmemThpSetting() {
  std::FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
  if (f == nullptr) return "";
  char line[256] = {};
  const bool ok = std::fgets(line, sizeof(line), f) != nullptr;
  std::fclose(f);
  const std::string text = ok ? line : "";
  const size_t open = text.find('[');
  const size_t close = text.find(']');
  return open != std::string::npos && close > open ? text.substr(open + 1, close - open - 1) : "";
}

int64_t HostFreeHugePages() {
  std::FILE* f = std::fopen("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "r");
  if (f == nullptr) return 0;
  long long n = 0;  // NOLINT(runtime/int)
  if (std::fscanf(f, "%lld", &n) != 1) n = 0;
  std::fclose(f);
  return n;
}

// A backend that only records host registrations; `fail_at` (1-based) fails that
// RegisterHost call. Checks that every unregistered range is still mapped.
class RecordingBackend : public Backend {
 public:
  struct Call {
    void* data;
    size_t bytes;
  };
  std::vector<Call> registered;
  std::vector<void*> unregistered;
  std::vector<bool> mapped_at_unregister;
  int fail_at = 0;

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string Describe() const override { return "recording fake"; }
  absl::StatusOr<DeviceBuffer> Allocate(size_t) override { return Unimplemented(); }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority) override {
    return Unimplemented();
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return Unimplemented(); }
  absl::Status RegisterHost(void* data, size_t bytes) override {
    if (static_cast<int>(registered.size()) + 1 == fail_at) {
      return absl::ResourceExhaustedError("injected registration failure");
    }
    registered.push_back({data, bytes});
    return absl::OkStatus();
  }
  absl::Status UnregisterHost(void* data) override {
    unsigned char residency = 0;
    mapped_at_unregister.push_back(mincore(data, 1, &residency) == 0);
    unregistered.push_back(data);
    return absl::OkStatus();
  }
  absl::Status Copy(Stream&, void*, const void*, size_t) override { return Unimplemented(); }
  absl::Status Memset(Stream&, void*, int, size_t) override { return Unimplemented(); }

 protected:
  void Free(void*) override {}
  absl::Status DoScorePages(Stream&, const ScorePagesArgs&) override { return Unimplemented(); }
  absl::Status DoTopK(Stream&, const TopKArgs&) override { return Unimplemented(); }
  absl::Status DoQueryCosine(Stream&, const QueryCosineArgs&) override { return Unimplemented(); }
  absl::Status DoSelectionLoss(Stream&, const SelectionLossArgs&) override {
    return Unimplemented();
  }
  absl::Status DoRecall(Stream&, const RecallArgs&) override { return Unimplemented(); }
  absl::Status DoGatherSlabs(Stream&, const GatherSlabsArgs&) override { return Unimplemented(); }
  absl::Status DoScatterSlabs(Stream&, const ScatterSlabsArgs&) override {
    return Unimplemented();
  }
  absl::Status DoReplace(Stream&, const ReplaceArgs&) override { return Unimplemented(); }
  absl::Status DoOffload(Stream&, const OffloadArgs&) override { return Unimplemented(); }
  absl::Status DoSparseAttention(Stream&, const SparseAttentionArgs&) override {
    return Unimplemented();
  }
  absl::Status DoDenseAttention(Stream&, const DenseAttentionArgs&) override {
    return Unimplemented();
  }
  absl::Status DoQuantizeSlots(Stream&, const QuantizeSlotsArgs&) override {
    return Unimplemented();
  }
  absl::Status DoMoveHeadSlots(Stream&, const MoveHeadSlotsArgs&) override {
    return Unimplemented();
  }

 private:
  static absl::Status Unimplemented() { return absl::UnimplementedError("fake"); }
};

std::unique_ptr<HostArena> MakeArena(size_t bytes, HugePages hugepages = HugePages::kOff) {
  ArenaOptions options;
  options.bytes = bytes;
  options.name = "kvtier-test";
  options.hugepages = hugepages;
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
  EXPECT_TRUE(arena.ok()) << arena.status();
  return arena.ok() ? *std::move(arena) : nullptr;
}

TEST(HostArenaTest, HugePagesOffGivesBasePagesRoundedUp) {
  std::unique_ptr<HostArena> arena = MakeArena(kMiB + 1);
  ASSERT_NE(arena, nullptr);
  const ArenaReport& r = arena->report();
  EXPECT_EQ(arena->size(), kMiB + kPage);
  EXPECT_EQ(r.requested_bytes, kMiB + 1);
  EXPECT_EQ(r.mapped_bytes, arena->size());
  EXPECT_EQ(r.page_bytes, kPage);
  EXPECT_FALSE(r.hugetlb);
  EXPECT_FALSE(r.transparent_hugepages);
  EXPECT_TRUE(r.prefaulted);
  EXPECT_TRUE(r.sealed) << r.seal_note;
  EXPECT_GE(arena->fd(), 0);
  EXPECT_THAT(r.ToString(), HasSubstr("hugepages (off): no"));
  // The whole range is writable.
  auto* bytes = static_cast<unsigned char*>(arena->data());
  bytes[0] = 1;
  bytes[arena->size() - 1] = 2;
  EXPECT_EQ(bytes[0] + bytes[arena->size() - 1], 3);
}

TEST(HostArenaTest, AutoHugePagesFollowTheFreePool) {
  const size_t bytes = 4 * kMiB + 1;  // needs 3 hugepages
  const int64_t free_before = HostFreeHugePages();
  std::unique_ptr<HostArena> arena = MakeArena(bytes, HugePages::kAuto);
  ASSERT_NE(arena, nullptr);
  const ArenaReport& r = arena->report();
  EXPECT_EQ(r.needed_hugepages, 3);
  EXPECT_GE(r.free_hugepages, 0);
  SCOPED_TRACE(r.ToString());
  if (r.hugetlb) {
    EXPECT_GE(r.free_hugepages, r.needed_hugepages);
    EXPECT_EQ(r.page_bytes, HostArena::kHugePageBytes);
    EXPECT_EQ(arena->size(), 6 * kMiB);
  } else {
    EXPECT_EQ(r.page_bytes, kPage);
    EXPECT_EQ(arena->size(), bytes + kPage - 1);
    const std::string thp = ShmemThpSetting();
    if (thp == "never" || thp == "deny" || thp.empty()) {
      EXPECT_FALSE(r.transparent_hugepages);  // advice the kernel ignores is not claimed
      EXPECT_THAT(r.hugepages_note, HasSubstr("shmem_enabled"));
    } else {
      EXPECT_TRUE(r.transparent_hugepages);
    }
    if (free_before < 3) {
      EXPECT_EQ(r.free_hugepages, free_before);  // a quiet host: nobody took any meanwhile
      EXPECT_THAT(r.hugepages_note, HasSubstr(absl::StrCat(free_before, " free 2 MiB")));
      EXPECT_THAT(r.hugepages_note, HasSubstr("3 needed"));
      EXPECT_THAT(r.hugepages_note, HasSubstr("vm.nr_hugepages"));
    } else {
      EXPECT_THAT(r.hugepages_note, HasSubstr("hugetlb arena failed"));
    }
  }
}

TEST(HostArenaTest, RequiredHugePagesSucceedOrNameTheCounts) {
  ArenaOptions options;
  options.bytes = 2 * kMiB + 1;  // needs 2 hugepages
  options.hugepages = HugePages::kRequire;
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
  if (arena.ok()) {
    EXPECT_TRUE((*arena)->report().hugetlb);
    EXPECT_EQ((*arena)->size(), 4 * kMiB);
    return;
  }
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kResourceExhausted) << arena.status();
  EXPECT_THAT(arena.status().message(), HasSubstr("2 needed"));
  EXPECT_THAT(arena.status().message(), HasSubstr("free 2 MiB hugepages"));
  EXPECT_THAT(arena.status().message(), HasSubstr("vm.nr_hugepages"));
}

TEST(HostArenaTest, BadSizesAreInvalidArgument) {
  for (size_t bytes : {size_t{0}, HostArena::kMaxBytes + 1}) {
    ArenaOptions options;
    options.bytes = bytes;
    absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
    ASSERT_FALSE(arena.ok()) << bytes;
    EXPECT_EQ(arena.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(arena.status().message(), HasSubstr("arena size"));
  }
}

TEST(HostArenaTest, MapSeesTheOtherMappingsWrites) {
  std::unique_ptr<HostArena> owner = MakeArena(256 * 1024);
  ASSERT_NE(owner, nullptr);
  absl::StatusOr<std::unique_ptr<HostArena>> client = HostArena::Map(owner->fd(), owner->size());
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_NE((*client)->fd(), owner->fd());  // its own duplicate
  EXPECT_NE((*client)->data(), owner->data());
  EXPECT_TRUE((*client)->report().mapped_existing);

  auto* a = static_cast<uint32_t*>(owner->data());
  auto* b = static_cast<uint32_t*>((*client)->data());
  const size_t words = owner->size() / sizeof(uint32_t);
  for (size_t i = 0; i < words; ++i) a[i] = static_cast<uint32_t>(i * 2654435761u);
  for (size_t i = 0; i < words; i += 997) ASSERT_EQ(b[i], static_cast<uint32_t>(i * 2654435761u));
  b[words - 1] = 0xfeedfaceu;
  EXPECT_EQ(a[words - 1], 0xfeedfaceu);

  owner.reset();  // the client's duplicate keeps the memory alive
  EXPECT_EQ(b[words - 1], 0xfeedfaceu);
}

TEST(HostArenaTest, MapRejectsBadFdsAndSizes) {
  std::unique_ptr<HostArena> owner = MakeArena(64 * 1024);
  ASSERT_NE(owner, nullptr);
  const std::pair<int, size_t> cases[] = {{owner->fd(), owner->size() + 1},
                                          {owner->fd(), 0},
                                          {owner->fd(), HostArena::kMaxBytes + 1},
                                          {-1, 4096}};
  for (const auto& [fd, bytes] : cases) {
    absl::StatusOr<std::unique_ptr<HostArena>> mapped = HostArena::Map(fd, bytes);
    ASSERT_FALSE(mapped.ok()) << fd << " " << bytes;
    EXPECT_EQ(mapped.status().code(), absl::StatusCode::kInvalidArgument) << mapped.status();
  }
  absl::StatusOr<std::unique_ptr<HostArena>> too_big =
      HostArena::Map(owner->fd(), owner->size() + 1);
  EXPECT_THAT(too_big.status().message(), HasSubstr(absl::StrCat("holds ", owner->size())));
}

TEST(HostArenaTest, ArenaFileCannotBeResizedByAClient) {
  std::unique_ptr<HostArena> arena = MakeArena(64 * 1024);
  ASSERT_NE(arena, nullptr);
  ASSERT_TRUE(arena->report().sealed);
  EXPECT_NE(ftruncate(arena->fd(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(ftruncate(arena->fd(), static_cast<off_t>(arena->size() * 2)), 0);
  static_cast<char*>(arena->data())[arena->size() - 1] = 1;  // still mapped and backed
}

TEST(HostArenaTest, LockReportIsConsistentWithTheRlimit) {
  ArenaOptions options;
  options.bytes = 512 * 1024;
  options.hugepages = HugePages::kOff;
  options.lock = false;
  absl::StatusOr<std::unique_ptr<HostArena>> unlocked = HostArena::Create(options);
  ASSERT_TRUE(unlocked.ok()) << unlocked.status();
  EXPECT_FALSE((*unlocked)->report().locked);
  EXPECT_EQ((*unlocked)->report().lock_note, "not requested");

  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &rl), 0);
  // Bigger than the limit when it is small enough to test; locking then needs privilege.
  options.bytes = rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur <= 256 * kMiB
                      ? static_cast<size_t>(rl.rlim_cur) + kMiB
                      : kMiB;
  options.lock = true;
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ArenaReport& r = (*arena)->report();
  SCOPED_TRACE(r.ToString());
  if (rl.rlim_cur == RLIM_INFINITY) {
    EXPECT_EQ(r.memlock_limit_bytes, UINT64_MAX);
  } else {
    EXPECT_EQ(r.memlock_limit_bytes, rl.rlim_cur);
  }
  if (r.locked) {
    EXPECT_TRUE(r.lock_note.empty());
    EXPECT_THAT(r.ToString(), HasSubstr("lock: locked"));
  } else {
    EXPECT_THAT(r.lock_note, HasSubstr("RLIMIT_MEMLOCK"));
    EXPECT_THAT(r.lock_note, HasSubstr("ulimit -l"));
    EXPECT_THAT(r.lock_note, HasSubstr(absl::StrCat(r.mapped_bytes, " bytes")));
  }
}

TEST(HostArenaTest, NumaNodeOutOfRangeIsReportedNotFatal) {
  ArenaOptions options;
  options.bytes = 64 * 1024;
  options.numa_node = 4095;
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ArenaReport& r = (*arena)->report();
  EXPECT_EQ(r.numa_policy, NumaPolicy::kNone);
  EXPECT_THAT(r.numa_note,
              AnyOf(HasSubstr("node 4095 out of range"), HasSubstr("libnuma unavailable")));
  EXPECT_THAT(r.ToString(), HasSubstr("numa: not bound"));
}

TEST(HostArenaTest, BoundArenaPagesLiveOnTheNode) {
  if (numa_available() < 0) GTEST_SKIP() << "no NUMA support";
  ArenaOptions options;
  options.bytes = 256 * 1024;
  options.hugepages = HugePages::kOff;
  options.numa_node = 0;
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ArenaReport& r = (*arena)->report();
  SCOPED_TRACE(r.ToString());
  ASSERT_NE(r.numa_policy, NumaPolicy::kNone);
  EXPECT_GE(r.node_free_bytes, 0);
  // Ask the kernel where each page is (move_pages with no target nodes only queries).
  const size_t pages = (*arena)->size() / kPage;
  std::vector<void*> addresses(pages);
  std::vector<int> status(pages, -1);
  for (size_t i = 0; i < pages; ++i) {
    addresses[i] = static_cast<char*>((*arena)->data()) + i * kPage;
  }
  ASSERT_EQ(numa_move_pages(0, pages, addresses.data(), nullptr, status.data(), 0), 0);
  if (r.numa_policy == NumaPolicy::kBind) {
    for (size_t i = 0; i < pages; ++i) EXPECT_EQ(status[i], 0) << "page " << i;
  }
}

TEST(PlanRegistrationChunksTest, CoversTheRangeInMaxSizedChunks) {
  EXPECT_THAT(PlanRegistrationChunks(0, 4), ElementsAre());
  EXPECT_THAT(PlanRegistrationChunks(3, 4), ElementsAre(Pair(0, 3)));
  EXPECT_THAT(PlanRegistrationChunks(8, 4), ElementsAre(Pair(0, 4), Pair(4, 4)));
  EXPECT_THAT(PlanRegistrationChunks(10, 4), ElementsAre(Pair(0, 4), Pair(4, 4), Pair(8, 2)));
  EXPECT_THAT(PlanRegistrationChunks(5, 1),
              ElementsAre(Pair(0, 1), Pair(1, 1), Pair(2, 1), Pair(3, 1), Pair(4, 1)));
  const size_t gib = size_t{1} << 30;
  EXPECT_THAT(PlanRegistrationChunks(130 * gib, Backend::kMaxRegisterBytes),
              ElementsAre(Pair(0, 64 * gib), Pair(64 * gib, 64 * gib), Pair(128 * gib, 2 * gib)));
  EXPECT_THAT(PlanRegistrationChunks(HostArena::kMaxBytes, Backend::kMaxRegisterBytes).size(), 64u);
}

TEST(HostArenaRegisterTest, RegistersInChunksAndUnregistersBeforeUnmapping) {
  RecordingBackend backend;
  std::unique_ptr<HostArena> arena = MakeArena(10 * kPage);
  ASSERT_NE(arena, nullptr);
  char* base = static_cast<char*>(arena->data());
  ASSERT_TRUE(arena->RegisterWith(backend, 3 * kPage).ok());
  EXPECT_THAT(arena->registered_chunks(),
              ElementsAre(Pair(0, 3 * kPage), Pair(3 * kPage, 3 * kPage),
                          Pair(6 * kPage, 3 * kPage), Pair(9 * kPage, kPage)));
  ASSERT_EQ(backend.registered.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(backend.registered[i].data, base + arena->registered_chunks()[i].first);
    EXPECT_EQ(backend.registered[i].bytes, arena->registered_chunks()[i].second);
  }
  EXPECT_TRUE(backend.unregistered.empty());
  arena.reset();
  EXPECT_THAT(backend.unregistered,
              ElementsAre(base, base + 3 * kPage, base + 6 * kPage, base + 9 * kPage));
  EXPECT_THAT(backend.mapped_at_unregister, ElementsAre(true, true, true, true));
}

TEST(HostArenaRegisterTest, ChunkRoundsDownToWholePagesButNotBelowOne) {
  RecordingBackend backend;
  std::unique_ptr<HostArena> arena = MakeArena(3 * kPage);
  ASSERT_NE(arena, nullptr);
  ASSERT_TRUE(arena->RegisterWith(backend, kPage + kPage / 2).ok());
  EXPECT_THAT(arena->registered_chunks(),
              ElementsAre(Pair(0, kPage), Pair(kPage, kPage), Pair(2 * kPage, kPage)));
  ASSERT_TRUE(arena->Unregister().ok());
  EXPECT_EQ(backend.unregistered.size(), 3u);

  ASSERT_TRUE(arena->RegisterWith(backend, kPage / 2).ok());  // below a page: taken as is
  EXPECT_EQ(arena->registered_chunks().size(), 6u);
  EXPECT_EQ(arena->registered_chunks()[1], std::make_pair(kPage / 2, kPage / 2));
}

TEST(HostArenaRegisterTest, RejectsBadChunksAndDoubleRegistration) {
  RecordingBackend backend;
  std::unique_ptr<HostArena> arena = MakeArena(4 * kPage);
  ASSERT_NE(arena, nullptr);
  EXPECT_EQ(arena->RegisterWith(backend, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena->RegisterWith(backend, Backend::kMaxRegisterBytes + 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(backend.registered.empty());
  ASSERT_TRUE(arena->RegisterWith(backend).ok());
  EXPECT_THAT(arena->registered_chunks(), ElementsAre(Pair(0, 4 * kPage)));
  const absl::Status again = arena->RegisterWith(backend);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.message(), HasSubstr("already registered"));
  EXPECT_EQ(backend.registered.size(), 1u);
}

TEST(HostArenaRegisterTest, FailureMidwayUnregistersWhatWasRegistered) {
  RecordingBackend backend;
  backend.fail_at = 3;
  std::unique_ptr<HostArena> arena = MakeArena(8 * kPage);
  ASSERT_NE(arena, nullptr);
  char* base = static_cast<char*>(arena->data());
  const absl::Status s = arena->RegisterWith(backend, 2 * kPage);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("chunk 3 of 4"));
  EXPECT_THAT(s.message(), HasSubstr("injected registration failure"));
  EXPECT_TRUE(arena->registered_chunks().empty());
  EXPECT_THAT(backend.unregistered, ElementsAre(base, base + 2 * kPage));
  arena.reset();
  EXPECT_EQ(backend.unregistered.size(), 2u);  // nothing left for the destructor
}

}  // namespace
}  // namespace kvtier
