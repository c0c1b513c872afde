#include "client/connection.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/convert.h"
#include "client/rpc_util.h"
#include "core/status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "kernels/registry.h"
#include "offload/session_region.h"

namespace kvtier {
namespace {

// Used when the daemon reports no message limit (gRPC's own default).
constexpr uint64_t kFallbackMaxMessageBytes = uint64_t{4} << 20;

int ChannelLimit(uint64_t bytes) {
  if (bytes == 0 || bytes > static_cast<uint64_t>(std::numeric_limits<int>::max())) return -1;
  return static_cast<int>(bytes);
}

}  // namespace

Connection::Connection(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options,
                       std::string unix_path)
    : options_(options),
      unix_path_(std::move(unix_path)),
      channel_(std::move(channel)),
      stub_(v1::KvTier::NewStub(channel_)) {}

absl::StatusOr<std::shared_ptr<Connection>> Connection::Open(std::string_view target,
                                                             const ClientOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(const ParsedTarget parsed, ParseTarget(target));
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.rpc_timeout = ", absl::FormatDuration(options.rpc_timeout),
                     ": must be positive"));
  }
  if (options.tenant.empty()) {
    return absl::InvalidArgumentError("ClientOptions.tenant: must not be empty");
  }
  grpc::ChannelArguments args;
  // Sending is bounded by the chunking (max_message_bytes()); receiving trusts the daemon,
  // whose own limit is not known before Hello.
  args.SetMaxSendMessageSize(ChannelLimit(options.max_message_bytes));
  args.SetMaxReceiveMessageSize(-1);
  auto channel =
      grpc::CreateCustomChannel(parsed.grpc_target, grpc::InsecureChannelCredentials(), args);
  std::shared_ptr<Connection> conn(new Connection(std::move(channel), options, parsed.unix_path));
  if (absl::Status st = conn->Hello(); !st.ok()) {
    return absl::Status(st.code(), absl::StrFormat("connect to %s: %s", target, st.message()));
  }
  return conn;
}

absl::Status Connection::Hello() {
  v1::HelloRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_client_name(options_.client_name);
  v1::HelloReply reply;
  auto ctx = Context();
  absl::Status st = FromGrpcStatus(stub_->Hello(ctx.get(), req, &reply));
  if (absl::IsDeadlineExceeded(st)) {
    return absl::UnavailableError(absl::StrCat("no answer to Hello within rpc_timeout = ",
                                               absl::FormatDuration(options_.rpc_timeout)));
  }
  KVTIER_RETURN_IF_ERROR(st);
  if (reply.protocol_version() < kProtocolVersion ||
      reply.min_protocol_version() > kProtocolVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the daemon speaks protocol versions [%d, %d]; this client speaks %d",
                        reply.min_protocol_version(), reply.protocol_version(), kProtocolVersion));
  }
  caps_ = CapabilitiesFromHello(reply);
  uint64_t limit =
      caps_.max_message_bytes != 0 ? caps_.max_message_bytes : kFallbackMaxMessageBytes;
  if (options_.max_message_bytes != 0) limit = std::min(limit, options_.max_message_bytes);
  max_message_bytes_ = limit;
  return absl::OkStatus();
}

std::unique_ptr<grpc::ClientContext> Connection::Context() const {
  return Context(options_.rpc_timeout);
}

std::unique_ptr<grpc::ClientContext> Connection::Context(absl::Duration timeout) const {
  return NewCallContext(options_.tenant, options_.token, timeout);
}

absl::Status Connection::AttachLocked() {
  if (mappings_ != nullptr) return absl::OkStatus();
  std::string path = options_.attach_socket;
  if (path.empty()) {
    if (!caps_.shm_available || caps_.attach_socket.empty()) {
      return absl::FailedPreconditionError(
          "the daemon serves no shared-memory attach socket (shm off, or another host): open "
          "the session with Transport::kGrpc, or set ClientOptions.attach_socket");
    }
    path = caps_.attach_socket;
    // The daemon names its attach socket as it sees it. A client in another mount namespace
    // (an engine container sharing the daemon's socket directory as a volume) reaches that
    // directory at a path of its own: where the reported path is not there, the socket of
    // the same name beside the one this client connected through is the daemon's.
    if (!unix_path_.empty() && ::access(path.c_str(), F_OK) != 0) {
      const std::filesystem::path beside =
          std::filesystem::path(unix_path_).parent_path() / std::filesystem::path(path).filename();
      if (::access(beside.c_str(), F_OK) == 0) path = beside.string();
    }
  }
  KVTIER_ASSIGN_OR_RETURN(
      AttachedArena a, AttachToArena(path, options_.tenant, options_.token, options_.rpc_timeout));
  if (a.region_layout_version != kRegionLayoutVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the daemon's session region layout is version %d; this client reads %d",
                        a.region_layout_version, kRegionLayoutVersion));
  }
  mappings_ = std::make_shared<ArenaMappings>(std::move(a.arena));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<ArenaMapping>> Connection::ArenaFor(Backend* backend) {
  std::shared_ptr<ArenaMappings> mappings;
  std::shared_ptr<Backend> owned;
  {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(AttachLocked());
    if (backend == nullptr) {
      if (cpu_backend_ == nullptr) {
        KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Backend> cpu, CreateBackend(DeviceKind::kCpu));
        cpu_backend_ = std::move(cpu);
      }
      owned = cpu_backend_;
      backend = owned.get();
    }
    mappings = mappings_;
  }
  return mappings->For(*backend, std::move(owned));
}

int64_t Connection::arena_maps() const {
  MutexLock lock(&mu_);
  return mappings_ == nullptr ? 0 : mappings_->maps();
}

ArenaMapping::~ArenaMapping() {
  if (mappings != nullptr && arena != nullptr) mappings->Release(arena);
}

ArenaMappings::ArenaMappings(std::unique_ptr<HostArena> first) {
  entries_.push_back(Entry{.arena = std::move(first)});
}

absl::StatusOr<std::shared_ptr<ArenaMapping>> ArenaMappings::For(Backend& backend,
                                                                 std::shared_ptr<Backend> owned) {
  MutexLock lock(&mu_);
  Entry* unused = nullptr;
  for (Entry& e : entries_) {
    if (e.backend == &backend) {
      if (std::shared_ptr<ArenaMapping> m = e.user.lock()) return m;
    }
    if (e.backend == nullptr && unused == nullptr) unused = &e;
  }
  // An entry whose holder is gone but not yet Released is not reused: its Release may be
  // unregistering it now.
  if (unused == nullptr) {
    const HostArena& first = *entries_.front().arena;
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> arena,
                            HostArena::Map(first.fd(), first.size()));
    entries_.push_back(Entry{.arena = std::move(arena)});
    unused = &entries_.back();
  }
  KVTIER_RETURN_IF_ERROR(unused->arena->RegisterWith(backend));
  auto m = std::make_shared<ArenaMapping>();
  m->owned_backend = std::move(owned);
  m->backend = &backend;
  m->arena = unused->arena.get();
  m->mappings = shared_from_this();
  unused->backend = &backend;
  unused->user = m;
  return m;
}

int64_t ArenaMappings::maps() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(entries_.size());
}

void ArenaMappings::Release(HostArena* arena) {
  MutexLock lock(&mu_);
  for (Entry& e : entries_) {
    if (e.arena.get() != arena) continue;
    (void)e.arena->Unregister();  // the backend may go once its last session has
    e.backend = nullptr;
    e.user.reset();
    return;
  }
}

absl::StatusOr<SessionInfo> LookupSessionInfo(Connection& conn, std::string_view id) {
  v1::ListSessionsReply reply;
  auto ctx = conn.Context();
  KVTIER_RETURN_IF_ERROR(
      FromGrpcStatus(conn.stub().ListSessions(ctx.get(), v1::ListSessionsRequest(), &reply)));
  for (const v1::SessionInfo& s : reply.sessions()) {
    if (s.session_id() == id) return SessionInfoFromProto(s);
  }
  return absl::NotFoundError(
      absl::StrFormat("session \"%s\" is not open for tenant \"%s\"", id, conn.options().tenant));
}

absl::Status CloseSessionById(Connection& conn, std::string_view id) {
  v1::CloseSessionRequest req;
  req.set_session_id(std::string(id));
  v1::CloseSessionReply reply;
  auto ctx = conn.Context();
  return FromGrpcStatus(conn.stub().CloseSession(ctx.get(), req, &reply));
}

absl::StatusOr<SessionInfo> SuspendSessionById(Connection& conn, std::string_view id) {
  v1::SuspendSessionRequest req;
  req.set_session_id(std::string(id));
  v1::SuspendSessionReply reply;
  auto ctx = conn.Context();
  KVTIER_RETURN_IF_ERROR(FromGrpcStatus(conn.stub().SuspendSession(ctx.get(), req, &reply)));
  return SessionInfoFromProto(reply.session());
}

absl::StatusOr<std::vector<FetchedPage>> FetchPagesById(Connection& conn, std::string_view id,
                                                        const Geometry& g, int32_t layer,
                                                        const std::vector<int64_t>& pages) {
  v1::FetchRequest req;
  req.set_session_id(std::string(id));
  req.set_layer(static_cast<uint32_t>(layer));
  for (int64_t page : pages) {
    if (page < 0 || page > std::numeric_limits<uint32_t>::max()) {
      return absl::OutOfRangeError(absl::StrFormat("FetchPages: page = %d is out of range", page));
    }
    req.add_pages(static_cast<uint32_t>(page));
  }
  auto ctx = conn.Context();
  auto reader = conn.stub().Fetch(ctx.get(), req);
  std::vector<FetchedPage> out;
  v1::FetchReply reply;
  const size_t bytes = g.host_page_bytes();
  absl::Status bad;
  while (reader->Read(&reply)) {
    for (v1::Page& p : *reply.mutable_pages()) {
      if (p.data().size() != bytes && bad.ok()) {
        bad = absl::DataLossError(absl::StrFormat("Fetch: page %d has %d bytes; a page has %d",
                                                  p.page(), p.data().size(), bytes));
      }
      FetchedPage f;
      f.layer = static_cast<int32_t>(p.layer());
      f.page = p.page();
      f.generation = p.generation();
      f.data.assign(p.data().begin(), p.data().end());
      out.push_back(std::move(f));
    }
  }
  KVTIER_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  KVTIER_RETURN_IF_ERROR(bad);
  return out;
}

}  // namespace kvtier
