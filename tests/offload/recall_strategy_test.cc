// The recall strategies on the cpu backend: each moves exactly the bytes the Recall op does
// (skips, chunk boundaries, merged runs included), and plan errors name the item and the
// limit.
#include "offload/recall_strategy.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/registry.h"

namespace kvtier {
namespace {

Geometry SmallGeometry() {
  Geometry g;
  g.num_layers = 1;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 16;
  g.page_size = 4;
  g.dtype = DType::kF16;
  return g;
}

struct HostPages {
  HostPages(const Geometry& g, int64_t pages) : bytes(g.host_page_bytes() * pages), num(pages) {
    data.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)));
    std::mt19937 rng(7);
    for (size_t i = 0; i < bytes; ++i) data.get()[i] = static_cast<uint8_t>(rng());
  }
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  size_t bytes;
  int64_t num;
  std::unique_ptr<uint8_t, Free> data;
};

class RecallStrategyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto b = CreateBackend(DeviceKind::kCpu);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
    drive_ = *backend_->CreateStream();
    xform_ = *backend_->CreateStream();
  }

  // The working set (K then V bytes) after recalling `plan` into zeroed caches of `slots`
  // slots: with `strategy`, or with the Recall op when strategy is kAuto.
  std::vector<uint8_t> Run(RecallStrategy strategy, const std::vector<RecallItem>& plan,
                           int32_t slots, int32_t chunk, int64_t* ranges = nullptr) {
    const size_t cache = size_t{static_cast<size_t>(slots)} * g_.page_size * g_.num_kv_heads *
                         g_.head_dim * g_.element_bytes();
    DeviceBuffer k = *backend_->Allocate(cache), v = *backend_->Allocate(cache);
    std::memset(k.data(), 0, cache);
    std::memset(v.data(), 0, cache);
    RecallTarget t{pages_.data.get(), pages_.num, k.data(), v.data(), slots};
    std::unique_ptr<SlabRecaller> recaller;  // alive until the streams have run its work
    if (strategy == RecallStrategy::kAuto) {
      EXPECT_TRUE(backend_
                      ->Recall(*drive_, ZeroCopyRecallArgs(g_, t, plan.data(),
                                                           static_cast<int32_t>(plan.size())))
                      .ok());
    } else {
      auto r =
          SlabRecaller::Create(*backend_, g_, strategy, static_cast<int32_t>(plan.size()), chunk);
      EXPECT_TRUE(r.ok()) << r.status();
      recaller = *std::move(r);
      std::copy(plan.begin(), plan.end(), recaller->plan());
      auto issued = recaller->Enqueue(*drive_, *xform_, static_cast<int32_t>(plan.size()), t);
      EXPECT_TRUE(issued.ok()) << issued.status();
      if (ranges != nullptr) *ranges = issued.value_or(-1);
    }
    EXPECT_TRUE(drive_->Synchronize().ok());
    std::vector<uint8_t> out(2 * cache);
    std::memcpy(out.data(), k.data(), cache);
    std::memcpy(out.data() + cache, v.data(), cache);
    return out;
  }

  Geometry g_ = SmallGeometry();
  HostPages pages_{g_, 40};
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> drive_, xform_;
};

TEST_F(RecallStrategyTest, EveryStrategyEqualsTheRecallOp) {
  // 30 distinct random (page, head) slabs, every fourth a skip item, into distinct slots.
  std::mt19937 rng(11);
  std::vector<int64_t> slabs(pages_.num * g_.num_kv_heads);
  std::iota(slabs.begin(), slabs.end(), 0);
  std::shuffle(slabs.begin(), slabs.end(), rng);
  std::vector<RecallItem> plan;
  for (int32_t i = 0; i < 30; ++i) {
    const int64_t s = slabs[i];
    plan.push_back(RecallItem{i % 4 == 3 ? kSkipItem : s / g_.num_kv_heads,
                              static_cast<int32_t>(s % g_.num_kv_heads), i});
  }
  const std::vector<uint8_t> expected = Run(RecallStrategy::kAuto, plan, 30, 1);
  for (int32_t chunk : {1, 4, 7, 64}) {
    for (RecallStrategy s : kRecallStrategies) {
      EXPECT_EQ(Run(s, plan, 30, chunk), expected) << RecallStrategyName(s) << " chunk " << chunk;
    }
  }
}

TEST_F(RecallStrategyTest, BatchedDmaMergesAdjacentSlabs) {
  // Every head of pages 10..17, listed in reverse: 16 slabs, one contiguous host range. The
  // sorted plan stages them contiguously, so each chunk is one range.
  std::vector<RecallItem> plan;
  for (int64_t p = 17; p >= 10; --p) {
    for (int32_t h = g_.num_kv_heads - 1; h >= 0; --h) {
      plan.push_back(RecallItem{p, h, static_cast<int32_t>(plan.size())});
    }
  }
  int64_t batched = 0;
  const auto a = Run(RecallStrategy::kBatchedDma, plan, 16, 8, &batched);
  EXPECT_EQ(a, Run(RecallStrategy::kAuto, plan, 16, 8));
  EXPECT_EQ(batched, 2);  // two chunks of 8 slabs, one range each (16 slabs)
}

TEST_F(RecallStrategyTest, PlanErrorsNameTheItemAndTheLimit) {
  DeviceBuffer k = *backend_->Allocate(1 << 16), v = *backend_->Allocate(1 << 16);
  RecallTarget t{pages_.data.get(), pages_.num, k.data(), v.data(), 4};
  for (RecallStrategy s : {RecallStrategy::kBatchedDma}) {
    auto r = *SlabRecaller::Create(*backend_, g_, s, 4, 2);
    r->plan()[0] = RecallItem{1, 0, 0};
    r->plan()[1] = RecallItem{pages_.num, 0, 1};  // one past the last host page
    const auto st = r->Enqueue(*drive_, *xform_, 2, t).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("items[1].host_page = 40 must be in [0, 40)"), std::string::npos)
        << st;
    r->plan()[1] = RecallItem{2, 0, 4};  // slot out of range
    EXPECT_EQ(r->Enqueue(*drive_, *xform_, 2, t).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r->Enqueue(*drive_, *xform_, 5, t).status().code(),
              absl::StatusCode::kInvalidArgument);  // more than max_items
  }
  // The zero-copy gather checks on the device: the stream fails.
  auto z = *SlabRecaller::Create(*backend_, g_, RecallStrategy::kZeroCopy, 4, 2);
  z->plan()[0] = RecallItem{pages_.num, 0, 0};
  ASSERT_TRUE(z->Enqueue(*drive_, *xform_, 1, t).ok());
  EXPECT_EQ(drive_->Synchronize().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(SlabRecaller::Create(*backend_, g_, RecallStrategy::kAuto, 4, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SlabRecaller::Create(*backend_, g_, RecallStrategy::kBatchedDma, 0, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RecallStrategyNames, RoundTrip) {
  for (RecallStrategy s :
       {RecallStrategy::kAuto, RecallStrategy::kBatchedDma, RecallStrategy::kZeroCopy}) {
    RecallStrategy parsed = RecallStrategy::kZeroCopy;
    ASSERT_TRUE(ParseRecallStrategy(RecallStrategyName(s), &parsed));
    EXPECT_EQ(parsed, s);
  }
  RecallStrategy out;
  EXPECT_FALSE(ParseRecallStrategy("streamed", &out));
}

}  // namespace
}  // namespace kvtier
