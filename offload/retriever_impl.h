// RetrieverImpl: the Retriever's internals, shared by its source files (retriever.cc: the
// decode path; retriever_select.cc: selection and speculative mode's correction;
// retriever_policy.cc: budgets, residency and drop-mode eviction). Not part of
// the public API. The invariants are stated at the top of retriever.cc.
#ifndef KVTIER_OFFLOAD_RETRIEVER_IMPL_H_
#define KVTIER_OFFLOAD_RETRIEVER_IMPL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "kvtier/layout.h"
#include "kernels/host_calls.h"
#include "offload/batch_shared.h"
#include "offload/cold_pages.h"
#include "offload/head_slot_table.h"
#include "offload/page_offloader.h"
#include "offload/page_pool.h"
#include "offload/page_table.h"
#include "offload/policy/config.h"
#include "offload/recall_strategy.h"
#include "offload/retriever.h"
#include "offload/step_plan.h"
#include "offload/telemetry.h"

namespace kvtier::retriever_internal {

// Host buffers read or written by enqueued copies, kept until the event after them fires.
struct Parked {
  std::vector<std::unique_ptr<uint8_t[]>> buffers;
  std::vector<uint64_t> tickets;     // staging ring blocks
  std::vector<DeviceBuffer> device;  // backend buffers replaced by a managed layer's growth
  std::unique_ptr<Event> done;
};

// Pages of one flushed offload, committed to the host tier once `done` has fired.
struct StoredBatch {
  std::vector<StoredPage> pages;
  std::unique_ptr<Event> done;
};

// A device → host copy of one step's selection results, accumulated into the stats once its
// event has fired.
// The copies land in one block of the staging ring (pinned: no copy blocks the host), or in
// ordinary memory when the ring cannot hold them.
struct StatRecord {
  int32_t layer = 0;
  int64_t step = 0;
  bool background = false;
  bool checked = false;              // drift flags are meaningful (a correction check ran)
  const int32_t* misses = nullptr;   // [Hkv], or null
  const uint8_t* drifted = nullptr;  // [Hkv] when checked
  const float* group_mean = nullptr;  // [Hkv] when checked
  const float* lost_mass = nullptr;   // [Hkv] when the mass trigger checked
  int32_t num_slots = 0;              // foreground: the working set attention read
  const int32_t* slot_table = nullptr;  // [Hkv][num_slots], foreground
  uint64_t ticket = 0;                  // the ring block holding them
  std::vector<uint8_t> heap;            // or, when the ring could not hold them, this
  std::unique_ptr<Event> done;
};

// A layer's page counts in backend memory (batch_shared.h: rows of the batch's count
// tables, this sequence's column). The live ones are uploaded before the next op reads them;
// EndStep snapshots full pages and candidates for the background selection, which must not
// see pages appended after it.
struct CountsView {
  int32_t* full_pages = nullptr;
  int32_t* candidates = nullptr;  // full pages before the recent window (TopK's end)
  int32_t* partial_page = nullptr;
  int32_t* partial_len = nullptr;
  int32_t* full_at_end = nullptr;
  int32_t* cand_at_end = nullptr;
};

// One layer of the sequence, grouped by concern. S: working-set slots, P: max pages, k:
// selected pages.
struct LayerState {
  // The working set attention reads (NHD slots on the backend) and its slot tables.
  struct WorkingSet {
    DeviceBuffer k, v;                  // [S][p][Hkv][d]
    DeviceBuffer table;                 // int32 [Hkv][S]: logical page per slot and KV head
    CountsView counts;
    std::vector<int32_t> table_mirror;  // [Hkv][S]; host-owned entries are authoritative
    bool table_dirty = true;
    // Drop mode with policies: the per-head slot table (authoritative; table_mirror unused).
    std::unique_ptr<HeadSlotTable> managed;
  };
  // The layer's pages in the host tier (speculative, sync) and their key summaries.
  struct HostPages {
    std::unique_ptr<PageTable> pages;
    DeviceBuffer summaries;               // [P][Hkv][2][d]
    DeviceBuffer codes;                   // [P] KeyCodeLayout pages (SummaryMode::kKeyCodes)
    DeviceBuffer page_of;                 // int64 [P]: host page of each logical page
    std::vector<int64_t> page_of_mirror;  // [P]
    struct Pending {
      int64_t logical;
      int64_t slot;
    };
    std::vector<Pending> pending;  // full pages not yet offloaded
    std::vector<uint8_t> dropped;  // [P] once a page was dropped from the host tier: 1 = dropped
    // host_drop = demote: [P], 1 = the page has a copy in the cold tier (it was demoted at
    // least once). A demoted page's host_page_of entry is ColdMarker(page).
    std::vector<uint8_t> cold;
  };
  // Selection: the queries, page scores, the chosen pages and the recall plan.
  struct Selection {
    DeviceBuffer q_prev, q_cur;  // [Hq][d]
    DeviceBuffer pooled;         // float [Hkv][P]
    DeviceBuffer selected;       // int32 [Hkv][k]
    DeviceBuffer items;          // RecallItem [Hkv][k]
    DeviceBuffer num_misses;     // int32 [Hkv]
    DeviceBuffer drifted;        // uint8 [Hkv]
    DeviceBuffer group_mean;     // float [Hkv]
    // The mass trigger (speculative mode): q_t's selection and the stale one's relative loss.
    DeviceBuffer fresh;      // int32 [Hkv][k]
    DeviceBuffer lost_mass;  // float [Hkv]
  };
  // The background recall of the next step's pages (speculative mode).
  struct Recall {
    // DMA strategies: the layer's own staging and host plan, and the background plan that
    // awaits its DMAs (plan_ready fires once the device's plan has reached the host).
    std::unique_ptr<SlabRecaller> recaller;
    bool plan_pending = false;
    // host_drop = demote: the host is rewriting the layer's plan (PromoteCold), so no other
    // layer's promotion may demote its pages or issue its plan.
    bool promoting = false;
    std::unique_ptr<Event> attn_done, done, plan_ready;
    bool in_flight = false;
    absl::Time launched;
  };
  // What the policies (retriever_policy.cc) decided and observed.
  struct PolicyState {
    std::vector<int32_t> budget;         // [Hkv] pages per head for this step
    std::vector<int32_t> selected_with;  // [Hkv] budget of the device's last selection
    DeviceBuffer head_k;                 // int32 [Hkv] (speculative, sync)
    DeviceBuffer page_flags;             // uint8 [Hkv][P] (speculative, sync)
    std::vector<uint8_t> flags_mirror;   // [Hkv][P]
    bool flags_changed = false;          // since the device's last selection
    DeviceBuffer token_prob;             // float [Hq][S][p] (policies that read attention)
    // Attention of the last step, copied to the host for the policies (ConsumeProbe).
    struct Probe {
      const float* prob = nullptr;     // [Hq][S][p], in the staging ring
      const int32_t* table = nullptr;  // [Hkv][S]
      uint64_t ticket = 0;
      std::vector<uint8_t> heap;  // when the ring could not hold it
      int32_t slots = 0;
      int64_t step = 0;
      int64_t position = 0;
      int64_t tokens = 0;
      std::unique_ptr<Event> done;
    };
    std::unique_ptr<Probe> probe;
  };

  WorkingSet ws;
  HostPages host;
  Selection select;
  Recall recall;
  PolicyState policy;
  // The step.
  int32_t tokens = 0;
  int64_t step = 0;
  bool in_step = false;
  absl::Time step_begun;  // BeginStep's entry, for the telemetry's layer-step time
  std::unique_ptr<Event> ready;  // recorded after BeginStep's retrieval work
  StepStats last;
  // Blocking host calls of the step in progress (Append since the last step included) and of
  // the last ended step.
  HostCalls calls;
  HostCalls last_calls;
  int64_t last_calls_step = -1;
  // Captured device work (SequenceOptions::capture_graphs), by the length of the run of
  // batch slots starting at this sequence's: the correction before attention and the
  // background selection after it.
  struct Graphs {
    std::map<int32_t, std::unique_ptr<Graph>> correct, select;
    // Attention reads the engine's q, out and lse: captured only once the same pointers
    // (and run) came back on the next step, and kept for those alone.
    struct AttendKey {
      const void* q = nullptr;
      void* out = nullptr;
      float* lse = nullptr;
      int32_t n = 0;
      bool operator==(const AttendKey&) const = default;
    };
    AttendKey attend_last;
    std::unique_ptr<Graph> attend;  // captured for attend_last
    bool refused = false;  // a capture failed: direct launches from then on
  } graphs;
};

class SequenceBatchImpl;

class RetrieverImpl final : public Retriever {
 public:
  // `shared`: the batch this sequence joins (null: a batch of one of its own).
  RetrieverImpl(const Geometry& g, const SequenceOptions& o, Backend& backend,
                std::unique_ptr<HostTier> host, policy::LayerBudgetStore* policy_store,
                std::shared_ptr<BatchShared> shared = nullptr)
      : shared_(std::move(shared)),
        geometry_(g),
        options_(o),
        backend_(backend),
        policy_store_(policy_store),
        host_(std::move(host)),
        pool_(host_ != nullptr ? &host_->pool() : nullptr) {}

  ~RetrieverImpl() override {
    // Work still queued may touch the buffers below: let it run first.
    for (Stream* s : {compute_, recall_, dma_, xform_fg_, xform_bg_}) {
      if (s != nullptr) (void)s->Synchronize();
    }
    if (offloader_ != nullptr) (void)offloader_->Drain();
    if (shared_ == nullptr) return;
    for (auto& r : records_) shared_->ring().Release(r.ticket);
    for (auto& p : parked_) {
      for (uint64_t t : p.tickets) shared_->ring().Release(t);
    }
    for (uint64_t t : staged_tickets_) shared_->ring().Release(t);
    for (LayerState& l : layers_) {
      if (l.policy.probe != nullptr) shared_->ring().Release(l.policy.probe->ticket);
    }
    if (slot_ >= 0) shared_->FreeSlot(slot_);
  }

  absl::Status Init();
  // The bytes of pinned staging one sequence of this shape needs for its decode path.
  static size_t RingBytes(const Geometry& g, const SequenceOptions& o);
  int32_t slot() const { return slot_; }
  BatchShared& shared() { return *shared_; }

  absl::Status Append(int32_t layer, const void* k, const void* v, int32_t n_tokens) override;
  absl::Status Flush() override;
  HostTier* host_tier() override { return host_.get(); }
  absl::Status Restore(int32_t layer, std::vector<PageHandle> pages) override;
  absl::Status Wait() override;
  absl::Status Close() override;
  absl::Status ReportSignals(const StepSignals& signals) override;
  absl::Status ObserveQueries(int32_t layer, const void* q, int32_t n,
                              int64_t first_position) override;
  SequenceStats Stats() override {
    (void)Collect(/*block=*/false);
    // What Stats says, the telemetry block says too (a scrape after it reads these counts).
    PublishTelemetry(/*gauges=*/true);
    SequenceStats st = stats_;
    FillPolicyStats(&st);
    return st;
  }
  StepStats LastStep(int32_t layer) override {
    (void)Collect(/*block=*/false);
    if (layer < 0 || layer >= geometry_.num_layers) return {};
    StepStats st = layers_[layer].last;
    if (layers_[layer].last_calls_step == st.step) {
      st.host_waits = layers_[layer].last_calls.total();
    }
    st.budget = layers_[layer].policy.budget;
    st.resident_head_pages = ResidentHeadPages(layers_[layer]);
    return st;
  }
  void SetProfiling(bool on) override { profiling_ = on; }
  Stream& compute_stream() override { return *compute_; }
  // The batch object of the members (NewSequenceBatch's, while it exists), else this
  // sequence's own: never null once Init succeeded.
  SequenceBatch* batch() override {
    SequenceBatch* owner = shared_ != nullptr ? shared_->owner() : nullptr;
    return owner != nullptr ? owner : own_batch_.get();
  }
  const Geometry& geometry() const override { return geometry_; }
  const SequenceOptions& options() const override { return options_; }
  int32_t num_tokens(int32_t layer) const override {
    return layer >= 0 && layer < geometry_.num_layers ? layers_[layer].tokens : 0;
  }

 private:
  friend class SequenceBatchImpl;
  bool has_host_tier() const {
    return options_.mode == RetrievalMode::kSpeculative || options_.mode == RetrievalMode::kSync;
  }
  size_t elem() const { return DTypeSize(geometry_.dtype); }
  size_t token_bytes() const {
    return static_cast<size_t>(geometry_.num_kv_heads) * geometry_.head_dim * elem();
  }
  size_t q_bytes() const {
    return static_cast<size_t>(geometry_.num_q_heads) * geometry_.head_dim * elem();
  }
  int32_t selected_pages() const { return options_.selected_pages; }
  int32_t SlotOf(int64_t logical) const;
  bool dma() const { return plan_.dma; }
  // Full pages of the recent window: excluded from top-k candidates.
  int32_t RecentFull(const LayerState& l) const;
  // Slots of the layer's working set (the managed ones change size).
  int32_t Slots(const LayerState& l) const {
    return l.ws.managed != nullptr ? l.ws.managed->capacity() : slots_per_layer_;
  }

  // --- Policies (retriever_policy.cc). ---
  bool policies_on() const { return policies_.budget != nullptr; }
  bool reads_attention() const;
  absl::Status InitPolicies();
  absl::Status InitLayerPolicies(int32_t layer);
  // BeginStep: feeds the last step's attention to the policies, takes this step's budget
  // and pins, and applies them (drop mode: evicts, quantises; selecting modes: uploads
  // head_k and flags). *reselect: the device's selection is stale (budget or pins changed).
  absl::Status ApplyPolicies(int32_t layer, bool* reselect);
  // Attend: sets the policy fields of the attention and enqueues the copy of its token
  // probabilities for ConsumeProbe.
  void SetPolicyArgs(LayerState& l, SparseAttentionArgs* a);
  absl::Status TakeProbe(int32_t layer, int64_t step, int64_t position);
  absl::Status ConsumeProbe(int32_t layer);
  absl::Status Evict(int32_t layer);
  absl::Status UpdateFlags(int32_t layer);
  // The slot for new page `page` of a managed layer (compacting or growing as needed).
  absl::StatusOr<int32_t> PlaceManaged(int32_t layer, int32_t page);
  absl::Status ResizeManaged(LayerState& l, int32_t capacity);
  absl::Status CompactManaged(LayerState& l);
  // Uploads `bytes` of host data into a new backend buffer parked with the next Park.
  absl::StatusOr<void*> StageArgs(const void* src, size_t bytes);
  // The sparse attention of q over the layer's working set, with the policies' fields.
  SparseAttentionArgs AttentionArgs(LayerState& l, const void* q, void* out, float* lse,
                                    int32_t n = 1);
  // Host tier full: drops `n` of the layer's pages (host_drop = evict), demotes them
  // (demote: DemoteHostPages) or refuses.
  absl::Status DropHostPages(int32_t layer, int64_t n);

  // --- The cold tier behind the host tier (retriever_cold.cc; host_drop = demote). ---
  bool demote() const { return cold_ != nullptr; }
  // An append that needs room demotes at least this many pages at once, so that the cold
  // tier's writes go in batches.
  static constexpr int64_t kDemoteBatch = 16;
  // The host_page_of value of a demoted logical page: past every host slot, so Replace
  // (which only refuses negative entries) plans it like any page and the host sees it.
  int64_t ColdMarker(int64_t page) const { return pool_->num_slots() + page; }
  // Frees at least `at_least` and up to `n` host slots (as many as may leave) by demoting
  // the lowest-scoring pages outside the sinks and recent windows, written to the cold tier
  // in one batch. Never a page of a layer whose background plan has not been launched (the plan
  // may name any of its host pages) other than `launching` (or -1), nor one whose slot is in
  // `keep` (the plan being issued); a layer's recall in flight is waited for before its page's slot is freed.
  // RESOURCE_EXHAUSTED (naming `what`) when fewer than `at_least` pages may leave.
  absl::Status DemoteHostPages(int64_t n, int64_t at_least, int32_t launching,
                               std::span<const int64_t> keep, const std::string& what);
  // Before the DMAs of `n` plan items of layer `layer` (its recaller's plan, on the host):
  // brings every demoted page the plan names back into a host slot and rewrites its items.
  absl::Status PromoteCold(int32_t layer, int32_t n);
  // PromoteCold's work once the plan's demoted pages (`cold`) and host slots (`keep`) are
  // known.
  absl::Status PromoteInto(int32_t layer, int32_t n, std::span<const int64_t> cold,
                           std::span<const int64_t> keep);
  int64_t ResidentHeadPages(const LayerState& l) const;
  void FillPolicyStats(SequenceStats* st) const;

  absl::Status CheckCall(int32_t layer, std::string_view what) const;
  absl::Status Allocate(DeviceBuffer* buf, size_t bytes);
  // A view of this sequence's part of the batch's (layer, field) storage.
  absl::Status Allocate(DeviceBuffer* buf, size_t bytes, int32_t layer, Field field);
  // A block of the staging ring: when it is full, the blocks of work already done are taken
  // back first; when that is not enough, the streams are waited for (counted host waits).
  // A null block when `bytes` exceeds a quarter of the ring, or when what is still held
  // after the waits leaves no room (the caller copies through ordinary memory instead).
  // Fails only when a wait fails, never for want of room.
  absl::StatusOr<StagingRing::Block> Stage(size_t bytes);
  // Uploads the layer's live counts (the whole batch's rows) if they changed.
  absl::Status UploadCountsIfDirty(int32_t layer);
  // Accumulates the blocking host calls made since `start` into the layer's step.
  void Meter(int32_t layer, const HostCalls& start) {
    if (layer >= 0 && layer < geometry_.num_layers) {
      layers_[layer].calls += ThreadHostCalls() - start;
    }
  }
  absl::StatusOr<std::unique_ptr<Event>> TakeEvent();
  // Copies `bytes` of host data into a parked buffer and enqueues its upload.
  absl::Status Upload(Stream& s, void* dst, const void* src, size_t bytes);
  // Parks the buffers staged since the last park behind an event on `s`.
  absl::Status Park(Stream& s);
  void Reap();

  absl::Status AppendChecked(int32_t layer, const void* k, const void* v, int32_t n_tokens);
  // Appends validated tokens. `restoring`: the host pages that already hold the layer's
  // logical pages (indexed by logical page), offloaded into instead of new ones (Restore).
  absl::Status AppendTokens(int32_t layer, const void* k, const void* v, int32_t n_tokens,
                            std::vector<PageHandle>* restoring);
  absl::Status FlushOffloads(int32_t layer, std::vector<PageHandle>* restoring);
  // Commits the pages whose offload has run to the host tier (wait: every offload enqueued
  // so far, bounded by the deadline); a refused commit fails the Retriever.
  absl::Status CommitStored(bool wait);
  // Moves the pages of completed StoredBatches to stored_ready_.
  void HarvestStored();
  absl::Status UploadTable(LayerState& l);
  // Writes the layer's counts into the batch's mirror (uploaded before the next step).
  void UpdateCounts(int32_t layer);
  // How Select recalls the misses of its plan (made on the device by Replace).
  using RecallPath = plan::RecallRoute;
  // Score → TopK → Replace → recall of the layer's selected region on `s`. `scored`: the
  // layer's pooled scores already hold q's for every head (the mass trigger computed them).
  // `n`: the run of sequences in consecutive batch slots starting at this one's (batch.h).
  absl::Status Select(Stream& s, RecallPath path, int32_t layer, const void* q,
                      const int32_t* num_pages, const int32_t* candidates, const uint8_t* mask,
                      bool scored = false, int32_t n = 1);
  // The arguments of Select's ScorePages and TopK (into `out`, [n][Hkv][k]).
  ScorePagesArgs ScoreArgs(LayerState& l, const void* q, const int32_t* num_pages,
                           const uint8_t* mask, int32_t n = 1) const;
  TopKArgs SelectArgs(LayerState& l, const int32_t* candidates, const uint8_t* mask, int32_t* out,
                      int32_t n = 1) const;
  // Speculative mode before attention: the drift check of every head of the layer with q_t
  // (QueryCosine's group means always; the drift flags from the configured trigger), then
  // the correction of the drifted heads.
  absl::Status Correct(Stream& s, RecallPath route, int32_t layer, int32_t n = 1);
  // The mass trigger: q_t's scores and selection for every head, and the drift flags from
  // the relative mass the stale selection loses (SelectionLoss).
  absl::Status MassDrift(Stream& s, LayerState& l, const int32_t* num_pages,
                         const int32_t* candidates, int32_t n);
  bool mass_trigger() const { return plan_.mass_trigger; }
  absl::Status RecallPlan(Stream& s, RecallPath path, LayerState& l, int32_t n = 1);
  // Issues the DMAs of background plans that have reached the host: of every layer whose
  // plan is ready (layer < 0), or of `layer`, waiting for its plan (bounded by the
  // deadline) when it is not there yet. Never blocks for other layers.
  absl::Status Pump(int32_t layer);
  absl::Status LaunchPlanned(LayerState& l);
  RecallTarget Target(const LayerState& l, int32_t n = 1) const;
  absl::Status RecordStats(Stream& s, int32_t layer, int64_t step, bool background, bool checked);

  // The phases of a step, which the batch protocol (sequence_batch.cc; the only step path)
  // runs for every member, the device work once per run of consecutive slots.
  // What BeginStep runs: the plan's (offload/step_plan.h), from the layer's step and the
  // policies' verdict.
  using BeginPath = plan::BeginPlan;
  // The wait for the background recall (on the stream), policies and the counts (the batch
  // checked the call and copies the run's queries into q_cur).
  absl::StatusOr<BeginPath> BeginHost(int32_t layer);
  // The device work of `path` for the run of n sequences starting at this one.
  absl::Status BeginDevice(int32_t layer, BeginPath path, int32_t n);
  // The statistics record, the ready event and the view.
  absl::StatusOr<WorkingSetView> BeginFinish(int32_t layer, BeginPath path);
  // Ends the step on the host (the batch checked the call); the plan of what follows
  // attention.
  absl::StatusOr<plan::EndPlan> EndHost(int32_t layer);
  // q_prev (n rows of q), the count snapshot and the background selection of the run.
  absl::Status EndDevice(int32_t layer, const plan::EndPlan& end, const void* q, int32_t n);
  absl::Status EndFinish(int32_t layer);
  // The step's blocking host calls go to the last step's and the sequence's statistics.
  void CloseStepCalls(int32_t layer);
  // Publishes the statistics into the host tier's telemetry block (offload/telemetry.h), when
  // it has one; `gauges`: also the working-set gauges, which walk every layer.
  void PublishTelemetry(bool gauges);
  bool graphs_on() const { return plan_.graphs && !profiling_; }
  // Enqueues `work` on `s` through *graph (when the plan says so: use_graph), capturing it into
  // *graph when empty; directly otherwise, or when a capture of the layer was refused.
  absl::Status RunCaptured(Stream& s, LayerState& l, bool use_graph, std::unique_ptr<Graph>* graph,
                           const std::function<absl::Status()>& work);
  // The sparse attention of `a` (a run of a.batch sequences from this one) on the compute
  // stream: as a graph once the same q, out and lse came back on consecutive steps.
  absl::Status AttendCaptured(LayerState& l, const SparseAttentionArgs& a);
  absl::Status Collect(bool block);
  // While profiling: waits for `s` and adds the time since *mark to *total_us.
  absl::Status Lap(Stream& s, absl::Time* mark, double* total_us) {
    if (!profiling_) return absl::OkStatus();
    absl::Status st = s.Synchronize();
    const absl::Time now = absl::Now();
    if (total_us != nullptr) *total_us += absl::ToDoubleMicroseconds(now - *mark);
    *mark = now;
    return st;
  }
  absl::Status Fail(absl::Status st) {
    if (failed_.ok()) failed_ = st;
    return st;
  }

  // First: the batch's storage outlives every view below.
  std::shared_ptr<BatchShared> shared_;
  int32_t slot_ = -1;
  const Geometry geometry_;
  const SequenceOptions options_;
  Backend& backend_;
  policy::LayerBudgetStore* const policy_store_;
  // The host tier outlives everything below that holds its pages (offloader, page tables).
  const std::unique_ptr<HostTier> host_;
  PagePool* const pool_;
  int32_t slots_per_layer_ = 0;  // slots per layer
  int32_t max_pages_ = 0;        // max pages per layer
  float scale_ = 1.0f;
  RecallStrategy strategy_ = RecallStrategy::kZeroCopy;  // resolved (never kAuto)
  // What every step runs (Init).
  plan::SequencePlan plan_;
  // This sequence's batch object over shared_ (Init): for a sequence made alone, the batch of
  // one (its owner); for a member of a NewSequenceBatch batch, the object it steps through
  // once that batch object is gone.
  std::unique_ptr<SequenceBatch> own_batch_;

  std::vector<LayerState> layers_;
  policy::Policies policies_;  // empty unless options_.policy is not the default
  std::unique_ptr<policy::HostDropPolicy> host_drop_;
  ColdPages* cold_ = nullptr;  // host_drop = demote: the host tier's cold tier
  // Recorded on the compute stream after a demotion freed slots; waited for before the host
  // writes a promoted page (retriever_cold.cc).
  std::unique_ptr<Event> demote_fence_;
  bool fence_pending_ = false;
  int32_t min_capacity_ = 0;  // managed layers never shrink below it
  std::unique_ptr<PageOffloader> offloader_;
  std::vector<std::unique_ptr<uint8_t[]>> staged_;  // not yet parked
  std::vector<uint64_t> staged_tickets_;            // not yet parked
  std::vector<DeviceBuffer> staged_device_;         // not yet parked
  std::deque<Parked> parked_;
  std::deque<StatRecord> records_;
  std::deque<StoredBatch> stored_;        // offloads not yet known to have run
  std::vector<StoredPage> stored_ready_;  // completed, not yet committed
  std::vector<std::unique_ptr<Event>> spare_events_;
  std::deque<std::unique_ptr<Event>> retired_events_;  // per-step events, until they fire
  SequenceStats stats_;
  // Telemetry: the block (nullopt: none), what it held when this writer took it over (a
  // reattached session continues its counts), and the counts SequenceStats has no field for.
  std::optional<TelemetryBlock> telemetry_block_;
  TelemetryValues telemetry_base_;
  TelemetryValues telemetry_own_;
  bool closed_ = false;
  bool profiling_ = false;
  absl::Status failed_;

  // The batch's streams.
  Stream* compute_ = nullptr;
  Stream* recall_ = nullptr;
  Stream* xform_fg_ = nullptr;
  Stream* xform_bg_ = nullptr;
  Stream* dma_ = nullptr;
  std::unique_ptr<Event> sync_compute_, sync_recall_, sync_dma_;
};

}  // namespace kvtier::retriever_internal

#endif  // KVTIER_OFFLOAD_RETRIEVER_IMPL_H_
