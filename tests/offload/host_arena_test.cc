#include "offload/host_arena.h"

#include <fcntl.h>
#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
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
#include "tests/testutil/arena_dir.h"

namespace kvtier {
namespace {

using ::kvtier::testing::ArenaFileDir;

using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

using Chunks = std::vector<std::pair<size_t, size_t>>;

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));
constexpr size_t kMiB = size_t{1} << 20;

size_t RoundUpForTest(size_t x, size_t multiple) {
  return (x + multiple - 1) / multiple * multiple;
}

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

// ---- file arenas (ArenaOptions::path) ---------------------------------------------------------

// A file path unique to this test and process, removed when it goes out of scope.
class ArenaFile {
 public:
  ArenaFile() {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = absl::StrCat(ArenaFileDir(), "/kvtier-host-arena-test-", getpid(), "-",
                         info != nullptr ? info->name() : "x", ".arena");
    unlink(path_.c_str());
  }
  ~ArenaFile() { unlink(path_.c_str()); }
  ArenaFile(const ArenaFile&) = delete;
  ArenaFile& operator=(const ArenaFile&) = delete;
  const std::string& path() const { return path_; }

  // The file's bytes, read with pread (not through any mapping); nullopt when absent.
  std::optional<std::string> Contents() const {
    const int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::nullopt;
    struct stat st {};
    std::string out;
    if (fstat(fd, &st) == 0 && st.st_size > 0) {
      out.resize(static_cast<size_t>(st.st_size));
      size_t done = 0;
      while (done < out.size()) {
        const ssize_t n = pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(done));
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      out.resize(done);
    }
    close(fd);
    return out;
  }

 private:
  std::string path_;
};

absl::StatusOr<std::unique_ptr<HostArena>> CreateFileArena(const std::string& path, size_t bytes,
                                                           HugePages hugepages = HugePages::kOff) {
  ArenaOptions options;
  options.bytes = bytes;
  options.name = "kvtier-file-test";
  options.hugepages = hugepages;
  options.path = path;
  return HostArena::Create(options);
}

void WritePattern(void* data, size_t bytes, uint32_t seed) {
  auto* words = static_cast<uint32_t*>(data);
  for (size_t i = 0; i < bytes / sizeof(uint32_t); ++i) {
    words[i] = static_cast<uint32_t>(i * 2654435761u) ^ seed;
  }
}

// The index of the first word that differs from the pattern; bytes / 4 when none does.
size_t FirstMismatch(const void* data, size_t bytes, uint32_t seed) {
  const auto* words = static_cast<const uint32_t*>(data);
  for (size_t i = 0; i < bytes / sizeof(uint32_t); ++i) {
    if (words[i] != (static_cast<uint32_t>(i * 2654435761u) ^ seed)) return i;
  }
  return bytes / sizeof(uint32_t);
}

bool OnHugetlbfs(const std::string& path) {
  struct statfs fs {};
  return statfs(path.c_str(), &fs) == 0 &&
         static_cast<uint64_t>(fs.f_type) == static_cast<uint64_t>(0x958458f6);
}

TEST(HostArenaFileTest, ContentsSurviveTheArenaAndAreMappedAgain) {
  ArenaFile file;
  const size_t bytes = 64 * kPage + 1;  // rounded up to 65 pages
  constexpr uint32_t kSeed = 0x5eed1234u;
  {
    absl::StatusOr<std::unique_ptr<HostArena>> arena = CreateFileArena(file.path(), bytes);
    ASSERT_TRUE(arena.ok()) << arena.status();
    const ArenaReport& r = (*arena)->report();
    SCOPED_TRACE(r.ToString());
    EXPECT_EQ(r.path, file.path());
    EXPECT_FALSE(r.existed);
    EXPECT_FALSE(r.sealed);
    EXPECT_EQ(r.seal_note, "a file arena is not sealed");
    EXPECT_TRUE(r.prefaulted);
    EXPECT_EQ((*arena)->size(), 65 * kPage);
    EXPECT_EQ(r.mapped_bytes, 65 * kPage);
    EXPECT_THAT(r.ToString(), HasSubstr(absl::StrCat("file: ", file.path(), " (created")));
    EXPECT_THAT(r.ToString(), HasSubstr("not sealed: a file arena is not sealed"));
    const auto* zero = static_cast<const char*>((*arena)->data());
    EXPECT_EQ(zero[0], 0);
    EXPECT_EQ(zero[(*arena)->size() - 1], 0);
    WritePattern((*arena)->data(), (*arena)->size(), kSeed);
  }
  const std::optional<std::string> after_first = file.Contents();
  ASSERT_TRUE(after_first.has_value());
  EXPECT_EQ(after_first->size(), 65 * kPage);

  absl::StatusOr<std::unique_ptr<HostArena>> again = CreateFileArena(file.path(), bytes);
  ASSERT_TRUE(again.ok()) << again.status();
  const ArenaReport& r = (*again)->report();
  SCOPED_TRACE(r.ToString());
  EXPECT_TRUE(r.existed);
  EXPECT_EQ(r.path, file.path());
  EXPECT_THAT(r.ToString(), HasSubstr(absl::StrCat("file: ", file.path(), " (existed")));
  ASSERT_EQ((*again)->size(), 65 * kPage);
  EXPECT_EQ(FirstMismatch((*again)->data(), (*again)->size(), kSeed), (*again)->size() / 4);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*again)->data()) % HostArena::kHugePageBytes, 0u);
}

TEST(HostArenaFileTest, ExistingFileIsReadNotWrittenByCreate) {
  ArenaFile file;
  // A file made outside HostArena, with a pattern on every page: Create keeps every byte.
  {
    const int fd = open(file.path().c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    std::string pattern(16 * kPage, '\0');
    WritePattern(pattern.data(), pattern.size(), 77);
    ASSERT_EQ(pwrite(fd, pattern.data(), pattern.size(), 0), static_cast<ssize_t>(pattern.size()));
    close(fd);
  }
  const std::optional<std::string> before = file.Contents();
  ASSERT_TRUE(before.has_value());
  for (const bool lock : {false, true}) {
    ArenaOptions options;
    options.bytes = 16 * kPage;
    options.path = file.path();
    options.hugepages = HugePages::kAuto;
    options.lock = lock;
    absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create(options);
    ASSERT_TRUE(arena.ok()) << arena.status();
    EXPECT_TRUE((*arena)->report().existed);
    EXPECT_FALSE((*arena)->report().hugetlb);
    EXPECT_THAT((*arena)->report().hugepages_note, HasSubstr("is not on hugetlbfs"));
    arena->reset();
    EXPECT_EQ(file.Contents(), before) << "lock " << lock;
  }
}

TEST(HostArenaFileTest, AnotherSizeIsRefusedAndTheFileIsUnchanged) {
  ArenaFile file;
  {
    absl::StatusOr<std::unique_ptr<HostArena>> arena = CreateFileArena(file.path(), 8 * kPage);
    ASSERT_TRUE(arena.ok()) << arena.status();
    WritePattern((*arena)->data(), (*arena)->size(), 3);
  }
  const std::optional<std::string> before = file.Contents();
  ASSERT_TRUE(before.has_value());
  ASSERT_EQ(before->size(), 8 * kPage);
  for (const size_t bytes : {4 * kPage, 9 * kPage, 8 * kPage + 1}) {
    absl::StatusOr<std::unique_ptr<HostArena>> other = CreateFileArena(file.path(), bytes);
    ASSERT_FALSE(other.ok()) << bytes;
    EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
    EXPECT_THAT(other.status().message(), HasSubstr(file.path()));
    EXPECT_THAT(other.status().message(), HasSubstr(absl::StrCat("holds ", 8 * kPage, " bytes")));
    EXPECT_THAT(other.status().message(),
                HasSubstr(absl::StrCat("this arena is ", RoundUpForTest(bytes, kPage), " bytes")));
    EXPECT_EQ(file.Contents(), before) << bytes;
  }
  // The right size still maps it.
  absl::StatusOr<std::unique_ptr<HostArena>> same = CreateFileArena(file.path(), 8 * kPage - 5);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(FirstMismatch((*same)->data(), (*same)->size(), 3), (*same)->size() / 4);
}

TEST(HostArenaFileTest, MapOfTheFileFdSeesTheSameBytes) {
  ArenaFile file;
  absl::StatusOr<std::unique_ptr<HostArena>> owner = CreateFileArena(file.path(), 32 * kPage);
  ASSERT_TRUE(owner.ok()) << owner.status();
  absl::StatusOr<std::unique_ptr<HostArena>> client =
      HostArena::Map((*owner)->fd(), (*owner)->size());
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->report().mapped_existing);
  EXPECT_EQ((*client)->size(), (*owner)->size());
  WritePattern((*owner)->data(), (*owner)->size(), 9);
  EXPECT_EQ(FirstMismatch((*client)->data(), (*client)->size(), 9), (*client)->size() / 4);
  static_cast<uint32_t*>((*client)->data())[5] = 0xfeedfaceu;
  EXPECT_EQ(static_cast<uint32_t*>((*owner)->data())[5], 0xfeedfaceu);
  // More than the file holds is refused.
  EXPECT_EQ(HostArena::Map((*owner)->fd(), (*owner)->size() + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HostArenaFileTest, RequireIsRefusedForAFileNotOnHugetlbfs) {
  ArenaFile file;
  if (OnHugetlbfs(ArenaFileDir())) GTEST_SKIP() << ArenaFileDir() << " is hugetlbfs";
  absl::StatusOr<std::unique_ptr<HostArena>> arena =
      CreateFileArena(file.path(), 4 * kPage, HugePages::kRequire);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kFailedPrecondition) << arena.status();
  EXPECT_THAT(arena.status().message(), HasSubstr(file.path()));
  EXPECT_THAT(arena.status().message(), HasSubstr("not on hugetlbfs"));
  EXPECT_FALSE(file.Contents().has_value()) << "the file Create made is removed again";

  // An existing file is refused the same way and kept.
  {
    absl::StatusOr<std::unique_ptr<HostArena>> made = CreateFileArena(file.path(), 4 * kPage);
    ASSERT_TRUE(made.ok()) << made.status();
    WritePattern((*made)->data(), (*made)->size(), 1);
  }
  const std::optional<std::string> before = file.Contents();
  absl::StatusOr<std::unique_ptr<HostArena>> refused =
      CreateFileArena(file.path(), 4 * kPage, HugePages::kRequire);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(file.Contents(), before);
}

TEST(HostArenaFileTest, AutoOnTmpfsAdvisesTransparentHugepages) {
  ArenaFile file;
  if (OnHugetlbfs(ArenaFileDir())) GTEST_SKIP() << ArenaFileDir() << " is hugetlbfs";
  absl::StatusOr<std::unique_ptr<HostArena>> arena =
      CreateFileArena(file.path(), 4 * kMiB, HugePages::kAuto);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ArenaReport& r = (*arena)->report();
  SCOPED_TRACE(r.ToString());
  EXPECT_FALSE(r.hugetlb);
  EXPECT_EQ(r.page_bytes, kPage);
  const std::string thp = ShmemThpSetting();
  if (thp == "advise" || thp == "always" || thp == "within_size" || thp == "force") {
    EXPECT_TRUE(r.transparent_hugepages);
  } else {
    EXPECT_FALSE(r.transparent_hugepages);
  }
}

TEST(HostArenaFileTest, AFileInAMissingDirectoryIsNotFound) {
  const std::string path = absl::StrCat(ArenaFileDir(), "/kvtier-no-such-dir-", getpid(), "/a");
  absl::StatusOr<std::unique_ptr<HostArena>> arena = CreateFileArena(path, kPage);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kNotFound) << arena.status();
  EXPECT_THAT(arena.status().message(), HasSubstr(path));
}

// On a hugetlbfs mount with free 2 MiB pages (most hosts have none): hugetlb pages, kept.
TEST(HostArenaFileTest, HugetlbfsFileUsesItsPagesAndKeepsItsContents) {
  if (!OnHugetlbfs("/dev/hugepages") || access("/dev/hugepages", W_OK) != 0 ||
      HostFreeHugePages() < 2) {
    GTEST_SKIP() << "no writable hugetlbfs at /dev/hugepages with 2 free 2 MiB pages";
  }
  const std::string path = absl::StrCat("/dev/hugepages/kvtier-host-arena-test-", getpid());
  unlink(path.c_str());
  {
    absl::StatusOr<std::unique_ptr<HostArena>> arena =
        CreateFileArena(path, 3 * kMiB, HugePages::kRequire);
    ASSERT_TRUE(arena.ok()) << arena.status();
    EXPECT_TRUE((*arena)->report().hugetlb);
    EXPECT_EQ((*arena)->size(), 4 * kMiB);
    WritePattern((*arena)->data(), (*arena)->size(), 11);
  }
  {
    absl::StatusOr<std::unique_ptr<HostArena>> again = CreateFileArena(path, 4 * kMiB);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE((*again)->report().existed);
    EXPECT_EQ(FirstMismatch((*again)->data(), (*again)->size(), 11), (*again)->size() / 4);
  }
  unlink(path.c_str());
}

}  // namespace
}  // namespace kvtier
