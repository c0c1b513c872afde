// Client and C API behaviour that needs no daemon: bad targets, nothing listening, the C
// API's handles and error reporting. With a daemon: tests/client/service_integration_test.cc.
#include "kvtier/client.h"

#include <unistd.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "kvtier/c_api.h"

extern "C" int kvtier_c_api_compile_check(void);

namespace kvtier {
namespace {

std::string MissingSocket() {
  return ::testing::TempDir() + "kvtier-no-daemon-" + std::to_string(getpid()) + ".sock";
}

TEST(ClientConnectTest, MalformedTargetIsInvalidArgument) {
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect("localhost");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
}

TEST(ClientConnectTest, NothingListeningIsUnavailable) {
  ClientOptions o;
  o.rpc_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect("unix://" + MissingSocket(), o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
}

TEST(ClientConnectTest, BadOptionsAreInvalidArgument) {
  ClientOptions o;
  o.rpc_timeout = absl::ZeroDuration();
  EXPECT_EQ(Client::Connect("unix:" + MissingSocket(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = ClientOptions();
  o.tenant = "";
  EXPECT_EQ(Client::Connect("unix:" + MissingSocket(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TransportNameTest, NamesBoth) {
  EXPECT_EQ(TransportName(Transport::kShm), "shm");
  EXPECT_EQ(TransportName(Transport::kGrpc), "grpc");
}

TEST(CApiTest, HeaderCompilesAsCAndRefusesNullArguments) {
  EXPECT_EQ(kvtier_c_api_compile_check(), 0) << kvtier_last_error();
}

TEST(CApiTest, ReturnCodesAreCanonicalAndTheLastErrorIsPerCall) {
  kvtier_client_options o;
  kvtier_client_options_init(&o);
  o.rpc_timeout_ms = 5000;
  kvtier_client* c = nullptr;
  const std::string target = "unix://" + MissingSocket();
  EXPECT_EQ(kvtier_connect(target.c_str(), &o, &c), KVTIER_UNAVAILABLE);
  EXPECT_EQ(c, nullptr);
  EXPECT_NE(std::string(kvtier_last_error()).find(MissingSocket()), std::string::npos)
      << kvtier_last_error();
  EXPECT_EQ(kvtier_connect("no-port", nullptr, &c), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::strlen(kvtier_last_error()), 0u);
  kvtier_client_free(nullptr);
  kvtier_session_free(nullptr);
}

TEST(CApiTest, SessionOptionsDefaultsMatchTheCppDefaults) {
  kvtier_session_options o;
  kvtier_session_options_init(&o);
  const SequenceOptions cpp;
  EXPECT_EQ(o.budget_tokens, cpp.budget_pages() * 32);
  EXPECT_FLOAT_EQ(o.correction_threshold, cpp.correction_threshold);
  EXPECT_EQ(o.correction_trigger, static_cast<int32_t>(cpp.correction_trigger));
  EXPECT_EQ(o.correction_trigger, KVTIER_CORRECTION_TRIGGER_COSINE);
  EXPECT_FLOAT_EQ(o.correction_max_loss, cpp.correction_max_loss);
  EXPECT_EQ(o.mode, static_cast<int32_t>(cpp.mode));
  EXPECT_EQ(o.transport, KVTIER_TRANSPORT_SHM);
  EXPECT_NE(std::string(kvtier_version()).find("protocol 1"), std::string::npos);
}

}  // namespace
}  // namespace kvtier
