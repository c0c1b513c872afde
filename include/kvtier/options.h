// What a sequence is configured with: retrieval modes, key summaries and pooling, recall
// strategies, the policy set, and what the engine reports for the policies. Every default
// of the retrieval layer is written here once (kDefault*); the daemon, the C API and the
// Python client take theirs from these. Every rule is too: ResolveSequenceOptions.
//
// Value types; thread-compatible.
#ifndef KVTIER_OPTIONS_H_
#define KVTIER_OPTIONS_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier {

class Stream;  // kvtier/device.h

// FreeKV's working set: 2048 tokens per layer at p = 32, split sink 1/4 : selected 1/2 :
// recent 1/4 (16/32/16 pages).
inline constexpr int32_t kDefaultPageSize = 32;
inline constexpr int32_t kDefaultBudgetTokens = 2048;
inline constexpr int32_t kDefaultMaxTokens = 131072;        // per layer
// τ: on the project's context-trained model τ = 0.7 keeps τ = 0.9's KL from full KV and needle
// accuracy while correcting half as many heads (48 % against 99 %; docs/eval.md).
inline constexpr float kDefaultCorrectionThreshold = 0.7f;  // τ
inline constexpr float kDefaultCorrectionMaxLoss = 0.1f;    // of the selection's mass
inline constexpr absl::Duration kDefaultDeadline = absl::Seconds(30);
// The largest values ResolveSequenceOptions accepts.
inline constexpr int32_t kMaxSequenceTokens = 1 << 30;  // max_tokens, per layer
inline constexpr int32_t kMaxBudgetPages = 1 << 20;     // sink + selected + recent
inline constexpr int32_t kMaxStreamChunkItems = 65536;  // stream_chunk_items

// How a sequence keeps its working set:
//   speculative  attends over the pages selected with the previous step's query while the
//                next selection and recall run in the background; heads whose query drifted
//                (CorrectionTrigger) are re-selected and recalled before attention (FreeKV);
//   sync         selects and recalls with q_t before attention (Quest, ArkVale);
//   full         keeps every page resident (the accuracy ceiling);
//   drop         no host tier: sinks plus a sliding window (StreamingLLM), the base the
//                drop policies build on.
enum class RetrievalMode : uint8_t { kSpeculative = 0, kSync = 1, kFull = 2, kDrop = 3 };
// "speculative", "sync", "full", "drop".
std::string_view RetrievalModeName(RetrievalMode mode);

// How speculative mode decides which KV heads to correct before attention:
//   cosine  mean cos(q_t, q_{t-1}) over the query group < τ (FreeKV; correction_threshold)
//   mass    the summary-estimated attention mass of the head's stale selection falls short of
//           the selection q_t would make by more than correction_max_loss (relative)
enum class CorrectionTrigger : uint8_t { kCosine = 0, kMass = 1 };
// "cosine", "mass".
std::string_view CorrectionTriggerName(CorrectionTrigger trigger);
bool ParseCorrectionTrigger(std::string_view name, CorrectionTrigger* out);

// Which per-(page, KV head) key summary the host tier keeps.
enum class SummaryMode : uint8_t {
  kMinMax = 0,     // hi/lo = per-dim max/min of the page's keys (Quest): a true bound
  kCenterMad = 1,  // hi/lo = mean ± mean absolute deviation (ArkVale): tighter, no bound;
                   // ranks pages by their typical key, so a page whose one key the query
                   // matches (a copy's next token) does not stand out
  kKeyCodes = 2,   // the default: hi/lo = the bounds and a 4-bit code per key and
                   // dimension within them (KeyCodeLayout); a page scores by its decoded
                   // keys' share of the attention, so a small working set follows a copy
                   // and finds a needle where the summaries above do not (docs/eval.md,
                   // "Page summaries"). Costs Geometry::key_code_bytes() per page on the
                   // backend besides the summaries: a quarter of the keys at fp16
};
// "minmax", "center-mad", "key-codes".
std::string_view SummaryModeName(SummaryMode mode);
bool ParseSummaryMode(std::string_view name, SummaryMode* out);

// How recalls move pages from the host tier into the working set.
// (1 was slab_dma, one DMA per head-page slab: removed, batched_dma does its work in fewer
// copies and the step plan needs no third strategy; sequences made with it are refused.)
enum class RecallStrategy : uint8_t {
  kAuto = 0,        // the gather (kZeroCopy), or kBatchedDma where pages may be demoted
  kBatchedDma = 2,  // the slabs of a recall as batched copies, adjacent ones merged
  kZeroCopy = 3,    // a gather kernel reading pinned host memory directly
};
// "auto", "batched_dma", "zero_copy".
std::string_view RecallStrategyName(RecallStrategy strategy);
bool ParseRecallStrategy(std::string_view name, RecallStrategy* out);

// Which budget, residency and host-drop policy a sequence runs, and their parameters by
// name (docs/policies.md lists every one, its default and its range):
//   budget     fixed | confidence (Conf-KV) | xkv (per layer) | kv_compress (per head)
//   residency  none | attention | h2o | epiphany (EpiKV) | kv_compress
//   host_drop  refuse | evict | demote (to a cold tier behind the host tier)
// Parameters are "<policy>.<name>" = value, e.g. "confidence.enter_tight" = "0.75".
struct PolicyConfig {
  std::string budget = "fixed";
  std::string residency = "none";
  std::string host_drop = "refuse";
  std::map<std::string, std::string> params;

  // True when nothing but the defaults is configured.
  bool is_default() const {
    return budget == "fixed" && residency == "none" && host_drop == "refuse" && params.empty();
  }
};

// A summary of one next-token distribution (Conf-KV): what engines that do not want to hand
// over the logits report instead.
struct LogitSummary {
  float normalized_entropy = 0;  // H(p) / ln(V), in [0, 1]
  float margin = 0;              // log p(top1) − log p(top2), ≥ 0 (nats)
  float top_mass = 0;            // Σ of the top-m probabilities, in [0, 1]
};

// What the engine reports after a forward pass (all optional: a policy that needs nothing
// gets nothing). `num_tokens` tokens were processed (1 for a decode step, the prompt length
// for a prefill); positions first_position .. first_position + num_tokens − 1.
struct StepSignals {
  int64_t first_position = 0;
  int32_t num_tokens = 1;
  // Next-token logits after the last token, [vocab] (fp32), or their summary.
  std::span<const float> logits;
  std::optional<LogitSummary> logit_summary;
  // Hidden-state change per token and layer: hidden_delta[t·L + l] = ‖h_l(t) − h_l(t−1)‖ for
  // the token at first_position + t (EpiKV). Empty, or num_tokens · L values.
  std::span<const float> hidden_delta;
  int32_t num_layers = 0;  // L of hidden_delta
};

// How SetBudgetTokens splits a working set of `pages` pages (a multiple of 4; docs/eval.md,
// "The budget split"): an eighth sinks but at least one page (the attention sink); an eighth
// recent but at least two pages and at most a quarter — two pages keep a full page of local
// context in the step after a page fills, which speculative mode, selecting a step late, has
// not selected yet; of a budget of 4 pages the second would cost half the selection — and the
// rest selected. 4 pages: 1 + 2 + 1; 8: 1 + 5 + 2; 16: 2 + 12 + 2; 64: 8 + 48 + 8.
constexpr int32_t DefaultSinkPages(int32_t pages) { return std::max(1, pages / 8); }
constexpr int32_t DefaultRecentPages(int32_t pages) {
  return std::min(std::max(2, pages / 8), pages / 4);
}
inline constexpr int32_t kDefaultBudgetPages = kDefaultBudgetTokens / kDefaultPageSize;

struct SequenceOptions {
  RetrievalMode mode = RetrievalMode::kSpeculative;
  // Working-set slots per layer, in pages: SetBudgetTokens(kDefaultBudgetTokens,
  // kDefaultPageSize), 8 + 48 + 8.
  int32_t sink_pages = DefaultSinkPages(kDefaultBudgetPages);
  int32_t selected_pages = kDefaultBudgetPages - DefaultSinkPages(kDefaultBudgetPages) -
                           DefaultRecentPages(kDefaultBudgetPages);
  int32_t recent_pages = DefaultRecentPages(kDefaultBudgetPages);  // with the page being filled
  // Capacity of the sequence in tokens per layer: sizes the summaries and page maps.
  int32_t max_tokens = kDefaultMaxTokens;
  // τ: a KV head whose mean cos(q_t, q_{t-1}) over its query group is below τ is corrected
  // (speculative mode, trigger kCosine). Any finite τ: the cosine lies in [-1, 1] and the
  // test is strict, so τ ≤ -1 never corrects and τ > 1 always does (τ = 1 spares a head
  // whose query did not change). NaN and ±inf are INVALID_ARGUMENT.
  float correction_threshold = kDefaultCorrectionThreshold;
  CorrectionTrigger correction_trigger = CorrectionTrigger::kCosine;
  // Trigger kMass: a KV head is corrected when the selection q_t would make holds more than
  // this fraction of its estimated attention mass beyond what the stale selection holds
  // (loss = (mass(new) − mass(stale)) / mass(new), from the key summaries). In [0, 1]:
  // 0 corrects every head whose selection q_t would improve, 1 never corrects.
  float correction_max_loss = kDefaultCorrectionMaxLoss;
  SummaryMode summary = SummaryMode::kKeyCodes;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  // How background recalls (and sync mode's) move pages; kAuto takes the zero-copy gather
  // (measured 3.6–9.3 times faster than batched DMA on an H200 at every budget and churn,
  // docs/retriever.md#recall-strategies), or batched_dma when policy.host_drop = demote
  // (the host must see the plan to promote pages first). SequenceStats::recall_strategy says
  // which. The speculative correction recall (a few pages on the critical path) is always
  // the zero-copy gather.
  RecallStrategy recall = RecallStrategy::kAuto;
  int32_t stream_chunk_items = 64;  // head-pages per staging buffer (DMA strategies)
  // Longest a background recall or Wait() may take before the step fails with
  // DEADLINE_EXCEEDED.
  absl::Duration deadline = kDefaultDeadline;
  // The engine's compute stream (local sequences); null: the sequence creates its own.
  Stream* compute_stream = nullptr;
  // Local sequences in speculative mode recalling zero-copy, on a backend that can capture
  // streams (CUDA graphs; the cpu backend records task lists): the steady-state device work
  // of a layer-step (the drift check and correction before attention, the attention when
  // its q and out buffers stay the same, the background selection and recall after it) is
  // captured once per layer (and batch run) and launched as graphs from then on, instead of
  // ~10 launches (docs/retriever.md#graphs).
  // Ignored elsewhere and while profiling.
  bool capture_graphs = false;
  // Budget, residency and host-drop policies (docs/policies.md). The default (fixed budget,
  // no residency policy, refuse) is the behaviour of the modes above. In drop mode any
  // other policy makes the working set per-head managed: pages are evicted per KV head by
  // the residency ranking (lowest first; pinned, sink and recent pages never), the slots
  // compacted and the capacity grown (prefill) and shrunk with use.
  PolicyConfig policy;

  // Sets sink/selected/recent from a budget in tokens: DefaultSinkPages, DefaultRecentPages
  // and the rest selected (4 pages: 1 + 2 + 1; 8: 1 + 5 + 2; 16: 2 + 12 + 2; 64: 8 + 48 + 8).
  // INVALID_ARGUMENT unless the budget is a positive multiple of 4·page_size
  // ("budget_tokens = 100: must be a positive multiple of 4 pages (128 tokens at page_size
  // 32)"); every entry point that takes a budget in tokens sets it through here.
  absl::Status SetBudgetTokens(int32_t budget_tokens, int32_t page_size);
  // Splits the budget it holds (budget_pages()) another way: `sink` and `recent` pages, the
  // rest selected; ResolveSequenceOptions judges the result (the selection not negative).
  // What the service entry points (the protocol, the C API, the clients) carry next to a
  // budget in tokens. INVALID_ARGUMENT, with the resolver's message, when sink < 0 or
  // recent < 1, and when a part lies past kMaxBudgetPages.
  absl::Status SplitBudget(int64_t sink, int64_t recent);
  int32_t budget_pages() const { return sink_pages + selected_pages + recent_pages; }
};

// The one resolver of SequenceOptions (docs/architecture.md#options-are-resolved-once):
// turns what a caller gave, for a sequence whose pages hold `page_size` tokens, into what
// runs. Every entry point calls it — NewLocalSequence and every Retriever, the C++ client
// (and through it the C API) before it sends, kvtierd once it has converted OpenSession's
// retrieval options — so each accepts the same options and refuses the others with the
// same INVALID_ARGUMENT and message: the first violated option, its value and the rule,
// e.g. "correction_max_loss = -0.5: must be in [0, 1] (...)". The rules:
//   mode                  one of RetrievalMode
//   max_tokens            in [1, kMaxSequenceTokens]
//   sink/selected_pages   >= 0; recent_pages >= 1 (it holds the page being filled)
//   the budget            at most kMaxBudgetPages (not in mode full, which holds every
//                         page); in speculative and sync modes selected_pages at most the
//                         ceil(max_tokens / page_size) pages a layer holds
//   correction_threshold  finite (see the field)
//   correction_trigger    one of CorrectionTrigger
//   correction_max_loss   in [0, 1]
//   summary               one of SummaryMode
//   softmax_scale         finite and >= 0
//   stream_chunk_items    in [1, kMaxStreamChunkItems]
//   deadline              positive
// The policies are checked by their own registry when the sequence is built
// (docs/policies.md). Today the options that run are those given: nothing is clamped or
// filled in (a service's zero values are its own, resolved before it calls this).
// Idempotent. REQUIRES: page_size >= 1 (a validated Geometry's).
absl::StatusOr<SequenceOptions> ResolveSequenceOptions(const SequenceOptions& given,
                                                       int32_t page_size);

}  // namespace kvtier

#endif  // KVTIER_OPTIONS_H_
