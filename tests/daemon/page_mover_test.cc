// The page mover (daemon/page_mover.h) against a real Redis Cluster on loopback (3 masters,
// 1 replica each; skipped, saying why, without redis-server): batches of pages of several
// layers demote and promote byte-exact and are charged once per key; a batch that fails —
// bad input, the quota, WAIT refused, a deadline, a damaged value, a caller that is gone —
// leaves nothing half-moved: a demotion holds none of its pages (and what it may have stored
// is removed with its charge), a promotion writes none of its destinations; pages handed over
// (Release) and taken over (Adopt) keep their keys and their one charge.
#include "daemon/page_mover.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/cold_store.h"
#include "daemon/cold_tier.h"
#include "daemon/redis_cluster.h"
#include "tests/daemon/cold_tier_suite.h"
#include "tests/testutil/redis_cluster_process.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::daemon {
namespace {

using ::kvtier::testing::RedisClusterProcess;
using ::testing::HasSubstr;

constexpr size_t kPageBytes = 4096;
constexpr uint64_t kCharge = kPageBytes + kColdHeaderBytes;  // one key's

constexpr char kPrefix[] = "pm";

class PageMoverTest : public ::kvtier::testing::ColdTierSuite<PageMoverTest, kPrefix> {
 protected:
  void SetUp() override {
    ColdTierSuite::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    keys_ = absl::StrCat("s", counter_++);
  }

  // A store of tenant "acme" with `quota` bytes, WAITing for `min_replicas`.
  std::unique_ptr<ColdStore> Store(uint64_t quota = 1 << 24, uint32_t min_replicas = 1) {
    return std::make_unique<ColdStore>(
        cluster_.get(), tier_.get(), "pm",
        ColdStoreOptions{"acme", quota, min_replicas, absl::Milliseconds(500)});
  }
  std::unique_ptr<PageMover> Mover(ColdStore* store) {
    return std::make_unique<PageMover>(
        store, PageMoverOptions{keys_, kPageBytes, absl::Seconds(10), /*live=*/true});
  }

  // Distinct bytes per (layer, page).
  static std::string Bytes(int32_t layer, int64_t page) {
    std::string s(kPageBytes, '\0');
    for (size_t i = 0; i < s.size(); ++i) {
      s[i] = static_cast<char>((i * 31 + static_cast<size_t>(page) * 7 +
                                static_cast<size_t>(layer) * 13) & 0xff);
    }
    return s;
  }
  static std::span<const uint8_t> Span(const std::string& s) {
    return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
  }
  static std::span<uint8_t> Span(std::string& s) {
    return {reinterpret_cast<uint8_t*>(s.data()), s.size()};
  }

  // Pages 0..pages-1 of layers 0..layers-1, each of generation `generation`.
  struct Batch {
    std::vector<std::string> data;
    std::vector<PageMover::Out> out;
  };
  static Batch Pages(int32_t layers, int64_t pages, uint64_t generation = 3) {
    Batch b;
    b.data.reserve(static_cast<size_t>(layers * pages));
    for (int32_t l = 0; l < layers; ++l) {
      for (int64_t p = 0; p < pages; ++p) {
        b.data.push_back(Bytes(l, p));
        b.out.push_back({l, p, generation, Span(b.data.back())});
      }
    }
    return b;
  }
  // Destinations for the same pages, filled with 'x'.
  struct Dest {
    std::vector<std::string> data;
    std::vector<PageMover::In> in;
  };
  static Dest Destinations(int32_t layers, int64_t pages) {
    Dest d;
    d.data.reserve(static_cast<size_t>(layers * pages));
    for (int32_t l = 0; l < layers; ++l) {
      for (int64_t p = 0; p < pages; ++p) {
        d.data.emplace_back(kPageBytes, 'x');
        d.in.push_back({l, p, Span(d.data.back())});
      }
    }
    return d;
  }
  static bool Untouched(const Dest& d) {
    for (const std::string& s : d.data) {
      if (s != std::string(kPageBytes, 'x')) return false;
    }
    return true;
  }
  bool Exists(int32_t layer, int64_t page) {
    absl::StatusOr<RedisReply> r = cluster_->Run(
        {"EXISTS", tier_->Key("acme", keys_, layer, page)}, absl::Now() + absl::Seconds(5));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() && r->integer == 1;
  }
  static absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

  static int counter_;
  std::string keys_;
};
int PageMoverTest::counter_ = 0;

TEST_F(PageMoverTest, ABatchOfManyLayersDemotesAndPromotesByteExactChargedOncePerKey) {
  auto store = Store();
  auto mover = Mover(store.get());
  Batch b = Pages(4, 8);
  // A page named twice with its generation is moved once.
  b.out.push_back(b.out[5]);
  ASSERT_TRUE(mover->Demote(b.out, Deadline()).ok());
  EXPECT_EQ(mover->size(), 32u);
  EXPECT_EQ(store->stats().used_bytes, 32 * kCharge);
  EXPECT_EQ(store->stats().live_demoted_pages, 32u);
  EXPECT_EQ(mover->Generation(3, 7), std::optional<uint64_t>(3));
  EXPECT_EQ(mover->Generation(4, 0), std::nullopt);

  Dest d = Destinations(4, 8);
  ASSERT_TRUE(mover->Promote(d.in, Deadline()).ok());
  for (int32_t l = 0; l < 4; ++l) {
    for (int64_t p = 0; p < 8; ++p) EXPECT_EQ(d.data[l * 8 + p], Bytes(l, p)) << l << " " << p;
  }
  // Pages never change: the same generation again writes nothing and charges nothing; another
  // generation is written over its key and keeps its one charge.
  const int64_t written = tier_->stats().pages_written;
  ASSERT_TRUE(mover->Demote(b.out, Deadline()).ok());
  EXPECT_EQ(tier_->stats().pages_written, written);
  PageMover::Out again = b.out[0];
  again.generation = 9;
  ASSERT_TRUE(mover->Demote({&again, 1}, Deadline()).ok());
  EXPECT_EQ(tier_->stats().pages_written, written + 1);
  EXPECT_EQ(mover->Generation(0, 0), std::optional<uint64_t>(9));
  EXPECT_EQ(store->stats().used_bytes, 32 * kCharge);

  ASSERT_TRUE(mover->RemoveAll().ok());
  EXPECT_EQ(store->stats().used_bytes, 0u);
  EXPECT_FALSE(Exists(2, 3));
}

TEST_F(PageMoverTest, BadInputIsInvalidArgumentAndWritesNothing) {
  auto store = Store();
  auto mover = Mover(store.get());
  const std::string page = Bytes(0, 0);
  const std::string short_page(kPageBytes - 1, 'a');
  const std::vector<std::vector<PageMover::Out>> bad = {
      {{0, 0, 1, Span(short_page)}},                      // another size
      {{0, 0, 0, Span(page)}},                            // generation 0
      {{-1, 0, 1, Span(page)}},                           // negative layer
      {{0, -2, 1, Span(page)}},                           // negative page
      {{0, 1, 1, Span(page)}, {0, 1, 2, Span(page)}},     // one page, two generations
  };
  for (const std::vector<PageMover::Out>& out : bad) {
    absl::Status st = mover->Demote(out, Deadline());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
  EXPECT_EQ(mover->size(), 0u);
  EXPECT_EQ(store->stats().used_bytes, 0u);
  EXPECT_FALSE(Exists(0, 0));
  EXPECT_FALSE(Exists(0, 1));

  // Promotion: a page never demoted is NOT_FOUND, a destination of another size
  // INVALID_ARGUMENT; neither reads nor writes anything.
  Batch b = Pages(1, 2);
  ASSERT_TRUE(mover->Demote(b.out, Deadline()).ok());
  Dest d = Destinations(1, 3);
  absl::Status st = mover->Promote(d.in, Deadline());
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_THAT(st.message(), HasSubstr("layer 0 page 2 was never demoted"));
  EXPECT_TRUE(Untouched(d));
  std::string small(10, 'x');
  const PageMover::In wrong[] = {{0, 0, Span(small)}};
  EXPECT_EQ(mover->Promote(wrong, Deadline()).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PageMoverTest, AQuotaThatDoesNotFitTheBatchWritesNoneOfIt) {
  auto store = Store(/*quota=*/10 * kCharge);
  auto mover = Mover(store.get());
  Batch b = Pages(2, 6);  // 12 keys
  absl::Status st = mover->Demote(b.out, Deadline());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(st.message(), HasSubstr("cold_quota_bytes"));
  EXPECT_EQ(mover->size(), 0u);
  EXPECT_EQ(store->stats().used_bytes, 0u);
  for (int64_t p = 0; p < 6; ++p) EXPECT_FALSE(Exists(0, p));
}

// The copy a move replaces stays charged until the move ends: an overdraft of its charge lets
// the new copy pass the quota by that much and no more, and the charges stay exact.
TEST_F(PageMoverTest, AnOverdraftPassesTheQuotaByItsBytesAndNoMore) {
  auto store = Store(/*quota=*/10 * kCharge);
  auto old_copy = Mover(store.get());
  Batch b = Pages(2, 4);  // 8 keys
  ASSERT_TRUE(old_copy->Demote(b.out, Deadline()).ok());
  EXPECT_EQ(old_copy->ChargedBytes(), 8 * kCharge);
  keys_ += "new";  // the other set of keys
  auto new_copy = Mover(store.get());
  // Without an overdraft 2 of the 8 fit: nothing is written.
  absl::Status st = new_copy->Demote(b.out, Deadline());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(new_copy->size(), 0u);
  // An overdraft a byte short of what the 8 keys pass the quota by (6 keys): still refused,
  // naming it.
  new_copy->SetOverdraft(6 * kCharge - 1);
  st = new_copy->Demote(b.out, Deadline());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(st.message(), HasSubstr("while the copy this move replaces is kept"));
  // The old copy's charge: both copies held, 16 keys charged against a quota of 10.
  new_copy->SetOverdraft(old_copy->ChargedBytes());
  ASSERT_TRUE(new_copy->Demote(b.out, Deadline()).ok());
  EXPECT_EQ(store->stats().used_bytes, 16 * kCharge);
  new_copy->SetOverdraft(0);
  ASSERT_TRUE(old_copy->RemoveAll().ok());
  EXPECT_EQ(store->stats().used_bytes, 8 * kCharge);
  ASSERT_TRUE(new_copy->RemoveAll().ok());
  EXPECT_EQ(store->stats().used_bytes, 0u);
}

TEST_F(PageMoverTest, ADemotionWaitRefusesHoldsNoneAndRemoveAllTakesWhatItStored) {
  // Two replicas asked of a cluster that has one per master: every WAIT falls short.
  auto store = Store(1 << 24, /*min_replicas=*/2);
  auto mover = Mover(store.get());
  Batch b = Pages(2, 4);
  absl::Status st = mover->Demote(b.out, Deadline());
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ(mover->size(), 0u);  // nothing counts as moved
  EXPECT_EQ(mover->Generation(0, 0), std::nullopt);
  // Stored all the same: charged until removed.
  EXPECT_TRUE(Exists(1, 3));
  EXPECT_EQ(store->stats().used_bytes, 8 * kCharge);
  ASSERT_TRUE(mover->RemoveAll().ok());
  EXPECT_FALSE(Exists(1, 3));
  EXPECT_EQ(store->stats().used_bytes, 0u);
}

TEST_F(PageMoverTest, ADeadlineThatHasPassedMovesNothing) {
  auto store = Store();
  auto mover = Mover(store.get());
  Batch b = Pages(1, 4);
  absl::Status st = mover->Demote(b.out, absl::Now() - absl::Milliseconds(1));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_EQ(mover->size(), 0u);
  ASSERT_TRUE(mover->Demote(b.out, Deadline()).ok());
  Dest d = Destinations(1, 4);
  st = mover->Promote(d.in, absl::Now() - absl::Milliseconds(1));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_TRUE(Untouched(d));
  // The call's deadline (CallScope) bounds a batch that names none.
  {
    PageMover::CallScope call(mover.get(), absl::Now() - absl::Milliseconds(1));
    std::vector<ColdPages::Read> reads;
    for (const PageMover::In& in : d.in) reads.push_back({in.layer, in.page, -1, in.into});
    EXPECT_EQ(mover->GetBatch(reads).code(), absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_TRUE(Untouched(d));
  ASSERT_TRUE(mover->Promote(d.in, Deadline()).ok());
  EXPECT_EQ(d.data[3], Bytes(0, 3));
}

TEST_F(PageMoverTest, APausedMasterEndsTheBatchAtItsDeadline) {
  auto store = Store();
  auto mover = Mover(store.get());
  Batch b = Pages(1, 4);
  ASSERT_TRUE(mover->Demote(b.out, Deadline()).ok());
  absl::StatusOr<int> master =
      process()->MasterOf(RedisCluster::SlotOf(tier_->Key("acme", keys_, 0, 0)));
  ASSERT_TRUE(master.ok()) << master.status();
  ASSERT_TRUE(process()->Pause(*master).ok());
  Dest d = Destinations(1, 4);
  const absl::Time start = absl::Now();
  absl::Status st = mover->Promote(d.in, start + absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(process()->Resume(*master).ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(st) || absl::IsUnavailable(st)) << st;
  // Bounded by the deadline, with room for a loaded machine; never the 10 s timeout.
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_TRUE(Untouched(d));
}

TEST_F(PageMoverTest, ADamagedPageFailsTheWholePromotionAndWritesNoDestination) {
  auto store = Store();
  auto mover = Mover(store.get());
  Batch b = Pages(2, 4);
  ASSERT_TRUE(mover->Demote(b.out, Deadline()).ok());
  // Layer 1 page 2 overwritten (on its master and, by replication, its replica).
  ASSERT_TRUE(cluster_->Run({"SET", tier_->Key("acme", keys_, 1, 2), "garbage"}, Deadline()).ok());
  ASSERT_TRUE(process()->WaitForReplicas(absl::Seconds(10)).ok());
  Dest d = Destinations(2, 4);
  absl::Status st = mover->Promote(d.in, Deadline());
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(st.message(), HasSubstr("layer 1 page 2"));
  EXPECT_TRUE(Untouched(d));  // layer 0's intact pages were not written either
  EXPECT_EQ(store->stats().data_loss, 1u);
}

TEST_F(PageMoverTest, ACallerGoneBeforeTheWriteLeavesEveryDestination) {
  auto store = Store();
  auto mover = Mover(store.get());
  Batch b = Pages(1, 3);
  ASSERT_TRUE(mover->Demote(b.out, Deadline()).ok());
  Dest d = Destinations(1, 3);
  absl::Status st = mover->Promote(d.in, Deadline(), [] {
    return absl::CancelledError("the caller went away");
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(Untouched(d));
}

TEST_F(PageMoverTest, PagesHandedOverKeepTheirKeysAndChargeAndAreTakenOverByAnother) {
  auto store = Store();
  std::vector<PageMover::Held> handed;
  {
    auto first = Mover(store.get());
    Batch b = Pages(2, 3);
    ASSERT_TRUE(first->Demote(b.out, Deadline()).ok());
    handed = first->Release();
    EXPECT_EQ(first->size(), 0u);
  }  // destroyed: removes nothing it handed over
  ASSERT_EQ(handed.size(), 6u);
  EXPECT_TRUE(Exists(1, 2));
  EXPECT_EQ(store->stats().used_bytes, 6 * kCharge);

  auto second = Mover(store.get());
  second->Adopt(handed);
  Dest d = Destinations(2, 3);
  ASSERT_TRUE(second->Promote(d.in, Deadline()).ok());
  EXPECT_EQ(d.data[4], Bytes(1, 1));
  ASSERT_TRUE(second->RemoveAll().ok());
  EXPECT_FALSE(Exists(1, 2));
  EXPECT_EQ(store->stats().used_bytes, 0u);
}

TEST_F(PageMoverTest, AWholeSessionsPagesAreNotCountedAsLivePages) {
  auto store = Store();
  PageMover mover(store.get(),
                  PageMoverOptions{keys_, kPageBytes, absl::Seconds(10), /*live=*/false});
  Batch b = Pages(1, 2);
  ASSERT_TRUE(mover.Demote(b.out, Deadline()).ok());
  Dest d = Destinations(1, 2);
  ASSERT_TRUE(mover.Promote(d.in, Deadline()).ok());
  EXPECT_EQ(store->stats().live_demoted_pages, 0u);
  EXPECT_EQ(store->stats().live_promoted_pages, 0u);
  EXPECT_EQ(store->stats().used_bytes, 2 * kCharge);
}

}  // namespace
}  // namespace kvtier::daemon
