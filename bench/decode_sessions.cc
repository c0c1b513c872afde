#include "bench/decode_sessions.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace kvtier::bench {

absl::StatusOr<std::unique_ptr<ReplaySessions>> ReplaySessions::Connect(
    const std::string& target, const ClientOptions& options, Transport transport,
    std::ostream& log) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(target, options));
  const Capabilities& c = client->capabilities();
  log << "connected to kvtierd " << c.server_version << " at " << target << " (protocol "
      << c.protocol_version << ", tenant " << c.tenant << ", quota " << (c.tenant_quota_bytes >> 20)
      << " MiB, shm " << (c.shm_available ? "yes" : "no") << ")\n";
  return std::unique_ptr<ReplaySessions>(
      new ReplaySessions(std::shared_ptr<Client>(std::move(client)), transport, log));
}

void ReplaySessions::Install(ReplayBenchOptions& o) {
  o.open_session = [this](const std::string& name, const Geometry& g, const SequenceOptions& ro,
                          Device& device) -> absl::StatusOr<std::unique_ptr<Session>> {
    SessionOptions so;
    so.geometry = g;
    so.sequence = ro;
    so.transport = transport_;
    so.device = &device;
    so.label = absl::StrCat("replay ", name);
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Session> s, client_->OpenSession(so));
    log_ << "  mode " << name << ": session " << s->id() << " (" << TransportName(transport_)
         << ")\n";
    ids_.push_back(s->id());
    return s;
  };
}

absl::Status ReplaySessions::CloseAll() {
  absl::Status first;
  for (const std::string& id : ids_) {
    absl::Status st = client_->CloseSession(id);
    log_ << "closed session " << id << ": " << (st.ok() ? "ok" : st.ToString()) << "\n";
    first.Update(st);
  }
  ids_.clear();
  return first;
}

}  // namespace kvtier::bench
