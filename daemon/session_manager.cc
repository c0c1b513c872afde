// SessionManager (session_manager.h): its construction and destruction, and the session
// table: finding a caller's session (Peek, Find), closing, listing, reattaching and
// suspending sessions, and closing them all at shutdown. The rest of the class is defined
// beside it: session_admission.cc, session_open.cc, session_streams.cc,
// session_tiering.cc, session_persistence.cc and session_metrics.cc.
#include "daemon/session_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "daemon/logging.h"
#include "daemon/session_manager_internal.h"
#include "kernels/registry.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

using session_internal::Printable;
using session_internal::Sv;

// ---- creation -----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SessionManager>> SessionManager::Create(const DaemonConfig& config) {
  DeviceOptions bo;
  bo.cpu_threads = config.cpu_threads;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(DeviceKind::kCpu, bo));
  spdlog::info("GRPC sessions run on {}", backend->Describe());
  std::unique_ptr<SessionManager> m(new SessionManager(config, std::move(backend)));
  for (const TenantConfig& tc : config.tenants) {
    if (m->tenants_.contains(tc.name)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tenant.name = '%s' appears twice", Printable(tc.name)));
    }
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Tenant> tenant, Tenant::Create(tc));
    KVTIER_RETURN_IF_ERROR(tenant->arena().RegisterWith(*m->backend_));
    m->tenants_.emplace(tc.name, std::move(tenant));
  }
  KVTIER_RETURN_IF_ERROR(m->AdoptPersistentSessions());
  KVTIER_RETURN_IF_ERROR(m->StartColdTier());
  return m;
}

SessionManager::SessionManager(const DaemonConfig& config, std::unique_ptr<Backend> backend)
    : config_(config), start_time_(absl::Now()), backend_(std::move(backend)) {}

SessionManager::~SessionManager() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  stopping_cv_.SignalAll();
  if (demoter_.joinable()) demoter_.join();
  CloseAllSessions();
}

Tenant* SessionManager::FindTenant(std::string_view name) const {
  auto it = tenants_.find(Sv(name));
  return it == tenants_.end() ? nullptr : it->second.get();
}

// ---- the table ----------------------------------------------------------------------------

absl::StatusOr<SessionManager::Entry> SessionManager::Peek(const Caller& caller,
                                                           std::string_view session_id) const {
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(Sv(session_id));
    // Another tenant's session is answered exactly like an unknown id: the answer must not
    // tell whether an id exists.
    if (it != sessions_.end() && it->second.tenant == caller.tenant) return it->second;
  }
  return absl::NotFoundError(absl::StrFormat("session_id = '%s': tenant '%s' has no such session",
                                             Printable(session_id), caller.tenant));
}

absl::StatusOr<std::shared_ptr<TenantSession>> SessionManager::Find(const Caller& caller,
                                                                    std::string_view session_id) {
  KVTIER_ASSIGN_OR_RETURN(Entry e, Peek(caller, session_id));
  if (e.session != nullptr) return e.session;
  return Promote(std::string(session_id), ColdDeadline(caller));
}

absl::StatusOr<CloseResult> SessionManager::CloseSession(const Caller& caller,
                                                         std::string_view session_id) {
  InflightCall call(this);
  absl::StatusOr<Entry> e = Peek(caller, session_id);
  if (!e.ok()) return Tally(caller, e.status());
  if (absl::Status live = caller.CheckLive("CloseSession"); !live.ok()) {
    return Tally(caller, live);
  }
  if (e->session == nullptr) return Tally(caller, CloseCold(caller, *e));
  absl::StatusOr<std::shared_ptr<TenantSession>> s = e->session;
  if (Remove(session_id) != *s) {
    return Tally(caller, absl::NotFoundError(absl::StrFormat(
                             "session %s was closed meanwhile by another call", (*s)->id())));
  }
  absl::StatusOr<CloseResult> r = (*s)->Close();
  if (e->stale_record != nullptr) {
    // A failed demotion's record, still listed: it must not bring the session back.
    if (ColdStore* store = ColdStoreOf(e->tenant); store != nullptr) {
      (void)store->Remove(*e->stale_record, ColdDeadline(caller));
    }
  }
  SaveSessionTable((*s)->tenant());
  session_events_.Add(
      {"closed", (*s)->tenant(), std::string(TransportName((*s)->spec().transport))});
  if (r.ok()) {
    LogLimited(spdlog::level::info, "session closed",
               "session {} closed: {} committed pages, {} bytes freed", (*s)->id(),
               r->committed_pages, r->freed_bytes);
  }
  return Tally(caller, std::move(r));
}

std::vector<SessionRecord> SessionManager::ListSessions(const Caller& caller) {
  InflightCall call(this);
  std::vector<Entry> mine;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, e] : sessions_) {
      if (e.tenant == caller.tenant) mine.push_back(e);
    }
  }
  std::sort(mine.begin(), mine.end(), [](const Entry& a, const Entry& b) { return a.seq < b.seq; });
  std::vector<SessionRecord> out;
  out.reserve(mine.size());
  for (const Entry& e : mine) out.push_back(e.Record());
  return out;
}

absl::StatusOr<SessionRecord> SessionManager::Reattach(const Caller& caller,
                                                       std::string_view session_id) {
  InflightCall call(this);
  absl::StatusOr<std::shared_ptr<TenantSession>> s;
  absl::StatusOr<SessionRecord> r;
  // A session demoted between Find and its Reattach is found again, cold, and promoted.
  for (int attempt = 0; attempt < 3; ++attempt) {
    s = Find(caller, session_id);
    if (!s.ok()) return Tally(caller, s.status());
    if (absl::Status live = caller.CheckLive("Reattach"); !live.ok()) return Tally(caller, live);
    r = (*s)->Reattach();
    if (r.ok() || !(*s)->demoted()) break;
  }
  if (!r.ok()) return Tally(caller, r.status());
  SaveSessionTable((*s)->tenant());
  session_events_.Add(
      {"reattached", (*s)->tenant(), std::string(TransportName((*s)->spec().transport))});
  LogLimited(spdlog::level::info, "session reattached", "session {} reattached: epoch {}", r->id,
             r->epoch);
  return r;
}

absl::StatusOr<SessionRecord> SessionManager::SuspendSession(const Caller& caller,
                                                             std::string_view session_id) {
  InflightCall call(this);
  absl::StatusOr<Entry> e = Peek(caller, session_id);
  if (!e.ok()) return Tally(caller, e.status());
  if (absl::Status live = caller.CheckLive("SuspendSession"); !live.ok()) {
    return Tally(caller, live);
  }
  if (e->session == nullptr) return e->Record();  // cold: suspended already, or persisted
  absl::StatusOr<SessionRecord> r = e->session->Suspend();
  if (!r.ok()) return Tally(caller, r.status());
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(Sv(session_id));
    if (it != sessions_.end() && it->second.session == e->session &&
        it->second.suspended_at == absl::InfiniteFuture()) {
      it->second.suspended_at = absl::Now();
    }
  }
  SaveSessionTable(e->tenant);
  session_events_.Add(
      {"suspended", e->tenant, std::string(TransportName(e->session->spec().transport))});
  LogLimited(spdlog::level::info, "session suspended", "session {} suspended: epoch {}", r->id,
             r->epoch);
  return r;
}

std::shared_ptr<TenantSession> SessionManager::Remove(std::string_view id) {
  MutexLock lock(&mu_);
  auto it = sessions_.find(Sv(id));
  if (it == sessions_.end()) return nullptr;
  std::shared_ptr<TenantSession> s = std::move(it->second.session);
  if (s == nullptr) return nullptr;  // cold: CloseCold removes it
  if (!it->second.request_key.empty()) requests_.erase(it->second.request_key);
  sessions_.erase(it);
  return s;
}

size_t SessionManager::CloseAllSessions() {
  absl::flat_hash_map<std::string, Entry> all;
  {
    MutexLock lock(&mu_);
    all.swap(sessions_);
    requests_.clear();
  }
  size_t closed = 0;
  for (auto& [id, e] : all) {
    if (e.session == nullptr) continue;  // cold: its record stays for the next daemon
    (void)e.session->Close();
    session_events_.Add({"closed", e.session->tenant(),
                         std::string(TransportName(e.session->spec().transport))});
    ++closed;
  }
  if (closed > 0) spdlog::info("closed {} sessions", closed);
  return closed;
}

}  // namespace kvtier::daemon
