// KvTierService over a real in-process gRPC server on a Unix socket, called through the
// generated stub: Hello and the protocol version, metadata authentication, Offload → Fetch,
// Step, error codes over the wire, a cancelled Offload stream, the message size limit and
// Drain.
#include "daemon/kvtier_service.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "spdlog/spdlog.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::daemon {
namespace {

using ::testing::HasSubstr;
using ::testing::SizeIs;
using testing::TypedBuffer;

constexpr uint64_t kMaxMessageBytes = 64 << 10;

DaemonConfig TestConfig() {
  DaemonConfig c;
  c.admin_token = "admin-secret";
  c.cpu_threads = 2;
  c.max_message_bytes = kMaxMessageBytes;
  c.max_sessions_per_tenant = 4;
  c.max_tokens_per_session = 1024;
  c.default_max_tokens = 256;
  c.max_layers = 8;
  c.max_tokens_per_offload = 256;
  c.attach_socket = "/run/kvtier/test.attach";
  for (const char* name : {"a", "b"}) {
    TenantConfig t;
    t.name = name;
    t.token = std::string("tok-") + name;
    t.host_memory_bytes = 8 << 20;
    t.hugepages = "off";
    t.lock = false;
    c.tenants.push_back(t);
  }
  return c;
}

v1::Geometry SmallGeometry() {
  v1::Geometry g;
  g.set_num_layers(2);
  g.set_num_q_heads(4);
  g.set_num_kv_heads(2);
  g.set_head_dim(16);
  g.set_page_size(8);
  g.set_dtype(v1::DTYPE_FP32);
  return g;
}

constexpr size_t kTokenBytes = 2 * 16 * 4;  // Hkv · d · fp32
constexpr size_t kPageBytes = 8 * 2 * kTokenBytes;

class KvTierServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    config_ = TestConfig();
    absl::StatusOr<std::unique_ptr<SessionManager>> m = SessionManager::Create(config_);
    ASSERT_TRUE(m.ok()) << m.status();
    manager_ = *std::move(m);
    absl::StatusOr<std::unique_ptr<WorkQueue>> work = WorkQueue::Create(WorkOptions());
    ASSERT_TRUE(work.ok()) << work.status();
    work_ = *std::move(work);
    service_ = std::make_unique<KvTierService>(*manager_, *work_, config_);
    char dir[] = "/tmp/kvtier-service-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/kvtierd-" + std::to_string(getpid()) + ".sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    builder.SetMaxReceiveMessageSize(static_cast<int>(config_.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(config_.max_message_bytes));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::KvTier::NewStub(
        grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    server_.reset();
    if (work_ != nullptr) work_->Shutdown();
    service_.reset();
    work_.reset();
    manager_.reset();
    unlink(socket_.c_str());
    rmdir(dir_.c_str());
  }

  virtual WorkQueueOptions WorkOptions() const { return {.threads = 2}; }

  static void As(grpc::ClientContext* ctx, const std::string& tenant, const std::string& token) {
    if (!tenant.empty()) ctx->AddMetadata(kTenantMetadata, tenant);
    if (!token.empty()) ctx->AddMetadata(kTokenMetadata, token);
  }

  v1::SessionInfo Open(const std::string& tenant = "a") {
    grpc::ClientContext ctx;
    As(&ctx, tenant, "tok-" + tenant);
    v1::OpenSessionRequest req;
    req.set_tenant(tenant);
    *req.mutable_geometry() = SmallGeometry();
    req.mutable_retrieval()->set_budget_tokens(64);
    req.mutable_retrieval()->set_max_tokens(256);
    req.set_transport(v1::TRANSPORT_GRPC);
    v1::OpenSessionReply reply;
    grpc::Status st = stub_->OpenSession(&ctx, req, &reply);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return reply.session();
  }

  // Streams `tokens` of K/V (byte i of K = i % 251, V its complement) to both layers.
  grpc::Status Offload(const std::string& id, int tokens, v1::OffloadReply* reply) {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    auto writer = stub_->Offload(&ctx, reply);
    // Messages of at most 128 tokens (32 KiB of K + V) stay within the limit.
    for (uint32_t layer = 0; layer < 2; ++layer) {
      const std::string k = Pattern(tokens, layer, false), v = Pattern(tokens, layer, true);
      for (int first = 0; first < tokens; first += 128) {
        const int n = std::min(128, tokens - first);
        v1::OffloadRequest req;
        req.set_session_id(id);
        req.set_layer(layer);
        req.set_num_tokens(n);
        req.set_k(k.substr(first * kTokenBytes, n * kTokenBytes));
        req.set_v(v.substr(first * kTokenBytes, n * kTokenBytes));
        writer->Write(req);
      }
    }
    writer->WritesDone();
    return writer->Finish();
  }

  static std::string Pattern(int tokens, uint32_t layer, bool v) {
    std::string s(tokens * kTokenBytes, '\0');
    for (size_t i = 0; i < s.size(); ++i) {
      s[i] = static_cast<char>((i + 7 * layer) % 251 ^ (v ? 0xff : 0));
    }
    return s;
  }

  std::vector<v1::FetchReply> Fetch(const std::string& id, uint32_t layer, grpc::Status* status,
                                    const std::string& tenant = "a") {
    grpc::ClientContext ctx;
    As(&ctx, tenant, "tok-" + tenant);
    v1::FetchRequest req;
    req.set_session_id(id);
    req.set_layer(layer);
    auto reader = stub_->Fetch(&ctx, req);
    std::vector<v1::FetchReply> out;
    v1::FetchReply reply;
    while (reader->Read(&reply)) out.push_back(reply);
    *status = reader->Finish();
    return out;
  }

  std::vector<uint64_t> CommittedTokens() {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::ListSessionsReply reply;
    EXPECT_TRUE(stub_->ListSessions(&ctx, v1::ListSessionsRequest(), &reply).ok());
    if (reply.sessions_size() != 1) return {};
    return {reply.sessions(0).committed_tokens().begin(),
            reply.sessions(0).committed_tokens().end()};
  }

  DaemonConfig config_;
  std::unique_ptr<SessionManager> manager_;
  std::unique_ptr<WorkQueue> work_;
  std::unique_ptr<KvTierService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::KvTier::Stub> stub_;
  std::string dir_;
  std::string socket_;
};

TEST_F(KvTierServiceTest, HelloReportsTheDaemon) {
  grpc::ClientContext ctx;
  As(&ctx, "a", "tok-a");
  v1::HelloRequest req;
  req.set_protocol_version(1);
  req.set_client_name("test");
  v1::HelloReply reply;
  ASSERT_TRUE(stub_->Hello(&ctx, req, &reply).ok());
  EXPECT_EQ(reply.protocol_version(), 1u);
  EXPECT_EQ(reply.min_protocol_version(), 1u);
  EXPECT_FALSE(reply.server_version().empty());
  EXPECT_THAT(reply.page_sizes(), ::testing::ElementsAre(8, 16, 32, 64, 128));
  EXPECT_THAT(reply.dtypes(), SizeIs(3));
  EXPECT_THAT(reply.layouts(), ::testing::ElementsAre("host:HND", "device:NHD"));
  EXPECT_THAT(reply.backends(), ::testing::ElementsAre("cpu"));
  EXPECT_THAT(reply.modes(), SizeIs(4));
  EXPECT_EQ(reply.limits().max_message_bytes(), kMaxMessageBytes);
  EXPECT_EQ(reply.limits().max_sessions_per_tenant(), 4u);
  EXPECT_EQ(reply.limits().max_tokens_per_session(), 1024u);
  EXPECT_EQ(reply.limits().max_layers(), 8u);
  EXPECT_EQ(reply.limits().max_tokens_per_offload(), 256u);
  EXPECT_EQ(reply.tenant(), "a");
  EXPECT_TRUE(reply.shm_available());
  EXPECT_EQ(reply.attach_socket(), "/run/kvtier/test.attach");
  EXPECT_EQ(reply.tenant_quota_bytes(), 8u << 20);
}

TEST_F(KvTierServiceTest, HelloRefusesOtherProtocolVersions) {
  for (uint32_t v : {0u, 2u}) {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::HelloRequest req;
    req.set_protocol_version(v);
    v1::HelloReply reply;
    grpc::Status st = stub_->Hello(&ctx, req, &reply);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(st.error_message(), HasSubstr("protocol_version = " + std::to_string(v)));
    EXPECT_THAT(st.error_message(), HasSubstr("versions 1 to 1"));
  }
}

TEST_F(KvTierServiceTest, MetadataAuthenticatesEveryCall) {
  struct Case {
    std::string tenant, token;
    grpc::StatusCode code;
    std::string needle;
  };
  for (const Case& c : {Case{"", "", grpc::StatusCode::UNAUTHENTICATED, "x-kvtier-tenant"},
                        Case{"a", "", grpc::StatusCode::PERMISSION_DENIED, "x-kvtier-token"},
                        Case{"a", "tok-b", grpc::StatusCode::PERMISSION_DENIED, "tenant 'a'"},
                        Case{"zz", "x", grpc::StatusCode::PERMISSION_DENIED, "'zz'"}}) {
    grpc::ClientContext ctx;
    As(&ctx, c.tenant, c.token);
    v1::HelloRequest req;
    req.set_protocol_version(1);
    v1::HelloReply reply;
    grpc::Status st = stub_->Hello(&ctx, req, &reply);
    EXPECT_EQ(st.error_code(), c.code) << c.tenant << "/" << c.token;
    EXPECT_THAT(st.error_message(), HasSubstr(c.needle));
    grpc::ClientContext list_ctx;
    As(&list_ctx, c.tenant, c.token);
    v1::ListSessionsReply list;
    EXPECT_EQ(stub_->ListSessions(&list_ctx, v1::ListSessionsRequest(), &list).error_code(),
              c.code);
  }
}

TEST_F(KvTierServiceTest, OpenSessionCarriesTheCorrectionTriggerBothWays) {
  const v1::SessionInfo plain = Open();
  EXPECT_EQ(plain.retrieval().correction_trigger(), "cosine");  // resolved defaults echoed
  ASSERT_TRUE(plain.retrieval().has_correction_max_loss());
  EXPECT_FLOAT_EQ(plain.retrieval().correction_max_loss(), 0.1f);
  const auto open = [&](const std::string& trigger, float max_loss, v1::OpenSessionReply* reply) {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::OpenSessionRequest req;
    req.set_tenant("a");
    *req.mutable_geometry() = SmallGeometry();
    req.mutable_retrieval()->set_budget_tokens(64);
    req.mutable_retrieval()->set_max_tokens(256);
    req.mutable_retrieval()->set_correction_trigger(trigger);
    req.mutable_retrieval()->set_correction_max_loss(max_loss);
    req.set_transport(v1::TRANSPORT_GRPC);
    return stub_->OpenSession(&ctx, req, reply);
  };
  v1::OpenSessionReply reply;
  grpc::Status st = open("mass", 0.25f, &reply);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(reply.session().retrieval().correction_trigger(), "mass");
  EXPECT_FLOAT_EQ(reply.session().retrieval().correction_max_loss(), 0.25f);
  st = open("Mass", 0.25f, &reply);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("correction_trigger = 'Mass'"));
  EXPECT_THAT(st.error_message(), HasSubstr("cosine, mass"));
  st = open("mass", -0.5f, &reply);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("correction_max_loss = -0.5"));
  EXPECT_THAT(st.error_message(), HasSubstr("[0, 1]"));
}

TEST_F(KvTierServiceTest, OffloadThenFetchReturnsHndPages) {
  const v1::SessionInfo s = Open();
  EXPECT_EQ(s.transport(), v1::TRANSPORT_GRPC);
  EXPECT_EQ(s.retrieval().budget_tokens(), 64u);
  EXPECT_EQ(s.retrieval().max_tokens(), 256u);
  EXPECT_EQ(s.state(), v1::SESSION_STATE_OPEN);
  v1::OffloadReply reply;
  grpc::Status st = Offload(s.session_id(), 20, &reply);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(reply.committed_tokens(), 40u);
  EXPECT_THAT(reply.layer_tokens(), ::testing::ElementsAre(20, 20));

  for (uint32_t layer = 0; layer < 2; ++layer) {
    std::vector<v1::FetchReply> replies = Fetch(s.session_id(), layer, &st);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_THAT(replies, SizeIs(1));
    ASSERT_THAT(replies[0].pages(), SizeIs(2));  // 20 tokens: two full pages of 8
    const std::string k = Pattern(20, layer, false), v = Pattern(20, layer, true);
    for (const v1::Page& page : replies[0].pages()) {
      ASSERT_EQ(page.data().size(), kPageBytes);
      // HND [Hkv][2][p][d]: head 1, V, token 3 of the page.
      const size_t token = page.page() * 8 + 3, row = 16 * 4;
      EXPECT_EQ(page.data().substr(((1 * 2 + 1) * 8 + 3) * row, row),
                v.substr(token * kTokenBytes + 1 * row, row));
      EXPECT_EQ(page.data().substr(0, row), k.substr(page.page() * 8 * kTokenBytes, row));
      EXPECT_EQ(page.layer(), layer);
      EXPECT_GE(page.generation(), 1u);
    }
  }
}

TEST_F(KvTierServiceTest, FetchSplitsPagesIntoMessagesWithinTheLimit) {
  const v1::SessionInfo s = Open();
  v1::OffloadReply reply;
  ASSERT_TRUE(Offload(s.session_id(), 256, &reply).ok());
  grpc::Status st;
  std::vector<v1::FetchReply> replies = Fetch(s.session_id(), 1, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_GE(replies.size(), 2u);
  size_t pages = 0;
  for (const v1::FetchReply& r : replies) {
    EXPECT_LE(r.ByteSizeLong(), kMaxMessageBytes);
    for (const v1::Page& p : r.pages()) EXPECT_EQ(p.page(), pages++);
  }
  EXPECT_EQ(pages, 32u);
}

TEST_F(KvTierServiceTest, StepRunsOnTheDaemonsRetriever) {
  const v1::SessionInfo s = Open();
  v1::OffloadReply offload;
  ASSERT_TRUE(Offload(s.session_id(), 100, &offload).ok());
  TypedBuffer q(DType::kF32, 4 * 16);
  q.FillNormal(3);
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::StepRequest req;
    req.set_session_id(s.session_id());
    req.set_layer(1);
    req.set_q(std::string(static_cast<const char*>(q.data()), q.bytes()));
    req.set_want_output(true);
    v1::StepReply reply;
    grpc::Status st = stub_->Step(&ctx, req, &reply);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(reply.layer(), 1u);
    EXPECT_EQ(reply.num_tokens(), 100u);
    EXPECT_EQ(reply.num_slots(), 8u);  // 64-token budget at p = 8
    EXPECT_THAT(reply.slot_table(), SizeIs(2 * 8));
    EXPECT_EQ(reply.output().size(), q.bytes());
    EXPECT_THAT(reply.lse(), SizeIs(4));
  }
  grpc::ClientContext ctx;
  As(&ctx, "a", "tok-a");
  v1::GetStatsRequest req;
  req.set_session_id(s.session_id());
  v1::GetStatsReply stats;
  ASSERT_TRUE(stub_->GetStats(&ctx, req, &stats).ok());
  EXPECT_EQ(stats.session().steps(), 3);
  EXPECT_EQ(stats.session().committed_pages(), 24u);  // 12 full pages per layer
  ASSERT_THAT(stats.tenants(), SizeIs(1));
  EXPECT_EQ(stats.tenants(0).tenant(), "a");
  EXPECT_EQ(stats.tenants(0).sessions(), 1u);
  EXPECT_GE(stats.rpcs(), 5u);
}

TEST_F(KvTierServiceTest, ErrorsKeepTheirCodesOverTheWire) {
  const v1::SessionInfo s = Open();
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::OpenSessionRequest req;
    req.set_tenant("a");
    *req.mutable_geometry() = SmallGeometry();
    req.mutable_geometry()->set_head_dim(100);
    v1::OpenSessionReply reply;
    grpc::Status st = stub_->OpenSession(&ctx, req, &reply);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("geometry.head_dim = 100"));
  }
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::OpenSessionRequest req;
    req.set_tenant("a");
    *req.mutable_geometry() = SmallGeometry();
    req.mutable_geometry()->set_dtype(v1::DTYPE_UNSPECIFIED);
    v1::OpenSessionReply reply;
    grpc::Status st = stub_->OpenSession(&ctx, req, &reply);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("geometry.dtype"));
  }
  {
    grpc::ClientContext ctx;
    As(&ctx, "b", "tok-b");
    v1::CloseSessionRequest req;
    req.set_session_id(s.session_id());
    v1::CloseSessionReply reply;
    EXPECT_EQ(stub_->CloseSession(&ctx, req, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::ReattachRequest req;
    req.set_session_id("nope");
    v1::ReattachReply reply;
    EXPECT_EQ(stub_->Reattach(&ctx, req, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::Status st;
    Fetch(s.session_id(), 0, &st, "b");
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
    v1::OffloadReply reply;
    ASSERT_TRUE(Offload(s.session_id(), 8, &reply).ok());
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::FetchRequest req;
    req.set_session_id(s.session_id());
    req.add_pages(1);
    auto reader = stub_->Fetch(&ctx, req);
    v1::FetchReply page;
    EXPECT_FALSE(reader->Read(&page));
    st = reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(st.error_message(), HasSubstr("page 1 is not committed"));
  }
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::OffloadReply reply;
    auto writer = stub_->Offload(&ctx, &reply);
    v1::OffloadRequest req;
    req.set_session_id(s.session_id());
    req.set_layer(0);
    req.set_num_tokens(4);
    req.set_k(std::string(10, 'k'));
    req.set_v(std::string(4 * kTokenBytes, 'v'));
    writer->Write(req);
    writer->WritesDone();
    grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("k: 10 bytes"));
  }
  grpc::ClientContext ctx;
  As(&ctx, "a", "tok-a");
  v1::GetStatsReply stats;
  ASSERT_TRUE(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  EXPECT_GE(stats.rpc_errors(), 6u);
  EXPECT_EQ(stats.tenants(0).refused_requests(), 4u);  // a's: head_dim, not found ×2, k size
}

TEST_F(KvTierServiceTest, SuspendSessionFencesWorkUntilReattach) {
  const v1::SessionInfo s = Open();
  v1::OffloadReply offload;
  ASSERT_TRUE(Offload(s.session_id(), 20, &offload).ok());
  auto suspend = [&](const std::string& id, v1::SuspendSessionReply* reply) {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::SuspendSessionRequest req;
    req.set_session_id(id);
    return stub_->SuspendSession(&ctx, req, reply);
  };
  v1::SuspendSessionReply suspended;
  grpc::Status st = suspend(s.session_id(), &suspended);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(suspended.session().session_id(), s.session_id());
  EXPECT_EQ(suspended.session().state(), v1::SESSION_STATE_SUSPENDED);
  EXPECT_GT(suspended.session().epoch(), s.epoch());
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::ListSessionsReply list;
    ASSERT_TRUE(stub_->ListSessions(&ctx, v1::ListSessionsRequest(), &list).ok());
    ASSERT_THAT(list.sessions(), SizeIs(1));
    EXPECT_EQ(list.sessions(0).state(), v1::SESSION_STATE_SUSPENDED);
  }
  // Twice: OK, still suspended.
  v1::SuspendSessionReply again;
  st = suspend(s.session_id(), &again);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(again.session().state(), v1::SESSION_STATE_SUSPENDED);

  // Step and Offload are refused; Fetch reads the committed pages.
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    TypedBuffer q(DType::kF32, 4 * 16);
    q.FillNormal(3);
    v1::StepRequest req;
    req.set_session_id(s.session_id());
    req.set_layer(0);
    req.set_q(std::string(static_cast<const char*>(q.data()), q.bytes()));
    v1::StepReply reply;
    EXPECT_EQ(stub_->Step(&ctx, req, &reply).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::OffloadReply reply;
    auto writer = stub_->Offload(&ctx, &reply);
    v1::OffloadRequest req;
    req.set_session_id(s.session_id());
    req.set_layer(0);
    req.set_start_token(20);
    req.set_num_tokens(1);
    req.set_k(std::string(kTokenBytes, 'k'));
    req.set_v(std::string(kTokenBytes, 'v'));
    req.set_commit(true);
    writer->Write(req);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  std::vector<v1::FetchReply> pages = Fetch(s.session_id(), 0, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_THAT(pages, SizeIs(1));
  EXPECT_THAT(pages[0].pages(), SizeIs(2));

  grpc::ClientContext ctx;
  As(&ctx, "a", "tok-a");
  v1::ReattachRequest req;
  req.set_session_id(s.session_id());
  v1::ReattachReply reattached;
  st = stub_->Reattach(&ctx, req, &reattached);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(reattached.session().state(), v1::SESSION_STATE_OPEN);
  EXPECT_GT(reattached.session().epoch(), again.session().epoch());
  for (uint64_t t : reattached.session().committed_tokens()) {
    EXPECT_TRUE(t == 16 || t == 20) << t;  // the full pages at least
  }

  v1::SuspendSessionReply unknown;
  EXPECT_EQ(suspend("nope", &unknown).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(KvTierServiceTest, CancelledOffloadLeavesNothingUncommitted) {
  const v1::SessionInfo s = Open();
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::OffloadReply reply;
    auto writer = stub_->Offload(&ctx, &reply);
    v1::OffloadRequest req;
    req.set_session_id(s.session_id());
    req.set_layer(0);
    req.set_num_tokens(16);
    req.set_k(Pattern(16, 0, false));
    req.set_v(Pattern(16, 0, true));
    req.set_commit(true);  // visible
    ASSERT_TRUE(writer->Write(req));
    req.set_layer(1);
    req.set_commit(false);  // staged only
    ASSERT_TRUE(writer->Write(req));
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // Drain waits until the server has let go of the stream.
  grpc::ClientContext ctx;
  As(&ctx, "", "admin-secret");
  v1::DrainRequest req;
  req.set_timeout_ms(60000);
  v1::DrainReply drain;
  ASSERT_TRUE(stub_->Drain(&ctx, req, &drain).ok());
  ASSERT_TRUE(drain.drained());
  const std::vector<uint64_t> committed = CommittedTokens();
  ASSERT_THAT(committed, SizeIs(2));
  EXPECT_EQ(committed[1], 0u);
  EXPECT_TRUE(committed[0] == 0 || committed[0] == 16) << committed[0];
}

TEST_F(KvTierServiceTest, OversizedMessagesAreRefusedAndTheServerKeepsServing) {
  const v1::SessionInfo s = Open();
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::OpenSessionRequest req;
    req.set_tenant("a");
    *req.mutable_geometry() = SmallGeometry();
    req.set_label(std::string(kMaxMessageBytes + 1, 'x'));
    v1::OpenSessionReply reply;
    EXPECT_EQ(stub_->OpenSession(&ctx, req, &reply).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::OffloadReply reply;
    auto writer = stub_->Offload(&ctx, &reply);
    v1::OffloadRequest req;
    req.set_session_id(s.session_id());
    req.set_layer(0);
    req.set_num_tokens(256);
    req.set_k(Pattern(256, 0, false));  // 256 × 128 bytes each: k + v over 64 KiB
    req.set_v(Pattern(256, 0, true));
    req.set_commit(true);
    writer->Write(req);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  EXPECT_EQ(CommittedTokens(), (std::vector<uint64_t>{0, 0}));
  grpc::ClientContext ctx;
  As(&ctx, "a", "tok-a");
  v1::HelloRequest req;
  req.set_protocol_version(1);
  v1::HelloReply reply;
  EXPECT_TRUE(stub_->Hello(&ctx, req, &reply).ok());
}

TEST_F(KvTierServiceTest, DrainNeedsTheAdminTokenThenRefusesSessions) {
  Open();
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::DrainReply reply;
    grpc::Status st = stub_->Drain(&ctx, v1::DrainRequest(), &reply);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    As(&ctx, "a", "admin-secret");
    v1::DrainRequest req;
    req.set_timeout_ms(60000);
    v1::DrainReply reply;
    ASSERT_TRUE(stub_->Drain(&ctx, req, &reply).ok());
    EXPECT_TRUE(reply.drained());
    EXPECT_EQ(reply.open_sessions(), 1u);
    EXPECT_EQ(reply.inflight_calls(), 0u);
  }
  grpc::ClientContext ctx;
  As(&ctx, "a", "tok-a");
  v1::OpenSessionRequest req;
  req.set_tenant("a");
  *req.mutable_geometry() = SmallGeometry();
  v1::OpenSessionReply reply;
  grpc::Status st = stub_->OpenSession(&ctx, req, &reply);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(st.error_message(), HasSubstr("draining"));
}

TEST(ToGrpcStatusTest, KeepsCodeAndMessage) {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status st(static_cast<absl::StatusCode>(code), code == 0 ? "" : "why");
    const grpc::Status g = ToGrpcStatus(st);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    EXPECT_EQ(g.error_message(), std::string(st.message()));
  }
}

}  // namespace
}  // namespace kvtier::daemon

namespace kvtier::daemon {
namespace {

// One worker, two places in the queue, and a gate the test holds the worker with: calls that
// do work wait in the queue, deterministically.
class KvTierServiceQueueTest : public KvTierServiceTest {
 protected:
  WorkQueueOptions WorkOptions() const override { return {.threads = 1, .max_queued = 2}; }

  // Occupies the only worker until Open() is called on the returned gate.
  struct Gate {
    Mutex mu;
    CondVar cv;
    bool open ABSL_GUARDED_BY(mu) = false;
    bool entered ABSL_GUARDED_BY(mu) = false;
    void Open() {
      MutexLock lock(&mu);
      open = true;
      cv.SignalAll();
    }
  };
  std::shared_ptr<Gate> HoldTheWorker() {
    auto gate = std::make_shared<Gate>();
    EXPECT_TRUE(work_
                    ->Submit("gate",
                             [gate](absl::Status) {
                               MutexLock lock(&gate->mu);
                               gate->entered = true;
                               gate->cv.SignalAll();
                               gate->cv.Await(&gate->mu, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                                                             gate->mu) { return gate->open; });
                             })
                    .ok());
    MutexLock lock(&gate->mu);
    gate->cv.Await(&gate->mu,
                   [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate->mu) { return gate->entered; });
    return gate;
  }
  // Blocks until `n` jobs wait in the queue.
  void AwaitQueued(size_t n) {
    while (work_->queued() < n) std::this_thread::yield();
  }

  v1::StepRequest StepRequest(const std::string& id, uint64_t step) {
    TypedBuffer q(DType::kF32, 4 * 16);
    q.FillNormal(5);
    v1::StepRequest req;
    req.set_session_id(id);
    req.set_layer(0);
    req.set_q(std::string(static_cast<const char*>(q.data()), q.bytes()));
    req.set_want_output(true);
    req.set_step(step);
    return req;
  }
  uint64_t StepsRun(const std::string& id) {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::ListSessionsReply reply;
    EXPECT_TRUE(stub_->ListSessions(&ctx, v1::ListSessionsRequest(), &reply).ok());
    for (const v1::SessionInfo& s : reply.sessions()) {
      if (s.session_id() == id) return s.steps_run(0);
    }
    return ~uint64_t{0};
  }
};

// A call whose deadline passes while it waits for a worker does nothing when its turn comes,
// and cheap calls are answered meanwhile: one slow call cannot hold the server.
TEST_F(KvTierServiceQueueTest, CallsWhoseDeadlinePassedInTheQueueDoNothing) {
  const v1::SessionInfo s = Open();
  v1::OffloadReply offload;
  ASSERT_TRUE(Offload(s.session_id(), 100, &offload).ok());
  std::shared_ptr<Gate> gate = HoldTheWorker();

  std::thread late_step([&] {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    v1::StepReply reply;
    EXPECT_EQ(stub_->Step(&ctx, StepRequest(s.session_id(), 1), &reply).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  });
  AwaitQueued(1);
  std::thread late_open([&] {
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    v1::OpenSessionRequest req;
    req.set_tenant("a");
    *req.mutable_geometry() = SmallGeometry();
    req.mutable_retrieval()->set_budget_tokens(64);
    req.mutable_retrieval()->set_max_tokens(256);
    req.set_transport(v1::TRANSPORT_GRPC);
    v1::OpenSessionReply reply;
    EXPECT_EQ(stub_->OpenSession(&ctx, req, &reply).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  });
  AwaitQueued(2);
  {  // The queue is full: a third call is refused at once, with a retry hint.
    grpc::ClientContext ctx;
    As(&ctx, "a", "tok-a");
    v1::StepReply reply;
    EXPECT_EQ(stub_->Step(&ctx, StepRequest(s.session_id(), 1), &reply).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
    const auto& trailers = ctx.GetServerTrailingMetadata();
    EXPECT_NE(trailers.find("grpc-retry-pushback-ms"), trailers.end());
  }
  {  // Cheap calls do not wait for the worker.
    grpc::ClientContext ctx;
    As(&ctx, "b", "tok-b");
    v1::HelloRequest req;
    req.set_protocol_version(1);
    v1::HelloReply reply;
    EXPECT_TRUE(stub_->Hello(&ctx, req, &reply).ok());
  }
  late_step.join();  // both deadlines have passed now, in the queue
  late_open.join();
  gate->Open();
  // Once the one worker has taken both expired calls, the next step runs after them. It is
  // step 1 and it runs: the expired step 1 ran nothing.
  while (work_->queued() > 0) std::this_thread::yield();
  grpc::ClientContext ctx;
  As(&ctx, "a", "tok-a");
  v1::StepReply reply;
  grpc::Status st = stub_->Step(&ctx, StepRequest(s.session_id(), 1), &reply);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_FALSE(reply.replayed());
  EXPECT_EQ(reply.step(), 1u);
  EXPECT_EQ(StepsRun(s.session_id()), 1u);
  grpc::ClientContext list_ctx;
  As(&list_ctx, "a", "tok-a");
  v1::ListSessionsReply sessions;
  ASSERT_TRUE(stub_->ListSessions(&list_ctx, v1::ListSessionsRequest(), &sessions).ok());
  EXPECT_EQ(sessions.sessions_size(), 1);  // the expired OpenSession opened nothing
}

}  // namespace
}  // namespace kvtier::daemon
