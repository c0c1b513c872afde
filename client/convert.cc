#include "client/convert.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvtier/status.h"

namespace kvtier {
namespace {

absl::StatusOr<int32_t> ToInt32(uint64_t v, std::string_view field) {
  if (v > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrFormat("%s = %d: must be at most %d", field, v,
                                                      std::numeric_limits<int32_t>::max()));
  }
  return static_cast<int32_t>(v);
}

}  // namespace

v1::DType DTypeToProto(DType t) {
  switch (t) {
    case DType::kF16:
      return v1::DTYPE_FP16;
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kF32:
      return v1::DTYPE_FP32;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> DTypeFromProto(int t, std::string_view field) {
  switch (t) {
    case v1::DTYPE_FP16:
      return DType::kF16;
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP32:
      return DType::kF32;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("%s = %d: must be DTYPE_FP16, DTYPE_BF16 or DTYPE_FP32", field, t));
  }
}

v1::Mode ModeToProto(RetrievalMode m) {
  switch (m) {
    case RetrievalMode::kSpeculative:
      return v1::MODE_SPECULATIVE;
    case RetrievalMode::kSync:
      return v1::MODE_SYNC;
    case RetrievalMode::kFull:
      return v1::MODE_FULL;
    case RetrievalMode::kDrop:
      return v1::MODE_DROP;
  }
  return v1::MODE_UNSPECIFIED;
}

absl::StatusOr<RetrievalMode> ModeFromProto(int m) {
  switch (m) {
    case v1::MODE_UNSPECIFIED:
    case v1::MODE_SPECULATIVE:
      return RetrievalMode::kSpeculative;
    case v1::MODE_SYNC:
      return RetrievalMode::kSync;
    case v1::MODE_FULL:
      return RetrievalMode::kFull;
    case v1::MODE_DROP:
      return RetrievalMode::kDrop;
    default:
      return absl::InvalidArgumentError(absl::StrCat("retrieval.mode = ", m, ": unknown mode"));
  }
}

v1::Transport TransportToProto(Transport t) {
  switch (t) {
    case Transport::kShm:
      return v1::TRANSPORT_SHM;
    case Transport::kGrpc:
      return v1::TRANSPORT_GRPC;
  }
  return v1::TRANSPORT_UNSPECIFIED;
}

absl::StatusOr<Transport> TransportFromProto(int t) {
  switch (t) {
    case v1::TRANSPORT_UNSPECIFIED:
    case v1::TRANSPORT_SHM:
      return Transport::kShm;
    case v1::TRANSPORT_GRPC:
      return Transport::kGrpc;
    default:
      return absl::InvalidArgumentError(absl::StrCat("transport = ", t, ": unknown transport"));
  }
}

v1::Geometry GeometryToProto(const Geometry& g) {
  v1::Geometry p;
  p.set_num_layers(static_cast<uint32_t>(g.num_layers));
  p.set_num_q_heads(static_cast<uint32_t>(g.num_q_heads));
  p.set_num_kv_heads(static_cast<uint32_t>(g.num_kv_heads));
  p.set_head_dim(static_cast<uint32_t>(g.head_dim));
  p.set_page_size(static_cast<uint32_t>(g.page_size));
  p.set_dtype(DTypeToProto(g.dtype));
  return p;
}

absl::StatusOr<Geometry> GeometryFromProto(const v1::Geometry& p) {
  Geometry g;
  KVTIER_ASSIGN_OR_RETURN(g.num_layers, ToInt32(p.num_layers(), "geometry.num_layers"));
  KVTIER_ASSIGN_OR_RETURN(g.num_q_heads, ToInt32(p.num_q_heads(), "geometry.num_q_heads"));
  KVTIER_ASSIGN_OR_RETURN(g.num_kv_heads, ToInt32(p.num_kv_heads(), "geometry.num_kv_heads"));
  KVTIER_ASSIGN_OR_RETURN(g.head_dim, ToInt32(p.head_dim(), "geometry.head_dim"));
  KVTIER_ASSIGN_OR_RETURN(g.page_size, ToInt32(p.page_size(), "geometry.page_size"));
  if (g.page_size == 0) g.page_size = 32;
  KVTIER_ASSIGN_OR_RETURN(g.dtype, DTypeFromProto(p.dtype()));
  return g;
}

absl::StatusOr<v1::OpenSessionRequest> BuildOpenSessionRequest(std::string_view tenant,
                                                               const SessionOptions& options) {
  const Geometry& g = options.geometry;
  KVTIER_RETURN_IF_ERROR(g.Validate());
  const RetrieverOptions& r = options.retriever;
  const int64_t budget_tokens = int64_t{r.budget_pages()} * g.page_size;
  RetrieverOptions split;
  if (budget_tokens > std::numeric_limits<int32_t>::max() ||
      !split.SetBudgetTokens(static_cast<int32_t>(budget_tokens), g.page_size).ok() ||
      split.sink_pages != r.sink_pages || split.selected_pages != r.selected_pages ||
      split.recent_pages != r.recent_pages) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "retriever sink_pages = %d, selected_pages = %d, recent_pages = %d: the protocol "
        "carries a budget in tokens split 1/4 : 1/2 : 1/4, so sink and recent must be equal, "
        "selected twice that, and the budget (%d tokens) a positive multiple of 4 pages (%d "
        "tokens at p = %d); use RetrieverOptions::SetBudgetTokens",
        r.sink_pages, r.selected_pages, r.recent_pages, budget_tokens, 4 * g.page_size,
        g.page_size));
  }
  if (r.max_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "retriever.max_tokens = %d: must be >= 0 (0: the daemon's default)", r.max_tokens));
  }
  if (!std::isfinite(r.correction_threshold)) {
    return absl::InvalidArgumentError("retriever.correction_threshold: must be finite");
  }
  v1::OpenSessionRequest req;
  req.set_tenant(std::string(tenant));
  *req.mutable_geometry() = GeometryToProto(g);
  v1::RetrievalOptions* ro = req.mutable_retrieval();
  ro->set_mode(ModeToProto(r.mode));
  ro->set_budget_tokens(static_cast<uint32_t>(budget_tokens));
  ro->set_max_tokens(static_cast<uint32_t>(r.max_tokens));
  ro->set_correction_threshold(r.correction_threshold);
  req.set_transport(TransportToProto(options.transport));
  req.set_label(options.label);
  return req;
}

absl::StatusOr<RetrieverOptions> ResolveRetrieverOptions(const RetrieverOptions& local,
                                                         const SessionInfo& info) {
  RetrieverOptions o = local;
  o.mode = info.mode;
  if (info.budget_tokens != 0) {
    if (absl::Status st = o.SetBudgetTokens(info.budget_tokens, info.geometry.page_size);
        !st.ok()) {
      return absl::InternalError(absl::StrCat(
          "session ", info.id, ": the daemon resolved an unusable budget: ", st.message()));
    }
  }
  if (info.max_tokens != 0) o.max_tokens = info.max_tokens;
  o.correction_threshold = info.correction_threshold;
  return o;
}

absl::StatusOr<SessionInfo> SessionInfoFromProto(const v1::SessionInfo& p) {
  SessionInfo info;
  info.id = p.session_id();
  info.tenant = p.tenant();
  info.label = p.label();
  KVTIER_ASSIGN_OR_RETURN(info.transport, TransportFromProto(p.transport()));
  KVTIER_ASSIGN_OR_RETURN(info.geometry, GeometryFromProto(p.geometry()));
  KVTIER_ASSIGN_OR_RETURN(info.mode, ModeFromProto(p.retrieval().mode()));
  KVTIER_ASSIGN_OR_RETURN(info.budget_tokens,
                          ToInt32(p.retrieval().budget_tokens(), "retrieval.budget_tokens"));
  KVTIER_ASSIGN_OR_RETURN(info.max_tokens,
                          ToInt32(p.retrieval().max_tokens(), "retrieval.max_tokens"));
  if (p.retrieval().has_correction_threshold()) {
    info.correction_threshold = p.retrieval().correction_threshold();
  }
  info.closing = p.state() == v1::SESSION_STATE_CLOSING;
  info.epoch = p.epoch();
  info.committed_tokens.reserve(static_cast<size_t>(p.committed_tokens_size()));
  for (uint64_t t : p.committed_tokens()) {
    if (t > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat("committed_tokens = ", t, ": out of range"));
    }
    info.committed_tokens.push_back(static_cast<int64_t>(t));
  }
  info.region_offset = p.region_offset();
  info.region_bytes = p.region_bytes();
  info.created_unix_ms = p.created_unix_ms();
  return info;
}

Capabilities CapabilitiesFromHello(const v1::HelloReply& r) {
  Capabilities c;
  c.protocol_version = r.protocol_version();
  c.server_version = r.server_version();
  for (uint32_t p : r.page_sizes()) c.page_sizes.push_back(static_cast<int32_t>(p));
  for (int t : r.dtypes()) {
    if (auto d = DTypeFromProto(t); d.ok()) c.dtypes.push_back(*d);  // skip unknown ones
  }
  c.layouts.assign(r.layouts().begin(), r.layouts().end());
  c.backends.assign(r.backends().begin(), r.backends().end());
  for (int m : r.modes()) {
    if (m == v1::MODE_UNSPECIFIED) continue;
    if (auto mode = ModeFromProto(m); mode.ok()) c.modes.push_back(*mode);
  }
  c.max_message_bytes = r.limits().max_message_bytes();
  c.max_sessions_per_tenant = r.limits().max_sessions_per_tenant();
  c.max_tokens_per_session = r.limits().max_tokens_per_session();
  c.max_tokens_per_offload = r.limits().max_tokens_per_offload();
  c.tenant = r.tenant();
  c.shm_available = r.shm_available();
  c.attach_socket = r.attach_socket();
  c.tenant_quota_bytes = r.tenant_quota_bytes();
  return c;
}

RetrieverStats StatsFromProto(const v1::SessionStats& s) {
  RetrieverStats r;
  r.steps = s.steps();
  r.appended_tokens = s.appended_tokens();
  r.offloaded_pages = s.offloaded_pages();
  r.recalled_pages = s.recalled_pages();
  r.recalled_bytes = s.recalled_bytes();
  r.correction_pages = s.correction_pages();
  r.checked_heads = s.checked_heads();
  r.corrected_heads = s.corrected_heads();
  return r;
}

}  // namespace kvtier
