#include "daemon/session_manager.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "daemon/logging.h"
#include "daemon/session_params.h"
#include "kernels/registry.h"
#include "offload/cold_pages.h"
#include "offload/policy/config.h"
#include "offload/telemetry.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {
namespace {

constexpr size_t kMaxLabelBytes = 256;
// Sessions persisted at once at shutdown (PersistAllSessions): each is a few pipelines to the
// cluster, so a few threads keep every node busy without a thread per session.
constexpr size_t kPersistParallelism = 8;

// This abseil's string_view is its own type, not std::string_view.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A client-supplied string, safe to put in a message or a log line.
std::string Printable(std::string_view s) {
  constexpr size_t kMax = 64;
  std::string out = absl::CHexEscape(Sv(s.substr(0, kMax)));
  if (s.size() > kMax) out += "...";
  return out;
}

// Compares in time independent of where the strings differ.
bool TokensEqual(std::string_view a, std::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

// 128 random bits from the kernel, as 32 lower-case hex digits.
std::string NewSessionId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    KVTIER_CHECK(n > 0 || errno == EINTR);  // getrandom cannot fail for 16 bytes otherwise
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

bool PageSizeSupported(int32_t p) {
  return std::find(std::begin(kSupportedPageSizes), std::end(kSupportedPageSizes), p) !=
         std::end(kSupportedPageSizes);
}

}  // namespace

// ---- CallSlot, InflightCall --------------------------------------------------------------

CallSlot& CallSlot::operator=(CallSlot&& other) noexcept {
  if (this != &other) {
    if (manager_ != nullptr) manager_->EndTenantCall(tenant_);
    manager_ = std::exchange(other.manager_, nullptr);
    tenant_ = std::move(other.tenant_);
  }
  return *this;
}

CallSlot::~CallSlot() {
  if (manager_ != nullptr) manager_->EndTenantCall(tenant_);
}

absl::StatusOr<CallSlot> SessionManager::Admit(const Caller& caller) {
  MutexLock lock(&mu_);
  uint32_t& calls = tenant_calls_[caller.tenant];
  if (calls >= config_.max_inflight_calls_per_tenant) {
    absl::Status busy = absl::ResourceExhaustedError(absl::StrFormat(
        "tenant '%s' has %d calls in flight (limits.max_inflight_calls_per_tenant = %d); retry "
        "when one has finished",
        caller.tenant, calls, config_.max_inflight_calls_per_tenant));
    SetRetryAfter(busy, absl::Milliseconds(10));
    if (Tenant* t = FindTenant(caller.tenant); t != nullptr) t->CountRefused();
    return busy;
  }
  ++calls;
  return CallSlot(this, caller.tenant);
}

void SessionManager::EndTenantCall(const std::string& tenant) {
  MutexLock lock(&mu_);
  auto it = tenant_calls_.find(tenant);
  if (it != tenant_calls_.end() && it->second > 0) --it->second;
}

InflightCall::InflightCall(SessionManager* manager) : manager_(manager) {
  MutexLock lock(&manager_->mu_);
  ++manager_->inflight_;
}

InflightCall& InflightCall::operator=(InflightCall&& other) noexcept {
  if (this != &other) {
    if (manager_ != nullptr) manager_->EndCall();
    manager_ = std::exchange(other.manager_, nullptr);
  }
  return *this;
}

InflightCall::~InflightCall() {
  if (manager_ != nullptr) manager_->EndCall();
}

void SessionManager::EndCall() {
  MutexLock lock(&mu_);
  if (--inflight_ == 0) idle_.SignalAll();
}

uint32_t SessionManager::InflightCalls() const {
  MutexLock lock(&mu_);
  return inflight_;
}

// ---- creation, authentication -------------------------------------------------------------

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

bool SessionManager::Persistent(std::string_view tenant) const {
  const Tenant* t = FindTenant(tenant);
  return t != nullptr && !t->config().arena_path.empty();
}

namespace {

std::string TablePath(const TenantConfig& tc) { return tc.arena_path + ".sessions"; }

// Writes `bytes` to `tmp`, syncs it and renames it over `path`: a crash leaves the old file
// or the new one, never a torn one.
absl::Status WriteFileDurably(const std::string& tmp, const std::string& path,
                              std::string_view bytes) {
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", tmp));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat("write ", tmp));
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("fsync ", tmp));
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SessionManager::AdoptPersistentSessions() {
  for (const TenantConfig& tc : config_.tenants) {
    if (tc.arena_path.empty()) continue;
    Tenant* tenant = FindTenant(tc.name);
    const std::string path = TablePath(tc);
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      spdlog::info("tenant '{}': no session table at {}: no sessions to take up", tc.name, path);
      continue;
    }
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    v1::HostSessionTable table;
    if (!table.ParseFromString(bytes) || table.version() != 1 || table.tenant() != tc.name) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "tenant '%s': %s is not a session table of this tenant (move it away to start with an "
          "empty arena)",
          tc.name, path));
    }
    if (!tenant->arena().report().existed) {
      spdlog::warn("tenant '{}': {} lists {} sessions but the arena {} is new: none taken up",
                   tc.name, path, table.sessions_size(), tc.arena_path);
      SaveSessionTable(tc.name);  // empty now
      continue;
    }
    size_t adopted = 0;
    for (const v1::HostSession& hs : table.sessions()) {
      const v1::ColdSessionRecord& r = hs.record();
      absl::StatusOr<std::shared_ptr<TenantSession>> s = [&]()
          -> absl::StatusOr<std::shared_ptr<TenantSession>> {
        KVTIER_ASSIGN_OR_RETURN(OpenSessionParams params, ParamsFromProto(r.request()));
        if (params.tenant != tc.name) return absl::FailedPreconditionError("another tenant's");
        KVTIER_ASSIGN_OR_RETURN(SessionSpec spec, ResolveSpec(Caller(tc.name), params));
        KVTIER_ASSIGN_OR_RETURN(RegionLease lease,
                                tenant->AdoptRegion(hs.region_offset(), hs.region_bytes()));
        KVTIER_ASSIGN_OR_RETURN(
            std::shared_ptr<TenantSession> session,
            TenantSession::Adopt(r.session_id(), std::move(spec), std::move(lease), backend_.get(),
                                 tenant, r.created_unix_ms(), r.epoch(), r.suspended()));
        Entry e;
        e.tenant = tc.name;
        e.session = session;
        e.params = std::move(params);
        if (session->suspended()) e.suspended_at = absl::Now();
        MutexLock lock(&mu_);
        e.seq = next_seq_++;
        sessions_.emplace(r.session_id(), std::move(e));
        return session;
      }();
      if (!s.ok()) {
        spdlog::warn("tenant '{}': session {} of {} cannot be taken up, its region is free again: "
                     "{}",
                     tc.name, r.session_id(), path, s.status().ToString());
        continue;
      }
      ++adopted;
    }
    spdlog::info("tenant '{}': took up {} of {} sessions from {}", tc.name, adopted,
                 table.sessions_size(), path);
    SaveSessionTable(tc.name);  // without the ones that could not be taken up
  }
  return absl::OkStatus();
}

void SessionManager::SaveSessionTable(const std::string& tenant_name) {
  const Tenant* tenant = FindTenant(tenant_name);
  if (tenant == nullptr || tenant->config().arena_path.empty()) return;
  MutexLock writing(&table_mu_);
  std::vector<Entry> hot;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, e] : sessions_) {
      // A session that demotes pages has pages in no arena: it does not survive (yet).
      if (e.tenant == tenant_name && e.session != nullptr && !e.session->closing() &&
          !e.session->spec().demotes_pages()) {
        hot.push_back(e);
      }
    }
  }
  std::sort(hot.begin(), hot.end(), [](const Entry& a, const Entry& b) { return a.seq < b.seq; });
  v1::HostSessionTable table;
  table.set_version(1);
  table.set_tenant(tenant_name);
  table.set_arena_bytes(tenant->quota_bytes());
  for (const Entry& e : hot) {
    const SessionRecord r = e.session->Record();
    v1::HostSession* hs = table.add_sessions();
    v1::ColdSessionRecord* rec = hs->mutable_record();
    rec->set_version(1);
    rec->set_session_id(r.id);
    *rec->mutable_request() = ResolvedRequest(e.params, r.spec);
    rec->set_created_unix_ms(r.created_unix_ms);
    rec->set_epoch(r.epoch);
    rec->set_suspended(r.suspended);
    rec->set_page_bytes(r.spec.geometry.host_page_bytes());
    hs->set_region_offset(r.region_offset);
    hs->set_region_bytes(r.region_bytes);
  }
  const std::string path = TablePath(tenant->config());
  const std::string tmp = path + ".tmp";
  std::string bytes;
  absl::Status st = table.SerializeToString(&bytes)
                        ? absl::OkStatus()
                        : absl::InternalError("serializing the session table");
  if (st.ok()) st = WriteFileDurably(tmp, path, bytes);
  if (!st.ok()) {
    LogLimited(spdlog::level::err, "session table",
               "tenant '{}': writing its session table {}: {}; a restart would not find the "
               "latest change",
               tenant_name, path, st.ToString());
  }
}

absl::Status SessionManager::StartColdTier() {
  const ColdTierConfig& cc = config_.cold_tier;
  if (!cc.enabled()) return absl::OkStatus();
  const auto connect = [&](std::string user,
                           std::string password) -> absl::StatusOr<std::unique_ptr<RedisCluster>> {
    RedisClusterOptions o;
    o.seeds = cc.nodes;
    o.user = std::move(user);
    o.password = std::move(password);
    o.connect_timeout = cc.connect_timeout;
    o.command_timeout = cc.command_timeout;
    o.slot_map_refresh = cc.slot_map_refresh;
    absl::StatusOr<std::unique_ptr<RedisCluster>> c = RedisCluster::Connect(std::move(o));
    if (!c.ok()) {
      return absl::Status(c.status().code(),
                          absl::StrCat("cold_tier.nodes: ", c.status().message()));
    }
    return c;
  };
  KVTIER_ASSIGN_OR_RETURN(cluster_, connect(cc.user, cc.password));
  spdlog::info("cold tier: Redis Cluster of {} nodes from {}, keys under '{}:'",
               cluster_->node_count(), absl::StrJoin(cc.nodes, ","), cc.key_prefix);
  const absl::Time deadline = absl::Now() + cc.operation_timeout;
  for (const TenantConfig& tc : config_.tenants) {
    if (tc.cold_quota_bytes == 0) continue;
    TenantCold& cold = cold_[tc.name];
    RedisCluster* cluster = cluster_.get();
    if (!tc.redis_user.empty()) {
      KVTIER_ASSIGN_OR_RETURN(cold.own_cluster, connect(tc.redis_user, tc.redis_password));
      cluster = cold.own_cluster.get();
    }
    KVTIER_ASSIGN_OR_RETURN(cold.tier, ColdTier::Create(cluster, cc.key_prefix));
    cold.store = std::make_unique<ColdStore>(
        cluster, cold.tier.get(), cc.key_prefix,
        ColdStoreOptions{tc.name, tc.cold_quota_bytes, cc.min_replicas, cc.command_timeout});
    absl::StatusOr<std::vector<v1::ColdSessionRecord>> records = cold.store->LoadAll(deadline);
    if (!records.ok()) {
      return absl::Status(records.status().code(),
                          absl::StrFormat("tenant '%s': reading its cold sessions: %s", tc.name,
                                          records.status().message()));
    }
    std::sort(records->begin(), records->end(), [](const auto& a, const auto& b) {
      return a.created_unix_ms() < b.created_unix_ms();
    });
    MutexLock lock(&mu_);
    for (v1::ColdSessionRecord& r : *records) {
      if (sessions_.contains(r.session_id())) {
        // Both in the persistent arena and in the cold tier (the daemon stopped between the
        // two halves of a move): the host tier's copy is the session.
        spdlog::info("tenant '{}': session {} is in its arena already; its cold copy is ignored",
                     tc.name, r.session_id());
        cold.store->Forget(r);
        continue;
      }
      absl::StatusOr<OpenSessionParams> params = ParamsFromProto(r.request());
      absl::StatusOr<SessionSpec> spec =
          params.ok() ? ResolveSpec(Caller(tc.name), *params) : params.status();
      if (!spec.ok() || params->tenant != tc.name) {
        spdlog::warn("tenant '{}': cold session {} cannot be taken up ({}); its keys stay",
                     tc.name, r.session_id(),
                     spec.ok() ? "another tenant's record" : spec.status().ToString());
        continue;
      }
      Entry e;
      e.seq = next_seq_++;
      e.tenant = tc.name;
      e.params = *std::move(params);
      e.cold = std::make_shared<const ColdEntry>(ColdEntry{r, *std::move(spec)});
      sessions_.emplace(r.session_id(), std::move(e));
    }
    spdlog::info("tenant '{}': cold quota {} bytes, {} sessions in the cold tier ({} bytes)",
                 tc.name, tc.cold_quota_bytes, cold.store->stats().sessions,
                 cold.store->stats().used_bytes);
  }
  if (cc.demote_suspended_after > absl::ZeroDuration() && !cold_.empty()) {
    demoter_ = std::thread([this] { DemoteSuspendedLoop(); });
  }
  return absl::OkStatus();
}

void SessionManager::DemoteSuspendedLoop() {
  const absl::Duration after = config_.cold_tier.demote_suspended_after;
  const absl::Duration period = std::clamp(after / 4, absl::Milliseconds(10), absl::Seconds(1));
  for (;;) {
    std::vector<std::string> due;
    {
      MutexLock lock(&mu_);
      stopping_cv_.AwaitWithTimeout(
          &mu_,
          [this] {
            mu_.AssertHeld();
            return stopping_;
          },
          period);
      if (stopping_) return;
      const absl::Time now = absl::Now();
      for (const auto& [id, e] : sessions_) {
        if (e.session != nullptr && e.session->suspended() && e.suspended_at + after <= now &&
            ColdStoreOf(e.tenant) != nullptr) {
          due.push_back(id);
        }
      }
    }
    for (const std::string& id : due) {
      absl::Status st =
          Demote(id, /*force=*/false, absl::Now() + config_.cold_tier.operation_timeout);
      // Reattached, closed or demoted meanwhile is fine; after a failure the session waits
      // its time again before the next try.
      if (!st.ok() && !absl::IsNotFound(st) && !absl::IsFailedPrecondition(st)) {
        LogLimited(spdlog::level::warn, "suspended session demotion",
                   "session {}: demoting it after {} ms suspended: {}", id,
                   absl::ToInt64Milliseconds(after), st.ToString());
        MutexLock lock(&mu_);
        auto it = sessions_.find(id);
        if (it != sessions_.end() && it->second.session != nullptr) {
          it->second.suspended_at = absl::Now();
        }
      }
    }
  }
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

absl::StatusOr<Caller> SessionManager::Authenticate(std::string_view tenant,
                                                    std::string_view token) const {
  if (tenant.empty()) {
    return absl::UnauthenticatedError("x-kvtier-tenant is missing: every call names its tenant");
  }
  const Tenant* t = FindTenant(tenant);
  if (t == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrFormat("x-kvtier-tenant = '%s': no such tenant", Printable(tenant)));
  }
  if (!t->config().token.empty() && !TokensEqual(token, t->config().token)) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "tenant '%s': x-kvtier-token does not match the tenant's token", t->name()));
  }
  Caller caller;
  caller.tenant = t->name();
  return caller;
}

absl::StatusOr<AttachGrant> SessionManager::AuthorizeAttach(const PeerCredentials& peer,
                                                            std::string_view tenant,
                                                            std::string_view token) const {
  if (draining()) return absl::UnavailableError("kvtierd is draining: attaches are refused");
  const Tenant* t = FindTenant(tenant);
  if (t == nullptr) {
    return absl::NotFoundError(
        absl::StrFormat("attach: tenant '%s' is not configured", Printable(tenant)));
  }
  if (!t->config().token.empty() && !TokensEqual(token, t->config().token)) {
    return absl::PermissionDeniedError(
        absl::StrFormat("attach to tenant '%s': the token does not match", t->name()));
  }
  const std::vector<uint32_t>& uids = t->config().uids;
  if (uids.empty() && peer.uid != geteuid()) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "attach to tenant '%s': uid %d may not map its arena (tenant.uids is empty: only the "
        "daemon's uid %d may)",
        t->name(), peer.uid, geteuid()));
  }
  if (!uids.empty() && std::find(uids.begin(), uids.end(), peer.uid) == uids.end()) {
    return absl::PermissionDeniedError(
        absl::StrFormat("attach to tenant '%s': uid %d is not in tenant.uids [%s]", t->name(),
                        peer.uid, absl::StrJoin(uids, ", ")));
  }
  AttachGrant grant;
  grant.fd = t->arena().fd();
  grant.arena_bytes = t->arena().size();
  grant.arena_name = t->arena().report().name;
  return grant;
}

absl::Status SessionManager::Tally(const Caller& caller, absl::Status status) const {
  if (!status.ok()) {
    if (Tenant* t = FindTenant(caller.tenant); t != nullptr) t->CountRefused();
    spdlog::debug("tenant '{}': {}", caller.tenant, status.ToString());
  }
  return status;
}

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

// ---- OpenSession --------------------------------------------------------------------------

absl::StatusOr<SessionSpec> SessionManager::ResolveSpec(const Caller& caller,
                                                        const OpenSessionParams& p) const {
  const auto bad = [](std::string msg) { return absl::InvalidArgumentError(std::move(msg)); };
  if (p.tenant != caller.tenant) {
    return absl::PermissionDeniedError(
        absl::StrFormat("tenant = '%s': sessions may be opened only for the caller's tenant '%s'",
                        Printable(p.tenant), caller.tenant));
  }
  const Geometry& g = p.geometry;
  // Before Validate, whose range is the library's, not what this daemon serves.
  if (!PageSizeSupported(g.page_size)) {
    return bad(absl::StrFormat("geometry.page_size = %d: the daemon serves page sizes %s",
                               g.page_size, absl::StrJoin(kSupportedPageSizes, ", ")));
  }
  KVTIER_RETURN_IF_ERROR(g.Validate());
  if (static_cast<uint32_t>(g.num_layers) > config_.max_layers) {
    return bad(absl::StrFormat("geometry.num_layers = %d: must be at most max_layers = %d",
                               g.num_layers, config_.max_layers));
  }
  const int64_t max_tokens =
      p.max_tokens != 0 ? p.max_tokens
                        : std::min(config_.default_max_tokens, config_.max_tokens_per_session);
  // This daemon's limits; the options' own rules are ResolveSequenceOptions's, below.
  if (max_tokens > config_.max_tokens_per_session) {
    return bad(absl::StrFormat("max_tokens = %d: must be at most max_tokens_per_session = %d",
                               max_tokens, config_.max_tokens_per_session));
  }
  // The working set never needs to be larger than the capacity, rounded up to whole budgets.
  const int64_t quantum = int64_t{4} * g.page_size;
  const int64_t cap = (max_tokens + quantum - 1) / quantum * quantum;
  const int64_t budget =
      p.budget_tokens != 0 ? p.budget_tokens : std::min<int64_t>(kDefaultBudgetTokens, cap);
  if (budget > cap) {
    return bad(absl::StrFormat(
        "budget_tokens = %d: must be at most %d (max_tokens = %d rounded up to a multiple of "
        "4 × page_size) in this service",
        budget, cap, max_tokens));
  }
  // The protocol's options as SequenceOptions (zero and unset: the defaults), then resolved.
  SequenceOptions given;
  given.mode = p.mode;
  given.max_tokens = static_cast<int32_t>(max_tokens);
  KVTIER_RETURN_IF_ERROR(given.SetBudgetTokens(static_cast<int32_t>(budget), g.page_size));
  given.correction_threshold = p.correction_threshold.value_or(kDefaultCorrectionThreshold);
  if (!p.correction_trigger.empty() &&
      !ParseCorrectionTrigger(p.correction_trigger, &given.correction_trigger)) {
    return bad(absl::StrFormat(
        "retrieval.correction_trigger = '%s': must be one of cosine, mass (empty: cosine)",
        Printable(p.correction_trigger)));
  }
  given.correction_max_loss = p.correction_max_loss.value_or(kDefaultCorrectionMaxLoss);
  SessionSpec spec;
  spec.tenant = caller.tenant;
  spec.label = p.label;
  spec.geometry = g;
  spec.transport = p.transport;
  spec.budget_tokens = static_cast<int32_t>(budget);
  KVTIER_ASSIGN_OR_RETURN(spec.sequence, ResolveSequenceOptions(given, g.page_size));
  const bool selects = p.mode == RetrievalMode::kSpeculative || p.mode == RetrievalMode::kSync;
  PolicyConfig& pc = spec.sequence.policy;
  if (!p.budget_policy.empty()) pc.budget = p.budget_policy;
  if (!p.residency_policy.empty()) pc.residency = p.residency_policy;
  if (!p.host_drop.empty()) pc.host_drop = p.host_drop;
  pc.params = p.policy_params;
  if (absl::Status st = policy::ValidatePolicyConfig(pc); !st.ok()) {
    // The message quotes what the client sent: keep it, minus control characters.
    std::string msg(st.message());
    for (char& ch : msg) {
      if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
    }
    return bad(std::move(msg));
  }
  spec.host_pages = spec.max_pages();
  if (pc.host_drop == "demote") {
    // The session's Retriever moves pages to the cold tier and back: the daemon's own (GRPC),
    // or the engine's through DemotePages and PromotePages (SHM).
    if (!selects) {
      return bad(absl::StrFormat(
          "policy.host_drop = 'demote': mode %s has no host tier (SPECULATIVE or SYNC only)",
          RetrievalModeName(p.mode)));
    }
    const ColdStore* store = ColdStoreOf(caller.tenant);
    if (store == nullptr || store->options().quota_bytes == 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "policy.host_drop = 'demote': tenant '%s' has no cold tier (configure [cold_tier] "
          "and tenant.cold_quota_bytes)",
          caller.tenant));
    }
  } else if (pc.host_drop != "refuse") {
    // A session's stored pages are committed to its region's directory, which a drop would
    // have to take back: not offered until the commit protocol has a decommit.
    return bad(
        "policy.host_drop = 'evict': sessions refuse when the tenant arena is full "
        "(host_drop = refuse) or demote pages to the cold tier (host_drop = demote)");
  }
  if (p.host_tokens != 0) {
    const int64_t host_pages = (int64_t{p.host_tokens} + g.page_size - 1) / g.page_size;
    if (host_pages > spec.max_pages()) {
      return bad(absl::StrFormat("retrieval.host_tokens = %d: must be at most max_tokens = %d",
                                 p.host_tokens, max_tokens));
    }
    if (host_pages < spec.max_pages() && pc.host_drop != "demote") {
      return bad(absl::StrFormat(
          "retrieval.host_tokens = %d is below max_tokens = %d: the pages past it need "
          "policy.host_drop = 'demote'",
          p.host_tokens, max_tokens));
    }
    const SequenceOptions& so = spec.sequence;
    const int64_t need = DemoteFloorPages(g, so);
    const int64_t need_per_layer = (need + g.num_layers - 1) / g.num_layers;
    if (host_pages < need_per_layer) {
      return bad(absl::StrFormat(
          "retrieval.host_tokens = %d: the host tier must hold at least %d tokens per layer "
          "(sink %d + recent %d + 1 pages per layer, and 2 × %d KV heads × %d selected pages "
          "over the %d layers, at page_size %d)",
          p.host_tokens, need_per_layer * g.page_size, so.sink_pages, so.recent_pages,
          g.num_kv_heads, so.selected_pages, g.num_layers, g.page_size));
    }
    spec.host_pages = static_cast<int32_t>(host_pages);
  }
  if (p.label.size() > kMaxLabelBytes) {
    return bad(absl::StrFormat("label: %d bytes, at most %d", p.label.size(), kMaxLabelBytes));
  }
  if (p.request_id.size() > kMaxRequestIdBytes ||
      !std::all_of(p.request_id.begin(), p.request_id.end(),
                   [](char c) { return c >= 0x20 && c <= 0x7e; })) {
    return bad(absl::StrFormat("request_id = '%s': at most %d bytes of printable ASCII",
                               Printable(p.request_id), kMaxRequestIdBytes));
  }
  if (p.transport == Transport::kShm && !config_.shm) {
    return absl::FailedPreconditionError(
        "transport = SHM: this daemon serves no attach socket (server.shm = false); use GRPC");
  }
  return spec;
}

absl::Status SessionManager::ReserveSession(const Tenant& tenant) {
  MutexLock lock(&mu_);
  uint32_t count = opening_[tenant.name()];
  // Cold sessions hold no host memory and do not count.
  for (const auto& [id, e] : sessions_) count += e.session != nullptr && e.tenant == tenant.name();
  if (count >= config_.max_sessions_per_tenant) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("tenant '%s' has %d sessions: max_sessions_per_tenant = %d", tenant.name(),
                        count, config_.max_sessions_per_tenant));
  }
  ++opening_[tenant.name()];
  return absl::OkStatus();
}

absl::StatusOr<SessionRecord> SessionManager::OpenSession(const Caller& caller,
                                                          const OpenSessionParams& params) {
  InflightCall call(this);
  return Tally(caller, DoOpenSession(caller, params));
}

namespace {

// Everything that defines a session but its label, for comparing a retried request.
std::string RequestFingerprint(const OpenSessionParams& p) {
  std::string f = absl::StrFormat(
      "%s|%s|%d|%d|%d|%d|%g|%s|%d|%g|%s|%s|%s|%d", p.geometry.ToString(),
      RetrievalModeName(p.mode), p.budget_tokens, p.max_tokens, p.host_tokens, p.correction_threshold.has_value(),
      p.correction_threshold.value_or(0.0f), p.correction_trigger,
      p.correction_max_loss.has_value(), p.correction_max_loss.value_or(0.0f), p.budget_policy,
      p.residency_policy, p.host_drop, static_cast<int>(p.transport));
  for (const auto& [k, v] : p.policy_params) absl::StrAppend(&f, "|", k, "=", v);
  return f;
}

}  // namespace

absl::StatusOr<std::optional<SessionRecord>> SessionManager::ClaimRequestId(
    const std::string& key, const std::string& fingerprint) {
  std::optional<Entry> existing;
  {
    MutexLock lock(&mu_);
    auto [it, fresh] = requests_.try_emplace(key, RequestEntry{"", fingerprint});
    if (fresh) return std::optional<SessionRecord>();
    if (it->second.session_id.empty()) {
      return absl::AbortedError(
          "an OpenSession with this request_id is in progress; retry when it has answered");
    }
    if (it->second.fingerprint != fingerprint) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "request_id opened session %s with other parameters; a retry must repeat the request "
          "(only the label may differ)",
          it->second.session_id));
    }
    auto s = sessions_.find(it->second.session_id);
    if (s != sessions_.end()) existing = s->second;
  }
  if (!existing.has_value()) return std::optional<SessionRecord>();  // closed meanwhile
  return std::optional<SessionRecord>(existing->Record());
}

absl::StatusOr<SessionRecord> SessionManager::DoOpenSession(const Caller& caller,
                                                            const OpenSessionParams& params) {
  if (draining()) return absl::UnavailableError("kvtierd is draining: no new sessions");
  KVTIER_ASSIGN_OR_RETURN(SessionSpec spec, ResolveSpec(caller, params));
  Tenant* tenant = FindTenant(caller.tenant);
  if (tenant == nullptr) return absl::PermissionDeniedError("unknown tenant");
  const std::string request_key =
      params.request_id.empty() ? "" : absl::StrCat(caller.tenant, "/", params.request_id);
  if (!request_key.empty()) {
    KVTIER_ASSIGN_OR_RETURN(std::optional<SessionRecord> again,
                            ClaimRequestId(request_key, RequestFingerprint(params)));
    if (again.has_value()) return *std::move(again);
  }
  absl::Cleanup unclaim = [&] {
    if (request_key.empty()) return;
    MutexLock lock(&mu_);
    auto it = requests_.find(request_key);
    if (it != requests_.end() && it->second.session_id.empty()) requests_.erase(it);
  };
  KVTIER_RETURN_IF_ERROR(caller.CheckLive("OpenSession"));
  KVTIER_RETURN_IF_ERROR(ReserveSession(*tenant));
  absl::Cleanup unreserve = [&] {
    MutexLock lock(&mu_);
    --opening_[tenant->name()];
  };
  const Geometry& g = spec.geometry;
  KVTIER_ASSIGN_OR_RETURN(RegionLayout layout,
                          ComputeRegionLayout(g, spec.max_pages(), spec.host_slots()));
  KVTIER_ASSIGN_OR_RETURN(RegionLease lease,
                          AllocateRegion(*tenant, layout.total_bytes, ColdDeadline(caller)));
  std::string id = NewSessionId();
  // host_drop = demote: the session's pages past its host tier go to the tenant's cold store.
  ColdStore* demote_to = spec.demotes_pages() ? ColdStoreOf(spec.tenant) : nullptr;
  KVTIER_ASSIGN_OR_RETURN(
      std::shared_ptr<TenantSession> session,
      TenantSession::Create(id, std::move(spec), std::move(lease), backend_.get(), tenant,
                            demote_to, config_.cold_tier.operation_timeout));
  // The point of no return is the table below: a caller that is no longer live gets no
  // session, and the one made for it goes away with this reference.
  if (absl::Status live = caller.CheckLive("OpenSession"); !live.ok()) {
    (void)session->Close();
    return absl::Status(live.code(),
                        absl::StrCat(live.message(), "; the session it made was closed again"));
  }
  std::move(unreserve).Cancel();
  std::move(unclaim).Cancel();
  {
    MutexLock lock(&mu_);
    --opening_[tenant->name()];
    Entry e;
    e.seq = next_seq_++;
    e.tenant = tenant->name();
    e.session = session;
    e.request_key = request_key;
    e.params = params;
    sessions_.emplace(id, std::move(e));
    if (!request_key.empty()) requests_[request_key].session_id = id;
  }
  session_events_.Add({"opened", caller.tenant, std::string(TransportName(params.transport))});
  SaveSessionTable(caller.tenant);
  SessionRecord r = session->Record();
  LogLimited(spdlog::level::info, "session opened",
             "session {} opened: tenant '{}', {} {}, {} {} tokens per layer, budget {}, "
             "region {} bytes at {}",
             id, r.spec.tenant, r.spec.geometry.ToString(), RetrievalModeName(r.spec.sequence.mode),
             r.spec.transport == Transport::kGrpc ? "GRPC" : "SHM", r.spec.sequence.max_tokens,
             r.spec.budget_tokens, r.region_bytes, r.region_offset);
  return r;
}

// ---- the other calls ----------------------------------------------------------------------

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

absl::StatusOr<StepResult> SessionManager::Step(const Caller& caller, std::string_view session_id,
                                                int64_t layer, std::string_view q, bool want_output,
                                                uint64_t step) {
  InflightCall call(this);
  return Tally(caller, DoStep(caller, session_id, layer, q, want_output, step));
}

absl::StatusOr<StepResult> SessionManager::DoStep(const Caller& caller, std::string_view session_id,
                                                  int64_t layer, std::string_view q,
                                                  bool want_output, uint64_t step) {
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<TenantSession> s, Find(caller, session_id));
  const Geometry& g = s->spec().geometry;
  if (s->spec().transport != Transport::kGrpc) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s uses SHM: steps run in the engine (Step is for GRPC sessions)", s->id()));
  }
  if (layer < 0 || layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer = %d: must be < num_layers = %d", layer, g.num_layers));
  }
  const size_t q_bytes = static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes();
  if (q.size() != q_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "q: %d bytes; expected %d (num_q_heads %d × head_dim %d × %d-byte %s)", q.size(), q_bytes,
        g.num_q_heads, g.head_dim, g.element_bytes(), DTypeName(g.dtype)));
  }
  return s->Step(static_cast<int32_t>(layer), q, want_output, step, caller);
}

absl::StatusOr<StatsReport> SessionManager::GetStats(const Caller& caller,
                                                     std::string_view session_id) {
  InflightCall call(this);
  Tenant* t = FindTenant(caller.tenant);
  if (t == nullptr) return absl::PermissionDeniedError("unknown tenant");
  StatsReport r;
  if (!session_id.empty()) {
    absl::StatusOr<Entry> e = Peek(caller, session_id);
    if (!e.ok()) return Tally(caller, e.status());
    if (e->session == nullptr) {
      // Cold: what its record says; nothing runs for it.
      SessionStatsRecord cold;
      cold.session_id = std::string(session_id);
      for (uint64_t tokens : e->cold->Record().committed_tokens) {
        cold.committed_pages += tokens / static_cast<uint64_t>(e->cold->spec.geometry.page_size);
      }
      r.session = std::move(cold);
    } else {
      absl::StatusOr<SessionStatsRecord> ss = e->session->Stats();
      if (!ss.ok()) return Tally(caller, ss.status());
      r.session = *std::move(ss);
    }
  }
  r.tenant.tenant = t->name();
  r.tenant.quota_bytes = t->quota_bytes();
  r.tenant.used_bytes = t->used_bytes();
  r.tenant.refused_requests = t->refused_requests();
  MutexLock lock(&mu_);
  for (const auto& [id, e] : sessions_) r.tenant.sessions += e.tenant == t->name();
  return r;
}

absl::StatusOr<DrainResult> SessionManager::Drain(std::string_view token, absl::Duration timeout) {
  if (config_.admin_token.empty()) {
    return absl::PermissionDeniedError(
        "Drain: the daemon has no server.admin_token configured, so Drain is refused");
  }
  if (!TokensEqual(token, config_.admin_token)) {
    return absl::PermissionDeniedError("Drain: x-kvtier-token is not the admin token");
  }
  StartDrain();
  DrainResult r;
  MutexLock lock(&mu_);
  r.drained = idle_.AwaitWithTimeout(
      &mu_,
      [this] {
        mu_.AssertHeld();
        return inflight_ == 0;
      },
      timeout);
  r.open_sessions = static_cast<uint32_t>(sessions_.size());
  r.inflight_calls = inflight_;
  return r;
}

void SessionManager::StartDrain() {
  if (!draining_.exchange(true, std::memory_order_acq_rel)) {
    spdlog::info("draining: new sessions and attaches are refused from now on");
    std::function<void()> listener;
    {
      MutexLock lock(&mu_);
      listener = drain_listener_;
    }
    if (listener) listener();
  }
}

void SessionManager::set_drain_listener(std::function<void()> listener) {
  MutexLock lock(&mu_);
  drain_listener_ = std::move(listener);
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

// ---- Fetch --------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<FetchCursor>> SessionManager::StartFetch(
    const Caller& caller, std::string_view session_id, int64_t layer, std::vector<int64_t> pages) {
  return Tally(caller, DoStartFetch(caller, session_id, layer, std::move(pages)));
}

absl::StatusOr<std::unique_ptr<FetchCursor>> SessionManager::DoStartFetch(
    const Caller& caller, std::string_view session_id, int64_t layer, std::vector<int64_t> pages) {
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<TenantSession> s, Find(caller, session_id));
  const int32_t num_layers = s->spec().geometry.num_layers;
  if (layer < 0 || layer >= num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer = %d: must be < num_layers = %d", layer, num_layers));
  }
  const int32_t l = static_cast<int32_t>(layer);
  // A page named twice is sent once: a request cannot make the daemon copy more pages than
  // the layer has.
  absl::flat_hash_set<int64_t> seen;
  pages.erase(std::remove_if(pages.begin(), pages.end(),
                             [&seen](int64_t p) { return !seen.insert(p).second; }),
              pages.end());
  KVTIER_ASSIGN_OR_RETURN(std::vector<int64_t> committed, s->CommittedPages(l, pages));
  return std::unique_ptr<FetchCursor>(
      new FetchCursor(this, std::move(s), l, std::move(committed), caller.deadline));
}

FetchCursor::FetchCursor(SessionManager* manager, std::shared_ptr<TenantSession> session,
                         int32_t layer, std::vector<int64_t> pages, absl::Time deadline)
    : manager_(manager),
      inflight_(manager),
      session_(std::move(session)),
      layer_(layer),
      pages_(std::move(pages)),
      deadline_(deadline) {}

absl::StatusOr<std::vector<PageData>> FetchCursor::Next(uint64_t max_message_bytes) {
  if (done()) return std::vector<PageData>();
  const uint64_t per_page =
      session_->spec().geometry.host_page_bytes() + SessionManager::kPageOverheadBytes;
  if (per_page > max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "Fetch: one page takes %d bytes in a message (%d of data) but max_message_bytes = %d",
        per_page, session_->spec().geometry.host_page_bytes(), max_message_bytes));
  }
  const size_t n = std::min<size_t>(pages_.size() - next_, max_message_bytes / per_page);
  KVTIER_ASSIGN_OR_RETURN(std::vector<PageData> out,
                          session_->ReadPages(layer_, pages_.data() + next_, n, deadline_));
  next_ += n;
  manager_->fetched_pages_.Add({session_->tenant()}, out.size());
  return out;
}

// ---- Offload ------------------------------------------------------------------------------

std::unique_ptr<OffloadStream> SessionManager::NewOffloadStream(const Caller& caller) {
  return std::unique_ptr<OffloadStream>(new OffloadStream(this, caller));
}

OffloadStream::OffloadStream(SessionManager* manager, Caller caller)
    : manager_(manager), caller_(std::move(caller)), inflight_(manager) {}

OffloadStream::~OffloadStream() { Discard(); }

absl::Status OffloadStream::Bind(std::string_view session_id) {
  KVTIER_ASSIGN_OR_RETURN(session_, manager_->Find(caller_, session_id));
  if (session_->spec().transport != Transport::kGrpc) {
    const std::string id = session_->id();
    session_.reset();
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s uses SHM: its engine writes pages into the arena (Offload is for GRPC "
        "sessions)",
        id));
  }
  staged_tokens_.assign(session_->spec().geometry.num_layers, 0);
  return absl::OkStatus();
}

absl::Status OffloadStream::Validate(const OffloadChunk& c) const {
  const SessionSpec& spec = session_->spec();
  const Geometry& g = spec.geometry;
  if (c.session_id != session_->id()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session_id = '%s': this stream is about session %s; every message must name it",
        Printable(c.session_id), session_->id()));
  }
  if (c.layer < 0 || c.layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer = %d: must be < num_layers = %d", c.layer, g.num_layers));
  }
  const uint32_t max_tokens = manager_->config_.max_tokens_per_offload;
  if (c.num_tokens < 1 || c.num_tokens > max_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_tokens = %d: must be in [1, max_tokens_per_offload = %d]", c.num_tokens, max_tokens));
  }
  const uint64_t bytes =
      static_cast<uint64_t>(c.num_tokens) * g.num_kv_heads * g.head_dim * g.element_bytes();
  for (const auto& [name, data] : {std::pair<const char*, const std::string*>{"k", &c.k},
                                   std::pair<const char*, const std::string*>{"v", &c.v}}) {
    if (data->size() != bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %d bytes; num_tokens = %d needs %d (num_tokens × num_kv_heads %d × head_dim %d × "
          "%d-byte %s)",
          name, data->size(), c.num_tokens, bytes, g.num_kv_heads, g.head_dim, g.element_bytes(),
          DTypeName(g.dtype)));
    }
  }
  const int32_t l = static_cast<int32_t>(c.layer);
  const uint64_t end = session_->LayerTokens(l) + staged_tokens_[l];
  if (c.start_token.has_value() && *c.start_token != end) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "start_token = %d: layer %d ends at token %d (%d held, %d staged by this stream); a "
        "chunk must start there",
        *c.start_token, l, end, session_->LayerTokens(l), staged_tokens_[l]));
  }
  if (end + c.num_tokens > static_cast<uint64_t>(spec.sequence.max_tokens)) {
    return absl::OutOfRangeError(
        absl::StrFormat("layer %d would hold %d tokens: the session's max_tokens is %d", l,
                        end + c.num_tokens, spec.sequence.max_tokens));
  }
  return absl::OkStatus();
}

void OffloadStream::Discard() {
  staged_.clear();
  std::fill(staged_tokens_.begin(), staged_tokens_.end(), 0);
  if (staged_bytes_ > 0) {
    if (Tenant* t = manager_->FindTenant(caller_.tenant); t != nullptr) t->Release(staged_bytes_);
    staged_bytes_ = 0;
  }
}

absl::Status OffloadStream::ApplyStaged() {
  commit_due_ = false;
  if (staged_.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<uint64_t>> tokens =
      session_->Apply(staged_, caller_, absl::StrFormat("the commit at message %d", messages_));
  if (!tokens.ok()) return tokens.status();
  result_.layer_tokens = *std::move(tokens);
  for (int64_t n : staged_tokens_) result_.committed_tokens += static_cast<uint64_t>(n);
  Discard();  // applied: the Retriever holds the tokens now, and the bytes go back
  return absl::OkStatus();
}

absl::Status OffloadStream::Fail(const absl::Status& st, std::string_view where) {
  uint64_t staged = 0;
  for (int64_t n : staged_tokens_) staged += static_cast<uint64_t>(n);
  Discard();
  failed_ = absl::Status(
      st.code(), absl::StrFormat("Offload %s: %s (this stream's commits before it, %d tokens, "
                                 "stand; its %d uncommitted tokens were discarded)",
                                 where, st.message(), result_.committed_tokens, staged));
  st.ForEachPayload([this](absl::string_view url, const absl::Cord& payload) {
    failed_.SetPayload(url, payload);
  });
  (void)manager_->Tally(caller_, failed_);
  return failed_;
}

absl::Status OffloadStream::Add(OffloadChunk chunk) {
  if (!failed_.ok()) return failed_;
  ++messages_;
  absl::Status st = [&]() -> absl::Status {
    if (session_ == nullptr) KVTIER_RETURN_IF_ERROR(Bind(chunk.session_id));
    KVTIER_RETURN_IF_ERROR(Validate(chunk));
    const uint64_t bytes = chunk.k.size() + chunk.v.size();
    Tenant* tenant = manager_->FindTenant(caller_.tenant);
    if (tenant == nullptr) return absl::PermissionDeniedError("unknown tenant");
    KVTIER_RETURN_IF_ERROR(tenant->Charge(bytes));
    staged_bytes_ += bytes;
    staged_tokens_[chunk.layer] += chunk.num_tokens;
    commit_due_ = chunk.commit;
    staged_.push_back(std::move(chunk));
    return absl::OkStatus();
  }();
  return st.ok() ? st : Fail(st, absl::StrFormat("message %d", messages_));
}

absl::Status OffloadStream::Commit() {
  if (!failed_.ok()) return failed_;
  absl::Status st = ApplyStaged();
  return st.ok() ? st : Fail(st, absl::StrFormat("message %d", messages_));
}

absl::StatusOr<OffloadResult> OffloadStream::Finish() {
  if (!failed_.ok()) return failed_;
  if (absl::Status st = ApplyStaged(); !st.ok()) {
    return Fail(st, absl::StrFormat("stream end (after message %d)", messages_));
  }
  if (session_ != nullptr && result_.layer_tokens.empty()) {
    for (int32_t l = 0; l < session_->spec().geometry.num_layers; ++l) {
      result_.layer_tokens.push_back(session_->LayerTokens(l));
    }
  }
  return result_;
}

absl::Status OffloadStream::Break(const absl::Status& why, bool at_next_message) {
  if (!failed_.ok()) return failed_;
  return Fail(why, at_next_message ? absl::StrFormat("message %d", messages_ + 1)
                                   : absl::StrFormat("stream (after message %d)", messages_));
}

// ---- metrics ------------------------------------------------------------------------------

void SessionManager::WriteMetrics(Exposition& out) const {
  std::vector<std::string> tenant_names;
  for (const auto& [name, t] : tenants_) tenant_names.push_back(name);
  std::sort(tenant_names.begin(), tenant_names.end());
  std::vector<std::pair<uint64_t, std::shared_ptr<TenantSession>>> open;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, e] : sessions_) {
      if (e.session != nullptr) open.emplace_back(e.seq, e.session);
    }
  }
  std::sort(open.begin(), open.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  constexpr std::string_view kTransports[] = {"shm", "grpc"};
  const auto per_tenant = [&](std::string_view name, std::string_view type, std::string_view help,
                              auto value) {
    out.Family(name, type, help);
    for (const std::string& t : tenant_names) {
      out.Sample(name, {{"tenant", t}}, static_cast<double>(value(*tenants_.at(t))));
    }
  };

  // Tenants and their arenas.
  per_tenant("kvtier_tenant_quota_bytes", "gauge", "The tenant's host memory (its arena).",
             [](const Tenant& t) { return t.quota_bytes(); });
  per_tenant("kvtier_tenant_used_bytes", "gauge",
             "Host memory in use: session regions plus the daemon memory of GRPC sessions.",
             [](const Tenant& t) { return t.used_bytes(); });
  per_tenant("kvtier_tenant_daemon_bytes", "gauge",
             "Daemon memory of the tenant's GRPC sessions (part of used_bytes).",
             [](const Tenant& t) { return t.charged_bytes(); });
  per_tenant("kvtier_tenant_refused_requests_total", "counter",
             "Requests of the tenant's callers that ended in an error.",
             [](const Tenant& t) { return t.refused_requests(); });
  absl::flat_hash_map<std::string, uint32_t> calls;
  {
    MutexLock lock(&mu_);
    calls = tenant_calls_;
  }
  out.Family("kvtier_tenant_calls_in_flight", "gauge",
             "Calls of the tenant's callers in progress (streams while open); at "
             "limits.max_inflight_calls_per_tenant more are refused.");
  for (const std::string& t : tenant_names) {
    auto it = calls.find(t);
    out.Sample("kvtier_tenant_calls_in_flight", {{"tenant", t}},
               it == calls.end() ? 0.0 : static_cast<double>(it->second));
  }
  out.Family("kvtier_tenant_sessions", "gauge", "Open sessions, by transport.");
  for (const std::string& t : tenant_names) {
    for (std::string_view tr : kTransports) {
      int64_t n = 0;
      for (const auto& [seq, s] : open) {
        n += s->tenant() == t && TransportName(s->spec().transport) == tr;
      }
      out.Sample("kvtier_tenant_sessions", {{"tenant", t}, {"transport", tr}},
                 static_cast<double>(n));
    }
  }
  per_tenant("kvtier_arena_bytes", "gauge", "Bytes mapped for the tenant's arena.",
             [](const Tenant& t) { return t.arena().report().mapped_bytes; });
  per_tenant("kvtier_arena_hugepage_bytes", "gauge",
             "Page size of the arena's hugetlb pages; 0 when it has none.",
             [](const Tenant& t) {
               const ArenaReport& r = t.arena().report();
               return r.hugetlb ? r.page_bytes : size_t{0};
             });
  per_tenant("kvtier_arena_transparent_hugepages", "gauge",
             "1 when the arena's normal pages are advised as transparent hugepages.",
             [](const Tenant& t) { return t.arena().report().transparent_hugepages ? 1 : 0; });
  per_tenant("kvtier_arena_numa_node", "gauge",
             "NUMA node the arena is bound to; -1 when it is not bound.", [](const Tenant& t) {
               const ArenaReport& r = t.arena().report();
               return r.numa_policy == NumaPolicy::kNone ? -1 : r.numa_node;
             });
  per_tenant("kvtier_arena_locked", "gauge", "1 when the arena is locked in memory (mlock).",
             [](const Tenant& t) { return t.arena().report().locked ? 1 : 0; });
  per_tenant("kvtier_arena_persistent", "gauge",
             "1 when the arena is a file (tenant.arena_path) whose sessions outlive the daemon.",
             [](const Tenant& t) { return t.arena().report().path.empty() ? 0 : 1; });

  // Session events and fetched pages: every tenant and transport, zeros included, so rates
  // start from the first scrape.
  const std::map<std::vector<std::string>, uint64_t> events = session_events_.Snapshot();
  const std::pair<const char*, const char*> kEvents[] = {
      {"opened", "Sessions opened."},
      {"closed", "Sessions closed (by CloseSession or at shutdown)."},
      {"reattached", "Sessions taken over by Reattach."},
      {"suspended", "Sessions suspended by SuspendSession."},
      {"demoted", "Sessions moved to the cold tier (arena full, or shutdown)."},
      {"promoted", "Sessions brought back from the cold tier."}};
  for (const auto& [event, help] : kEvents) {
    const std::string name = absl::StrCat("kvtier_sessions_", event, "_total");
    out.Family(name, "counter", help);
    for (const std::string& t : tenant_names) {
      for (std::string_view tr : kTransports) {
        auto it = events.find({event, t, std::string(tr)});
        out.Sample(name, {{"tenant", t}, {"transport", tr}},
                   it == events.end() ? 0.0 : static_cast<double>(it->second));
      }
    }
  }
  const std::map<std::vector<std::string>, uint64_t> fetched = fetched_pages_.Snapshot();
  out.Family("kvtier_pages_fetched_total", "counter", "Committed pages sent by Fetch.");
  for (const std::string& t : tenant_names) {
    auto it = fetched.find({t});
    out.Sample("kvtier_pages_fetched_total", {{"tenant", t}},
               it == fetched.end() ? 0.0 : static_cast<double>(it->second));
  }

  WriteColdMetrics(out, tenant_names);

  // Open sessions: the directory and the telemetry block, read now.
  struct Row {
    std::string tenant, id, transport;
    const TenantSession* session;
    std::optional<TelemetryValues> t;
  };
  std::vector<Row> rows;
  for (const auto& [seq, s] : open) {
    rows.push_back({s->tenant(), s->id(), std::string(TransportName(s->spec().transport)),
                    s.get(), s->Telemetry()});
  }
  out.Family("kvtier_session_info", "gauge",
             "1 per open session, its shape and retrieval mode in the labels.");
  for (const Row& r : rows) {
    const SessionSpec& spec = r.session->spec();
    const std::string layers = absl::StrCat(spec.geometry.num_layers);
    const std::string kv_heads = absl::StrCat(spec.geometry.num_kv_heads);
    const std::string page = absl::StrCat(spec.geometry.page_size);
    const std::string budget = absl::StrCat(spec.budget_tokens);
    const Label labels[] = {{"tenant", r.tenant},
                            {"session", r.id},
                            {"transport", r.transport},
                            {"mode", RetrievalModeName(spec.sequence.mode)},
                            {"dtype", DTypeName(spec.geometry.dtype)},
                            {"layers", layers},
                            {"kv_heads", kv_heads},
                            {"page_size", page},
                            {"budget_tokens", budget},
                            {"label", spec.label}};
    out.Sample("kvtier_session_info", labels, 1);
  }
  const auto session_family = [&](std::string_view name, std::string_view type,
                                   std::string_view help, auto value) {
    out.Family(name, type, help);
    for (const Row& r : rows) {
      const std::optional<double> v = value(r);
      if (!v.has_value()) continue;
      out.Sample(name, {{"tenant", r.tenant}, {"session", r.id}, {"transport", r.transport}}, *v);
    }
  };
  session_family("kvtier_session_committed_pages", "gauge",
                 "(layer, page) pairs committed in the session's region now.",
                 [](const Row& r) -> std::optional<double> {
                   return static_cast<double>(r.session->CommittedPageCount());
                 });
  // The retrieval telemetry (offload/telemetry.h): sessions whose block reads back.
  const auto telemetry = [&](std::string_view name, std::string_view type, std::string_view help,
                             auto field) {
    session_family(name, type, help, [&](const Row& r) -> std::optional<double> {
      if (!r.t.has_value()) return std::nullopt;
      return static_cast<double>(field(*r.t));
    });
  };
  telemetry("kvtier_session_pages_committed_total", "counter",
            "(layer, page) pairs the session's writer committed.",
            [](const TelemetryValues& t) { return t.pages_committed; });
  telemetry("kvtier_retrieval_steps_total", "counter", "Layer-steps begun (BeginStep calls).",
            [](const TelemetryValues& t) { return t.steps; });
  telemetry("kvtier_retrieval_appended_tokens_total", "counter",
            "Tokens appended, per layer, summed over layers.",
            [](const TelemetryValues& t) { return t.appended_tokens; });
  telemetry("kvtier_retrieval_recalled_pages_total", "counter",
            "Head-pages recalled from the host tier (background and correction).",
            [](const TelemetryValues& t) { return t.recalled_pages; });
  telemetry("kvtier_retrieval_recalled_bytes_total", "counter",
            "K+V bytes of the recalled head-pages.",
            [](const TelemetryValues& t) { return t.recalled_bytes; });
  telemetry("kvtier_retrieval_correction_pages_total", "counter",
            "Head-pages recalled before attention, for corrected heads.",
            [](const TelemetryValues& t) { return t.correction_pages; });
  const auto per_class = [&](std::string_view name, std::string_view help, bool corrected) {
    out.Family(name, "counter", help);
    for (const Row& r : rows) {
      if (!r.t.has_value()) continue;
      for (int c = 0; c < kHeadClasses; ++c) {
        const uint64_t n = corrected ? r.t->corrected_heads[c] : r.t->checked_heads[c];
        out.Sample(name,
                   {{"tenant", r.tenant},
                    {"session", r.id},
                    {"transport", r.transport},
                    {"head_class", kHeadClassNames[c]}},
                   static_cast<double>(n));
      }
    }
  };
  per_class("kvtier_retrieval_checked_heads_total",
            "(layer-step, KV head) pairs checked for query drift, by the depth class of the "
            "layer.",
            false);
  per_class("kvtier_retrieval_corrected_heads_total",
            "Checked heads that were corrected (re-selected and recalled before attention), by "
            "the depth class of the layer.",
            true);
  out.Family("kvtier_retrieval_recall_strategy", "gauge",
             "1 for the recall strategy the session uses (after calibration).");
  for (const Row& r : rows) {
    if (!r.t.has_value() || r.t->recall_strategy == 0 || r.t->recall_strategy > 4) continue;
    const std::string_view name =
        RecallStrategyName(static_cast<RecallStrategy>(r.t->recall_strategy - 1));
    out.Sample("kvtier_retrieval_recall_strategy",
               {{"tenant", r.tenant},
                {"session", r.id},
                {"transport", r.transport},
                {"strategy", name}},
               1);
  }
  telemetry("kvtier_retrieval_host_waits_total", "counter",
            "Blocking host calls (event waits, synchronous copies, allocations) of ended "
            "layer-steps.",
            [](const TelemetryValues& t) { return t.host_waits; });
  telemetry("kvtier_retrieval_host_dropped_pages_total", "counter",
            "Pages dropped for good because the host tier was full (host_drop = evict).",
            [](const TelemetryValues& t) { return t.host_dropped_pages; });
  telemetry("kvtier_retrieval_evicted_head_pages_total", "counter",
            "Head-pages evicted for good by drop-mode policies.",
            [](const TelemetryValues& t) { return t.evicted_head_pages; });
  telemetry("kvtier_retrieval_resident_bytes", "gauge",
            "K+V bytes of the working sets, all layers.",
            [](const TelemetryValues& t) { return t.resident_bytes; });
  telemetry("kvtier_retrieval_resident_head_pages", "gauge",
            "Head-pages in the working sets, all layers.",
            [](const TelemetryValues& t) { return t.resident_head_pages; });
  out.Family("kvtier_retrieval_estimated_mass_recall", "summary",
             "Share of the attention mass the attended selection keeps, as the page summaries "
             "estimate it, per checked head (mass correction trigger only).");
  for (const Row& r : rows) {
    if (!r.t.has_value() || r.t->mass_recall_count == 0) continue;
    const Label labels[] = {{"tenant", r.tenant}, {"session", r.id}, {"transport", r.transport}};
    out.Sample("kvtier_retrieval_estimated_mass_recall_sum", labels,
               static_cast<double>(r.t->mass_recall_micros) * 1e-6);
    out.Sample("kvtier_retrieval_estimated_mass_recall_count", labels,
               static_cast<double>(r.t->mass_recall_count));
  }
  out.Family("kvtier_retrieval_layer_step_duration_seconds", "histogram",
             "Wall time of a layer-step, BeginStep to the end of EndStep (the engine's "
             "attention in between included).");
  for (const Row& r : rows) {
    if (!r.t.has_value()) continue;
    const Label labels[] = {{"tenant", r.tenant}, {"session", r.id}, {"transport", r.transport}};
    out.Histogram("kvtier_retrieval_layer_step_duration_seconds", labels,
                  kLayerStepBucketsSeconds, r.t->step_buckets,
                  static_cast<double>(r.t->step_nanos) * 1e-9);
  }
}

}  // namespace kvtier::daemon

namespace kvtier::daemon {

// ---- the cold tier ------------------------------------------------------------------------

SessionRecord SessionManager::ColdEntry::Record() const {
  SessionRecord r;
  r.id = record.session_id();
  r.spec = spec;
  r.suspended = record.suspended();
  r.cold = true;
  r.epoch = record.epoch();
  r.created_unix_ms = record.created_unix_ms();
  r.committed_tokens.resize(spec.geometry.num_layers, 0);
  for (int32_t l = 0; l < spec.geometry.num_layers && l < record.layers_size(); ++l) {
    r.committed_tokens[l] =
        static_cast<uint64_t>(record.layers(l).generations_size()) * spec.geometry.page_size;
  }
  if (spec.transport == Transport::kGrpc) r.steps_run.assign(spec.geometry.num_layers, 0);
  return r;
}

ColdStore* SessionManager::ColdStoreOf(std::string_view tenant) const {
  auto it = cold_.find(Sv(tenant));
  return it == cold_.end() ? nullptr : it->second.store.get();
}

absl::Time SessionManager::ColdDeadline(const Caller& caller) const {
  return std::min(caller.deadline, absl::Now() + config_.cold_tier.operation_timeout);
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

absl::Status SessionManager::MovePages(const Caller& caller, std::string_view session_id,
                                       bool demote, uint64_t epoch,
                                       const std::vector<TenantSession::PageMove>& pages) {
  InflightCall call(this);
  const char* what = demote ? "DemotePages" : "PromotePages";
  if (pages.empty() || pages.size() > kMaxPagesPerMove) {
    return Tally(caller, absl::InvalidArgumentError(absl::StrFormat(
                             "%s: %d pages; between 1 and %d a call", what, pages.size(),
                             kMaxPagesPerMove)));
  }
  absl::StatusOr<Entry> e = Peek(caller, session_id);
  if (!e.ok()) return Tally(caller, e.status());
  if (e->session == nullptr) {
    return Tally(caller, absl::FailedPreconditionError(absl::StrFormat(
                             "%s: session %s is in the cold tier; Reattach first", what,
                             session_id)));
  }
  if (absl::Status live = caller.CheckLive(what); !live.ok()) return Tally(caller, live);
  return Tally(caller, e->session->MovePages(demote, epoch, pages, caller));
}

std::optional<SessionManager::Entry> SessionManager::EntryOf(const std::string& id) const {
  MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return std::nullopt;
  return it->second;
}

absl::Status SessionManager::Demote(const std::string& id, bool force, absl::Time deadline) {
  std::optional<Entry> first = EntryOf(id);
  if (!first.has_value()) return absl::NotFoundError(absl::StrCat("session ", id));
  MutexLock moving(first->move_mu.get());
  std::optional<Entry> found = EntryOf(id);  // again, now that no other move runs
  if (!found.has_value() || found->session == nullptr) {
    return absl::NotFoundError(absl::StrFormat("session %s is not in the host tier", id));
  }
  const Entry& e = *found;
  ColdStore* store = ColdStoreOf(e.tenant);
  if (store == nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "tenant '%s' has no cold tier (cold_tier.nodes, tenant.cold_quota_bytes)", e.tenant));
  }
  const SessionSpec& spec = e.session->spec();
  v1::ColdSessionRecord record;
  record.set_session_id(id);
  *record.mutable_request() = ResolvedRequest(e.params, spec);
  record.set_created_unix_ms(e.session->Record().created_unix_ms);
  record.set_suspended(e.session->suspended());
  record.set_page_bytes(spec.geometry.host_page_bytes());
  record.set_demoted_unix_ms(absl::ToUnixMillis(absl::Now()));
  uint64_t reserved = 0;
  absl::StatusOr<CloseResult> closed = e.session->Demote(
      [&](const TenantSession::Image& image) -> absl::Status {
        uint64_t pages = 0;
        for (const auto& l : image.layers) pages += l.size();
        const uint64_t bytes = ColdStore::ValueBytes(pages, record.page_bytes());
        KVTIER_RETURN_IF_ERROR(store->Reserve(id, bytes));
        reserved = bytes;
        record.set_epoch(image.epoch);
        absl::Status st = store->Write(record, image.layers, deadline);
        if (!st.ok()) {
          store->Unreserve(bytes);
          reserved = 0;
        }
        return st;
      },
      force);
  if (!closed.ok()) return closed.status();
  const std::string transport(TransportName(spec.transport));
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it != sessions_.end()) {
      it->second.session = nullptr;
      it->second.cold = std::make_shared<const ColdEntry>(ColdEntry{std::move(record), spec});
    }
  }
  SaveSessionTable(e.tenant);
  session_events_.Add({"demoted", e.tenant, transport});
  LogLimited(spdlog::level::info, "session demoted",
             "session {} demoted to the cold tier: {} pages, {} bytes, {} bytes of host memory "
             "freed",
             id, closed->committed_pages, reserved, closed->freed_bytes);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<TenantSession>> SessionManager::Promote(const std::string& id,
                                                                       absl::Time deadline) {
  std::optional<Entry> first = EntryOf(id);
  if (!first.has_value()) return absl::NotFoundError(absl::StrCat("session ", id));
  MutexLock moving(first->move_mu.get());
  std::optional<Entry> found = EntryOf(id);  // again, now that no other move runs
  if (!found.has_value()) {
    return absl::NotFoundError(absl::StrFormat("session %s was closed meanwhile", id));
  }
  const Entry& e = *found;
  if (e.session != nullptr) return e.session;  // another call promoted it meanwhile
  ColdStore* store = ColdStoreOf(e.tenant);
  Tenant* tenant = FindTenant(e.tenant);
  if (store == nullptr || tenant == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrFormat("session %s is in the cold tier, which tenant '%s' no longer has", id,
                        e.tenant));
  }
  const ColdEntry& cold = *e.cold;
  const Geometry& g = cold.spec.geometry;
  KVTIER_ASSIGN_OR_RETURN(RegionLayout layout,
                          ComputeRegionLayout(g, cold.spec.max_pages(), cold.spec.host_slots()));
  KVTIER_ASSIGN_OR_RETURN(RegionLease lease, AllocateRegion(*tenant, layout.total_bytes, deadline));
  absl::StatusOr<std::shared_ptr<TenantSession>> s = TenantSession::Restore(
      id, cold.spec, std::move(lease), backend_.get(), tenant, cold.record.created_unix_ms(),
      cold.record.epoch(), cold.record.suspended(),
      [&](int32_t layer) { return store->ReadLayer(cold.record, layer, deadline); },
      cold.spec.demotes_pages() ? store : nullptr, config_.cold_tier.operation_timeout);
  if (!s.ok()) {
    spdlog::log(absl::IsDataLoss(s.status()) ? spdlog::level::err : spdlog::level::warn,
                "session {}: promotion from the cold tier failed, it stays there: {}", id,
                s.status().ToString());
    return absl::Status(s.status().code(),
                        absl::StrFormat("bringing session %s back from the cold tier: %s", id,
                                        s.status().message()));
  }
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it != sessions_.end()) {
      it->second.session = *s;
      it->second.cold = nullptr;
      it->second.suspended_at = (*s)->suspended() ? absl::Now() : absl::InfiniteFuture();
    }
  }
  SaveSessionTable(e.tenant);
  store->CountPromoted(cold.record);
  session_events_.Add({"promoted", e.tenant, std::string(TransportName(cold.spec.transport))});
  // Its pages are in the host tier again: the cold copy goes (a failure only leaves keys).
  (void)store->Remove(cold.record, deadline);
  LogLimited(spdlog::level::info, "session promoted",
             "session {} promoted from the cold tier: {} bytes per page, epoch {}", id,
             cold.record.page_bytes(), (*s)->Record().epoch);
  return s;
}

absl::StatusOr<RegionLease> SessionManager::AllocateRegion(Tenant& tenant, uint64_t bytes,
                                                           absl::Time deadline) {
  absl::StatusOr<RegionLease> lease = tenant.AllocateRegion(bytes);
  if (lease.ok() || !absl::IsResourceExhausted(lease.status()) ||
      ColdStoreOf(tenant.name()) == nullptr) {
    return lease;
  }
  // The arena is full: demote suspended sessions, least recently suspended first.
  std::vector<std::pair<absl::Time, std::string>> victims;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, e] : sessions_) {
      if (e.tenant == tenant.name() && e.session != nullptr && e.session->suspended()) {
        victims.emplace_back(e.suspended_at, id);
      }
    }
  }
  std::sort(victims.begin(), victims.end());
  absl::Status why = lease.status();
  for (const auto& [at, id] : victims) {
    if (absl::Now() >= deadline) break;
    absl::Status st = Demote(id, /*force=*/false, deadline);
    if (!st.ok()) {
      // Demoted by another call, or reattached, meanwhile: no news. Anything else is.
      if (!absl::IsNotFound(st) && !absl::IsFailedPrecondition(st)) {
        LogLimited(spdlog::level::warn, "demotion for room",
                   "tenant '{}': demoting session {} to make room: {}", tenant.name(), id,
                   st.ToString());
        why = st;
      }
      // Another call's demotion may have freed the room already.
      lease = tenant.AllocateRegion(bytes);
      if (lease.ok() || !absl::IsResourceExhausted(lease.status())) return lease;
      continue;
    }
    lease = tenant.AllocateRegion(bytes);
    if (lease.ok() || !absl::IsResourceExhausted(lease.status())) return lease;
  }
  return absl::Status(
      lease.status().code(),
      absl::StrFormat("%s; %s", lease.status().message(),
                      victims.empty()
                          ? "no suspended session could be demoted to the cold tier"
                          : absl::StrFormat("demoting %d suspended sessions did not free enough "
                                            "(last: %s)",
                                            victims.size(), why.message())));
}

absl::StatusOr<CloseResult> SessionManager::CloseCold(const Caller& caller, const Entry& entry) {
  MutexLock moving(entry.move_mu.get());
  const std::string& id = entry.cold->record.session_id();
  std::shared_ptr<const ColdEntry> cold;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end() || it->second.cold == nullptr) {
      return absl::NotFoundError(
          absl::StrFormat("session %s was closed or brought back meanwhile; retry", id));
    }
    cold = it->second.cold;
    if (!it->second.request_key.empty()) requests_.erase(it->second.request_key);
    sessions_.erase(it);
  }
  CloseResult r;
  for (const v1::ColdLayer& l : cold->record.layers()) {
    r.committed_pages += static_cast<uint64_t>(l.generations_size());
  }
  if (ColdStore* store = ColdStoreOf(entry.tenant); store != nullptr) {
    (void)store->Remove(cold->record, ColdDeadline(caller));
  }
  session_events_.Add({"closed", entry.tenant, std::string(TransportName(cold->spec.transport))});
  LogLimited(spdlog::level::info, "session closed",
             "session {} closed in the cold tier: {} committed pages", id, r.committed_pages);
  return r;
}

void SessionManager::WriteColdMetrics(Exposition& out,
                                      const std::vector<std::string>& tenant_names) const {
  if (cold_.empty()) return;
  struct ColdRow {
    std::string tenant;
    ColdStoreStats s;
    ColdTierStats t;
    uint64_t quota;
  };
  std::vector<ColdRow> rows;
  int64_t redirects = cluster_ != nullptr ? cluster_->redirects() : 0;
  int64_t refreshes = cluster_ != nullptr ? cluster_->slot_map_refreshes() : 0;
  for (const std::string& name : tenant_names) {
    auto it = cold_.find(name);
    if (it == cold_.end()) continue;
    rows.push_back({name, it->second.store->stats(), it->second.tier->stats(),
                    it->second.store->options().quota_bytes});
    if (it->second.own_cluster != nullptr) {
      redirects += it->second.own_cluster->redirects();
      refreshes += it->second.own_cluster->slot_map_refreshes();
    }
  }
  const auto family = [&](std::string_view name, std::string_view type, std::string_view help,
                          auto value) {
    out.Family(name, type, help);
    for (const ColdRow& r : rows) {
      out.Sample(name, {{"tenant", r.tenant}}, static_cast<double>(value(r)));
    }
  };
  const auto both_ways = [&](std::string_view name, std::string_view help, auto demoted,
                             auto promoted) {
    out.Family(name, "counter", help);
    for (const ColdRow& r : rows) {
      out.Sample(name, {{"tenant", r.tenant}, {"direction", "demoted"}},
                 static_cast<double>(demoted(r)));
      out.Sample(name, {{"tenant", r.tenant}, {"direction", "promoted"}},
                 static_cast<double>(promoted(r)));
    }
  };
  family("kvtier_cold_quota_bytes", "gauge", "The tenant's cold quota (tenant.cold_quota_bytes).",
         [](const ColdRow& r) { return r.quota; });
  family("kvtier_cold_used_bytes", "gauge",
         "Bytes of the tenant's sessions in the cold tier (values with their headers).",
         [](const ColdRow& r) { return r.s.used_bytes; });
  family("kvtier_cold_sessions", "gauge", "The tenant's sessions in the cold tier.",
         [](const ColdRow& r) { return r.s.sessions; });
  both_ways("kvtier_cold_sessions_moved_total", "Sessions demoted to / promoted from the cold tier.",
            [](const ColdRow& r) { return r.s.demoted_sessions; },
            [](const ColdRow& r) { return r.s.promoted_sessions; });
  both_ways("kvtier_cold_pages_total", "Pages demoted to / promoted from the cold tier.",
            [](const ColdRow& r) { return r.s.demoted_pages; },
            [](const ColdRow& r) { return r.s.promoted_pages; });
  both_ways("kvtier_cold_live_pages_total",
            "Pages of live sessions (policy.host_drop = demote) demoted to / promoted from the "
            "cold tier, one by one.",
            [](const ColdRow& r) { return r.s.live_demoted_pages; },
            [](const ColdRow& r) { return r.s.live_promoted_pages; });
  both_ways("kvtier_cold_bytes_total",
            "Page bytes demoted to / promoted from the cold tier (whole sessions and live "
            "sessions' pages).",
            [](const ColdRow& r) { return r.s.demoted_bytes; },
            [](const ColdRow& r) { return r.s.promoted_bytes; });
  family("kvtier_cold_failures_total", "counter",
         "Demotions, promotions and removals that failed (the session stayed where it was).",
         [](const ColdRow& r) { return r.s.failures; });
  family("kvtier_cold_data_loss_total", "counter",
         "Promotions refused because a page had no intact copy (DATA_LOSS).",
         [](const ColdRow& r) { return r.s.data_loss; });
  family("kvtier_cold_checksum_failures_total", "counter",
         "Values that failed their checksum on their master.",
         [](const ColdRow& r) { return r.t.checksum_failures; });
  family("kvtier_cold_replica_recoveries_total", "counter",
         "Values that failed their checksum on the master and read back intact from a replica.",
         [](const ColdRow& r) { return r.t.replica_recoveries; });
  out.Family("kvtier_redis_redirects_total", "counter",
             "MOVED and ASK redirections the cold tier's cluster client followed.");
  out.Sample("kvtier_redis_redirects_total", {}, static_cast<double>(redirects));
  out.Family("kvtier_redis_slot_map_refreshes_total", "counter",
             "Slot map reloads (CLUSTER SLOTS) of the cold tier's cluster client.");
  out.Sample("kvtier_redis_slot_map_refreshes_total", {}, static_cast<double>(refreshes));
}

size_t SessionManager::PersistAllSessions(absl::Time deadline) {
  struct Hot {
    std::string id, tenant;
    absl::Status status;
  };
  std::vector<Hot> hot;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, e] : sessions_) {
      // A persistent arena keeps its sessions itself.
      if (e.session != nullptr && ColdStoreOf(e.tenant) != nullptr && !Persistent(e.tenant)) {
        hot.push_back({id, e.tenant, absl::OkStatus()});
      }
    }
  }
  if (hot.empty()) return 0;
  // Each session on its own: a node that is slow or paused holds up only the sessions with
  // keys on it, and only for their share of the deadline. A session starting with r sessions
  // (itself included) still to start gets (time left) * workers / r, so every session gets at
  // least (deadline - start) * workers / sessions even when each uses all of its share; one
  // that finishes early leaves its time to the later ones.
  const size_t workers = std::min(hot.size(), kPersistParallelism);
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= hot.size()) return;
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        hot[i].status = absl::DeadlineExceededError(
            "the shutdown deadline (cold_tier.operation_timeout_ms) passed before its turn");
        continue;
      }
      const size_t to_start = hot.size() - i;
      const absl::Duration share =
          (deadline - now) * static_cast<double>(workers) / static_cast<double>(to_start);
      hot[i].status = Demote(hot[i].id, /*force=*/true, std::min(deadline, now + share));
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (size_t t = 1; t < workers; ++t) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
  size_t demoted = 0;
  for (const Hot& h : hot) {
    if (h.status.ok()) {
      ++demoted;
    } else {
      spdlog::warn("shutdown: session {} of tenant '{}' was not persisted; it stays in the host "
                   "tier and is lost: {}",
                   h.id, h.tenant, h.status.ToString());
    }
  }
  spdlog::info("shutdown: {} of {} sessions demoted to the cold tier", demoted, hot.size());
  return demoted;
}

}  // namespace kvtier::daemon
