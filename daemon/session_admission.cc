// SessionManager's admission of calls: authenticating a caller (Authenticate) and an
// attach (AuthorizeAttach), a tenant's in-flight call slots (Admit, CallSlot), the calls in
// flight (InflightCall) that Drain waits for, counting a tenant's refused calls (Tally), and
// draining.
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "daemon/session_manager.h"
#include "daemon/session_manager_internal.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

using session_internal::Printable;

namespace {

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

// ---- authentication -----------------------------------------------------------------------

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

// ---- draining -----------------------------------------------------------------------------

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

}  // namespace kvtier::daemon
