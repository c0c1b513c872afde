// Every case of the op table (tests/kernels/op_cases.h) on every backend this build has,
// against the CPU reference backend. The cpu parameter runs another CPU backend (with a
// different thread count, so work is split differently); cpuscalar one whose per-ISA ops run
// the scalar reference loops (NewCpuBackend with cpu::Isa::kScalar, what `kvtier-bench ops`
// times as its baseline) where the reference runs the vectorised kernels; the cuda parameter
// skips itself when no CUDA device is usable.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/registry.h"
#include "tests/kernels/op_cases.h"

namespace kvtier::testing {
namespace {

enum class Under { kCpu, kCpuScalar, kCuda };

struct Param {
  Under under;
  size_t index;  // into OpCases()
};

std::vector<Param> AllParams() {
  std::vector<Param> out;
  for (const Under under : {Under::kCpu, Under::kCpuScalar, Under::kCuda}) {
    for (size_t i = 0; i < OpCases().size(); ++i) out.push_back({under, i});
  }
  return out;
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const Under u = info.param.under;
  return absl::StrCat(u == Under::kCpu ? "cpu_" : u == Under::kCpuScalar ? "cpuscalar_" : "cuda_",
                      OpCases()[info.param.index].name);
}

// One backend of each kind for the whole run: the reference, and the backends under test.
Backend& Reference() {
  static Backend* const backend = CreateBackend(DeviceKind::kCpu).value().release();
  return *backend;
}
Backend& UnderTest(Under under) {
  static Backend* const cpu =
      CreateBackend(DeviceKind::kCpu, DeviceOptions{.cpu_threads = 3}).value().release();
  static Backend* const scalar = NewCpuBackend(3, cpu::Isa::kScalar).release();
  if (under == Under::kCpu) return *cpu;
  if (under == Under::kCpuScalar) return *scalar;
  static Backend* const cuda = CreateBackend(DeviceKind::kCuda).value().release();
  return *cuda;
}

class BackendOpsTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (GetParam().under == Under::kCuda && CudaDeviceCount() == 0) {
      GTEST_SKIP() << (CudaBackendBuilt() ? "no usable CUDA device"
                                          : "built without the CUDA backend");
    }
  }
};

// The statuses a run must show: the op accepted, and the stream as the case expects.
void ExpectStatuses(const OpRun& run, const OpResult& result, const std::string& who) {
  EXPECT_TRUE(result.enqueue.ok()) << who << ": " << result.enqueue;
  EXPECT_EQ(result.run.code(), run.run_code) << who << ": " << result.run;
  EXPECT_TRUE(absl::StrContains(result.run.message(), run.run_message))
      << who << ": " << result.run << " should name \"" << run.run_message << "\"";
}

TEST_P(BackendOpsTest, MatchesTheCpuReference) {
  const OpRun run = OpCases()[GetParam().index].make();
  const absl::StatusOr<OpResult> want = RunOn(Reference(), run.in, run.op);
  ASSERT_TRUE(want.ok()) << "reference: " << want.status();
  const absl::StatusOr<OpResult> got = RunOn(UnderTest(GetParam().under), run.in, run.op);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectStatuses(run, *want, "reference");
  ExpectStatuses(run, *got, "backend");
  if (HasFailure() || !run.check) return;
  run.check(run.in, *want, *got);
}

// gtest refuses duplicate parameter names, so the case names are checked unique here too.
INSTANTIATE_TEST_SUITE_P(Table, BackendOpsTest, ::testing::ValuesIn(AllParams()), ParamName);

// The alignment contract of sparse attention (kAttentionAlignment), checked when the op is
// enqueued on every backend: a cache view off its 16-byte alignment is refused, naming the
// field, instead of being read by a slow path.
TEST(BackendOpsContractTest, MisalignedCachesAreRefused) {
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(DeviceKind::kCpu);
  ASSERT_TRUE(be.ok()) << be.status();
  std::unique_ptr<Stream> s = (*be)->CreateStream().value();
  const KvShape shape{DType::kF16, 4, 2, 16, 8};
  const size_t slot = size_t{8} * 2 * 16 * 2;
  DeviceBuffer k = (*be)->Allocate(4 * slot + 64).value(), v = (*be)->Allocate(4 * slot + 64).value();
  DeviceBuffer small = (*be)->Allocate(4096).value();
  std::memset(small.data(), 0, small.size());
  std::vector<int32_t> table(2 * 4 + 10, -1);  // empty slot tables; no partial page
  table[17] = 0;                              // its length
  std::memcpy(small.data(), table.data(), table.size() * sizeof(int32_t));
  SparseAttentionArgs a;
  a.shape = shape;
  a.kv.k_cache = k.data();
  a.kv.v_cache = v.data();
  a.kv.num_slots = 4;
  a.kv.slot_table = small.as<int32_t>();
  a.kv.partial_page = small.as<int32_t>() + 16;
  a.kv.partial_len = small.as<int32_t>() + 17;
  a.batch = 1;
  a.q = small.as<uint8_t>() + 256;
  a.out = small.as<uint8_t>() + 512;
  ASSERT_TRUE((*be)->SparseAttention(*s, a).ok());
  a.kv.k_cache = k.as<uint8_t>() + 2;  // one fp16 element off
  absl::Status st = (*be)->SparseAttention(*s, a);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "kv.k_cache")) << st;
  a.kv.k_cache = k.data();
  a.kv.v_cache = v.as<uint8_t>() + 8;
  st = (*be)->SparseAttention(*s, a);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "kv.v_cache")) << st;
  EXPECT_TRUE(s->Synchronize().ok());
}

}  // namespace
}  // namespace kvtier::testing
