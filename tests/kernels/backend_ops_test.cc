// Every case of the op table (tests/kernels/op_cases.h) on every backend this build has,
// against the CPU reference backend. The cpu parameter runs another CPU backend (with a
// different thread count, so work is split differently); the cuda parameter skips itself
// when no CUDA device is usable.
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/registry.h"
#include "tests/kernels/op_cases.h"

namespace kvtier::testing {
namespace {

struct Param {
  DeviceKind kind;
  size_t index;  // into OpCases()
};

std::vector<Param> AllParams() {
  std::vector<Param> out;
  for (const DeviceKind kind : {DeviceKind::kCpu, DeviceKind::kCuda}) {
    for (size_t i = 0; i < OpCases().size(); ++i) out.push_back({kind, i});
  }
  return out;
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  return absl::StrCat(info.param.kind == DeviceKind::kCpu ? "cpu_" : "cuda_",
                      OpCases()[info.param.index].name);
}

// One backend of each kind for the whole run: the reference, and the backends under test.
Backend& Reference() {
  static Backend* const backend = CreateBackend(DeviceKind::kCpu).value().release();
  return *backend;
}
Backend& UnderTest(DeviceKind kind) {
  static Backend* const cpu =
      CreateBackend(DeviceKind::kCpu, DeviceOptions{.cpu_threads = 3}).value().release();
  if (kind == DeviceKind::kCpu) return *cpu;
  static Backend* const cuda = CreateBackend(DeviceKind::kCuda).value().release();
  return *cuda;
}

class BackendOpsTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (GetParam().kind == DeviceKind::kCuda && CudaDeviceCount() == 0) {
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
  const absl::StatusOr<OpResult> got = RunOn(UnderTest(GetParam().kind), run.in, run.op);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectStatuses(run, *want, "reference");
  ExpectStatuses(run, *got, "backend");
  if (HasFailure() || !run.check) return;
  run.check(run.in, *want, *got);
}

// gtest refuses duplicate parameter names, so the case names are checked unique here too.
INSTANTIATE_TEST_SUITE_P(Table, BackendOpsTest, ::testing::ValuesIn(AllParams()), ParamName);

}  // namespace
}  // namespace kvtier::testing
