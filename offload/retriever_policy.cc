// The Retriever's policy side (docs/architecture.md#policies): budgets, pins, drop-mode eviction
// with per-head compaction, host-tier drops, and the attention the policies read.
// Invariants (on top of retriever.cc's):
//   - Policy buffers the background selection reads (head_k, page_flags) change only on the
//     compute stream after BeginStep has made it wait for that selection.
//   - A managed layer's HeadSlotTable is the truth; the device table is uploaded from it
//     before the next op that reads it (table_dirty).
//   - A managed page is placed, compacted or resized only at a page boundary, where no page
//     is partial, so every move is of full pages and the page being filled has one slot.
//   - The token probabilities of a step reach the policies at the layer's next BeginStep
//     (ConsumeProbe waits for their copy); the vectors they are copied into live until then.
#include <algorithm>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "offload/retriever_impl.h"

namespace kvtier::retriever_internal {

bool RetrieverImpl::reads_attention() const {
  if (!policies_on()) return false;
  return policies_.budget->needs_attention() ||
         (policies_.residency != nullptr && policies_.residency->needs_attention());
}

absl::Status RetrieverImpl::InitPolicies() {
  if (options_.policy.is_default()) {
    host_drop_ = std::make_unique<policy::HostDropPolicy>(policy::HostDropMode::kRefuse);
    return absl::OkStatus();
  }
  policy::PolicyContext ctx;
  ctx.num_layers = geometry_.num_layers;
  ctx.num_q_heads = geometry_.num_q_heads;
  ctx.num_kv_heads = geometry_.num_kv_heads;
  ctx.page_size = geometry_.page_size;
  ctx.default_pages = options_.selected_pages;
  ctx.xkv_store = policy_store_;
  KVTIER_ASSIGN_OR_RETURN(policies_, policy::MakePolicies(options_.policy, ctx));
  // The rules that combine host drop, INT8 and the modes are the plan's (offload/step_plan.h),
  // checked in Init; what is left is the host tier's size.
  if (plan_.demote) {
    const int64_t need = DemoteFloorPages(geometry_, options_);
    if (host_->pool().num_slots() < need) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "policy.host_drop = demote: the host tier holds %d pages; it needs at least %d "
          "(%d layers × (sink %d + recent %d + 1) + 2 × %d KV heads × %d selected pages)",
          host_->pool().num_slots(), need, geometry_.num_layers, options_.sink_pages,
          options_.recent_pages, geometry_.num_kv_heads, options_.selected_pages));
    }
    cold_ = host_->cold();
  }
  host_drop_ = std::make_unique<policy::HostDropPolicy>(policies_.host_drop);
  // Managed drop layers start at the budget plus the page being filled.
  min_capacity_ = slots_per_layer_ + 1;
  return absl::OkStatus();
}

absl::Status RetrieverImpl::InitLayerPolicies(int32_t layer) {
  LayerState& l = layers_[layer];
  const size_t hkv = geometry_.num_kv_heads;
  l.policy.budget.assign(hkv, options_.selected_pages);
  l.policy.selected_with = l.policy.budget;
  if (!policies_on()) return absl::OkStatus();
  if (has_host_tier()) {
    KVTIER_RETURN_IF_ERROR(Allocate(&l.policy.head_k, hkv * sizeof(int32_t), layer, Field::kHeadK));
    KVTIER_RETURN_IF_ERROR(
        Allocate(&l.policy.page_flags, hkv * max_pages_, layer, Field::kPageFlags));
    l.policy.flags_mirror.assign(hkv * max_pages_, kPageNormal);
    KVTIER_RETURN_IF_ERROR(
        Upload(*compute_, l.policy.head_k.data(), l.policy.budget.data(), hkv * sizeof(int32_t)));
    KVTIER_RETURN_IF_ERROR(
        backend_.Memset(*compute_, l.policy.page_flags.data(), 0, l.policy.page_flags.size()));
  }
  const size_t slots = Slots(l);
  const size_t p = geometry_.page_size;
  if (reads_attention()) {
    const size_t bytes = geometry_.num_q_heads * slots * p * sizeof(float);
    if (l.ws.managed != nullptr) {  // resized with the working set
      KVTIER_RETURN_IF_ERROR(Allocate(&l.policy.token_prob, bytes));
    } else {
      KVTIER_RETURN_IF_ERROR(Allocate(&l.policy.token_prob, bytes, layer, Field::kTokenProb));
    }
  }
  return Park(*compute_);
}

absl::StatusOr<void*> RetrieverImpl::StageArgs(const void* src, size_t bytes) {
  // Ops read staging blocks in place (registered host memory): nothing is allocated.
  KVTIER_ASSIGN_OR_RETURN(StagingRing::Block b, Stage(bytes));
  if (b.data != nullptr) {
    std::memcpy(b.data, src, bytes);
    staged_tickets_.push_back(b.ticket);
    return b.data;
  }
  DeviceBuffer buf;  // larger than the ring allows: a device buffer (a counted allocation)
  KVTIER_RETURN_IF_ERROR(Allocate(&buf, bytes));
  KVTIER_RETURN_IF_ERROR(Upload(*compute_, buf.data(), src, bytes));
  void* data = buf.data();
  staged_device_.push_back(std::move(buf));
  return data;
}

void RetrieverImpl::SetPolicyArgs(LayerState& l, SparseAttentionArgs* a) {
  if (reads_attention()) a->token_prob = l.policy.token_prob.as<float>();
}

absl::Status RetrieverImpl::TakeProbe(int32_t layer, int64_t step, int64_t position) {
  LayerState& l = layers_[layer];
  // One probe in flight per layer: an earlier one is handed over first.
  KVTIER_RETURN_IF_ERROR(ConsumeProbe(layer));
  auto pr = std::make_unique<LayerState::PolicyState::Probe>();
  pr->slots = Slots(l);
  pr->step = step;
  pr->position = position;
  pr->tokens = l.tokens;
  const size_t prob_bytes = sizeof(float) * geometry_.num_q_heads * pr->slots * geometry_.page_size;
  const size_t table_bytes = sizeof(int32_t) * geometry_.num_kv_heads * pr->slots;
  KVTIER_ASSIGN_OR_RETURN(StagingRing::Block b, Stage(prob_bytes + table_bytes));
  uint8_t* at = b.data;
  if (at == nullptr) {  // larger than the ring allows (a managed layer grew): ordinary memory
    pr->heap.resize(prob_bytes + table_bytes);
    at = pr->heap.data();
  }
  pr->ticket = b.ticket;
  pr->prob = reinterpret_cast<const float*>(at);
  pr->table = reinterpret_cast<const int32_t*>(at + prob_bytes);
  absl::Status st = backend_.Copy(*compute_, at, l.policy.token_prob.data(), prob_bytes);
  if (st.ok()) st = backend_.Copy(*compute_, at + prob_bytes, l.ws.table.data(), table_bytes);
  absl::StatusOr<std::unique_ptr<Event>> ev = TakeEvent();
  if (st.ok() && !ev.ok()) st = ev.status();
  if (st.ok()) {
    pr->done = std::move(*ev);
    st = compute_->Record(*pr->done);
  }
  if (!st.ok()) {
    // Copies may be queued into pr's block: keep it until the stream has run.
    (void)compute_->Synchronize();
    shared_->ring().Release(pr->ticket);
    return Fail(st);
  }
  l.policy.probe = std::move(pr);
  return absl::OkStatus();
}

absl::Status RetrieverImpl::ConsumeProbe(int32_t layer) {
  LayerState& l = layers_[layer];
  if (l.policy.probe == nullptr) return absl::OkStatus();
  std::unique_ptr<LayerState::PolicyState::Probe> pr = std::move(l.policy.probe);
  // The policies see step t's attention before step t+1's decisions: a deliberate host wait
  // per layer-step for policies that read attention (docs/retriever.md#host-waits), made
  // only when the copy has not landed yet.
  absl::Status st = pr->done->Query() ? absl::OkStatus() : pr->done->Wait(options_.deadline);
  const auto release = [&] { shared_->ring().Release(pr->ticket); };
  if (absl::IsDeadlineExceeded(st)) {
    (void)compute_->Synchronize();  // the copies write into pr
    release();
    return Fail(absl::DeadlineExceededError(
        absl::StrFormat("layer %d: the attention of step %d did not complete within the "
                        "deadline of %s",
                        layer, pr->step, absl::FormatDuration(options_.deadline))));
  }
  if (!st.ok()) {
    release();
    return Fail(st);
  }
  policy::AttentionObservation obs;
  obs.layer = layer;
  obs.step = pr->step;
  obs.query_position = pr->position;
  obs.num_q_heads = geometry_.num_q_heads;
  obs.num_kv_heads = geometry_.num_kv_heads;
  obs.num_slots = pr->slots;
  obs.page_size = geometry_.page_size;
  obs.slot_table = std::span<const int32_t>(
      pr->table, static_cast<size_t>(geometry_.num_kv_heads) * pr->slots);
  obs.token_prob = std::span<const float>(
      pr->prob, static_cast<size_t>(geometry_.num_q_heads) * pr->slots * geometry_.page_size);
  obs.num_tokens = pr->tokens;
  if (policies_.budget->needs_attention()) policies_.budget->OnAttention(obs);
  if (policies_.residency != nullptr && policies_.residency->needs_attention()) {
    policies_.residency->OnAttention(obs);
  }
  release();
  spare_events_.push_back(std::move(pr->done));
  return absl::OkStatus();
}

absl::Status RetrieverImpl::ApplyPolicies(int32_t layer, bool* reselect) {
  *reselect = false;
  if (!policies_on()) return absl::OkStatus();
  LayerState& l = layers_[layer];
  KVTIER_RETURN_IF_ERROR(ConsumeProbe(layer));
  // The selected region bounds a selecting mode's budget; a managed drop layer grows.
  const int32_t max_pages = l.ws.managed != nullptr ? max_pages_ : options_.selected_pages;
  std::vector<int32_t> budget(geometry_.num_kv_heads, options_.selected_pages);
  policies_.budget->Budget(layer, max_pages, std::span<int32_t>(budget));
  for (int32_t& b : budget) b = std::clamp(b, 0, max_pages);
  if (budget != l.policy.budget) ++stats_.budget_changes;
  l.policy.budget = std::move(budget);
  absl::Status st;
  if (l.ws.managed != nullptr) {
    st = Evict(layer);
    if (st.ok()) st = UploadTable(l);
  } else if (has_host_tier()) {
    st = UpdateFlags(layer);
    if (st.ok() && l.policy.budget != l.policy.selected_with) {
      st = Upload(*compute_, l.policy.head_k.data(), l.policy.budget.data(),
                  l.policy.budget.size() * sizeof(int32_t));
      l.policy.selected_with = l.policy.budget;
      *reselect = true;
    }
    if (l.policy.flags_changed) *reselect = true;
    l.policy.flags_changed = false;
  }
  if (st.ok()) st = Park(*compute_);
  return st.ok() ? st : Fail(st);
}

absl::Status RetrieverImpl::UpdateFlags(int32_t layer) {
  LayerState& l = layers_[layer];
  policy::ResidencyPolicy* r = policies_.residency.get();
  if (r == nullptr && l.host.dropped.empty()) return absl::OkStatus();
  const int32_t full = l.tokens / geometry_.page_size;
  for (int32_t h = 0; h < geometry_.num_kv_heads; ++h) {
    uint8_t* row = &l.policy.flags_mirror[static_cast<size_t>(h) * max_pages_];
    bool changed = false;
    for (int32_t page = 0; page < full; ++page) {
      uint8_t f = kPageNormal;
      if (!l.host.dropped.empty() && l.host.dropped[page] != 0) {
        f = kPageExcluded;
      } else if (r != nullptr && r->Pinned(layer, h, page)) {
        f = kPagePinned;
      }
      changed |= row[page] != f;
      row[page] = f;
    }
    if (!changed) continue;
    l.policy.flags_changed = true;
    KVTIER_RETURN_IF_ERROR(
        Upload(*compute_, l.policy.page_flags.as<uint8_t>() + static_cast<size_t>(h) * max_pages_,
               row, full));
  }
  return absl::OkStatus();
}

absl::Status RetrieverImpl::Evict(int32_t layer) {
  LayerState& l = layers_[layer];
  HeadSlotTable& t = *l.ws.managed;
  policy::ResidencyPolicy* r = policies_.residency.get();
  const int32_t p = geometry_.page_size;
  const int32_t total = (l.tokens + p - 1) / p;
  const int32_t recent_lo = std::max(options_.sink_pages, total - options_.recent_pages);
  struct Cand {
    float score;
    int32_t page;
  };
  std::vector<Cand> cand;
  for (int32_t h = 0; h < geometry_.num_kv_heads; ++h) {
    cand.clear();
    for (int32_t page : t.Pages(h)) {
      if (page < options_.sink_pages || page >= recent_lo) continue;
      if (r != nullptr && r->Pinned(layer, h, page)) continue;
      // Without a ranker the oldest goes first: a sliding window.
      const float score = r != nullptr ? r->Score(layer, h, page) : static_cast<float>(page);
      cand.push_back({score != score ? -std::numeric_limits<float>::infinity() : score, page});
    }
    const int32_t keep = l.policy.budget[h];
    if (static_cast<int32_t>(cand.size()) <= keep) continue;
    const auto n = static_cast<ptrdiff_t>(cand.size()) - keep;
    std::partial_sort(cand.begin(), cand.begin() + n, cand.end(), [](const Cand& a, const Cand& b) {
      return a.score != b.score ? a.score < b.score : a.page < b.page;
    });
    for (ptrdiff_t i = 0; i < n; ++i) {
      KVTIER_CHECK(t.Evict(h, cand[i].page));
      if (r != nullptr) r->OnEvicted(layer, h, cand[i].page);
    }
    stats_.evicted_head_pages += n;
    l.ws.table_dirty = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> RetrieverImpl::PlaceManaged(int32_t layer, int32_t page) {
  LayerState& l = layers_[layer];
  HeadSlotTable& t = *l.ws.managed;
  int32_t most = 0;
  for (int32_t h = 0; h < geometry_.num_kv_heads; ++h) most = std::max(most, t.CountOf(h));
  // Give memory back once at most half of it is in use (after the first step evicted the
  // prompt down to the budget, say).
  if (t.capacity() > min_capacity_ && most + 1 <= t.capacity() / 2) {
    KVTIER_RETURN_IF_ERROR(CompactManaged(l));
    KVTIER_RETURN_IF_ERROR(ResizeManaged(l, std::max(min_capacity_, t.used() + 1)));
  }
  int32_t s = t.PlaceInFreeSlot(page);
  if (s < 0) {
    KVTIER_RETURN_IF_ERROR(CompactManaged(l));
    s = t.PlaceInFreeSlot(page);
  }
  if (s < 0) {
    KVTIER_RETURN_IF_ERROR(
        ResizeManaged(l, std::max(min_capacity_, std::min(2 * t.capacity(), max_pages_ + 1))));
    s = t.PlaceInFreeSlot(page);
  }
  KVTIER_CHECK(s >= 0);
  return s;
}

absl::Status RetrieverImpl::CompactManaged(LayerState& l) {
  std::vector<HeadSlotMove> moves = l.ws.managed->Compact(/*fixed=*/-1);
  if (moves.empty()) return absl::OkStatus();
  KVTIER_ASSIGN_OR_RETURN(void* dev_moves,
                          StageArgs(moves.data(), moves.size() * sizeof(HeadSlotMove)));
  MoveHeadSlotsArgs a{.shape = KvShapeOf(geometry_)};
  a.items = static_cast<const HeadSlotMove*>(dev_moves);
  a.num_items = static_cast<int32_t>(moves.size());
  a.kv.k_cache = l.ws.k.data();
  a.kv.v_cache = l.ws.v.data();
  a.kv.num_slots = l.ws.managed->capacity();
  l.ws.table_dirty = true;
  return backend_.MoveHeadSlots(*compute_, a);
}

absl::Status RetrieverImpl::ResizeManaged(LayerState& l, int32_t capacity) {
  const int32_t old_cap = l.ws.managed->capacity();
  if (capacity == old_cap) return absl::OkStatus();
  const size_t keep = std::min(old_cap, capacity);
  const size_t hkv = geometry_.num_kv_heads;
  const size_t slot_elems = static_cast<size_t>(geometry_.page_size) * hkv * geometry_.head_dim;
  // New buffers; the kept prefix of slots is copied on the compute stream.
  auto grow = [&](DeviceBuffer* buf, size_t per_slot, bool copy) -> absl::Status {
    DeviceBuffer fresh;
    KVTIER_RETURN_IF_ERROR(Allocate(&fresh, per_slot * capacity));
    if (copy) {
      KVTIER_RETURN_IF_ERROR(backend_.Copy(*compute_, fresh.data(), buf->data(), per_slot * keep));
    }
    staged_device_.push_back(std::exchange(*buf, std::move(fresh)));
    return absl::OkStatus();
  };
  KVTIER_RETURN_IF_ERROR(grow(&l.ws.k, slot_elems * elem(), true));
  KVTIER_RETURN_IF_ERROR(grow(&l.ws.v, slot_elems * elem(), true));
  KVTIER_RETURN_IF_ERROR(grow(&l.ws.table, hkv * sizeof(int32_t), false));
  if (l.policy.token_prob.data() != nullptr) {
    KVTIER_RETURN_IF_ERROR(grow(
        &l.policy.token_prob,
        static_cast<size_t>(geometry_.num_q_heads) * geometry_.page_size * sizeof(float), false));
  }
  l.ws.managed->Resize(capacity);
  l.ws.table_dirty = true;
  // The old buffers go once the copies out of them (and any attention still reading them)
  // have run: parked behind the next event on the compute stream.
  return Park(*compute_);
}

absl::Status RetrieverImpl::DropHostPages(int32_t layer, int64_t n) {
  const PagePoolStats ps = pool_->stats();
  const std::string full = absl::StrFormat(
      "Append: layer %d: %d more pages would fill but the host tier has %d of %d pages free", layer,
      n + (ps.capacity - ps.in_use), ps.capacity - ps.in_use, ps.capacity);
  // A background plan that is not issued yet may name any host page of its layer, and its
  // recall's event is recorded only once it is: issue them all first (waiting for their
  // selections), so that every layer's pages may go once their recall has run.
  if (demote() || policies_.host_drop == policy::HostDropMode::kEvict) {
    for (int32_t li = 0; li < geometry_.num_layers; ++li) {
      if (layers_[li].recall.plan_pending) KVTIER_RETURN_IF_ERROR(Pump(li));
    }
  }
  if (demote()) {
    return DemoteHostPages(std::max(n, kDemoteBatch), n, /*launching=*/-1, {},
                           absl::StrFormat("Append: layer %d", layer));
  }
  if (policies_.host_drop != policy::HostDropMode::kEvict) {
    (void)host_drop_->PickVictim({});  // counts the refusal
    return absl::ResourceExhaustedError(full + " (host_drop = refuse)");
  }
  // The candidates: every host page of the sequence outside the sinks and recent windows.
  const int32_t p = geometry_.page_size;
  std::vector<policy::HostCandidate> cand;
  for (int32_t li = 0; li < geometry_.num_layers; ++li) {
    const LayerState& c = layers_[li];
    const int32_t total = (c.tokens + p - 1) / p;
    const int32_t recent_lo = std::max(options_.sink_pages, total - options_.recent_pages);
    for (int32_t page = options_.sink_pages; page < recent_lo; ++page) {
      if (c.host.page_of_mirror[page] < 0) continue;
      cand.push_back(
          {li, page, policy::HostScore(policies_.residency.get(), li, page, geometry_.num_kv_heads),
           policy::HostPinned(policies_.residency.get(), li, page, geometry_.num_kv_heads)});
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    absl::StatusOr<size_t> victim = host_drop_->PickVictim(cand);
    if (!victim.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat(full, ": nothing left to drop (", victim.status().message(), ")"));
    }
    const policy::HostCandidate v = cand[*victim];
    cand.erase(cand.begin() + static_cast<ptrdiff_t>(*victim));
    LayerState& vl = layers_[v.layer];
    // A background recall may be reading the page: let it finish before the slot is reused.
    if (vl.recall.in_flight) KVTIER_RETURN_IF_ERROR(vl.recall.done->Wait(options_.deadline));
    KVTIER_RETURN_IF_ERROR(vl.host.pages->Erase(v.page));
    vl.host.page_of_mirror[v.page] = -1;
    if (vl.host.dropped.empty()) vl.host.dropped.assign(max_pages_, 0);
    vl.host.dropped[v.page] = 1;
    KVTIER_RETURN_IF_ERROR(Upload(*compute_, vl.host.page_of.as<int64_t>() + v.page,
                                  &vl.host.page_of_mirror[v.page], sizeof(int64_t)));
  }
  return Park(*compute_);
}

int64_t RetrieverImpl::ResidentHeadPages(const LayerState& l) const {
  if (l.ws.managed != nullptr) return l.ws.managed->resident();
  const int32_t p = geometry_.page_size;
  const int64_t hkv = geometry_.num_kv_heads;
  const int32_t total = (l.tokens + p - 1) / p;
  switch (options_.mode) {
    case RetrievalMode::kFull:
      return total * hkv;
    case RetrievalMode::kDrop:
      return std::min(total, slots_per_layer_) * hkv;
    case RetrievalMode::kSpeculative:
    case RetrievalMode::kSync:
      break;
  }
  const int32_t sinks = std::min(total, options_.sink_pages);
  const int32_t recent = std::min(total - sinks, options_.recent_pages);
  const int32_t cand = total - sinks - recent;
  int64_t selected = 0;
  for (int32_t b : l.policy.budget) selected += std::min(b, cand);
  return (sinks + recent) * hkv + selected;
}

void RetrieverImpl::FillPolicyStats(SequenceStats* st) const {
  int64_t resident = 0;
  for (const LayerState& l : layers_) resident += ResidentHeadPages(l);
  st->resident_head_pages = resident;
  st->resident_bytes = resident * geometry_.slab_elements() * static_cast<int64_t>(elem());
  int64_t selection = 0;
  for (const LayerState& l : layers_) {
    selection += static_cast<int64_t>(l.host.summaries.size() + l.host.codes.size());
  }
  st->selection_bytes = selection;
  if (host_drop_ != nullptr) {
    st->host_dropped_pages = host_drop_->dropped();
    st->host_refusals = host_drop_->refused();
  }
}

absl::Status RetrieverImpl::ReportSignals(const StepSignals& s) {
  if (closed_) return absl::FailedPreconditionError("ReportSignals: the sequence is closed");
  if (s.num_tokens < 1 || s.first_position < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ReportSignals: num_tokens = %d must be >= 1 and first_position = %d >= 0",
                        s.num_tokens, s.first_position));
  }
  if (!s.hidden_delta.empty() &&
      (s.num_layers < 1 ||
       s.hidden_delta.size() != static_cast<size_t>(s.num_tokens) * s.num_layers)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ReportSignals: hidden_delta has %d values; it must hold num_tokens × num_layers = %d × "
        "%d",
        s.hidden_delta.size(), s.num_tokens, s.num_layers));
  }
  if (!policies_on()) return absl::OkStatus();
  policies_.budget->OnSignals(s);
  if (policies_.residency != nullptr) policies_.residency->OnSignals(s);
  return absl::OkStatus();
}

absl::Status RetrieverImpl::ObserveQueries(int32_t layer, const void* q, int32_t n,
                                           int64_t first_position) {
  KVTIER_RETURN_IF_ERROR(CheckCall(layer, "ObserveQueries"));
  if (q == nullptr || n < 1 || n > 4096 || first_position < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ObserveQueries: q must be non-null, n = %d in [1, 4096] and first_position = %d >= 0", n,
        first_position));
  }
  LayerState& l = layers_[layer];
  if (l.tokens == 0 || l.in_step) {
    return absl::FailedPreconditionError(
        absl::StrFormat("ObserveQueries: layer %d must hold tokens and be outside a step", layer));
  }
  if (!reads_attention()) return absl::OkStatus();
  KVTIER_RETURN_IF_ERROR(UploadCountsIfDirty(layer));
  DeviceBuffer out;
  KVTIER_RETURN_IF_ERROR(Allocate(&out, q_bytes()));
  for (int32_t i = 0; i < n; ++i) {
    const int64_t position = first_position + i;
    KVTIER_ASSIGN_OR_RETURN(void* qpos, StageArgs(&position, sizeof(position)));
    SparseAttentionArgs a =
        AttentionArgs(l, static_cast<const uint8_t*>(q) + i * q_bytes(), out.data(), nullptr);
    a.query_position = static_cast<const int64_t*>(qpos);
    KVTIER_RETURN_IF_ERROR(backend_.SparseAttention(*compute_, a));
    KVTIER_RETURN_IF_ERROR(TakeProbe(layer, /*step=*/-1, position));
    KVTIER_RETURN_IF_ERROR(ConsumeProbe(layer));
    // Park the position's block with this query's attention, not after the window: the ring
    // takes blocks back in acquisition order, so one still unparked would hold the room of
    // every probe staged after it, and the window's probes (each of the whole working set,
    // which spans the prompt until the first step evicts it) would fill the ring.
    KVTIER_RETURN_IF_ERROR(Park(*compute_));
  }
  return absl::OkStatus();
}

}  // namespace kvtier::retriever_internal
