// SessionManager's numbers: GetStats (a tenant's and a session's statistics) and the
// metrics families (docs/metrics.md): WriteMetrics (tenants, arenas, sessions, retrieval
// telemetry) and WriteColdMetrics (the cold tier and its cluster client).
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/session_manager.h"
#include "offload/telemetry.h"

namespace kvtier::daemon {

// ---- GetStats -----------------------------------------------------------------------------

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
  for (const auto& [id, e] : sessions_) {
    if (e.tenant != t->name()) continue;
    ++(e.session != nullptr ? r.tenant.sessions : r.tenant.cold_sessions);
  }
  return r;
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
  // Every counter of kvtier/counters.h, from the telemetry block, which has a word for each:
  // kvtier_retrieval_<name>_total for a counter, kvtier_retrieval_<name> for a gauge.
  // checked_heads and corrected_heads come by the depth class of the layer (below).
#define KVTIER_METRIC_FAMILY(name, kind, help)                                          \
  if (std::string_view(#name) != "checked_heads" &&                                     \
      std::string_view(#name) != "corrected_heads") {                                   \
    constexpr bool counter = CounterKind::kind == CounterKind::kCounter;                \
    telemetry(counter ? "kvtier_retrieval_" #name "_total" : "kvtier_retrieval_" #name, \
              counter ? "counter" : "gauge", help,                                       \
              [](const TelemetryValues& t) { return t.name; });                          \
  }
  KVTIER_SEQUENCE_COUNTERS(KVTIER_METRIC_FAMILY)
#undef KVTIER_METRIC_FAMILY
  const auto per_class = [&](std::string_view name, std::string_view help, bool corrected) {
    out.Family(name, "counter", help);
    for (const Row& r : rows) {
      if (!r.t.has_value()) continue;
      for (int c = 0; c < kHeadClasses; ++c) {
        const uint64_t n =
            corrected ? r.t->corrected_heads_by_class[c] : r.t->checked_heads_by_class[c];
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
             "1 for the recall strategy the session uses.");
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

}  // namespace kvtier::daemon
