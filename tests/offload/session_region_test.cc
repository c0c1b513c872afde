#include "offload/session_region.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "offload/page_pool.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;

// kRegionAlignment-aligned, zeroed scratch memory standing in for an arena.
class Memory {
 public:
  explicit Memory(size_t bytes)
      : bytes_(bytes),
        data_(static_cast<char*>(::operator new (bytes, std::align_val_t{kRegionAlignment}))) {
    std::memset(data_, 0, bytes);
  }
  ~Memory() { ::operator delete (data_, std::align_val_t{kRegionAlignment}); }
  char* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_;
  char* data_;
};

// 2 layers, 1 KV head, d = 8, p = 4, fp16: a host page is 1·2·4·8·2 = 128 bytes.
Geometry Small() {
  return Geometry{.num_layers = 2,
                  .num_q_heads = 2,
                  .num_kv_heads = 1,
                  .head_dim = 8,
                  .page_size = 4,
                  .dtype = DType::kF16};
}

constexpr int32_t kMaxPages = 3;
constexpr int64_t kSlots = 5;

// Byte offsets of layout version 1, written out here so a change to the format breaks this test:
// RegionHeader fields, and a DirEntry's {stamp, slot, epoch}.
constexpr size_t kHeaderMaxPagesOffset = 44;
constexpr size_t kHeaderNumSlotsOffset = 48;
constexpr size_t kHeaderSlotsOffsetOffset = 64;
constexpr size_t kHeaderEpochOffset = 80;
constexpr size_t kDirEntryBytes = 24;
constexpr size_t kDirEntrySlotOffset = 8;

template <class T>
void Poke(char* base, size_t offset, T value) {
  std::memcpy(base + offset, &value, sizeof(value));
}

TEST(RegionLayoutTest, SmallGeometryByHand) {
  absl::StatusOr<RegionLayout> l = ComputeRegionLayout(Small(), kMaxPages, kSlots);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->dir_offset, 4096u);
  // Directory: 2 layers · 3 pages · 24 bytes = 144 bytes, then round up to 4096.
  EXPECT_EQ(l->slots_offset, 8192u);
  // 128-byte pages in 256-byte slots (PagePool::kSlotAlignment).
  EXPECT_EQ(l->slot_stride, 256u);
  // 8192 + 5 · 256 = 9472, rounded up to 64 KiB.
  EXPECT_EQ(l->total_bytes, 65536u);
  EXPECT_EQ(l->max_pages_per_layer, kMaxPages);
  EXPECT_EQ(l->num_slots, kSlots);
}

TEST(RegionLayoutTest, LargerDirectoryAndSlotsRoundUp) {
  // 2 · 200 · 24 = 9600 directory bytes: 4096 + 9600 = 13696 → 16384. 300 slots · 256 = 76800:
  // 16384 + 76800 = 93184 → 131072.
  absl::StatusOr<RegionLayout> l = ComputeRegionLayout(Small(), 200, 300);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->slots_offset, 16384u);
  EXPECT_EQ(l->total_bytes, 131072u);
}

TEST(RegionLayoutTest, RejectsBadArguments) {
  EXPECT_EQ(ComputeRegionLayout(Small(), 0, kSlots).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ComputeRegionLayout(Small(), 0, kSlots).status().message(),
              HasSubstr("max_pages_per_layer"));
  EXPECT_EQ(ComputeRegionLayout(Small(), kMaxPages, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  Geometry bad = Small();
  bad.head_dim = 7;
  EXPECT_EQ(ComputeRegionLayout(bad, kMaxPages, kSlots).status().code(),
            absl::StatusCode::kInvalidArgument);
  // 4 GiB pages · 2^31 slots is far beyond HostArena::kMaxBytes.
  Geometry huge{.num_layers = 1,
                .num_q_heads = 1024,
                .num_kv_heads = 1024,
                .head_dim = 512,
                .page_size = 1024,
                .dtype = DType::kF32};
  absl::StatusOr<RegionLayout> l = ComputeRegionLayout(huge, 1, PagePool::kMaxSlots);
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(l.status().message(), HasSubstr("exceeds"));
}

class SessionRegionTest : public ::testing::Test {
 protected:
  SessionRegionTest() : memory_(65536) {}

  SessionRegion Formatted() {
    absl::StatusOr<SessionRegion> r =
        SessionRegion::Format(memory_.data(), memory_.size(), Small(), kMaxPages, kSlots);
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  }
  absl::StatusOr<SessionRegion> Reopen(const Geometry& g = Small()) {
    return SessionRegion::Open(memory_.data(), memory_.size(), g);
  }

  Memory memory_;
};

TEST_F(SessionRegionTest, FormatThenOpenRoundTrips) {
  SessionRegion w = Formatted();
  EXPECT_EQ(w.epoch(), 1u);
  EXPECT_EQ(w.num_slots(), kSlots);
  EXPECT_EQ(w.slot_stride(), 256u);
  EXPECT_EQ(w.slots(), memory_.data() + 8192);
  EXPECT_EQ(w.SlotData(2), memory_.data() + 8192 + 2 * 256);
  EXPECT_EQ(w.CommittedPages(), 0);
  absl::StatusOr<SessionRegion> r = Reopen();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->geometry(), Small());
  EXPECT_EQ(r->layout().slots_offset, w.layout().slots_offset);
  EXPECT_EQ(r->layout().total_bytes, w.layout().total_bytes);
  EXPECT_EQ(r->layout().max_pages_per_layer, kMaxPages);
  EXPECT_EQ(r->num_slots(), kSlots);
  EXPECT_EQ(r->slots(), w.slots());
  // Both views share the memory: a commit and an epoch bump are visible through the other.
  ASSERT_TRUE(w.Commit(1, 2, 4, 9, 1).ok());
  EXPECT_EQ(r->BumpEpoch().value(), 2u);
  EXPECT_EQ(w.epoch(), 2u);
  absl::StatusOr<CommittedPage> c = r->Lookup(1, 2);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->slot, 4);
  EXPECT_EQ(c->generation, 9u);
  EXPECT_EQ(c->epoch, 1u);
}

TEST_F(SessionRegionTest, FormatRejectsSmallOrMisalignedMemory) {
  EXPECT_EQ(SessionRegion::Format(memory_.data(), 9472, Small(), kMaxPages, kSlots).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SessionRegion::Format(memory_.data() + 4096, 32768, Small(), kMaxPages, kSlots)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SessionRegion::Format(nullptr, 65536, Small(), kMaxPages, kSlots).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SessionRegionTest, OpenRefusesWrongMagicAndVersion) {
  Formatted();
  Poke<uint64_t>(memory_.data(), 0, kRegionMagic + 1);
  absl::StatusOr<SessionRegion> r = Reopen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("magic"));

  Formatted();
  Poke<uint32_t>(memory_.data(), 8, kRegionLayoutVersion + 1);
  r = Reopen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("layout_version"));
}

TEST_F(SessionRegionTest, OpenRefusesAnotherGeometry) {
  Formatted();
  Geometry other = Small();
  other.head_dim = 16;
  absl::StatusOr<SessionRegion> r = Reopen(other);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  Geometry other_dtype = Small();
  other_dtype.dtype = DType::kBF16;
  r = Reopen(other_dtype);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("dtype"));
}

TEST_F(SessionRegionTest, OpenRefusesTooFewBytes) {
  Formatted();
  absl::StatusOr<SessionRegion> r = SessionRegion::Open(memory_.data(), 32768, Small());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("total_bytes"));
  EXPECT_EQ(SessionRegion::Open(memory_.data(), 100, Small()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(SessionRegionTest, OpenRefusesGarbageCountsAndOffsets) {
  Formatted();
  Poke<uint64_t>(memory_.data(), kHeaderSlotsOffsetOffset, 4096);
  absl::StatusOr<SessionRegion> r = Reopen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("slots_offset"));

  // A directory of 2^31 pages per layer fits no 64 KiB mapping.
  Formatted();
  Poke<int32_t>(memory_.data(), kHeaderMaxPagesOffset, INT32_MAX);
  EXPECT_EQ(Reopen().status().code(), absl::StatusCode::kFailedPrecondition);

  Formatted();
  Poke<int64_t>(memory_.data(), kHeaderNumSlotsOffset, -1);
  r = Reopen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("num_slots"));

  // Flipping any other byte of the header before the epoch makes it unacceptable. Other counts
  // (max_pages_per_layer, num_slots) that still fit give a consistent region, which Open accepts
  // and reports in layout() for the caller to compare with its record.
  for (size_t offset = 0; offset < kHeaderEpochOffset; ++offset) {
    Formatted();
    memory_.data()[offset] ^= 0x40;
    absl::StatusOr<SessionRegion> flipped = Reopen();
    if (offset >= kHeaderMaxPagesOffset && offset < kHeaderNumSlotsOffset + 8) {
      if (!flipped.ok()) continue;
      EXPECT_LE(flipped->layout().total_bytes, memory_.size());
      EXPECT_TRUE(flipped->layout().max_pages_per_layer != kMaxPages ||
                  flipped->num_slots() != kSlots);
      continue;
    }
    EXPECT_FALSE(flipped.ok()) << "header byte " << offset;
  }
}

TEST_F(SessionRegionTest, OpenSurvivesRandomHeaders) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    for (size_t offset = 0; offset < 4096; offset += 8)
      Poke<uint64_t>(memory_.data(), offset, rng());
    // Keep magic and version valid half of the time, to get past the first checks.
    if (i % 2 == 0) {
      Poke<uint64_t>(memory_.data(), 0, kRegionMagic);
      Poke<uint32_t>(memory_.data(), 8, kRegionLayoutVersion);
    }
    EXPECT_FALSE(Reopen().ok());
  }
}

TEST_F(SessionRegionTest, CommitThenLookup) {
  SessionRegion r = Formatted();
  EXPECT_EQ(r.Lookup(0, 0).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(r.Commit(0, 0, 3, 1, 1).ok());
  ASSERT_TRUE(r.Commit(0, 1, 0, 7, 1).ok());
  absl::StatusOr<CommittedPage> c = r.Lookup(0, 1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->slot, 0);
  EXPECT_EQ(c->generation, 7u);
  EXPECT_EQ(c->epoch, 1u);
  EXPECT_EQ(r.Lookup(1, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.CommittedPrefix(0), 2);
  EXPECT_EQ(r.CommittedPrefix(1), 0);
  EXPECT_EQ(r.CommittedPages(), 2);
  // Re-committing replaces the entry.
  ASSERT_TRUE(r.Commit(0, 1, 2, 8, 1).ok());
  EXPECT_EQ(r.Lookup(0, 1)->slot, 2);
  EXPECT_EQ(r.Lookup(0, 1)->generation, 8u);
}

TEST_F(SessionRegionTest, CommitAndLookupRejectBadIndices) {
  SessionRegion r = Formatted();
  EXPECT_EQ(r.Commit(2, 0, 0, 1, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.Commit(-1, 0, 0, 1, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.Commit(0, kMaxPages, 0, 1, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.Commit(0, 0, kSlots, 1, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.Commit(0, 0, -1, 1, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.Commit(0, 0, 0, 0, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Lookup(0, kMaxPages).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.Lookup(5, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.Uncommit(0, kMaxPages + 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.CommittedPages(), 0);
}

TEST_F(SessionRegionTest, UncommitWithdrawsThePageAndEverythingAfter) {
  SessionRegion r = Formatted();
  for (int64_t page = 0; page < kMaxPages; ++page) {
    ASSERT_TRUE(r.Commit(0, page, page, 1, 1).ok());
    ASSERT_TRUE(r.Commit(1, page, page + 2, 1, 1).ok());
  }
  ASSERT_TRUE(r.Uncommit(0, 1).ok());
  EXPECT_TRUE(r.Lookup(0, 0).ok());
  EXPECT_EQ(r.Lookup(0, 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.Lookup(0, 2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.CommittedPrefix(0), 1);
  EXPECT_EQ(r.CommittedPrefix(1), kMaxPages);
  EXPECT_EQ(r.CommittedPages(), 1 + kMaxPages);
  ASSERT_TRUE(r.Uncommit(1, kMaxPages).ok());  // nothing at or after the end
  EXPECT_EQ(r.CommittedPages(), 1 + kMaxPages);
}

TEST_F(SessionRegionTest, CommittedPrefixStopsAtAGap) {
  SessionRegion r = Formatted();
  ASSERT_TRUE(r.Commit(0, 0, 0, 1, 1).ok());
  ASSERT_TRUE(r.Commit(0, 2, 1, 1, 1).ok());
  EXPECT_EQ(r.CommittedPrefix(0), 1);
  EXPECT_EQ(r.CommittedPages(), 2);
  ASSERT_TRUE(r.Commit(0, 1, 2, 1, 1).ok());
  EXPECT_EQ(r.CommittedPrefix(0), 3);
}

TEST_F(SessionRegionTest, CommitsWithAnOlderEpochAreFenced) {
  SessionRegion r = Formatted();
  ASSERT_TRUE(r.Commit(0, 0, 0, 1, 1).ok());
  EXPECT_EQ(r.BumpEpoch().value(), 2u);
  absl::Status fenced = r.Commit(0, 1, 1, 1, 1);
  EXPECT_EQ(fenced.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(fenced.message(), HasSubstr("epoch 2"));
  EXPECT_EQ(r.Lookup(0, 1).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(r.Commit(0, 1, 1, 1, 2).ok());
  EXPECT_EQ(r.Lookup(0, 1)->epoch, 2u);
  EXPECT_EQ(r.Lookup(0, 0)->epoch, 1u);  // older commits stay readable
}

// A writer of the shared header can set the epoch to anything: the bump never wraps to 0
// (which would let every fenced holder commit again) and never goes below what the owner
// recorded.
TEST_F(SessionRegionTest, EpochNeverWrapsNorGoesBelowTheOwnersRecord) {
  SessionRegion r = Formatted();
  Poke<uint64_t>(memory_.data(), kHeaderEpochOffset, std::numeric_limits<uint64_t>::max());
  absl::StatusOr<uint64_t> wrapped = r.BumpEpoch();
  EXPECT_EQ(wrapped.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrapped.status().message(), HasSubstr("largest value"));
  EXPECT_EQ(r.epoch(), std::numeric_limits<uint64_t>::max());

  Poke<uint64_t>(memory_.data(), kHeaderEpochOffset, 1);  // lowered behind the owner's back
  EXPECT_EQ(r.BumpEpoch(/*at_least=*/7).value(), 8u);
  EXPECT_EQ(r.epoch(), 8u);
  EXPECT_EQ(r.BumpEpoch(/*at_least=*/3).value(), 9u);
}

TEST_F(SessionRegionTest, CorruptSlotIndexIsDataLoss) {
  SessionRegion r = Formatted();
  ASSERT_TRUE(r.Commit(1, 2, 4, 1, 1).ok());
  const size_t entry = 4096 + (1 * kMaxPages + 2) * kDirEntryBytes;
  for (int64_t bad : {kSlots, int64_t{-1}, INT64_MAX}) {
    Poke<int64_t>(memory_.data(), entry + kDirEntrySlotOffset, bad);
    absl::StatusOr<CommittedPage> c = r.Lookup(1, 2);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << bad;
    EXPECT_THAT(c.status().message(), HasSubstr("slot"));
  }
}

// A reader that sees a page's stamp sees all of its bytes: the writer fills each slot with a
// per-page pattern, then commits; the reader follows CommittedPrefix and checks every byte of every
// page it finds.
TEST(SessionRegionConcurrencyTest, ReaderSeesCompleteBytesOfEveryCommittedPage) {
  const Geometry g{.num_layers = 1,
                   .num_q_heads = 4,
                   .num_kv_heads = 4,
                   .head_dim = 64,
                   .page_size = 16,
                   .dtype = DType::kF16};  // 16 KiB pages
  constexpr int32_t kPages = 256;
  absl::StatusOr<RegionLayout> layout = ComputeRegionLayout(g, kPages, kPages);
  ASSERT_TRUE(layout.ok()) << layout.status();
  Memory memory(layout->total_bytes);
  absl::StatusOr<SessionRegion> writer =
      SessionRegion::Format(memory.data(), memory.size(), g, kPages, kPages);
  ASSERT_TRUE(writer.ok()) << writer.status();
  absl::StatusOr<SessionRegion> reader = SessionRegion::Open(memory.data(), memory.size(), g);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const size_t page_bytes = g.host_page_bytes();

  int64_t pages_checked = 0;
  int64_t bad_bytes = 0;
  int64_t bad_entries = 0;
  std::atomic<bool> writer_failed{false};
  std::thread reading([&] {
    int64_t next = 0;
    while (next < kPages && !writer_failed.load()) {
      const int64_t prefix = reader->CommittedPrefix(0);
      for (; next < prefix; ++next) {
        absl::StatusOr<CommittedPage> c = reader->Lookup(0, next);
        if (!c.ok() || c->slot != kPages - 1 - next || c->generation != uint64_t(next) + 1) {
          ++bad_entries;
          continue;
        }
        const auto* bytes = static_cast<const uint8_t*>(reader->SlotData(c->slot));
        for (size_t i = 0; i < page_bytes; ++i) {
          if (bytes[i] != static_cast<uint8_t>(next * 31 + i)) ++bad_bytes;
        }
        ++pages_checked;
      }
      if (next < kPages) std::this_thread::yield();
    }
  });
  for (int64_t page = 0; page < kPages; ++page) {
    const int64_t slot = kPages - 1 - page;
    uint8_t* bytes = static_cast<uint8_t*>(writer->slots()) + slot * writer->slot_stride();
    for (size_t i = 0; i < page_bytes; ++i) bytes[i] = static_cast<uint8_t>(page * 31 + i);
    absl::Status s = writer->Commit(0, page, slot, page + 1, 1);
    EXPECT_TRUE(s.ok()) << s;  // not ASSERT: the reader must still be joined
    if (!s.ok()) {
      writer_failed = true;
      break;
    }
  }
  reading.join();
  EXPECT_EQ(pages_checked, kPages);
  EXPECT_EQ(bad_entries, 0);
  EXPECT_EQ(bad_bytes, 0);
}

}  // namespace
}  // namespace kvtier
