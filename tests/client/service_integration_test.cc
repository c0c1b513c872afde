// The service end to end: the real kvtierd (a subprocess) and libkvtier. SHM and GRPC
// sessions agree bit for bit on a synthetic decode trace; an SHM session survives its client
// being killed; tenants are isolated; malformed requests are refused with the right code while
// the daemon keeps serving; SIGTERM shuts down cleanly.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "client/connection.h"
#include "client/rpc_util.h"
#include "client/shm_attach.h"
#include "core/status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvtier/c_api.h"
#include "kvtier/client.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "offload/session_region.h"
#include "tests/client/daemon_process.h"
#include "tests/client/integration_options.h"
#include "tests/client/session_trace.h"
#include "tests/testutil/assert_ok.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::DaemonProcessOptions;
using testing::IntegrationSessionOptions;
using testing::IntegrationTrace;
using testing::StepRecord;
using testing::SyntheticTrace;

constexpr int kCpuThreads = 2;                   // the daemon's and the SHM sessions' backend
constexpr uint64_t kMaxMessageBytes = 1u << 20;  // small, so limits are cheap to hit
constexpr char kAdminToken[] = "adm";

DaemonProcessOptions TwoTenants() {
  DaemonProcessOptions o;
  o.kvtierd_path = KVTIERD_PATH;
  o.tenants = {{"a", "ta", uint64_t{64} << 20}, {"b", "tb", uint64_t{64} << 20}};
  o.admin_token = kAdminToken;
  o.cpu_threads = kCpuThreads;
  o.max_message_bytes = kMaxMessageBytes;
  // Several Offload messages per prefill Append: the chunking is exercised.
  o.extra_toml = "[limits]\nmax_tokens_per_offload = 256\nmax_sessions_per_tenant = 16\n";
  return o;
}

// Compares two runs of the trace; returns the first difference, or "".
std::string FirstDifference(const std::vector<std::vector<StepRecord>>& x,
                            const std::vector<std::vector<StepRecord>>& y) {
  if (x.size() != y.size()) return "different step counts";
  for (size_t s = 0; s < x.size(); ++s) {
    for (size_t l = 0; l < x[s].size(); ++l) {
      const StepRecord& a = x[s][l];
      const StepRecord& b = y[s][l];
      const std::string where = "step " + std::to_string(s) + " layer " + std::to_string(l);
      if (a.slot_table.empty()) return where + ": empty slot table";
      if (a.slot_table != b.slot_table) return where + ": slot tables differ";
      if (a.output != b.output) return where + ": attention outputs differ";
      if (a.lse.size() != b.lse.size() ||
          std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) != 0) {
        return where + ": lse differs";
      }
    }
  }
  return "";
}

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    backend_ = NewCpuBackend(kCpuThreads).release();
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(TwoTenants());
    if (d.ok()) {
      daemon_ = d->release();
    } else {
      start_error_ = new absl::Status(d.status());
    }
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
    delete start_error_;
    start_error_ = nullptr;
    delete backend_;
    backend_ = nullptr;
  }
  void SetUp() override {
    ASSERT_EQ(start_error_, nullptr) << *start_error_;
    ASSERT_TRUE(daemon_->process().Running()) << "kvtierd died; its log:\n" << daemon_->Log();
  }
  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) {
      std::string log = daemon_->Log();
      if (log.size() > 8000) log = log.substr(log.size() - 8000);
      std::cerr << "---- kvtierd log (tail) ----\n" << log << "\n----\n";
    }
  }

  static absl::StatusOr<std::unique_ptr<Client>> ConnectAs(const std::string& tenant,
                                                           const std::string& token) {
    ClientOptions o;
    o.tenant = tenant;
    o.token = token;
    o.client_name = "service_integration_test";
    return Client::Connect(daemon_->target(), o);
  }
  static std::unique_ptr<Client> MustConnect(const std::string& tenant, const std::string& token) {
    absl::StatusOr<std::unique_ptr<Client>> c = ConnectAs(tenant, token);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  // A stub that sends whatever it is given (no client-side size limit).
  static std::unique_ptr<v1::KvTier::Stub> RawStub() {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetMaxReceiveMessageSize(-1);
    return v1::KvTier::NewStub(grpc::CreateCustomChannel("unix:" + daemon_->socket_path(),
                                                         grpc::InsecureChannelCredentials(), args));
  }
  static std::unique_ptr<grpc::ClientContext> Ctx(const std::string& tenant,
                                                  const std::string& token) {
    return NewCallContext(tenant, token, absl::Seconds(30));
  }
  // The daemon still answers.
  static void ExpectServing(v1::KvTier::Stub& stub) {
    v1::HelloRequest req;
    req.set_protocol_version(kProtocolVersion);
    v1::HelloReply reply;
    auto ctx = Ctx("a", "ta");
    const grpc::Status st = stub.Hello(ctx.get(), req, &reply);
    EXPECT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(reply.tenant(), "a");
  }

  static DaemonProcess* daemon_;
  static absl::Status* start_error_;
  static Backend* backend_;
};

DaemonProcess* ServiceTest::daemon_ = nullptr;
absl::Status* ServiceTest::start_error_ = nullptr;
Backend* ServiceTest::backend_ = nullptr;

TEST_F(ServiceTest, HelloReportsTheTenantAndTheLimits) {
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  const Capabilities& c = a->capabilities();
  EXPECT_EQ(c.protocol_version, kProtocolVersion);
  EXPECT_EQ(c.tenant, "a");
  EXPECT_EQ(c.max_message_bytes, kMaxMessageBytes);
  EXPECT_EQ(c.max_tokens_per_offload, 256u);
  EXPECT_TRUE(c.shm_available);
  EXPECT_EQ(c.attach_socket, daemon_->attach_path());
  EXPECT_EQ(c.tenant_quota_bytes, uint64_t{64} << 20);
}

TEST_F(ServiceTest, ShmAndGrpcSessionsGiveIdenticalWorkingSetsOutputsAndPages) {
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  auto shm = a->OpenSession(IntegrationSessionOptions(Transport::kShm, backend_));
  ASSERT_TRUE(shm.ok()) << shm.status();
  auto grpc = a->OpenSession(IntegrationSessionOptions(Transport::kGrpc));
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  EXPECT_EQ((*shm)->transport(), Transport::kShm);
  EXPECT_EQ((*grpc)->transport(), Transport::kGrpc);
  // SHM sessions own a local sequence; GRPC ones a remote sequence that has no local part.
  EXPECT_NE((*shm)->sequence().local(), nullptr);
  EXPECT_EQ((*grpc)->sequence().local(), nullptr);

  const SyntheticTrace trace(IntegrationTrace());
  const int32_t prefill = trace.options().prefill;
  const int32_t steps = trace.options().steps;
  ASSERT_OK(testing::AppendTokens(**shm, trace, 0, prefill));
  ASSERT_OK(testing::AppendTokens(**grpc, trace, 0, prefill));
  auto rs = testing::RunDecode(**shm, trace, 0, steps);
  ASSERT_TRUE(rs.ok()) << rs.status();
  auto rg = testing::RunDecode(**grpc, trace, 0, steps);
  ASSERT_TRUE(rg.ok()) << rg.status();
  EXPECT_EQ(FirstDifference(*rs, *rg), "");
  // Hkv × S entries, S = 16 pages of budget.
  EXPECT_EQ((*rs)[0][0].slot_table.size(), 2u * 16u);

  // Speculation was sometimes wrong and corrected, identically on both sides.
  const SequenceStats ss = (*shm)->sequence().Stats();
  const SequenceStats gs = (*grpc)->sequence().Stats();
  EXPECT_GT(ss.corrected_heads, 0);
  EXPECT_LT(ss.corrected_heads, ss.checked_heads);
  EXPECT_EQ(gs.corrected_heads, ss.corrected_heads);
  EXPECT_EQ(gs.checked_heads, ss.checked_heads);
  EXPECT_EQ(gs.steps, ss.steps);

  // Every full page is committed on both sides, with the same bytes.
  ASSERT_OK((*shm)->Flush());
  const int64_t full_pages = (prefill + steps) / 32;
  for (int32_t l = 0; l < 2; ++l) {
    auto ps = (*shm)->FetchPages(l, {});
    ASSERT_TRUE(ps.ok()) << ps.status();
    auto pg = (*grpc)->FetchPages(l, {});
    ASSERT_TRUE(pg.ok()) << pg.status();
    ASSERT_EQ(ps->size(), static_cast<size_t>(full_pages));
    ASSERT_EQ(pg->size(), ps->size());
    for (size_t i = 0; i < ps->size(); ++i) {
      EXPECT_EQ((*ps)[i].page, static_cast<int64_t>(i));
      EXPECT_EQ((*pg)[i].page, (*ps)[i].page);
      EXPECT_EQ((*pg)[i].data, (*ps)[i].data) << "layer " << l << " page " << i;
      EXPECT_GE((*ps)[i].generation, 1u);
    }
    // A page list: just those; an uncommitted page: NOT_FOUND on both.
    auto two = (*grpc)->FetchPages(l, {3, 1});
    ASSERT_TRUE(two.ok()) << two.status();
    ASSERT_EQ(two->size(), 2u);
    EXPECT_EQ((*two)[0].data, (*ps)[3].data);
    EXPECT_EQ((*shm)->FetchPages(l, {full_pages}).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*grpc)->FetchPages(l, {full_pages}).status().code(), absl::StatusCode::kNotFound);
  }
  auto info = (*shm)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->committed_tokens, (std::vector<int64_t>{full_pages * 32, full_pages * 32}));
  EXPECT_EQ(info->transport, Transport::kShm);
  EXPECT_EQ(info->label, "integration");

  const std::string shm_id = (*shm)->id(), grpc_id = (*grpc)->id();
  ASSERT_OK((*shm)->Close());
  ASSERT_OK((*grpc)->Close());
  auto list = a->ListSessions();
  ASSERT_TRUE(list.ok()) << list.status();
  for (const SessionInfo& s : *list) {
    EXPECT_NE(s.id, shm_id);
    EXPECT_NE(s.id, grpc_id);
  }
  EXPECT_EQ((*shm)->sequence().Append(0, trace.K(0, 0), trace.V(0, 0), 1).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A GRPC session whose Step reply was lost (the daemon ran the step; the engine moved on
// with another q), and one whose Offload stream committed behind its back, keep working:
// the library adopts the daemon's step count and token count, and a reattached session
// continues the daemon's step numbering.
TEST_F(ServiceTest, GrpcSessionsResyncAfterLostRepliesAndReattach) {
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  const SessionOptions options = IntegrationSessionOptions(Transport::kGrpc);
  auto s = a->OpenSession(options);
  ASSERT_TRUE(s.ok()) << s.status();
  const SyntheticTrace trace(IntegrationTrace());
  ASSERT_OK(testing::AppendTokens(**s, trace, 0, 96));
  std::vector<uint8_t> out(8 * 64 * 2);
  auto step = [&](Session& session, int32_t i) -> absl::Status {
    return session.sequence().Decode(0, trace.Query(0, i), out.data(), nullptr);
  };
  ASSERT_OK(step(**s, 0));
  // Step 2 runs in the daemon, but its reply never reaches the session.
  auto stub = RawStub();
  v1::StepRequest lost;
  lost.set_session_id((*s)->id());
  lost.set_layer(0);
  lost.set_q(trace.Query(0, 1), 8 * 64 * 2);
  lost.set_step(2);
  v1::StepReply reply;
  ASSERT_TRUE(stub->Step(Ctx("a", "ta").get(), lost, &reply).ok());
  ASSERT_OK(step(**s, 2));  // sent as step 2, refused, resent as step 3
  auto info = (*s)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->steps_run, (std::vector<int64_t>{3, 0}));

  // 8 tokens of layer 1 committed by another stream: the session's next Append is refused
  // (its start_token is stale), and num_tokens then says where the layer ends.
  v1::OffloadRequest behind;
  behind.set_session_id((*s)->id());
  behind.set_layer(1);
  behind.set_num_tokens(8);
  behind.set_k(trace.K(1, 96), 8 * 2 * 64 * 2);
  behind.set_v(trace.V(1, 96), 8 * 2 * 64 * 2);
  behind.set_commit(true);
  {
    v1::OffloadReply r;
    auto ctx = Ctx("a", "ta");
    auto writer = stub->Offload(ctx.get(), &r);
    ASSERT_TRUE(writer->Write(behind));
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
  }
  EXPECT_EQ((*s)->sequence().Append(1, trace.K(1, 96), trace.V(1, 96), 8).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*s)->sequence().num_tokens(1), 104);
  ASSERT_OK((*s)->sequence().Append(1, trace.K(1, 104), trace.V(1, 104), 8));
  EXPECT_EQ((*s)->sequence().num_tokens(1), 112);

  // A reattached session continues at step 4.
  auto again = a->Reattach((*s)->id(), options);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_OK(step(**again, 3));
  info = (*again)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->steps_run, (std::vector<int64_t>{4, 0}));
  ASSERT_OK((*again)->Close());
}

TEST_F(ServiceTest, ReattachAfterTheClientIsKilledContinuesBitForBit) {
  const SyntheticTrace trace(IntegrationTrace());
  const int32_t prefill = trace.options().prefill;
  auto child =
      testing::Subprocess::Spawn({KVTIER_SESSION_CHILD_PATH, daemon_->target(), "a", "ta",
                                  std::to_string(prefill), std::to_string(trace.options().seed)});
  ASSERT_TRUE(child.ok()) << child.status();
  absl::StatusOr<std::string> id = (*child)->ReadLine(absl::Seconds(120));
  ASSERT_TRUE(id.ok()) << id.status();
  auto killed = (*child)->Stop(SIGKILL, absl::Seconds(60));
  ASSERT_TRUE(killed.ok()) << killed.status();
  EXPECT_TRUE(WIFSIGNALED(*killed) && WTERMSIG(*killed) == SIGKILL);

  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  const SessionOptions options = IntegrationSessionOptions(Transport::kShm, backend_);
  auto re = a->Reattach(*id, options);
  ASSERT_TRUE(re.ok()) << re.status();
  EXPECT_EQ((*re)->epoch(), 2u);
  const int32_t committed = prefill / 32 * 32;  // the partial page died with the child
  auto info = (*re)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->committed_tokens, (std::vector<int64_t>{committed, committed}));
  EXPECT_EQ(info->epoch, 2u);
  for (int32_t l = 0; l < 2; ++l) EXPECT_EQ((*re)->sequence().num_tokens(l), committed);

  ASSERT_OK(testing::AppendTokens(**re, trace, committed, prefill));
  auto after = testing::RunDecode(**re, trace, 0, trace.options().steps);
  ASSERT_TRUE(after.ok()) << after.status();

  auto fresh = a->OpenSession(options);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_OK(testing::AppendTokens(**fresh, trace, 0, prefill));
  auto never_crashed = testing::RunDecode(**fresh, trace, 0, trace.options().steps);
  ASSERT_TRUE(never_crashed.ok()) << never_crashed.status();
  EXPECT_EQ(FirstDifference(*after, *never_crashed), "");

  ASSERT_OK((*re)->Close());
  ASSERT_OK((*fresh)->Close());
}

TEST_F(ServiceTest, ReattachFencesThePreviousHolder) {
  const SyntheticTrace trace(IntegrationTrace());
  const SessionOptions options = IntegrationSessionOptions(Transport::kShm, backend_);
  std::unique_ptr<Client> c1 = MustConnect("a", "ta");
  std::unique_ptr<Client> c2 = MustConnect("a", "ta");
  ASSERT_TRUE(c1 != nullptr && c2 != nullptr);
  auto s1 = c1->OpenSession(options);
  ASSERT_TRUE(s1.ok()) << s1.status();
  ASSERT_OK(testing::AppendTokens(**s1, trace, 0, 64));
  ASSERT_OK((*s1)->Flush());

  auto s2 = c2->Reattach((*s1)->id(), options);
  ASSERT_TRUE(s2.ok()) << s2.status();
  EXPECT_EQ((*s2)->sequence().num_tokens(0), 64);
  EXPECT_GT((*s2)->epoch(), (*s1)->epoch());

  // The old holder's next commit is refused, and it stays refused.
  absl::Status st = testing::AppendTokens(**s1, trace, 64, 96);
  if (st.ok()) st = (*s1)->Flush();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ((*s1)->Flush().code(), absl::StatusCode::kFailedPrecondition);
  // Nor can it close the session under the new holder.
  EXPECT_EQ((*s1)->Close().code(), absl::StatusCode::kFailedPrecondition);

  ASSERT_OK(testing::AppendTokens(**s2, trace, 64, 96));
  ASSERT_OK((*s2)->Flush());
  auto pages = (*s2)->FetchPages(0, {});
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(pages->size(), 3u);
  ASSERT_OK((*s2)->Close());
}

TEST_F(ServiceTest, DetachedSessionsStayOpenUntilClosedById) {
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  std::string id;
  {
    auto s = a->OpenSession(IntegrationSessionOptions(Transport::kShm, backend_));
    ASSERT_TRUE(s.ok()) << s.status();
    id = (*s)->id();
  }  // destroyed without Close: detached
  auto list = a->ListSessions();
  ASSERT_TRUE(list.ok()) << list.status();
  bool found = false;
  for (const SessionInfo& s : *list) found |= s.id == id;
  EXPECT_TRUE(found);
  ASSERT_OK(a->CloseSession(id));
  EXPECT_EQ(a->CloseSession(id).code(), absl::StatusCode::kNotFound);
}

// This process's mappings of tenant `tenant`'s arena (the daemon's memfd "kvtier-<tenant>"),
// as their address ranges in /proc/self/maps.
std::vector<std::string> ArenaMappingsOf(const std::string& tenant) {
  const std::string path = "/memfd:kvtier-" + tenant;
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> out;
  for (std::string line; std::getline(maps, line);) {
    const size_t at = line.find(path);
    if (at == std::string::npos) continue;
    const size_t end = at + path.size();
    if (end == line.size() || line[end] == ' ') out.push_back(line.substr(0, line.find(' ')));
  }
  return out;
}

// A Client maps its tenant's arena once: SHM sessions opened one after another find it
// mapped (no second mapping for the session, none anew per session), and it goes with the
// Client.
TEST_F(ServiceTest, AClientMapsTheArenaOnceForAllItsShmSessions) {
  const std::vector<std::string> before = ArenaMappingsOf("a");
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  const SyntheticTrace trace(IntegrationTrace());
  std::vector<std::string> first;
  for (int i = 0; i < 3; ++i) {
    auto s = a->OpenSession(IntegrationSessionOptions(Transport::kShm, backend_));
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_OK(testing::AppendTokens(**s, trace, 0, 100));
    const std::vector<std::string> now = ArenaMappingsOf("a");
    ASSERT_EQ(now.size(), before.size() + 1) << "session " << i;
    if (i == 0) first = now;
    EXPECT_EQ(now, first) << "session " << i << " mapped the arena anew";
    ASSERT_OK((*s)->Close());
  }
  a.reset();
  EXPECT_EQ(ArenaMappingsOf("a"), before);
}

// The Connection's mappings: shared by the sessions on one backend, a second one only while
// two backends are in use at once, each reused afterwards; a mapping is unregistered from its
// backend with its last holder, so the engine may destroy its device after its last session.
TEST_F(ServiceTest, ArenaMappingsAreKeptAndUnregisteredWithTheirLastHolder) {
  ClientOptions o;
  o.tenant = "a";
  o.token = "ta";
  absl::StatusOr<std::shared_ptr<Connection>> conn = Connection::Open(daemon_->target(), o);
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_EQ((*conn)->arena_maps(), 0);
  std::unique_ptr<Backend> engine = NewCpuBackend(1);
  const HostArena* arena = nullptr;
  {
    absl::StatusOr<std::shared_ptr<ArenaMapping>> m = (*conn)->ArenaFor(engine.get());
    ASSERT_TRUE(m.ok()) << m.status();
    absl::StatusOr<std::shared_ptr<ArenaMapping>> again = (*conn)->ArenaFor(engine.get());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->get(), m->get());
    arena = (*m)->arena;
    EXPECT_FALSE(arena->registered_chunks().empty());
    EXPECT_EQ((*conn)->arena_maps(), 1);
    absl::StatusOr<std::shared_ptr<ArenaMapping>> other = (*conn)->ArenaFor(backend_);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_NE((*other)->arena, arena);
    EXPECT_EQ((*conn)->arena_maps(), 2);
  }
  EXPECT_TRUE(arena->registered_chunks().empty());
  engine.reset();
  absl::StatusOr<std::shared_ptr<ArenaMapping>> m = (*conn)->ArenaFor(backend_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE((*m)->arena->registered_chunks().empty());
  EXPECT_EQ((*conn)->arena_maps(), 2);
}

TEST_F(ServiceTest, TenantsAreIsolated) {
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  std::unique_ptr<Client> b = MustConnect("b", "tb");
  ASSERT_TRUE(a != nullptr && b != nullptr);
  auto s = a->OpenSession(IntegrationSessionOptions(Transport::kShm, backend_));
  ASSERT_TRUE(s.ok()) << s.status();
  const SyntheticTrace trace(IntegrationTrace());
  ASSERT_OK(testing::AppendTokens(**s, trace, 0, 64));
  ASSERT_OK((*s)->Flush());
  const std::string id = (*s)->id();

  // b cannot touch a's session, nor see it, nor tell it from an id nobody has.
  const SessionOptions options = IntegrationSessionOptions(Transport::kShm, backend_);
  EXPECT_EQ(b->Reattach(id, options).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b->CloseSession(id).code(), absl::StatusCode::kNotFound);
  auto stub = RawStub();
  {
    v1::FetchRequest req;
    req.set_session_id(id);
    req.set_layer(0);
    auto ctx = Ctx("b", "tb");
    auto reader = stub->Fetch(ctx.get(), req);
    v1::FetchReply reply;
    while (reader->Read(&reply)) ADD_FAILURE() << "b read a page of a's session";
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  auto listed = b->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  for (const SessionInfo& info : *listed) EXPECT_NE(info.id, id);

  // Wrong or missing credentials: refused at Connect.
  EXPECT_EQ(ConnectAs("a", "wrong").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ConnectAs("a", "").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ConnectAs("a", "tb").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ConnectAs("nobody", "").status().code(), absl::StatusCode::kPermissionDenied);

  // The attach socket hands out the caller's own arena only.
  EXPECT_EQ(AttachToArena(daemon_->attach_path(), "a", "tb").status().code(),
            absl::StatusCode::kPermissionDenied);
  auto arena_a = AttachToArena(daemon_->attach_path(), "a", "ta");
  auto arena_b = AttachToArena(daemon_->attach_path(), "b", "tb");
  ASSERT_TRUE(arena_a.ok()) << arena_a.status();
  ASSERT_TRUE(arena_b.ok()) << arena_b.status();
  auto info = (*s)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  auto* base_a = static_cast<char*>(arena_a->arena->data()) + info->region_offset;
  auto* base_b = static_cast<char*>(arena_b->arena->data()) + info->region_offset;
  auto region_a = SessionRegion::Open(base_a, info->region_bytes, options.geometry);
  ASSERT_TRUE(region_a.ok()) << region_a.status();
  EXPECT_EQ(region_a->CommittedPrefix(0), 2);
  EXPECT_FALSE(SessionRegion::Open(base_b, info->region_bytes, options.geometry).ok())
      << "b's arena holds a's session region";
  ASSERT_OK((*s)->Close());
}

TEST_F(ServiceTest, MalformedRequestsAreRefusedAndTheDaemonKeepsServing) {
  auto stub = RawStub();
  const SessionOptions good = IntegrationSessionOptions(Transport::kGrpc);

  // Bad geometry: INVALID_ARGUMENT naming the field.
  {
    v1::OpenSessionRequest req;
    req.set_tenant("a");
    req.mutable_geometry()->set_num_layers(2);
    req.mutable_geometry()->set_num_q_heads(8);
    req.mutable_geometry()->set_num_kv_heads(2);
    req.mutable_geometry()->set_head_dim(100);
    req.mutable_geometry()->set_page_size(32);
    req.mutable_geometry()->set_dtype(v1::DTYPE_FP16);
    req.set_transport(v1::TRANSPORT_GRPC);
    v1::OpenSessionReply reply;
    auto ctx = Ctx("a", "ta");
    const grpc::Status st = stub->OpenSession(ctx.get(), req, &reply);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("head_dim"), std::string::npos) << st.error_message();
  }
  ExpectServing(*stub);

  // Quota: a session whose region does not fit the tenant's 64 MiB.
  {
    SessionOptions big = good;
    big.sequence.max_tokens = 131072;  // 2 layers × 4096 pages × 16 KiB = 128 MiB
    std::unique_ptr<Client> a = MustConnect("a", "ta");
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(a->OpenSession(big).status().code(), absl::StatusCode::kResourceExhausted);
  }
  ExpectServing(*stub);

  // Unknown session: NOT_FOUND.
  {
    v1::StepRequest req;
    req.set_session_id("no-such-session");
    req.set_q(std::string(8 * 64 * 2, '\0'));
    v1::StepReply reply;
    auto ctx = Ctx("a", "ta");
    EXPECT_EQ(stub->Step(ctx.get(), req, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  ExpectServing(*stub);

  // A real session for the per-session checks.
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  auto s = a->OpenSession(good);
  ASSERT_TRUE(s.ok()) << s.status();
  const SyntheticTrace trace(IntegrationTrace());
  ASSERT_OK(testing::AppendTokens(**s, trace, 0, 40));
  const std::string id = (*s)->id();

  // A message beyond max_message_bytes: RESOURCE_EXHAUSTED.
  {
    v1::StepRequest req;
    req.set_session_id(id);
    req.set_q(std::string(kMaxMessageBytes + 1024, '\0'));
    v1::StepReply reply;
    auto ctx = Ctx("a", "ta");
    EXPECT_EQ(stub->Step(ctx.get(), req, &reply).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  ExpectServing(*stub);

  // A layer beyond the session: INVALID_ARGUMENT naming the layer, the code the Retriever
  // itself gives a bad layer (retriever.h).
  {
    v1::StepRequest req;
    req.set_session_id(id);
    req.set_layer(99);
    req.set_q(std::string(8 * 64 * 2, '\0'));
    v1::StepReply reply;
    auto ctx = Ctx("a", "ta");
    const grpc::Status st = stub->Step(ctx.get(), req, &reply);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("layer"), std::string::npos) << st.error_message();
  }
  ExpectServing(*stub);

  // A query of the wrong size, and an Offload whose bytes do not match num_tokens:
  // INVALID_ARGUMENT.
  {
    v1::StepRequest req;
    req.set_session_id(id);
    req.set_q(std::string(7, '\0'));
    v1::StepReply reply;
    auto ctx = Ctx("a", "ta");
    EXPECT_EQ(stub->Step(ctx.get(), req, &reply).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    auto ctx = Ctx("a", "ta");
    v1::OffloadReply reply;
    auto writer = stub->Offload(ctx.get(), &reply);
    v1::OffloadRequest req;
    req.set_session_id(id);
    req.set_layer(0);
    req.set_num_tokens(4);
    req.set_k(std::string(10, '\0'));
    req.set_v(std::string(10, '\0'));
    req.set_commit(true);
    writer->Write(req);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  ExpectServing(*stub);
  // The refused Offload left nothing behind.
  auto info = (*s)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->committed_tokens, (std::vector<int64_t>{40, 40}));

  // A page beyond the session: OUT_OF_RANGE; one not committed yet: NOT_FOUND.
  EXPECT_EQ((*s)->FetchPages(0, {1000}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*s)->FetchPages(0, {1}).status().code(), absl::StatusCode::kNotFound);
  ExpectServing(*stub);
  ASSERT_OK((*s)->Close());
}

TEST_F(ServiceTest, CApiDrivesAnShmSessionLikeTheCppApi) {
  kvtier_client_options co;
  kvtier_client_options_init(&co);
  co.tenant = "a";
  co.token = "ta";
  kvtier_client* client = nullptr;
  ASSERT_EQ(kvtier_connect(daemon_->target().c_str(), &co, &client), KVTIER_OK)
      << kvtier_last_error();
  kvtier_session_options so;
  kvtier_session_options_init(&so);
  so.geometry = {2, 8, 2, 64, 32, KVTIER_DTYPE_F16};
  so.budget_tokens = 512;
  so.max_tokens = 2048;
  kvtier_session* cs = nullptr;
  {
    // host_tokens and host_drop_demote reach the daemon: below max_tokens without demotion
    // is refused, and demotion without a cold tier too.
    kvtier_session_options small = so;
    small.host_tokens = 1024;
    EXPECT_EQ(kvtier_open_session(client, &small, &cs), KVTIER_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvtier_last_error()).find("retrieval.host_tokens = 1024"),
              std::string::npos)
        << kvtier_last_error();
    small.host_drop_demote = 1;
    EXPECT_EQ(kvtier_open_session(client, &small, &cs), KVTIER_FAILED_PRECONDITION);
    EXPECT_NE(std::string(kvtier_last_error()).find("no cold tier"), std::string::npos)
        << kvtier_last_error();
    small.host_drop_demote = 2;
    EXPECT_EQ(kvtier_open_session(client, &small, &cs), KVTIER_INVALID_ARGUMENT);
    EXPECT_EQ(cs, nullptr);
    // A struct not made by kvtier_session_options_init is refused before the daemon is asked.
    kvtier_session_options zeroed = so;
    zeroed.struct_size = 0;
    EXPECT_EQ(kvtier_open_session(client, &zeroed, &cs), KVTIER_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvtier_last_error())
                  .find("kvtier_session_options.struct_size = 0: fill the struct with "
                        "kvtier_session_options_init"),
              std::string::npos)
        << kvtier_last_error();
    EXPECT_EQ(cs, nullptr);
  }
  ASSERT_EQ(kvtier_open_session(client, &so, &cs), KVTIER_OK) << kvtier_last_error();
  EXPECT_NE(std::string(kvtier_session_id(cs)), "");

  // The same trace through the C++ API on the client's own CPU backend, as the C API uses.
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  auto ref = a->OpenSession(IntegrationSessionOptions(Transport::kShm, nullptr));
  ASSERT_TRUE(ref.ok()) << ref.status();

  const SyntheticTrace trace(IntegrationTrace());
  const int32_t prefill = trace.options().prefill;
  for (int32_t l = 0; l < 2; ++l) {
    ASSERT_EQ(kvtier_append(cs, l, trace.K(l, 0), trace.V(l, 0), prefill), KVTIER_OK)
        << kvtier_last_error();
  }
  ASSERT_OK(testing::AppendTokens(**ref, trace, 0, prefill));
  auto expected = testing::RunDecode(**ref, trace, 0, 8);
  ASSERT_TRUE(expected.ok()) << expected.status();
  for (int32_t step = 0; step < 8; ++step) {
    for (int32_t l = 0; l < 2; ++l) {
      const int32_t token = prefill + step;
      const void* q = trace.Query(l, step);
      ASSERT_EQ(kvtier_append(cs, l, trace.K(l, token), trace.V(l, token), 1), KVTIER_OK);
      int32_t num_slots = 0;
      std::vector<int32_t> table(4);  // too small: the step runs, the table is refused
      std::vector<uint8_t> out(8 * 64 * 2);
      std::vector<float> lse(8);
      if (step == 0 && l == 0) {
        ASSERT_EQ(
            kvtier_decode(cs, l, q, out.data(), lse.data(), &num_slots, table.data(), table.size()),
            KVTIER_OUT_OF_RANGE);
        EXPECT_NE(std::string(kvtier_last_error()).find("slot_table_capacity"), std::string::npos);
      } else {
        table.resize(64);
        ASSERT_EQ(
            kvtier_decode(cs, l, q, out.data(), lse.data(), &num_slots, table.data(), table.size()),
            KVTIER_OK)
            << kvtier_last_error();
        table.resize(static_cast<size_t>(2 * num_slots));
        EXPECT_EQ(table, (*expected)[step][l].slot_table) << "step " << step << " layer " << l;
      }
      EXPECT_EQ(num_slots, 16);
      EXPECT_EQ(out, (*expected)[step][l].output) << "step " << step << " layer " << l;
    }
  }
  EXPECT_EQ(kvtier_num_tokens(cs, 0), prefill + 8);
  ASSERT_EQ(kvtier_flush(cs), KVTIER_OK) << kvtier_last_error();
  ASSERT_EQ(kvtier_close_session(cs), KVTIER_OK) << kvtier_last_error();
  EXPECT_EQ(kvtier_append(cs, 0, trace.K(0, 0), trace.V(0, 0), 1), KVTIER_FAILED_PRECONDITION);
  kvtier_session_free(cs);
  kvtier_client_free(client);
  ASSERT_OK((*ref)->Close());
}

TEST_F(ServiceTest, CApiCarriesTheCorrectionTriggerAndRefusesBadOnes) {
  kvtier_client_options co;
  kvtier_client_options_init(&co);
  co.tenant = "a";
  co.token = "ta";
  kvtier_client* client = nullptr;
  ASSERT_EQ(kvtier_connect(daemon_->target().c_str(), &co, &client), KVTIER_OK)
      << kvtier_last_error();
  kvtier_session_options so;
  kvtier_session_options_init(&so);
  so.geometry = {2, 8, 2, 64, 32, KVTIER_DTYPE_F16};
  so.budget_tokens = 512;
  so.max_tokens = 2048;
  so.correction_trigger = KVTIER_CORRECTION_TRIGGER_MASS;
  so.correction_max_loss = 0.2f;
  so.label = "c-mass";
  kvtier_session* cs = nullptr;
  ASSERT_EQ(kvtier_open_session(client, &so, &cs), KVTIER_OK) << kvtier_last_error();
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  auto list = a->ListSessions();
  ASSERT_TRUE(list.ok()) << list.status();
  bool seen = false;
  for (const SessionInfo& info : *list) {
    if (info.id != kvtier_session_id(cs)) continue;
    seen = true;
    EXPECT_EQ(info.correction_trigger, CorrectionTrigger::kMass);
    EXPECT_FLOAT_EQ(info.correction_max_loss, 0.2f);
  }
  EXPECT_TRUE(seen);
  ASSERT_EQ(kvtier_close_session(cs), KVTIER_OK) << kvtier_last_error();
  kvtier_session_free(cs);

  so.correction_trigger = 7;
  EXPECT_EQ(kvtier_open_session(client, &so, &cs), KVTIER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvtier_last_error()).find("correction_trigger = 7"), std::string::npos)
      << kvtier_last_error();
  so.correction_trigger = KVTIER_CORRECTION_TRIGGER_MASS;
  so.correction_max_loss = 1.5f;
  EXPECT_EQ(kvtier_open_session(client, &so, &cs), KVTIER_INVALID_ARGUMENT);
  const std::string error = kvtier_last_error();
  EXPECT_NE(error.find("correction_max_loss = 1.5"), std::string::npos) << error;
  EXPECT_NE(error.find("[0, 1]"), std::string::npos) << error;
  kvtier_client_free(client);
}

// ---- SuspendSession ------------------------------------------------------------------------

// The daemon's record of session `id` in `client`'s tenant.
absl::StatusOr<SessionInfo> Listed(Client& client, const std::string& id) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<SessionInfo> list, client.ListSessions());
  for (SessionInfo& s : list) {
    if (s.id == id) return s;
  }
  return absl::NotFoundError("session " + id + " is not listed");
}

// The status of a raw Offload of `n` tokens of layer `layer` at `start`, committed.
grpc::Status RawOffload(v1::KvTier::Stub& stub, const std::string& id,
                        const testing::SyntheticTrace& trace, uint32_t layer, int32_t start,
                        int32_t n) {
  constexpr size_t kTokenBytes = 2 * 64 * 2;  // Hkv × d × fp16
  v1::OffloadRequest req;
  req.set_session_id(id);
  req.set_layer(layer);
  req.set_start_token(static_cast<uint64_t>(start));
  req.set_num_tokens(static_cast<uint32_t>(n));
  req.set_k(trace.K(static_cast<int32_t>(layer), start), static_cast<size_t>(n) * kTokenBytes);
  req.set_v(trace.V(static_cast<int32_t>(layer), start), static_cast<size_t>(n) * kTokenBytes);
  req.set_commit(true);
  v1::OffloadReply reply;
  auto ctx = NewCallContext("a", "ta", absl::Seconds(30));
  auto writer = stub.Offload(ctx.get(), &reply);
  (void)writer->Write(req);
  writer->WritesDone();
  return writer->Finish();
}

TEST_F(ServiceTest, SuspendedGrpcSessionRefusesWorkUntilReattached) {
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  const SessionOptions options = IntegrationSessionOptions(Transport::kGrpc);
  auto s = a->OpenSession(options);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string id = (*s)->id();
  const uint64_t opened_epoch = (*s)->epoch();
  const SyntheticTrace trace(IntegrationTrace());
  constexpr int32_t kAppended = 100;  // 3 full pages and 4 tokens
  constexpr int32_t kFullPages = 96;
  ASSERT_OK(testing::AppendTokens(**s, trace, 0, kAppended));
  std::vector<uint8_t> out(8 * 64 * 2);
  ASSERT_OK((*s)->sequence().Decode(0, trace.Query(0, 0), out.data(), nullptr));

  ASSERT_OK((*s)->Suspend());
  auto info = Listed(*a, id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->suspended);
  EXPECT_FALSE(info->closing);
  EXPECT_GT(info->epoch, opened_epoch);
  const uint64_t suspended_epoch = info->epoch;
  // Info still reads the daemon's record.
  auto own = (*s)->Info();
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_TRUE(own->suspended);

  // The suspended object refuses work, saying why.
  absl::Status st = (*s)->sequence().Append(0, trace.K(0, kAppended), trace.V(0, kAppended), 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("suspended"), std::string::npos) << st;
  st = (*s)->sequence().Decode(0, trace.Query(0, 1), out.data(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ((*s)->Flush().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*s)->FetchPages(0, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK((*s)->Suspend());  // again: OK

  // So does the daemon: Offload and Step are FAILED_PRECONDITION, Fetch and GetStats work.
  auto stub = RawStub();
  EXPECT_EQ(RawOffload(*stub, id, trace, 0, kAppended, 1).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  {
    v1::StepRequest req;
    req.set_session_id(id);
    req.set_layer(0);
    req.set_q(trace.Query(0, 1), 8 * 64 * 2);
    req.set_step(2);
    v1::StepReply reply;
    EXPECT_EQ(stub->Step(Ctx("a", "ta").get(), req, &reply).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  {
    v1::GetStatsRequest req;
    req.set_session_id(id);
    v1::GetStatsReply reply;
    const grpc::Status gs = stub->GetStats(Ctx("a", "ta").get(), req, &reply);
    EXPECT_TRUE(gs.ok()) << gs.error_message();
  }
  {
    v1::FetchRequest req;
    req.set_session_id(id);
    req.set_layer(0);
    auto ctx = Ctx("a", "ta");
    auto reader = stub->Fetch(ctx.get(), req);
    v1::FetchReply reply;
    int pages = 0;
    while (reader->Read(&reply)) pages += reply.pages_size();
    const grpc::Status fs = reader->Finish();
    EXPECT_TRUE(fs.ok()) << fs.error_message();
    EXPECT_GE(pages, kFullPages / 32);
  }
  // Closing the suspended object leaves the daemon's session for a Reattach.
  ASSERT_OK((*s)->Close());
  ASSERT_TRUE(Listed(*a, id).ok());

  auto re = a->Reattach(id, options);
  ASSERT_TRUE(re.ok()) << re.status();
  EXPECT_GT((*re)->epoch(), suspended_epoch);
  info = Listed(*a, id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->suspended);
  EXPECT_FALSE(info->cold);
  for (int32_t l = 0; l < 2; ++l) {
    // The committed full pages at least (the partial one may be the engine's to re-append).
    const int32_t n = (*re)->sequence().num_tokens(l);
    EXPECT_TRUE(n == kFullPages || n == kAppended) << "layer " << l << ": " << n;
    EXPECT_EQ(info->committed_tokens[static_cast<size_t>(l)], n);
    if (n < kAppended) {
      ASSERT_OK((*re)->sequence().Append(l, trace.K(l, n), trace.V(l, n), kAppended - n));
    }
    EXPECT_EQ((*re)->sequence().num_tokens(l), kAppended);
  }
  // Decoding works again, and matches a session that was never suspended.
  auto fresh = a->OpenSession(options);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_OK(testing::AppendTokens(**fresh, trace, 0, kAppended));
  std::vector<uint8_t> ref(out.size());
  ASSERT_OK((*fresh)->sequence().Decode(1, trace.Query(1, 0), ref.data(), nullptr));
  ASSERT_OK((*re)->sequence().Decode(1, trace.Query(1, 0), out.data(), nullptr));
  EXPECT_EQ(out, ref);
  ASSERT_OK((*re)->sequence().Decode(0, trace.Query(0, 1), out.data(), nullptr));
  ASSERT_OK((*re)->Close());
  ASSERT_OK((*fresh)->Close());
  EXPECT_EQ(Listed(*a, id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, SuspendedShmSessionIsFlushedAndReattachedWithItsPages) {
  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  const SessionOptions options = IntegrationSessionOptions(Transport::kShm, backend_);
  auto s = a->OpenSession(options);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string id = (*s)->id();
  const SyntheticTrace trace(IntegrationTrace());
  constexpr int32_t kAppended = 2 * 32 + 10;  // two full pages and a partial one
  constexpr int32_t kFullPages = 64;
  ASSERT_OK(testing::AppendTokens(**s, trace, 0, kAppended));

  ASSERT_OK((*s)->Suspend());  // no Flush before: Suspend flushes
  auto info = Listed(*a, id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->suspended);
  EXPECT_EQ(info->committed_tokens, (std::vector<int64_t>{kFullPages, kFullPages}));
  const uint64_t suspended_epoch = info->epoch;
  EXPECT_GT(suspended_epoch, (*s)->epoch());
  absl::Status st = (*s)->sequence().Append(0, trace.K(0, kAppended), trace.V(0, kAppended), 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  st = (*s)->FetchPages(0, {}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("Client::Reattach"), std::string::npos) << st;
  EXPECT_EQ((*s)->Flush().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK((*s)->Suspend());
  ASSERT_OK((*s)->Close());  // leaves the daemon's session
  s->reset();                // and destroying it does nothing more
  ASSERT_TRUE(Listed(*a, id).ok());

  auto re = a->Reattach(id, options);
  ASSERT_TRUE(re.ok()) << re.status();
  EXPECT_GT((*re)->epoch(), suspended_epoch);
  for (int32_t l = 0; l < 2; ++l) {
    EXPECT_EQ((*re)->sequence().num_tokens(l), kFullPages) << "layer " << l;
    auto pages = (*re)->FetchPages(l, {});
    ASSERT_TRUE(pages.ok()) << pages.status();
    ASSERT_EQ(pages->size(), 2u) << "layer " << l;
    for (const FetchedPage& p : *pages) {
      EXPECT_EQ(p.data, testing::TraceHostPage(trace, l, p.page))
          << "layer " << l << " page " << p.page;
    }
  }
  // The engine re-appends the partial page and goes on.
  ASSERT_OK(testing::AppendTokens(**re, trace, kFullPages, 3 * 32));
  ASSERT_OK((*re)->Flush());
  auto pages = (*re)->FetchPages(1, {});
  ASSERT_TRUE(pages.ok()) << pages.status();
  ASSERT_EQ(pages->size(), 3u);
  EXPECT_EQ((*pages)[2].data, testing::TraceHostPage(trace, 1, 2));
  ASSERT_OK((*re)->Close());
  EXPECT_EQ(Listed(*a, id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, SuspendSessionOfAnUnknownIdIsNotFoundAndTwiceIsOk) {
  auto stub = RawStub();
  auto suspend = [&](const std::string& id, v1::SuspendSessionReply* reply) {
    v1::SuspendSessionRequest req;
    req.set_session_id(id);
    return stub->SuspendSession(Ctx("a", "ta").get(), req, reply);
  };
  v1::SuspendSessionReply reply;
  EXPECT_EQ(suspend("no-such-session", &reply).error_code(), grpc::StatusCode::NOT_FOUND);

  std::unique_ptr<Client> a = MustConnect("a", "ta");
  ASSERT_NE(a, nullptr);
  auto s = a->OpenSession(IntegrationSessionOptions(Transport::kGrpc));
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string id = (*s)->id();
  grpc::Status st = suspend(id, &reply);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(reply.session().session_id(), id);
  EXPECT_EQ(reply.session().state(), v1::SESSION_STATE_SUSPENDED);
  reply.Clear();
  st = suspend(id, &reply);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(reply.session().state(), v1::SESSION_STATE_SUSPENDED);
  // Another tenant does not see it.
  {
    v1::SuspendSessionRequest req;
    req.set_session_id(id);
    v1::SuspendSessionReply other;
    EXPECT_EQ(stub->SuspendSession(Ctx("b", "tb").get(), req, &other).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // A suspended session can be closed by id.
  ASSERT_OK(a->CloseSession(id));
  EXPECT_EQ(suspend(id, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  s->reset();
}

TEST_F(ServiceTest, CApiSuspendsAndReattaches) {
  kvtier_client_options co;
  kvtier_client_options_init(&co);
  co.tenant = "a";
  co.token = "ta";
  kvtier_client* client = nullptr;
  ASSERT_EQ(kvtier_connect(daemon_->target().c_str(), &co, &client), KVTIER_OK)
      << kvtier_last_error();
  kvtier_session_options so;
  kvtier_session_options_init(&so);
  so.geometry = {2, 8, 2, 64, 32, KVTIER_DTYPE_F16};
  so.budget_tokens = 512;
  so.max_tokens = 2048;
  so.transport = KVTIER_TRANSPORT_GRPC;
  kvtier_session* cs = nullptr;
  ASSERT_EQ(kvtier_open_session(client, &so, &cs), KVTIER_OK) << kvtier_last_error();
  const std::string id = kvtier_session_id(cs);
  const SyntheticTrace trace(IntegrationTrace());
  for (int32_t l = 0; l < 2; ++l) {
    ASSERT_EQ(kvtier_append(cs, l, trace.K(l, 0), trace.V(l, 0), 64), KVTIER_OK)
        << kvtier_last_error();
  }
  ASSERT_EQ(kvtier_session_suspend(cs), KVTIER_OK) << kvtier_last_error();
  EXPECT_EQ(kvtier_append(cs, 0, trace.K(0, 64), trace.V(0, 64), 1), KVTIER_FAILED_PRECONDITION);
  EXPECT_NE(std::string(kvtier_last_error()).find("suspended"), std::string::npos)
      << kvtier_last_error();
  ASSERT_EQ(kvtier_session_suspend(cs), KVTIER_OK) << kvtier_last_error();
  ASSERT_EQ(kvtier_close_session(cs), KVTIER_OK) << kvtier_last_error();  // left open
  kvtier_session_free(cs);
  cs = nullptr;
  ASSERT_EQ(kvtier_reattach(client, id.c_str(), &so, &cs), KVTIER_OK) << kvtier_last_error();
  EXPECT_EQ(kvtier_num_tokens(cs, 0), 64);
  ASSERT_EQ(kvtier_append(cs, 0, trace.K(0, 64), trace.V(0, 64), 1), KVTIER_OK)
      << kvtier_last_error();
  ASSERT_EQ(kvtier_close_session(cs), KVTIER_OK) << kvtier_last_error();
  kvtier_session_free(cs);
  kvtier_client_free(client);
}

// Its own daemon: this one is drained and stopped.
TEST(ServiceShutdownTest, DrainThenSigtermExitsCleanlyAndRemovesTheSockets) {
  auto d = DaemonProcess::Start(TwoTenants());
  ASSERT_TRUE(d.ok()) << d.status();
  ClientOptions o;
  o.tenant = "a";
  o.token = "ta";
  auto a = Client::Connect((*d)->target(), o);
  ASSERT_TRUE(a.ok()) << a.status();
  // Sessions left open do not hold the shutdown up.
  auto shm = (*a)->OpenSession(IntegrationSessionOptions(Transport::kShm));
  ASSERT_TRUE(shm.ok()) << shm.status();
  auto grpc = (*a)->OpenSession(IntegrationSessionOptions(Transport::kGrpc));
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  const SyntheticTrace trace(IntegrationTrace());
  ASSERT_OK(testing::AppendTokens(**shm, trace, 0, 100));
  ASSERT_OK(testing::AppendTokens(**grpc, trace, 0, 100));

  // Drain needs the admin token; afterwards no new session opens.
  EXPECT_EQ((*a)->Drain(absl::Seconds(5)).code(), absl::StatusCode::kPermissionDenied);
  o.admin_token = kAdminToken;
  auto admin = Client::Connect((*d)->target(), o);
  ASSERT_TRUE(admin.ok()) << admin.status();
  ASSERT_OK((*admin)->Drain(absl::Seconds(5)));
  EXPECT_EQ((*a)->OpenSession(IntegrationSessionOptions(Transport::kGrpc)).status().code(),
            absl::StatusCode::kUnavailable);

  auto status = (*d)->Stop(SIGTERM);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status)) << (*d)->Log();
  EXPECT_EQ(WEXITSTATUS(*status), 0) << (*d)->Log();
  struct stat sb;
  EXPECT_NE(stat((*d)->socket_path().c_str(), &sb), 0) << "the gRPC socket is still there";
  EXPECT_NE(stat((*d)->attach_path().c_str(), &sb), 0) << "the attach socket is still there";
  // The client sees the daemon gone.
  EXPECT_EQ((*grpc)->sequence().Stats().steps, 0);
  EXPECT_EQ((*a)->ListSessions().status().code(), absl::StatusCode::kUnavailable);
}

// An engine in another container reaches the daemon's socket directory as a volume mounted
// at a path of its own, where the attach socket Hello names (the daemon's path) is not: the
// client attaches through the socket of that name beside the one it connected through. The
// daemon's directory is renamed under it, so the path Hello reports no longer exists.
TEST(ServiceSocketDirTest, ShmSessionsAttachThroughTheSocketDirectoryTheClientSees) {
  auto d = DaemonProcess::Start(TwoTenants());
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string moved = (*d)->dir() + ".mounted";
  ASSERT_EQ(::rename((*d)->dir().c_str(), moved.c_str()), 0) << std::strerror(errno);
  struct Restore {  // the daemon's directory back where its owner removes it
    std::string from, to;
    ~Restore() { ::rename(from.c_str(), to.c_str()); }
  } restore{moved, (*d)->dir()};
  struct stat sb;
  ASSERT_NE(stat((*d)->attach_path().c_str(), &sb), 0);
  ClientOptions o;
  o.tenant = "a";
  o.token = "ta";
  const std::string socket =
      moved + "/" + (*d)->socket_path().substr((*d)->socket_path().rfind('/') + 1);
  auto a = Client::Connect("unix://" + socket, o);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->capabilities().attach_socket, (*d)->attach_path());
  auto shm = (*a)->OpenSession(IntegrationSessionOptions(Transport::kShm));
  ASSERT_TRUE(shm.ok()) << shm.status();
  const SyntheticTrace trace(IntegrationTrace());
  ASSERT_OK(testing::AppendTokens(**shm, trace, 0, 100));
  EXPECT_EQ((*shm)->sequence().num_tokens(0), 100);
  ASSERT_OK((*shm)->Close());
}

// kvtierd in a pid namespace of its own, as in a container, and the engine outside it: the
// engine's pid is 0 on the daemon's side of SO_PEERCRED, which is not "unknown credentials".
// The daemon runs under `unshare --pid --fork` (root).
TEST(ServiceSocketDirTest, AnEngineInAnotherPidNamespaceAttaches) {
  const bool ci = std::getenv("CI") != nullptr && std::string(std::getenv("CI")) == "true";
  if (::geteuid() != 0 || ::access("/usr/bin/unshare", X_OK) != 0) {
    if (ci) FAIL() << "needs root and /usr/bin/unshare";
    GTEST_SKIP() << "needs root and /usr/bin/unshare";
  }
  // A wrapper in the place of kvtierd: the daemon, as pid 1 of a new pid namespace.
  char dir[] = "/tmp/kvtierd-pidns-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string wrapper = std::string(dir) + "/kvtierd";
  {
    std::ofstream w(wrapper);
    w << "#!/bin/sh\nexec /usr/bin/unshare --pid --fork --kill-child " << KVTIERD_PATH
      << " \"$@\"\n";
  }
  ASSERT_EQ(::chmod(wrapper.c_str(), 0755), 0);
  DaemonProcessOptions options = TwoTenants();
  options.kvtierd_path = wrapper;
  {
    auto d = DaemonProcess::Start(options);
    ASSERT_TRUE(d.ok()) << d.status();
    ClientOptions o;
    o.tenant = "a";
    o.token = "ta";
    auto a = Client::Connect((*d)->target(), o);
    ASSERT_TRUE(a.ok()) << a.status();
    auto shm = (*a)->OpenSession(IntegrationSessionOptions(Transport::kShm));
    ASSERT_TRUE(shm.ok()) << shm.status() << "\n" << (*d)->Log();
    const SyntheticTrace trace(IntegrationTrace());
    ASSERT_OK(testing::AppendTokens(**shm, trace, 0, 64));
    EXPECT_EQ((*shm)->sequence().num_tokens(0), 64);
    ASSERT_OK((*shm)->Close());
  }
  std::filesystem::remove_all(dir);
}

// docs/service.md, "What survives what": a daemon restart keeps no session. Arenas are memfds
// owned by the daemon, so the restarted daemon does not know the old session ids: Reattach
// answers NOT_FOUND (not a crash, not a hang), and a new session works at once.
TEST(ServiceShutdownTest, SessionsDoNotSurviveADaemonRestart) {
  auto first = DaemonProcess::Start(TwoTenants());
  ASSERT_TRUE(first.ok()) << first.status();
  ClientOptions o;
  o.tenant = "a";
  o.token = "ta";
  auto a = Client::Connect((*first)->target(), o);
  ASSERT_TRUE(a.ok()) << a.status();
  auto shm = (*a)->OpenSession(IntegrationSessionOptions(Transport::kShm));
  ASSERT_TRUE(shm.ok()) << shm.status();
  const SyntheticTrace trace(IntegrationTrace());
  ASSERT_OK(testing::AppendTokens(**shm, trace, 0, 100));
  ASSERT_OK((*shm)->Flush());
  const std::string id = (*shm)->id();
  auto stopped = (*first)->Stop(SIGTERM);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(WEXITSTATUS(*stopped), 0) << (*first)->Log();

  auto second = DaemonProcess::Start(TwoTenants());
  ASSERT_TRUE(second.ok()) << second.status();
  auto again = Client::Connect((*second)->target(), o);
  ASSERT_TRUE(again.ok()) << again.status();
  auto lost = (*again)->Reattach(id, IntegrationSessionOptions(Transport::kShm));
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kNotFound) << lost.status();
  auto fresh = (*again)->OpenSession(IntegrationSessionOptions(Transport::kShm));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_OK(testing::AppendTokens(**fresh, trace, 0, 100));
  ASSERT_OK((*fresh)->Close());
}

}  // namespace
}  // namespace kvtier
