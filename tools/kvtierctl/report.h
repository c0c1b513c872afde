// kvtierctl's views of kvtierd's /metrics (docs/metrics.md): one row per tenant, one row per
// session, each as a table or as JSON. Pure functions over a parsed text; thread-safe.
//
// Series read (every label set as the daemon writes it; a series that is absent shows "-"):
//  tenants:  kvtier_tenant_quota_bytes{tenant}, kvtier_tenant_used_bytes{tenant},
//            kvtier_tenant_sessions{tenant,transport} (summed),
//            kvtier_tenant_refused_requests_total, kvtier_arena_hugepage_bytes,
//            kvtier_arena_numa_node, kvtier_arena_locked {tenant}
//  sessions: {tenant,session,transport[,...]} of kvtier_retrieval_steps_total,
//            kvtier_retrieval_{corrected,checked}_heads_total (summed over head_class),
//            kvtier_retrieval_recalled_bytes_total, kvtier_session_committed_pages,
//            kvtier_retrieval_resident_bytes, kvtier_retrieval_recall_strategy{strategy} (the one
//            at 1), kvtier_retrieval_layer_step_duration_seconds_{sum,count},
//            kvtier_retrieval_estimated_mass_recall_{sum,count}
#ifndef KVTIER_TOOLS_KVTIERCTL_REPORT_H_
#define KVTIER_TOOLS_KVTIERCTL_REPORT_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tools/kvtierctl/prometheus.h"

namespace kvtier::ctl {

struct TenantRow {
  std::string tenant;
  std::optional<double> quota_bytes, used_bytes;
  std::optional<double> sessions;  // over every transport
  std::optional<double> refused_requests;
  std::optional<double> hugepage_bytes;  // the arena's page size; 0: none
  std::optional<double> numa_node;       // < 0: not bound
  std::optional<double> locked;          // 1: mlocked
};

struct SessionRow {
  std::string tenant, session, transport;
  std::optional<double> layer_steps;
  std::optional<double> checked_heads, corrected_heads;  // over every head class
  std::optional<double> recalled_bytes, committed_pages, resident_bytes;
  std::string strategy;  // empty: unknown
  double step_seconds_sum = 0, step_count = 0;
  double mass_recall_sum = 0, mass_recall_count = 0;

  std::optional<double> correction_rate() const;    // corrected / checked; none when unchecked
  std::optional<double> mean_step_seconds() const;  // none without steps
  std::optional<double> mean_mass_recall() const;   // none without estimates
};

// Rows sorted by tenant.
std::vector<TenantRow> TenantRows(const PromText& metrics);
// Rows sorted by (tenant, session); only `tenant_filter`'s when it is not empty.
std::vector<SessionRow> SessionRows(const PromText& metrics, std::string_view tenant_filter);

// A table (or "no tenants\n"), or a JSON array of objects (one per row, numbers or null).
std::string FormatTenants(const std::vector<TenantRow>& rows, bool json);
std::string FormatSessions(const std::vector<SessionRow>& rows, bool json);

}  // namespace kvtier::ctl

#endif  // KVTIER_TOOLS_KVTIERCTL_REPORT_H_
