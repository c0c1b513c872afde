// Retriever: the KV working set of one sequence, all layers (docs/architecture.md#the-decode-step). The full KV
// cache lives in the host tier (HND pages in a PagePool, with per-page key summaries on the
// backend); each layer keeps a working set of S = sink + selected + recent page slots in NHD
// on the backend, which attention reads.
//
// One decode step of layer l, as an engine drives it:
//   Append(l, k, v, 1)      the new token's K/V (prefill appends many tokens at once)
//   view = BeginStep(l, q)  the working set ready for attention with q
//   Attend(l, q, out)       or the engine's own paged decode kernel over `view`
//   EndStep(l, q)           launches the next step's selection and recall
//
// Modes (RetrievalMode): speculative attends over the pages selected with the previous
// step's query while the next selection and recall run in the background; heads whose query
// drifted (mean group cosine < τ) are re-selected and recalled before attention. sync
// selects and recalls with q_t before attention (Quest/ArkVale); full keeps every page
// resident (the accuracy ceiling); drop has no host tier: sinks plus a sliding window
// (StreamingLLM), the base the policies build on.
//
// Ordering is by events on the backend's streams only: all foreground work is enqueued on
// the compute stream (the engine's, or one the Retriever creates), background selection and
// recall on the Retriever's recall stream, which waits for the layer's attention before it
// touches the working set; the next BeginStep makes the compute stream wait for that recall.
// Nothing on the decode path blocks the host; Wait() is the one blocking call, and it is
// bounded by the deadline.
//
// Pointers passed in (k, v, q, out) are backend memory or host memory the backend can read,
// and must stay valid until the compute stream has run the work (as with CUDA).
//
// Thread-compatible: one thread drives a Retriever at a time.
#ifndef KVTIER_RETRIEVER_H_
#define KVTIER_RETRIEVER_H_

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kvtier/geometry.h"
#include "offload/policy/config.h"
#include "offload/policy/policy.h"
#include "offload/recall_strategy.h"

namespace kvtier {

class PageHandle;
class PagePool;

enum class RetrievalMode : uint8_t { kSpeculative = 0, kSync = 1, kFull = 2, kDrop = 3 };
std::string_view RetrievalModeName(RetrievalMode mode);
bool ParseRetrievalMode(std::string_view name, RetrievalMode* out);

struct RetrieverOptions {
  RetrievalMode mode = RetrievalMode::kSpeculative;
  // Working-set slots per layer, in pages (FreeKV's defaults: 2048 tokens at p = 32).
  int32_t sink_pages = 16;
  int32_t selected_pages = 32;
  int32_t recent_pages = 16;  // includes the page being filled
  // Capacity of the sequence in tokens: sizes the summaries and page maps per layer.
  int32_t max_tokens = 131072;
  // τ: a KV head whose mean cos(q_t, q_{t-1}) over its query group is below τ is corrected
  // (speculative mode). τ ≤ -1 never corrects; τ > 1 always does.
  float correction_threshold = 0.9f;
  PoolMode pool = PoolMode::kSoftmaxMean;
  SummaryMode summary = SummaryMode::kMinMax;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  // How background recalls (and sync mode's) move slabs (offload/recall_strategy.h); kAuto
  // calibrates the three strategies on the backend and host tier at Create (once per
  // backend device and shape in a process) and takes the fastest; RetrieverStats says which.
  // The speculative correction recall (a few pages, on the critical path, planned on the
  // device) is always the zero-copy gather, so it never waits for the host.
  RecallStrategy recall = RecallStrategy::kAuto;
  int32_t stream_chunk_items = 64;  // head-pages per staging buffer (DMA strategies)
  // Longest a background recall or Wait() may take before the step fails with
  // DEADLINE_EXCEEDED.
  absl::Duration deadline = absl::Seconds(30);
  // The engine's compute stream; null: the Retriever creates its own (compute_stream()).
  Stream* compute_stream = nullptr;
  // Budget, residency and host-drop policies (offload/policy/config.h, docs/policies.md).
  // The default (fixed budget, no residency policy, refuse) is the behaviour above. In drop
  // mode any other policy makes the working set per-head managed: pages are evicted per KV
  // head by the residency ranking (lowest first; pinned, sink and recent pages never), the
  // slots compacted and the capacity grown (prefill) and shrunk with use.
  policy::PolicyConfig policy;
  // Where XKV allocations are recorded per task type and reused (policy::LayerBudgetStore);
  // null: each Retriever allocates its own. Must outlive the Retriever.
  policy::LayerBudgetStore* policy_store = nullptr;

  // Sets sink/selected/recent from a budget in tokens, split 1/4 : 1/2 : 1/4 as FreeKV's
  // 16/32/16 pages. INVALID_ARGUMENT unless the budget is a multiple of 4·page_size.
  absl::Status SetBudgetTokens(int32_t budget_tokens, int32_t page_size);
  int32_t budget_pages() const { return sink_pages + selected_pages + recent_pages; }
};

// Everything attention needs for one layer, in backend memory. A standard paged decode
// kernel reads it with the slot list [0, num_slots) as its page table (docs/architecture.md#geometry-and-layouts); the
// per-KV-head slot tables say which logical page each slot holds for each head (−1: empty).
struct WorkingSetView {
  int32_t layer = 0;
  const void* k_cache = nullptr;  // [S][p][Hkv][d]
  const void* v_cache = nullptr;
  int32_t num_slots = 0;                  // S
  const int32_t* slot_table = nullptr;    // [Hkv][S]
  const int32_t* partial_page = nullptr;  // [1]: logical page being filled, or −1
  const int32_t* partial_len = nullptr;   // [1]: its tokens
  int32_t num_tokens = 0;                 // tokens of the sequence so far
  // Recorded on the compute stream after this step's retrieval work; attention on another
  // stream must wait on it.
  Event* ready = nullptr;
};

// What one layer's step did (speculative mode fills all fields; the others what applies).
struct StepStats {
  int64_t step = 0;                 // per-layer step index, from 0
  int32_t corrected_heads = 0;      // KV heads re-selected before attention
  int64_t correction_pages = 0;     // head-pages recalled before attention
  int64_t background_pages = 0;     // head-pages recalled after this step's EndStep
  std::vector<uint8_t> drifted;     // [Hkv] 1 = corrected
  std::vector<float> group_mean;    // [Hkv] mean cos(q_t, q_{t-1}) over the group
  std::vector<int32_t> budget;      // [Hkv] pages the budget policy gave each head this step
  int64_t resident_head_pages = 0;  // the layer's working set after this step's decisions
};

struct RetrieverStats {
  int64_t steps = 0;                 // layer-steps (BeginStep calls)
  int64_t appended_tokens = 0;       // per layer, summed over layers
  int64_t offloaded_pages = 0;       // (layer, page) pairs written to the host tier
  int64_t recalled_pages = 0;        // head-pages recalled, background + correction
  int64_t recalled_bytes = 0;        // K+V bytes of those head-pages
  int64_t correction_pages = 0;      // of which before attention
  int64_t checked_heads = 0;         // (layer-step, KV head) pairs checked for drift
  int64_t corrected_heads = 0;       // of which corrected
  std::vector<int64_t> corrections;  // [layer][Hkv]: corrected heads per layer and head
  // Wall time of each phase over the layer-steps run while profiling (SetProfiling), µs.
  RecallStrategy recall_strategy = RecallStrategy::kAuto;  // the one in use (after calibration)
  int64_t profiled_steps = 0;
  double select_us = 0;     // scoring, top-k and replacement (foreground and background)
  double recall_us = 0;     // recall of the misses (foreground and background)
  double attention_us = 0;  // Attend
  // Working-set memory and policy decisions (offload/policy). A head-page is one KV head's
  // K+V of one page (slab_elements() elements).
  int64_t resident_head_pages = 0;  // now, all layers: sinks, selected/kept, recent
  int64_t resident_bytes = 0;       // their K+V bytes (INT8 ones at 1 byte + scales)
  int64_t int8_head_pages = 0;      // now, stored as INT8
  int64_t evicted_head_pages = 0;   // drop mode: evicted for good by the policies
  int64_t budget_changes = 0;       // layer-steps whose budget differed from the previous
  int64_t host_dropped_pages = 0;   // host tier full, host_drop = evict: dropped for good
  int64_t host_refusals = 0;        // host tier full, host_drop = refuse
  double correction_rate() const {
    return checked_heads == 0 ? 0.0 : static_cast<double>(corrected_heads) / checked_heads;
  }
};

// A host page whose offload has completed: its bytes are in `slot` of the pool.
struct StoredPage {
  int32_t layer = 0;
  int64_t page = 0;         // logical page
  int64_t slot = -1;        // pool slot
  uint64_t generation = 0;  // the slot's generation (PageHandle::generation)
};

class Retriever {
 public:
  // INVALID_ARGUMENT for an invalid geometry or options (naming the field and limit);
  // RESOURCE_EXHAUSTED when backend memory runs out. `pool` holds the host tier and must be
  // registered with `backend` with slot_bytes = geometry.host_page_bytes(); it may be null
  // only in full and drop modes. REQUIRES: backend, pool and the compute stream outlive the
  // Retriever.
  static absl::StatusOr<std::unique_ptr<Retriever>> Create(const Geometry& geometry,
                                                           const RetrieverOptions& options,
                                                           Backend& backend, PagePool* pool);
  virtual ~Retriever() = default;

  // Appends n_tokens of K and V, NHD [n_tokens][Hkv][d], to `layer`. Pages that fill are
  // offloaded to the host tier with their summaries; the partial page stays resident.
  // INVALID_ARGUMENT for a bad layer or null data; OUT_OF_RANGE past max_tokens;
  // RESOURCE_EXHAUSTED when the host tier is full (nothing of this call is kept then).
  virtual absl::Status Append(int32_t layer, const void* k, const void* v, int32_t n_tokens) = 0;

  // Readies the working set for attention with q [Hq][d] (see the modes above).
  // FAILED_PRECONDITION before any token was appended or after Close();
  // DEADLINE_EXCEEDED when the layer's background recall has been running longer than the
  // deadline.
  virtual absl::StatusOr<WorkingSetView> BeginStep(int32_t layer, const void* q) = 0;

  // Sparse decode attention of q [Hq][d] over the layer's working set into out [Hq][d]
  // (and lse [Hq], optional), on the compute stream. REQUIRES: BeginStep for this step.
  virtual absl::Status Attend(int32_t layer, const void* q, void* out, float* lse) = 0;

  // Ends the layer's step: launches selection with q for the next step and the background
  // recall (speculative mode). REQUIRES: q is the query given to BeginStep.
  virtual absl::Status EndStep(int32_t layer, const void* q) = 0;

  // Blocks until all work enqueued so far (compute and background) has run, at most the
  // deadline: OK, the first error that work hit, or DEADLINE_EXCEEDED.
  virtual absl::Status Wait() = 0;

  // Stops the sequence: no new work is accepted (later calls fail FAILED_PRECONDITION),
  // work in flight is drained (bounded by the deadline) and the host pages are freed.
  // DEADLINE_EXCEEDED if the in-flight work did not finish; the pages are then freed when
  // the Retriever is destroyed.
  virtual absl::Status Close() = 0;

  // Pages whose offload to the host tier has completed since the last call, in offload
  // order (per layer, ascending logical pages). wait = false never blocks (only work already
  // finished is reported); wait = true blocks, bounded by the deadline (DEADLINE_EXCEEDED),
  // until every offload enqueued so far has run. Pages that Restore adopted are not
  // reported. FAILED_PRECONDITION after Close(); the Retriever's first error once it failed.
  // A page reported here stays in the host tier until Close() or destruction.
  virtual absl::StatusOr<std::vector<StoredPage>> TakeStoredPages(bool wait) = 0;

  // Rebuilds `layer` of a Retriever that has no tokens in it from host pages that already
  // hold its logical pages 0..n-1 (pages[i] = page i, HND, slots of this Retriever's pool,
  // e.g. from PagePool::Claim after a restart). Afterwards num_tokens(layer) = n·p and the
  // layer is in the state that appending those n·p tokens would have left it in, so later
  // steps give the same results bit for bit. The Retriever owns the handles from then on
  // (on error they are released). The pages' bytes are read on the host here and rewritten,
  // unchanged, by the offload op that recomputes their summaries; nobody else may write
  // them. Restored tokens count in no statistic.
  //   FAILED_PRECONDITION: the layer has tokens, the Retriever is closed, or the mode has no
  //     host tier (drop and full);
  //   INVALID_ARGUMENT: a bad layer, a handle that is empty or of another pool;
  //   OUT_OF_RANGE: n·p > max_tokens.
  virtual absl::Status Restore(int32_t layer, std::vector<PageHandle> pages) = 0;

  // What the engine reports for the policies after a forward pass (policy::StepSignals):
  // logits or their summary, hidden-state changes per layer. Applied from the next
  // BeginStep on. INVALID_ARGUMENT for inconsistent sizes; OK and ignored when no policy
  // uses them.
  virtual absl::Status ReportSignals(const policy::StepSignals& signals) = 0;

  // The observation window of the prompt (XKV, KV-Compress, Conf-KV's ranker): the last n
  // prompt queries q [n][Hq][d] of `layer`, at positions first_position .. + n − 1, after
  // the prompt was appended. Each attends causally over the layer's working set (in drop
  // mode with policies: every prompt page, as eviction waits for the first BeginStep) and
  // the policies see its token probabilities. Blocks until done (bounded by the deadline).
  // OK and nothing done when no policy reads attention. FAILED_PRECONDITION inside a step
  // or before any token; INVALID_ARGUMENT for a bad layer, n or null q.
  virtual absl::Status ObserveQueries(int32_t layer, const void* q, int32_t n,
                                      int64_t first_position) = 0;

  // Cumulative statistics of the steps whose work is known to have run; after Wait(), all.
  virtual RetrieverStats Stats() = 0;
  // The latest step of `layer` whose work has run (empty until one has).
  virtual StepStats LastStep(int32_t layer) = 0;

  // Benchmarks only: while on, every phase synchronises its stream and adds its wall time
  // to the stats (select_us, recall_us, attention_us), so the decode path blocks and
  // speculation no longer overlaps. Never use profiled steps to time the critical path.
  virtual void SetProfiling(bool on) = 0;

  virtual Stream& compute_stream() = 0;
  virtual const Geometry& geometry() const = 0;
  virtual const RetrieverOptions& options() const = 0;
  virtual int32_t num_tokens(int32_t layer) const = 0;
};

}  // namespace kvtier

#endif  // KVTIER_RETRIEVER_H_
