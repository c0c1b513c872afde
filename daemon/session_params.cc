#include "daemon/session_params.h"

#include <string>

#include "core/status.h"
#include "proto/convert.h"

namespace kvtier::daemon {

absl::StatusOr<OpenSessionParams> ParamsFromProto(const v1::OpenSessionRequest& r) {
  OpenSessionParams p;
  p.tenant = r.tenant();
  KVTIER_ASSIGN_OR_RETURN(p.geometry, GeometryFromProto(r.geometry()));
  KVTIER_ASSIGN_OR_RETURN(p.mode, ModeFromProto(r.retrieval().mode()));
  p.budget_tokens = r.retrieval().budget_tokens();
  p.max_tokens = r.retrieval().max_tokens();
  p.host_tokens = r.retrieval().host_tokens();
  if (r.retrieval().has_correction_threshold()) {
    p.correction_threshold = r.retrieval().correction_threshold();
  }
  p.correction_trigger = r.retrieval().correction_trigger();
  if (r.retrieval().has_correction_max_loss()) {
    p.correction_max_loss = r.retrieval().correction_max_loss();
  }
  p.summary = r.retrieval().summary();
  if (r.retrieval().has_sink_pages()) p.sink_pages = r.retrieval().sink_pages();
  if (r.retrieval().has_recent_pages()) p.recent_pages = r.retrieval().recent_pages();
  p.budget_policy = r.policy().budget_policy();
  p.residency_policy = r.policy().residency_policy();
  p.host_drop = r.policy().host_drop();
  p.policy_params.insert(r.policy().params().begin(), r.policy().params().end());
  KVTIER_ASSIGN_OR_RETURN(p.transport, TransportFromProto(r.transport()));
  p.label = r.label();
  p.request_id = r.request_id();
  return p;
}

v1::OpenSessionRequest ResolvedRequest(const OpenSessionParams& params, const SessionSpec& spec) {
  v1::OpenSessionRequest r;
  r.set_tenant(spec.tenant);
  *r.mutable_geometry() = GeometryToProto(spec.geometry);
  v1::RetrievalOptions* ro = r.mutable_retrieval();
  ro->set_mode(ModeToProto(spec.sequence.mode));
  ro->set_budget_tokens(static_cast<uint32_t>(spec.budget_tokens));
  ro->set_max_tokens(static_cast<uint32_t>(spec.sequence.max_tokens));
  ro->set_host_tokens(static_cast<uint32_t>(spec.host_pages * spec.geometry.page_size));
  ro->set_correction_threshold(spec.sequence.correction_threshold);
  ro->set_correction_trigger(std::string(CorrectionTriggerName(spec.sequence.correction_trigger)));
  ro->set_correction_max_loss(spec.sequence.correction_max_loss);
  ro->set_summary(std::string(SummaryModeName(spec.sequence.summary)));
  ro->set_sink_pages(static_cast<uint32_t>(spec.sequence.sink_pages));
  ro->set_recent_pages(static_cast<uint32_t>(spec.sequence.recent_pages));
  v1::PolicyOptions* po = r.mutable_policy();
  po->set_budget_policy(params.budget_policy);
  po->set_residency_policy(params.residency_policy);
  po->set_host_drop(params.host_drop);
  po->mutable_params()->insert(params.policy_params.begin(), params.policy_params.end());
  r.set_transport(TransportToProto(spec.transport));
  r.set_label(spec.label);
  r.set_request_id(params.request_id);
  return r;
}

}  // namespace kvtier::daemon
