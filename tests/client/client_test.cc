// Client and C API behaviour that needs no daemon: bad targets, nothing listening, the C
// API's handles and error reporting. With a daemon: tests/client/service_integration_test.cc.
#include "kvtier/client.h"

#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <string>

#include "client/c_api_internal.h"
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

TEST(CApiAbiTest, InitSetsTheSizeAndTheLibrarySaysItsVersion) {
  EXPECT_EQ(kvtier_abi_version(), KVTIER_ABI_VERSION);
  kvtier_client_options co;
  kvtier_client_options_init(&co);
  kvtier_session_options so;
  kvtier_session_options_init(&so);
  kvtier_sequence_options qo;
  kvtier_sequence_options_init(&qo);
  EXPECT_EQ(co.struct_size, sizeof(co));
  EXPECT_EQ(so.struct_size, sizeof(so));
  EXPECT_EQ(qo.struct_size, sizeof(qo));
}

// kvtier_last_error() holds `part`.
void ExpectLastErrorHas(const std::string& part) {
  EXPECT_NE(std::string(kvtier_last_error()).find(part), std::string::npos) << kvtier_last_error();
}

// A caller's struct as a newer header would lay it out: this library's struct, then a field
// it does not know.
struct NewerSequenceOptions {
  kvtier_sequence_options known;
  int64_t added;
};

class CApiAbiSequenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(kvtier_device_create(KVTIER_DEVICE_CPU, &device_), KVTIER_OK) << kvtier_last_error();
    geometry_ = {1, 2, 1, 16, 16, KVTIER_DTYPE_F32};
  }
  void TearDown() override { kvtier_device_free(device_); }

  // kvtier_sequence_create's code for `o`, the sequence freed when made.
  int Create(const kvtier_sequence_options* o) {
    kvtier_sequence* s = nullptr;
    const int rc = kvtier_sequence_create(device_, &geometry_, o, &s);
    EXPECT_EQ(rc == KVTIER_OK, s != nullptr);
    kvtier_sequence_free(s);
    return rc;
  }

  kvtier_device* device_ = nullptr;
  kvtier_geometry geometry_{};
};

TEST_F(CApiAbiSequenceTest, StructNotMadeByInitIsRefused) {
  kvtier_sequence_options o;
  kvtier_sequence_options_init(&o);
  o.budget_tokens = 64;
  o.max_tokens = 256;
  ASSERT_EQ(Create(&o), KVTIER_OK) << kvtier_last_error();
  o.struct_size = 0;
  EXPECT_EQ(Create(&o), KVTIER_INVALID_ARGUMENT);
  EXPECT_STREQ(kvtier_last_error(),
               "kvtier_sequence_options.struct_size = 0: fill the struct with "
               "kvtier_sequence_options_init, which sets it");
  o.struct_size = 8;
  EXPECT_EQ(Create(&o), KVTIER_INVALID_ARGUMENT);
  ExpectLastErrorHas("kvtier_sequence_options.struct_size = 8: the smallest "
                     "kvtier_sequence_options this library reads is " +
                     std::to_string(sizeof(kvtier_sequence_options)) + " bytes");
}

TEST_F(CApiAbiSequenceTest, NewerHeaderIsReadWhenItsNewFieldsAreZero) {
  NewerSequenceOptions n;
  std::memset(&n, 0, sizeof(n));
  kvtier_sequence_options_init(&n.known);
  n.known.struct_size = sizeof(n);
  n.known.budget_tokens = 64;
  n.known.max_tokens = 256;
  EXPECT_EQ(Create(&n.known), KVTIER_OK) << kvtier_last_error();
  n.added = 1;
  EXPECT_EQ(Create(&n.known), KVTIER_INVALID_ARGUMENT);
  ExpectLastErrorHas("sets a field this library does not know (byte " +
                     std::to_string(offsetof(NewerSequenceOptions, added)) + "; it knows " +
                     std::to_string(sizeof(kvtier_sequence_options)) + " bytes");
}

TEST(CApiAbiTest, ClientOptionsNotMadeByInitAreRefusedBeforeConnecting) {
  kvtier_client_options o;
  std::memset(&o, 0, sizeof(o));
  kvtier_client* c = nullptr;
  const std::string target = "unix://" + MissingSocket();
  EXPECT_EQ(kvtier_connect(target.c_str(), &o, &c), KVTIER_INVALID_ARGUMENT);
  ExpectLastErrorHas("kvtier_client_options.struct_size = 0");
  EXPECT_EQ(c, nullptr);
}

// An older header's struct (here: one that ended after `recall`) gets the library's defaults
// for the fields it lacks, whatever the bytes past its size hold.
TEST(CApiAbiTest, OlderHeaderGetsTheDefaultsForTheFieldsItLacks) {
  kvtier_sequence_options defaults;
  kvtier_sequence_options_init(&defaults);
  kvtier_sequence_options older;
  std::memset(&older, 0x5a, sizeof(older));
  const size_t older_size = offsetof(kvtier_sequence_options, capture_graphs);
  older.struct_size = static_cast<uint32_t>(older_size);
  older.mode = KVTIER_MODE_SYNC;
  older.budget_tokens = 512;
  const auto read_older = [&] {
    return c_api::ReadOptions(older, kvtier_sequence_options_init, older_size,
                              "kvtier_sequence_options");
  };
  absl::StatusOr<kvtier_sequence_options> read = read_older();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->struct_size, sizeof(kvtier_sequence_options));
  EXPECT_EQ(read->mode, KVTIER_MODE_SYNC);
  EXPECT_EQ(read->budget_tokens, 512);
  EXPECT_EQ(read->capture_graphs, defaults.capture_graphs);
  EXPECT_EQ(read->compute_stream, nullptr);
  EXPECT_EQ(read->summary, defaults.summary);
  EXPECT_EQ(read->split, 0);
  EXPECT_EQ(read->recent_pages, defaults.recent_pages);
  // One byte short of that older size is below every size the reader accepts.
  older.struct_size = static_cast<uint32_t>(older_size - 1);
  EXPECT_EQ(read_older().status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
