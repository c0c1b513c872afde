// PageMover: the one way pages move between a session's host tier and the cold tier
// (docs/service.md#the-cold-tier), in batches only, as LMCache's batched_put / batched_get.
// Every path that moves pages goes through one: the daemon's Retriever of a GRPC session
// that demotes pages (as its ColdPages), DemotePages / PromotePages of an SHM one, Fetch of a
// demoted page, and whole sessions — a session is demoted by demoting every committed page
// through a mover over its record's keys, and promoted by promoting them back.
//
// A mover holds pages under one set of keys of the tenant's ColdStore: those of "<keys>" in
// the page key "<prefix>:<tenant>:{<keys>:<layer>}:<page>" (daemon/cold_tier.h). A live
// session's demoted pages are under "<session>.live" (LiveKeys), a cold session's under
// "<session>", apart from each other, so a promotion that fails half-way never touches the
// pages its record names.
//
// Demote is all or nothing: OK means every page of the batch is stored (with
// cold_tier.min_replicas, acknowledged by that many replicas) and held at its generation; an
// error means none of the batch counts as moved (the host tier must keep them all), though
// some may have been stored: those are not held, never read back, stay charged, and
// RemoveAll removes them. Promote is all or nothing too: every page is read and checked (its
// generation, its value's checksums and identity) into buffers of the mover's own before any
// destination is written, and then every destination is written, or none.
//
// Charges: each key is charged once to the tenant's cold quota, its value's size (page and
// header), from its first write until RemoveAll (or until Release hands it to a record). A
// page demoted again with the generation held is not written again (pages never change);
// with another generation its key is written over and keeps its one charge.
//
// A session that demotes pages is moved whole by copying its pages from one set of keys to the
// other (demoted: its live keys' pages go under its record's; promoted: the record's pages are
// appended again and demoted anew under its live keys). Until the move ends both copies exist
// and are charged; SetOverdraft lets the new copy pass the quota by the old one's charge, so a
// session that fits the quota once is never refused for not fitting it twice.
//
// Deadlines: every batch ends by the earliest of the deadline it is given, `timeout` from
// its start (cold_tier.operation_timeout_ms) and, while a CallScope lives, the deadline of
// the RPC it runs for (the Retriever's ColdPages calls name none).
//
// Thread-safe. Demote batches of one mover run one at a time; Promote reads without holding
// the mover (Generation and HeldPages answer meanwhile).
#ifndef KVTIER_DAEMON_PAGE_MOVER_H_
#define KVTIER_DAEMON_PAGE_MOVER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "daemon/cold_store.h"
#include "offload/cold_pages.h"

namespace kvtier::daemon {

struct PageMoverOptions {
  std::string keys;         // the key namespace: the session id, or LiveKeys of it
  size_t page_bytes = 0;    // bytes of every page (HND [Hkv][2][p][d])
  absl::Duration timeout = absl::Seconds(10);  // the longest a batch may take
  // Counted as a live session's pages (kvtier_cold_live_pages_total) or, when false, as a
  // whole session's (counted with its record by the ColdStore).
  bool live = true;
};

class PageMover final : public ColdPages {
 public:
  // The keys of a live session's demoted pages.
  static std::string LiveKeys(std::string_view session) {
    return std::string(session) + ".live";
  }

  // `store` (the tenant's) must outlive the mover.
  PageMover(ColdStore* store, PageMoverOptions options);
  PageMover(const PageMover&) = delete;
  PageMover& operator=(const PageMover&) = delete;
  // RemoveAll.
  ~PageMover() override;

  // A page leaving the host tier: `bytes` (page_bytes of them) stay valid during the call.
  struct Out {
    int32_t layer = 0;
    int64_t page = 0;
    uint64_t generation = 0;  // its commit stamp, >= 1
    std::span<const uint8_t> bytes;
  };
  // A page coming back: written to `into` (page_bytes), which is the caller's.
  struct In {
    int32_t layer = 0;
    int64_t page = 0;
    std::span<uint8_t> into;
  };
  // A page the mover holds, by its generation.
  struct Held {
    int32_t layer = 0;
    int64_t page = 0;
    uint64_t generation = 0;
  };

  // Host → cold, all or nothing (above). A page named more than once is moved once.
  // INVALID_ARGUMENT for a page of another size, a negative layer or page, a generation of 0
  // or a page named twice with two generations (nothing written); the quota's
  // RESOURCE_EXHAUSTED (nothing written); the cold tier's errors, DEADLINE_EXCEEDED when the
  // deadline cut it off.
  absl::Status Demote(std::span<const Out> pages, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Cold → host, all or nothing (above): once every page read back intact, `may_write` is
  // asked (e.g. whether the call is still live) and, only when it says OK, each page is
  // copied into its `into`. NOT_FOUND for a page the mover does not hold and INVALID_ARGUMENT
  // for a destination of another size (nothing read); DATA_LOSS naming the page when no
  // intact copy of it is left (missing, of another generation, or failing its checksums or
  // identity on the master and every replica); the cold tier's errors; `may_write`'s error.
  absl::Status Promote(std::span<const In> pages, absl::Time deadline,
                       absl::FunctionRef<absl::Status()> may_write) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Promote(std::span<const In> pages, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_) {
    return Promote(pages, deadline, [] { return absl::OkStatus(); });
  }

  // Takes over pages already in the cold tier under the mover's keys (a cold session's,
  // as its record names them): held from now on, their charge counted by whoever held
  // them before (ColdStore::LoadAll, a demotion's record). Replaces any held generation.
  void Adopt(std::span<const Held> pages) ABSL_LOCKS_EXCLUDED(mu_);
  // Hands every held page over (to a record written after a whole-session demotion): the
  // mover forgets them, their keys and their charge stay. Pages a failed batch may have
  // stored are not handed over (RemoveAll still removes them).
  std::vector<Held> Release() ABSL_LOCKS_EXCLUDED(mu_);

  // Lets this mover's charges pass the tenant's cold quota by `bytes` (0: not at all, the
  // default): the charge of the copy that the move it makes replaces (above).
  void SetOverdraft(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes its keys are charged (every page held or stored by a failed batch).
  uint64_t ChargedBytes() const ABSL_LOCKS_EXCLUDED(mu_);

  // The generation held for (layer, page); nullopt when none.
  std::optional<uint64_t> Generation(int32_t layer, int64_t page) const ABSL_LOCKS_EXCLUDED(mu_);
  // Pages held (a page promoted again keeps its copy: pages never change), in (layer, page)
  // order.
  std::vector<Held> HeldPages() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every page held or stored by a failed batch and returns their charge, by
  // `deadline` (or the timeout, when earlier): the first error of the removals; the charge is
  // returned regardless and the keys left are logged.
  absl::Status RemoveAll(absl::Time deadline = absl::InfiniteFuture()) ABSL_LOCKS_EXCLUDED(mu_);

  // ColdPages (the daemon's Retriever): Demote and Promote with no deadline of their own
  // (the timeout and the CallScope's bound them). The Retriever's slots are its own, so
  // GetBatch writes them without asking.
  absl::Status PutBatch(std::span<const StoredPage> pages,
                        std::span<const std::span<const uint8_t>> bytes) override;
  absl::Status GetBatch(std::span<const Read> reads) override;

  // While it lives, every batch also ends by `deadline` (that of the RPC the session runs
  // the Retriever for: Apply, Step, Fetch). Scopes do not nest; the session's lock orders
  // them. A null mover is allowed (a session that demotes nothing).
  class CallScope {
   public:
    CallScope(PageMover* mover, absl::Time deadline) : mover_(mover) {
      if (mover_ != nullptr) mover_->SetCallDeadline(deadline);
    }
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;
    ~CallScope() {
      if (mover_ != nullptr) mover_->SetCallDeadline(absl::InfiniteFuture());
    }

   private:
    PageMover* const mover_;
  };

 private:
  using Key = std::pair<int32_t, int64_t>;  // (layer, page)

  // The earliest of `deadline`, the call's (CallScope) and the timeout from now.
  absl::Time DeadlineOf(absl::Time deadline) const ABSL_LOCKS_EXCLUDED(call_mu_);
  void SetCallDeadline(absl::Time deadline) ABSL_LOCKS_EXCLUDED(call_mu_);

  ColdStore* const store_;
  const PageMoverOptions options_;
  mutable Mutex mu_;  // held through a Demote's I/O, not a Promote's
  // Acknowledged pages → their generation, and pages a failed batch may have stored; apart.
  // Each key of both is charged once (its value's size).
  std::map<Key, uint64_t> held_ ABSL_GUARDED_BY(mu_);
  std::set<Key> unacknowledged_ ABSL_GUARDED_BY(mu_);
  uint64_t overdraft_ ABSL_GUARDED_BY(mu_) = 0;
  // Apart from mu_, which a batch holds through its I/O.
  mutable Mutex call_mu_;
  absl::Time call_deadline_ ABSL_GUARDED_BY(call_mu_) = absl::InfiniteFuture();
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_PAGE_MOVER_H_
