// TenantSession: one session of kvtierd (DESIGN.md §2) — its region of the tenant arena
// (offload/session_region.h) and, for GRPC sessions, the daemon-side Retriever on the CPU
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
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/tenant.h"
#include "kernels/backend.h"
#include "kvtier/client.h"
#include "kvtier/geometry.h"
#include "kvtier/mutex.h"
#include "kvtier/retriever.h"
#include "offload/page_pool.h"
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
  RetrieverOptions retriever;
  int32_t max_pages() const {
    return (retriever.max_tokens + geometry.page_size - 1) / geometry.page_size;
  }
};

// What ListSessions, OpenSession and Reattach report about a session.
struct SessionRecord {
  std::string id;
  SessionSpec spec;
  bool closing = false;
  uint64_t region_offset = 0;  // bytes from the arena's first byte
  uint64_t region_bytes = 0;
  uint64_t epoch = 0;
  // Per layer. SHM: the committed prefix of the region's directory × page size. GRPC: the
  // tokens the daemon's Retriever holds (including the partial page's).
  std::vector<uint64_t> committed_tokens;
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
};

struct SessionStatsRecord {
  std::string session_id;
  RetrieverStats retriever;  // zero for SHM sessions (their Retriever runs in the engine)
  uint64_t committed_pages = 0;
};

struct CloseResult {
  uint64_t freed_bytes = 0;
  uint64_t committed_pages = 0;
};

class TenantSession {
 public:
  // Formats `lease` as the session's region and, for GRPC sessions, creates the Retriever on
  // `backend` (REQUIRES: non-null for GRPC; the tenant arena is registered with it; it
  // outlives the session). REQUIRES: spec is validated; lease holds the ComputeRegionLayout
  // of spec.
  static absl::StatusOr<std::shared_ptr<TenantSession>> Create(std::string id, SessionSpec spec,
                                                               RegionLease lease, Backend* backend);
  TenantSession(const TenantSession&) = delete;
  TenantSession& operator=(const TenantSession&) = delete;
  ~TenantSession();

  const std::string& id() const { return id_; }
  const SessionSpec& spec() const { return spec_; }
  const std::string& tenant() const { return spec_.tenant; }
  bool closing() const { return closing_.load(std::memory_order_acquire); }

  SessionRecord Record() const ABSL_LOCKS_EXCLUDED(info_mu_);
  // Tokens of `layer` as Record() counts them. REQUIRES: 0 <= layer < num_layers.
  uint64_t LayerTokens(int32_t layer) const ABSL_LOCKS_EXCLUDED(info_mu_);

  // GRPC: appends every chunk to the Retriever, layer by layer in order, waits for the work,
  // and commits the pages that were stored. Returns the tokens per layer afterwards.
  // REQUIRES: every chunk was validated against this session. NOT_FOUND once closed.
  absl::StatusOr<std::vector<uint64_t>> Apply(const std::vector<OffloadChunk>& chunks)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The committed pages among `pages` of `layer` (all of them when empty): OUT_OF_RANGE
  // for a page beyond the layout, NOT_FOUND for one not committed (only when named).
  absl::StatusOr<std::vector<int64_t>> CommittedPages(int32_t layer,
                                                      const std::vector<int64_t>& pages) const;
  // Copies committed pages out of the region, with the range checks of
  // SessionRegion::Lookup. ABORTED when an SHM writer re-committed a page while it was read.
  absl::StatusOr<std::vector<PageData>> ReadPages(int32_t layer, const int64_t* pages, size_t count)
      ABSL_LOCKS_EXCLUDED(mu_);

  // GRPC: one step of `layer` with q [Hq][d] (REQUIRES: layer and q size validated).
  absl::StatusOr<StepResult> Step(int32_t layer, std::string_view q, bool want_output)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Bumps the region's epoch and returns the session's record.
  SessionRecord Reattach();
  absl::StatusOr<SessionStatsRecord> Stats() ABSL_LOCKS_EXCLUDED(mu_);

  // Closes the Retriever and frees the pool; the region returns to the tenant when the last
  // reference to the session is dropped. NOT_FOUND when already closed.
  absl::StatusOr<CloseResult> Close() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  TenantSession(std::string id, SessionSpec spec, RegionLease lease, SessionRegion region,
                Backend* backend, int64_t created_unix_ms);
  absl::Status CheckOpen() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CommitStoredPages() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishTokens() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_LOCKS_EXCLUDED(info_mu_);

  const std::string id_;
  const SessionSpec spec_;
  const int64_t created_unix_ms_;
  // The region stays leased until the session is destroyed, so readers that hold a
  // reference never read memory another session was given.
  const RegionLease lease_;
  SessionRegion region_;    // its methods are safe to call from any thread
  Backend* const backend_;  // GRPC only
  std::atomic<bool> closing_{false};

  mutable Mutex mu_;  // serializes the calls that drive the session
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<PagePool> pool_ ABSL_GUARDED_BY(mu_);  // GRPC only
  std::unique_ptr<Retriever> retriever_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> steps_ ABSL_GUARDED_BY(mu_);  // per layer: steps run (EndStep calls)

  mutable Mutex info_mu_;
  std::vector<uint64_t> grpc_tokens_ ABSL_GUARDED_BY(info_mu_);  // GRPC: per layer
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_TENANT_SESSION_H_
