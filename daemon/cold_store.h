// ColdStore: one tenant's share of the cold tier (docs/service.md#the-cold-tier): the
// sessions it demoted, as records and pages in the Redis Cluster, and its cold quota. The
// SessionManager decides when a session moves. Its pages move only through a PageMover
// (daemon/page_mover.h), which writes and reads them here (PutPages, GetPages); this class
// stores them, the session's record and the quota's charges. A cold session is its pages
// under its own keys plus its record.
//
// Keys, all under the tenant's prefix so a Redis ACL user per tenant ("~<prefix>:<tenant>:*")
// reaches exactly its own:
//   <prefix>:<tenant>:{<session>:<layer>}:<page>   a page (daemon/cold_tier.h)
//   <prefix>:<tenant>:{<session>}:meta             the session's ColdSessionRecord
//   <prefix>:<tenant>:sessions                     a set of the tenant's demoted session ids
// A session is written pages first (its mover), then its record, then its index entry; it is
// removed in the reverse order. So a record names only pages that were stored, and a daemon
// that died half-way leaves at worst pages without a record (written again by the next
// demotion).
//
// With min_replicas > 0 a write counts only after WAIT saw that many replicas acknowledge it
// on every node it went to: a demotion acknowledged survives the loss of a master.
//
// Thread-safe.
#ifndef KVTIER_DAEMON_COLD_STORE_H_
#define KVTIER_DAEMON_COLD_STORE_H_

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/cold_tier.h"
#include "daemon/redis_cluster.h"
#include "kvtier/v1/cold_record.pb.h"

namespace kvtier::daemon {

struct ColdStoreOptions {
  std::string tenant;
  uint64_t quota_bytes = 0;   // 0: nothing may be demoted
  uint32_t min_replicas = 0;  // WAIT for this many after every write
  // The cluster's round-trip timeout: a WAIT waits at most 3/4 of it.
  absl::Duration command_timeout = absl::Seconds(2);
};

struct ColdStoreStats {
  uint64_t used_bytes = 0;  // pages of the tenant's cold sessions (values, headers included)
  uint64_t sessions = 0;    // cold sessions counted in used_bytes
  uint64_t demoted_sessions = 0;
  uint64_t promoted_sessions = 0;
  uint64_t demoted_pages = 0;
  uint64_t promoted_pages = 0;
  uint64_t demoted_bytes = 0;
  uint64_t promoted_bytes = 0;
  uint64_t failures = 0;  // writes, reads or removals that failed
  uint64_t data_loss = 0;  // pages refused: no intact copy
  // Pages of live sessions (PutPage, GetPage): demoted, promoted.
  uint64_t live_demoted_pages = 0;
  uint64_t live_promoted_pages = 0;
};

class ColdStore {
 public:
  // `cluster` and `tier` (over that cluster) must outlive the store.
  ColdStore(RedisCluster* cluster, ColdTier* tier, std::string prefix, ColdStoreOptions options);
  ColdStore(const ColdStore&) = delete;
  ColdStore& operator=(const ColdStore&) = delete;

  // What a session's record and index entry are charged, whatever their size, so that the
  // quota bounds the number of cold sessions too.
  static constexpr uint64_t kSessionOverheadBytes = 4096;
  // Bytes a session of `pages` pages of `page_bytes` is charged in the cold tier: its values
  // (headers included) and kSessionOverheadBytes.
  static uint64_t ValueBytes(uint64_t pages, uint64_t page_bytes) {
    return pages * (page_bytes + kColdHeaderBytes) + kSessionOverheadBytes;
  }

  // Reserves `bytes` of the quota: RESOURCE_EXHAUSTED "tenant 'a': demoting session s needs
  // N bytes of the cold tier, M of Q bytes free (tenant.cold_quota_bytes)". `overdraft`: how
  // far past the quota this reservation may take the tenant's charges — the charge of a copy
  // that the move it is made for replaces (a session that demotes pages has its pages under
  // two sets of keys while it moves whole: PageMover::SetOverdraft). Charges stay exact.
  absl::Status Reserve(std::string_view session, uint64_t bytes, uint64_t overdraft = 0);
  void Unreserve(uint64_t bytes);

  // Writes `record` (its layers' generations filled in: each layer's committed prefix, whose
  // pages a PageMover over the session's keys has stored) and then the index entry. OK once
  // both are on their masters (and, with min_replicas, acknowledged by that many replicas);
  // on error the record and the entry are removed again as far as the cluster lets them
  // (the session stays in the host tier). REQUIRES: the quota was reserved for the record
  // (kSessionOverheadBytes; the mover charged the pages).
  // `*left_listed` (when given) says, on error, whether the record may still be listed: the
  // removal of neither the index entry nor the record is known to have succeeded, so a
  // restart may take the session up from it — its pages must then stay (KeepListed).
  absl::Status WriteRecord(v1::ColdSessionRecord& record, absl::Time deadline,
                           bool* left_listed = nullptr);
  // Counts a record WriteRecord left listed as a cold session's (its charges, taken for its
  // writing, stay): Remove takes it away like any other.
  void KeepListed() { sessions_.fetch_add(1, std::memory_order_relaxed); }

  // Removes the index entry, the record and then the pages (absent ones are fine); the
  // pages stay when the first two fail. The record's charge is returned whatever happens
  // (the keys left are logged) — unless `keep_if_listed`: then, when the index entry or the
  // record could not be removed, nothing changes and the error comes back.
  absl::Status Remove(const v1::ColdSessionRecord& record, absl::Time deadline,
                      bool keep_if_listed = false);

  // Every record the tenant's index lists (a start-up after a restart); the records are
  // counted in used_bytes. A listed id whose record is missing or does not parse is skipped
  // with a warning (and left for an operator).
  absl::StatusOr<std::vector<v1::ColdSessionRecord>> LoadAll(absl::Time deadline);

  // Pages under the keys of `session` (a PageMover's: daemon/page_mover.h): writes them and,
  // with min_replicas, WAITs as Write does. Several pages at once: one pipeline per layer,
  // one WAIT per node. REQUIRES: the caller reserved their values (page and header;
  // Reserve). On error the pages must stay in the host tier, but some may be stored all the
  // same (written, then WAIT failed or the deadline came): their charge stays, and the caller
  // removes them with RemovePages, which returns it. `live`: counted as a live session's
  // pages (else a whole session's, counted by its record).
  absl::Status PutPages(std::string_view session, std::span<const ColdPageRef> pages,
                        absl::Time deadline, bool live = true);
  // Reads such pages of one layer back (one pipeline), each of its generation: per page,
  // DATA_LOSS when there is no intact copy, when it is missing or of another generation (it
  // was acknowledged); the cluster's errors.
  std::vector<absl::StatusOr<ColdPage>> GetPages(std::string_view session, int32_t layer,
                                                 std::span<const int64_t> pages,
                                                 std::span<const uint64_t> generations,
                                                 absl::Time deadline, bool live = true);
  // Removes such pages of one layer (absent ones are fine) and returns their charge to the
  // quota whatever happens (keys that could not be removed are logged).
  absl::Status RemovePages(std::string_view session, int32_t layer, std::span<const int64_t> pages,
                           uint64_t page_bytes, absl::Time deadline);
  // Counts a promotion (the record's pages were read back).
  void CountPromoted(const v1::ColdSessionRecord& record);
  void CountDataLoss() { data_loss_.fetch_add(1, std::memory_order_relaxed); }
  // Stops counting a record LoadAll counted (its session is taken from elsewhere); its keys
  // stay.
  void Forget(const v1::ColdSessionRecord& record) {
    Unreserve(RecordBytes(record));
    sessions_.fetch_sub(1, std::memory_order_relaxed);
  }

  ColdStoreStats stats() const;
  const ColdStoreOptions& options() const { return options_; }
  std::string RecordKey(std::string_view session) const;
  std::string IndexKey() const;
  // Bytes of the record's pages (ValueBytes).
  static uint64_t RecordBytes(const v1::ColdSessionRecord& record);

 private:
  // WAIT min_replicas on the node of every key in `keys` (no-op when min_replicas is 0).
  absl::Status WaitForReplicas(const std::vector<std::string>& keys, absl::Time deadline);

  RedisCluster* const cluster_;
  ColdTier* const tier_;
  const std::string prefix_;
  const ColdStoreOptions options_;
  const absl::Duration wait_timeout_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> sessions_{0};
  std::atomic<uint64_t> demoted_sessions_{0}, promoted_sessions_{0};
  std::atomic<uint64_t> demoted_pages_{0}, promoted_pages_{0};
  std::atomic<uint64_t> demoted_bytes_{0}, promoted_bytes_{0};
  std::atomic<uint64_t> failures_{0}, data_loss_{0};
  std::atomic<uint64_t> live_demoted_pages_{0}, live_promoted_pages_{0};
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_COLD_STORE_H_
