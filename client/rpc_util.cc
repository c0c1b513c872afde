#include "client/rpc_util.h"

#include <charconv>
#include <string>
#include <system_error>

#include "absl/strings/str_format.h"

namespace kvtier {
namespace {

absl::Status BadTarget(std::string_view target, std::string_view why) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "target \"%s\": %s; expected \"unix:///absolute/path\", \"unix:relative/path\" or "
      "\"host:port\"",
      target, why));
}

absl::StatusOr<ParsedTarget> ParseUnix(std::string_view target) {
  std::string_view rest = target.substr(5);  // after "unix:"
  if (rest.starts_with("//")) {
    // URI form: only an empty authority is allowed ("unix:///abs/path").
    rest.remove_prefix(2);
    if (!rest.starts_with("/")) {
      return BadTarget(target, "a unix URI with an authority is not supported");
    }
  }
  if (rest.empty()) return BadTarget(target, "the socket path is empty");
  ParsedTarget t;
  t.unix_path = std::string(rest);
  t.grpc_target = absl::StrFormat("unix:%s", rest);
  return t;
}

}  // namespace

absl::StatusOr<ParsedTarget> ParseTarget(std::string_view target) {
  if (target.empty()) return BadTarget(target, "empty");
  if (target.starts_with("unix:")) return ParseUnix(target);
  const size_t colon = target.rfind(':');
  if (colon == std::string_view::npos) return BadTarget(target, "no port");
  const std::string_view host = target.substr(0, colon);
  const std::string_view port = target.substr(colon + 1);
  if (host.empty()) return BadTarget(target, "the host is empty");
  if (host.find(':') != std::string_view::npos && !(host.starts_with("[") && host.ends_with("]"))) {
    return BadTarget(target, "an IPv6 host must be written in brackets");
  }
  if (host.find('/') != std::string_view::npos) {
    return BadTarget(target, "a host must not contain '/'");
  }
  int port_number = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), port_number);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || port_number < 1 ||
      port_number > 65535) {
    return BadTarget(target, absl::StrFormat("port \"%s\" is not in [1, 65535]", port));
  }
  ParsedTarget t;
  t.grpc_target = std::string(target);
  return t;
}

std::unique_ptr<grpc::ClientContext> NewCallContext(std::string_view tenant, std::string_view token,
                                                    absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata(kTenantMetadataKey, std::string(tenant));
  if (!token.empty()) ctx->AddMetadata(kTokenMetadataKey, std::string(token));
  if (timeout != absl::InfiniteDuration()) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  return ctx;
}

absl::Status CheckSessionOpen(bool closed, std::string_view what, std::string_view id) {
  if (!closed) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat("%s: session %s is closed", what, id));
}

absl::Status CheckSessionOpen(bool closed, bool suspended, std::string_view what,
                              std::string_view id) {
  if (closed || !suspended) return CheckSessionOpen(closed, what, id);
  return absl::FailedPreconditionError(
      absl::StrFormat("%s: session %s is suspended; Client::Reattach resumes it", what, id));
}

}  // namespace kvtier
