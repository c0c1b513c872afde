// SessionManager: kvtierd's domain logic (docs/architecture.md#processes,
// docs/architecture.md#errors-and-integrity). It owns the tenants (their arenas), the sessions and
// the CPU backend of GRPC sessions, and has one method per RPC of kvtier.v1.KvTier; the gRPC
// service (kvtier_service.h) only converts protos and maps statuses, and the attach socket asks
// AuthorizeAttach.
//
// Every call runs as an authenticated Caller (Authenticate; caller.h), holds one of its
// tenant's in-flight call slots while it runs (Admit), may touch only its own tenant's
// sessions (another tenant's session id is NOT_FOUND, exactly like an unknown one, so ids
// cannot be probed), and is refused with the canonical code and a message naming the field
// and the limit it broke. Work starts and commits only while the caller is live (its
// deadline has not passed, it did not cancel): a call that started either completes or is
// rolled back (docs/service.md, "Deadlines"). Nothing a request can send aborts the daemon.
//
// Thread-safe. Calls on different sessions run in parallel; calls on the same session
// serialize. Expensive work (OpenSession, Step, an Offload commit) runs on the calling
// thread: the gRPC service calls them from its WorkQueue.
//
// SessionManager's definitions are split by job: session_manager.cc (construction, the
// session table), session_admission.cc (authentication, call slots, calls in flight,
// draining), session_open.cc (OpenSession), session_streams.cc (Step, Fetch, Offload),
// session_tiering.cc (the cold tier), session_persistence.cc (what outlives a restart) and
// session_metrics.cc (GetStats, the metrics); session_manager_internal.h holds the helpers
// they share.
#ifndef KVTIER_DAEMON_SESSION_MANAGER_H_
#define KVTIER_DAEMON_SESSION_MANAGER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "daemon/attach_server.h"
#include "daemon/caller.h"
#include "daemon/cold_store.h"
#include "daemon/cold_tier.h"
#include "daemon/config.h"
#include "daemon/metrics.h"
#include "daemon/redis_cluster.h"
#include "daemon/tenant.h"
#include "daemon/tenant_session.h"
#include "kernels/backend.h"
#include "kvtier/options.h"

namespace kvtier::daemon {

// Page sizes (tokens per page) the daemon serves, reported by Hello.
inline constexpr int32_t kSupportedPageSizes[] = {8, 16, 32, 64, 128};
// The working set when OpenSession leaves budget_tokens 0 is kDefaultBudgetTokens
// (kvtier/options.h), capped at the session's capacity; τ left unset is
// kDefaultCorrectionThreshold, the trigger left empty "cosine" and the largest loss left unset
// kDefaultCorrectionMaxLoss.

// OpenSessionRequest, converted. Zero means the default as in the proto.
struct OpenSessionParams {
  std::string tenant;  // must be the caller's
  Geometry geometry;   // page_size 0 is converted to 32 by the adapter
  RetrievalMode mode = RetrievalMode::kSpeculative;
  uint32_t budget_tokens = 0;
  uint32_t max_tokens = 0;
  uint32_t host_tokens = 0;  // 0: max_tokens (retrieval.host_tokens)
  std::optional<float> correction_threshold;
  std::string correction_trigger;  // CorrectionTriggerName; empty: cosine
  std::optional<float> correction_max_loss;
  std::string summary;  // SummaryModeName; empty: key-codes (the library's default)
  // The working set's split; unset: SetBudgetTokens's for the budget (selected: the rest).
  std::optional<uint32_t> sink_pages;
  std::optional<uint32_t> recent_pages;
  std::string budget_policy;
  std::string residency_policy;
  std::string host_drop;
  std::map<std::string, std::string> policy_params;
  Transport transport = Transport::kShm;
  std::string label;
  // Idempotency key (OpenSessionRequest.request_id): at most kMaxRequestIdBytes of
  // printable ASCII; empty: none.
  std::string request_id;
};

inline constexpr size_t kMaxRequestIdBytes = 64;

struct OffloadResult {
  uint64_t committed_tokens = 0;       // applied by this stream, over all layers
  std::vector<uint64_t> layer_tokens;  // per layer, the session's after the stream
};

struct TenantStatsRecord {
  std::string tenant;
  uint64_t quota_bytes = 0;
  uint64_t used_bytes = 0;
  // Sessions that hold host memory (what max_sessions_per_tenant and kvtier_tenant_sessions
  // count), and sessions in the cold tier (counted apart, as their memory is).
  uint32_t sessions = 0;
  uint32_t cold_sessions = 0;
  uint64_t refused_requests = 0;  // calls of the tenant that ended in an error
};

struct StatsReport {
  TenantStatsRecord tenant;
  std::optional<SessionStatsRecord> session;  // when one was named
};

struct DrainResult {
  bool drained = false;  // no call was in flight when Drain returned
  uint32_t open_sessions = 0;
  uint32_t inflight_calls = 0;
};

class SessionManager;

// One of a tenant's in-flight call slots (limits.max_inflight_calls_per_tenant), held from
// the call's start to its end. Move-only; gives the slot back when destroyed.
class CallSlot {
 public:
  CallSlot() = default;
  CallSlot(CallSlot&& other) noexcept
      : manager_(std::exchange(other.manager_, nullptr)), tenant_(std::move(other.tenant_)) {}
  CallSlot& operator=(CallSlot&& other) noexcept;
  CallSlot(const CallSlot&) = delete;
  CallSlot& operator=(const CallSlot&) = delete;
  ~CallSlot();

 private:
  friend class SessionManager;
  CallSlot(SessionManager* manager, std::string tenant)
      : manager_(manager), tenant_(std::move(tenant)) {}
  SessionManager* manager_ = nullptr;
  std::string tenant_;
};

// Counts one call in flight for Drain while it lives. Move-only.
class InflightCall {
 public:
  InflightCall() = default;
  explicit InflightCall(SessionManager* manager);
  InflightCall(InflightCall&& other) noexcept : manager_(std::exchange(other.manager_, nullptr)) {}
  InflightCall& operator=(InflightCall&& other) noexcept;
  InflightCall(const InflightCall&) = delete;
  InflightCall& operator=(const InflightCall&) = delete;
  ~InflightCall();

 private:
  SessionManager* manager_ = nullptr;
};

// One Offload stream. The first message binds the session; each Add validates its message
// and stages it (its bytes charged to the tenant's quota until applied or discarded); after
// a message with commit = true, Commit applies everything staged, and Finish (the stream's
// clean end) applies the rest. Commit and Finish do the work only while the caller is live.
// Break (a message that does not parse, a cancel, the client gone) and destroying the
// stream without Finish discard what is staged; the commits applied before stand. Every
// error names the message that broke the stream (counted from 1) and what the stream had
// committed; after one, the stream refuses everything with it. Thread-compatible; the
// SessionManager must outlive it.
class OffloadStream {
 public:
  // INVALID_ARGUMENT for a bad layer, token count or K/V size (naming both numbers),
  // a session id other than the first message's; FAILED_PRECONDITION for a start_token
  // other than the layer's end, or an SHM session; OUT_OF_RANGE when the layer would exceed
  // the session's max_tokens; NOT_FOUND for another tenant's or an unknown session;
  // RESOURCE_EXHAUSTED when the staged bytes do not fit the tenant's quota.
  absl::Status Add(OffloadChunk chunk);
  // Whether the last message asked for a commit (Commit is due before the next Add).
  bool commit_due() const { return commit_due_; }
  // Applies what is staged (the caller's DEADLINE_EXCEEDED / CANCELLED instead when it is
  // no longer live, discarding it).
  absl::Status Commit();
  absl::StatusOr<OffloadResult> Finish();
  // The stream broke with `why` before its clean end: discards what is staged and returns
  // `why` naming where (the message after the last one added when `at_next_message`, e.g.
  // one that did not parse) with the stream's account appended.
  absl::Status Break(const absl::Status& why, bool at_next_message);
  // Messages added so far (Add calls).
  int64_t messages() const { return messages_; }
  ~OffloadStream();

 private:
  friend class SessionManager;
  OffloadStream(SessionManager* manager, Caller caller);
  absl::Status Bind(std::string_view session_id);
  absl::Status Validate(const OffloadChunk& chunk) const;
  absl::Status ApplyStaged();
  void Discard();
  // Records `st` as the stream's error, at `where` ("message 3").
  absl::Status Fail(const absl::Status& st, std::string_view where);

  SessionManager* const manager_;
  const Caller caller_;
  InflightCall inflight_;
  std::shared_ptr<TenantSession> session_;
  std::vector<OffloadChunk> staged_;
  std::vector<int64_t> staged_tokens_;  // per layer
  uint64_t staged_bytes_ = 0;           // charged to the tenant
  int64_t messages_ = 0;
  bool commit_due_ = false;
  OffloadResult result_;
  absl::Status failed_;
};

// The pages of one Fetch, read a message at a time. Thread-compatible; the SessionManager
// must outlive it.
class FetchCursor {
 public:
  bool done() const { return next_ == pages_.size(); }
  // The next pages, as many as fit a message of `max_message_bytes` (at least one while
  // not done()). RESOURCE_EXHAUSTED when one page does not fit (naming both sizes);
  // NOT_FOUND when a page was withdrawn or the session closed meanwhile.
  absl::StatusOr<std::vector<PageData>> Next(uint64_t max_message_bytes);

 private:
  friend class SessionManager;
  FetchCursor(SessionManager* manager, std::shared_ptr<TenantSession> session, int32_t layer,
              std::vector<int64_t> pages, absl::Time deadline);
  SessionManager* manager_;
  InflightCall inflight_;
  std::shared_ptr<TenantSession> session_;
  int32_t layer_;
  std::vector<int64_t> pages_;
  size_t next_ = 0;
  const absl::Time deadline_;  // the Fetch's: its demoted pages are read from the cold tier by it
};

class SessionManager {
 public:
  // Bytes of framing a Page adds to its data inside a FetchReply (tags, lengths, numbers).
  static constexpr uint64_t kPageOverheadBytes = 64;

  // Creates every tenant of `config` (their arenas; errors name the tenant) and the CPU
  // backend of GRPC sessions (config.cpu_threads), and registers each arena with it. With a
  // cold tier (config.cold_tier.nodes), connects to the cluster (UNAVAILABLE naming the
  // nodes when none answers) and takes up every session its tenants demoted before, cold.
  // REQUIRES: config.Validate() is OK (tenant names unique).
  static absl::StatusOr<std::unique_ptr<SessionManager>> Create(const DaemonConfig& config);
  SessionManager(const SessionManager&) = delete;
  SessionManager& operator=(const SessionManager&) = delete;
  // Closes every session left.
  ~SessionManager();

  // The caller for x-kvtier-tenant / x-kvtier-token (deadline and cancellation unset):
  // UNAUTHENTICATED for an empty tenant; PERMISSION_DENIED for an unknown tenant or, when
  // the tenant has a token, another token.
  absl::StatusOr<Caller> Authenticate(std::string_view tenant, std::string_view token) const;
  // One of the caller's tenant's in-flight call slots: RESOURCE_EXHAUSTED (with a retry
  // hint) when limits.max_inflight_calls_per_tenant calls of the tenant are in flight.
  absl::StatusOr<CallSlot> Admit(const Caller& caller) ABSL_LOCKS_EXCLUDED(mu_);

  // The attach socket's authorizer: UNAVAILABLE while draining; NOT_FOUND for an unknown
  // tenant; PERMISSION_DENIED for a wrong token, or a uid outside tenant.uids (the
  // daemon's own uid when uids is empty), naming the uid. The grant's fd is the arena's,
  // valid while the manager lives.
  absl::StatusOr<AttachGrant> AuthorizeAttach(const PeerCredentials& peer, std::string_view tenant,
                                              std::string_view token) const;

  // --- one method per RPC -------------------------------------------------------------
  // UNAVAILABLE while draining; PERMISSION_DENIED for params.tenant != caller's;
  // INVALID_ARGUMENT for geometry, page size, layers, max_tokens, budget, τ, policy,
  // request_id; FAILED_PRECONDITION for SHM when the daemon serves no attach socket, or a
  // request_id of an open session whose parameters differ; ABORTED while another call
  // with the same request_id is opening; RESOURCE_EXHAUSTED past max_sessions_per_tenant
  // or the tenant's memory; the caller's DEADLINE_EXCEEDED / CANCELLED when it is no longer
  // live before the session is made, or after (the session is then closed again).
  absl::StatusOr<SessionRecord> OpenSession(const Caller& caller, const OpenSessionParams& params);
  absl::StatusOr<CloseResult> CloseSession(const Caller& caller, std::string_view session_id);
  // The caller's tenant's sessions, in creation order.
  std::vector<SessionRecord> ListSessions(const Caller& caller);
  // A cold session is promoted first (its pages brought back from the cold tier), within
  // the caller's deadline and cold_tier.operation_timeout; DATA_LOSS when a page of it does
  // not read back intact from any copy (the session stays cold).
  absl::StatusOr<SessionRecord> Reattach(const Caller& caller, std::string_view session_id);
  // Bumps the epoch (fencing the holder's later commits) and marks the session suspended:
  // a candidate for demotion to the cold tier when its tenant's arena runs out of room.
  // Until a Reattach, Offload and Step on it are FAILED_PRECONDITION; Fetch, Stats, List
  // and Close work. Suspending a suspended or cold session returns its record again.
  absl::StatusOr<SessionRecord> SuspendSession(const Caller& caller, std::string_view session_id);
  // DemotePages / PromotePages of an SHM session that demotes pages (TenantSession::MovePages),
  // within the caller's deadline and cold_tier.operation_timeout_ms (a promotion writes its
  // slots only while the call is live, never after it ended). A page named more than
  // once is moved (and charged) once. INVALID_ARGUMENT for more than kMaxPagesPerMove pages
  // or none.
  static constexpr size_t kMaxPagesPerMove = 4096;
  absl::Status MovePages(const Caller& caller, std::string_view session_id, bool demote,
                         uint64_t epoch, const std::vector<TenantSession::PageMove>& pages);
  std::unique_ptr<OffloadStream> NewOffloadStream(const Caller& caller);
  // Checks the request up front: INVALID_ARGUMENT for a bad layer, OUT_OF_RANGE for a page
  // beyond the session's pages, NOT_FOUND for one not committed. A page named more than
  // once is sent once, in the order it was first named.
  absl::StatusOr<std::unique_ptr<FetchCursor>> StartFetch(const Caller& caller,
                                                          std::string_view session_id,
                                                          int64_t layer,
                                                          std::vector<int64_t> pages);
  // GRPC sessions: FAILED_PRECONDITION for SHM ones; INVALID_ARGUMENT for a bad layer or q
  // size; TenantSession::Step's numbering and liveness errors; the Retriever's errors.
  absl::StatusOr<StepResult> Step(const Caller& caller, std::string_view session_id, int64_t layer,
                                  std::string_view q, bool want_output, uint64_t step = 0);
  // GRPC sessions: the engine's signals for the session's policies (TenantSession::
  // ReportSignals; true: a retry, nothing applied again). FAILED_PRECONDITION for SHM ones;
  // INVALID_ARGUMENT for inconsistent sizes, naming the field and the limit.
  absl::StatusOr<bool> ReportSignals(const Caller& caller, std::string_view session_id,
                                     const EngineSignals& signals);
  // The caller's tenant, plus the session when session_id is not empty.
  absl::StatusOr<StatsReport> GetStats(const Caller& caller, std::string_view session_id);
  // Admin: PERMISSION_DENIED unless `token` is the configured admin_token (an empty one
  // refuses every Drain). Starts draining and waits up to `timeout` for the calls in flight.
  absl::StatusOr<DrainResult> Drain(std::string_view token, absl::Duration timeout);

  // --- lifecycle ----------------------------------------------------------------------
  // From now on OpenSession and attaches are refused with UNAVAILABLE. The first call runs
  // the drain listener (the daemon turns its health NOT_SERVING there).
  void StartDrain();
  // Runs once, on the thread of the first StartDrain (not at all when that came before).
  void set_drain_listener(std::function<void()> listener) ABSL_LOCKS_EXCLUDED(mu_);
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // Calls in flight (streams count while open).
  uint32_t InflightCalls() const ABSL_LOCKS_EXCLUDED(mu_);
  // Shutdown with cold_tier.persist_on_shutdown: demotes every session in the host tier to
  // the cold tier (fencing its holder first), so a daemon started later finds it. Sessions
  // are demoted independently, a few at once, each by its own share of the time left to
  // `deadline`, so a slow node holds up only the sessions with keys on it. Sessions that
  // cannot be demoted by then (or whose tenant has no cold tier) are left for
  // CloseAllSessions; each one of a tenant with a cold tier is logged (id, tenant, error).
  // Returns the number demoted.
  size_t PersistAllSessions(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Demotes the suspended session `id` to the cold tier now, as a full arena would
  // (operators, tests). FAILED_PRECONDITION when it is not suspended or its tenant has no
  // cold tier; NOT_FOUND when it is not in the host tier; the cold tier's errors (the
  // session then stays whole where it was).
  absl::Status DemoteSession(std::string_view id, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_) {
    return Demote(std::string(id), /*force=*/false, deadline);
  }
  // Shutdown: closes every session in the host tier (their regions return to the tenants)
  // and forgets the cold ones (their pages and records stay in the cold tier for the next
  // daemon). Calls still holding a session see NOT_FOUND. Returns the number closed.
  size_t CloseAllSessions() ABSL_LOCKS_EXCLUDED(mu_);

  // --- metrics (docs/metrics.md) ---------------------------------------------------------
  // Writes the tenant, arena, session and retrieval families: tenants and arenas as they
  // are, sessions' counters of opens, closes, reattaches and fetched pages, and every open
  // session's committed pages and telemetry block (offload/telemetry.h), read now.
  void WriteMetrics(Exposition& out) const ABSL_LOCKS_EXCLUDED(mu_);

  const DaemonConfig& config() const { return config_; }
  absl::Time start_time() const { return start_time_; }
  // REQUIRES: the name of a configured tenant, for the daemon's own use (logs, tests).
  const Tenant& tenant(const std::string& name) const { return *tenants_.at(name); }
  // Tests only: the cluster connection `tenant`'s cold tier talks through (null when none).
  RedisCluster* ColdClusterForTesting(std::string_view tenant) const;

 private:
  friend class CallSlot;
  friend class InflightCall;
  friend class OffloadStream;
  friend class FetchCursor;
  SessionManager(const DaemonConfig& config, std::unique_ptr<Backend> backend);

  // The caller's session, or NOT_FOUND / PERMISSION_DENIED; a cold session is promoted
  // first (Promote's errors).
  absl::StatusOr<std::shared_ptr<TenantSession>> Find(const Caller& caller,
                                                      std::string_view session_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // --- the cold tier (docs/service.md#the-cold-tier) ---
  struct ColdEntry;
  struct Entry;
  // A copy of the caller's entry (NOT_FOUND like Find), without promoting it.
  absl::StatusOr<Entry> Peek(const Caller& caller, std::string_view session_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  ColdStore* ColdStoreOf(std::string_view tenant) const;
  // A copy of the entry of `id` (any tenant), or nullopt.
  std::optional<Entry> EntryOf(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the hot session `id` to the cold tier (Entry::session → Entry::cold). `force`:
  // a session not suspended too (shutdown).
  absl::Status Demote(const std::string& id, bool force, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Sets (or, with null, clears) the stale record of the session `id`.
  void SetStaleRecord(const std::string& id, std::shared_ptr<const v1::ColdSessionRecord> record)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Brings the cold session `id` back into its tenant's arena; the session.
  absl::StatusOr<std::shared_ptr<TenantSession>> Promote(const std::string& id,
                                                         absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A region of `bytes` in `tenant`'s arena, demoting its suspended sessions (least recently
  // suspended first) while the arena has no room and the tenant has a cold tier.
  absl::StatusOr<RegionLease> AllocateRegion(Tenant& tenant, uint64_t bytes, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The kvtier_cold_* and kvtier_redis_* families (docs/metrics.md), when there is a cold tier.
  void WriteColdMetrics(Exposition& out, const std::vector<std::string>& tenant_names) const;
  // --- persistent arenas (tenant.arena_path) ---
  // Takes up the sessions the table beside each persistent arena lists (Create, before the
  // cold tier's: a session in both is the host tier's).
  absl::Status AdoptPersistentSessions() ABSL_LOCKS_EXCLUDED(mu_);
  // Rewrites the table of `tenant`'s persistent arena from its sessions in the host tier now
  // (nothing for a tenant without one). A failure is logged: the sessions work on, but a
  // restart would not find the change.
  void SaveSessionTable(const std::string& tenant) ABSL_LOCKS_EXCLUDED(mu_, table_mu_);
  bool Persistent(std::string_view tenant) const;
  // Connects the cold tier and takes up its sessions (Create); starts the demoter thread
  // when cold_tier.demote_suspended_after is set.
  absl::Status StartColdTier();
  // The demoter thread: demotes sessions suspended longer than demote_suspended_after, until
  // the manager goes.
  void DemoteSuspendedLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // CloseSession of a cold session: out of the table, out of the cold tier.
  absl::StatusOr<CloseResult> CloseCold(const Caller& caller, const Entry& entry)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The deadline of a demotion or promotion for `caller`: its own, at most
  // cold_tier.operation_timeout from now.
  absl::Time ColdDeadline(const Caller& caller) const;
  Tenant* FindTenant(std::string_view name) const;
  absl::StatusOr<SessionSpec> ResolveSpec(const Caller& caller,
                                          const OpenSessionParams& params) const;
  absl::Status ReserveSession(const Tenant& tenant) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<SessionRecord> DoOpenSession(const Caller& caller,
                                              const OpenSessionParams& params);
  // The open session of (tenant, request_id), or nullopt; ABORTED while one is opening,
  // FAILED_PRECONDITION when its parameters differ from `fingerprint`'s.
  absl::StatusOr<std::optional<SessionRecord>> ClaimRequestId(const std::string& key,
                                                              const std::string& fingerprint)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<bool> DoReportSignals(const Caller& caller, std::string_view session_id,
                                       const EngineSignals& signals);
  absl::StatusOr<StepResult> DoStep(const Caller& caller, std::string_view session_id,
                                    int64_t layer, std::string_view q, bool want_output,
                                    uint64_t step);
  // Removes `id` from the table; the session it was (or null).
  std::shared_ptr<TenantSession> Remove(std::string_view id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::unique_ptr<FetchCursor>> DoStartFetch(const Caller& caller,
                                                            std::string_view session_id,
                                                            int64_t layer,
                                                            std::vector<int64_t> pages);
  // Counts an error against the caller's tenant (refused_requests) and returns it.
  absl::Status Tally(const Caller& caller, absl::Status status) const;
  template <typename T>
  absl::StatusOr<T> Tally(const Caller& caller, absl::StatusOr<T> result) const {
    if (!result.ok()) (void)Tally(caller, result.status());
    return result;
  }
  void EndCall() ABSL_LOCKS_EXCLUDED(mu_);
  void EndTenantCall(const std::string& tenant) ABSL_LOCKS_EXCLUDED(mu_);

  const DaemonConfig config_;
  const absl::Time start_time_;
  std::atomic<bool> draining_{false};

  // Declaration order is destruction order reversed: sessions go before the tenants whose
  // arenas hold them, and the arenas before the backend they are registered with.
  const std::unique_ptr<Backend> backend_;
  absl::flat_hash_map<std::string, std::unique_ptr<Tenant>> tenants_;  // fixed after Create
  // The cold tier: the daemon's cluster connection, and per tenant with a cold quota its
  // own connection (when it has a Redis ACL user), tier and store. Fixed after Create.
  struct TenantCold {
    std::unique_ptr<RedisCluster> own_cluster;
    std::unique_ptr<ColdTier> tier;
    std::unique_ptr<ColdStore> store;
  };
  std::unique_ptr<RedisCluster> cluster_;
  absl::flat_hash_map<std::string, TenantCold> cold_;

  mutable Mutex mu_;
  CondVar idle_;  // signalled when inflight_ drops to 0
  uint32_t inflight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Sessions being opened, per tenant: count towards max_sessions_per_tenant.
  absl::flat_hash_map<std::string, uint32_t> opening_ ABSL_GUARDED_BY(mu_);
  // Calls in flight per tenant (CallSlots).
  absl::flat_hash_map<std::string, uint32_t> tenant_calls_ ABSL_GUARDED_BY(mu_);
  std::function<void()> drain_listener_ ABSL_GUARDED_BY(mu_);
  // A demoted session: its record (as stored) and its resolved parameters.
  struct ColdEntry {
    v1::ColdSessionRecord record;
    SessionSpec spec;
    SessionRecord Record() const;
  };
  struct Entry {
    uint64_t seq = 0;  // creation order, for ListSessions
    std::string tenant;
    std::shared_ptr<TenantSession> session;  // null while cold
    std::shared_ptr<const ColdEntry> cold;   // set while cold
    // While hot: the record of a demotion that failed after writing it and could not remove
    // it (ColdStore::WriteRecord's left_listed), its pages kept under it so that a restart
    // that takes the session up from it loses nothing; removed by the next demotion or the
    // close.
    std::shared_ptr<const v1::ColdSessionRecord> stale_record;
    std::string request_key;  // key of requests_, or empty
    OpenSessionParams params;  // as opened (what a cold record keeps)
    absl::Time suspended_at = absl::InfiniteFuture();  // the last SuspendSession
    // Serializes the moves of this session between the tiers.
    std::shared_ptr<Mutex> move_mu = std::make_shared<Mutex>();
    SessionRecord Record() const { return session != nullptr ? session->Record() : cold->Record(); }
  };
  absl::flat_hash_map<std::string, Entry> sessions_ ABSL_GUARDED_BY(mu_);
  // OpenSession idempotency: tenant + NUL + request_id → the session it opened (empty while
  // it is being opened) and the request's parameters.
  struct RequestEntry {
    std::string session_id;
    std::string fingerprint;
  };
  absl::flat_hash_map<std::string, RequestEntry> requests_ ABSL_GUARDED_BY(mu_);
  Mutex table_mu_;  // serializes SaveSessionTable's writes
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // the destructor runs: the demoter ends
  CondVar stopping_cv_;
  std::thread demoter_;  // joined by the destructor
  // Metrics: {event ("opened", "closed", "reattached"), tenant, transport}, and {tenant}.
  Counters session_events_;
  Counters fetched_pages_;
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_SESSION_MANAGER_H_
