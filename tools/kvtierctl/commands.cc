// The commands: every RPC gets the --timeout-ms deadline and the tenant metadata (Drain: the
// admin token only); every failure becomes one absl::Status whose message names the address,
// the method and the gRPC code, printed by Fail().
#include "tools/kvtierctl/commands.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"
#include "kvtier/counters.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "tools/kvtierctl/format.h"
#include "tools/kvtierctl/prometheus.h"
#include "tools/kvtierctl/report.h"

namespace kvtier::ctl {
namespace {

constexpr char kTenantMetadata[] = "x-kvtier-tenant";
constexpr char kTokenMetadata[] = "x-kvtier-token";
constexpr uint32_t kProtocolVersion = 1;
constexpr size_t kMaxMetricsBytes = size_t{256} << 20;

std::string CodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

// Protobuf varint, for the hand-encoded health messages.
void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

bool GetVarint(std::string_view* in, uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 64 && !in->empty(); shift += 7) {
    const auto byte = static_cast<unsigned char>(in->front());
    in->remove_prefix(1);
    *v |= uint64_t{byte & 0x7fu} << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// HealthCheckResponse { ServingStatus status = 1; }: the status (0 when absent), or -1 for
// bytes that are not such a message.
int ServingStatusOf(std::string_view reply) {
  uint64_t status = 0;
  while (!reply.empty()) {
    uint64_t tag = 0, value = 0;
    if (!GetVarint(&reply, &tag) || (tag & 7) != 0 || !GetVarint(&reply, &value)) return -1;
    if (tag >> 3 == 1) status = value;
  }
  return static_cast<int>(std::min<uint64_t>(status, 1 << 20));
}

std::string ServingStatusName(int status) {
  switch (status) {
    case 0:
      return "UNKNOWN";
    case 1:
      return "SERVING";
    case 2:
      return "NOT_SERVING";
    case 3:
      return "SERVICE_UNKNOWN";
    default:
      return absl::StrCat("STATUS_", status);
  }
}

std::string BufferBytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::string TransportName(v1::Transport t) {
  switch (t) {
    case v1::TRANSPORT_UNSPECIFIED:
    case v1::TRANSPORT_SHM:
      return "shm";
    case v1::TRANSPORT_GRPC:
      return "grpc";
    default:
      return absl::StrCat("transport_", static_cast<int>(t));
  }
}

std::string StateName(v1::SessionState s) {
  switch (s) {
    case v1::SESSION_STATE_OPEN:
      return "open";
    case v1::SESSION_STATE_CLOSING:
      return "closing";
    case v1::SESSION_STATE_SUSPENDED:
      return "suspended";
    case v1::SESSION_STATE_COLD:
      return "cold";
    default:
      return "-";
  }
}

// Committed tokens per layer, summarised: "-" (none), "N" (every layer alike) or "MIN..MAX".
std::string TokensSummary(const google::protobuf::RepeatedField<uint64_t>& tokens) {
  if (tokens.empty()) return "-";
  const auto [lo, hi] = std::minmax_element(tokens.begin(), tokens.end());
  if (*lo == *hi) return absl::StrCat(*lo);
  return absl::StrCat(*lo, "..", *hi);
}

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions o;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  std::string out;
  const auto st = google::protobuf::util::MessageToJsonString(message, &out, o);
  if (!st.ok())
    return absl::InternalError(absl::StrCat("JSON of ", message.GetTypeName(), " failed"));
  return out + "\n";
}

std::string Field(std::string_view key, const std::string& value) {
  return absl::StrFormat("%-20s %s\n", key, value);
}

// "42s", or "3723s (1h02m)" from a minute on.
std::string Uptime(uint64_t seconds) {
  if (seconds < 60) return absl::StrCat(seconds, "s");
  return absl::StrFormat("%ds (%s)", seconds,
                         HumanDuration(absl::Seconds(static_cast<int64_t>(seconds))));
}

bool IsUnspecifiedHost(const std::string& host) {
  return host == "0.0.0.0" || host == "::" || host == "0:0:0:0:0:0:0:0";
}

}  // namespace

absl::StatusOr<DaemonAddress> ParseDaemonAddress(std::string_view socket) {
  if (socket.empty()) return absl::InvalidArgumentError("--socket is empty");
  std::string_view path = socket;
  if (socket.starts_with("unix:")) {
    path.remove_prefix(5);
    if (path.starts_with("///")) path.remove_prefix(2);
  } else if (socket.find('/') == std::string_view::npos &&
             socket.find(':') != std::string_view::npos) {
    absl::StatusOr<daemon::HttpAddress> tcp = daemon::ParseHttpAddress(socket);
    if (!tcp.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--socket %s: not a path, unix:PATH or host:port (%s)", socket, tcp.status().message()));
    }
    return DaemonAddress{.target = tcp->ToString(), .display = tcp->ToString(), .tcp = *tcp};
  }
  if (path.empty()) return absl::InvalidArgumentError("--socket unix: names no path");
  const std::string unix_target = absl::StrCat("unix:", std::string(path));
  return DaemonAddress{.target = unix_target, .display = unix_target, .tcp = std::nullopt};
}

absl::StatusOr<std::string> MetricsAddress(std::string_view advertised,
                                           const DaemonAddress& daemon) {
  KVTIER_ASSIGN_OR_RETURN(daemon::HttpAddress address, daemon::ParseHttpAddress(advertised));
  if (address.kind == daemon::HttpAddress::Kind::kTcp && IsUnspecifiedHost(address.host)) {
    if (daemon.tcp.has_value()) {
      address.host = daemon.tcp->host;
    } else {
      address.host = address.host == "0.0.0.0" ? "127.0.0.1" : "::1";
    }
  }
  return address.ToString();
}

Ctl::Ctl(CtlOptions options, std::ostream& out, std::ostream& err)
    : options_(std::move(options)), out_(out), err_(err) {
  absl::StatusOr<DaemonAddress> daemon = ParseDaemonAddress(options_.socket);
  KVTIER_CHECK(daemon.ok());
  daemon_ = *std::move(daemon);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  channel_ = grpc::CreateCustomChannel(daemon_.target, grpc::InsecureChannelCredentials(), args);
}

Ctl::~Ctl() = default;

int Ctl::Fail(const absl::Status& status) {
  err_ << "kvtierctl: " << status.message() << "\n";
  return status.code() == absl::StatusCode::kUnavailable ? kExitUnreachable : kExitFailed;
}

absl::Status Ctl::RpcError(std::string_view method, int code, const std::string& message) {
  // A deadline that passed before the channel ever connected is an unreachable daemon too.
  const bool unreachable =
      code == grpc::StatusCode::UNAVAILABLE || (code == grpc::StatusCode::DEADLINE_EXCEEDED &&
                                                channel_->GetState(false) != GRPC_CHANNEL_READY);
  const std::string text =
      absl::StrFormat("%s%s: %s: %s: %s", unreachable ? "cannot reach kvtierd at " : "",
                      daemon_.display, method, CodeName(code), message);
  return unreachable ? absl::UnavailableError(text)
                     : absl::Status(static_cast<absl::StatusCode>(code), text);
}

void Ctl::Prepare(grpc::ClientContext& ctx, bool as_tenant, int64_t extra_ms) const {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(options_.timeout_ms + extra_ms));
  if (!as_tenant) return;
  ctx.AddMetadata(kTenantMetadata, options_.tenant);
  if (!options_.token.empty()) ctx.AddMetadata(kTokenMetadata, options_.token);
}

int Ctl::Health(const std::string& service) {
  std::string request;  // HealthCheckRequest { string service = 1; }
  if (!service.empty()) {
    request.push_back('\x0a');
    PutVarint(service.size(), &request);
    request += service;
  }
  grpc::ClientContext ctx;
  Prepare(ctx, false);
  grpc::GenericStub stub(channel_);
  grpc::CompletionQueue cq;
  grpc::Slice slice(request);
  const grpc::ByteBuffer request_buffer(&slice, 1);
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request_buffer, &cq);
  call->StartCall();
  grpc::ByteBuffer reply;
  grpc::Status status;
  int tag = 0;
  call->Finish(&reply, &status, &tag);
  void* got = nullptr;
  bool ok = false;
  (void)cq.Next(&got, &ok);
  cq.Shutdown();
  while (cq.Next(&got, &ok)) {
  }
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) {  // the service is not known
    out_ << ServingStatusName(3) << "\n";
    return kExitFailed;
  }
  if (!status.ok()) {
    return Fail(RpcError("Health/Check", status.error_code(), status.error_message()));
  }
  const int serving = ServingStatusOf(BufferBytes(reply));
  if (serving < 0) {
    return Fail(absl::InternalError(absl::StrFormat(
        "%s: Health/Check: the reply is not a HealthCheckResponse", daemon_.display)));
  }
  out_ << ServingStatusName(serving) << "\n";
  return serving == 1 ? kExitOk : kExitFailed;
}

absl::StatusOr<std::string> Ctl::FetchMetrics() {
  std::string address = options_.metrics;
  if (address.empty()) {
    auto stub = v1::KvTier::NewStub(channel_);
    grpc::ClientContext ctx;
    Prepare(ctx, true);
    v1::HelloRequest request;
    request.set_protocol_version(kProtocolVersion);
    request.set_client_name("kvtierctl");
    v1::HelloReply reply;
    const grpc::Status st = stub->Hello(&ctx, request, &reply);
    if (!st.ok()) return RpcError("Hello", st.error_code(), st.error_message());
    if (reply.metrics_address().empty()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "metrics are off on this daemon (%s advertises no metrics address); pass --metrics "
          "ADDRESS if it serves them elsewhere",
          daemon_.display));
    }
    KVTIER_ASSIGN_OR_RETURN(address, MetricsAddress(reply.metrics_address(), daemon_));
  }
  absl::StatusOr<daemon::HttpResponse> r = daemon::HttpGet(
      address, "/metrics", absl::Milliseconds(options_.timeout_ms), kMaxMetricsBytes);
  if (!r.ok()) return absl::Status(r.status().code(), r.status().message());
  if (r->status != 200) {
    const std::string first_line = r->body.substr(0, r->body.find('\n'));
    return absl::UnknownError(
        absl::StrFormat("GET http %s/metrics answered %d: %s", address, r->status, first_line));
  }
  return std::move(r->body);
}

int Ctl::Metrics() {
  absl::StatusOr<std::string> body = FetchMetrics();
  if (!body.ok()) return Fail(body.status());
  out_ << *body;
  return kExitOk;
}

int Ctl::Tenants() {
  absl::StatusOr<std::string> body = FetchMetrics();
  if (!body.ok()) return Fail(body.status());
  absl::StatusOr<PromText> text = ParsePrometheusText(*body);
  if (!text.ok())
    return Fail(absl::UnknownError(absl::StrCat("/metrics: ", text.status().message())));
  out_ << FormatTenants(TenantRows(*text), options_.json);
  return kExitOk;
}

int Ctl::Sessions(const std::string& tenant_filter) {
  absl::StatusOr<std::string> body = FetchMetrics();
  if (!body.ok()) return Fail(body.status());
  absl::StatusOr<PromText> text = ParsePrometheusText(*body);
  if (!text.ok())
    return Fail(absl::UnknownError(absl::StrCat("/metrics: ", text.status().message())));
  out_ << FormatSessions(SessionRows(*text, tenant_filter), options_.json);
  return kExitOk;
}

int Ctl::Stats(const std::string& session_id) {
  auto stub = v1::KvTier::NewStub(channel_);
  grpc::ClientContext ctx;
  Prepare(ctx, true);
  v1::GetStatsRequest request;
  request.set_session_id(session_id);
  v1::GetStatsReply reply;
  const grpc::Status st = stub->GetStats(&ctx, request, &reply);
  if (!st.ok()) return Fail(RpcError("GetStats", st.error_code(), st.error_message()));
  if (options_.json) {
    absl::StatusOr<std::string> json = ToJson(reply);
    if (!json.ok()) return Fail(json.status());
    out_ << *json;
    return kExitOk;
  }
  const v1::SessionStats& s = reply.session();
  std::string text = Field("session", s.session_id());
  // Every counter the daemon sent: those of kvtier/counters.h in its order, then any this
  // build does not know (a newer daemon's), by name.
  std::vector<std::string> names;
  for (const CounterInfo& c : SequenceCounters()) names.emplace_back(c.name);
  std::vector<std::string> unknown;
  for (const auto& [name, value] : s.counters()) {
    if (std::find(names.begin(), names.end(), name) == names.end()) unknown.push_back(name);
  }
  std::sort(unknown.begin(), unknown.end());
  names.insert(names.end(), unknown.begin(), unknown.end());
  for (const std::string& name : names) {
    const auto it = s.counters().find(name);
    if (it == s.counters().end()) continue;
    const int64_t v = it->second;
    absl::StrAppend(&text, Field("  " + name, absl::EndsWith(name, "_bytes")
                                                  ? absl::StrFormat("%d (%s)", v, HumanBytes(v))
                                                  : absl::StrCat(v)));
  }
  absl::StrAppend(&text, Field("  correction_rate", absl::StrFormat("%.4f", s.correction_rate())),
                  Field("  committed_pages", absl::StrCat(s.committed_pages())));
  for (const v1::TenantStats& t : reply.tenants()) {
    absl::StrAppend(&text, Field("tenant", t.tenant()),
                    Field("  quota_bytes",
                          absl::StrFormat("%d (%s)", t.quota_bytes(), HumanBytes(t.quota_bytes()))),
                    Field("  used_bytes",
                          absl::StrFormat("%d (%s)", t.used_bytes(), HumanBytes(t.used_bytes()))),
                    Field("  sessions", absl::StrCat(t.sessions())),
                    Field("  cold_sessions", absl::StrCat(t.cold_sessions())),
                    Field("  refused_requests", absl::StrCat(t.refused_requests())));
  }
  absl::StrAppend(&text, Field("uptime", Uptime(reply.uptime_s())),
                  Field("rpcs", absl::StrCat(reply.rpcs())),
                  Field("rpc_errors", absl::StrCat(reply.rpc_errors())));
  out_ << text;
  return kExitOk;
}

int Ctl::List() {
  auto stub = v1::KvTier::NewStub(channel_);
  grpc::ClientContext ctx;
  Prepare(ctx, true);
  v1::ListSessionsReply reply;
  const grpc::Status st = stub->ListSessions(&ctx, v1::ListSessionsRequest(), &reply);
  if (!st.ok()) return Fail(RpcError("ListSessions", st.error_code(), st.error_message()));
  if (options_.json) {
    absl::StatusOr<std::string> json = ToJson(reply);
    if (!json.ok()) return Fail(json.status());
    out_ << *json;
    return kExitOk;
  }
  if (reply.sessions().empty()) {
    out_ << "no sessions for tenant '" << options_.tenant << "'\n";
    return kExitOk;
  }
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  std::vector<std::vector<std::string>> rows;
  for (const v1::SessionInfo& s : reply.sessions()) {
    const std::string age = s.created_unix_ms() > 0
                                ? HumanDuration(absl::Milliseconds(now_ms - s.created_unix_ms()))
                                : "-";
    rows.push_back({s.session_id(), TransportName(s.transport()), StateName(s.state()),
                    s.label().empty() ? "-" : s.label(), absl::StrCat(s.geometry().num_layers()),
                    TokensSummary(s.committed_tokens()), absl::StrCat(s.epoch()), age});
  }
  out_ << RenderTable({{"SESSION"},
                       {"TRANSPORT"},
                       {"STATE"},
                       {"LABEL"},
                       {"LAYERS", true},
                       {"TOKENS", true},
                       {"EPOCH", true},
                       {"AGE", true}},
                      rows);
  return kExitOk;
}

int Ctl::Drain(uint32_t drain_timeout_ms, const std::string& admin_token) {
  auto stub = v1::KvTier::NewStub(channel_);
  grpc::ClientContext ctx;
  Prepare(ctx, false, drain_timeout_ms);  // the daemon may wait that long before answering
  ctx.AddMetadata(kTokenMetadata, admin_token);
  v1::DrainRequest request;
  request.set_timeout_ms(drain_timeout_ms);
  v1::DrainReply reply;
  const grpc::Status st = stub->Drain(&ctx, request, &reply);
  if (!st.ok()) return Fail(RpcError("Drain", st.error_code(), st.error_message()));
  out_ << Field("drained", reply.drained() ? "yes" : "no")
       << Field("open_sessions", absl::StrCat(reply.open_sessions()))
       << Field("inflight_calls", absl::StrCat(reply.inflight_calls()));
  return reply.drained() ? kExitOk : kExitFailed;
}

}  // namespace kvtier::ctl
