// The chaos backend (tests/testutil/chaos_backend.h): a two-stream pipeline ordered by
// events stays correct under random delays, the same pipeline reads stale data when the
// backend drops waits (so the chaos backend can catch missing ordering), and ops give
// the plain CPU backend's results bit for bit.
#include "tests/testutil/chaos_backend.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "core/status.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::testing {
namespace {

constexpr size_t kBytes = 64 << 10;

// `rounds` rounds of a producer/consumer pipeline on two streams, enqueued all at once:
// stream A (stalled by `producer_stall` first) memsets a staging buffer to the round's
// byte, copies it into `shared` and records `produced`; stream B waits for that, copies
// `shared` out to the round's host buffer and records `consumed`, which A waits for
// before the next round overwrites `shared`. Returns how many rounds read anything but
// their own byte.
absl::StatusOr<int> StaleRounds(Backend& backend, int rounds, absl::Duration producer_stall) {
  KVTIER_ASSIGN_OR_RETURN(auto a, backend.CreateStream());
  KVTIER_ASSIGN_OR_RETURN(auto b, backend.CreateStream());
  KVTIER_ASSIGN_OR_RETURN(auto produced, backend.CreateEvent());
  KVTIER_ASSIGN_OR_RETURN(auto consumed, backend.CreateEvent());
  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer staging, backend.Allocate(kBytes));
  KVTIER_ASSIGN_OR_RETURN(DeviceBuffer shared, backend.Allocate(kBytes));
  KVTIER_RETURN_IF_ERROR(backend.Memset(*a, shared.data(), 0, kBytes));
  KVTIER_RETURN_IF_ERROR(a->Synchronize());
  std::vector<std::vector<uint8_t>> out(static_cast<size_t>(rounds), std::vector<uint8_t>(kBytes));
  auto byte_of = [](int r) { return static_cast<uint8_t>(1 + r % 255); };
  for (int r = 0; r < rounds; ++r) {
    if (producer_stall > absl::ZeroDuration()) {
      KVTIER_RETURN_IF_ERROR(EnqueueStall(backend, *a, producer_stall));
    }
    KVTIER_RETURN_IF_ERROR(a->Wait(*consumed));
    KVTIER_RETURN_IF_ERROR(backend.Memset(*a, staging.data(), byte_of(r), kBytes));
    KVTIER_RETURN_IF_ERROR(backend.Copy(*a, shared.data(), staging.data(), kBytes));
    KVTIER_RETURN_IF_ERROR(a->Record(*produced));
    KVTIER_RETURN_IF_ERROR(b->Wait(*produced));
    KVTIER_RETURN_IF_ERROR(
        backend.Copy(*b, out[static_cast<size_t>(r)].data(), shared.data(), kBytes));
    KVTIER_RETURN_IF_ERROR(b->Record(*consumed));
  }
  KVTIER_RETURN_IF_ERROR(a->Synchronize());
  KVTIER_RETURN_IF_ERROR(b->Synchronize());
  int stale = 0;
  for (int r = 0; r < rounds; ++r) {
    const std::vector<uint8_t>& got = out[static_cast<size_t>(r)];
    for (uint8_t byte : got) {
      if (byte != byte_of(r)) {
        ++stale;
        break;
      }
    }
  }
  return stale;
}

ChaosOptions Options(uint64_t seed, bool drop_waits) {
  ChaosOptions o;
  o.seed = seed;
  o.max_delay = absl::Microseconds(300);
  o.drop_waits = drop_waits;
  o.threads = 2;
  return o;
}

TEST(ChaosBackendTest, PipelineOrderedByEventsIsCorrectUnderChaos) {
  constexpr int kRounds = 200;
  auto backend = NewChaosBackend(Options(7, /*drop_waits=*/false));
  absl::StatusOr<int> stale = StaleRounds(*backend, kRounds, absl::ZeroDuration());
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_EQ(*stale, 0);
  // The initial memset, then per round: memset, copy, record on A; copy, record on B.
  const ChaosStats stats = GetChaosStats(*backend);
  EXPECT_EQ(stats.tasks_run, 1 + 5 * kRounds);
  EXPECT_GT(stats.injected_delay, absl::ZeroDuration());
  EXPECT_LE(stats.injected_delay, stats.tasks_run * absl::Microseconds(300));
}

TEST(ChaosBackendTest, PipelineOrderedByEventsSurvivesASlowProducer) {
  auto backend = NewChaosBackend(Options(8, /*drop_waits=*/false));
  absl::StatusOr<int> stale = StaleRounds(*backend, 4, absl::Milliseconds(20));
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_EQ(*stale, 0);
}

TEST(ChaosBackendTest, DroppedWaitsAreCaughtAsStaleReads) {
  // The consumer ignores the producer's event, so it copies `shared` while the producer
  // sleeps through a 20 ms stall: every round should read stale data; one is enough.
  auto backend = NewChaosBackend(Options(9, /*drop_waits=*/true));
  absl::StatusOr<int> stale = StaleRounds(*backend, 4, absl::Milliseconds(20));
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_GT(*stale, 0);
}

TEST(ChaosBackendTest, SameSeedInjectsTheSameDelays) {
  auto run = [](uint64_t seed) {
    auto backend = NewChaosBackend(Options(seed, /*drop_waits=*/false));
    EXPECT_TRUE(StaleRounds(*backend, 10, absl::ZeroDuration()).ok());
    return GetChaosStats(*backend).injected_delay;
  };
  const absl::Duration first = run(3);
  EXPECT_EQ(run(3), first);
  EXPECT_NE(run(4), first);
}

// DenseAttention on random f16 input; the chaos run uploads on one stream and computes
// on another, ordered by an event.
class DenseAttentionCase {
 public:
  static constexpr int32_t kB = 2, kHq = 8, kHkv = 2, kD = 64, kT = 300;
  DenseAttentionCase()
      : q_(DType::kF16, int64_t{kB} * kHq * kD),
        k_(DType::kF16, int64_t{kB} * kT * kHkv * kD),
        v_(DType::kF16, int64_t{kB} * kT * kHkv * kD) {
    q_.FillNormal(1);
    k_.FillNormal(2);
    v_.FillNormal(3);
  }

  DenseAttentionArgs Args(const void* q, const void* k, const void* v, const int32_t* len,
                          void* out, float* lse) const {
    DenseAttentionArgs a;
    a.shape = {.dtype = DType::kF16, .num_q_heads = kHq, .num_kv_heads = kHkv, .head_dim = kD};
    a.batch = kB;
    a.max_tokens = kT;
    a.q = q;
    a.k = k;
    a.v = v;
    a.seq_len = len;
    a.softmax_scale = 0.125f;
    a.out = out;
    a.lse = lse;
    return a;
  }

  TypedBuffer q_, k_, v_;
  const int32_t len_[kB] = {kT, 177};
};

TEST(ChaosBackendTest, DenseAttentionMatchesTheCpuBackendBitForBit) {
  const DenseAttentionCase c;
  using C = DenseAttentionCase;
  TypedBuffer want(DType::kF16, int64_t{C::kB} * C::kHq * C::kD);
  std::vector<float> want_lse(C::kB * C::kHq);
  {
    auto cpu = NewCpuBackend(2);
    auto s = std::move(cpu->CreateStream()).value();
    ASSERT_TRUE(cpu->DenseAttention(*s, c.Args(c.q_.data(), c.k_.data(), c.v_.data(), c.len_,
                                               want.data(), want_lse.data()))
                    .ok());
    ASSERT_TRUE(s->Synchronize().ok());
  }

  auto chaos = NewChaosBackend(Options(11, /*drop_waits=*/false));
  auto upload = std::move(chaos->CreateStream()).value();
  auto compute = std::move(chaos->CreateStream()).value();
  auto uploaded = std::move(chaos->CreateEvent()).value();
  DeviceBuffer q = std::move(chaos->Allocate(c.q_.bytes())).value();
  DeviceBuffer k = std::move(chaos->Allocate(c.k_.bytes())).value();
  DeviceBuffer v = std::move(chaos->Allocate(c.v_.bytes())).value();
  DeviceBuffer len = std::move(chaos->Allocate(sizeof(c.len_))).value();
  DeviceBuffer out = std::move(chaos->Allocate(want.bytes())).value();
  DeviceBuffer lse = std::move(chaos->Allocate(want_lse.size() * sizeof(float))).value();
  ASSERT_TRUE(chaos->Copy(*upload, q.data(), c.q_.data(), q.size()).ok());
  ASSERT_TRUE(chaos->Copy(*upload, k.data(), c.k_.data(), k.size()).ok());
  ASSERT_TRUE(chaos->Copy(*upload, v.data(), c.v_.data(), v.size()).ok());
  ASSERT_TRUE(chaos->Copy(*upload, len.data(), c.len_, len.size()).ok());
  ASSERT_TRUE(upload->Record(*uploaded).ok());
  ASSERT_TRUE(compute->Wait(*uploaded).ok());
  ASSERT_TRUE(chaos->Memset(*compute, out.data(), 0xff, out.size()).ok());
  ASSERT_TRUE(chaos
                  ->DenseAttention(*compute, c.Args(q.data(), k.data(), v.data(), len.as<int32_t>(),
                                                    out.data(), lse.as<float>()))
                  .ok());
  TypedBuffer got(DType::kF16, want.size());
  std::vector<float> got_lse(want_lse.size());
  ASSERT_TRUE(chaos->Copy(*compute, got.data(), out.data(), out.size()).ok());
  ASSERT_TRUE(chaos->Copy(*compute, got_lse.data(), lse.data(), lse.size()).ok());
  ASSERT_TRUE(compute->Synchronize().ok());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.bytes()), 0);
  EXPECT_EQ(std::memcmp(got_lse.data(), want_lse.data(), lse.size()), 0);
}

TEST(ChaosBackendTest, RunTimeErrorsAreStickyAndTravelThroughEvents) {
  auto backend = NewChaosBackend(Options(12, /*drop_waits=*/false));
  auto s1 = std::move(backend->CreateStream()).value();
  auto s2 = std::move(backend->CreateStream()).value();
  auto ev = std::move(backend->CreateEvent()).value();
  std::vector<uint16_t> host(2 * 16 * 64), cache(2 * 16 * 64);
  const RecallItem item{/*host_page=*/5, /*kv_head=*/0, /*dst_slot=*/0};  // page 5 of 1
  RecallArgs a;
  a.shape = {.dtype = DType::kF16, .num_kv_heads = 1, .head_dim = 64, .page_size = 16};
  a.host_pages = host.data();
  a.num_host_pages = 1;
  a.items = &item;
  a.num_items = 1;
  a.kv = {.k_cache = cache.data(), .v_cache = cache.data() + 16 * 64, .num_slots = 1};
  int x = 0, y = 9, z = 0;
  ASSERT_TRUE(backend->Recall(*s1, a).ok());                  // fails when it runs
  ASSERT_TRUE(backend->Copy(*s1, &x, &y, sizeof(int)).ok());  // skipped
  ASSERT_TRUE(s1->Record(*ev).ok());
  ASSERT_TRUE(s2->Wait(*ev).ok());
  ASSERT_TRUE(backend->Copy(*s2, &z, &y, sizeof(int)).ok());  // skipped too
  EXPECT_EQ(s1->Synchronize().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(ev->Wait().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(s2->Synchronize().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(x, 0);
  EXPECT_EQ(z, 0);
}

TEST(ChaosBackendTest, RejectsBadShapesAndForeignStreams) {
  auto chaos = NewChaosBackend(Options(13, /*drop_waits=*/false));
  auto cpu = NewCpuBackend(1);
  auto chaos_stream = std::move(chaos->CreateStream()).value();
  auto cpu_stream = std::move(cpu->CreateStream()).value();
  EXPECT_EQ(chaos->DenseAttention(*chaos_stream, DenseAttentionArgs{}).code(),
            absl::StatusCode::kInvalidArgument);
  int x = 0, y = 1;
  EXPECT_EQ(chaos->Copy(*cpu_stream, &x, &y, sizeof(int)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EnqueueStall(*cpu, *cpu_stream, absl::Milliseconds(1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EnqueueStall(*chaos, *cpu_stream, absl::Milliseconds(1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(chaos->kind(), DeviceKind::kCpu);
  EXPECT_EQ(GetChaosStats(*chaos).tasks_run, 0);
}

}  // namespace
}  // namespace kvtier::testing
