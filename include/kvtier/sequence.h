// A sequence: the KV cache of one sequence, all layers, held in tiers — every page in the
// host tier (pinned host memory, HND, with per-page key summaries), and per layer a working
// set of S = sink + selected + recent page slots in device memory (NHD) that attention
// reads. Two kinds implement the contract below:
//   - a local sequence (LocalSequence): the working set lives in this process's device
//     memory; its work is enqueued on streams and never blocks the host on the decode path.
//     NewLocalSequence makes one with a private host tier; an SHM session of kvtierd
//     (kvtier/client.h) runs one over the session's region of the shared arena.
//   - a remote sequence: a GRPC session, whose host tier, working set and attention run in
//     kvtierd; every call has finished its work when it returns, and pointers passed in are
//     host memory.
// What only a local sequence can do (hand the working set to the engine's own attention
// kernel, profile) is on LocalSequence, so a remote sequence never pretends to it; both take
// the policies' signals and observation queries (a remote one sends them to kvtierd).
//
// One decode step of layer l, as an engine drives any sequence:
//   Append(l, k, v, 1)         the new token's K/V (prefill appends many tokens at once)
//   Decode(l, q, out, lse)     attention of q over the working set; launches the next step
// A local sequence is always a member of a batch (SequenceBatch, below; one made alone is
// the one member of its own batch of one), and the step is the batch's protocol, split so
// the engine's own paged decode kernel can run in between:
//   views = batch.BeginStep(l, members, q); [batch.Attend(l, members, q, out, lse) or the
//   engine's kernel over views]; batch.EndStep(l, members, q)
// LocalSequence::BeginStep / Attend / EndStep are that protocol for a batch of this one member.
//
// Thread-compatible: one thread drives a sequence at a time.
#ifndef KVTIER_SEQUENCE_H_
#define KVTIER_SEQUENCE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/counters.h"
#include "kvtier/device.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"

namespace kvtier {

// Everything attention needs for one layer, in device memory. A standard paged decode
// kernel reads it with the slot list [0, num_slots) as its page table; the per-KV-head slot
// tables say which logical page each slot holds for each head (−1: empty).
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
  int64_t background_pages = 0;     // head-pages recalled after this step
  std::vector<uint8_t> drifted;     // [Hkv] 1 = corrected
  std::vector<float> group_mean;    // [Hkv] mean cos(q_t, q_{t-1}) over the group
  // [Hkv] mass trigger: the estimated relative loss of the stale selection (empty with the
  // cosine trigger)
  std::vector<float> lost_mass;
  std::vector<int32_t> budget;      // [Hkv] pages the budget policy gave each head this step
  int64_t resident_head_pages = 0;  // the layer's working set after this step's decisions
  int32_t num_slots = 0;            // S of the step
  std::vector<int32_t> slot_table;  // [Hkv][S]: the logical page each slot held for attention
  // Blocking host calls the step made (its Appends since the previous step, BeginStep,
  // Attend and EndStep): event waits and stream synchronisations, copies into or out of
  // pageable host memory, device allocations and frees. Speculative mode makes none after
  // warm-up; what makes one is in docs/retriever.md#host-waits. A batch's calls count for
  // every member of it.
  int64_t host_waits = 0;
};

// Cumulative statistics of a sequence: a field for every counter of kvtier/counters.h
// (steps, appended_tokens, recalled_pages, ... host_waits, graph_launches: their meaning is
// written there, once), and what is not a single number.
struct SequenceStats {
#define KVTIER_COUNTER_FIELD(name, kind, help) int64_t name = 0;
  KVTIER_SEQUENCE_COUNTERS(KVTIER_COUNTER_FIELD)
#undef KVTIER_COUNTER_FIELD
  std::vector<int64_t> corrections;  // [layer][Hkv]: corrected heads per layer and head
  RecallStrategy recall_strategy = RecallStrategy::kAuto;  // the one in use (kAuto resolved)
  // Wall time of each phase over the profiled_steps run while profiling, µs
  // (LocalSequence::SetProfiling).
  double select_us = 0;     // scoring, top-k and replacement (foreground and background)
  double recall_us = 0;     // recall of the misses (foreground and background)
  double attention_us = 0;  // attention
  double correction_rate() const {
    return checked_heads == 0 ? 0.0 : static_cast<double>(corrected_heads) / checked_heads;
  }
};

class LocalSequence;
class SequenceBatch;

class Sequence {
 public:
  virtual ~Sequence() = default;

  // Appends n_tokens of K and V, NHD [n_tokens][Hkv][d], to `layer`. Pages that fill go to
  // the host tier with their summaries; the partial page stays in the working set.
  // INVALID_ARGUMENT for a bad layer or null data; OUT_OF_RANGE for n_tokens < 1 or past
  // max_tokens; RESOURCE_EXHAUSTED when the host tier is full (nothing of this call is kept).
  virtual absl::Status Append(int32_t layer, const void* k, const void* v, int32_t n_tokens) = 0;

  // One decode step of `layer` with q [Hq][d]: readies the working set for q (per the mode),
  // writes the attention over it to out [Hq][d] (lse [Hq], optional) and launches the next
  // step's selection and recall. `out` may be null when the engine runs attention itself
  // (on a LocalSequence: BeginStep/EndStep). FAILED_PRECONDITION before any token was
  // appended or after Close(); DEADLINE_EXCEEDED when the layer's background recall ran
  // past the deadline.
  virtual absl::Status Decode(int32_t layer, const void* q, void* out, float* lse) = 0;

  // What the engine reports for the policies after a forward pass. Applied from the next
  // step on. INVALID_ARGUMENT for inconsistent sizes; OK and ignored when no policy uses
  // them. A remote sequence sends them to kvtierd (its logits and hidden-state changes are
  // host memory there too), and a retry of signals already applied applies nothing.
  virtual absl::Status ReportSignals(const StepSignals& signals) = 0;

  // The observation window of the prompt (XKV, KV-Compress, Conf-KV's ranker): the last n
  // prompt queries q [n][Hq][d] of `layer`, at positions first_position .. + n − 1, after
  // the prompt was appended. Each attends causally over the layer's working set and the
  // policies see its token probabilities. Blocks until done (bounded by the deadline). OK
  // and nothing done when no policy reads attention. FAILED_PRECONDITION inside a step or
  // before any token; INVALID_ARGUMENT for a bad layer, n or null q. On a remote sequence q
  // is host memory and n at most 1024.
  virtual absl::Status ObserveQueries(int32_t layer, const void* q, int32_t n,
                                      int64_t first_position) = 0;

  // Blocks until all work enqueued so far has run, at most the deadline: OK, the first
  // error that work hit, or DEADLINE_EXCEEDED.
  virtual absl::Status Wait() = 0;

  // Stops the sequence: later calls fail FAILED_PRECONDITION, work in flight is drained
  // (bounded by the deadline; DEADLINE_EXCEEDED if it did not finish).
  virtual absl::Status Close() = 0;

  // Cumulative statistics of the steps whose work is known to have run; after Wait(), all.
  virtual SequenceStats Stats() = 0;
  // The latest step of `layer` whose work has run (empty until one has).
  virtual StepStats LastStep(int32_t layer) = 0;

  virtual const Geometry& geometry() const = 0;
  // The options in effect (defaults filled in).
  virtual const SequenceOptions& options() const = 0;
  virtual int32_t num_tokens(int32_t layer) const = 0;

  // This sequence as a LocalSequence, or null when it is remote.
  virtual LocalSequence* local() { return nullptr; }
};

// A sequence whose working set is in this process's device memory. Pointers passed in
// (k, v, q, out) are device memory or host memory the device can read, and must stay valid
// until the compute stream has run the work. Ordering is by events on the device's streams
// only: foreground work goes on the compute stream (the engine's, or one the sequence
// creates), background selection and recall on the sequence's recall stream, which waits
// for the layer's attention before it touches the working set. Nothing on the decode path
// blocks the host; Wait() is the one blocking call.
class LocalSequence : public Sequence {
 public:
  // Decode = BeginStep; Attend (when out is non-null); EndStep.
  absl::Status Decode(int32_t layer, const void* q, void* out, float* lse) override;

  // The batch protocol (SequenceBatch::BeginStep, Attend, EndStep) with this sequence as the
  // one member: the same work, results, errors and statistics.
  // BeginStep readies the working set for attention with q [Hq][d]. Errors as Decode.
  absl::StatusOr<WorkingSetView> BeginStep(int32_t layer, const void* q);
  // Sparse decode attention of q over the layer's working set into out [Hq][d] (and lse
  // [Hq], optional), on the compute stream. REQUIRES: BeginStep for this step.
  absl::Status Attend(int32_t layer, const void* q, void* out, float* lse);
  // Ends the layer's step: launches selection with q for the next step and the background
  // recall (speculative mode). REQUIRES: q is the query given to BeginStep.
  absl::Status EndStep(int32_t layer, const void* q);

  // Benchmarks only: while on, every phase synchronises its stream and adds its wall time
  // to the stats (select_us, recall_us, attention_us), so speculation no longer overlaps.
  virtual void SetProfiling(bool on) = 0;

  virtual Stream& compute_stream() = 0;
  LocalSequence* local() override { return this; }
  // The batch whose protocol steps this sequence: the one SequenceBatch::NewSequence made it
  // in or, for a sequence made alone (NewLocalSequence, an SHM session), its own batch of
  // one. Never null: a member keeps the batch's storage, and steps through an object of it
  // even once the SequenceBatch object it was made by is gone.
  virtual SequenceBatch* batch() = 0;
  // The sequence batch() steps: this one. A decorator (a LocalSequence that forwards every
  // call to another, e.g. to observe what an engine appends) returns the one it wraps.
  virtual LocalSequence* stepped() { return this; }
};

// A local sequence with a private host tier of pinned host memory sized for max_tokens per
// layer (nothing shared, no daemon): what an engine links when it wants tiered retrieval
// without kvtierd. INVALID_ARGUMENT for an invalid geometry or options (naming the field
// and limit) or a device kvtier did not create; RESOURCE_EXHAUSTED when host or device
// memory runs out. REQUIRES: `device` (and options.compute_stream) outlive the sequence.
absl::StatusOr<std::unique_ptr<LocalSequence>> NewLocalSequence(const Geometry& geometry,
                                                                const SequenceOptions& options,
                                                                Device& device);

// A decode batch (docs/retriever.md#batches): local sequences of one geometry and one set of
// options whose layer steps run together, each op launched once for a run of members (one
// run when the members are passed in the order their sequences were made), instead of once
// per sequence. Members keep their own lengths (ragged), budgets and policy state; each step
// call names the members taking part, so sequences join (NewSequence) and leave (Close, or
// destruction) between steps, and a member may be stepped alone (a run of one member, as
// LocalSequence::BeginStep / Attend / EndStep do). The batch's storage for max_batch sequences is allocated when it is
// made (and each member's host tier with it): nothing on the decode path allocates.
// A batch of more than one recalls zero-copy (recall strategy zero_copy; the DMA strategies
// drive one sequence), and a drop-mode working set managed by policies, which changes size,
// or one that demotes pages cannot join one (offload/step_plan.h has the rules).
//
// Thread-compatible: one thread drives a batch and its members at a time.
class SequenceBatch {
 public:
  virtual ~SequenceBatch() = default;

  // A new, empty member. RESOURCE_EXHAUSTED when max_batch members are open.
  virtual absl::StatusOr<std::unique_ptr<LocalSequence>> NewSequence() = 0;

  // One layer step of `members` (sequences of this batch, each at most once), their queries
  // q [n][Hq][d] in the order given, with the same results, errors and statistics as
  // stepping the members one at a time. BeginStep readies each member's working set,
  // Attend writes out [n][Hq][d] and lse [n][Hq] (optional), EndStep launches the next
  // step's selection and recall (LocalSequence's calls say more). INVALID_ARGUMENT when a
  // member is not of this batch or repeated, or n is not in [1, max_batch]; a member's own
  // precondition errors (FAILED_PRECONDITION when it is closed, has no tokens in the layer,
  // or is not in the step the call needs) before any work.
  virtual absl::StatusOr<std::vector<WorkingSetView>> BeginStep(
      int32_t layer, std::span<LocalSequence* const> members, const void* q) = 0;
  virtual absl::Status Attend(int32_t layer, std::span<LocalSequence* const> members,
                              const void* q, void* out, float* lse) = 0;
  virtual absl::Status EndStep(int32_t layer, std::span<LocalSequence* const> members,
                               const void* q) = 0;

  virtual int32_t max_batch() const = 0;
  // The members' compute stream (options.compute_stream, or one the batch made).
  virtual Stream& compute_stream() = 0;
};

// A batch of up to max_batch sequences of `geometry` with `options` (every member's), each
// with a private host tier of max_tokens per layer. INVALID_ARGUMENT for invalid geometry or
// options, max_batch outside [1, 4096], options a batch of max_batch cannot run (above), or
// a device kvtier did not create; RESOURCE_EXHAUSTED when memory runs out. REQUIRES: `device` (and
// options.compute_stream) outlive the batch and its members.
absl::StatusOr<std::unique_ptr<SequenceBatch>> NewSequenceBatch(const Geometry& geometry,
                                                                const SequenceOptions& options,
                                                                int32_t max_batch, Device& device);

}  // namespace kvtier

#endif  // KVTIER_SEQUENCE_H_
