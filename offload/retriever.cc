// Retriever implementation. Invariants (per layer):
//   - Slots: sink pages L < s live in slot L; in speculative and sync mode slots [s, s+k)
//     are the selected region (written only by Replace on the device) and page L ≥ s of the
//     recent window lives in ring slot s + k + (L − s) mod r; drop mode rings pages L ≥ s over
//     [s, S); full mode keeps page L in slot L.
//   - The host owns the slot-table entries outside the selected region; it mirrors them and
//     uploads them when they change. The device owns the selected region.
//   - A page is offloaded (host page, summary, host_page_of entry) before any selection can
//     name it: all three are enqueued on the compute stream before the counts that make the
//     page a candidate, and background selection starts after an event recorded later.
//   - Background selection reads its own snapshot of the page count, so appends for the next
//     step (compute stream) never race with it.
//   - Host memory that an enqueued copy reads or writes stays alive until an event recorded
//     after that copy has fired (Parked).
//   - Every flushed offload of new pages is one StoredBatch, its event recorded on the
//     compute stream after the op; batches complete in order (one stream), so the pages of
//     the completed prefix are reported in offload order. Restore's pages make no batch.
//   - A restored layer goes through Append's own path (AppendTokens) with the host pages
//     turned back into NHD, its offloads writing into the given pages: the working set,
//     mirrors, counts, summaries and host_page_of end up exactly as after the appends.
#include "offload/retriever.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kernels/registry.h"
#include "kvtier/layout.h"
#include "offload/host_tier.h"
#include "offload/retriever_impl.h"

namespace kvtier {

namespace retriever_internal {

int32_t RetrieverImpl::SlotOf(int64_t logical) const {
  const int32_t s = options_.sink_pages;
  switch (options_.mode) {
    case RetrievalMode::kFull:
      return static_cast<int32_t>(logical);
    case RetrievalMode::kDrop:
      return logical < s ? static_cast<int32_t>(logical)
                         : s + static_cast<int32_t>((logical - s) % (slots_per_layer_ - s));
    case RetrievalMode::kSpeculative:
    case RetrievalMode::kSync:
      return logical < s ? static_cast<int32_t>(logical)
                         : s + selected_pages() +
                               static_cast<int32_t>((logical - s) % options_.recent_pages);
  }
  return -1;
}

int32_t RetrieverImpl::RecentFull(const LayerState& l) const {
  const int32_t full = l.tokens / geometry_.page_size;
  const int32_t total = (l.tokens + geometry_.page_size - 1) / geometry_.page_size;
  const int32_t recent_lo = std::max(options_.sink_pages, total - options_.recent_pages);
  return std::max(0, full - recent_lo);
}

absl::Status RetrieverImpl::Allocate(DeviceBuffer* buf, size_t bytes) {
  KVTIER_ASSIGN_OR_RETURN(*buf, backend_.Allocate(std::max<size_t>(bytes, 1)));
  return absl::OkStatus();
}

absl::Status RetrieverImpl::Allocate(DeviceBuffer* buf, size_t bytes, int32_t layer, Field field) {
  KVTIER_ASSIGN_OR_RETURN(*buf, shared_->View(layer, field, bytes, slot_));
  return absl::OkStatus();
}

namespace {

// The most slots a layer's working set can have (RetrieverImpl::Slots): every page in full
// mode; the budget in speculative, sync and plain drop mode; in drop mode with policies the
// budget and the page being filled, or every page and one more: PlaceManaged grows a layer
// that holds the whole context (a prompt, until the first step evicts it) up to there.
size_t MaxSlots(const Geometry& g, const SequenceOptions& o) {
  const int64_t pages = (int64_t{o.max_tokens} + g.page_size - 1) / g.page_size;
  const int64_t budget =
      std::max<int64_t>(1, int64_t{o.sink_pages} + o.selected_pages + o.recent_pages);
  switch (o.mode) {
    case RetrievalMode::kFull:
      return static_cast<size_t>(std::max<int64_t>(pages, 1));
    case RetrievalMode::kDrop:
      return static_cast<size_t>(o.policy.is_default() ? budget : std::max(budget, pages) + 1);
    case RetrievalMode::kSpeculative:
    case RetrievalMode::kSync:
      break;
  }
  return static_cast<size_t>(budget);
}

// The ring of a sequence whose layers hold at most `slots` slots (RetrieverImpl::RingBytes).
size_t RingBytesFor(const Geometry& g, const SequenceOptions& o, size_t slots) {
  const size_t hkv = g.num_kv_heads;
  const size_t a = StagingRing::kAlign;
  const auto round = [a](size_t b) { return (b + a - 1) / a * a + a; };
  const size_t record = round(hkv * (4 + 1 + 4 + 4) + hkv * slots * 4);
  const size_t uploads = round(16 * 4096) + 2 * round(hkv * slots * 4) + round(8 * o.recent_pages);
  size_t per_layer = 2 * record + uploads;
  size_t bytes = 4 * per_layer * g.num_layers;
  if (!o.policy.is_default()) {
    const size_t probe = round(static_cast<size_t>(g.num_q_heads) * slots * g.page_size * 4) +
                         round(hkv * slots * 4);
    bytes += 2 * probe * g.num_layers + (size_t{1} << 20);
  }
  return bytes;
}

// Pinned staging past which a sequence's largest working set is not worth sizing the ring
// for (a drop layer of a long context holding its whole prompt); what the ring then cannot
// hold goes through ordinary memory (Stage).
constexpr size_t kMaxRingBytes = size_t{256} << 20;

}  // namespace

size_t RetrieverImpl::RingBytes(const Geometry& g, const SequenceOptions& o) {
  // Per layer-step at most: the live counts, the host-owned table entries, the host page of
  // the pages filled, a foreground and a background statistics record (the slot table of
  // the working set), and, for policies that read attention, the probe. Records stay until
  // the next steps collect them: room for four steps of every layer. A layer holds its probe
  // from its attention to its next step while the others stage theirs: room for the probes
  // of two steps. All of them are as large as the working set, which is not the budget's in
  // every mode (MaxSlots): sized for the largest, up to kMaxRingBytes, and never below what
  // the budget asks.
  const size_t budget = static_cast<size_t>(
      std::max<int64_t>(1, int64_t{o.sink_pages} + o.selected_pages + o.recent_pages));
  const size_t bytes = std::max(RingBytesFor(g, o, budget),
                                std::min(RingBytesFor(g, o, MaxSlots(g, o)), kMaxRingBytes));
  return std::max<size_t>(bytes, size_t{256} << 10);
}

absl::StatusOr<StagingRing::Block> RetrieverImpl::Stage(size_t bytes) {
  StagingRing& ring = shared_->ring();
  if (bytes > ring.capacity() / 4) return StagingRing::Block{};
  StagingRing::Block b = ring.TryAcquire(bytes);
  if (b.data != nullptr) return b;
  Reap();
  (void)Collect(/*block=*/false);
  b = ring.TryAcquire(bytes);
  if (b.data != nullptr) return b;
  // Everything staged is still in flight: wait for it (counted, as every blocking call).
  KVTIER_RETURN_IF_ERROR(compute_->Synchronize());
  KVTIER_RETURN_IF_ERROR(recall_->Synchronize());
  Reap();
  KVTIER_RETURN_IF_ERROR(Collect(/*block=*/true));
  // The page offloader shares the ring: its batches are released only as it reaps them,
  // which it does when it offloads again. A prefill appended in small chunks fills the ring
  // with batches that have long run; take them back.
  if (offloader_ != nullptr) KVTIER_RETURN_IF_ERROR(offloader_->Drain());
  // What is still held is not this sequence's to take back now: the probes its layers hold
  // until their next step, the blocks of the work being staged (not yet behind an event),
  // and the other members' of a batch. A step the sequence's limits allow is never refused
  // for them: without room the block goes the unstaged way, as one larger than the ring
  // allows does (a counted synchronous copy), as the page offloader's item lists do.
  return ring.TryAcquire(bytes);
}

absl::StatusOr<std::unique_ptr<Event>> RetrieverImpl::TakeEvent() {
  if (!spare_events_.empty()) {
    std::unique_ptr<Event> e = std::move(spare_events_.back());
    spare_events_.pop_back();
    return e;
  }
  return backend_.CreateEvent();
}

absl::Status RetrieverImpl::Init() {
  KVTIER_RETURN_IF_ERROR(geometry_.Validate());
  const auto bad = [](std::string msg) { return absl::InvalidArgumentError(std::move(msg)); };
  // The options' rules are the resolver's alone (kvtier/options.h); what follows is what only
  // a Retriever knows: its host tier, its batch.
  KVTIER_RETURN_IF_ERROR(ResolveSequenceOptions(options_, geometry_.page_size).status());
  // What runs in every step, and the rules that combine features (offload/step_plan.h).
  KVTIER_ASSIGN_OR_RETURN(
      plan_, plan::PlanSequence(plan::ConfigOf(
                 options_, /*batch=*/shared_ != nullptr && shared_->max_batch() > 1,
                 /*cold_tier=*/host_ != nullptr && host_->cold() != nullptr,
                 backend_.SupportsCapture())));
  max_pages_ = (options_.max_tokens + geometry_.page_size - 1) / geometry_.page_size;
  slots_per_layer_ = options_.mode == RetrievalMode::kFull ? max_pages_ : options_.budget_pages();
  KVTIER_RETURN_IF_ERROR(InitPolicies());
  scale_ = options_.softmax_scale > 0 ? options_.softmax_scale
                                      : 1.0f / std::sqrt(float(geometry_.head_dim));
  if (has_host_tier() && pool_ == nullptr) {
    return bad(absl::StrFormat("sequence mode %s needs a host page pool",
                               RetrievalModeName(options_.mode)));
  }
  if (shared_ == nullptr) {
    // Made alone: the one member of a batch of one (its storage, and the batch object).
    KVTIER_ASSIGN_OR_RETURN(shared_, BatchShared::Create(geometry_, options_, backend_,
                                                         /*max_batch=*/1,
                                                         RingBytes(geometry_, options_)));
    own_batch_ = NewBatchObject(geometry_, options_, backend_, shared_, /*owner=*/true);
  } else {
    own_batch_ = NewBatchObject(geometry_, options_, backend_, shared_, /*owner=*/false);
  }
  KVTIER_ASSIGN_OR_RETURN(slot_, shared_->TakeSlot());
  compute_ = &shared_->compute();
  recall_ = &shared_->recall();
  xform_fg_ = &shared_->xform_fg();
  xform_bg_ = &shared_->xform_bg();
  dma_ = &shared_->dma();
  if (has_host_tier()) {
    KVTIER_ASSIGN_OR_RETURN(offloader_,
                            PageOffloader::Create(geometry_, backend_, *pool_, &shared_->ring()));
  }
  KVTIER_ASSIGN_OR_RETURN(sync_compute_, backend_.CreateEvent());
  KVTIER_ASSIGN_OR_RETURN(sync_recall_, backend_.CreateEvent());
  KVTIER_ASSIGN_OR_RETURN(sync_dma_, backend_.CreateEvent());
  if (has_host_tier()) strategy_ = plan_.strategy;
  stats_.recall_strategy = strategy_;
  if (host_ != nullptr) telemetry_block_ = host_->telemetry();
  if (telemetry_block_.has_value()) {
    telemetry_base_ = telemetry_block_->Read().value_or(TelemetryValues{});
  }

  const size_t hkv = geometry_.num_kv_heads;
  const size_t slot_bytes = static_cast<size_t>(geometry_.page_size) * token_bytes();
  const bool select = has_host_tier();
  const size_t kk = static_cast<size_t>(std::max(selected_pages(), 1));
  layers_.resize(geometry_.num_layers);
  stats_.corrections.assign(static_cast<size_t>(geometry_.num_layers) * hkv, 0);
  const bool managed = plan_.managed;
  for (int32_t li = 0; li < geometry_.num_layers; ++li) {
    LayerState& l = layers_[li];
    const auto field = [&](DeviceBuffer* buf, size_t bytes, Field f) {
      return Allocate(buf, bytes, li, f);
    };
    if (managed)
      l.ws.managed = std::make_unique<HeadSlotTable>(geometry_.num_kv_heads, min_capacity_);
    const int32_t slots = Slots(l);
    if (managed) {  // resized by the policies: buffers of its own
      KVTIER_RETURN_IF_ERROR(Allocate(&l.ws.k, slots * slot_bytes));
      KVTIER_RETURN_IF_ERROR(Allocate(&l.ws.v, slots * slot_bytes));
      KVTIER_RETURN_IF_ERROR(Allocate(&l.ws.table, hkv * slots * sizeof(int32_t)));
    } else {
      KVTIER_RETURN_IF_ERROR(field(&l.ws.k, slots * slot_bytes, Field::kK));
      KVTIER_RETURN_IF_ERROR(field(&l.ws.v, slots * slot_bytes, Field::kV));
      KVTIER_RETURN_IF_ERROR(field(&l.ws.table, hkv * slots * sizeof(int32_t), Field::kTable));
    }
    KVTIER_RETURN_IF_ERROR(shared_->EnsureCounts(li));
    l.ws.counts.full_pages = shared_->live(li, kFullPages, slot_);
    l.ws.counts.candidates = shared_->live(li, kCandidates, slot_);
    l.ws.counts.partial_page = shared_->live(li, kPartialPage, slot_);
    l.ws.counts.partial_len = shared_->live(li, kPartialLen, slot_);
    l.ws.counts.full_at_end = shared_->end(li, kFullAtEnd, slot_);
    l.ws.counts.cand_at_end = shared_->end(li, kCandAtEnd, slot_);
    UpdateCounts(li);
    KVTIER_RETURN_IF_ERROR(field(&l.select.q_cur, q_bytes(), Field::kQCur));
    KVTIER_RETURN_IF_ERROR(field(&l.select.q_prev, q_bytes(), Field::kQPrev));
    if (select) {
      KVTIER_RETURN_IF_ERROR(field(
          &l.host.summaries, static_cast<size_t>(max_pages_) * geometry_.summary_bytes(),
          Field::kSummaries));
      if (options_.summary == SummaryMode::kKeyCodes) {
        KVTIER_RETURN_IF_ERROR(field(&l.host.codes,
                                     static_cast<size_t>(max_pages_) * geometry_.key_code_bytes(),
                                     Field::kCodes));
      }
      KVTIER_RETURN_IF_ERROR(
          field(&l.host.page_of, static_cast<size_t>(max_pages_) * sizeof(int64_t), Field::kPageOf));
      KVTIER_RETURN_IF_ERROR(
          field(&l.select.pooled, hkv * max_pages_ * sizeof(float), Field::kPooled));
      KVTIER_RETURN_IF_ERROR(
          field(&l.select.selected, hkv * kk * sizeof(int32_t), Field::kSelected));
      KVTIER_RETURN_IF_ERROR(field(&l.select.items, hkv * kk * sizeof(RecallItem), Field::kItems));
      KVTIER_RETURN_IF_ERROR(
          field(&l.select.num_misses, hkv * sizeof(int32_t), Field::kNumMisses));
      KVTIER_RETURN_IF_ERROR(field(&l.select.drifted, hkv, Field::kDrifted));
      KVTIER_RETURN_IF_ERROR(field(&l.select.group_mean, hkv * sizeof(float), Field::kGroupMean));
      if (mass_trigger()) {
        KVTIER_RETURN_IF_ERROR(field(&l.select.fresh, hkv * kk * sizeof(int32_t), Field::kFresh));
        KVTIER_RETURN_IF_ERROR(field(&l.select.lost_mass, hkv * sizeof(float), Field::kLostMass));
      }
      if (dma()) {
        KVTIER_ASSIGN_OR_RETURN(
            l.recall.recaller,
            SlabRecaller::Create(backend_, geometry_, strategy_, static_cast<int32_t>(hkv * kk),
                                 options_.stream_chunk_items));
      }
      l.host.pages = std::make_unique<PageTable>(*pool_);
      l.host.page_of_mirror.assign(max_pages_, -1);
    }
    for (auto* e : {&l.recall.attn_done, &l.recall.done, &l.ready, &l.recall.plan_ready}) {
      KVTIER_ASSIGN_OR_RETURN(*e, backend_.CreateEvent());
    }
    // Empty slot tables (0xFF bytes = −1), zero previous query (cosine 0).
    KVTIER_RETURN_IF_ERROR(backend_.Memset(*compute_, l.ws.table.data(), 0xFF, l.ws.table.size()));
    KVTIER_RETURN_IF_ERROR(
        backend_.Memset(*compute_, l.select.q_prev.data(), 0, l.select.q_prev.size()));
    if (select) {
      KVTIER_RETURN_IF_ERROR(
          backend_.Memset(*compute_, l.host.page_of.data(), 0xFF, l.host.page_of.size()));
      KVTIER_RETURN_IF_ERROR(
          backend_.Memset(*compute_, l.host.summaries.data(), 0, l.host.summaries.size()));
      if (l.host.codes.data() != nullptr) {
        KVTIER_RETURN_IF_ERROR(
            backend_.Memset(*compute_, l.host.codes.data(), 0, l.host.codes.size()));
      }
    }
    l.ws.table_mirror.assign(hkv * slots_per_layer_, kEmptySlot);
    KVTIER_RETURN_IF_ERROR(InitLayerPolicies(li));
  }
  // The attention workspace, for the largest attention this sequence (or its batch) runs.
  LayerState& l0 = layers_[0];
  SparseAttentionArgs probe = AttentionArgs(l0, nullptr, nullptr, nullptr);
  probe.batch = shared_->max_batch();
  KVTIER_RETURN_IF_ERROR(shared_->ReserveWorkspace(backend_.SparseAttentionWorkspaceBytes(probe)));
  return Wait();
}

absl::Status RetrieverImpl::CheckCall(int32_t layer, std::string_view what) const {
  if (closed_) {
    return absl::FailedPreconditionError(absl::StrFormat("%s: the sequence is closed", what));
  }
  if (!failed_.ok()) return failed_;
  if (layer < 0 || layer >= geometry_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: layer = %d must be in [0, %d)", what, layer, geometry_.num_layers));
  }
  return absl::OkStatus();
}

absl::Status RetrieverImpl::Upload(Stream& s, void* dst, const void* src, size_t bytes) {
  KVTIER_ASSIGN_OR_RETURN(StagingRing::Block b, Stage(bytes));
  if (b.data == nullptr) {
    // Too large for the ring (a restore, a policy's bulk upload): ordinary memory, whose copy
    // the backend may serve synchronously.
    auto buf = std::make_unique<uint8_t[]>(bytes);
    std::memcpy(buf.get(), src, bytes);
    KVTIER_RETURN_IF_ERROR(backend_.Copy(s, dst, buf.get(), bytes));
    staged_.push_back(std::move(buf));
    return absl::OkStatus();
  }
  std::memcpy(b.data, src, bytes);
  staged_tickets_.push_back(b.ticket);
  return backend_.Copy(s, dst, b.data, bytes);
}

absl::Status RetrieverImpl::Park(Stream& s) {
  Reap();
  if (staged_.empty() && staged_device_.empty() && staged_tickets_.empty()) {
    return absl::OkStatus();
  }
  Parked p;
  p.buffers = std::move(staged_);
  staged_.clear();
  p.tickets = std::move(staged_tickets_);
  staged_tickets_.clear();
  p.device = std::move(staged_device_);
  staged_device_.clear();
  KVTIER_ASSIGN_OR_RETURN(p.done, TakeEvent());
  absl::Status st = s.Record(*p.done);
  parked_.push_back(std::move(p));
  return st;
}

void RetrieverImpl::Reap() {
  while (!parked_.empty() && parked_.front().done->Query()) {
    for (uint64_t t : parked_.front().tickets) shared_->ring().Release(t);
    spare_events_.push_back(std::move(parked_.front().done));
    parked_.pop_front();
  }
  while (!retired_events_.empty() && retired_events_.front()->Query()) {
    spare_events_.push_back(std::move(retired_events_.front()));
    retired_events_.pop_front();
  }
}

absl::Status RetrieverImpl::UploadTable(LayerState& l) {
  if (!l.ws.table_dirty) return absl::OkStatus();
  l.ws.table_dirty = false;
  auto* table = l.ws.table.as<int32_t>();
  if (l.ws.managed != nullptr) {
    const std::vector<int32_t>& t = l.ws.managed->table();
    return Upload(*compute_, table, t.data(), t.size() * sizeof(int32_t));
  }
  const bool selects = has_host_tier();
  for (int32_t h = 0; h < geometry_.num_kv_heads; ++h) {
    const size_t row = static_cast<size_t>(h) * slots_per_layer_;
    if (!selects) {
      KVTIER_RETURN_IF_ERROR(Upload(*compute_, table + row, &l.ws.table_mirror[row],
                                    slots_per_layer_ * sizeof(int32_t)));
      continue;
    }
    // Sinks and the recent ring; the selected region between them belongs to the device.
    if (options_.sink_pages > 0) {
      KVTIER_RETURN_IF_ERROR(Upload(*compute_, table + row, &l.ws.table_mirror[row],
                                    options_.sink_pages * sizeof(int32_t)));
    }
    const size_t ring = row + options_.sink_pages + selected_pages();
    KVTIER_RETURN_IF_ERROR(Upload(*compute_, table + ring, &l.ws.table_mirror[ring],
                                  options_.recent_pages * sizeof(int32_t)));
  }
  return absl::OkStatus();
}

void RetrieverImpl::UpdateCounts(int32_t layer) {
  const LayerState& l = layers_[layer];
  const int32_t p = geometry_.page_size;
  const int32_t full = l.tokens / p;
  *shared_->mirror(layer, kFullPages, slot_) = full;
  *shared_->mirror(layer, kCandidates, slot_) = full - RecentFull(l);
  *shared_->mirror(layer, kPartialPage, slot_) = l.tokens % p == 0 ? -1 : full;
  *shared_->mirror(layer, kPartialLen, slot_) = l.tokens % p;
  shared_->MarkCountsDirty(layer);
}

absl::Status RetrieverImpl::UploadCountsIfDirty(int32_t layer) {
  if (!shared_->counts_dirty(layer)) return absl::OkStatus();
  // The live rows only, of the whole batch: the snapshot rows are the background
  // selection's, and every other sequence's column is its current value.
  shared_->ClearCountsDirty(layer);
  return Upload(*compute_, shared_->live(layer, kFullPages, 0),
                shared_->mirror(layer, kFullPages, 0), shared_->counts_bytes());
}

absl::Status RetrieverImpl::FlushOffloads(int32_t layer, std::vector<PageHandle>* restoring) {
  LayerState& l = layers_[layer];
  if (l.host.pending.empty()) return absl::OkStatus();
  std::vector<int64_t> logical, slots;
  for (const LayerState::HostPages::Pending& p : l.host.pending) {
    logical.push_back(p.logical);
    slots.push_back(p.slot);
  }
  l.host.pending.clear();
  OffloadRequest req;
  req.k_src = l.ws.k.data();
  req.v_src = l.ws.v.data();
  req.num_src_slots = slots_per_layer_;
  req.summaries = l.host.summaries.data();
  req.num_summary_pages = max_pages_;
  req.summary_mode = options_.summary;
  req.codes = l.host.codes.as<uint8_t>();
  req.logical_pages = logical;
  req.src_slots = slots;
  if (restoring == nullptr) {
    KVTIER_RETURN_IF_ERROR(offloader_->Offload(*compute_, *l.host.pages, req));
  } else {
    std::vector<PageHandle> pages;
    for (int64_t page : logical) pages.push_back(std::move((*restoring)[page]));
    KVTIER_RETURN_IF_ERROR(
        offloader_->OffloadInto(*compute_, *l.host.pages, req, std::move(pages)));
  }
  StoredBatch batch;
  for (int64_t page : logical) {
    KVTIER_ASSIGN_OR_RETURN(PageEntry e, l.host.pages->Lookup(page));
    l.host.page_of_mirror[page] = e.slot;
    batch.pages.push_back(StoredPage{layer, page, e.slot, e.generation});
  }
  // The flushed pages are consecutive: one upload of their host_page_of entries.
  const int64_t first = logical.front();
  KVTIER_RETURN_IF_ERROR(Upload(*compute_, l.host.page_of.as<int64_t>() + first,
                                &l.host.page_of_mirror[first], logical.size() * sizeof(int64_t)));
  if (restoring != nullptr) return absl::OkStatus();
  stats_.offloaded_pages += static_cast<int64_t>(logical.size());
  HarvestStored();
  KVTIER_ASSIGN_OR_RETURN(batch.done, TakeEvent());
  absl::Status st = compute_->Record(*batch.done);
  if (st.ok()) stored_.push_back(std::move(batch));
  return st;
}

void RetrieverImpl::HarvestStored() {
  while (!stored_.empty() && stored_.front().done->Query()) {
    StoredBatch& b = stored_.front();
    stored_ready_.insert(stored_ready_.end(), b.pages.begin(), b.pages.end());
    spare_events_.push_back(std::move(b.done));
    stored_.pop_front();
  }
}

absl::Status RetrieverImpl::CommitStored(bool wait) {
  if (!failed_.ok()) return failed_;
  if (wait && !stored_.empty()) {
    // One stream: the last batch done means every batch is.
    absl::Status st = stored_.back().done->Wait(options_.deadline);
    if (absl::IsDeadlineExceeded(st)) {
      return absl::DeadlineExceededError(
          absl::StrFormat("Flush: offloads in flight did not complete within the deadline of %s",
                          absl::FormatDuration(options_.deadline)));
    }
    if (!st.ok()) return Fail(st);
  }
  HarvestStored();
  if (stored_ready_.empty() || host_ == nullptr) {
    stored_ready_.clear();
    return absl::OkStatus();
  }
  absl::Status st = host_->Commit(stored_ready_);
  stored_ready_.clear();
  return st.ok() ? st : Fail(st);
}

absl::Status RetrieverImpl::Flush() {
  if (closed_) return absl::FailedPreconditionError("Flush: the sequence is closed");
  absl::Status st = CommitStored(/*wait=*/true);
  PublishTelemetry(/*gauges=*/true);
  return st;
}

absl::Status RetrieverImpl::Restore(int32_t layer, std::vector<PageHandle> pages) {
  KVTIER_RETURN_IF_ERROR(CheckCall(layer, "Restore"));
  if (!has_host_tier()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "Restore: mode %s has no host tier to restore from", RetrievalModeName(options_.mode)));
  }
  LayerState& l = layers_[layer];
  if (l.tokens != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "Restore: layer %d holds %d tokens: only an empty layer can be restored", layer, l.tokens));
  }
  const int32_t p = geometry_.page_size;
  if (pages.size() > static_cast<size_t>(options_.max_tokens / p)) {
    return absl::OutOfRangeError(
        absl::StrFormat("Restore: %d pages of %d tokens exceed max_tokens = %d", pages.size(), p,
                        options_.max_tokens));
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    if (!pages[i].valid() || pages[i].pool() != pool_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Restore: pages[%d] is empty or a slot of another page pool", i));
    }
  }
  if (pages.empty()) return absl::OkStatus();
  // HND host pages → NHD rows [n·p][Hkv][d] on the host: exact copies of d elements.
  const int32_t n_tokens = static_cast<int32_t>(pages.size()) * p;
  const size_t page_rows = static_cast<size_t>(p) * token_bytes();
  const size_t bytes = pages.size() * page_rows;
  KVTIER_CHECK(bytes <= (size_t{1} << 52));  // ≤ 2^30 tokens of ≤ 2 MiB (validated bounds)
  auto k = std::make_unique<uint8_t[]>(bytes);
  auto v = std::make_unique<uint8_t[]>(bytes);
  for (size_t i = 0; i < pages.size(); ++i) {
    HostPageToRows(geometry_, pages[i].data(), k.get() + i * page_rows, v.get() + i * page_rows);
  }
  const uint8_t* ks = k.get();
  const uint8_t* vs = v.get();
  // The compute stream reads the rows later: they stay alive until the next Park's event.
  staged_.push_back(std::move(k));
  staged_.push_back(std::move(v));
  return AppendTokens(layer, ks, vs, n_tokens, &pages);
}

absl::Status RetrieverImpl::Append(int32_t layer, const void* k, const void* v, int32_t n_tokens) {
  const HostCalls start = ThreadHostCalls();
  absl::Status st = AppendChecked(layer, k, v, n_tokens);
  Meter(layer, start);
  return st;
}

absl::Status RetrieverImpl::AppendChecked(int32_t layer, const void* k, const void* v,
                                          int32_t n_tokens) {
  KVTIER_RETURN_IF_ERROR(CheckCall(layer, "Append"));
  if (k == nullptr || v == nullptr) {
    return absl::InvalidArgumentError("Append: k and v must be non-null");
  }
  if (absl::Status ps = Pump(-1); !ps.ok()) return Fail(ps);  // background DMAs, if ready
  LayerState& l = layers_[layer];
  if (n_tokens < 1 || n_tokens > options_.max_tokens - l.tokens) {
    return absl::OutOfRangeError(absl::StrFormat(
        "Append: layer %d holds %d tokens; n_tokens = %d must be in [1, %d] (max_tokens = %d)",
        layer, l.tokens, n_tokens, options_.max_tokens - l.tokens, options_.max_tokens));
  }
  if (l.in_step) {
    return absl::FailedPreconditionError(
        absl::StrFormat("Append: layer %d is between BeginStep and EndStep", layer));
  }
  const int32_t p = geometry_.page_size;
  if (has_host_tier() && demote()) {
    // In pieces that fill at most the free pages (or one): the pages this append offloads
    // become candidates for the demotions the next pieces need.
    const auto* ks = static_cast<const uint8_t*>(k);
    const auto* vs = static_cast<const uint8_t*>(v);
    for (int32_t done = 0; done < n_tokens;) {
      const PagePoolStats ps = pool_->stats();
      const int64_t free = ps.capacity - ps.in_use;
      const int64_t fill = std::max<int64_t>(free, 1);
      const int64_t fits = (l.tokens / p + fill + 1) * int64_t{p} - 1 - l.tokens;
      const auto m = static_cast<int32_t>(std::min<int64_t>(n_tokens - done, fits));
      const int64_t filling = (l.tokens + m) / p - l.tokens / p;
      if (filling > free) KVTIER_RETURN_IF_ERROR(DropHostPages(layer, filling - free));
      const size_t off = static_cast<size_t>(done) * token_bytes();
      KVTIER_RETURN_IF_ERROR(AppendTokens(layer, ks + off, vs + off, m, /*restoring=*/nullptr));
      done += m;
    }
    return CommitStored(/*wait=*/false);
  }
  if (has_host_tier()) {
    const int64_t filling = (l.tokens + n_tokens) / p - l.tokens / p;
    const PagePoolStats ps = pool_->stats();
    if (filling > ps.capacity - ps.in_use) {
      KVTIER_RETURN_IF_ERROR(DropHostPages(layer, filling - (ps.capacity - ps.in_use)));
    }
  }
  KVTIER_RETURN_IF_ERROR(AppendTokens(layer, k, v, n_tokens, /*restoring=*/nullptr));
  return CommitStored(/*wait=*/false);
}

absl::Status RetrieverImpl::AppendTokens(int32_t layer, const void* k, const void* v,
                                         int32_t n_tokens, std::vector<PageHandle>* restoring) {
  // From here on a failure leaves the layer inconsistent: it fails the Retriever.
  LayerState& l = layers_[layer];
  const int32_t p = geometry_.page_size;
  const auto* ks = static_cast<const uint8_t*>(k);
  const auto* vs = static_cast<const uint8_t*>(v);
  const size_t tb = token_bytes();
  // Tokens bound for consecutive slots are copied together: one copy of K and one of V per
  // run of pages (a chunked prefill fills the recent ring in one), not per page. A run is
  // copied before anything reads the working set or moves it.
  size_t run_dst = 0, run_src = 0, run_bytes = 0;
  const auto copy_run = [&]() {
    if (run_bytes == 0) return absl::OkStatus();
    const size_t bytes = std::exchange(run_bytes, 0);
    absl::Status st = backend_.Copy(*compute_, l.ws.k.as<uint8_t>() + run_dst, ks + run_src, bytes);
    if (st.ok()) st = backend_.Copy(*compute_, l.ws.v.as<uint8_t>() + run_dst, vs + run_src, bytes);
    return st;
  };
  int32_t done = 0;
  while (done < n_tokens) {
    const int64_t page = l.tokens / p;
    const int32_t off = l.tokens % p;
    int32_t slot = 0;
    if (l.ws.managed == nullptr) {
      slot = SlotOf(page);
    } else if (off == 0) {
      // Placing a managed page may move the working set.
      if (absl::Status cs = copy_run(); !cs.ok()) return Fail(cs);
      absl::StatusOr<int32_t> placed = PlaceManaged(layer, static_cast<int32_t>(page));
      if (!placed.ok()) return Fail(placed.status());
      slot = *placed;
      l.ws.table_dirty = true;
    } else {
      slot = l.ws.managed->SlotOf(0, static_cast<int32_t>(page));
    }
    if (off == 0 && l.ws.managed == nullptr) {
      for (int32_t h = 0; h < geometry_.num_kv_heads; ++h) {
        l.ws.table_mirror[static_cast<size_t>(h) * slots_per_layer_ + slot] =
            static_cast<int32_t>(page);
      }
      l.ws.table_dirty = true;
    }
    const int32_t n = std::min(p - off, n_tokens - done);
    const size_t dst = (static_cast<size_t>(slot) * p + off) * tb;
    const size_t src = static_cast<size_t>(done) * tb;
    if (run_bytes == 0 || run_dst + run_bytes != dst || run_src + run_bytes != src) {
      if (absl::Status cs = copy_run(); !cs.ok()) return Fail(cs);
      run_dst = dst;
      run_src = src;
    }
    run_bytes += n * tb;
    l.tokens += n;
    done += n;
    if (l.tokens % p == 0 && has_host_tier()) {
      l.host.pending.push_back({page, slot});
      // Flush before a ring slot holding a pending page is reused.
      if (static_cast<int32_t>(l.host.pending.size()) >= options_.recent_pages) {
        absl::Status fs = copy_run();
        if (fs.ok()) fs = FlushOffloads(layer, restoring);
        if (!fs.ok()) return Fail(fs);
      }
    }
  }
  if (absl::Status cs = copy_run(); !cs.ok()) return Fail(cs);
  absl::Status st = FlushOffloads(layer, restoring);
  if (st.ok()) st = UploadTable(l);
  UpdateCounts(layer);
  if (st.ok()) st = Park(*compute_);
  if (!st.ok()) return Fail(st);
  if (restoring == nullptr) {
    stats_.appended_tokens += n_tokens;
    PublishTelemetry(/*gauges=*/false);
  }
  return absl::OkStatus();
}

absl::Status RetrieverImpl::RecallPlan(Stream& s, RecallPath path, LayerState& l, int32_t batch) {
  if (path == RecallPath::kGather || !dma()) {
    return backend_.Recall(s, ZeroCopyRecallArgs(geometry_, Target(l, batch),
                                                 l.select.items.as<RecallItem>(),
                                                 batch * geometry_.num_kv_heads * selected_pages()));
  }
  // DMA strategies drive one sequence (a batch recalls zero-copy).
  KVTIER_CHECK(batch == 1);
  const int32_t n = geometry_.num_kv_heads * selected_pages();
  // The copy engines are driven from the host: the plan goes to the layer's host plan buffer.
  KVTIER_RETURN_IF_ERROR(
      backend_.Copy(s, l.recall.recaller->plan(), l.select.items.data(), n * sizeof(RecallItem)));
  KVTIER_RETURN_IF_ERROR(s.Record(*l.recall.plan_ready));
  if (path == RecallPath::kBackground) {
    l.recall.plan_pending = true;  // Pump issues the DMAs once the plan is on the host
    return absl::OkStatus();
  }
  // Sync mode: the host waits for its plan (this is the synchronous baseline).
  absl::Status st = l.recall.plan_ready->Wait(options_.deadline);
  if (absl::IsDeadlineExceeded(st)) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "sync recall: the selection did not reach the host within the deadline of %s",
        absl::FormatDuration(options_.deadline)));
  }
  KVTIER_RETURN_IF_ERROR(st);
  if (demote()) KVTIER_RETURN_IF_ERROR(PromoteCold(static_cast<int32_t>(&l - layers_.data()), n));
  return l.recall.recaller->Enqueue(s, *xform_fg_, n, Target(l)).status();
}

RecallTarget RetrieverImpl::Target(const LayerState& l, int32_t n) const {
  return RecallTarget{pool_->base(), pool_->num_slots(), l.ws.k.data(), l.ws.v.data(),
                      n * slots_per_layer_};
}

absl::Status RetrieverImpl::LaunchPlanned(LayerState& l) {
  // The plan is on the host (plan_ready has fired); the DMAs run on their own stream, after
  // the plan's selection on the recall stream, and recall_done covers the whole recall.
  KVTIER_RETURN_IF_ERROR(dma_->Wait(*l.recall.plan_ready));
  const int32_t n = geometry_.num_kv_heads * selected_pages();
  if (demote()) KVTIER_RETURN_IF_ERROR(PromoteCold(static_cast<int32_t>(&l - layers_.data()), n));
  KVTIER_RETURN_IF_ERROR(l.recall.recaller->Enqueue(*dma_, *xform_bg_, n, Target(l)).status());
  l.recall.plan_pending = false;
  return dma_->Record(*l.recall.done);
}

absl::Status RetrieverImpl::Pump(int32_t layer) {
  if (!dma()) return absl::OkStatus();
  for (int32_t i = 0; i < geometry_.num_layers; ++i) {
    LayerState& l = layers_[i];
    if (!l.recall.plan_pending || l.recall.promoting || (layer >= 0 && i != layer)) continue;
    if (i == layer) {
      // This layer's step needs its recall now: wait for the plan, within the deadline.
      const absl::Duration left = options_.deadline - (absl::Now() - l.recall.launched);
      absl::Status st = l.recall.plan_ready->Wait(std::max(left, absl::ZeroDuration()));
      if (absl::IsDeadlineExceeded(st)) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "layer %d: the background selection launched %s ago has not reached the host "
            "within the deadline of %s",
            i, absl::FormatDuration(absl::Now() - l.recall.launched),
            absl::FormatDuration(options_.deadline)));
      }
      KVTIER_RETURN_IF_ERROR(st);
    } else if (!l.recall.plan_ready->Query()) {
      continue;
    }
    KVTIER_RETURN_IF_ERROR(LaunchPlanned(l));
  }
  return absl::OkStatus();
}

absl::Status RetrieverImpl::RecordStats(Stream& s, int32_t layer, int64_t step, bool background,
                                        bool checked) {
  LayerState& l = layers_[layer];
  StatRecord r;
  r.layer = layer;
  r.step = step;
  r.background = background;
  r.checked = checked;
  const size_t hkv = geometry_.num_kv_heads;
  const bool selects = l.select.num_misses.data() != nullptr;
  const bool mass = checked && mass_trigger();
  const int32_t slots = background ? 0 : Slots(l);
  // One block: misses, group means, lost mass, slot table, drift flags (4-byte fields first).
  const size_t misses = selects ? hkv * sizeof(int32_t) : 0;
  const size_t means = checked ? hkv * sizeof(float) : 0;
  const size_t lost = mass ? hkv * sizeof(float) : 0;
  const size_t table = hkv * static_cast<size_t>(slots) * sizeof(int32_t);
  const size_t flags = checked ? hkv : 0;
  const size_t total = misses + means + lost + table + flags;
  if (total == 0) return absl::OkStatus();
  KVTIER_ASSIGN_OR_RETURN(StagingRing::Block b, Stage(total));
  uint8_t* at = b.data;
  if (at == nullptr) {  // the ring cannot hold it: ordinary memory (a synchronous copy)
    r.heap.resize(total);
    at = r.heap.data();
  }
  r.ticket = b.ticket;
  absl::Status st;
  const auto take = [&](size_t bytes, const void* src) -> uint8_t* {
    uint8_t* dst = at;
    at += bytes;
    if (bytes > 0 && st.ok()) st = backend_.Copy(s, dst, src, bytes);
    return bytes > 0 ? dst : nullptr;
  };
  r.misses = reinterpret_cast<const int32_t*>(take(misses, l.select.num_misses.data()));
  r.group_mean = reinterpret_cast<const float*>(take(means, l.select.group_mean.data()));
  r.lost_mass = reinterpret_cast<const float*>(take(lost, l.select.lost_mass.data()));
  r.slot_table = reinterpret_cast<const int32_t*>(take(table, l.ws.table.data()));
  r.num_slots = slots;
  r.drifted = take(flags, l.select.drifted.data());
  if (st.ok()) {
    absl::StatusOr<std::unique_ptr<Event>> e = TakeEvent();
    if (e.ok()) {
      r.done = *std::move(e);
      st = s.Record(*r.done);
    } else {
      st = e.status();
    }
  }
  if (!st.ok()) {
    // Copies may be queued into the block: it goes back once the stream has run them.
    (void)s.Synchronize();
    shared_->ring().Release(r.ticket);
    return st;
  }
  records_.push_back(std::move(r));
  return absl::OkStatus();
}

absl::Status RetrieverImpl::Collect(bool block) {
  const absl::Time end = absl::Now() + options_.deadline;
  while (!records_.empty()) {
    StatRecord& r = records_.front();
    if (block) {
      KVTIER_RETURN_IF_ERROR(r.done->Wait(std::max(end - absl::Now(), absl::ZeroDuration())));
    } else if (!r.done->Query()) {
      break;
    }
    LayerState& l = layers_[r.layer];
    const size_t hkv = geometry_.num_kv_heads;
    int64_t pages = 0;
    if (r.misses != nullptr) {
      for (size_t h = 0; h < hkv; ++h) pages += r.misses[h];
    }
    stats_.recalled_pages += pages;
    stats_.recalled_bytes +=
        pages * static_cast<int64_t>(geometry_.slab_elements() * static_cast<int64_t>(elem()));
    if (r.background) {
      if (l.last.step == r.step) l.last.background_pages = pages;
    } else {
      stats_.correction_pages += pages;
      StepStats st;
      st.step = r.step;
      st.correction_pages = pages;
      st.num_slots = r.num_slots;
      st.slot_table.assign(r.slot_table, r.slot_table + hkv * static_cast<size_t>(r.num_slots));
      if (r.checked) {
        for (int32_t h = 0; h < geometry_.num_kv_heads; ++h) {
          const bool d = r.drifted[h] != 0;
          st.corrected_heads += d;
          stats_.corrections[static_cast<size_t>(r.layer) * geometry_.num_kv_heads + h] += d;
        }
        stats_.checked_heads += geometry_.num_kv_heads;
        stats_.corrected_heads += st.corrected_heads;
        const int c = HeadClassOf(r.layer, geometry_.num_layers);
        telemetry_own_.checked_heads_by_class[c] += hkv;
        telemetry_own_.corrected_heads_by_class[c] += static_cast<uint64_t>(st.corrected_heads);
        if (r.lost_mass != nullptr) {
          // A corrected head attends a fresh selection: the summaries estimate no loss.
          for (size_t h = 0; h < hkv; ++h) {
            const float loss = r.drifted[h] != 0 ? 0.0f : r.lost_mass[h];
            const double kept = std::clamp(1.0 - static_cast<double>(loss), 0.0, 1.0);
            telemetry_own_.mass_recall_micros += static_cast<uint64_t>(std::llround(kept * 1e6));
          }
          telemetry_own_.mass_recall_count += hkv;
        }
        st.drifted.assign(r.drifted, r.drifted + hkv);
        st.group_mean.assign(r.group_mean, r.group_mean + hkv);
        if (r.lost_mass != nullptr) st.lost_mass.assign(r.lost_mass, r.lost_mass + hkv);
      }
      l.last = std::move(st);
    }
    shared_->ring().Release(r.ticket);
    spare_events_.push_back(std::move(r.done));
    records_.pop_front();
  }
  return absl::OkStatus();
}

absl::StatusOr<RetrieverImpl::BeginPath> RetrieverImpl::BeginHost(int32_t layer) {
  LayerState& l = layers_[layer];
  l.step_begun = absl::Now();
  if (absl::Status ps = Pump(layer); !ps.ok()) return Fail(ps);
  if (l.recall.in_flight && !l.recall.done->Query()) {
    const absl::Duration age = absl::Now() - l.recall.launched;
    if (age > options_.deadline) {
      return Fail(absl::DeadlineExceededError(absl::StrFormat(
          "BeginStep: layer %d: the background recall launched %s ago has not completed within "
          "the deadline of %s",
          layer, absl::FormatDuration(age), absl::FormatDuration(options_.deadline))));
    }
  }
  (void)Collect(/*block=*/false);
  Stream& c = *compute_;
  absl::Status st;
  // The background recall writes the working set and reads the policy buffers: wait for it
  // before anything below touches them.
  if (l.recall.in_flight) st = c.Wait(*l.recall.done);
  l.recall.in_flight = false;
  bool reselect = false;
  if (st.ok()) st = ApplyPolicies(layer, &reselect);
  if (st.ok()) st = UploadCountsIfDirty(layer);
  if (!st.ok()) return Fail(st);
  return plan::PlanBegin(plan_, {.step = l.step, .reselect = reselect, .profiling = profiling_});
}

absl::Status RetrieverImpl::BeginDevice(int32_t layer, BeginPath path, int32_t n) {
  LayerState& l = layers_[layer];
  Stream& c = *compute_;
  absl::Status st;
  switch (path.work) {
    case plan::BeginWork::kSelect:
      st = Select(c, path.route, layer, l.select.q_cur.data(), l.ws.counts.full_pages,
                  l.ws.counts.candidates, /*mask=*/nullptr, /*scored=*/false, n);
      break;
    case plan::BeginWork::kCorrect:
      st = RunCaptured(c, l, path.captured, &l.graphs.correct[n],
                       [&] { return Correct(c, path.route, layer, n); });
      break;
    case plan::BeginWork::kNone:
      break;
  }
  return st.ok() ? st : Fail(st);
}

absl::StatusOr<WorkingSetView> RetrieverImpl::BeginFinish(int32_t layer, BeginPath path) {
  LayerState& l = layers_[layer];
  Stream& c = *compute_;
  // Full and drop mode select nothing: the record carries the slot table alone.
  absl::Status st = RecordStats(c, layer, l.step, /*background=*/false,
                                /*checked=*/path.checked);
  if (st.ok()) st = Park(c);
  if (st.ok()) st = c.Record(*l.ready);
  if (!st.ok()) return Fail(st);
  l.in_step = true;
  ++stats_.steps;
  stats_.profiled_steps += profiling_;
  WorkingSetView view;
  view.layer = layer;
  view.k_cache = l.ws.k.data();
  view.v_cache = l.ws.v.data();
  view.num_slots = Slots(l);
  view.slot_table = l.ws.table.as<int32_t>();
  view.partial_page = l.ws.counts.partial_page;
  view.partial_len = l.ws.counts.partial_len;
  view.num_tokens = l.tokens;
  view.ready = l.ready.get();
  return view;
}

SparseAttentionArgs RetrieverImpl::AttentionArgs(LayerState& l, const void* q, void* out,
                                                 float* lse, int32_t n) {
  SparseAttentionArgs a;
  a.shape = KvShapeOf(geometry_);
  a.kv.k_cache = l.ws.k.data();
  a.kv.v_cache = l.ws.v.data();
  a.kv.num_slots = Slots(l);
  a.kv.slot_table = l.ws.table.as<int32_t>();
  a.kv.partial_page = l.ws.counts.partial_page;
  a.kv.partial_len = l.ws.counts.partial_len;
  a.batch = n;
  a.q = q;
  a.softmax_scale = scale_;
  a.out = out;
  a.lse = lse;
  a.workspace = shared_->workspace();
  a.workspace_bytes = shared_->workspace_bytes();
  SetPolicyArgs(l, &a);
  return a;
}

absl::StatusOr<plan::EndPlan> RetrieverImpl::EndHost(int32_t layer) {
  LayerState& l = layers_[layer];
  l.in_step = false;
  ++l.step;
  const plan::EndPlan end = plan::PlanEnd(plan_, profiling_);
  if (!end.background_select) return end;
  // Fresh events for this step (FreeKV re-records one event per layer, which is only safe
  // while nobody can still be about to wait on the old record): the previous step's are
  // retired and reused only once they have fired.
  for (std::unique_ptr<Event>* e : {&l.recall.attn_done, &l.recall.done, &l.recall.plan_ready}) {
    absl::StatusOr<std::unique_ptr<Event>> fresh = TakeEvent();
    if (!fresh.ok()) return Fail(fresh.status());
    retired_events_.push_back(std::exchange(*e, *std::move(fresh)));
  }
  return end;
}

absl::Status RetrieverImpl::EndDevice(int32_t layer, const plan::EndPlan& end, const void* q,
                                      int32_t n) {
  LayerState& l = layers_[layer];
  // On the compute stream, after attention: remember q_t and snapshot the page counts.
  Stream& c = *compute_;
  absl::Status st = backend_.Copy(c, l.select.q_prev.data(), q, q_bytes() * n);
  if (st.ok()) {
    st = backend_.Copy(c, l.ws.counts.full_at_end, l.ws.counts.full_pages, sizeof(int32_t) * n);
  }
  if (st.ok()) {
    st = backend_.Copy(c, l.ws.counts.cand_at_end, l.ws.counts.candidates, sizeof(int32_t) * n);
  }
  if (st.ok()) st = c.Record(*l.recall.attn_done);
  // In the background, once attention is done with the working set: select with q_t and
  // recall the misses into the slots of evicted pages.
  if (st.ok()) st = recall_->Wait(*l.recall.attn_done);
  if (st.ok()) {
    st = RunCaptured(*recall_, l, end.captured, &l.graphs.select[n], [&] {
      return Select(*recall_, end.route, layer, l.select.q_prev.data(),
                    l.ws.counts.full_at_end, l.ws.counts.cand_at_end, nullptr, /*scored=*/false,
                    n);
    });
  }
  return st.ok() ? st : Fail(st);
}

absl::Status RetrieverImpl::AttendCaptured(LayerState& l, const SparseAttentionArgs& a) {
  const LayerState::Graphs::AttendKey key{a.q, a.out, a.lse, a.batch};
  const auto direct = [&] { return backend_.SparseAttention(*compute_, a); };
  if (!graphs_on() || l.graphs.refused) return direct();
  if (!(key == l.graphs.attend_last)) {
    // New pointers: launch directly, and capture if they come back next step.
    l.graphs.attend_last = key;
    l.graphs.attend.reset();
    return direct();
  }
  return RunCaptured(*compute_, l, /*use_graph=*/true, &l.graphs.attend, direct);
}

absl::Status RetrieverImpl::RunCaptured(Stream& s, LayerState& l, bool use_graph,
                                        std::unique_ptr<Graph>* graph,
                                        const std::function<absl::Status()>& work) {
  if (!use_graph || l.graphs.refused) return work();
  if (*graph == nullptr) {
    // Every argument of the captured ops is a buffer of the layer (or of the batch slots of
    // the run) or a constant of the options, so one capture serves every later step.
    KVTIER_RETURN_IF_ERROR(backend_.BeginCapture(s));
    const absl::Status worked = work();
    absl::StatusOr<std::unique_ptr<Graph>> captured = backend_.EndCapture(s);
    if (!worked.ok() || !captured.ok()) {
      // Nothing was enqueued: run the work directly, and never capture this layer again.
      l.graphs.refused = true;
      return work();
    }
    *graph = *std::move(captured);
  }
  ++stats_.graph_launches;
  return (*graph)->Launch(s);
}

absl::Status RetrieverImpl::EndFinish(int32_t layer) {
  LayerState& l = layers_[layer];
  absl::Status st =
      RecordStats(*recall_, layer, l.step - 1, /*background=*/true, /*checked=*/false);
  // A DMA plan's recall_done is recorded when Pump issues its copies, after plan_ready: moved
  // here, past the record's copy of num_misses, so that the next step's selection (ordered
  // after recall_done) cannot overwrite it before the copy has read it.
  if (st.ok()) {
    st = recall_->Record(l.recall.plan_pending ? *l.recall.plan_ready : *l.recall.done);
  }
  if (!st.ok()) return Fail(st);
  l.recall.in_flight = true;
  l.recall.launched = absl::Now();
  if (absl::Status ps = Pump(-1); !ps.ok()) return Fail(ps);
  return absl::OkStatus();
}

void RetrieverImpl::CloseStepCalls(int32_t layer) {
  LayerState& l = layers_[layer];
  l.last_calls = l.calls;
  l.last_calls_step = l.step - 1;
  stats_.host_waits += l.calls.total();
  stats_.host_event_waits += l.calls.waits;
  stats_.host_sync_copies += l.calls.sync_copies;
  stats_.host_allocations += l.calls.allocations;
  stats_.host_frees += l.calls.frees;
  l.calls = HostCalls{};
  if (telemetry_block_.has_value()) {
    telemetry_own_.AddStepTime(absl::ToDoubleSeconds(absl::Now() - l.step_begun));
    PublishTelemetry(/*gauges=*/layer == geometry_.num_layers - 1);
  }
}

void RetrieverImpl::PublishTelemetry(bool gauges) {
  if (!telemetry_block_.has_value()) return;
  TelemetryValues& v = telemetry_own_;
  // Every counter as Stats() reports it. What the policies fill in (the working-set gauges,
  // the host drops) walks every layer, so it is refreshed in stats_ only with `gauges`;
  // nothing else writes those fields, so between refreshes they keep the last values.
  if (gauges) FillPolicyStats(&stats_);
  v.SetCounters(stats_);
  v.recall_strategy = has_host_tier() ? static_cast<uint64_t>(strategy_) + 1 : 0;
  telemetry_block_->Publish(v.ContinuedFrom(telemetry_base_));
}

absl::Status RetrieverImpl::Wait() {
  const absl::Time end = absl::Now() + options_.deadline;
  KVTIER_RETURN_IF_ERROR(compute_->Record(*sync_compute_));
  KVTIER_RETURN_IF_ERROR(recall_->Record(*sync_recall_));
  const auto wait = [&](Event& e) -> absl::Status {
    absl::Status st = e.Wait(std::max(end - absl::Now(), absl::ZeroDuration()));
    if (absl::IsDeadlineExceeded(st)) {
      return absl::DeadlineExceededError(
          absl::StrFormat("retriever: work in flight did not complete within the deadline of %s",
                          absl::FormatDuration(options_.deadline)));
    }
    return st;
  };
  KVTIER_RETURN_IF_ERROR(wait(*sync_compute_));
  KVTIER_RETURN_IF_ERROR(wait(*sync_recall_));
  // Every background plan is on the host now: issue its DMAs and wait for them too.
  for (int32_t i = 0; i < geometry_.num_layers; ++i) KVTIER_RETURN_IF_ERROR(Pump(i));
  KVTIER_RETURN_IF_ERROR(dma_->Record(*sync_dma_));
  KVTIER_RETURN_IF_ERROR(wait(*sync_dma_));
  for (LayerState& l : layers_) {
    if (l.recall.in_flight && l.recall.done->Query()) l.recall.in_flight = false;
  }
  Reap();
  KVTIER_RETURN_IF_ERROR(Collect(/*block=*/true));
  absl::Status st = CommitStored(/*wait=*/true);
  PublishTelemetry(/*gauges=*/true);
  return st;
}

absl::Status RetrieverImpl::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  absl::Status st = Wait();
  if (absl::IsDeadlineExceeded(st)) return st;  // pages freed by the destructor
  if (offloader_ != nullptr) (void)offloader_->Drain();
  for (LayerState& l : layers_) {
    if (l.host.pages != nullptr) l.host.pages->Clear();
    l.host.pending.clear();
  }
  stored_.clear();  // their pages are freed: nothing left to report
  stored_ready_.clear();
  // The batch slot is free for a new member (this one's views are never used again).
  if (st.ok() && slot_ >= 0) {
    shared_->FreeSlot(slot_);
    slot_ = -1;
  }
  return st;
}

}  // namespace retriever_internal

absl::StatusOr<std::unique_ptr<Retriever>> Retriever::Create(
    const Geometry& geometry, const SequenceOptions& options, Backend& backend,
    std::unique_ptr<HostTier> host, policy::LayerBudgetStore* policy_store) {
  auto r = std::make_unique<retriever_internal::RetrieverImpl>(geometry, options, backend,
                                                               std::move(host), policy_store);
  KVTIER_RETURN_IF_ERROR(r->Init());
  return std::unique_ptr<Retriever>(std::move(r));
}

absl::StatusOr<std::unique_ptr<Retriever>> Retriever::Create(const Geometry& geometry,
                                                             const SequenceOptions& options,
                                                             Backend& backend, PagePool* pool) {
  std::unique_ptr<HostTier> host;
  if (pool != nullptr) host = std::make_unique<PoolHostTier>(*pool);
  return Create(geometry, options, backend, std::move(host));
}

absl::StatusOr<std::unique_ptr<LocalSequence>> NewLocalSequence(const Geometry& geometry,
                                                                const SequenceOptions& options,
                                                                Device& device) {
  KVTIER_ASSIGN_OR_RETURN(Backend * backend, BackendOf(device, "NewLocalSequence"));
  KVTIER_RETURN_IF_ERROR(geometry.Validate());
  // Resolved before the host tier is sized from them.
  KVTIER_ASSIGN_OR_RETURN(const SequenceOptions resolved,
                          ResolveSequenceOptions(options, geometry.page_size));
  std::unique_ptr<HostTier> host;
  if (resolved.mode == RetrievalMode::kSpeculative || resolved.mode == RetrievalMode::kSync) {
    KVTIER_ASSIGN_OR_RETURN(host, NewOwnedHostTier(geometry, resolved.max_tokens, *backend));
  }
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Retriever> r,
                          Retriever::Create(geometry, resolved, *backend, std::move(host)));
  return std::unique_ptr<LocalSequence>(std::move(r));
}

}  // namespace kvtier
