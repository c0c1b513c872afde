// Retriever: selection (Score → TopK → Replace → recall) and speculative mode's correction
// before attention, with either trigger (docs/architecture.md#the-decode-step). Every flag
// and selection stays on the device: the drift flags are the head mask of the ops.
#include "core/status.h"
#include "offload/retriever_impl.h"

namespace kvtier::retriever_internal {

ScorePagesArgs RetrieverImpl::ScoreArgs(LayerState& l, const void* q, const int32_t* num_pages,
                                        const uint8_t* mask, int32_t n) const {
  ScorePagesArgs sa;
  sa.shape = KvShapeOf(geometry_);
  sa.batch = n;
  sa.max_pages = max_pages_;
  sa.q = q;
  sa.summaries = l.host.summaries.data();
  sa.codes = l.host.codes.as<uint8_t>();  // null unless SummaryMode::kKeyCodes
  sa.num_pages = num_pages;
  sa.softmax_scale = scale_;
  sa.pooled = l.select.pooled.as<float>();
  sa.head_mask = mask;
  return sa;
}

TopKArgs RetrieverImpl::SelectArgs(LayerState& l, const int32_t* candidates, const uint8_t* mask,
                                   int32_t* out, int32_t n) const {
  TopKArgs ta;
  ta.shape = KvShapeOf(geometry_);
  ta.batch = n;
  ta.max_pages = max_pages_;
  ta.k = selected_pages();
  ta.pooled = l.select.pooled.as<float>();
  // Candidates end before the recent window's full pages: [sink, candidates[b]).
  ta.num_pages = candidates;
  ta.sink_pages = options_.sink_pages;
  ta.recent_pages = 0;
  ta.selected = out;
  ta.head_mask = mask;
  if (policies_on()) {
    ta.head_k = l.policy.head_k.as<int32_t>();
    ta.page_flags = l.policy.page_flags.as<uint8_t>();
  }
  return ta;
}

absl::Status RetrieverImpl::Select(Stream& s, RecallPath path, int32_t layer, const void* q,
                                   const int32_t* num_pages, const int32_t* candidates,
                                   const uint8_t* mask, bool scored, int32_t n) {
  LayerState& l = layers_[layer];
  if (selected_pages() == 0) return absl::OkStatus();
  absl::Time mark;
  KVTIER_RETURN_IF_ERROR(Lap(s, &mark, nullptr));
  if (!scored) {
    KVTIER_RETURN_IF_ERROR(backend_.ScorePages(s, ScoreArgs(l, q, num_pages, mask, n)));
  }
  KVTIER_RETURN_IF_ERROR(
      backend_.TopK(s, SelectArgs(l, candidates, mask, l.select.selected.as<int32_t>(), n)));
  ReplaceArgs ra;
  ra.shape = KvShapeOf(geometry_);
  ra.kv.num_slots = slots_per_layer_;
  ra.kv.slot_table = l.ws.table.as<int32_t>();
  ra.batch = n;
  ra.region_begin = options_.sink_pages;
  ra.k = selected_pages();
  ra.selected = l.select.selected.as<int32_t>();
  ra.host_page_of = l.host.page_of.as<int64_t>();
  ra.max_pages = max_pages_;
  ra.head_mask = mask;
  ra.items = l.select.items.as<RecallItem>();
  ra.num_misses = l.select.num_misses.as<int32_t>();
  KVTIER_RETURN_IF_ERROR(backend_.Replace(s, ra));
  KVTIER_RETURN_IF_ERROR(Lap(s, &mark, &stats_.select_us));
  KVTIER_RETURN_IF_ERROR(RecallPlan(s, path, l, n));
  return Lap(s, &mark, &stats_.recall_us);
}

absl::Status RetrieverImpl::MassDrift(Stream& s, LayerState& l, const int32_t* num_pages,
                                      const int32_t* candidates, int32_t n) {
  const size_t hkv = geometry_.num_kv_heads;
  if (selected_pages() == 0) {  // nothing is selected, so nothing can be lost
    KVTIER_RETURN_IF_ERROR(backend_.Memset(s, l.select.drifted.data(), 0, hkv * n));
    return backend_.Memset(s, l.select.lost_mass.data(), 0, hkv * n * sizeof(float));
  }
  absl::Time mark;
  KVTIER_RETURN_IF_ERROR(Lap(s, &mark, nullptr));
  // The selection q_t would make, with exactly Select's arguments, beside the stale one.
  KVTIER_RETURN_IF_ERROR(
      backend_.ScorePages(s, ScoreArgs(l, l.select.q_cur.data(), num_pages, nullptr, n)));
  KVTIER_RETURN_IF_ERROR(
      backend_.TopK(s, SelectArgs(l, candidates, nullptr, l.select.fresh.as<int32_t>(), n)));
  SelectionLossArgs la;
  la.shape = KvShapeOf(geometry_);
  la.batch = n;
  la.max_pages = max_pages_;
  la.k = selected_pages();
  la.pooled = l.select.pooled.as<float>();
  la.current = l.select.selected.as<int32_t>();
  la.fresh = l.select.fresh.as<int32_t>();
  la.threshold = options_.correction_max_loss;
  la.loss = l.select.lost_mass.as<float>();
  la.drifted = l.select.drifted.as<uint8_t>();
  KVTIER_RETURN_IF_ERROR(backend_.SelectionLoss(s, la));
  return Lap(s, &mark, &stats_.select_us);
}

absl::Status RetrieverImpl::Correct(Stream& s, RecallPath route, int32_t layer, int32_t n) {
  LayerState& l = layers_[layer];
  const bool mass = mass_trigger();
  // The group means are kept with either trigger, so the two can be compared step by step.
  QueryCosineArgs qa;
  qa.shape = KvShapeOf(geometry_);
  qa.batch = n;
  qa.q = l.select.q_cur.data();
  qa.q_prev = l.select.q_prev.data();
  qa.threshold = options_.correction_threshold;
  qa.group_mean = l.select.group_mean.as<float>();
  qa.drifted = mass ? nullptr : l.select.drifted.as<uint8_t>();
  KVTIER_RETURN_IF_ERROR(backend_.QueryCosine(s, qa));
  const int32_t* num_pages = l.ws.counts.full_pages;
  const int32_t* candidates = l.ws.counts.candidates;
  if (mass) KVTIER_RETURN_IF_ERROR(MassDrift(s, l, num_pages, candidates, n));
  // Re-select only the drifted heads, with q_t; the others keep last step's pages. The
  // correction recall is a few pages on the critical path: one fused op, no pipeline
  // hand-offs. The mass trigger scored every head with q_t already.
  return Select(s, route, layer, l.select.q_cur.data(), num_pages, candidates,
                l.select.drifted.as<uint8_t>(), /*scored=*/mass, n);
}

}  // namespace kvtier::retriever_internal
