// Target parsing, the gRPC ↔ absl status mapping and the per-call context (client/rpc_util.h).
#include "client/rpc_util.h"

#include <string>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(ParseTargetTest, UnixUriWithEmptyAuthorityIsAnAbsolutePath) {
  absl::StatusOr<ParsedTarget> t = ParseTarget("unix:///run/kvtier/kvtierd.sock");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->grpc_target, "unix:/run/kvtier/kvtierd.sock");
  EXPECT_EQ(t->unix_path, "/run/kvtier/kvtierd.sock");
}

TEST(ParseTargetTest, UnixWithoutSlashesKeepsAbsoluteAndRelativePaths) {
  absl::StatusOr<ParsedTarget> abs = ParseTarget("unix:/tmp/k.sock");
  ASSERT_TRUE(abs.ok()) << abs.status();
  EXPECT_EQ(abs->grpc_target, "unix:/tmp/k.sock");
  absl::StatusOr<ParsedTarget> rel = ParseTarget("unix:run/k.sock");
  ASSERT_TRUE(rel.ok()) << rel.status();
  EXPECT_EQ(rel->grpc_target, "unix:run/k.sock");
  EXPECT_EQ(rel->unix_path, "run/k.sock");
}

TEST(ParseTargetTest, HostPortIsPassedThrough) {
  for (const char* target : {"localhost:50051", "10.0.0.7:1", "[::1]:65535"}) {
    absl::StatusOr<ParsedTarget> t = ParseTarget(target);
    ASSERT_TRUE(t.ok()) << target << ": " << t.status();
    EXPECT_EQ(t->grpc_target, target);
    EXPECT_TRUE(t->unix_path.empty());
  }
}

TEST(ParseTargetTest, MalformedTargetsAreInvalidArgumentNamingTheTarget) {
  for (const char* target : {"", "unix:", "unix://", "unix://host/path", "localhost", ":80",
                             "host:", "host:0", "host:65536", "host:80x", "::1:80", "a/b:80"}) {
    absl::StatusOr<ParsedTarget> t = ParseTarget(target);
    ASSERT_FALSE(t.ok()) << target;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << target;
    EXPECT_NE(t.status().message().find(std::string("\"") + target + "\""), std::string::npos)
        << t.status();
  }
}

TEST(StatusMappingTest, EveryCanonicalCodeMapsOneToOneBothWays) {
  for (int code = 0; code <= 16; ++code) {
    const auto absl_code = static_cast<absl::StatusCode>(code);
    const absl::Status a(absl_code, code == 0 ? "" : "what went wrong");
    const grpc::Status g = ToGrpcStatus(a);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    const absl::Status back = FromGrpcStatus(g);
    EXPECT_EQ(back, a) << code;
  }
  EXPECT_EQ(static_cast<int>(grpc::StatusCode::PERMISSION_DENIED),
            static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(static_cast<int>(grpc::StatusCode::UNAUTHENTICATED),
            static_cast<int>(absl::StatusCode::kUnauthenticated));
}

TEST(StatusMappingTest, MessagesPassThrough) {
  const grpc::Status g(grpc::StatusCode::RESOURCE_EXHAUSTED, "quota: 64 MiB");
  const absl::Status a = FromGrpcStatus(g);
  EXPECT_EQ(a.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(a.message(), "quota: 64 MiB");
}

TEST(CallContextTest, CarriesADeadline) {
  auto ctx = NewCallContext("a", "ta", absl::Seconds(5));
  const auto deadline = absl::FromChrono(ctx->deadline());
  EXPECT_GT(deadline, absl::Now());
  EXPECT_LE(deadline, absl::Now() + absl::Seconds(5));
  auto forever = NewCallContext("a", "", absl::InfiniteDuration());
  EXPECT_GT(absl::FromChrono(forever->deadline()), absl::Now() + absl::Hours(24 * 365));
}

}  // namespace
}  // namespace kvtier
