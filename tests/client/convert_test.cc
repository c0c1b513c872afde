// SessionOptions → OpenSessionRequest and back (client/convert.h), and the Offload chunking
// (client/session_grpc.h): what libkvtier refuses before a round trip.
#include "client/convert.h"

#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "client/session_grpc.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

SessionOptions SmallOptions() {
  SessionOptions o;
  o.geometry.num_layers = 2;
  o.geometry.num_q_heads = 8;
  o.geometry.num_kv_heads = 2;
  o.geometry.head_dim = 64;
  o.geometry.page_size = 32;
  o.geometry.dtype = DType::kF16;
  EXPECT_TRUE(o.sequence.SetBudgetTokens(512, 32).ok());
  o.sequence.max_tokens = 2048;
  o.sequence.correction_threshold = 0.8f;
  o.sequence.correction_trigger = CorrectionTrigger::kMass;
  o.sequence.correction_max_loss = 0.125f;
  o.sequence.mode = RetrievalMode::kSync;
  o.sequence.summary = SummaryMode::kCenterMad;
  o.transport = Transport::kGrpc;
  o.label = "unit";
  return o;
}

TEST(BuildOpenSessionRequestTest, CarriesEveryOption) {
  absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", SmallOptions());
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->tenant(), "a");
  EXPECT_EQ(req->geometry().num_layers(), 2u);
  EXPECT_EQ(req->geometry().num_q_heads(), 8u);
  EXPECT_EQ(req->geometry().num_kv_heads(), 2u);
  EXPECT_EQ(req->geometry().head_dim(), 64u);
  EXPECT_EQ(req->geometry().page_size(), 32u);
  EXPECT_EQ(req->geometry().dtype(), v1::DTYPE_FP16);
  EXPECT_EQ(req->retrieval().mode(), v1::MODE_SYNC);
  EXPECT_EQ(req->retrieval().budget_tokens(), 512u);
  EXPECT_EQ(req->retrieval().max_tokens(), 2048u);
  ASSERT_TRUE(req->retrieval().has_correction_threshold());
  EXPECT_FLOAT_EQ(req->retrieval().correction_threshold(), 0.8f);
  EXPECT_EQ(req->retrieval().correction_trigger(), "mass");
  ASSERT_TRUE(req->retrieval().has_correction_max_loss());
  EXPECT_FLOAT_EQ(req->retrieval().correction_max_loss(), 0.125f);
  EXPECT_EQ(req->retrieval().summary(), "center-mad");
  EXPECT_EQ(req->transport(), v1::TRANSPORT_GRPC);
  EXPECT_EQ(req->label(), "unit");
}

TEST(BuildOpenSessionRequestTest, CarriesThePoliciesWhole) {
  SessionOptions o = SmallOptions();
  o.sequence.policy.budget = "xkv";
  o.sequence.policy.residency = "h2o";
  o.sequence.policy.params["xkv.window"] = "4";
  absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->policy().budget_policy(), "xkv");
  EXPECT_EQ(req->policy().residency_policy(), "h2o");
  EXPECT_EQ(req->policy().host_drop(), "refuse");
  EXPECT_EQ(req->policy().params().at("xkv.window"), "4");
}

TEST(BuildOpenSessionRequestTest, CarriesEverySummaryAndRefusesAnUnknownOne) {
  for (SummaryMode m : {SummaryMode::kMinMax, SummaryMode::kCenterMad, SummaryMode::kKeyCodes}) {
    for (Transport t : {Transport::kGrpc, Transport::kShm}) {
      SessionOptions o = SmallOptions();
      o.sequence.summary = m;
      o.transport = t;
      absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
      ASSERT_TRUE(req.ok()) << req.status();
      EXPECT_EQ(req->retrieval().summary(), SummaryModeName(m));
    }
  }
  SessionOptions o = SmallOptions();
  o.sequence.summary = static_cast<SummaryMode>(7);
  absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
  EXPECT_TRUE(absl::IsInvalidArgument(req.status())) << req.status();
  EXPECT_THAT(std::string(req.status().message()), ::testing::HasSubstr("summary = 7"));
}

TEST(BuildOpenSessionRequestTest, DefaultSequenceOptionsAreFreeKvsBudget) {
  SessionOptions o = SmallOptions();
  o.sequence = SequenceOptions();
  absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->retrieval().budget_tokens(), 2048u);
  EXPECT_EQ(req->retrieval().mode(), v1::MODE_SPECULATIVE);
  EXPECT_EQ(req->retrieval().correction_trigger(), "cosine");
  EXPECT_FLOAT_EQ(req->retrieval().correction_max_loss(), 0.1f);
}

TEST(BuildOpenSessionRequestTest, BadGeometryIsInvalidArgumentNamingTheField) {
  SessionOptions o = SmallOptions();
  o.geometry.head_dim = 100;
  absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
  ASSERT_EQ(req.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(req.status().message().find("head_dim"), std::string::npos) << req.status();
}

TEST(BuildOpenSessionRequestTest, AnySplitOfAWholeBudgetIsCarried) {
  for (auto [sink, selected, recent] :
       {std::tuple{4, 4, 4}, std::tuple{0, 7, 1}, std::tuple{1, 1, 6}, std::tuple{2, 12, 2}}) {
    SessionOptions o = SmallOptions();
    o.sequence.sink_pages = sink;
    o.sequence.selected_pages = selected;
    o.sequence.recent_pages = recent;
    absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
    ASSERT_TRUE(req.ok()) << req.status();
    EXPECT_EQ(req->retrieval().budget_tokens(),
              static_cast<uint32_t>((sink + selected + recent) * o.geometry.page_size));
    ASSERT_TRUE(req->retrieval().has_sink_pages());
    ASSERT_TRUE(req->retrieval().has_recent_pages());
    EXPECT_EQ(req->retrieval().sink_pages(), static_cast<uint32_t>(sink));
    EXPECT_EQ(req->retrieval().recent_pages(), static_cast<uint32_t>(recent));
  }
}

TEST(BuildOpenSessionRequestTest, BudgetsTheProtocolCannotCarryAreInvalidArgument) {
  // Not a multiple of 4 pages: the protocol's budget_tokens goes through SetBudgetTokens.
  for (auto [sink, selected, recent] :
       {std::tuple{1, 3, 2}, std::tuple{2, 4, 3}, std::tuple{0, 0, 1}}) {
    SessionOptions o = SmallOptions();
    o.sequence.sink_pages = sink;
    o.sequence.selected_pages = selected;
    o.sequence.recent_pages = recent;
    absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
    ASSERT_EQ(req.status().code(), absl::StatusCode::kInvalidArgument)
        << sink << "/" << selected << "/" << recent;
    EXPECT_NE(req.status().message().find("sink_pages"), std::string::npos) << req.status();
  }
}

TEST(BuildOpenSessionRequestTest, NegativeMaxTokensAndNonFiniteTauAreInvalidArgument) {
  SessionOptions o = SmallOptions();
  o.sequence.max_tokens = -1;
  EXPECT_EQ(BuildOpenSessionRequest("a", o).status().code(), absl::StatusCode::kInvalidArgument);
  o = SmallOptions();
  o.sequence.correction_threshold = std::numeric_limits<float>::quiet_NaN();
  absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
  EXPECT_EQ(req.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(req.status().message().find("correction_threshold"), std::string::npos);
}

TEST(BuildOpenSessionRequestTest, BadCorrectionTriggerOrMaxLossIsInvalidArgumentNamingIt) {
  for (float bad : {-0.25f, 2.0f, std::numeric_limits<float>::quiet_NaN()}) {
    SessionOptions o = SmallOptions();
    o.sequence.correction_max_loss = bad;
    absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
    EXPECT_EQ(req.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(req.status().message().find("correction_max_loss"), std::string::npos);
    EXPECT_NE(req.status().message().find("[0, 1]"), std::string::npos);
  }
  SessionOptions o = SmallOptions();
  o.sequence.correction_trigger = static_cast<CorrectionTrigger>(5);
  absl::StatusOr<v1::OpenSessionRequest> req = BuildOpenSessionRequest("a", o);
  EXPECT_EQ(req.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(req.status().message().find("correction_trigger = 5"), std::string::npos)
      << req.status();
}

TEST(GeometryProtoTest, RoundTripsAndDefaultsThePageSize) {
  const Geometry g = SmallOptions().geometry;
  absl::StatusOr<Geometry> back = GeometryFromProto(GeometryToProto(g));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, g);
  v1::Geometry p = GeometryToProto(g);
  p.set_page_size(0);
  EXPECT_EQ(GeometryFromProto(p)->page_size, 32);
  p.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(GeometryFromProto(p).status().code(), absl::StatusCode::kInvalidArgument);
  p.set_dtype(v1::DTYPE_BF16);
  p.set_num_layers(1u << 31);
  EXPECT_EQ(GeometryFromProto(p).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ModeProtoTest, UnspecifiedMeansSpeculativeAndEveryModeRoundTrips) {
  EXPECT_EQ(*ModeFromProto(v1::MODE_UNSPECIFIED), RetrievalMode::kSpeculative);
  for (RetrievalMode m : {RetrievalMode::kSpeculative, RetrievalMode::kSync, RetrievalMode::kFull,
                          RetrievalMode::kDrop}) {
    EXPECT_EQ(*ModeFromProto(ModeToProto(m)), m);
  }
  EXPECT_FALSE(ModeFromProto(99).ok());
  EXPECT_EQ(*TransportFromProto(v1::TRANSPORT_UNSPECIFIED), Transport::kShm);
  EXPECT_EQ(*TransportFromProto(TransportToProto(Transport::kGrpc)), Transport::kGrpc);
}

TEST(SessionInfoProtoTest, ResolvedOptionsDriveTheLocalRetriever) {
  v1::SessionInfo p;
  p.set_session_id("s1");
  p.set_tenant("a");
  *p.mutable_geometry() = GeometryToProto(SmallOptions().geometry);
  p.mutable_retrieval()->set_mode(v1::MODE_SPECULATIVE);
  p.mutable_retrieval()->set_budget_tokens(256);
  p.mutable_retrieval()->set_max_tokens(1024);
  p.set_transport(v1::TRANSPORT_SHM);
  p.set_epoch(3);
  p.add_committed_tokens(64);
  p.add_committed_tokens(32);
  p.set_region_offset(65536);
  p.set_region_bytes(131072);
  absl::StatusOr<SessionInfo> info = SessionInfoFromProto(p);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->epoch, 3u);
  EXPECT_EQ(info->committed_tokens, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(info->region_offset, 65536u);
  EXPECT_FLOAT_EQ(info->correction_threshold, kDefaultCorrectionThreshold);  // unset: the default
  EXPECT_EQ(info->correction_trigger, CorrectionTrigger::kCosine);
  EXPECT_FLOAT_EQ(info->correction_max_loss, 0.1f);
  EXPECT_EQ(info->summary, SummaryMode::kKeyCodes);  // unset: the default

  SequenceOptions local;
  local.recall = RecallStrategy::kBatchedDma;
  absl::StatusOr<SequenceOptions> o = SequenceOptionsForSession(local, *info);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->sink_pages, 1);  // 256 tokens: 8 pages, split as SetBudgetTokens splits them
  EXPECT_EQ(o->selected_pages, 5);
  EXPECT_EQ(o->recent_pages, 2);
  EXPECT_EQ(o->max_tokens, 1024);
  EXPECT_EQ(o->recall, RecallStrategy::kBatchedDma);  // local knobs stay

  // The daemon's split, when it sends one, is the sequence's; an unusable one is INTERNAL.
  p.mutable_retrieval()->set_sink_pages(3);
  p.mutable_retrieval()->set_recent_pages(1);
  info = SessionInfoFromProto(p);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sink_pages, 3);
  EXPECT_EQ(info->recent_pages, 1);
  o = SequenceOptionsForSession(local, *info);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->sink_pages, 3);
  EXPECT_EQ(o->selected_pages, 4);
  EXPECT_EQ(o->recent_pages, 1);
  p.mutable_retrieval()->set_recent_pages(6);
  info = SessionInfoFromProto(p);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(SequenceOptionsForSession(local, *info).status().code(), absl::StatusCode::kInternal);
  p.mutable_retrieval()->clear_sink_pages();
  p.mutable_retrieval()->clear_recent_pages();

  // The daemon's trigger drives the local Retriever; an unknown one is refused.
  p.mutable_retrieval()->set_correction_trigger("mass");
  p.mutable_retrieval()->set_correction_max_loss(0.3f);
  absl::StatusOr<SessionInfo> mass = SessionInfoFromProto(p);
  ASSERT_TRUE(mass.ok()) << mass.status();
  absl::StatusOr<SequenceOptions> mo = SequenceOptionsForSession(local, *mass);
  ASSERT_TRUE(mo.ok()) << mo.status();
  EXPECT_EQ(mo->correction_trigger, CorrectionTrigger::kMass);
  EXPECT_FLOAT_EQ(mo->correction_max_loss, 0.3f);
  p.mutable_retrieval()->set_correction_trigger("entropy");
  EXPECT_EQ(SessionInfoFromProto(p).status().code(), absl::StatusCode::kInvalidArgument);
  p.mutable_retrieval()->set_correction_trigger("mass");

  // So does its summary (a reattached SHM session scores pages as it did); an unknown one is
  // refused.
  local.summary = SummaryMode::kKeyCodes;
  p.mutable_retrieval()->set_summary("center-mad");
  absl::StatusOr<SessionInfo> mad = SessionInfoFromProto(p);
  ASSERT_TRUE(mad.ok()) << mad.status();
  EXPECT_EQ(mad->summary, SummaryMode::kCenterMad);
  absl::StatusOr<SequenceOptions> so = SequenceOptionsForSession(local, *mad);
  ASSERT_TRUE(so.ok()) << so.status();
  EXPECT_EQ(so->summary, SummaryMode::kCenterMad);
  p.mutable_retrieval()->set_summary("pca");
  EXPECT_EQ(SessionInfoFromProto(p).status().code(), absl::StatusCode::kInvalidArgument);

  info->budget_tokens = 100;  // not a multiple of 4 pages: a daemon bug
  EXPECT_EQ(SequenceOptionsForSession(local, *info).status().code(), absl::StatusCode::kInternal);
}

TEST(SessionInfoProtoTest, StateSaysClosingSuspendedOrCold) {
  v1::SessionInfo p;
  p.set_session_id("s1");
  *p.mutable_geometry() = GeometryToProto(SmallOptions().geometry);
  p.set_transport(v1::TRANSPORT_GRPC);
  struct Case {
    v1::SessionState state;
    bool closing, suspended, cold;
  };
  for (const Case& c : {Case{v1::SESSION_STATE_OPEN, false, false, false},
                        Case{v1::SESSION_STATE_CLOSING, true, false, false},
                        Case{v1::SESSION_STATE_SUSPENDED, false, true, false},
                        Case{v1::SESSION_STATE_COLD, false, false, true}}) {
    p.set_state(c.state);
    absl::StatusOr<SessionInfo> info = SessionInfoFromProto(p);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->closing, c.closing) << v1::SessionState_Name(c.state);
    EXPECT_EQ(info->suspended, c.suspended) << v1::SessionState_Name(c.state);
    EXPECT_EQ(info->cold, c.cold) << v1::SessionState_Name(c.state);
  }
}

TEST(OffloadChunkTokensTest, BoundedByMessageSizeAndTokenLimit) {
  const Geometry g = SmallOptions().geometry;  // 2 × 2 × 64 × 2 = 512 bytes of K+V a token
  EXPECT_EQ(*OffloadChunkTokens(g, (1 << 20) + 1024, 0, 1024), 2048);
  EXPECT_EQ(*OffloadChunkTokens(g, (1 << 20) + 1024, 100, 1024), 100);
  EXPECT_EQ(*OffloadChunkTokens(g, 512 + 1024, 0, 1024), 1);
  absl::StatusOr<int32_t> none = OffloadChunkTokens(g, 511 + 1024, 0, 1024);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("max_message_bytes"), std::string::npos);
}

// Every counter of kvtier/counters.h crosses the wire by name, and a reply of a daemon that
// predates the map still gives the counters its fields carry.
TEST(CountersProtoTest, EveryCounterRoundTripsAndOldRepliesStillRead) {
  SequenceStats in;
  int64_t v = 1000;
  for (const CounterInfo& c : SequenceCounters()) in.*c.field = v++;
  v1::SessionStats p;
  CountersToProto(in, &p);
  EXPECT_EQ(p.counters_size(), kNumSequenceCounters);
  EXPECT_EQ(p.steps(), in.steps) << "the field of protocol 1 is filled too";
  EXPECT_EQ(p.corrected_heads(), in.corrected_heads);
  const SequenceStats out = StatsFromProto(p);
  for (const CounterInfo& c : SequenceCounters()) {
    EXPECT_EQ(out.*c.field, in.*c.field) << c.name;
    EXPECT_EQ(GetCounter(out, c.name), in.*c.field) << c.name;
  }
  EXPECT_EQ(GetCounter(out, "no_such_counter"), std::nullopt);

  v1::SessionStats old;  // no map: the fields are all there is
  old.set_steps(7);
  old.set_recalled_bytes(4096);
  const SequenceStats from_old = StatsFromProto(old);
  EXPECT_EQ(from_old.steps, 7);
  EXPECT_EQ(from_old.recalled_bytes, 4096);
  EXPECT_EQ(from_old.graph_launches, 0);
}

TEST(CountersTest, NamesAreUniqueAndEveryFieldIsListedOnce) {
  std::set<std::string_view> names;
  std::set<const void*> fields;
  SequenceStats s;
  for (const CounterInfo& c : SequenceCounters()) {
    EXPECT_TRUE(names.insert(c.name).second) << c.name;
    EXPECT_TRUE(fields.insert(&(s.*c.field)).second) << c.name;
    EXPECT_FALSE(c.help.empty()) << c.name;
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kNumSequenceCounters));
}

}  // namespace
}  // namespace kvtier
