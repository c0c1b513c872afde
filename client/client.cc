// Client: the control calls of kvtier/client.h over one Connection, and the session
// factories for both transports.
#include "kvtier/client.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/connection.h"
#include "client/convert.h"
#include "client/rpc_util.h"
#include "client/session_grpc.h"
#include "client/session_shm.h"
#include "core/status.h"
#include "kernels/registry.h"

namespace kvtier {

namespace {

class ClientImpl final : public Client {
 public:
  explicit ClientImpl(std::shared_ptr<Connection> conn) : conn_(std::move(conn)) {}

  const Capabilities& capabilities() const override { return conn_->capabilities(); }

  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const SessionOptions& options) override;
  absl::StatusOr<std::unique_ptr<Session>> Reattach(std::string_view id,
                                                    const SessionOptions& options) override;
  absl::StatusOr<std::vector<SessionInfo>> ListSessions() override;
  absl::Status CloseSession(std::string_view id) override { return CloseSessionById(*conn_, id); }
  absl::Status Drain(absl::Duration timeout) override;

 private:
  // The session object for the daemon's record `info`; `restore`: take over its pages.
  // The tenant arena mapped for `options.device` (null: the client's CPU device).
  absl::StatusOr<std::shared_ptr<ArenaMapping>> MapArena(const SessionOptions& options);
  absl::StatusOr<std::unique_ptr<Session>> MakeSession(const SessionInfo& info,
                                                       const SessionOptions& options,
                                                       std::shared_ptr<ArenaMapping> mapping,
                                                       bool restore);

  std::shared_ptr<Connection> conn_;
};

absl::StatusOr<std::unique_ptr<Session>> ClientImpl::MakeSession(
    const SessionInfo& info, const SessionOptions& options, std::shared_ptr<ArenaMapping> mapping,
    bool restore) {
  switch (info.transport) {
    case Transport::kShm:
      return NewShmSession(conn_, std::move(mapping), info, options, restore);
    case Transport::kGrpc:
      return NewGrpcSession(conn_, info, options);
  }
  return absl::InternalError("unknown transport");
}

absl::StatusOr<std::shared_ptr<ArenaMapping>> ClientImpl::MapArena(const SessionOptions& options) {
  Backend* backend = nullptr;
  if (options.device != nullptr) {
    KVTIER_ASSIGN_OR_RETURN(backend, BackendOf(*options.device, "SessionOptions.device"));
  }
  return conn_->ArenaFor(backend);
}

absl::StatusOr<std::unique_ptr<Session>> ClientImpl::OpenSession(const SessionOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(const v1::OpenSessionRequest req,
                          BuildOpenSessionRequest(conn_->options().tenant, options));
  // Map the arena first: a session the client cannot use must not be opened.
  std::shared_ptr<ArenaMapping> mapping;
  if (options.transport == Transport::kShm) {
    KVTIER_ASSIGN_OR_RETURN(mapping, MapArena(options));
  }
  v1::OpenSessionReply reply;
  auto ctx = conn_->Context();
  KVTIER_RETURN_IF_ERROR(FromGrpcStatus(conn_->stub().OpenSession(ctx.get(), req, &reply)));
  absl::StatusOr<SessionInfo> info = SessionInfoFromProto(reply.session());
  absl::StatusOr<std::unique_ptr<Session>> session =
      info.ok() ? MakeSession(*info, options, std::move(mapping), /*restore=*/false)
                : info.status();
  if (!session.ok()) {
    (void)CloseSessionById(*conn_, reply.session().session_id());  // best effort: no leak
    return session.status();
  }
  return session;
}

absl::StatusOr<std::unique_ptr<Session>> ClientImpl::Reattach(std::string_view id,
                                                              const SessionOptions& options) {
  v1::ReattachRequest req;
  req.set_session_id(std::string(id));
  v1::ReattachReply reply;
  auto ctx = conn_->Context();
  KVTIER_RETURN_IF_ERROR(FromGrpcStatus(conn_->stub().Reattach(ctx.get(), req, &reply)));
  KVTIER_ASSIGN_OR_RETURN(const SessionInfo info, SessionInfoFromProto(reply.session()));
  if (!(info.geometry == options.geometry)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("Reattach: session %s has geometry %s; SessionOptions.geometry is %s", id,
                        info.geometry.ToString(), options.geometry.ToString()));
  }
  // The transport is the session's, whatever options.transport says.
  std::shared_ptr<ArenaMapping> mapping;
  if (info.transport == Transport::kShm) {
    KVTIER_ASSIGN_OR_RETURN(mapping, MapArena(options));
  }
  return MakeSession(info, options, std::move(mapping), /*restore=*/true);
}

absl::StatusOr<std::vector<SessionInfo>> ClientImpl::ListSessions() {
  v1::ListSessionsReply reply;
  auto ctx = conn_->Context();
  KVTIER_RETURN_IF_ERROR(
      FromGrpcStatus(conn_->stub().ListSessions(ctx.get(), v1::ListSessionsRequest(), &reply)));
  std::vector<SessionInfo> out;
  out.reserve(static_cast<size_t>(reply.sessions_size()));
  for (const v1::SessionInfo& s : reply.sessions()) {
    KVTIER_ASSIGN_OR_RETURN(SessionInfo info, SessionInfoFromProto(s));
    out.push_back(std::move(info));
  }
  return out;
}

absl::Status ClientImpl::Drain(absl::Duration timeout) {
  if (timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("Drain: timeout must be >= 0");
  }
  const int64_t ms = std::min<int64_t>(absl::ToInt64Milliseconds(timeout), UINT32_MAX);
  v1::DrainRequest req;
  req.set_timeout_ms(static_cast<uint32_t>(ms));
  v1::DrainReply reply;
  // The call itself lasts up to `timeout`: give it that on top of the usual deadline.
  const ClientOptions& o = conn_->options();
  auto ctx = NewCallContext(o.tenant, o.admin_token.empty() ? o.token : o.admin_token,
                            o.rpc_timeout + timeout);
  KVTIER_RETURN_IF_ERROR(FromGrpcStatus(conn_->stub().Drain(ctx.get(), req, &reply)));
  if (!reply.drained()) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "Drain: %d calls still in flight after %s (%d sessions open)", reply.inflight_calls(),
        absl::FormatDuration(timeout), reply.open_sessions()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(std::string_view target,
                                                        const ClientOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<Connection> conn, Connection::Open(target, options));
  return std::unique_ptr<Client>(std::make_unique<ClientImpl>(std::move(conn)));
}

}  // namespace kvtier
