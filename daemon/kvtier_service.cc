#include "daemon/kvtier_service.h"

#include <cmath>
#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kvtier/status.h"
#include "spdlog/spdlog.h"

#ifndef KVTIER_VERSION_STRING
#define KVTIER_VERSION_STRING "unknown"
#endif

namespace kvtier::daemon {
namespace {

// ---- proto ⇄ domain -----------------------------------------------------------------------

absl::StatusOr<OpenSessionParams> ParamsFromProto(const v1::OpenSessionRequest& r) {
  OpenSessionParams p;
  p.tenant = r.tenant();
  KVTIER_ASSIGN_OR_RETURN(p.geometry, GeometryFromProto(r.geometry()));
  KVTIER_ASSIGN_OR_RETURN(p.mode, ModeFromProto(r.retrieval().mode()));
  p.budget_tokens = r.retrieval().budget_tokens();
  p.max_tokens = r.retrieval().max_tokens();
  if (r.retrieval().has_correction_threshold()) {
    p.correction_threshold = r.retrieval().correction_threshold();
  }
  p.budget_policy = r.policy().budget_policy();
  p.residency_policy = r.policy().residency_policy();
  p.host_drop = r.policy().host_drop();
  p.policy_params.insert(r.policy().params().begin(), r.policy().params().end());
  KVTIER_ASSIGN_OR_RETURN(p.transport, TransportFromProto(r.transport()));
  p.label = r.label();
  return p;
}

v1::SessionInfo SessionToProto(const SessionRecord& r) {
  v1::SessionInfo p;
  p.set_session_id(r.id);
  p.set_tenant(r.spec.tenant);
  *p.mutable_geometry() = GeometryToProto(r.spec.geometry);
  v1::RetrievalOptions* ro = p.mutable_retrieval();
  ro->set_mode(ModeToProto(r.spec.retriever.mode));
  ro->set_budget_tokens(static_cast<uint32_t>(r.spec.budget_tokens));
  ro->set_max_tokens(static_cast<uint32_t>(r.spec.retriever.max_tokens));
  ro->set_correction_threshold(r.spec.retriever.correction_threshold);
  p.set_transport(r.spec.transport == Transport::kGrpc ? v1::TRANSPORT_GRPC : v1::TRANSPORT_SHM);
  p.set_state(r.closing ? v1::SESSION_STATE_CLOSING : v1::SESSION_STATE_OPEN);
  p.set_label(r.spec.label);
  p.set_region_offset(r.region_offset);
  p.set_region_bytes(r.region_bytes);
  p.set_epoch(r.epoch);
  p.mutable_committed_tokens()->Add(r.committed_tokens.begin(), r.committed_tokens.end());
  p.set_created_unix_ms(r.created_unix_ms);
  return p;
}

void StatsToProto(const SessionStatsRecord& s, v1::SessionStats* p) {
  p->set_session_id(s.session_id);
  p->set_steps(s.retriever.steps);
  p->set_appended_tokens(s.retriever.appended_tokens);
  p->set_offloaded_pages(s.retriever.offloaded_pages);
  p->set_recalled_pages(s.retriever.recalled_pages);
  p->set_recalled_bytes(s.retriever.recalled_bytes);
  p->set_correction_pages(s.retriever.correction_pages);
  p->set_checked_heads(s.retriever.checked_heads);
  p->set_corrected_heads(s.retriever.corrected_heads);
  p->set_correction_rate(s.retriever.correction_rate());
  p->set_committed_pages(s.committed_pages);
}

std::string Metadata(const grpc::CallbackServerContext* ctx, const char* key) {
  const auto& md = ctx->client_metadata();
  auto it = md.find(key);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

}  // namespace

KvTierService::KvTierService(SessionManager& manager, const DaemonConfig& config)
    : manager_(manager), config_(config) {
  shm_.available = config.shm && !config.attach_socket.empty();
  shm_.path = config.attach_socket;
}

void KvTierService::Begin() {
  rpcs_.fetch_add(1, std::memory_order_relaxed);
  inflight_.fetch_add(1, std::memory_order_acq_rel);
}

grpc::Status KvTierService::End(const absl::Status& status) {
  if (!status.ok()) errors_.fetch_add(1, std::memory_order_relaxed);
  inflight_.fetch_sub(1, std::memory_order_acq_rel);
  return ToGrpcStatus(status);
}

grpc::ServerUnaryReactor* KvTierService::Reply(grpc::CallbackServerContext* ctx,
                                               const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(End(status));
  return reactor;
}

absl::StatusOr<Caller> KvTierService::Authenticate(const grpc::CallbackServerContext* ctx) const {
  return manager_.Authenticate(Metadata(ctx, kTenantMetadata), Metadata(ctx, kTokenMetadata));
}

// ---- unary calls: each runs its manager method inline on the callback thread --------------

grpc::ServerUnaryReactor* KvTierService::Hello(grpc::CallbackServerContext* ctx,
                                               const v1::HelloRequest* request,
                                               v1::HelloReply* reply) {
  Begin();
  absl::Status st = [&]() -> absl::Status {
    const uint32_t v = request->protocol_version();
    if (v < kMinProtocolVersion || v > kServerProtocolVersion) {
      return absl::FailedPreconditionError(
          absl::StrFormat("protocol_version = %d: this daemon speaks protocol versions %d to %d", v,
                          kMinProtocolVersion, kServerProtocolVersion));
    }
    KVTIER_ASSIGN_OR_RETURN(Caller caller, Authenticate(ctx));
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
    reply->set_tenant(caller.tenant);
    reply->set_shm_available(shm_.available);
    reply->set_attach_socket(shm_.path);
    reply->set_tenant_quota_bytes(manager_.tenant(caller.tenant).quota_bytes());
    spdlog::debug("Hello from '{}' (protocol {}), tenant '{}'", request->client_name(), v,
                  caller.tenant);
    return absl::OkStatus();
  }();
  return Reply(ctx, st);
}

grpc::ServerUnaryReactor* KvTierService::OpenSession(grpc::CallbackServerContext* ctx,
                                                     const v1::OpenSessionRequest* request,
                                                     v1::OpenSessionReply* reply) {
  Begin();
  absl::Status st = [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Caller caller, Authenticate(ctx));
    KVTIER_ASSIGN_OR_RETURN(OpenSessionParams params, ParamsFromProto(*request));
    KVTIER_ASSIGN_OR_RETURN(SessionRecord r, manager_.OpenSession(caller, params));
    *reply->mutable_session() = SessionToProto(r);
    return absl::OkStatus();
  }();
  return Reply(ctx, st);
}

grpc::ServerUnaryReactor* KvTierService::CloseSession(grpc::CallbackServerContext* ctx,
                                                      const v1::CloseSessionRequest* request,
                                                      v1::CloseSessionReply* reply) {
  Begin();
  absl::Status st = [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Caller caller, Authenticate(ctx));
    KVTIER_ASSIGN_OR_RETURN(CloseResult r, manager_.CloseSession(caller, request->session_id()));
    reply->set_freed_bytes(r.freed_bytes);
    reply->set_committed_pages(r.committed_pages);
    return absl::OkStatus();
  }();
  return Reply(ctx, st);
}

grpc::ServerUnaryReactor* KvTierService::ListSessions(grpc::CallbackServerContext* ctx,
                                                      const v1::ListSessionsRequest* /*request*/,
                                                      v1::ListSessionsReply* reply) {
  Begin();
  absl::Status st = [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Caller caller, Authenticate(ctx));
    for (const SessionRecord& r : manager_.ListSessions(caller)) {
      *reply->add_sessions() = SessionToProto(r);
    }
    return absl::OkStatus();
  }();
  return Reply(ctx, st);
}

grpc::ServerUnaryReactor* KvTierService::Reattach(grpc::CallbackServerContext* ctx,
                                                  const v1::ReattachRequest* request,
                                                  v1::ReattachReply* reply) {
  Begin();
  absl::Status st = [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Caller caller, Authenticate(ctx));
    KVTIER_ASSIGN_OR_RETURN(SessionRecord r, manager_.Reattach(caller, request->session_id()));
    *reply->mutable_session() = SessionToProto(r);
    return absl::OkStatus();
  }();
  return Reply(ctx, st);
}

// Runs the step inline on gRPC's callback thread: a step is milliseconds of CPU work on the
// daemon's backend. A dedicated executor would keep slow steps from occupying callback
// threads; not needed while steps are short.
grpc::ServerUnaryReactor* KvTierService::Step(grpc::CallbackServerContext* ctx,
                                              const v1::StepRequest* request,
                                              v1::StepReply* reply) {
  Begin();
  absl::Status st = [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Caller caller, Authenticate(ctx));
    KVTIER_ASSIGN_OR_RETURN(
        StepResult r, manager_.Step(caller, request->session_id(), request->layer(), request->q(),
                                    request->want_output()));
    reply->set_layer(static_cast<uint32_t>(r.layer));
    reply->set_num_tokens(static_cast<uint32_t>(r.num_tokens));
    reply->set_num_slots(static_cast<uint32_t>(r.num_slots));
    reply->mutable_slot_table()->Add(r.slot_table.begin(), r.slot_table.end());
    reply->set_output(std::move(r.output));
    reply->mutable_lse()->Add(r.lse.begin(), r.lse.end());
    reply->set_corrected_heads(static_cast<uint32_t>(r.corrected_heads));
    return absl::OkStatus();
  }();
  return Reply(ctx, st);
}

grpc::ServerUnaryReactor* KvTierService::GetStats(grpc::CallbackServerContext* ctx,
                                                  const v1::GetStatsRequest* request,
                                                  v1::GetStatsReply* reply) {
  Begin();
  absl::Status st = [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Caller caller, Authenticate(ctx));
    KVTIER_ASSIGN_OR_RETURN(StatsReport r, manager_.GetStats(caller, request->session_id()));
    v1::TenantStats* t = reply->add_tenants();
    t->set_tenant(r.tenant.tenant);
    t->set_quota_bytes(r.tenant.quota_bytes);
    t->set_used_bytes(r.tenant.used_bytes);
    t->set_sessions(r.tenant.sessions);
    t->set_refused_requests(r.tenant.refused_requests);
    if (r.session.has_value()) StatsToProto(*r.session, reply->mutable_session());
    reply->set_uptime_s(
        static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - manager_.start_time())));
    reply->set_rpcs(rpcs());
    reply->set_rpc_errors(rpc_errors());
    return absl::OkStatus();
  }();
  return Reply(ctx, st);
}

// Waits for the calls in flight on this callback thread, at most timeout_ms.
grpc::ServerUnaryReactor* KvTierService::Drain(grpc::CallbackServerContext* ctx,
                                               const v1::DrainRequest* request,
                                               v1::DrainReply* reply) {
  Begin();
  absl::Status st = [&]() -> absl::Status {
    // The admin token stands on its own: no tenant is needed.
    KVTIER_ASSIGN_OR_RETURN(
        DrainResult r,
        manager_.Drain(Metadata(ctx, kTokenMetadata), absl::Milliseconds(request->timeout_ms())));
    reply->set_drained(r.drained);
    reply->set_open_sessions(r.open_sessions);
    reply->set_inflight_calls(r.inflight_calls);
    return absl::OkStatus();
  }();
  return Reply(ctx, st);
}

// ---- Offload --------------------------------------------------------------------------------

// Feeds each message to an OffloadStream. Applying staged chunks (at a commit and at the
// clean end) runs inline on the callback thread, like Step.
class KvTierService::OffloadReactor final : public grpc::ServerReadReactor<v1::OffloadRequest> {
 public:
  OffloadReactor(KvTierService* service, grpc::CallbackServerContext* ctx, v1::OffloadReply* reply)
      : service_(service), ctx_(ctx), reply_(reply) {
    service_->Begin();
    absl::StatusOr<Caller> caller = service_->Authenticate(ctx_);
    if (!caller.ok()) {
      Finish(service_->End(caller.status()));
      return;
    }
    stream_ = service_->manager_.NewOffloadStream(*caller);
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // No more messages: a clean end (the client half-closed) or a broken stream. gRPC
      // marks the call cancelled before this callback when the read failed for a cancel.
      if (ctx_->IsCancelled()) {
        return Done(absl::CancelledError(
            "Offload: the stream was cancelled; its uncommitted chunks were discarded"));
      }
      absl::StatusOr<OffloadResult> r = stream_->Finish();
      if (r.ok()) {
        reply_->set_committed_tokens(r->committed_tokens);
        reply_->mutable_layer_tokens()->Add(r->layer_tokens.begin(), r->layer_tokens.end());
      }
      return Done(r.status());
    }
    OffloadChunk c;
    c.session_id = std::move(*request_.mutable_session_id());
    c.layer = request_.layer();
    c.num_tokens = request_.num_tokens();
    c.k = std::move(*request_.mutable_k());
    c.v = std::move(*request_.mutable_v());
    c.commit = request_.commit();
    request_.Clear();
    if (absl::Status st = stream_->Add(std::move(c)); !st.ok()) return Done(st);
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  // Drops what is staged (unless Finish applied it) and finishes the call.
  void Done(const absl::Status& status) {
    stream_.reset();
    Finish(service_->End(status));
  }

  KvTierService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::OffloadReply* const reply_;
  v1::OffloadRequest request_;
  std::unique_ptr<OffloadStream> stream_;
};

grpc::ServerReadReactor<v1::OffloadRequest>* KvTierService::Offload(
    grpc::CallbackServerContext* ctx, v1::OffloadReply* reply) {
  return new OffloadReactor(this, ctx, reply);
}

// ---- Fetch ----------------------------------------------------------------------------------

// Writes one FetchReply at a time, each with as many pages as fit max_message_bytes.
class KvTierService::FetchReactor final : public grpc::ServerWriteReactor<v1::FetchReply> {
 public:
  FetchReactor(KvTierService* service, grpc::CallbackServerContext* ctx,
               const v1::FetchRequest* request)
      : service_(service) {
    service_->Begin();
    if (absl::Status st = Start(ctx, *request); !st.ok()) {
      Done(st);
    } else {
      WriteNext();
    }
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Done(absl::CancelledError("Fetch: the client went away"));
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Start(grpc::CallbackServerContext* ctx, const v1::FetchRequest& request) {
    KVTIER_ASSIGN_OR_RETURN(Caller caller, service_->Authenticate(ctx));
    std::vector<int64_t> pages(request.pages().begin(), request.pages().end());
    KVTIER_ASSIGN_OR_RETURN(
        cursor_, service_->manager_.StartFetch(caller, request.session_id(), request.layer(),
                                               std::move(pages)));
    return absl::OkStatus();
  }

  void WriteNext() {
    if (cursor_->done()) return Done(absl::OkStatus());
    absl::StatusOr<std::vector<PageData>> pages =
        cursor_->Next(service_->config_.max_message_bytes);
    if (!pages.ok()) return Done(pages.status());
    reply_.Clear();
    for (PageData& p : *pages) {
      v1::Page* out = reply_.add_pages();
      out->set_layer(static_cast<uint32_t>(p.layer));
      out->set_page(static_cast<uint32_t>(p.page));
      out->set_generation(p.generation);
      out->set_data(std::move(p.data));
    }
    StartWrite(&reply_);
  }

  void Done(const absl::Status& status) {
    cursor_.reset();
    Finish(service_->End(status));
  }

  KvTierService* const service_;
  std::unique_ptr<FetchCursor> cursor_;
  v1::FetchReply reply_;
};

grpc::ServerWriteReactor<v1::FetchReply>* KvTierService::Fetch(grpc::CallbackServerContext* ctx,
                                                               const v1::FetchRequest* request) {
  return new FetchReactor(this, ctx, request);
}

}  // namespace kvtier::daemon
