// Retriever: the in-process implementation of LocalSequence (kvtier/sequence.h) — the KV
// working set of one sequence, all layers (docs/architecture.md#the-decode-step). The full
// KV cache lives in the host tier (HND pages in a PagePool, with per-page key summaries on
// the backend); each layer keeps a working set of S = sink + selected + recent page slots in
// NHD on the backend, which attention reads. Internal: engines reach it through
// NewLocalSequence or an SHM session (kvtier/client.h).
//
// Its host tier (offload/host_tier.h) owns the pool and publishes pages: once a page's
// offload has run, the Retriever hands it to HostTier::Commit (without blocking, at Append
// and EndStep; all of them at Flush, Wait and Close). A commit that fails fails the
// sequence.
//
// Thread-compatible: one thread drives a Retriever at a time.
#ifndef KVTIER_OFFLOAD_RETRIEVER_H_
#define KVTIER_OFFLOAD_RETRIEVER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"
#include "kvtier/sequence.h"
#include "offload/host_tier.h"

namespace kvtier {

namespace policy {
class LayerBudgetStore;
}  // namespace policy

class PageHandle;
class PagePool;

class Retriever : public LocalSequence {
 public:
  // INVALID_ARGUMENT for an invalid geometry or options (naming the field and limit);
  // RESOURCE_EXHAUSTED when backend memory runs out. `host` is the host tier: its pool must
  // be registered with `backend` with slot_bytes = geometry.host_page_bytes(); it may be
  // null only in full and drop modes. `policy_store`: where XKV allocations are recorded
  // per task type and reused (null: each Retriever allocates its own). REQUIRES: backend,
  // the compute stream and policy_store outlive the Retriever.
  static absl::StatusOr<std::unique_ptr<Retriever>> Create(
      const Geometry& geometry, const SequenceOptions& options, Backend& backend,
      std::unique_ptr<HostTier> host, policy::LayerBudgetStore* policy_store = nullptr);
  // As above over a bare pool (commits go nowhere): tests and benchmarks. REQUIRES: the
  // pool outlives the Retriever.
  static absl::StatusOr<std::unique_ptr<Retriever>> Create(const Geometry& geometry,
                                                           const SequenceOptions& options,
                                                           Backend& backend, PagePool* pool);

  // Waits (bounded by the deadline: DEADLINE_EXCEEDED) for every offload enqueued so far
  // and commits their pages to the host tier. FAILED_PRECONDITION after Close(); the
  // Retriever's first error once it failed (a refused commit included).
  virtual absl::Status Flush() = 0;

  // Rebuilds `layer` of a Retriever that has no tokens in it from host pages that already
  // hold its logical pages 0..n-1 (pages[i] = page i, HND, slots of this Retriever's pool,
  // e.g. from PagePool::Claim after a restart). Afterwards num_tokens(layer) = n·p and the
  // layer is in the state that appending those n·p tokens would have left it in, so later
  // steps give the same results bit for bit. The Retriever owns the handles from then on
  // (on error they are released). The pages' bytes are read on the host here and rewritten,
  // unchanged, by the offload op that recomputes their summaries; nobody else may write
  // them. Restored pages are not committed again and count in no statistic.
  //   FAILED_PRECONDITION: the layer has tokens, the Retriever is closed, or the mode has no
  //     host tier (drop and full);
  //   INVALID_ARGUMENT: a bad layer, a handle that is empty or of another pool;
  //   OUT_OF_RANGE: n·p > max_tokens.
  virtual absl::Status Restore(int32_t layer, std::vector<PageHandle> pages) = 0;

  // The host tier (null in full and drop modes).
  virtual HostTier* host_tier() = 0;
};

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_RETRIEVER_H_
