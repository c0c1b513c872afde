// The one-option table (tests/include/option_table.toml) against every C++ entry point that
// takes sequence options: the resolver itself (but for the policies, which are their
// registry's), NewLocalSequence (in-process), the C++ client, the C API, and the real kvtierd
// (a subprocess) over gRPC with a raw stub, so that the daemon, not a client, judges. Each must accept the same cases and refuse the others with
// INVALID_ARGUMENT and the table's message, word for word. The Python client runs the same
// table (client/python/tests/test_client.py).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/rpc_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kvtier/c_api.h"
#include "kvtier/client.h"
#include "kvtier/device.h"
#include "kvtier/options.h"
#include "kvtier/sequence.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "proto/convert.h"
#include "tests/client/daemon_process.h"
#include "toml++/toml.h"

namespace kvtier {
namespace {

using testing::DaemonProcess;
using testing::DaemonProcessOptions;

constexpr char kTenant[] = "a";
constexpr char kToken[] = "ta";

// One row of the table: [base] with the case's fields changed.
struct OptionCase {
  std::string name;
  int32_t page_size = 0;
  std::string mode;
  int64_t budget_tokens = 0;
  int64_t max_tokens = 0;
  float correction_threshold = 0;
  std::string correction_trigger;
  float correction_max_loss = 0;
  std::string summary;
  // The budget's split, both or neither (neither: SetBudgetTokens's); the rest is selected.
  std::optional<int64_t> sink_pages, recent_pages;
  PolicyConfig policy;
  bool wire = true;
  bool resolver = true;  // the resolver judges the case (false: the policy registry does)
  std::string error;     // empty: accepted
};

void Read(const toml::table& t, OptionCase* c) {
  if (auto v = t["name"].value<std::string>()) c->name = *v;
  if (auto v = t["page_size"].value<int64_t>()) c->page_size = static_cast<int32_t>(*v);
  if (auto v = t["mode"].value<std::string>()) c->mode = *v;
  if (auto v = t["budget_tokens"].value<int64_t>()) c->budget_tokens = *v;
  if (auto v = t["max_tokens"].value<int64_t>()) c->max_tokens = *v;
  if (auto v = t["correction_threshold"].value<double>()) {
    c->correction_threshold = static_cast<float>(*v);
  }
  if (auto v = t["correction_trigger"].value<std::string>()) c->correction_trigger = *v;
  if (auto v = t["correction_max_loss"].value<double>()) {
    c->correction_max_loss = static_cast<float>(*v);
  }
  if (auto v = t["summary"].value<std::string>()) c->summary = *v;
  if (auto v = t["sink_pages"].value<int64_t>()) c->sink_pages = *v;
  if (auto v = t["recent_pages"].value<int64_t>()) c->recent_pages = *v;
  if (auto v = t["budget_policy"].value<std::string>()) c->policy.budget = *v;
  if (auto v = t["residency_policy"].value<std::string>()) c->policy.residency = *v;
  if (auto v = t["host_drop"].value<std::string>()) c->policy.host_drop = *v;
  if (const toml::table* params = t["policy_params"].as_table()) {
    for (const auto& [key, value] : *params) {
      if (auto s = value.value<std::string>()) c->policy.params[std::string(key.str())] = *s;
    }
  }
  if (auto v = t["wire"].value<bool>()) c->wire = *v;
  if (auto v = t["resolver"].value<bool>()) c->resolver = *v;
  if (auto v = t["error"].value<std::string>()) c->error = *v;
}

std::vector<OptionCase> LoadTable() {
  toml::parse_result parsed = toml::parse_file(KVTIER_OPTION_TABLE);
  if (!parsed) {
    ADD_FAILURE() << KVTIER_OPTION_TABLE << ": " << parsed.error().description();
    return {};
  }
  const toml::table& root = parsed.table();
  OptionCase base;
  if (const toml::table* b = root["base"].as_table()) Read(*b, &base);
  std::vector<OptionCase> cases;
  if (const toml::array* rows = root["case"].as_array()) {
    for (const toml::node& row : *rows) {
      OptionCase c = base;
      if (const toml::table* t = row.as_table()) Read(*t, &c);
      cases.push_back(c);
    }
  }
  return cases;
}

RetrievalMode ModeOf(const std::string& name) {
  for (RetrievalMode m : {RetrievalMode::kSpeculative, RetrievalMode::kSync, RetrievalMode::kFull,
                          RetrievalMode::kDrop}) {
    if (RetrievalModeName(m) == name) return m;
  }
  ADD_FAILURE() << "mode '" << name << "' is not a RetrievalMode";
  return RetrievalMode::kSpeculative;
}

Geometry TableGeometry(const OptionCase& c) {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 8;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.page_size = c.page_size;
  g.dtype = DType::kF16;
  return g;
}

// The case as an engine fills SequenceOptions: the budget through SetBudgetTokens.
absl::StatusOr<SequenceOptions> SequenceOptionsOf(const OptionCase& c) {
  SequenceOptions o;
  o.mode = ModeOf(c.mode);
  if (absl::Status st = o.SetBudgetTokens(static_cast<int32_t>(c.budget_tokens), c.page_size);
      !st.ok()) {
    return st;
  }
  EXPECT_EQ(c.sink_pages.has_value(), c.recent_pages.has_value()) << c.name << ": both or neither";
  if (c.sink_pages.has_value()) {
    if (absl::Status st = o.SplitBudget(*c.sink_pages, *c.recent_pages); !st.ok()) return st;
  }
  o.max_tokens = static_cast<int32_t>(c.max_tokens);
  o.correction_threshold = c.correction_threshold;
  EXPECT_TRUE(ParseCorrectionTrigger(c.correction_trigger, &o.correction_trigger));
  o.correction_max_loss = c.correction_max_loss;
  EXPECT_TRUE(ParseSummaryMode(c.summary, &o.summary)) << c.name;
  o.policy = c.policy;
  return o;
}

// ---- the entry points ----------------------------------------------------------------------

absl::Status ViaResolver(const OptionCase& c) {
  absl::StatusOr<SequenceOptions> o = SequenceOptionsOf(c);
  if (!o.ok()) return o.status();
  absl::StatusOr<SequenceOptions> resolved = ResolveSequenceOptions(*o, c.page_size);
  if (resolved.ok()) {
    // Nothing is clamped or filled in, and resolving is idempotent.
    EXPECT_EQ(resolved->correction_threshold, o->correction_threshold) << c.name;
    EXPECT_EQ(resolved->max_tokens, o->max_tokens) << c.name;
    EXPECT_TRUE(ResolveSequenceOptions(*resolved, c.page_size).ok()) << c.name;
  }
  return resolved.status();
}

absl::Status InProcess(const OptionCase& c, Device& device) {
  absl::StatusOr<SequenceOptions> o = SequenceOptionsOf(c);
  if (!o.ok()) return o.status();
  absl::StatusOr<std::unique_ptr<LocalSequence>> s = NewLocalSequence(TableGeometry(c), *o, device);
  if (s.ok()) {
    EXPECT_EQ((*s)->options().correction_threshold, c.correction_threshold) << c.name;
    EXPECT_EQ(SummaryModeName((*s)->options().summary), c.summary) << c.name;
    EXPECT_EQ((*s)->options().sink_pages, o->sink_pages) << c.name;
    EXPECT_EQ((*s)->options().recent_pages, o->recent_pages) << c.name;
  }
  return s.status();
}

absl::Status ViaCppClient(const OptionCase& c, Client& client) {
  SessionOptions so;
  so.geometry = TableGeometry(c);
  absl::StatusOr<SequenceOptions> o = SequenceOptionsOf(c);
  if (!o.ok()) return o.status();
  so.sequence = *o;
  so.transport = Transport::kGrpc;
  so.label = "option-table";
  absl::StatusOr<std::unique_ptr<Session>> s = client.OpenSession(so);
  if (!s.ok()) return s.status();
  EXPECT_EQ((*s)->sequence().options().correction_threshold, c.correction_threshold) << c.name;
  EXPECT_EQ(SummaryModeName((*s)->sequence().options().summary), c.summary) << c.name;
  EXPECT_EQ((*s)->sequence().options().sink_pages, o->sink_pages) << c.name;
  EXPECT_EQ((*s)->sequence().options().selected_pages, o->selected_pages) << c.name;
  EXPECT_EQ((*s)->sequence().options().recent_pages, o->recent_pages) << c.name;
  absl::StatusOr<SessionInfo> info = (*s)->Info();
  if (info.ok()) {
    EXPECT_EQ(SummaryModeName(info->summary), c.summary) << c.name << ": the daemon's record";
    EXPECT_EQ(info->sink_pages, o->sink_pages) << c.name << ": the daemon's record";
    EXPECT_EQ(info->recent_pages, o->recent_pages) << c.name << ": the daemon's record";
  } else {
    ADD_FAILURE() << c.name << ": " << info.status();
  }
  return (*s)->Close();
}

absl::Status ViaCApi(const OptionCase& c, kvtier_client* client) {
  kvtier_session_options so;
  kvtier_session_options_init(&so);
  so.geometry = {2, 8, 2, 64, c.page_size, KVTIER_DTYPE_F16};
  so.mode = static_cast<int32_t>(ModeOf(c.mode));
  so.budget_tokens = static_cast<int32_t>(c.budget_tokens);
  so.max_tokens = static_cast<int32_t>(c.max_tokens);
  so.correction_threshold = c.correction_threshold;
  so.correction_trigger = c.correction_trigger == "mass" ? KVTIER_CORRECTION_TRIGGER_MASS
                                                         : KVTIER_CORRECTION_TRIGGER_COSINE;
  so.correction_max_loss = c.correction_max_loss;
  SummaryMode summary = SummaryMode::kKeyCodes;
  EXPECT_TRUE(ParseSummaryMode(c.summary, &summary)) << c.name;
  so.summary = static_cast<int32_t>(summary);
  if (c.sink_pages.has_value()) {
    so.split = 1;
    so.sink_pages = static_cast<int32_t>(*c.sink_pages);
    so.recent_pages = static_cast<int32_t>(*c.recent_pages);
  }
  so.transport = KVTIER_TRANSPORT_GRPC;
  so.label = "option-table-c";
  const PolicyConfig& p = c.policy;
  std::vector<std::string> kv;
  for (const auto& [key, value] : p.params) kv.push_back(key + "=" + value);
  std::vector<const char*> params;
  for (const std::string& s : kv) params.push_back(s.c_str());
  so.policy.budget = p.budget.c_str();
  so.policy.residency = p.residency.c_str();
  so.policy.host_drop = p.host_drop.c_str();
  so.policy.params = params.data();
  so.policy.num_params = static_cast<int32_t>(params.size());
  kvtier_session* s = nullptr;
  const int rc = kvtier_open_session(client, &so, &s);
  const absl::Status st(static_cast<absl::StatusCode>(rc), kvtier_last_error());
  if (rc != KVTIER_OK) return st;
  const int closed = kvtier_close_session(s);
  EXPECT_EQ(closed, KVTIER_OK) << kvtier_last_error();
  kvtier_session_free(s);
  return absl::OkStatus();
}

// What the daemon answers a raw OpenSession: no client checks anything first.
absl::Status ViaDaemon(const OptionCase& c, v1::KvTier::Stub& stub) {
  v1::OpenSessionRequest req;
  req.set_tenant(kTenant);
  v1::Geometry* g = req.mutable_geometry();
  g->set_num_layers(2);
  g->set_num_q_heads(8);
  g->set_num_kv_heads(2);
  g->set_head_dim(64);
  g->set_page_size(static_cast<uint32_t>(c.page_size));
  g->set_dtype(v1::DTYPE_FP16);
  v1::RetrievalOptions* r = req.mutable_retrieval();
  r->set_mode(ModeToProto(ModeOf(c.mode)));
  r->set_budget_tokens(static_cast<uint32_t>(c.budget_tokens));
  r->set_max_tokens(static_cast<uint32_t>(c.max_tokens));
  r->set_correction_threshold(c.correction_threshold);
  r->set_correction_trigger(c.correction_trigger);
  r->set_correction_max_loss(c.correction_max_loss);
  r->set_summary(c.summary);
  if (c.sink_pages.has_value()) r->set_sink_pages(static_cast<uint32_t>(*c.sink_pages));
  if (c.recent_pages.has_value()) r->set_recent_pages(static_cast<uint32_t>(*c.recent_pages));
  v1::PolicyOptions* po = req.mutable_policy();
  po->set_budget_policy(c.policy.budget);
  po->set_residency_policy(c.policy.residency);
  po->set_host_drop(c.policy.host_drop);
  for (const auto& [key, value] : c.policy.params) (*po->mutable_params())[key] = value;
  req.set_transport(v1::TRANSPORT_GRPC);
  req.set_label("option-table-raw");
  v1::OpenSessionReply reply;
  std::unique_ptr<grpc::ClientContext> ctx = NewCallContext(kTenant, kToken, absl::Seconds(30));
  const grpc::Status st = stub.OpenSession(ctx.get(), req, &reply);
  if (!st.ok()) return FromGrpcStatus(st);
  EXPECT_EQ(reply.session().retrieval().correction_threshold(), c.correction_threshold) << c.name;
  EXPECT_EQ(reply.session().retrieval().summary(), c.summary) << c.name;
  if (c.sink_pages.has_value()) {
    EXPECT_EQ(reply.session().retrieval().sink_pages(), *c.sink_pages) << c.name;
    EXPECT_EQ(reply.session().retrieval().recent_pages(), *c.recent_pages) << c.name;
  }
  v1::CloseSessionRequest close;
  close.set_session_id(reply.session().session_id());
  v1::CloseSessionReply closed;
  ctx = NewCallContext(kTenant, kToken, absl::Seconds(30));
  const grpc::Status cst = stub.CloseSession(ctx.get(), close, &closed);
  EXPECT_TRUE(cst.ok()) << cst.error_message();
  return absl::OkStatus();
}

// ---- the test ------------------------------------------------------------------------------

void ExpectAnswer(const OptionCase& c, const std::string& entry, const absl::Status& st,
                  bool judges = true) {
  if (c.error.empty() || !judges) {
    EXPECT_TRUE(st.ok()) << c.name << " via " << entry << ": " << st;
  } else {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument)
        << c.name << " via " << entry << ": " << st;
    EXPECT_EQ(std::string(st.message()), c.error) << c.name << " via " << entry;
  }
}

class OptionTableTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    DaemonProcessOptions o;
    o.kvtierd_path = KVTIERD_PATH;
    o.tenants = {{kTenant, kToken, uint64_t{64} << 20}};
    o.cpu_threads = 1;
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(o);
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
  }
  void SetUp() override { ASSERT_EQ(start_error_, nullptr) << *start_error_; }

  static DaemonProcess* daemon_;
  static absl::Status* start_error_;
};

DaemonProcess* OptionTableTest::daemon_ = nullptr;
absl::Status* OptionTableTest::start_error_ = nullptr;

TEST_F(OptionTableTest, TheTableCoversBothAnswers) {
  const std::vector<OptionCase> cases = LoadTable();
  int accepted = 0, refused = 0, off_wire = 0, with_policy = 0, by_registry = 0, split = 0;
  for (const OptionCase& c : cases) {
    (c.error.empty() ? accepted : refused) += 1;
    off_wire += c.wire ? 0 : 1;
    with_policy += c.policy.is_default() ? 0 : 1;
    by_registry += c.resolver ? 0 : 1;
    split += c.sink_pages.has_value() ? 1 : 0;
    EXPECT_TRUE(c.resolver || !c.error.empty()) << c.name << ": resolver = false on an accepted case";
  }
  EXPECT_GE(accepted, 5);
  EXPECT_GE(refused, 10);
  EXPECT_LT(off_wire, refused);
  EXPECT_GE(with_policy, 6);
  EXPECT_GE(by_registry, 4);
  EXPECT_GE(split, 5);
}

TEST_F(OptionTableTest, EveryEntryPointAnswersEveryCaseAlike) {
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(DeviceKind::kCpu);
  ASSERT_TRUE(device.ok()) << device.status();
  ClientOptions co;
  co.tenant = kTenant;
  co.token = kToken;
  co.client_name = "option_table_test";
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(daemon_->target(), co);
  ASSERT_TRUE(client.ok()) << client.status();
  kvtier_client_options cco;
  kvtier_client_options_init(&cco);
  cco.tenant = kTenant;
  cco.token = kToken;
  kvtier_client* c_client = nullptr;
  ASSERT_EQ(kvtier_connect(daemon_->target().c_str(), &cco, &c_client), KVTIER_OK)
      << kvtier_last_error();
  std::unique_ptr<v1::KvTier::Stub> stub = v1::KvTier::NewStub(
      grpc::CreateChannel("unix:" + daemon_->socket_path(), grpc::InsecureChannelCredentials()));

  const std::vector<OptionCase> cases = LoadTable();
  ASSERT_FALSE(cases.empty());
  for (const OptionCase& c : cases) {
    // The resolver knows no policy: it accepts what only the policy registry refuses.
    ExpectAnswer(c, "ResolveSequenceOptions", ViaResolver(c), /*judges=*/c.resolver);
    ExpectAnswer(c, "NewLocalSequence", InProcess(c, **device));
    ExpectAnswer(c, "the C++ client", ViaCppClient(c, **client));
    ExpectAnswer(c, "the C API", ViaCApi(c, c_client));
    if (c.wire) ExpectAnswer(c, "kvtierd over gRPC", ViaDaemon(c, *stub));
  }
  kvtier_client_free(c_client);
}

}  // namespace
}  // namespace kvtier
