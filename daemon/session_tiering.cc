// SessionManager's cold tier (docs/service.md#the-cold-tier): connecting it and taking up
// its sessions at start (StartColdTier), demoting whole sessions to it and promoting them
// back (Demote, Promote), demoting suspended sessions for room (AllocateRegion) or after
// cold_tier.demote_suspended_after (DemoteSuspendedLoop), closing a cold session
// (CloseCold), and DemotePages / PromotePages of a live session (MovePages).
#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "daemon/logging.h"
#include "daemon/page_mover.h"
#include "daemon/session_manager.h"
#include "daemon/session_manager_internal.h"
#include "daemon/session_params.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

using session_internal::Sv;

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
  if (e.stale_record != nullptr) {
    // What an earlier failed demotion left listed goes first (its pages with it, once the
    // index and the record are gone): this demotion writes the same keys anew, and one that
    // failed would remove pages the record names. So while it cannot go, nothing is demoted.
    if (absl::Status st = store->Remove(*e.stale_record, deadline, /*keep_if_listed=*/true);
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrFormat("session %s: the record an earlier demotion left in the "
                                          "cold tier could not be removed: %s",
                                          id, st.message()));
    }
    SetStaleRecord(id, nullptr);
  }
  const SessionSpec& spec = e.session->spec();
  v1::ColdSessionRecord record;
  record.set_session_id(id);
  *record.mutable_request() = ResolvedRequest(e.params, spec);
  record.set_created_unix_ms(e.session->Record().created_unix_ms);
  record.set_suspended(e.session->suspended());
  record.set_page_bytes(spec.geometry.host_page_bytes());
  record.set_demoted_unix_ms(absl::ToUnixMillis(absl::Now()));
  // Pages the session demoted itself stay under its live keys, charged, until it is closed as
  // demoted: this move may pass the quota by their charge (PageMover::SetOverdraft).
  const uint64_t live = e.session->LiveColdBytes();
  // The record's own charge first; the mover charges each page as it stores it.
  KVTIER_RETURN_IF_ERROR(store->Reserve(id, ColdStore::kSessionOverheadBytes, live));
  // Every page through the one mover, under the session's own keys (those its record names).
  PageMover mover(store, PageMoverOptions{id, record.page_bytes(),
                                          config_.cold_tier.operation_timeout, /*live=*/false});
  mover.SetOverdraft(live);
  bool left_listed = false;
  absl::StatusOr<CloseResult> closed = e.session->Demote(
      mover, deadline, force, [&](const TenantSession::Demoted& d) -> absl::Status {
        record.set_epoch(d.epoch);
        for (const std::vector<uint64_t>& layer : d.generations) {
          v1::ColdLayer* cl = record.add_layers();
          for (uint64_t generation : layer) cl->add_generations(generation);
        }
        return store->WriteRecord(record, deadline, &left_listed);
      });
  if (!closed.ok() && left_listed) {
    // The record may still be listed, and a restart would take the session up from it: its
    // pages stay under it, with their charges, until the next demotion or the close removes
    // it. The session stays in the host tier.
    (void)mover.Release();
    store->KeepListed();
    SetStaleRecord(id, std::make_shared<const v1::ColdSessionRecord>(record));
    spdlog::error("session {}: demotion failed after its record was written, and the record "
                  "could not be removed: its {} bytes of pages stay in the cold tier until the "
                  "session is demoted again or closed: {}",
                  id, ColdStore::RecordBytes(record), closed.status().ToString());
    return closed.status();
  }
  if (!closed.ok()) {
    // Not demoted: what the mover stored goes, by the demotion's deadline (keys it cannot
    // reach stay, logged, and are written over by the session's next demotion); the charges
    // are returned.
    store->Unreserve(ColdStore::kSessionOverheadBytes);
    (void)mover.RemoveAll(deadline);
    return closed.status();
  }
  (void)mover.Release();  // the record's now, with their charge
  const uint64_t reserved = ColdStore::RecordBytes(record);
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

void SessionManager::SetStaleRecord(const std::string& id,
                                    std::shared_ptr<const v1::ColdSessionRecord> record) {
  MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) it->second.stale_record = std::move(record);
}

RedisCluster* SessionManager::ColdClusterForTesting(std::string_view tenant) const {
  auto it = cold_.find(Sv(tenant));
  if (it == cold_.end()) return nullptr;
  return it->second.own_cluster != nullptr ? it->second.own_cluster.get() : cluster_.get();
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
  // The record's pages, promoted back through the one mover over the session's keys; they
  // stay the record's (Release) whatever happens, removed with it below once promoted.
  PageMover mover(store, PageMoverOptions{id, g.host_page_bytes(),
                                          config_.cold_tier.operation_timeout, /*live=*/false});
  std::vector<PageMover::Held> pages;
  for (int32_t l = 0; l < cold.record.layers_size(); ++l) {
    const v1::ColdLayer& cl = cold.record.layers(l);
    for (int i = 0; i < cl.generations_size(); ++i) pages.push_back({l, i, cl.generations(i)});
  }
  mover.Adopt(pages);
  absl::StatusOr<std::shared_ptr<TenantSession>> s = [&] {
    PageMover::CallScope call(&mover, deadline);
    return TenantSession::Restore(
        id, cold.spec, std::move(lease), backend_.get(), tenant,
        {cold.record.created_unix_ms(), cold.record.epoch(), cold.record.suspended()}, &mover,
        cold.spec.demotes_pages() ? store : nullptr, config_.cold_tier.operation_timeout);
  }();
  (void)mover.Release();
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

}  // namespace kvtier::daemon
