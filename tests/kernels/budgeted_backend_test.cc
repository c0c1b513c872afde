// The budgeted backend decorator: every allocation is charged to the budget and released when
// freed; a refused charge allocates nothing; ops, copies and streams reach the inner backend
// and compute what it computes.
#include "kernels/budgeted_backend.h"

#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/registry.h"
#include "tests/testutil/random_fill.h"

namespace kvtier {
namespace {

using testing::TypedBuffer;

// Holds at most `limit` bytes.
class CountingBudget final : public MemoryBudget {
 public:
  explicit CountingBudget(size_t limit) : limit_(limit) {}
  absl::Status Charge(size_t bytes) override {
    if (used_ + bytes > limit_) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("budget: %d bytes wanted, %d of %d free", bytes, limit_ - used_, limit_));
    }
    used_ += bytes;
    return absl::OkStatus();
  }
  void Release(size_t bytes) override { used_ -= bytes; }
  size_t used() const { return used_; }

 private:
  const size_t limit_;
  size_t used_ = 0;
};

std::unique_ptr<Backend> Cpu() {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(DeviceKind::kCpu, {.cpu_threads = 2});
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

TEST(BudgetedBackendTest, ChargesEveryAllocationUntilItIsFreed) {
  std::unique_ptr<Backend> cpu = Cpu();
  CountingBudget budget(1 << 20);
  std::unique_ptr<Backend> b = NewBudgetedBackend(*cpu, budget);
  {
    absl::StatusOr<DeviceBuffer> x = b->Allocate(1000);
    absl::StatusOr<DeviceBuffer> y = b->Allocate(24);
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_EQ(budget.used(), 1024u);
    x->Reset();
    EXPECT_EQ(budget.used(), 24u);
  }
  EXPECT_EQ(budget.used(), 0u);
  absl::StatusOr<DeviceBuffer> too_big = b->Allocate((1 << 20) + 1);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(budget.used(), 0u);
}

TEST(BudgetedBackendTest, OpsAndCopiesReachTheInnerBackend) {
  std::unique_ptr<Backend> cpu = Cpu();
  CountingBudget budget(1 << 20);
  std::unique_ptr<Backend> b = NewBudgetedBackend(*cpu, budget);
  absl::StatusOr<std::unique_ptr<Stream>> s = b->CreateStream();
  ASSERT_TRUE(s.ok());
  // A copy through budgeted memory, and cosines of two query sets against the inner backend.
  TypedBuffer q(DType::kF32, 4 * 8), qp(DType::kF32, 4 * 8);
  q.FillNormal(1);
  qp.FillNormal(2);
  absl::StatusOr<DeviceBuffer> dq = b->Allocate(q.bytes());
  ASSERT_TRUE(dq.ok());
  ASSERT_TRUE(b->Copy(**s, dq->data(), q.data(), q.bytes()).ok());
  std::vector<float> via(2), direct(2);
  std::vector<uint8_t> drift_via(2), drift_direct(2);
  QueryCosineArgs a;
  a.shape = {.dtype = DType::kF32, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 8};
  a.batch = 1;
  a.q = dq->data();
  a.q_prev = qp.data();
  a.threshold = 0.5f;
  a.group_mean = via.data();
  a.drifted = drift_via.data();
  ASSERT_TRUE(b->QueryCosine(**s, a).ok());
  ASSERT_TRUE((*s)->Synchronize().ok());
  a.q = q.data();
  a.group_mean = direct.data();
  a.drifted = drift_direct.data();
  absl::StatusOr<std::unique_ptr<Stream>> s2 = cpu->CreateStream();
  ASSERT_TRUE(s2.ok());
  ASSERT_TRUE(cpu->QueryCosine(**s2, a).ok());
  ASSERT_TRUE((*s2)->Synchronize().ok());
  EXPECT_EQ(via, direct);
  EXPECT_EQ(drift_via, drift_direct);
  EXPECT_EQ(std::memcmp(dq->data(), q.data(), q.bytes()), 0);
  // The selection loss too: (0.8 − 0.2) / 0.8 of the mass is lost.
  const std::vector<float> pooled = {0.5f, 0.3f, 0.1f, 0.1f};
  const std::vector<int32_t> current = {2, 3}, fresh = {0, 1};
  float loss = -1.0f;
  SelectionLossArgs la;
  la.shape.num_kv_heads = 1;
  la.batch = 1;
  la.max_pages = 4;
  la.k = 2;
  la.pooled = pooled.data();
  la.current = current.data();
  la.fresh = fresh.data();
  la.loss = &loss;
  ASSERT_TRUE(b->SelectionLoss(**s, la).ok());
  ASSERT_TRUE((*s)->Synchronize().ok());
  EXPECT_NEAR(loss, 0.75f, 1e-6f);
}

}  // namespace
}  // namespace kvtier
