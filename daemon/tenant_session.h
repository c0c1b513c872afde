// TenantSession: one session of kvtierd (docs/architecture.md#processes) — its region of the tenant
// arena (offload/session_region.h) and, for GRPC sessions, the daemon-side Retriever on the CPU
// backend over a PagePool of the region's slots. The SessionManager validates requests,
// resolves the parameters and checks who may call; this class runs the session's share of
// each call: apply offloaded tokens and commit their pages, read committed pages, run a
// step, bump the epoch, close.
//
// Also the domain types the SessionManager's API speaks (no proto types: kvtier_service.cc
// converts).
//
// Thread-safe. One call drives the session at a time (a per-session mutex: concurrent calls
// for the same session serialize); Record() and the accessors do not wait for it.
#ifndef KVTIER_DAEMON_TENANT_SESSION_H_
#define KVTIER_DAEMON_TENANT_SESSION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "daemon/caller.h"
#include "daemon/cold_store.h"
#include "daemon/cold_tier.h"
#include "daemon/page_mover.h"
#include "daemon/tenant.h"
#include "kernels/backend.h"
#include "kvtier/geometry.h"
#include "kvtier/protocol.h"
#include "offload/page_pool.h"
#include "offload/retriever.h"
#include "offload/session_region.h"

namespace kvtier::daemon {

// A session's parameters after the daemon filled in its defaults.
struct SessionSpec {
  std::string tenant;
  std::string label;
  Geometry geometry;
  Transport transport = Transport::kShm;
  int32_t budget_tokens = 0;  // tokens per layer in the working set
  // mode, sink/selected/recent pages, max_tokens (per layer), τ; the rest default.
  SequenceOptions sequence;
  int32_t max_pages() const {
    return (sequence.max_tokens + geometry.page_size - 1) / geometry.page_size;
  }
  // Pages per layer the host tier holds (retrieval.host_tokens); max_pages() unless the
  // session demotes pages (policy.host_drop = demote).
  int32_t host_pages = 0;
  // Slots of the session's region: host_pages for every layer.
  int64_t host_slots() const { return int64_t{geometry.num_layers} * host_pages; }
  bool demotes_pages() const { return host_pages < max_pages(); }
};

// What ListSessions, OpenSession and Reattach report about a session.
struct SessionRecord {
  std::string id;
  SessionSpec spec;
  bool closing = false;
  bool suspended = false;  // SuspendSession: no holder; may be demoted when the arena is full
  bool cold = false;       // demoted: its pages are in the cold tier, no region (offset 0)
  uint64_t region_offset = 0;  // bytes from the arena's first byte
  uint64_t region_bytes = 0;
  uint64_t epoch = 0;
  // Per layer. SHM: the committed prefix of the region's directory × page size. GRPC: the
  // tokens the daemon's Retriever holds (including the partial page's).
  std::vector<uint64_t> committed_tokens;
  std::vector<uint64_t> steps_run;  // GRPC: per layer, steps the daemon's Retriever ran
  int64_t created_unix_ms = 0;
};

// One OffloadRequest: K and V NHD [num_tokens][Hkv][d] in the session dtype.
struct OffloadChunk {
  std::string session_id;
  int64_t layer = 0;
  int64_t num_tokens = 0;
  std::string k;
  std::string v;
  bool commit = false;
  std::optional<uint64_t> start_token;  // the layer's index of the first token, when given
};

// A committed host page read back: HND [Hkv][2][p][d].
struct PageData {
  int32_t layer = 0;
  int64_t page = 0;
  uint64_t generation = 0;
  std::string data;
};

// What one Step returned.
struct StepResult {
  int32_t layer = 0;
  int32_t num_tokens = 0;
  int32_t num_slots = 0;
  std::vector<int32_t> slot_table;  // [Hkv][num_slots]
  std::string output;               // [Hq][d], session dtype; empty without want_output
  std::vector<float> lse;           // [Hq]; empty without want_output
  int32_t corrected_heads = 0;
  uint64_t step = 0;      // the layer's count of steps run, this one included
  bool replayed = false;  // an earlier run's reply, sent again (nothing ran)
};

// What a GRPC session's engine reports for its policies (ReportSignalsRequest): the signals of
// tokens first_position .. + num_tokens − 1 (none when num_tokens is 0), and the prompt's last
// queries of one layer (none when observe_q is empty).
struct EngineSignals {
  int64_t first_position = 0;
  int32_t num_tokens = 0;
  std::vector<float> logits;
  std::optional<LogitSummary> logit_summary;
  std::vector<float> hidden_delta;  // [num_tokens][num_layers]
  int32_t num_layers = 0;
  int32_t observe_layer = 0;
  std::string observe_q;  // [n][Hq][d], session dtype
  int64_t observe_first_position = 0;
};

// Trailing metadata of a refused numbered Step: the layer's count of steps run.
inline constexpr char kStepsRunTrailer[] = "x-kvtier-steps-run";

struct SessionStatsRecord {
  std::string session_id;
  SequenceStats sequence;  // zero for SHM sessions (their Retriever runs in the engine)
  uint64_t committed_pages = 0;
};

struct CloseResult {
  uint64_t freed_bytes = 0;
  uint64_t committed_pages = 0;
};

class TenantSession {
 public:
  // Formats `lease` as the session's region and, for GRPC sessions, creates the Retriever on
  // `backend` with every allocation charged to `budget` (REQUIRES: both non-null for GRPC;
  // the tenant arena is registered with the backend; both outlive the session); the
  // budget's RESOURCE_EXHAUSTED when the Retriever does not fit. REQUIRES: spec is
  // validated; lease holds the ComputeRegionLayout of spec.
  // `demote_to`: the tenant's cold store, for a GRPC session whose host tier holds fewer pages
  // than the session (SessionSpec::demotes_pages; null otherwise): its Retriever demotes
  // pages there through a PageMover (daemon/page_mover.h), each batch within `cold_timeout` and,
  // during Apply and Step, by their caller's deadline.
  static absl::StatusOr<std::shared_ptr<TenantSession>> Create(
      std::string id, SessionSpec spec, RegionLease lease, Backend* backend, MemoryBudget* budget,
      ColdStore* demote_to = nullptr, absl::Duration cold_timeout = absl::Seconds(10));
  // Where a session that existed before comes back from.
  struct Resume {
    int64_t created_unix_ms = 0;
    uint64_t epoch = 0;  // the last epoch given out: the session moves past it
    bool suspended = false;
  };
  // A session that existed before, its pages where `from` says (one way for both):
  //  - null: its region survived in a persistent arena (tenant.arena_path), taken up after a
  //    daemon restart: `lease` is opened (SessionRegion::Open's checks; its shape must be the
  //    spec's: FAILED_PRECONDITION otherwise) and its committed pages are the session's;
  //  - a cold session's mover (daemon/page_mover.h), holding the pages its record names
  //    (each layer's committed prefix): `lease` is formatted like Create and each layer's
  //    pages are promoted back in one batch, by the mover's deadline (its CallScope), into
  //    the region's slots, committed with their generations. A session that demotes pages
  //    (SessionSpec::demotes_pages) takes them instead into its host tier as it takes new
  //    pages: a GRPC one appends them, layer by layer, to a fresh Retriever whose host tier
  //    demotes to `demote_to` as it fills; an SHM one demotes them under its live keys in
  //    `demote_to` and keeps an empty region, for its engine's Reattach.
  // Then the region's epoch moves past `resume.epoch` (and the header's, fencing a holder that
  // outlived the old daemon) and a GRPC session's Retriever is rebuilt from the committed
  // pages (Retriever::Restore). The mover's errors as they are (DATA_LOSS naming a page with
  // no intact copy; the lease is then freed); OUT_OF_RANGE for more pages than a layer holds,
  // DATA_LOSS for a layer whose pages are not a prefix; FAILED_PRECONDITION for a session that
  // demotes pages with no `demote_to`, or from a region.
  static absl::StatusOr<std::shared_ptr<TenantSession>> Restore(
      std::string id, SessionSpec spec, RegionLease lease, Backend* backend, MemoryBudget* budget,
      const Resume& resume, PageMover* from, ColdStore* demote_to = nullptr,
      absl::Duration cold_timeout = absl::Seconds(10));
  TenantSession(const TenantSession&) = delete;
  TenantSession& operator=(const TenantSession&) = delete;
  ~TenantSession();

  const std::string& id() const { return id_; }
  const SessionSpec& spec() const { return spec_; }
  const std::string& tenant() const { return spec_.tenant; }
  bool closing() const { return closing_.load(std::memory_order_acquire); }
  bool suspended() const { return suspended_.load(std::memory_order_acquire); }
  // Closed because its pages moved to the cold tier (Demote): a caller that still held this
  // object finds the session again, cold, in the SessionManager.
  bool demoted() const { return demoted_.load(std::memory_order_acquire); }

  SessionRecord Record() const ABSL_LOCKS_EXCLUDED(info_mu_);
  // Tokens of `layer` as Record() counts them. REQUIRES: 0 <= layer < num_layers.
  uint64_t LayerTokens(int32_t layer) const ABSL_LOCKS_EXCLUDED(info_mu_);

  // GRPC: appends every chunk to the Retriever, layer by layer in order, waits for the work,
  // and commits the pages that were stored. Returns the tokens per layer afterwards. Starts
  // only while `caller` is live (its error otherwise, nothing applied); once started it
  // completes, but the demotions it needs end by the caller's deadline: one cut off fails
  // the commit with nothing leaving the host tier. REQUIRES: every chunk was validated against
  // this session. NOT_FOUND once closed.
  absl::StatusOr<std::vector<uint64_t>> Apply(const std::vector<OffloadChunk>& chunks,
                                              const Caller& caller, std::string_view what)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The committed pages among `pages` of `layer` (all of them when empty): OUT_OF_RANGE
  // for a page beyond the layout, NOT_FOUND for one not committed (only when named).
  absl::StatusOr<std::vector<int64_t>> CommittedPages(int32_t layer,
                                                      const std::vector<int64_t>& pages) const;
  // Copies committed pages out of the region, with the range checks of
  // SessionRegion::Lookup. ABORTED when an SHM writer re-committed a page while it was read.
  // A page the session demoted is read from the cold tier by `deadline` (the Fetch's; its
  // errors; DATA_LOSS when no intact copy is left).
  absl::StatusOr<std::vector<PageData>> ReadPages(int32_t layer, const int64_t* pages, size_t count,
                                                  absl::Time deadline = absl::InfiniteFuture())
      ABSL_LOCKS_EXCLUDED(mu_);

  // SHM sessions that demote pages (DemotePages / PromotePages): moves `pages` between the
  // region and the cold tier for the engine's Retriever, whose epoch is `epoch`
  // (FAILED_PRECONDITION when the region moved past it), by `caller`'s deadline (and the
  // cold timeout). A move named more than once is made once. Demote: each page must be
  // committed in its slot with its generation (FAILED_PRECONDITION otherwise); its bytes go
  // to the cold tier. Promote: the pages are read into buffers first; then, only while
  // `caller` is live (its DEADLINE_EXCEEDED / CANCELLED otherwise, no slot touched), each
  // page's bytes are written into its slot (the engine's, free): once the call has ended the
  // engine owns those slots again. Range errors are OUT_OF_RANGE; a session that does not
  // demote pages, or a GRPC one (its own Retriever moves them), FAILED_PRECONDITION; the cold
  // tier's errors.
  struct PageMove {
    int32_t layer = 0;
    int64_t page = 0;
    int64_t slot = 0;
    uint64_t generation = 0;
  };
  absl::Status MovePages(bool demote, uint64_t epoch, const std::vector<PageMove>& pages,
                         const Caller& caller) ABSL_LOCKS_EXCLUDED(mu_);

  // GRPC: one step of `layer` with q [Hq][d] (REQUIRES: layer and q size validated).
  // `step` numbers it (StepRequest.step; 0: unnumbered): step n runs when the layer has run
  // n − 1, and when it has run n with the same q the kept reply comes back (replayed)
  // without running; otherwise FAILED_PRECONDITION with the kStepsRunTrailer. A step starts
  // only while `caller` is live (its error otherwise, nothing run); once started it
  // completes and its reply is kept for a retry, even when the caller's deadline passes;
  // only its cold-tier I/O (host_drop = demote) ends by the deadline, and a promotion cut off
  // fails the step and the session's Retriever, as any promotion that fails does.
  absl::StatusOr<StepResult> Step(int32_t layer, std::string_view q, bool want_output,
                                  uint64_t step, const Caller& caller) ABSL_LOCKS_EXCLUDED(mu_);
  // GRPC: hands the engine's signals to the Retriever's policies (REQUIRES: sizes validated).
  // Signals whose tokens end at or before those already reported, and an observation window
  // of a layer and first position already applied, are a retry: true (replayed) and nothing
  // applied again. Runs only while `caller` is live.
  absl::StatusOr<bool> ReportSignals(const EngineSignals& signals, const Caller& caller)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Bumps the region's epoch past every epoch it had and returns the session's record;
  // FAILED_PRECONDITION when the epoch cannot advance (the shared header was overwritten
  // with the largest value).
  absl::StatusOr<SessionRecord> Reattach() ABSL_LOCKS_EXCLUDED(mu_);
  // Bumps the epoch like Reattach and marks the session suspended: Apply and Step are
  // FAILED_PRECONDITION until the next Reattach. Idempotent.
  absl::StatusOr<SessionRecord> Suspend() ABSL_LOCKS_EXCLUDED(mu_);

  // What a whole-session demotion hands its record.
  struct Demoted {
    uint64_t epoch = 0;  // the last epoch given out
    // [num_layers]: the generations of each layer's committed prefix, pages 0..n-1.
    std::vector<std::vector<uint64_t>> generations;
  };
  // Moves the session out of the host tier: with the session held (no call runs on it),
  // every page of each layer's committed prefix is demoted through `to` in one batch by
  // `deadline` (pages the session had demoted itself are promoted from its live keys
  // first), then `record` gets what was demoted. When both succeed the session is closed as
  // demoted (Close's work; the region returns to the tenant when the last reference goes):
  // its host tier holds no pages. Else it stays as it was and the error comes back (what
  // `to` stored is `to`'s to remove). FAILED_PRECONDITION unless the session is suspended (or
  // `force`: shutdown); NOT_FOUND when closed.
  absl::StatusOr<CloseResult> Demote(PageMover& to, absl::Time deadline, bool force,
                                     const std::function<absl::Status(const Demoted&)>& record)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of the cold quota its own demoted pages (policy.host_drop = demote; its live keys)
  // are charged; 0 for a session that demotes nothing.
  uint64_t LiveColdBytes() const {
    return cold_pages_ != nullptr ? cold_pages_->ChargedBytes() : 0;
  }
  absl::StatusOr<SessionStatsRecord> Stats() ABSL_LOCKS_EXCLUDED(mu_);
  // The region's telemetry block as its writer last published it (nullopt when it does
  // not read back: overwritten by the engine). Does not wait for a call in progress.
  std::optional<TelemetryValues> Telemetry() const { return region_.telemetry().Read(); }
  // (layer, page) pairs committed in the region now. Does not wait either.
  // Pages the session demoted (policy.host_drop = demote) count too.
  uint64_t CommittedPageCount() const {
    return static_cast<uint64_t>(region_.CommittedPages()) + DemotedPageCount();
  }

  // Closes the Retriever and frees the pool; the region returns to the tenant when the last
  // reference to the session is dropped. NOT_FOUND when already closed.
  absl::StatusOr<CloseResult> Close() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  TenantSession(std::string id, SessionSpec spec, RegionLease lease, SessionRegion region,
                std::unique_ptr<Backend> backend, int64_t created_unix_ms);
  // Restore's second half, for a session that demotes pages: each layer's pages, promoted
  // through `from`, taken into the session's host tier as new pages are (REQUIRES: mu_ held,
  // the live mover set; GRPC: the fresh Retriever open).
  absl::Status TakeDemotingPages(PageMover& from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckOpen() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CheckOpen, and FAILED_PRECONDITION while suspended (`what` names the call).
  absl::Status CheckWritable(std::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pages in the cold tier and not in the region (demoted, not promoted since).
  uint64_t DemotedPageCount() const;
  // Close's work (REQUIRES: open).
  CloseResult CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs a step the numbering admitted (REQUIRES: mu_ held, open, GRPC). *advanced: whether
  // the Retriever moved to the next step (it ran EndStep), even when the step failed.
  absl::StatusOr<StepResult> RunStep(int32_t layer, std::string_view q, bool want_output,
                                     bool* advanced) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishTokens() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_LOCKS_EXCLUDED(info_mu_);

  const std::string id_;
  const SessionSpec spec_;
  const int64_t created_unix_ms_;
  // The region stays leased until the session is destroyed, so readers that hold a
  // reference never read memory another session was given.
  const RegionLease lease_;
  SessionRegion region_;  // its methods are safe to call from any thread
  // GRPC only: the daemon's backend, charging the tenant for every allocation.
  const std::unique_ptr<Backend> backend_;
  std::atomic<bool> closing_{false};
  std::atomic<bool> suspended_{false};
  std::atomic<bool> demoted_{false};

  // Per layer: steps run (EndStep calls) and the last one's request and reply.
  struct LayerSteps {
    uint64_t run = 0;
    std::string q;
    bool want_output = false;
    StepResult reply;
  };

  mutable Mutex mu_;  // serializes the calls that drive the session
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 1;              // the last epoch Reattach gave out
  // host_drop = demote: the mover of the pages the Retriever (or the engine) demoted, under
  // the session's live keys (set by the factories, then only used: it is thread-safe).
  // Declared before the Retriever, so it is destroyed after it.
  std::unique_ptr<PageMover> cold_pages_;
  // GRPC only: over the region's slots (offload/region_host_tier.h).
  std::unique_ptr<Retriever> retriever_ ABSL_GUARDED_BY(mu_);
  std::vector<LayerSteps> steps_ ABSL_GUARDED_BY(mu_);
  int64_t signals_end_ ABSL_GUARDED_BY(mu_) = 0;  // GRPC: tokens whose signals were applied
  // GRPC: the observation windows applied, by (layer, first position): a retry applies none.
  std::set<std::pair<int32_t, int64_t>> observed_ ABSL_GUARDED_BY(mu_);

  mutable Mutex info_mu_;
  std::vector<uint64_t> grpc_tokens_ ABSL_GUARDED_BY(info_mu_);  // GRPC: per layer
  std::vector<uint64_t> steps_run_ ABSL_GUARDED_BY(info_mu_);    // GRPC: steps_[l].run
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_TENANT_SESSION_H_
