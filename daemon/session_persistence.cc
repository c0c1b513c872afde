// What SessionManager keeps across a restart of the daemon: the session table beside each
// persistent arena (tenant.arena_path), written on every change (SaveSessionTable) and
// taken up at start (AdoptPersistentSessions), and, with cold_tier.persist_on_shutdown,
// every session demoted to the cold tier at shutdown (PersistAllSessions).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "daemon/logging.h"
#include "daemon/session_manager.h"
#include "daemon/session_params.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

namespace {

// Sessions persisted at once at shutdown (PersistAllSessions): each is a few pipelines to the
// cluster, so a few threads keep every node busy without a thread per session.
constexpr size_t kPersistParallelism = 8;

}  // namespace

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
            TenantSession::Restore(r.session_id(), std::move(spec), std::move(lease),
                                   backend_.get(), tenant,
                                   {r.created_unix_ms(), r.epoch(), r.suspended()},
                                   /*from=*/nullptr));
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

// ---- shutdown -----------------------------------------------------------------------------

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
  // Each session on its own, a few at a time: a node that is slow or paused holds up only the
  // sessions with keys on it, and only for their share of the deadline. Two passes. The first
  // gives every session the same share, half of an even split of the time over the workers,
  // so that every session gets its turn within the first half even when each before it uses
  // all of its share (a paused node holds its sessions to the end of their share, and a
  // command in flight may overrun it by up to cold_tier.command_timeout). The second retries
  // the sessions the first did not persist, with what is left split the same way. (A share
  // that grew as fewer sessions were left to start let the first ones, stuck on a paused
  // node, run the clock out on the last ones: a flaky cold_session_test found it.)
  const size_t workers = std::min(hot.size(), kPersistParallelism);
  const auto pass = [&](const std::vector<size_t>& todo, double fraction) {
    const absl::Time start = absl::Now();
    const absl::Duration share = std::max(absl::ZeroDuration(), deadline - start) *
                                 static_cast<double>(workers) /
                                 static_cast<double>(todo.size()) * fraction;
    std::atomic<size_t> next{0};
    const auto work = [&] {
      for (;;) {
        const size_t k = next.fetch_add(1, std::memory_order_relaxed);
        if (k >= todo.size()) return;
        Hot& h = hot[todo[k]];
        const absl::Time now = absl::Now();
        if (now >= deadline) {
          if (h.status.ok()) {
            h.status = absl::DeadlineExceededError(
                "the shutdown deadline (cold_tier.operation_timeout_ms) passed before its turn");
          }
          continue;
        }
        h.status = Demote(h.id, /*force=*/true, std::min(deadline, now + share));
      }
    };
    const size_t n = std::min(workers, todo.size());
    std::vector<std::thread> threads;
    threads.reserve(n - 1);
    for (size_t t = 1; t < n; ++t) threads.emplace_back(work);
    work();
    for (std::thread& t : threads) t.join();
  };
  std::vector<size_t> todo(hot.size());
  for (size_t i = 0; i < hot.size(); ++i) todo[i] = i;
  pass(todo, 0.5);
  todo.clear();
  for (size_t i = 0; i < hot.size(); ++i) {
    if (!hot[i].status.ok()) todo.push_back(i);
  }
  if (!todo.empty() && absl::Now() < deadline) pass(todo, 1.0);
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
