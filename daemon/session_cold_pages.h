// SessionColdPages: the cold tier behind one live session's host tier (policy.host_drop =
// demote; offload/cold_pages.h, docs/service.md#the-cold-tier): the daemon's Retriever's for a
// GRPC session, DemotePages / PromotePages for an SHM one. Pages are demoted here when the
// region's slots are full, under the page keys of the cold tier (daemon/cold_tier.h), each
// charged to the tenant's cold quota and, with cold_tier.min_replicas, acknowledged by that
// many replicas before its slot is freed (under keys of their own: "<session>.live"). A page
// comes back checked against the generation it was written with: no intact copy is DATA_LOSS.
// Fetch reads demoted pages here too. The keys go when the session is closed (RemoveAll).
//
// Charges: each page key is charged once, its value's size (page and header), from its first
// write until RemoveAll. A page demoted again with the generation it holds is not written
// again; with another generation its key is written over and keeps its one charge. A batch
// that fails may have stored some of its pages unacknowledged: they are not held (never read
// back), but stay charged, and RemoveAll removes them with the rest.
//
// Every call has the deadline `timeout` from its start (cold_tier.operation_timeout_ms), or
// the earlier one it is given, or the earlier deadline of the RPC it runs for (CallScope):
// the Retriever's ColdPages calls (offload/cold_pages.h) name no deadline, so the session
// sets its caller's around the Retriever work it does for a call.
//
// Thread-safe: the session's Retriever and its Fetch both call it, under the session's lock.
#ifndef KVTIER_DAEMON_SESSION_COLD_PAGES_H_
#define KVTIER_DAEMON_SESSION_COLD_PAGES_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "daemon/cold_store.h"
#include "offload/cold_pages.h"

namespace kvtier::daemon {

class SessionColdPages final : public ColdPages {
 public:
  // `store` (the tenant's) must outlive this object. The pages' keys are those of session
  // "<session>.live" (daemon/cold_tier.h), apart from the keys of the session's own record
  // and pages when the session is demoted whole.
  SessionColdPages(ColdStore* store, const std::string& session, size_t page_bytes,
                   absl::Duration timeout)
      : store_(store), session_(session + ".live"), page_bytes_(page_bytes), timeout_(timeout) {}
  ~SessionColdPages() override;

  // While it lives, every call also ends by `deadline` (that of the RPC the session runs the
  // Retriever for: Apply, Step). Scopes do not nest; the session's lock orders them.
  class CallScope {
   public:
    CallScope(SessionColdPages* pages, absl::Time deadline) : pages_(pages) {
      if (pages_ != nullptr) pages_->SetCallDeadline(deadline);
    }
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;
    ~CallScope() {
      if (pages_ != nullptr) pages_->SetCallDeadline(absl::InfiniteFuture());
    }

   private:
    SessionColdPages* const pages_;
  };

  absl::Status Put(const StoredPage& page, std::span<const uint8_t> bytes) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Get(int32_t layer, int64_t page, int64_t slot, std::span<uint8_t> out) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // One pipeline per layer and one WAIT per node for the batch; a page named more than once
  // is written (and charged) once. INVALID_ARGUMENT for a page of another size or one named
  // twice with two generations; the quota's RESOURCE_EXHAUSTED (nothing written); the cold
  // tier's errors.
  absl::Status PutBatch(std::span<const StoredPage> pages,
                        std::span<const std::span<const uint8_t>> bytes) override
      ABSL_LOCKS_EXCLUDED(mu_) {
    return PutBatchUntil(pages, bytes, absl::InfiniteFuture());
  }
  // The same by `deadline` (or the timeout, when earlier).
  absl::Status PutBatchUntil(std::span<const StoredPage> pages,
                             std::span<const std::span<const uint8_t>> bytes, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // One pipeline per layer; each page is copied to its `out` once its layer is read.
  absl::Status GetBatch(std::span<const Read> reads) override ABSL_LOCKS_EXCLUDED(mu_);
  // The pages of `reads` (their `slot` and `out` unused) by `deadline` (or the timeout, when
  // earlier), into buffers of their own, in the order asked: nothing else is written.
  // GetBatch's errors.
  absl::StatusOr<std::vector<std::string>> ReadPages(std::span<const Read> reads,
                                                     absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The generation the cold tier holds for (layer, page); nullopt when it holds none.
  std::optional<uint64_t> Generation(int32_t layer, int64_t page) const ABSL_LOCKS_EXCLUDED(mu_);
  // Pages held (a page promoted again keeps its copy: pages never change).
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::pair<int32_t, int64_t>> Held() const ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every page held or written unacknowledged and returns their quota (the first
  // error of the removals; the quota is returned regardless and the keys left are logged).
  absl::Status RemoveAll() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::pair<int32_t, int64_t>;  // (layer, page)

  // Reads `reads` by `deadline`, a layer at a time, handing read i's bytes (page_bytes_ of
  // them, checked) to `take(i, bytes)` as its layer arrives.
  absl::Status ReadEach(std::span<const Read> reads, absl::Time deadline,
                        absl::FunctionRef<void(size_t, std::string&&)> take)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The earliest of `deadline`, the call's (CallScope) and the timeout from now.
  absl::Time DeadlineOf(absl::Time deadline) const ABSL_LOCKS_EXCLUDED(call_mu_);
  void SetCallDeadline(absl::Time deadline) ABSL_LOCKS_EXCLUDED(call_mu_);

  ColdStore* const store_;
  const std::string session_;
  const size_t page_bytes_;
  const absl::Duration timeout_;
  mutable Mutex mu_;
  // Acknowledged pages → their generation, and pages a failed batch may have stored; apart.
  // Each key of both is charged once (its value's size).
  std::map<Key, uint64_t> held_ ABSL_GUARDED_BY(mu_);
  std::set<Key> unacknowledged_ ABSL_GUARDED_BY(mu_);
  // Apart from mu_, which a batch holds through its I/O.
  mutable Mutex call_mu_;
  absl::Time call_deadline_ ABSL_GUARDED_BY(call_mu_) = absl::InfiniteFuture();
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_SESSION_COLD_PAGES_H_
