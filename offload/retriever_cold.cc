// The Retriever's cold tier (host_drop = demote; offload/cold_pages.h): demotion of host
// pages when the host tier is full, and their promotion when a recall plan names them.
// Invariants (on top of retriever.cc's and retriever_policy.cc's):
//   - A demoted page keeps its key summaries on the backend and its host_page_of entry is
//     ColdMarker(page) (≥ every host slot): selection sees it, Replace plans it, and the host
//     rewrites the plan before any copy reads it. Only the DMA strategies read the plan on
//     the host, so demotion runs with them alone, one sequence per batch.
//   - A page leaves the host tier only once nothing may still read its slot: its offload has
//     run (CommitStored waits), its layer's background recall has completed, and no plan
//     that was made before the demotion and not yet issued can name it (layers whose plan is
//     pending keep their pages; the plan being issued keeps the slots it names).
//   - A foreground recall queued on the compute stream may still read a slot freed here:
//     the host writes a promoted page into a freed slot only after the compute stream has
//     passed the fence recorded at the demotion.
#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "offload/retriever_impl.h"

namespace kvtier::retriever_internal {
namespace {

absl::Status Prefixed(const absl::Status& st, const std::string& what) {
  return absl::Status(st.code(), what + ": " + std::string(st.message()));
}

}  // namespace

absl::Status RetrieverImpl::DemoteHostPages(int64_t n, int64_t at_least, int32_t launching,
                                            std::span<const int64_t> keep, const std::string& what) {
  // Pages are read on the host below: every offload enqueued so far must have run, and be
  // committed, so that no commit of a page can follow its withdrawal.
  KVTIER_RETURN_IF_ERROR(CommitStored(/*wait=*/true));
  const int32_t p = geometry_.page_size;
  const int64_t slots = pool_->num_slots();
  std::vector<policy::HostCandidate> cand;
  int32_t pending_layers = 0;
  for (int32_t li = 0; li < geometry_.num_layers; ++li) {
    const LayerState& c = layers_[li];
    if ((c.recall.plan_pending || c.recall.promoting) && li != launching) {
      ++pending_layers;
      continue;
    }
    const int32_t total = (c.tokens + p - 1) / p;
    const int32_t recent_lo = std::max(options_.sink_pages, total - options_.recent_pages);
    for (int32_t page = options_.sink_pages; page < recent_lo; ++page) {
      const int64_t slot = c.host.page_of_mirror[page];
      if (slot < 0 || slot >= slots) continue;  // being offloaded, or already cold
      if (std::find(keep.begin(), keep.end(), slot) != keep.end()) continue;
      cand.push_back(
          {li, page, policy::HostScore(policies_.residency.get(), li, page, geometry_.num_kv_heads),
           policy::HostPinned(policies_.residency.get(), li, page, geometry_.num_kv_heads)});
    }
  }
  const size_t page_bytes = geometry_.host_page_bytes();
  // The victims first: `at_least` of them, and up to n while unpinned candidates last.
  int64_t unpinned = std::count_if(cand.begin(), cand.end(),
                                   [](const policy::HostCandidate& c) { return !c.pinned; });
  std::vector<policy::HostCandidate> victims;
  while (static_cast<int64_t>(victims.size()) < n &&
         (static_cast<int64_t>(victims.size()) < at_least || unpinned > 0)) {
    absl::StatusOr<size_t> victim = host_drop_->PickVictim(cand);
    if (!victim.ok()) {
      const PagePoolStats ps = pool_->stats();
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: the host tier (%d pages, %d free) needs %d more free pages and no page may be "
          "demoted (sinks, recent windows, the plan being recalled and the %d layers whose "
          "plans are pending stay): %s",
          what, ps.capacity, ps.capacity - ps.in_use, at_least - victims.size(), pending_layers,
          victim.status().message()));
    }
    victims.push_back(cand[*victim]);
    cand.erase(cand.begin() + static_cast<ptrdiff_t>(*victim));
    --unpinned;
  }
  // A layer's last background recall may still be copying from its pages' slots.
  std::vector<uint8_t> waited(geometry_.num_layers, 0);
  for (const policy::HostCandidate& v : victims) {
    LayerState& vl = layers_[v.layer];
    if (waited[v.layer] != 0 || vl.recall.done == nullptr) continue;
    KVTIER_RETURN_IF_ERROR(vl.recall.done->Wait(options_.deadline));
    waited[v.layer] = 1;
  }
  // The pages the cold tier does not hold yet, written in one batch.
  std::vector<StoredPage> put;
  std::vector<std::span<const uint8_t>> bytes;
  for (const policy::HostCandidate& v : victims) {
    LayerState& vl = layers_[v.layer];
    if (vl.host.cold.empty()) vl.host.cold.assign(max_pages_, 0);
    if (vl.host.cold[v.page] != 0) continue;
    KVTIER_ASSIGN_OR_RETURN(const PageEntry e, vl.host.pages->Lookup(v.page));
    put.push_back(StoredPage{v.layer, v.page, e.slot, e.generation});
    bytes.emplace_back(static_cast<const uint8_t*>(pool_->SlotData(e.slot)), page_bytes);
  }
  if (!put.empty()) {
    if (absl::Status st = cold_->PutBatch(put, bytes); !st.ok()) {
      // Every page stays in the host tier; the caller's call fails, the sequence does not.
      return Prefixed(st, absl::StrFormat("%s: demoting %d pages to the cold tier (layer %d "
                                          "page %d first)",
                                          what, put.size(), put[0].layer, put[0].page));
    }
    for (const StoredPage& sp : put) layers_[sp.layer].host.cold[sp.page] = 1;
    stats_.cold_written_pages += static_cast<int64_t>(put.size());
  }
  // From here on a failure leaves the tiers inconsistent: it fails the Retriever.
  for (const policy::HostCandidate& v : victims) {
    LayerState& vl = layers_[v.layer];
    if (absl::Status st = host_->Withdraw(v.layer, v.page); !st.ok()) return Fail(st);
    if (absl::Status st = vl.host.pages->Erase(v.page); !st.ok()) return Fail(st);
    vl.host.page_of_mirror[v.page] = ColdMarker(v.page);
    ++stats_.host_demoted_pages;
    if (absl::Status st = Upload(*compute_, vl.host.page_of.as<int64_t>() + v.page,
                                 &vl.host.page_of_mirror[v.page], sizeof(int64_t));
        !st.ok()) {
      return Fail(st);
    }
  }
  if (!victims.empty()) {
    // Foreground recalls queued before this point may read the freed slots.
    if (demote_fence_ == nullptr) {
      KVTIER_ASSIGN_OR_RETURN(demote_fence_, backend_.CreateEvent());
    }
    if (absl::Status st = compute_->Record(*demote_fence_); !st.ok()) return Fail(st);
    fence_pending_ = true;
  }
  absl::Status st = Park(*compute_);
  return st.ok() ? st : Fail(st);
}

absl::Status RetrieverImpl::PromoteCold(int32_t layer, int32_t n) {
  LayerState& l = layers_[layer];
  RecallItem* plan = l.recall.recaller->plan();
  const int64_t slots = pool_->num_slots();
  std::vector<int64_t> keep, cold;
  for (int32_t i = 0; i < n; ++i) {
    const int64_t hp = plan[i].host_page;
    if (hp == kSkipItem) continue;
    if (hp >= 0 && hp < slots) {
      keep.push_back(hp);
      continue;
    }
    const int64_t page = hp - slots;
    if (hp < 0 || page >= max_pages_ || l.host.cold.empty() || l.host.cold[page] == 0 ||
        l.host.page_of_mirror[page] != hp) {
      return Fail(absl::InternalError(absl::StrFormat(
          "layer %d: recall plan item %d names host page %d, neither a host slot (< %d) nor a "
          "demoted page",
          layer, i, hp, slots)));
    }
    if (std::find(cold.begin(), cold.end(), page) == cold.end()) cold.push_back(page);
  }
  if (cold.empty()) return absl::OkStatus();
  // While the plan is being rewritten, promotions of other layers leave its pages alone.
  l.recall.promoting = true;
  absl::Status st = PromoteInto(layer, n, cold, keep);
  l.recall.promoting = false;
  return st;
}

absl::Status RetrieverImpl::PromoteInto(int32_t layer, int32_t n, std::span<const int64_t> cold,
                                        std::span<const int64_t> keep) {
  LayerState& l = layers_[layer];
  RecallItem* plan = l.recall.recaller->plan();
  const auto need = [&] {
    const PagePoolStats ps = pool_->stats();
    return static_cast<int64_t>(cold.size()) - (ps.capacity - ps.in_use);
  };
  if (need() > 0) {
    // Pages of layers whose plans are pending may not leave: issue those plans first (each
    // promoting its own pages), so that their pages may.
    for (int32_t li = 0; li < geometry_.num_layers; ++li) {
      const LayerState& o = layers_[li];
      if (li != layer && o.recall.plan_pending && !o.recall.promoting) {
        KVTIER_RETURN_IF_ERROR(Pump(li));
      }
    }
  }
  if (need() > 0) {
    KVTIER_RETURN_IF_ERROR(DemoteHostPages(
        need(), need(), layer, keep,
        absl::StrFormat("layer %d: promoting %d demoted pages", layer, cold.size())));
  }
  if (fence_pending_) {
    absl::Status st = demote_fence_->Wait(options_.deadline);
    if (absl::IsDeadlineExceeded(st)) {
      return Fail(absl::DeadlineExceededError(absl::StrFormat(
          "layer %d: the recalls queued before a demotion did not complete within the deadline "
          "of %s",
          layer, absl::FormatDuration(options_.deadline))));
    }
    if (!st.ok()) return Fail(st);
    fence_pending_ = false;
  }
  // A slot for each, then all of them read in one batch, then each committed and planned.
  const size_t page_bytes = geometry_.host_page_bytes();
  std::vector<PageHandle> handles;
  std::vector<ColdPages::Read> reads;
  for (const int64_t page : cold) {
    absl::StatusOr<PageHandle> h = pool_->Allocate();
    if (!h.ok()) return Fail(h.status());
    reads.push_back({layer, page, h->slot(),
                     std::span<uint8_t>(static_cast<uint8_t*>(h->data()), page_bytes)});
    handles.push_back(*std::move(h));
  }
  if (absl::Status st = cold_->GetBatch(reads); !st.ok()) {
    return Fail(Prefixed(st, absl::StrFormat("layer %d: promoting %d pages from the cold tier",
                                             layer, reads.size())));
  }
  for (size_t i = 0; i < handles.size(); ++i) {
    const int64_t page = reads[i].page;
    const int64_t slot = handles[i].slot();
    const uint64_t generation = handles[i].generation();
    if (absl::Status st = l.host.pages->Insert(page, std::move(handles[i])); !st.ok()) {
      return Fail(st);
    }
    const StoredPage sp{layer, page, slot, generation};
    if (absl::Status st = host_->Commit(std::span<const StoredPage>(&sp, 1)); !st.ok()) {
      return Fail(st);
    }
    const int64_t marker = ColdMarker(page);
    for (int32_t j = 0; j < n; ++j) {
      if (plan[j].host_page == marker) plan[j].host_page = slot;
    }
    l.host.page_of_mirror[page] = slot;
    if (absl::Status st = Upload(*compute_, l.host.page_of.as<int64_t>() + page,
                                 &l.host.page_of_mirror[page], sizeof(int64_t));
        !st.ok()) {
      return Fail(st);
    }
    ++stats_.host_promoted_pages;
  }
  absl::Status st = Park(*compute_);
  return st.ok() ? st : Fail(st);
}

}  // namespace kvtier::retriever_internal
