// TenantRows / SessionRows: one pass over the samples, each series name mapped to the field it
// fills. Counters and per-transport or per-class series are summed; a row exists once any of
// its series does.
#include "tools/kvtierctl/report.h"

#include <functional>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tools/kvtierctl/format.h"

namespace kvtier::ctl {
namespace {

void Add(std::optional<double>& slot, double v) { slot = slot.value_or(0) + v; }

using TenantField = std::function<void(TenantRow&, const PromSample&)>;
using SessionField = std::function<void(SessionRow&, const PromSample&)>;

const std::map<std::string, TenantField, std::less<>>& TenantFields() {
  static const auto* fields = new std::map<std::string, TenantField, std::less<>>{
      {"kvtier_tenant_quota_bytes",
       [](TenantRow& r, const PromSample& s) { r.quota_bytes = s.value; }},
      {"kvtier_tenant_used_bytes",
       [](TenantRow& r, const PromSample& s) { r.used_bytes = s.value; }},
      {"kvtier_tenant_sessions",
       [](TenantRow& r, const PromSample& s) { Add(r.sessions, s.value); }},
      {"kvtier_tenant_refused_requests_total",
       [](TenantRow& r, const PromSample& s) { Add(r.refused_requests, s.value); }},
      {"kvtier_arena_hugepage_bytes",
       [](TenantRow& r, const PromSample& s) { r.hugepage_bytes = s.value; }},
      {"kvtier_arena_numa_node", [](TenantRow& r, const PromSample& s) { r.numa_node = s.value; }},
      {"kvtier_arena_locked", [](TenantRow& r, const PromSample& s) { r.locked = s.value; }},
  };
  return *fields;
}

const std::map<std::string, SessionField, std::less<>>& SessionFields() {
  static const auto* fields = new std::map<std::string, SessionField, std::less<>>{
      {"kvtier_retrieval_steps_total",
       [](SessionRow& r, const PromSample& s) { Add(r.layer_steps, s.value); }},
      {"kvtier_retrieval_checked_heads_total",
       [](SessionRow& r, const PromSample& s) { Add(r.checked_heads, s.value); }},
      {"kvtier_retrieval_corrected_heads_total",
       [](SessionRow& r, const PromSample& s) { Add(r.corrected_heads, s.value); }},
      {"kvtier_retrieval_recalled_bytes_total",
       [](SessionRow& r, const PromSample& s) { Add(r.recalled_bytes, s.value); }},
      {"kvtier_session_committed_pages",
       [](SessionRow& r, const PromSample& s) { Add(r.committed_pages, s.value); }},
      {"kvtier_retrieval_resident_bytes",
       [](SessionRow& r, const PromSample& s) { Add(r.resident_bytes, s.value); }},
      {"kvtier_retrieval_recall_strategy",
       [](SessionRow& r, const PromSample& s) {
         const std::string* strategy = s.Label("strategy");
         if (s.value == 1 && strategy != nullptr) r.strategy = *strategy;
       }},
      {"kvtier_retrieval_layer_step_duration_seconds_sum",
       [](SessionRow& r, const PromSample& s) { r.step_seconds_sum += s.value; }},
      {"kvtier_retrieval_layer_step_duration_seconds_count",
       [](SessionRow& r, const PromSample& s) { r.step_count += s.value; }},
      {"kvtier_retrieval_estimated_mass_recall_sum",
       [](SessionRow& r, const PromSample& s) { r.mass_recall_sum += s.value; }},
      {"kvtier_retrieval_estimated_mass_recall_count",
       [](SessionRow& r, const PromSample& s) { r.mass_recall_count += s.value; }},
  };
  return *fields;
}

std::string Percent(std::optional<double> share) {
  if (!share.has_value()) return "-";
  return absl::StrFormat("%.1f%%", 100 * *share);
}

std::string YesNo(std::optional<double> v) {
  if (!v.has_value()) return "-";
  return *v != 0 ? "yes" : "no";
}

std::string HugePages(std::optional<double> bytes) {
  if (bytes.has_value() && *bytes == 0) return "none";
  return HumanBytes(bytes);
}

std::string NumaNode(std::optional<double> node) {
  if (node.has_value() && *node < 0) return "any";
  return Count(node);
}

std::optional<double> Ratio(std::optional<double> num, std::optional<double> den) {
  if (!den.has_value() || *den <= 0) return std::nullopt;
  return num.value_or(0) / *den;
}

std::optional<double> Share(std::optional<double> used, std::optional<double> quota) {
  if (!used.has_value()) return std::nullopt;
  return Ratio(used, quota);
}

}  // namespace

std::optional<double> SessionRow::correction_rate() const {
  return Ratio(corrected_heads, checked_heads);
}
std::optional<double> SessionRow::mean_step_seconds() const {
  return Ratio(step_seconds_sum, step_count);
}
std::optional<double> SessionRow::mean_mass_recall() const {
  return Ratio(mass_recall_sum, mass_recall_count);
}

std::vector<TenantRow> TenantRows(const PromText& metrics) {
  std::map<std::string, TenantRow> rows;
  for (const PromSample& s : metrics.samples) {
    const auto field = TenantFields().find(s.name);
    const std::string* tenant = s.Label("tenant");
    if (field == TenantFields().end() || tenant == nullptr) continue;
    TenantRow& row = rows[*tenant];
    row.tenant = *tenant;
    field->second(row, s);
  }
  std::vector<TenantRow> out;
  for (auto& [name, row] : rows) out.push_back(std::move(row));
  return out;
}

std::vector<SessionRow> SessionRows(const PromText& metrics, std::string_view tenant_filter) {
  std::map<std::pair<std::string, std::string>, SessionRow> rows;
  for (const PromSample& s : metrics.samples) {
    const auto field = SessionFields().find(s.name);
    const std::string* tenant = s.Label("tenant");
    const std::string* session = s.Label("session");
    if (field == SessionFields().end() || tenant == nullptr || session == nullptr) continue;
    if (!tenant_filter.empty() && *tenant != tenant_filter) continue;
    SessionRow& row = rows[{*tenant, *session}];
    row.tenant = *tenant;
    row.session = *session;
    if (const std::string* transport = s.Label("transport"); row.transport.empty() && transport) {
      row.transport = *transport;
    }
    field->second(row, s);
  }
  std::vector<SessionRow> out;
  for (auto& [key, row] : rows) out.push_back(std::move(row));
  return out;
}

std::string FormatTenants(const std::vector<TenantRow>& rows, bool json) {
  if (json) {
    std::string out = "[";
    for (size_t i = 0; i < rows.size(); ++i) {
      const TenantRow& r = rows[i];
      absl::StrAppend(&out, i == 0 ? "\n" : ",\n", "  {\"tenant\": ", JsonString(r.tenant),
                      ", \"quota_bytes\": ", JsonNumber(r.quota_bytes),
                      ", \"used_bytes\": ", JsonNumber(r.used_bytes),
                      ", \"sessions\": ", JsonNumber(r.sessions),
                      ", \"refused_requests\": ", JsonNumber(r.refused_requests),
                      ", \"hugepage_bytes\": ", JsonNumber(r.hugepage_bytes),
                      ", \"numa_node\": ", JsonNumber(r.numa_node), ", \"locked\": ",
                      !r.locked        ? "null"
                      : *r.locked != 0 ? "true"
                                       : "false",
                      "}");
    }
    return out + (rows.empty() ? "]\n" : "\n]\n");
  }
  if (rows.empty()) return "no tenants\n";
  std::vector<std::vector<std::string>> cells;
  for (const TenantRow& r : rows) {
    cells.push_back({r.tenant, HumanBytes(r.quota_bytes), HumanBytes(r.used_bytes),
                     Percent(Share(r.used_bytes, r.quota_bytes)), Count(r.sessions),
                     Count(r.refused_requests), HugePages(r.hugepage_bytes), NumaNode(r.numa_node),
                     YesNo(r.locked)});
  }
  return RenderTable({{"TENANT"},
                      {"QUOTA", true},
                      {"USED", true},
                      {"USED%", true},
                      {"SESSIONS", true},
                      {"REFUSED", true},
                      {"HUGEPAGES", true},
                      {"NUMA", true},
                      {"LOCKED"}},
                     cells);
}

std::string FormatSessions(const std::vector<SessionRow>& rows, bool json) {
  if (json) {
    std::string out = "[";
    for (size_t i = 0; i < rows.size(); ++i) {
      const SessionRow& r = rows[i];
      absl::StrAppend(
          &out, i == 0 ? "\n" : ",\n", "  {\"tenant\": ", JsonString(r.tenant),
          ", \"session\": ", JsonString(r.session), ", \"transport\": ", JsonString(r.transport),
          ", \"layer_steps\": ", JsonNumber(r.layer_steps),
          ", \"checked_heads\": ", JsonNumber(r.checked_heads),
          ", \"corrected_heads\": ", JsonNumber(r.corrected_heads),
          ", \"correction_rate\": ", JsonNumber(r.correction_rate()),
          ", \"recalled_bytes\": ", JsonNumber(r.recalled_bytes),
          ", \"committed_pages\": ", JsonNumber(r.committed_pages),
          ", \"resident_bytes\": ", JsonNumber(r.resident_bytes),
          ", \"recall_strategy\": ", r.strategy.empty() ? "null" : JsonString(r.strategy),
          ", \"mean_layer_step_seconds\": ", JsonNumber(r.mean_step_seconds()),
          ", \"estimated_mass_recall\": ", JsonNumber(r.mean_mass_recall()), "}");
    }
    return out + (rows.empty() ? "]\n" : "\n]\n");
  }
  if (rows.empty()) return "no sessions\n";
  std::vector<std::vector<std::string>> cells;
  for (const SessionRow& r : rows) {
    const std::optional<double> step = r.mean_step_seconds();
    const std::optional<double> mass = r.mean_mass_recall();
    cells.push_back({r.tenant, r.session, r.transport.empty() ? "-" : r.transport,
                     Count(r.layer_steps), Percent(r.correction_rate()),
                     HumanBytes(r.recalled_bytes), Count(r.committed_pages),
                     HumanBytes(r.resident_bytes), r.strategy.empty() ? "-" : r.strategy,
                     step ? HumanDuration(absl::Seconds(*step)) : "-",
                     mass ? absl::StrFormat("%.3f", *mass) : "-"});
  }
  return RenderTable({{"TENANT"},
                      {"SESSION"},
                      {"TRANSPORT"},
                      {"LAYER-STEPS", true},
                      {"CORRECTED", true},
                      {"RECALLED", true},
                      {"PAGES", true},
                      {"RESIDENT", true},
                      {"STRATEGY"},
                      {"STEP", true},
                      {"MASS-RECALL", true}},
                     cells);
}

}  // namespace kvtier::ctl
