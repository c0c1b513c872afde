// KvTierService. Invariants: every call is counted by Begin() once and by End() once, when it
// finishes; a call's in-flight slot and its Caller (whose cancellation reads the gRPC
// context) are gone before the call finishes; a job given to the WorkQueue owns its call and
// finishes it, whether it runs or not.
#include "daemon/kvtier_service.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "daemon/logging.h"
#include "daemon/session_params.h"
#include "proto/convert.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "spdlog/spdlog.h"

#ifndef KVTIER_VERSION_STRING
#define KVTIER_VERSION_STRING "unknown"
#endif

namespace kvtier::daemon {
namespace {

using Raw = grpc::ByteBuffer;

// ---- bytes ⇄ messages -----------------------------------------------------------------------

// Protobuf's log lines while this thread parses a request land here instead of the log: the
// first one says why the parse failed (e.g. the field with invalid UTF-8).
thread_local std::string* parse_log = nullptr;

void ProtobufLogHandler(google::protobuf::LogLevel level, const char* file, int line,
                        const std::string& message) {
  if (parse_log != nullptr) {
    if (parse_log->empty()) *parse_log = message;
    return;
  }
  const spdlog::level::level_enum lvl =
      level >= google::protobuf::LOGLEVEL_ERROR     ? spdlog::level::err
      : level == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                    : spdlog::level::info;
  LogLimited(lvl, "protobuf", "protobuf {}:{} {}", file, line, message);
}

// INVALID_ARGUMENT naming the message type and what protobuf said, when `in` does not parse.
absl::Status Parse(const Raw& in, google::protobuf::Message* message, std::string_view what) {
  Raw bytes(in);  // shares the slices; the reader needs a mutable buffer
  std::string why;
  parse_log = &why;
  grpc::ProtoBufferReader reader(&bytes);
  const bool ok = message->ParseFromZeroCopyStream(&reader);
  parse_log = nullptr;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: the request (%d bytes) does not parse as %s%s%s", what, in.Length(),
                      message->GetDescriptor()->full_name(), why.empty() ? "" : ": ", why));
}

absl::Status Serialize(const google::protobuf::Message& message, Raw* out) {
  bool own = false;
  const grpc::Status st =
      grpc::SerializationTraits<google::protobuf::Message>::Serialize(message, out, &own);
  if (!st.ok()) {
    return absl::InternalError(absl::StrCat("serializing the reply: ", st.error_message()));
  }
  return absl::OkStatus();
}

// ---- proto ⇄ domain -----------------------------------------------------------------------

v1::SessionInfo SessionToProto(const SessionRecord& r) {
  v1::SessionInfo p;
  p.set_session_id(r.id);
  p.set_tenant(r.spec.tenant);
  *p.mutable_geometry() = GeometryToProto(r.spec.geometry);
  v1::RetrievalOptions* ro = p.mutable_retrieval();
  ro->set_mode(ModeToProto(r.spec.sequence.mode));
  ro->set_budget_tokens(static_cast<uint32_t>(r.spec.budget_tokens));
  ro->set_max_tokens(static_cast<uint32_t>(r.spec.sequence.max_tokens));
  ro->set_correction_threshold(r.spec.sequence.correction_threshold);
  ro->set_correction_trigger(
      std::string(CorrectionTriggerName(r.spec.sequence.correction_trigger)));
  ro->set_correction_max_loss(r.spec.sequence.correction_max_loss);
  ro->set_summary(std::string(SummaryModeName(r.spec.sequence.summary)));
  ro->set_sink_pages(static_cast<uint32_t>(r.spec.sequence.sink_pages));
  ro->set_recent_pages(static_cast<uint32_t>(r.spec.sequence.recent_pages));
  p.set_transport(r.spec.transport == Transport::kGrpc ? v1::TRANSPORT_GRPC : v1::TRANSPORT_SHM);
  p.set_state(r.closing     ? v1::SESSION_STATE_CLOSING
              : r.cold      ? v1::SESSION_STATE_COLD
              : r.suspended ? v1::SESSION_STATE_SUSPENDED
                            : v1::SESSION_STATE_OPEN);
  p.set_label(r.spec.label);
  p.set_region_offset(r.region_offset);
  p.set_region_bytes(r.region_bytes);
  p.set_epoch(r.epoch);
  p.mutable_committed_tokens()->Add(r.committed_tokens.begin(), r.committed_tokens.end());
  p.mutable_steps_run()->Add(r.steps_run.begin(), r.steps_run.end());
  p.set_created_unix_ms(r.created_unix_ms);
  return p;
}

void StatsToProto(const SessionStatsRecord& s, v1::SessionStats* p) {
  p->set_session_id(s.session_id);
  CountersToProto(s.sequence, p);
  p->set_correction_rate(s.sequence.correction_rate());
  p->set_committed_pages(s.committed_pages);
}

std::string Metadata(const grpc::CallbackServerContext* ctx, const char* key) {
  const auto& md = ctx->client_metadata();
  auto it = md.find(key);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

absl::Time DeadlineOf(const grpc::CallbackServerContext* ctx) {
  const std::chrono::system_clock::time_point d = ctx->deadline();
  if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

}  // namespace

void RouteProtobufLogs() { google::protobuf::SetLogHandler(&ProtobufLogHandler); }

// A unary call in progress: owned by whoever runs it.
template <typename Request, typename Reply>
struct KvTierService::UnaryCall {
  grpc::CallbackServerContext* ctx = nullptr;
  grpc::ServerUnaryReactor* reactor = nullptr;
  Raw* out = nullptr;
  Request request;
  Reply reply;
  Caller caller;
  CallSlot slot;
};

KvTierService::KvTierService(SessionManager& manager, WorkQueue& work, const DaemonConfig& config)
    : manager_(manager), work_(work), config_(config) {
  shm_.available = config.shm && !config.attach_socket.empty();
  shm_.path = config.attach_socket;
}

void KvTierService::Begin() {
  rpcs_.fetch_add(1, std::memory_order_relaxed);
  inflight_.fetch_add(1, std::memory_order_acq_rel);
}

grpc::Status KvTierService::End(const absl::Status& status) {
  if (!status.ok()) errors_.fetch_add(1, std::memory_order_relaxed);
  if (inflight_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    MutexLock lock(&idle_mu_);
    idle_.SignalAll();
  }
  return ToGrpcStatus(status);
}

bool KvTierService::AwaitIdle(absl::Time deadline) {
  MutexLock lock(&idle_mu_);
  return idle_.AwaitWithTimeout(
      &idle_mu_, [this] { return inflight_.load(std::memory_order_acquire) == 0; },
      deadline - absl::Now());
}

void KvTierService::AddTrailers(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  ForEachTrailer(status, [ctx](std::string_view key, std::string_view value) {
    ctx->AddTrailingMetadata(std::string(key), std::string(value));
    // gRPC's own client retry honours this one.
    if (key == kRetryAfterTrailer) {
      ctx->AddTrailingMetadata("grpc-retry-pushback-ms", std::string(value));
    }
  });
}

absl::StatusOr<Caller> KvTierService::CallerOf(grpc::CallbackServerContext* ctx,
                                               bool tenant) const {
  Caller caller;
  const std::string token = Metadata(ctx, kTokenMetadata);
  if (tenant) {
    KVTIER_ASSIGN_OR_RETURN(caller, manager_.Authenticate(Metadata(ctx, kTenantMetadata), token));
  }
  caller.token = token;
  caller.deadline = DeadlineOf(ctx) - config_.deadline_margin;
  caller.cancelled = [ctx] { return ctx->IsCancelled(); };
  return caller;
}

template <typename Request, typename Reply>
grpc::ServerUnaryReactor* KvTierService::Serve(
    grpc::CallbackServerContext* ctx, const Raw* in, Raw* out, Where where, bool tenant,
    absl::Status (KvTierService::*handler)(const Caller&, const Request&, Reply*)) {
  using Call = UnaryCall<Request, Reply>;
  Begin();
  auto call = std::make_unique<Call>();
  call->ctx = ctx;
  call->reactor = ctx->DefaultReactor();
  call->out = out;
  const std::string& method = Request::descriptor()->name();  // "StepRequest"
  const std::string_view name(method.data(), method.size() - std::string_view("Request").size());
  absl::Status st = Parse(*in, &call->request, name);
  if (st.ok()) {
    absl::StatusOr<Caller> caller = CallerOf(ctx, tenant);
    st = caller.status();
    if (st.ok()) call->caller = *std::move(caller);
  }
  if (st.ok() && tenant) {
    absl::StatusOr<CallSlot> slot = manager_.Admit(call->caller);
    st = slot.status();
    if (st.ok()) call->slot = *std::move(slot);
  }
  // A call that arrives with its deadline spent does nothing.
  if (st.ok()) st = call->caller.CheckLive(name);
  // Finishes the call: the reply, the trailers, then the slot goes back before the client
  // can see the answer (and call again).
  auto finish = [this](std::unique_ptr<Call> c, absl::Status status) {
    if (status.ok()) status = Serialize(c->reply, c->out);
    AddTrailers(c->ctx, status);
    grpc::ServerUnaryReactor* reactor = c->reactor;
    c.reset();
    reactor->Finish(End(status));
  };
  grpc::ServerUnaryReactor* reactor = call->reactor;
  if (!st.ok() || where == Where::kInline) {
    if (st.ok()) st = (this->*handler)(call->caller, call->request, &call->reply);
    finish(std::move(call), st);
    return reactor;
  }
  Call* queued = call.release();
  absl::Status submitted =
      work_.Submit(queued->caller.tenant, [queued, name, handler, finish, this](absl::Status ok) {
        std::unique_ptr<Call> c(queued);
        if (ok.ok()) ok = c->caller.CheckLive(name);  // it may have waited in the queue
        if (ok.ok()) ok = (this->*handler)(c->caller, c->request, &c->reply);
        finish(std::move(c), ok);
      });
  if (!submitted.ok()) finish(std::unique_ptr<Call>(queued), submitted);
  return reactor;
}

// ---- unary calls --------------------------------------------------------------------------

grpc::ServerUnaryReactor* KvTierService::Hello(grpc::CallbackServerContext* ctx, const Raw* in,
                                               Raw* out) {
  return Serve(ctx, in, out, Where::kInline, true, &KvTierService::DoHello);
}
grpc::ServerUnaryReactor* KvTierService::OpenSession(grpc::CallbackServerContext* ctx,
                                                     const Raw* in, Raw* out) {
  return Serve(ctx, in, out, Where::kWorkQueue, true, &KvTierService::DoOpenSession);
}
grpc::ServerUnaryReactor* KvTierService::CloseSession(grpc::CallbackServerContext* ctx,
                                                      const Raw* in, Raw* out) {
  return Serve(ctx, in, out, Where::kInline, true, &KvTierService::DoCloseSession);
}
grpc::ServerUnaryReactor* KvTierService::ListSessions(grpc::CallbackServerContext* ctx,
                                                      const Raw* in, Raw* out) {
  return Serve(ctx, in, out, Where::kInline, true, &KvTierService::DoListSessions);
}
grpc::ServerUnaryReactor* KvTierService::Reattach(grpc::CallbackServerContext* ctx, const Raw* in,
                                                  Raw* out) {
  return Serve(ctx, in, out, Where::kInline, true, &KvTierService::DoReattach);
}
grpc::ServerUnaryReactor* KvTierService::SuspendSession(grpc::CallbackServerContext* ctx,
                                                        const Raw* in, Raw* out) {
  return Serve(ctx, in, out, Where::kInline, true, &KvTierService::DoSuspendSession);
}
// They wait for the cold tier: on the work queue, like Step.
grpc::ServerUnaryReactor* KvTierService::DemotePages(grpc::CallbackServerContext* ctx,
                                                     const Raw* in, Raw* out) {
  return Serve(ctx, in, out, Where::kWorkQueue, true, &KvTierService::DoDemotePages);
}
grpc::ServerUnaryReactor* KvTierService::PromotePages(grpc::CallbackServerContext* ctx,
                                                      const Raw* in, Raw* out) {
  return Serve(ctx, in, out, Where::kWorkQueue, true, &KvTierService::DoPromotePages);
}
grpc::ServerUnaryReactor* KvTierService::Step(grpc::CallbackServerContext* ctx, const Raw* in,
                                              Raw* out) {
  return Serve(ctx, in, out, Where::kWorkQueue, true, &KvTierService::DoStep);
}
grpc::ServerUnaryReactor* KvTierService::ReportSignals(grpc::CallbackServerContext* ctx,
                                                       const Raw* in, Raw* out) {
  return Serve(ctx, in, out, Where::kWorkQueue, true, &KvTierService::DoReportSignals);
}
grpc::ServerUnaryReactor* KvTierService::GetStats(grpc::CallbackServerContext* ctx, const Raw* in,
                                                  Raw* out) {
  return Serve(ctx, in, out, Where::kInline, true, &KvTierService::DoGetStats);
}
// Waits for the calls in flight on this callback thread, at most timeout_ms. The admin token
// stands on its own: no tenant is needed.
grpc::ServerUnaryReactor* KvTierService::Drain(grpc::CallbackServerContext* ctx, const Raw* in,
                                               Raw* out) {
  return Serve(ctx, in, out, Where::kInline, false, &KvTierService::DoDrain);
}

absl::Status KvTierService::DoHello(const Caller& caller, const v1::HelloRequest& request,
                                    v1::HelloReply* reply) {
  const uint32_t v = request.protocol_version();
  if (v < kMinProtocolVersion || v > kServerProtocolVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("protocol_version = %d: this daemon speaks protocol versions %d to %d", v,
                        kMinProtocolVersion, kServerProtocolVersion));
  }
  reply->set_protocol_version(kServerProtocolVersion);
  reply->set_min_protocol_version(kMinProtocolVersion);
  reply->set_server_version(KVTIER_VERSION_STRING);
  for (int32_t p : kSupportedPageSizes) reply->add_page_sizes(static_cast<uint32_t>(p));
  for (v1::DType t : {v1::DTYPE_FP16, v1::DTYPE_BF16, v1::DTYPE_FP32}) reply->add_dtypes(t);
  reply->add_layouts("host:HND");
  reply->add_layouts("device:NHD");
  reply->add_backends("cpu");
  for (v1::Mode m : {v1::MODE_SPECULATIVE, v1::MODE_SYNC, v1::MODE_FULL, v1::MODE_DROP}) {
    reply->add_modes(m);
  }
  v1::Limits* limits = reply->mutable_limits();
  limits->set_max_message_bytes(config_.max_message_bytes);
  limits->set_max_sessions_per_tenant(config_.max_sessions_per_tenant);
  limits->set_max_tokens_per_session(config_.max_tokens_per_session);
  limits->set_max_layers(config_.max_layers);
  limits->set_max_tokens_per_offload(config_.max_tokens_per_offload);
  limits->set_max_inflight_calls_per_tenant(config_.max_inflight_calls_per_tenant);
  limits->set_deadline_margin_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(config_.deadline_margin)));
  reply->set_tenant(caller.tenant);
  reply->set_shm_available(shm_.available);
  reply->set_attach_socket(shm_.path);
  reply->set_metrics_address(metrics_address_);
  reply->set_tenant_quota_bytes(manager_.tenant(caller.tenant).quota_bytes());
  spdlog::debug("Hello from '{}' (protocol {}), tenant '{}'", request.client_name(), v,
                caller.tenant);
  return absl::OkStatus();
}

absl::Status KvTierService::DoOpenSession(const Caller& caller,
                                          const v1::OpenSessionRequest& request,
                                          v1::OpenSessionReply* reply) {
  KVTIER_ASSIGN_OR_RETURN(OpenSessionParams params, ParamsFromProto(request));
  KVTIER_ASSIGN_OR_RETURN(SessionRecord r, manager_.OpenSession(caller, params));
  *reply->mutable_session() = SessionToProto(r);
  return absl::OkStatus();
}

absl::Status KvTierService::DoCloseSession(const Caller& caller,
                                           const v1::CloseSessionRequest& request,
                                           v1::CloseSessionReply* reply) {
  KVTIER_ASSIGN_OR_RETURN(CloseResult r, manager_.CloseSession(caller, request.session_id()));
  reply->set_freed_bytes(r.freed_bytes);
  reply->set_committed_pages(r.committed_pages);
  return absl::OkStatus();
}

absl::Status KvTierService::DoListSessions(const Caller& caller,
                                           const v1::ListSessionsRequest& /*request*/,
                                           v1::ListSessionsReply* reply) {
  for (const SessionRecord& r : manager_.ListSessions(caller)) {
    *reply->add_sessions() = SessionToProto(r);
  }
  return absl::OkStatus();
}

absl::Status KvTierService::DoReattach(const Caller& caller, const v1::ReattachRequest& request,
                                       v1::ReattachReply* reply) {
  KVTIER_ASSIGN_OR_RETURN(SessionRecord r, manager_.Reattach(caller, request.session_id()));
  *reply->mutable_session() = SessionToProto(r);
  return absl::OkStatus();
}

absl::Status KvTierService::DoSuspendSession(const Caller& caller,
                                             const v1::SuspendSessionRequest& request,
                                             v1::SuspendSessionReply* reply) {
  KVTIER_ASSIGN_OR_RETURN(SessionRecord r, manager_.SuspendSession(caller, request.session_id()));
  *reply->mutable_session() = SessionToProto(r);
  return absl::OkStatus();
}

namespace {

std::vector<TenantSession::PageMove> PageMoves(
    const google::protobuf::RepeatedPtrField<v1::PageSlot>& pages) {
  std::vector<TenantSession::PageMove> out;
  out.reserve(static_cast<size_t>(pages.size()));
  for (const v1::PageSlot& p : pages) {
    // Ranges are checked against the session; a slot past int64 becomes negative and fails.
    out.push_back({static_cast<int32_t>(std::min<uint32_t>(p.layer(), INT32_MAX)),
                   static_cast<int64_t>(p.page()), static_cast<int64_t>(p.slot()),
                   p.generation()});
  }
  return out;
}

// DemotePages and PromotePages: the same request shape, the direction apart (the manager
// checks the page count).
template <typename Request>
absl::Status MovePagesOf(SessionManager& manager, const Caller& caller, const Request& request,
                         bool demote) {
  return manager.MovePages(caller, request.session_id(), demote, request.epoch(),
                           PageMoves(request.pages()));
}

}  // namespace

absl::Status KvTierService::DoDemotePages(const Caller& caller,
                                          const v1::DemotePagesRequest& request,
                                          v1::DemotePagesReply* /*reply*/) {
  return MovePagesOf(manager_, caller, request, /*demote=*/true);
}

absl::Status KvTierService::DoPromotePages(const Caller& caller,
                                           const v1::PromotePagesRequest& request,
                                           v1::PromotePagesReply* /*reply*/) {
  return MovePagesOf(manager_, caller, request, /*demote=*/false);
}

absl::Status KvTierService::DoReportSignals(const Caller& caller,
                                            const v1::ReportSignalsRequest& request,
                                            v1::ReportSignalsReply* reply) {
  EngineSignals e;
  e.first_position = static_cast<int64_t>(
      std::min<uint64_t>(request.first_position(), std::numeric_limits<int64_t>::max()));
  e.num_tokens = static_cast<int32_t>(
      std::min<uint64_t>(request.num_tokens(), std::numeric_limits<int32_t>::max()));
  e.logits.assign(request.logits().begin(), request.logits().end());
  if (request.has_logit_summary()) {
    const v1::LogitSummary& ls = request.logit_summary();
    e.logit_summary = LogitSummary{ls.normalized_entropy(), ls.margin(), ls.top_mass()};
  }
  e.hidden_delta.assign(request.hidden_delta().begin(), request.hidden_delta().end());
  e.num_layers = static_cast<int32_t>(
      std::min<uint64_t>(request.num_layers(), std::numeric_limits<int32_t>::max()));
  e.observe_layer = static_cast<int32_t>(
      std::min<uint64_t>(request.observe_layer(), std::numeric_limits<int32_t>::max()));
  e.observe_q = request.observe_q();
  e.observe_first_position = static_cast<int64_t>(
      std::min<uint64_t>(request.observe_first_position(), std::numeric_limits<int64_t>::max()));
  KVTIER_ASSIGN_OR_RETURN(const bool replayed,
                          manager_.ReportSignals(caller, request.session_id(), e));
  reply->set_replayed(replayed);
  return absl::OkStatus();
}

absl::Status KvTierService::DoStep(const Caller& caller, const v1::StepRequest& request,
                                   v1::StepReply* reply) {
  KVTIER_ASSIGN_OR_RETURN(StepResult r,
                          manager_.Step(caller, request.session_id(), request.layer(), request.q(),
                                        request.want_output(), request.step()));
  reply->set_layer(static_cast<uint32_t>(r.layer));
  reply->set_num_tokens(static_cast<uint32_t>(r.num_tokens));
  reply->set_num_slots(static_cast<uint32_t>(r.num_slots));
  reply->mutable_slot_table()->Add(r.slot_table.begin(), r.slot_table.end());
  reply->set_output(std::move(r.output));
  reply->mutable_lse()->Add(r.lse.begin(), r.lse.end());
  reply->set_corrected_heads(static_cast<uint32_t>(r.corrected_heads));
  reply->set_step(r.step);
  reply->set_replayed(r.replayed);
  return absl::OkStatus();
}

absl::Status KvTierService::DoGetStats(const Caller& caller, const v1::GetStatsRequest& request,
                                       v1::GetStatsReply* reply) {
  KVTIER_ASSIGN_OR_RETURN(StatsReport r, manager_.GetStats(caller, request.session_id()));
  v1::TenantStats* t = reply->add_tenants();
  t->set_tenant(r.tenant.tenant);
  t->set_quota_bytes(r.tenant.quota_bytes);
  t->set_used_bytes(r.tenant.used_bytes);
  t->set_sessions(r.tenant.sessions);
  t->set_cold_sessions(r.tenant.cold_sessions);
  t->set_refused_requests(r.tenant.refused_requests);
  if (r.session.has_value()) StatsToProto(*r.session, reply->mutable_session());
  reply->set_uptime_s(
      static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - manager_.start_time())));
  reply->set_rpcs(rpcs());
  reply->set_rpc_errors(rpc_errors());
  return absl::OkStatus();
}

absl::Status KvTierService::DoDrain(const Caller& caller, const v1::DrainRequest& request,
                                    v1::DrainReply* reply) {
  KVTIER_ASSIGN_OR_RETURN(DrainResult r,
                          manager_.Drain(caller.token, absl::Milliseconds(request.timeout_ms())));
  reply->set_drained(r.drained);
  reply->set_open_sessions(r.open_sessions);
  reply->set_inflight_calls(r.inflight_calls);
  return absl::OkStatus();
}

// ---- Offload --------------------------------------------------------------------------------

// Feeds each message to an OffloadStream; its commits, and the final one at the clean end,
// run on the WorkQueue, and the next message is read only after a commit has finished, so
// the stream's messages apply in order.
class KvTierService::OffloadReactor final : public grpc::ServerReadReactor<Raw> {
 public:
  OffloadReactor(KvTierService* service, grpc::CallbackServerContext* ctx, Raw* reply)
      : service_(service), ctx_(ctx), reply_(reply) {
    service_->Begin();
    absl::Status st = [&]() -> absl::Status {
      KVTIER_ASSIGN_OR_RETURN(Caller caller, service_->CallerOf(ctx_, true));
      KVTIER_ASSIGN_OR_RETURN(slot_, service_->manager_.Admit(caller));
      KVTIER_RETURN_IF_ERROR(caller.CheckLive("Offload"));
      tenant_ = caller.tenant;
      stream_ = service_->manager_.NewOffloadStream(caller);
      return absl::OkStatus();
    }();
    if (!st.ok()) {
      Done(st);
      return;
    }
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // No more messages: a clean end (the client half-closed) or a broken stream. gRPC
      // marks the call cancelled before this callback when the read failed for a cancel, a
      // deadline or a client that went away.
      if (ctx_->IsCancelled()) {
        return Done(stream_->Break(
            absl::CancelledError("the call was cancelled, its deadline passed or the client "
                                 "went away"),
            /*at_next_message=*/false));
      }
      return Submit([this] {
        absl::StatusOr<OffloadResult> r = stream_->Finish();
        if (r.ok()) {
          v1::OffloadReply reply;
          reply.set_committed_tokens(r->committed_tokens);
          reply.mutable_layer_tokens()->Add(r->layer_tokens.begin(), r->layer_tokens.end());
          return Done(Serialize(reply, reply_));
        }
        Done(r.status());
      });
    }
    v1::OffloadRequest request;
    if (absl::Status st = Parse(in_, &request, "Offload"); !st.ok()) {
      return Done(stream_->Break(st, /*at_next_message=*/true));
    }
    in_.Clear();
    OffloadChunk c;
    c.session_id = std::move(*request.mutable_session_id());
    c.layer = request.layer();
    c.num_tokens = request.num_tokens();
    c.k = std::move(*request.mutable_k());
    c.v = std::move(*request.mutable_v());
    c.commit = request.commit();
    if (request.has_start_token()) c.start_token = request.start_token();
    if (absl::Status st = stream_->Add(std::move(c)); !st.ok()) return Done(st);
    if (!stream_->commit_due()) return StartRead(&in_);
    Submit([this] {
      if (absl::Status st = stream_->Commit(); !st.ok()) return Done(st);
      StartRead(&in_);
    });
  }

  void OnDone() override { delete this; }

 private:
  // Runs `work` on the WorkQueue; the stream breaks with the queue's refusal, or with the
  // UNAVAILABLE of a queue that shut down before it ran.
  void Submit(absl::AnyInvocable<void() &&> work) {
    absl::Status submitted =
        service_->work_.Submit(tenant_, [this, work = std::move(work)](absl::Status ok) mutable {
          if (!ok.ok()) return Done(stream_->Break(ok, /*at_next_message=*/false));
          std::move(work)();
        });
    if (!submitted.ok()) Done(stream_->Break(submitted, /*at_next_message=*/false));
  }

  // Drops what is staged (unless Finish applied it), gives the slot back, finishes the call.
  void Done(const absl::Status& status) {
    stream_.reset();
    slot_ = CallSlot();
    KvTierService::AddTrailers(ctx_, status);
    Finish(service_->End(status));
  }

  KvTierService* const service_;
  grpc::CallbackServerContext* const ctx_;
  Raw* const reply_;
  Raw in_;
  std::string tenant_;
  CallSlot slot_;
  std::unique_ptr<OffloadStream> stream_;
};

grpc::ServerReadReactor<Raw>* KvTierService::Offload(grpc::CallbackServerContext* ctx, Raw* reply) {
  return new OffloadReactor(this, ctx, reply);
}

// ---- Fetch ----------------------------------------------------------------------------------

// Writes one FetchReply at a time, each with as many pages as fit max_message_bytes.
class KvTierService::FetchReactor final : public grpc::ServerWriteReactor<Raw> {
 public:
  FetchReactor(KvTierService* service, grpc::CallbackServerContext* ctx, const Raw* request)
      : service_(service) {
    service_->Begin();
    if (absl::Status st = Start(ctx, *request); !st.ok()) {
      Done(ctx, st);
    } else {
      ctx_ = ctx;
      WriteNext();
    }
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Done(ctx_, absl::CancelledError("Fetch: the client went away"));
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Start(grpc::CallbackServerContext* ctx, const Raw& in) {
    v1::FetchRequest request;
    KVTIER_RETURN_IF_ERROR(Parse(in, &request, "Fetch"));
    KVTIER_ASSIGN_OR_RETURN(caller_, service_->CallerOf(ctx, true));
    KVTIER_ASSIGN_OR_RETURN(slot_, service_->manager_.Admit(caller_));
    KVTIER_RETURN_IF_ERROR(caller_.CheckLive("Fetch"));
    std::vector<int64_t> pages(request.pages().begin(), request.pages().end());
    KVTIER_ASSIGN_OR_RETURN(
        cursor_, service_->manager_.StartFetch(caller_, request.session_id(), request.layer(),
                                               std::move(pages)));
    return absl::OkStatus();
  }

  void WriteNext() {
    if (cursor_->done()) return Done(ctx_, absl::OkStatus());
    if (absl::Status live = caller_.CheckLive("Fetch"); !live.ok()) return Done(ctx_, live);
    absl::StatusOr<std::vector<PageData>> pages =
        cursor_->Next(service_->config_.max_message_bytes);
    if (!pages.ok()) return Done(ctx_, pages.status());
    v1::FetchReply reply;
    for (PageData& p : *pages) {
      v1::Page* out = reply.add_pages();
      out->set_layer(static_cast<uint32_t>(p.layer));
      out->set_page(static_cast<uint32_t>(p.page));
      out->set_generation(p.generation);
      out->set_data(std::move(p.data));
    }
    out_.Clear();
    if (absl::Status st = Serialize(reply, &out_); !st.ok()) return Done(ctx_, st);
    StartWrite(&out_);
  }

  void Done(grpc::CallbackServerContext* ctx, const absl::Status& status) {
    cursor_.reset();
    caller_ = Caller();
    slot_ = CallSlot();
    KvTierService::AddTrailers(ctx, status);
    Finish(service_->End(status));
  }

  KvTierService* const service_;
  grpc::CallbackServerContext* ctx_ = nullptr;
  Caller caller_;
  CallSlot slot_;
  std::unique_ptr<FetchCursor> cursor_;
  Raw out_;
};

grpc::ServerWriteReactor<Raw>* KvTierService::Fetch(grpc::CallbackServerContext* ctx,
                                                    const Raw* request) {
  return new FetchReactor(this, ctx, request);
}

}  // namespace kvtier::daemon
